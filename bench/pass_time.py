"""Stock llama.cpp's time per generated token (one-token decode passes) for each GGUF given, and with
``--split`` that split model's own one-token passes (a drafting pass: the base alone in the split's
context; a verify pass: base + residual), all in one process, round-robin token by token so that a
shared machine's drift hits each alike: what a drafting pass costs against a stock model's token.

    python bench/pass_time.py base.gguf model-Q8_0.gguf [...] [--split SPLIT_DIR] [--rows 1,2] [--stock-rows 2,3]
                              [--threads 2] [--tokens 30]

Loads each GGUF as a plain ``llama_cpp.Llama`` with its defaults (what a user of stock
llama-cpp-python gets) and the split as ``SplitModel`` with its defaults (batch-invariant
verification, the policy's kernel families; a one-token drafting pass is ggml's wherever the native
drafter starts at more tokens); the median over the passes after 5 warm-up passes. ``--rows``: verify
passes of that many tokens too (a tree of rows - 1 drafted nodes after the pending token; the
speculative loop's 1-node chain verifies 2). ``--stock-rows``: each stock model's passes of that many
tokens too, with logits for every one (as a verify pass computes them): what verifying as many
tokens would cost a speculative decoder whose verifier is that stock model itself, a bound for the
split's verify pass on the same machine. Each line also gives the weight bytes a pass reads
(every tensor but the token embedding, which is read a row at a time, unless it is also the output
head) and that over the time: how close each pass comes to the memory's rate.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path


def weight_bytes(*paths: Path) -> int:
    """The bytes of the weights one pass reads over these GGUF files (a model, or a split's base then
    its residual): every tensor but the token embedding (a row per token), unless the first file
    stores no output head (tied: the head is the embedding, read whole)."""
    from gguf import GGUFReader

    files = [GGUFReader(path).tensors for path in paths]
    tied = not any(t.name == "output.weight" for t in files[0])
    return sum(int(t.n_bytes) for tensors in files for t in tensors if t.name != "token_embd.weight" or tied)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("models", type=Path, nargs="*")
    ap.add_argument("--split", type=Path, default=None, help="a split model directory: time its drafting and "
                                                             "verify passes too")
    ap.add_argument("--rows", default="1", help="verify passes of these numbers of tokens, comma-separated "
                                                "(default 1)")
    ap.add_argument("--stock-rows", default="", help="each stock model's passes of these numbers of tokens too "
                                                     "(2 or more, comma-separated), logits for every token")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=30)
    a = ap.parse_args()
    if a.tokens < 6 or a.threads < 1:
        ap.error("--tokens must be at least 6 and --threads at least 1")
    if not a.models and a.split is None:
        ap.error("give at least one GGUF file or --split")
    try:
        rows = sorted({int(r) for r in a.rows.split(",")})
    except ValueError:
        ap.error(f"--rows {a.rows!r}: expected numbers of tokens separated by commas, e.g. 1,2,4")
    if not 1 <= rows[0] <= rows[-1] <= 64:
        ap.error(f"--rows {a.rows!r}: each must be between 1 and 64")
    try:
        stock_rows = sorted({int(r) for r in a.stock_rows.split(",")}) if a.stock_rows.strip() else []
    except ValueError:
        ap.error(f"--stock-rows {a.stock_rows!r}: expected numbers of tokens separated by commas, e.g. 2,3")
    if stock_rows and not 2 <= stock_rows[0] <= stock_rows[-1] <= 64:
        ap.error(f"--stock-rows {a.stock_rows!r}: each must be between 2 and 64 (one token is the stock pass itself)")
    if stock_rows and not a.models:
        ap.error("--stock-rows needs at least one GGUF file")
    for m in a.models:
        if not m.is_file():
            ap.error(f"{m}: model file not found")
    if a.split is not None and not (a.split / "residual.gguf").is_file():
        ap.error(f"{a.split}: not a split model directory (no residual.gguf)")
    from bitsplit_llama.runtime.stock import stock_llama

    prompt_text = b"def quicksort(arr):"
    runners: list[tuple[str, object, int]] = []  # (label, pass taking the token index, weight bytes)
    closers = []
    try:
        for m in a.models:
            llm = stock_llama(m, n_ctx=512, n_threads=a.threads)
            closers.append(llm.close)
            llm.eval(llm.tokenize(prompt_text))
            wb = weight_bytes(m)
            runners.append((m.name, lambda i, llm=llm: llm.eval([100 + i]), wb))
            if stock_rows:
                from llama_cpp import Llama

                # batches of up to max(stock_rows) tokens, logits for each; the cache is cut back to the
                # prompt before every pass (eval drops what lies past n_tokens)
                big = Llama(model_path=str(m), n_ctx=512, n_batch=stock_rows[-1], n_ubatch=stock_rows[-1],
                            n_threads=a.threads, logits_all=True, verbose=False)
                closers.append(big.close)
                big.eval(big.tokenize(prompt_text))
                plen = big.n_tokens

                def stock_pass(i: int, n: int, big=big, plen=plen) -> None:
                    big.n_tokens = plen
                    big.eval([100 + i + j for j in range(n)])

                for n in stock_rows:
                    runners.append((f"{m.name}, {n} tokens", lambda i, n=n, f=stock_pass: f(i, n), wb))
        if a.split is not None:
            from bitsplit_llama.runtime.verifier import SplitModel

            sm = SplitModel(a.split, n_ctx=512, n_threads=a.threads)
            closers.append(sm.close)
            prompt = sm.model.tokenize(prompt_text.decode())
            with sm.verifying():
                sm.ctx.decode(prompt, list(range(len(prompt))), logits=False)
            pos = len(prompt)

            def split_pass(i: int, verify: bool, n: int = 1) -> None:
                # n tokens at the next positions, then dropped again: the cache stays the prompt's
                with sm.verifying() if verify else sm.drafting():
                    sm.ctx.decode([100 + i + j for j in range(n)], list(range(pos, pos + n)), logits=True)
                    sm.ctx.logits_ith(n - 1)
                sm.ctx.seq_rm(0, pos)

            base = a.split / "base.gguf"
            runners.append((f"{a.split.name} drafting pass (base alone)", lambda i: split_pass(i, False),
                            weight_bytes(base)))
            both = weight_bytes(base, a.split / "residual.gguf")
            for n in rows:
                label = f"{a.split.name} verify pass" + (f", {n} tokens" if n > 1 else "")
                runners.append((label, lambda i, n=n: split_pass(i, True, n), both))
        times: dict[str, list[float]] = {label: [] for label, _, _ in runners}
        for i in range(a.tokens):
            for label, run, _ in runners:
                t0 = time.perf_counter()
                run(i)
                times[label].append(time.perf_counter() - t0)
        for label, _, nbytes in runners:
            t = statistics.median(times[label][5:])
            print(f"{label}: {1000 * t:.1f} ms per pass ({a.threads} threads, median of {len(times[label]) - 5}); "
                  f"{nbytes / 1e9:.2f} GB of weights, {nbytes / t / 1e9:.1f} GB/s", flush=True)
    finally:
        for close in reversed(closers):
            close()


if __name__ == "__main__":
    sys.exit(main())
