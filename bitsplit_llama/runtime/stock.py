"""Stock llama-cpp-python, as a user would run it: ``llama_cpp.Llama`` on one GGUF, with nothing of
ours loaded into it (the stock side of the demo and the bench, tests and bench scripts that need
plain llama.cpp behaviour).

One change, made here and nowhere else: prompts are fed one token per ``llama_decode``
(``n_batch=1``). llama-cpp-python 0.3.36 built with GCC 12 and -march=native on an AMX CPU crashes
(SIGILL) in llama.cpp's AMX matmul whenever a batch holds more than one token: GCC drops the stores
that fill the tile configuration before ``ldtilecfg``. Batch-1 decoding takes the AVX512-VNNI path
and works; generation is one token per step anyway.
"""

from __future__ import annotations

import os


def stock_llama(path: str | os.PathLike[str], n_ctx: int = 256, **kw):
    """``llama_cpp.Llama(path)`` with one token per batch (see the module doc); ``kw`` go to Llama."""
    from llama_cpp import Llama

    kw.setdefault("verbose", False)
    return Llama(model_path=str(path), n_ctx=n_ctx, n_batch=1, n_ubatch=1, **kw)

