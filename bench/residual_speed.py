"""Speed of the verifier's weight products: one whole pass over every weight that has a residual,
for batches of 1, 4, 8, 16, 32 columns, and the bytes read per second against this machine's
memory bandwidth measured in the same run (a multi-threaded numpy reduction over 1 GiB).

    python bench/residual_speed.py SPLIT_DIR [--batches 1,4,8,16,32] [--repeat 5] [--threads N]
                                   [--kernel amx-bf16|avx512-bf16|generic] [--residual-only] [--json]

"pass" = the products (W2 + R) . x of all 2-D residual tensors, as the callback computes them in a
verifier pass (``--residual-only``: R . x alone, the CPU half of the GPU configuration). Medians of
--repeat runs; passes of different batch sizes are interleaved so that drift cancels.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np

from bitsplit_llama.native.residual import Residual


from bitsplit_llama.tools.bench import memory_bandwidth  # threaded numpy max-reduce over 1 GiB


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("split", type=Path)
    ap.add_argument("--batches", default="1,4,8,16,32")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--kernel", default=None)
    ap.add_argument("--residual-only", action="store_true")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    from bitsplit_llama.runtime.llamacpp import default_threads

    threads = a.threads or default_threads()
    batches = [int(b) for b in a.batches.split(",")]
    r = Residual(a.split)
    r.set_threads(threads)
    if a.kernel:
        r.set_kernel(a.kernel)
    names = [(n, ne) for n, ne, _, _ in r.tensors() if ne[2] == 1 and ne[3] == 1]
    rng = np.random.default_rng(0)
    xs = {b: {n: rng.standard_normal((b, ne[0])).astype(np.float32) for n, ne in names} for b in batches}
    with_base = not a.residual_only

    def one_pass(b: int) -> tuple[float, int]:
        r.reset_counters()
        t0 = time.perf_counter()
        for n, _ in names:
            r.matmul(n, xs[b][n], with_base=with_base)
        dt = time.perf_counter() - t0
        c = r.counters()
        return dt, c.bytes_residual + c.bytes_base

    for b in batches:  # warm the page cache and the scratch buffers
        one_pass(b)
    times: dict[int, list[float]] = {b: [] for b in batches}
    nbytes = {}
    bw = []
    for _ in range(a.repeat):
        bw.append(memory_bandwidth(threads, 0.5, 1))
        for b in batches:
            dt, nb = one_pass(b)
            times[b].append(dt)
            nbytes[b] = nb
    bandwidth = statistics.median(bw)
    rows = []
    t1 = statistics.median(times[batches[0]])
    for b in batches:
        t = statistics.median(times[b])
        rows.append({"batch": b, "ms": round(1000 * t, 2), "ratio_vs_first": round(t / t1, 3),
                     "gb_per_s": round(nbytes[b] / t / 1e9, 2), "bandwidth_use": round(nbytes[b] / t / bandwidth, 3)})
    out = {"split": str(a.split), "kernel": r.kernel, "threads": threads, "with_base": with_base,
           "tensors": len(names), "bytes_per_pass": nbytes[batches[0]], "memory_gb_per_s": round(bandwidth / 1e9, 2),
           "rows": rows}
    if a.json:
        print(json.dumps(out))
        return
    print(f"{a.split}: {len(names)} tensors, {nbytes[batches[0]] / 1e9:.3f} GB per pass "
          f"({'W2 + R' if with_base else 'R only'}), kernel {r.kernel}, {threads} threads; "
          f"memory bandwidth (numpy reduction) {bandwidth / 1e9:.1f} GB/s")
    print(f"{'batch':>5} {'ms/pass':>9} {'x batch 1':>9} {'GB/s':>7} {'of bandwidth':>12}")
    for row in rows:
        print(f"{row['batch']:5d} {row['ms']:9.2f} {row['ratio_vs_first']:9.2f} {row['gb_per_s']:7.2f} "
              f"{100 * row['bandwidth_use']:11.1f}%")


if __name__ == "__main__":
    main()
