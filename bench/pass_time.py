"""Stock llama.cpp's time per generated token (one-token decode passes) for each GGUF given, in one
process, one after the other: what a drafting pass (base.gguf) costs against a stock model's token.

    python bench/pass_time.py base.gguf model-Q8_0.gguf [...] [--threads 2] [--tokens 30]

Loads each model as a plain ``llama_cpp.Llama`` with its defaults (what a user of stock
llama-cpp-python gets); the median over the passes after 5 warm-up passes.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("models", type=Path, nargs="+")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=30)
    a = ap.parse_args()
    if a.tokens < 6 or a.threads < 1:
        ap.error("--tokens must be at least 6 and --threads at least 1")
    for m in a.models:
        if not m.is_file():
            ap.error(f"{m}: model file not found")
    from bitsplit_llama.runtime.stock import stock_llama

    for m in a.models:
        llm = stock_llama(m, n_ctx=512, n_threads=a.threads)
        try:
            llm.eval(llm.tokenize(b"def quicksort(arr):"))
            ts = []
            for i in range(a.tokens):
                t0 = time.perf_counter()
                llm.eval([100 + i])
                ts.append(time.perf_counter() - t0)
            print(f"{m.name}: {1000 * statistics.median(ts[5:]):.1f} ms/token "
                  f"({a.threads} threads, median of {len(ts) - 5})", flush=True)
        finally:
            llm.close()


if __name__ == "__main__":
    sys.exit(main())
