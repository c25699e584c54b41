"""Stock llama-cpp-python, as a user would run it, for tests that need plain llama.cpp behaviour.

llama-cpp-python 0.3.36 built with GCC 12 and -march=native on an AMX CPU crashes (SIGILL) in
llama.cpp's AMX matmul whenever a batch holds more than one token: GCC drops the stores that fill
the tile configuration before ``ldtilecfg``. Batch-1 decoding takes the AVX512-VNNI path and works,
so these helpers decode one token per ``llama_decode`` (``n_batch=1``); nothing else is changed.
"""

from __future__ import annotations

from pathlib import Path


def stock_llama(path: Path, n_ctx: int = 256, **kw):
    from llama_cpp import Llama

    return Llama(model_path=str(path), n_ctx=n_ctx, n_batch=1, n_ubatch=1, verbose=False, **kw)
