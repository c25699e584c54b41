"""What measures and prepares rather than generates: the bench against stock llama.cpp, the
quality eval (KL, top-1, perplexity), the hardware plan, model fetching, progress display."""
