"""Drafting pass time (residual off): llama.cpp's own kernels against the native fast drafter, for
batches of 1 to 4 tokens, interleaved in one process; medians and the ratio.

    python bench/draft_speed.py SPLIT_DIR [--repeat 7] [--threads N]

The native library takes a drafting product only where its integer kernel is the faster one
(``bitsplit_draft_min_cols``: from 1 column with the 256-bit integer families, 2 with vnni-int24);
below that both rows time llama.cpp's kernel. The native drafter's passes have the draft vocabulary
(``--draft-vocab auto``) where the head is exact, llama.cpp's the whole head.
"""

from __future__ import annotations

import argparse
import statistics
import time

from bitsplit_llama.runtime.verifier import SplitModel

BATCHES = (1, 2, 3, 4)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("split")
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--threads", type=int, default=None)
    a = ap.parse_args()
    models = {name: SplitModel(a.split, n_ctx=256, n_batch=64, n_seq_max=4, n_threads=a.threads, fast_drafter=fast)
              for name, fast in (("llama.cpp", False), ("native", True))}
    prompt = models["native"].model.tokenize("def quicksort(arr):\n    if len(arr) <= 1:\n        return arr\n")
    P = len(prompt)
    for sm in models.values():
        with sm.drafting() as ctx:
            ctx.decode(prompt, list(range(P)))
    times: dict[tuple[str, int], list[float]] = {(n, b): [] for n in models for b in BATCHES}
    for _ in range(a.repeat):
        for b in BATCHES:
            for name, sm in models.items():
                with sm.drafting() as ctx:
                    t0 = time.perf_counter()
                    ctx.decode(prompt[:b], list(range(P, P + b)), logits=True)
                    times[(name, b)].append(time.perf_counter() - t0)
                    ctx.seq_rm(0, P)
    print(f"{a.split}: drafting pass, median of {a.repeat}")
    for b in BATCHES:
        x, y = statistics.median(times[("llama.cpp", b)]), statistics.median(times[("native", b)])
        print(f"batch {b}: llama.cpp {1000 * x:7.1f} ms   native drafter {1000 * y:7.1f} ms   ratio {y / x:.2f}")
    n = models["native"].residual.counters().n_draft_products
    print(f"products computed by the native drafter: {n}")
    for sm in models.values():
        sm.close()


if __name__ == "__main__":
    main()
