"""Plain generation with stock llama-cpp-python from one GGUF (used by the demo to show that the
base is an ordinary model that llama.cpp loads without anything of ours)."""

from __future__ import annotations

from pathlib import Path


def generate_with_base(path: Path, prompt: str, n_predict: int, n_ctx: int = 512, seed: int = 0) -> str:
    from llama_cpp import Llama

    # n_batch=1: see tests/stock.py (llama.cpp AMX crash on batches with this build)
    llm = Llama(model_path=str(path), n_ctx=n_ctx, n_batch=1, n_ubatch=1, verbose=False, seed=seed)
    try:
        out = llm.create_completion(prompt, max_tokens=n_predict, temperature=0.0)
        return out["choices"][0]["text"]
    finally:
        llm.close()
