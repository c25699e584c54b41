"""The public faces of a split model: ``BitsplitLlama`` (a ``llama_cpp.Llama`` subclass) and the
OpenAI-compatible HTTP server over it."""
