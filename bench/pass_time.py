"""Stock llama.cpp's time per generated token (one-token decode passes) for each GGUF given, and with
``--split`` that split model's own one-token passes (a drafting pass: the base alone in the split's
context; a verify pass: base + residual), all in one process, round-robin token by token so that a
shared machine's drift hits each alike: what a drafting pass costs against a stock model's token.

    python bench/pass_time.py base.gguf model-Q8_0.gguf [...] [--split SPLIT_DIR] [--threads 2] [--tokens 30]

Loads each GGUF as a plain ``llama_cpp.Llama`` with its defaults (what a user of stock
llama-cpp-python gets) and the split as ``SplitModel`` with its defaults (batch-invariant
verification, the policy's kernel families; a one-token drafting pass is ggml's wherever the native
drafter starts at more tokens); the median over the passes after 5 warm-up passes.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("models", type=Path, nargs="*")
    ap.add_argument("--split", type=Path, default=None, help="a split model directory: time its drafting and "
                                                             "verify passes too")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=30)
    a = ap.parse_args()
    if a.tokens < 6 or a.threads < 1:
        ap.error("--tokens must be at least 6 and --threads at least 1")
    if not a.models and a.split is None:
        ap.error("give at least one GGUF file or --split")
    for m in a.models:
        if not m.is_file():
            ap.error(f"{m}: model file not found")
    if a.split is not None and not (a.split / "residual.gguf").is_file():
        ap.error(f"{a.split}: not a split model directory (no residual.gguf)")
    from bitsplit_llama.runtime.stock import stock_llama

    prompt_text = b"def quicksort(arr):"
    runners: list[tuple[str, object]] = []  # (label, one-token pass taking the token index)
    closers = []
    try:
        for m in a.models:
            llm = stock_llama(m, n_ctx=512, n_threads=a.threads)
            closers.append(llm.close)
            llm.eval(llm.tokenize(prompt_text))
            runners.append((m.name, lambda i, llm=llm: llm.eval([100 + i])))
        if a.split is not None:
            from bitsplit_llama.runtime.verifier import SplitModel

            sm = SplitModel(a.split, n_ctx=512, n_threads=a.threads)
            closers.append(sm.close)
            prompt = sm.model.tokenize(prompt_text.decode())
            with sm.verifying():
                sm.ctx.decode(prompt, list(range(len(prompt))), logits=False)
            pos = len(prompt)

            def split_pass(i: int, verify: bool) -> None:
                # one token at the next position, then dropped again: the cache stays the prompt's
                with sm.verifying() if verify else sm.drafting():
                    sm.ctx.decode([100 + i], [pos])
                    sm.ctx.logits_ith(0)
                sm.ctx.seq_rm(0, pos)

            runners.append((f"{a.split.name} drafting pass (base alone)", lambda i: split_pass(i, False)))
            runners.append((f"{a.split.name} verify pass", lambda i: split_pass(i, True)))
        times: dict[str, list[float]] = {label: [] for label, _ in runners}
        for i in range(a.tokens):
            for label, run in runners:
                t0 = time.perf_counter()
                run(i)
                times[label].append(time.perf_counter() - t0)
        for label, ts in times.items():
            print(f"{label}: {1000 * statistics.median(ts[5:]):.1f} ms/token ({a.threads} threads, median of "
                  f"{len(ts) - 5})", flush=True)
    finally:
        for close in reversed(closers):
            close()


if __name__ == "__main__":
    sys.exit(main())
