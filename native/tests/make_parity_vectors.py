#!/usr/bin/env python3
"""Test vectors for native/tests/kernel_parity.c: quantized weights made by ggml's own quantizer,
f32 activations and the float64 reference products, in one little-endian binary file.

    make_parity_vectors.py OUT_FILE [--seed N]

Cases: every base type a split can hold (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, Q8_0, Q4_0, Q4_1) x every
residual type (Q4_K, Q5_K, Q6_K, Q8_0), on shapes (K, N) = (256, 8), (512, 13), (1280, 13) (crosses
avx2-f32's chunk of 1024 values), (2304, 38) (crosses neon-f32's chunk of 2048, and the library's
row blocks of 16), plus (96, 15) where both halves are block-32 types. As in a real split, the
residual is the quantized remainder: W2 = q_base(W), R = q_res(W - deq(W2)).

The reference products use ggml's dequantizers (bitsplit_llama.formats._ggml.dequantize_rows),
cross-checked here against gguf-py's independent numpy dequantizers (gguf.quants.dequantize) when
gguf-py is installed: the file is not written if the two disagree.

File layout (all little-endian):
    char magic[8] = "BSPARV01"; u32 n_cases; u32 max_cols
    per case:
        u32 base_type, res_type (ggml type ids), K, N, base_row_bytes, res_row_bytes
        u8  base[N * base_row_bytes]; u8 res[N * res_row_bytes]
        f32 x[max_cols][K]                      activation columns
        f64 ref[3][max_cols][N]                 mode 0: (W2 + R) x, 1: R x (no base), 2: W2 x (no residual)
"""

from __future__ import annotations

import argparse
import struct
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bitsplit_llama.formats import _ggml  # noqa: E402

# ggml type ids (ggml.h's enum ggml_type)
TYPES = {"Q4_0": 2, "Q4_1": 3, "Q8_0": 8, "Q2_K": 10, "Q3_K": 11, "Q4_K": 12, "Q5_K": 13, "Q6_K": 14}
BLOCK = {"Q4_0": 32, "Q4_1": 32, "Q8_0": 32, "Q2_K": 256, "Q3_K": 256, "Q4_K": 256, "Q5_K": 256, "Q6_K": 256}
BASES = ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "Q8_0", "Q4_0", "Q4_1"]
RESIDUALS = ["Q4_K", "Q5_K", "Q6_K", "Q8_0"]
SHAPES = [(256, 8), (512, 13), (1280, 13), (2304, 38), (96, 15)]
MAX_COLS = 16
MAGIC = b"BSPARV01"


def _gguf_check(raw: np.ndarray, tname: str, K: int, ggml_deq: np.ndarray) -> None:
    """ggml's dequantizer against gguf-py's (an independent implementation of the formats)."""
    try:
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize
    except ImportError:
        return
    ref = dequantize(raw, GGMLQuantizationType[tname]).reshape(ggml_deq.shape).astype(np.float64)
    scale = max(float(np.abs(ref).max()), 1e-30)
    err = float(np.abs(ref - ggml_deq.astype(np.float64)).max()) / scale
    if err > 1e-6:
        raise SystemExit(f"make_parity_vectors: ggml and gguf-py dequantize {tname} (K={K}) differently: "
                         f"max error {err:.3g} of max|w|")


def make_case(rng: np.random.Generator, base: str, res: str, K: int, N: int):
    # weights with per-row scales and a few large values, like a real projection
    w = rng.standard_normal((N, K)).astype(np.float32) * rng.uniform(0.02, 0.08, (N, 1)).astype(np.float32)
    big = rng.random((N, K)) < 0.003
    w[big] *= 8.0
    wb = _ggml.quantize_rows(w, TYPES[base])
    w2 = _ggml.dequantize_rows(wb, TYPES[base], K)
    _gguf_check(wb, base, K, w2)
    rb = _ggml.quantize_rows(w - w2, TYPES[res])
    r = _ggml.dequantize_rows(rb, TYPES[res], K)
    _gguf_check(rb, res, K, r)
    x = rng.standard_normal((MAX_COLS, K)).astype(np.float32)
    x[:, 3] *= 60.0  # an outlier channel, as real activations have
    xd = x.astype(np.float64)
    w2d, rd = w2.astype(np.float64), r.astype(np.float64)
    ref = np.stack([xd @ (w2d + rd).T, xd @ rd.T, xd @ w2d.T])  # (3, MAX_COLS, N)
    head = struct.pack("<6I", TYPES[base], TYPES[res], K, N, wb.shape[1], rb.shape[1])
    return head + wb.tobytes() + rb.tobytes() + x.astype("<f4").tobytes() + ref.astype("<f8").tobytes()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--seed", type=int, default=1234)
    args = ap.parse_args()
    rng = np.random.default_rng(args.seed)
    cases = []
    for K, N in SHAPES:
        for base in BASES:
            for res in RESIDUALS:
                if K % BLOCK[base] or K % BLOCK[res]:
                    continue
                cases.append(make_case(rng, base, res, K, N))
    data = MAGIC + struct.pack("<2I", len(cases), MAX_COLS) + b"".join(cases)
    args.out.write_bytes(data)
    print(f"make_parity_vectors: {len(cases)} cases, {len(data)} bytes -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
