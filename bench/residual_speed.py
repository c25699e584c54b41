"""Speed of the verifier's weight products: one whole pass over every weight that has a residual,
for batches of 1, 4, 8, 16, 32 columns, and the bytes read per second against this machine's
memory bandwidth measured in the same run (a multi-threaded numpy reduction over 1 GiB).

    python bench/residual_speed.py SPLIT_DIR [--batches 1,4,8,16,32] [--repeat 5] [--threads N]
                                   [--kernel FAMILY[,FAMILY...]] [--residual-only] [--json]

--kernel takes one family or several (e.g. generic,avx2-f32): several are measured in one run,
interleaved pass by pass, so that their ratio is not skewed by drift on a shared machine.

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
    kernels = a.kernel.split(",") if a.kernel else [None]
    for k in kernels:  # refuse a family this CPU cannot run before measuring anything
        r.set_kernel(k)
    names = [(n, ne) for n, ne, _, _ in r.tensors() if ne[2] == 1 and ne[3] == 1]
    rng = np.random.default_rng(0)
    xs = {b: {n: rng.standard_normal((b, ne[0])).astype(np.float32) for n, ne in names} for b in batches}
    with_base = not a.residual_only

    def one_pass(k: str | None, b: int) -> tuple[float, int]:
        # a pinned family serves passes up to 32 columns; larger ones follow the policy unless
        # BITSPLIT_KERNEL pins it for every size
        r.set_kernel(k) if k else r.choose_decode_kernel(b)
        r.reset_counters()
        t0 = time.perf_counter()
        for n, _ in names:
            r.matmul(n, xs[b][n], with_base=with_base)
        dt = time.perf_counter() - t0
        c = r.counters()
        return dt, c.bytes_residual + c.bytes_base

    for k in kernels:  # warm the page cache and the scratch buffers
        for b in batches:
            one_pass(k, b)
    times: dict[tuple, list[float]] = {(k, b): [] for k in kernels for b in batches}
    nbytes = {}
    bw = []
    for _ in range(a.repeat):
        bw.append(memory_bandwidth(threads, 0.5, 1))
        for b in batches:
            for k in kernels:
                dt, nb = one_pass(k, b)
                times[(k, b)].append(dt)
                nbytes[b] = nb
    bandwidth = statistics.median(bw)
    results = []
    for k in kernels:
        rows = []
        t1 = statistics.median(times[(k, batches[0])])
        for b in batches:
            t = statistics.median(times[(k, b)])
            rows.append({"batch": b, "ms": round(1000 * t, 2), "ratio_vs_first": round(t / t1, 3),
                         "gb_per_s": round(nbytes[b] / t / 1e9, 2),
                         "bandwidth_use": round(nbytes[b] / t / bandwidth, 3)})
        r.set_kernel(k) if k else r.choose_decode_kernel(batches[0])
        results.append({"kernel": r.kernel if k else "policy", "rows": rows})
    out = {"split": str(a.split), "threads": threads, "with_base": with_base, "tensors": len(names),
           "bytes_per_pass": nbytes[batches[0]], "memory_gb_per_s": round(bandwidth / 1e9, 2), "kernels": results}
    if a.json:
        print(json.dumps(out))
        return
    print(f"{a.split}: {len(names)} tensors, {nbytes[batches[0]] / 1e9:.3f} GB per pass "
          f"({'W2 + R' if with_base else 'R only'}), {threads} threads; "
          f"memory bandwidth (numpy reduction) {bandwidth / 1e9:.1f} GB/s; medians of {a.repeat}")
    print(f"{'kernel':>12} {'batch':>5} {'ms/pass':>9} {'x batch 1':>9} {'GB/s':>7} {'of bandwidth':>12}")
    for res in results:
        for row in res["rows"]:
            print(f"{res['kernel']:>12} {row['batch']:5d} {row['ms']:9.2f} {row['ratio_vs_first']:9.2f} "
                  f"{row['gb_per_s']:7.2f} {100 * row['bandwidth_use']:11.1f}%")
    if len(results) > 1:
        base = results[0]
        for res in results[1:]:
            ratios = ", ".join(f"batch {a_['batch']}: {b_['ms'] / a_['ms']:.3f}" for a_, b_ in zip(base["rows"], res["rows"]))
            print(f"time {res['kernel']} / {base['kernel']}: {ratios}")


if __name__ == "__main__":
    main()
