"""The fixed cost of one residual product on the library's thread pool (add mode's R . x, and
bitsplit_ctx_matmul): small products, where the bytes take microseconds and what remains is waking
the pool's threads and waiting for the last one.

    python bench/pool_overhead.py SPLIT [--threads 1,2,4] [--cols 1] [--calls 200] [--rounds 5]

For each thread count, the median time per product over ``--calls`` products (each of the split's
smallest residual tensors in turn), in interleaved rounds, and the median over rounds; next to it
the time the same bytes take at the memory bandwidth measured in the same run. The first GPU run
(an H200 machine, 16 threads) spent ~2 ms per add-mode product of a few hundred KB.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("split", type=Path)
    ap.add_argument("--threads", default="1,2,4", help="thread counts (comma-separated)")
    ap.add_argument("--cols", type=int, default=1, help="columns per product")
    ap.add_argument("--calls", type=int, default=200, help="products per timing")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds")
    ap.add_argument("--tensors", type=int, default=4, help="how many of the smallest residual tensors")
    args = ap.parse_args(argv)
    try:
        threads = [int(t) for t in args.threads.split(",")]
    except ValueError:
        ap.error(f"--threads: '{args.threads}' is not a comma-separated list of integers")
    if min(threads) < 1 or args.cols < 1 or args.calls < 1 or args.rounds < 1 or args.tensors < 1:
        ap.error("--threads, --cols, --calls, --rounds and --tensors must be positive")

    import llama_cpp  # noqa: F401  (llama.cpp's libraries before anything else: see the README)

    from bitsplit_llama.native.residual import Residual
    from bitsplit_llama.tools.bench import memory_bandwidth

    res = Residual(args.split)
    try:
        from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

        def nbytes_of(ne: tuple[int, ...], rtype: int) -> int:
            block, size = GGML_QUANT_SIZES[GGMLQuantizationType(rtype)]
            return ne[0] * ne[1] // block * size

        plain = [(name, ne, nbytes_of(ne, rt)) for name, ne, _, rt in res.tensors() if ne[2] == 1 and ne[3] == 1]
        plain.sort(key=lambda t: t[2])  # by residual bytes
        picked = plain[: args.tensors]
        if not picked:
            print(f"{args.split}: no 2-D residual tensor", file=sys.stderr)
            return 1
        rng = np.random.default_rng(0)
        xs = {name: rng.standard_normal((args.cols, ne[0]), dtype=np.float32) for name, ne, _ in picked}
        nbytes = statistics.mean(t[2] for t in picked)
        per: dict[int, list[float]] = {n: [] for n in threads}
        for _ in range(args.rounds):
            for n in threads:
                res.set_threads(n)
                for name, *_ in picked:  # warm-up: the pool exists, the pages are mapped
                    res.matmul(name, xs[name], with_base=False)
                t0 = time.perf_counter()
                for i in range(args.calls):
                    name = picked[i % len(picked)][0]
                    res.matmul(name, xs[name], with_base=False)
                per[n].append((time.perf_counter() - t0) / args.calls)
        bw = statistics.median(memory_bandwidth(max(threads), 0.25, 1) for _ in range(3))
    finally:
        res.close()
    out = {"split": str(args.split), "tensors": [t[0] for t in picked], "mean_residual_bytes": nbytes,
           "cols": args.cols, "memory_bandwidth_gb_s": round(bw / 1e9, 2),
           "bytes_at_bandwidth_us": round(nbytes / bw * 1e6, 1),
           "us_per_product": {n: round(statistics.median(v) * 1e6, 1) for n, v in per.items()}}
    for n, v in per.items():
        print(f"threads {n:3d}: {statistics.median(v) * 1e6:9.1f} us per product "
              f"(rounds: {', '.join(f'{x * 1e6:.0f}' for x in v)})")
    print(f"the bytes alone at {bw / 1e9:.1f} GB/s: {nbytes / bw * 1e6:.1f} us ({nbytes / 1e3:.0f} KB per product)")
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
