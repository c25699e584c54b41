"""C sources of the native library (built on first use by bitsplit_llama.native)."""
