"""Weight-space fidelity of a split: relative RMSE of base + residual against the source, next to
that of a plain Q8_0 quantization of the same source, over every tensor that has a residual and
whose source is not already Q8_0 (the premise of the project: a Q8_0 residual should reconstruct at
least 2x better than Q8_0, a Q6_K residual about as well).

    python bench/split_fidelity.py SOURCE.gguf SPLIT_DIR [SPLIT_DIR ...] [--json]

Relative RMSE = sqrt(sum of squared errors / sum of squared source weights), over all those tensors
together (and per tensor kind with --by-kind). Streams row chunks: memory stays bounded.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np
from gguf.constants import GGMLQuantizationType as QT

from bitsplit_llama.formats import _ggml
from bitsplit_llama.formats.gguf_file import GGUFFile, iter_row_chunks


def kind(name: str) -> str:
    return re.sub(r"^blk\.\d+\.", "", name).replace(".weight", "")


def measure(source: Path, split_dir: Path) -> dict:
    err_split = defaultdict(float)
    err_q8 = defaultdict(float)
    ref = defaultdict(float)
    n_tensors = 0
    with GGUFFile(source) as s, GGUFFile(split_dir / "base.gguf") as b, GGUFFile(split_dir / "residual.gguf") as r:
        rtype = r.kv.get("bitsplit.residual_type")
        for rt in r.tensors:
            st, bt = s.tensor(rt.name), b.tensor(rt.name)
            if st.ggml_type == QT.Q8_0 or st.n_per_row % 32:
                continue
            n_tensors += 1
            k = kind(rt.name)
            for start, count in iter_row_chunks(st.n_rows, st.n_per_row, 1 << 22):
                S = _ggml.dequantize_rows(s.read_rows(st, start, count), st.ggml_type, st.n_per_row)
                B = _ggml.dequantize_rows(b.read_rows(bt, start, count), bt.ggml_type, bt.n_per_row)
                R = _ggml.dequantize_rows(r.read_rows(rt, start, count), rt.ggml_type, rt.n_per_row)
                Q = _ggml.dequantize_rows(_ggml.quantize_rows(S, QT.Q8_0), QT.Q8_0, st.n_per_row)
                e1 = float(np.square((S - B - R).astype(np.float64)).sum())
                e2 = float(np.square((S - Q).astype(np.float64)).sum())
                ss = float(np.square(S.astype(np.float64)).sum())
                for key in (k, "ALL"):
                    err_split[key] += e1
                    err_q8[key] += e2
                    ref[key] += ss
    rows = {key: {"split_rel_rmse": (err_split[key] / ref[key]) ** 0.5, "q8_0_rel_rmse": (err_q8[key] / ref[key]) ** 0.5}
            for key in ref}
    for v in rows.values():
        v["ratio_q8_over_split"] = v["q8_0_rel_rmse"] / v["split_rel_rmse"]
    return {"source": str(source), "split": str(split_dir), "residual_type": rtype, "n_tensors": n_tensors,
            "all": rows.pop("ALL"), "by_kind": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("source", type=Path)
    ap.add_argument("splits", type=Path, nargs="+")
    ap.add_argument("--by-kind", action="store_true")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    results = [measure(a.source, d) for d in a.splits]
    if a.json:
        print(json.dumps(results))
        return
    print(f"source {a.source.name}: relative RMSE against the dequantized source")
    print(f"{'split':40s} {'residual':8s} {'tensors':>7s} {'base+res':>10s} {'Q8_0':>10s} {'Q8_0/split':>10s}")
    for res in results:
        al = res["all"]
        print(f"{res['split'][-40:]:40s} {res['residual_type']:8s} {res['n_tensors']:7d} "
              f"{al['split_rel_rmse']:10.5f} {al['q8_0_rel_rmse']:10.5f} {al['ratio_q8_over_split']:10.2f}x")
        if a.by_kind:
            for k, v in sorted(res["by_kind"].items()):
                print(f"    {k:36s} {'':8s} {'':7s} {v['split_rel_rmse']:10.5f} {v['q8_0_rel_rmse']:10.5f} "
                      f"{v['ratio_q8_over_split']:10.2f}x")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
