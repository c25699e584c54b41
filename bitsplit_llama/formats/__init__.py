"""Files on disk: the GGUF reader/writer, a split model directory (base.gguf + residual.gguf,
checked together), the split itself (source GGUF -> Q2_K base + residual), llama.cpp's quantizer in
a child process, importance matrices, and the few ggml functions the split calls through ctypes."""
