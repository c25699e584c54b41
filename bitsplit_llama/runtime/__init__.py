"""llama.cpp at run time: owning wrappers over llama-cpp-python's low-level API (model, context,
batch; the only place that calls it), the split model (one context over base.gguf whose eval
callback is the native residual), and stock ``llama_cpp.Llama`` as users run it (comparisons)."""
