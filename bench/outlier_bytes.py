"""What an exact-outlier correction of a device's rounding would cost the host, at verify-pass sizes.

Under emulated device numerics (``bitsplit eval --device-numerics``) with N exact channels per row,
the host would add ``W2[:, S] . x[S]``: with each row's own channels it reads the base's blocks that
hold them (native counter ``bytes_outlier_base``), with a fixed set per weight (an imatrix's choice) a
slab of N columns. This decodes a prompt, then passes of 1, 4 and 16 rows, and prints those bytes as a
share of the residual's bytes over the same passes (the issue's gate: at most 15% more host bytes).

    python bench/outlier_bytes.py SPLIT [--text FILE] [--numerics cpu] [--outliers 4,16] [--imatrix FILE [--pool P]]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import llama_cpp  # noqa: F401  (llama.cpp before numpy: see docs/device-path.md)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("split")
    ap.add_argument("--text", default=None, help="text to decode (default: the package's calibration text)")
    ap.add_argument("--numerics", default="cpu")
    ap.add_argument("--outliers", default="4,16")
    ap.add_argument("--rows", default="1,4,16")
    ap.add_argument("--passes", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=256, help="tokens decoded first (their passes not counted)")
    ap.add_argument("--imatrix", default=None, help="fixed sets: each weight's N channels of largest importance")
    ap.add_argument("--pool", type=int, default=None,
                    help="with --imatrix: each weight's P most important channels the slab, each row's N among them")
    ap.add_argument("--threads", type=int, default=None)
    a = ap.parse_args()

    from bitsplit_llama.runtime.verifier import SplitModel
    from bitsplit_llama.tools.imatrix import calibration_text
    from bitsplit_llama.tools.quality import set_fixed_channels

    text = Path(a.text or calibration_text()).read_text(errors="replace")
    importance = None
    if a.imatrix:
        from bitsplit_llama.formats.imatrix import load_imatrix

        importance = load_imatrix(a.imatrix)
    rows_list = [int(r) for r in a.rows.split(",")]
    need = a.prompt + a.passes * max(rows_list)
    out = []
    with SplitModel(a.split, n_ctx=need + 16, n_batch=max(a.prompt, 16), n_threads=a.threads) as sm:
        toks = sm.model.tokenize(text.encode())
        if len(toks) < need:
            print(f"{a.text}: {len(toks)} tokens, need {need}", file=sys.stderr)
            return 2
        ts = sm.residual.tensors()
        for n in [int(v) for v in a.outliers.split(",")]:
            if importance is not None:
                set_fixed_channels(sm.residual, ts, importance, a.pool or n, a.imatrix)
            sm.residual.set_numerics(a.numerics, 0 if importance is not None and not a.pool else n)
            for rows in rows_list:
                sm.ctx.clear()
                with sm.verifying() as ctx:
                    ctx.decode(toks[:a.prompt], list(range(a.prompt)))
                sm.residual.reset_counters()
                pos = a.prompt
                with sm.verifying() as ctx:
                    for _ in range(a.passes):
                        ctx.decode(toks[pos:pos + rows], list(range(pos, pos + rows)))
                        pos += rows
                c = sm.residual.counters()
                share = c.bytes_outlier_base / max(c.bytes_residual, 1)
                row = {"numerics": a.numerics, "outliers": n, "fixed": importance is not None, "pool": a.pool, "rows": rows,
                       "passes": a.passes, "outlier_bytes_share": round(share, 4),
                       "outlier_bytes_per_pass": c.bytes_outlier_base // a.passes,
                       "residual_bytes_per_pass": c.bytes_residual // a.passes}
                out.append(row)
                kind = f"of {a.pool}" if a.pool else "fixed" if row["fixed"] else "per row"
                print(f"N={n:3d} {kind} rows={rows:3d}: outlier base bytes "
                      f"{share:.1%} of the residual's ({row['outlier_bytes_per_pass'] / 1e6:.2f} MB per pass)")
    print(json.dumps({"outlier_bytes": out}))
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except Exception as e:  # one line for bad input (a split, a text, an imatrix of another model)
        from bitsplit_llama.errors import BitsplitError

        if isinstance(e, BitsplitError):
            print(f"outlier_bytes: {e}", file=sys.stderr)
            sys.exit(1)
        raise
