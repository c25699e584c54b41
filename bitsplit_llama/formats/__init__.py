"""Files on disk: the GGUF reader/writer, a split model directory (base.gguf + residual.gguf,
checked together), the split itself (source GGUF -> Q2_K base + residual), llama.cpp's quantizer in
a child process, importance matrices, the acceptance profile, and the one module that calls ggml
(cffi declarations read from the installed headers)."""
