"""Does a token's result depend on the rest of its batch? Row 0 of a pass decoded in a batch of 2
and in a batch of N (default 17, a 16-node tree plus its root), the other rows siblings in their own
sequences, with the residual on (the verifier: our products) and off (the drafter: llama.cpp's own
kernels); prints whether the logits are bit-identical and the largest difference.

    python bench/batch_invariance.py SPLIT_DIR [--rows 17] [--kernel amx-bf16]
"""

from __future__ import annotations

import argparse

import numpy as np

from bitsplit_llama.speculative.engine import TreeShape, n_seq_max_for
from bitsplit_llama.runtime.verifier import SplitModel

PROMPT = "def quicksort(arr):\n    if len(arr) <= 1:\n        return arr\n    pivot = arr[len(arr) // 2]\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("split")
    ap.add_argument("--rows", type=int, default=17)
    ap.add_argument("--kernel", default=None, help="kernel family for the verifier (default: as a tree of rows-1 nodes)")
    a = ap.parse_args()
    if not 2 < a.rows <= 64:
        ap.error(f"--rows: {a.rows} must be in 3..64")
    sm = SplitModel(a.split, n_ctx=1024, n_batch=64, n_seq_max=max(a.rows, n_seq_max_for(TreeShape(16, 4, 7))),
                    fast_drafter=False)
    try:
        sm.residual.choose_decode_kernel(a.rows, a.kernel)
        prompt = sm.model.tokenize(PROMPT)
        n = len(prompt)

        def row0(rows: int, verify: bool) -> np.ndarray:
            sm.ctx.clear()
            with (sm.verifying() if verify else sm.drafting()) as ctx:
                ctx.decode(prompt, range(n), logits=False)
                for s in range(1, rows):
                    sm.ctx.seq_cp(0, s, 0, n)
                toks = [prompt[-1]] + [100 + i for i in range(rows - 1)]
                ctx.decode(toks, [n] * rows, seq_ids=[[s] for s in range(rows)], logits=True)
                return ctx.logits_ith(0).copy()

        for verify in (True, False):
            two, big, again = row0(2, verify), row0(a.rows, verify), row0(2, verify)
            name = f"verifier ({sm.residual.kernel})" if verify else "drafter (llama.cpp's kernels)"
            print(f"{name}: 2 rows twice identical: {np.array_equal(two, again)}; 2 vs {a.rows} rows identical: "
                  f"{np.array_equal(two, big)}, max |logit difference| {float(np.abs(two - big).max()):.3g}")
    finally:
        sm.close()


if __name__ == "__main__":
    main()
