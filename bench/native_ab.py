"""Two builds of the native library side by side in one process: the time of the verifier's weight
products (one pass over every 2-D weight with a residual, W2 + R) with library A and with library B,
interleaved pass by pass (A, B then B, A), so that a shared machine's drift hits both alike.

    python bench/native_ab.py LIB_A LIB_B SPLIT_DIR [--batches 1,2,4] [--rounds 8] [--threads N]
                              [--only NAME_PART] [--kernel FAMILY] [--kernel-b FAMILY] [--residual-only]
                              [--act-bits auto|16|8]

LIB_A / LIB_B: libbitsplit.so files, e.g. the path `bitsplit build-native` prints in each of two
checkouts (or a path under ~/.cache/bitsplit-llama/native/). Prints per batch the best and median
pass time of each and the median of the per-pair ratios B/A; also checks that both give the same
results bit for bit (a speed change should not change arithmetic unless it says so).

Separate processes on these machines differ by 1.5x from one minute to the next; in one process
the ratio holds to a few percent.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np


def _residual(lib: Path, split: Path, threads: int, act_bits: str):
    from bitsplit_llama.native import build
    from bitsplit_llama.native.residual import Residual

    real = build.build
    build.build = lambda *a, **k: lib  # load() asks build() for the path
    build.load.cache_clear()
    try:
        r = Residual(split)
    finally:
        build.build = real
        build.load.cache_clear()
    r.set_threads(threads)
    r.set_act_bits(act_bits)
    return r


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("lib_a", type=Path)
    ap.add_argument("lib_b", type=Path)
    ap.add_argument("split", type=Path)
    ap.add_argument("--batches", default="1,2,4")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--only", default="", help="only the weights whose name contains this")
    ap.add_argument("--residual-only", action="store_true", help="R . x alone (the CPU's half when the base "
                    "is on a GPU) instead of (W2 + R) . x")
    ap.add_argument("--kernel", default=None, help="pin this family in both (default: the policy's per batch)")
    ap.add_argument("--kernel-b", default=None, help="pin this family in B instead (a change against another "
                                                     "family's arithmetic; the results then differ)")
    ap.add_argument("--act-bits", default="auto", help="the verifier's activation bits in both (auto, 16 or 8; "
                                                       "the int16 families' W2 + R)")
    a = ap.parse_args()
    from bitsplit_llama.native.residual import check_act_bits

    try:
        check_act_bits(a.act_bits)
    except ValueError as e:
        raise SystemExit(str(e)) from None
    from bitsplit_llama.runtime.llamacpp import default_threads

    for p in (a.lib_a, a.lib_b):
        if not p.is_file():
            raise SystemExit(f"{p}: no such library file")
    threads = a.threads or default_threads()
    libs = [_residual(a.lib_a, a.split, threads, a.act_bits), _residual(a.lib_b, a.split, threads, a.act_bits)]
    if libs[0]._lib is libs[1]._lib:
        raise SystemExit("both paths loaded the same library")
    batches = [int(b) for b in a.batches.split(",")]
    names = [(n, ne) for n, ne, _, _ in libs[0].tensors() if ne[2] == 1 and ne[3] == 1 and a.only in n]
    if not names:
        raise SystemExit(f"no 2-D weight with a residual matches {a.only!r}")
    rng = np.random.default_rng(0)
    xs = {b: {n: rng.standard_normal((b, ne[0])).astype(np.float32) for n, ne in names} for b in batches}

    def one_pass(r, b: int) -> tuple[float, list]:
        k = a.kernel_b if r is libs[1] and a.kernel_b else a.kernel
        r.set_kernel(k) if k else r.choose_decode_kernel(b)
        t0 = time.perf_counter()
        out = [r.matmul(n, xs[b][n], with_base=not a.residual_only) for n, _ in names]
        return time.perf_counter() - t0, out

    for b in batches:  # warm-up, and the same results from both
        ya, yb = one_pass(libs[0], b)[1], one_pass(libs[1], b)[1]
        same = all(np.array_equal(p, q) for p, q in zip(ya, yb))
        print(f"batch {b}: results {'bit-identical' if same else 'DIFFER'} ({len(names)} products)")
    times = {(i, b): [] for i in (0, 1) for b in batches}
    for rnd in range(a.rounds):
        for b in batches:
            for i in ((0, 1) if rnd % 2 == 0 else (1, 0)):
                times[(i, b)].append(one_pass(libs[i], b)[0])
    print(f"{a.split}: {len(names)} products, {threads} threads, {a.rounds} rounds, act bits "
          f"{a.act_bits} ({libs[0].act_bits}), kernel {a.kernel or 'policy'}{f' (B: {a.kernel_b})' if a.kernel_b else ''}; A = {a.lib_a}, B = {a.lib_b}")
    for b in batches:
        ta, tb = times[(0, b)], times[(1, b)]
        ratio = statistics.median(y / x for x, y in zip(ta, tb))
        print(f"batch {b:3d}: A best {min(ta) * 1e3:8.1f} ms, median {statistics.median(ta) * 1e3:8.1f} | "
              f"B best {min(tb) * 1e3:8.1f} ms, median {statistics.median(tb) * 1e3:8.1f} | B/A {ratio:.3f}")


if __name__ == "__main__":
    main()
