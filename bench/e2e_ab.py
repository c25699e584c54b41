"""Two builds of the native library end to end: `bitsplit bench` (bitsplit against stock llama.cpp on
the same prompts) run alternately with the sources of A and of B, in pairs whose order alternates
(A, B then B, A), so that a shared machine's drift hits both alike.

    python bench/e2e_ab.py SRC_A SRC_B SPLIT_DIR --vs MODEL-Q8_0.gguf [--pairs 4] [--prompts FILE]
                           [-n 32] [--threads N] [-- more bitsplit bench options]

SRC_A / SRC_B: the native/ folders of two checkouts (e.g. a git worktree holding a change), or
`installed` for this package's own sources. Each run sets BITSPLIT_NATIVE_SRC, so the bench and its
worker processes load that build (built once, before the runs, and cached like any build).

Each `bitsplit bench` run times its stock llama.cpp run beside bitsplit's, interleaved prompt by
prompt; its `speedup_vs` (bitsplit over stock) is the figure least moved by the machine's drift.
Prints every run, then per pair the ratio B/A of speedup_vs and of bitsplit's tokens/s, and their
medians. Native changes that are bit-identical give the same tokens (accepted_per_verify equal);
one that changes arithmetic may change what is generated, and so the work per token.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from bitsplit_llama.errors import NativeError
from bitsplit_llama.native import build


def _src(src: str) -> str | None:
    """BITSPLIT_NATIVE_SRC for src (None: the installed sources)."""
    return None if src == "installed" else str(Path(src).resolve())


def _env(src: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != build.SRC_ENV}
    if _src(src) is not None:
        env[build.SRC_ENV] = _src(src)
    return env


def _build(src: str) -> Path:
    """Build (or find cached) the library of src, before any timing; returns its path. build.source_dir
    reads BITSPLIT_NATIVE_SRC at each call and refuses a folder without the sources (NativeError)."""
    saved = os.environ.pop(build.SRC_ENV, None)
    if _src(src) is not None:
        os.environ[build.SRC_ENV] = _src(src)
    try:
        return build.build()
    finally:
        os.environ.pop(build.SRC_ENV, None)
        if saved is not None:
            os.environ[build.SRC_ENV] = saved


def _bench(src: str, args, extra: list[str]) -> dict:
    cmd = [sys.executable, "-m", "bitsplit_llama.cli", "bench", args.split, "--vs", args.vs, "-n", str(args.n),
           "--json", *(["--prompts", args.prompts] if args.prompts else []),
           *(["--threads", str(args.threads)] if args.threads else []), *extra]
    p = subprocess.run(cmd, env=_env(src), capture_output=True, text=True)
    if p.returncode != 0:
        sys.exit(f"e2e_ab: bitsplit bench with {src} failed (exit {p.returncode}): "
                 f"{(p.stderr or p.stdout).strip()[-2000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("src_a")
    ap.add_argument("src_b")
    ap.add_argument("split")
    ap.add_argument("--vs", required=True, help="the stock model each bench run compares with (e.g. the Q8_0 GGUF)")
    ap.add_argument("--pairs", type=int, default=4)
    ap.add_argument("--prompts", default=None)
    ap.add_argument("-n", type=int, default=32)
    ap.add_argument("--threads", type=int, default=0)
    args, extra = ap.parse_known_args()
    extra = [a for a in extra if a != "--"]
    if args.pairs < 1:
        ap.error(f"--pairs {args.pairs}: expected at least 1")
    try:
        libs = {src: _build(src) for src in (args.src_a, args.src_b)}
    except NativeError as exc:
        ap.error(str(exc))
    print(f"A = {args.src_a} ({libs[args.src_a]})\nB = {args.src_b} ({libs[args.src_b]})", flush=True)
    cols = ("tokens_per_second", "vs_tokens_per_second", "speedup_vs", "median_pair_ratio", "accepted_per_verify")
    print(f"{'pair':>4} {'run':>3} " + " ".join(f"{c:>20}" for c in cols), flush=True)
    ratios, tps = [], []
    for i in range(args.pairs):
        order = ("a", "b") if i % 2 == 0 else ("b", "a")
        got = {}
        for which in order:
            d = _bench(args.src_a if which == "a" else args.src_b, args, extra)
            got[which] = d
            print(f"{i + 1:>4} {which.upper():>3} " + " ".join(f"{d.get(c, float('nan')):>20}" for c in cols), flush=True)
        ratios.append(got["b"]["speedup_vs"] / got["a"]["speedup_vs"])
        tps.append(got["b"]["tokens_per_second"] / got["a"]["tokens_per_second"])
        print(f"     pair {i + 1}: B/A speedup_vs {ratios[-1]:.3f}, tokens/s {tps[-1]:.3f}", flush=True)
    print(f"{args.split}: {args.pairs} pairs; B/A median speedup_vs ratio {statistics.median(ratios):.3f} "
          f"(each {', '.join(f'{r:.3f}' for r in ratios)}), tokens/s {statistics.median(tps):.3f}", flush=True)


if __name__ == "__main__":
    main()
