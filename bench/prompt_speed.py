"""Time to decode a prompt through the verifier: in prompt mode (the engine's way: every product takes
the kernel policy's family for a 64-row batch) against the family pinned for the generation's
decode passes serving the prompt too (before prompt mode), alternating in one process; medians.

    python bench/prompt_speed.py SPLIT_DIR --text FILE [--tokens 8,32,512] [--kernel FAMILY]
                                 [--rounds 3] [--threads N]

``--kernel``: the family pinned for decode passes (default: the policy's for 2-row passes, what a
fixed small tree pins; ``--tree-nodes auto`` pins the one it measured fastest). The prompts are the
first N tokens of FILE. Times are the engine's ``prompt_seconds`` (one token generated after it).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
from pathlib import Path

from bitsplit_llama.speculative.generate import Generator


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("split")
    ap.add_argument("--text", type=Path, required=True, help="a text file; prompts are its first N tokens")
    ap.add_argument("--tokens", default="8,32,512", help="prompt lengths in tokens, comma-separated")
    ap.add_argument("--kernel", default=None, help="the family pinned for decode passes")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    a = ap.parse_args()
    try:
        lengths = [int(t) for t in a.tokens.split(",") if t.strip()]
    except ValueError:
        lengths = []
    if not lengths or min(lengths) < 1:
        ap.error(f"--tokens {a.tokens!r}: expected positive whole numbers, e.g. 8,32,512")
    if a.rounds < 1:
        ap.error(f"--rounds {a.rounds}: expected at least 1")
    if not a.text.is_file():
        ap.error(f"--text {a.text}: no such file (expected a text file to take the prompts from)")
    text = a.text.read_text(encoding="utf-8", errors="replace")
    with Generator(a.split, n_ctx=max(lengths) + 64, n_threads=a.threads, tree_nodes=4, kernel=a.kernel) as g:
        tokens = g.sm.model.tokenize(text)
        if len(tokens) < max(lengths):
            ap.error(f"{a.text}: {len(tokens)} tokens, fewer than --tokens asks ({max(lengths)})")
        res = g.sm.residual
        real = res.prompt
        print(f"{a.split}: decode passes pinned to {g.kernel}; prompt mode uses the policy's family for 64 rows")
        print(f"{'tokens':>7} {'prompt mode s':>14} {'pinned s':>10} {'ratio':>7} {'tok/s':>16}")
        for n in lengths:
            times: dict[str, list[float]] = {"prompt": [], "pinned": []}
            for r in range(a.rounds):
                for mode in (("prompt", "pinned") if r % 2 == 0 else ("pinned", "prompt")):
                    # the pinned family for the prompt too: prompt mode off (an instance attribute)
                    res.prompt = real if mode == "prompt" else contextlib.nullcontext
                    g.engine.reset()
                    times[mode].append(g.generate(tokens[:n], max_tokens=1, speculative=False).stats.prompt_seconds)
            res.prompt = real
            p, q = statistics.median(times["prompt"]), statistics.median(times["pinned"])
            print(f"{n:>7} {p:>14.3f} {q:>10.3f} {p / q:>7.3f} {n / p:>7.1f} vs {n / q:<7.1f}", flush=True)


if __name__ == "__main__":
    main()
