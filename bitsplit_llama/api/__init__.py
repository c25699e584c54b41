"""The public faces of a split model: ``BitsplitLlama`` (a ``llama_cpp.Llama`` subclass) and the
OpenAI-compatible HTTP server over it."""

# The server's defaults, stated once (here, where ``bitsplit serve`` reads them without loading the
# server's own imports)
DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000
DEFAULT_QUEUE = 8          # requests that may wait for the model; more get 503
DEFAULT_WAIT_S = 300.0     # seconds a request may wait; then 503
