#!/usr/bin/env python3
"""Tiny split models for the native C test (native/tests/test_native.c), made with the project's own
code: random-weight llama GGUFs (tests/synth.py) split by bitsplit_llama.formats.split. The files are
the same on every architecture (native/tests/native_qemu.sh runs the AArch64 build on them).

    make_split_models.py WORK_DIR [NAME ...]      (default: every model below)

Names: q6k (Q2_K mix base, Q6_K residual), moe-q8 (3-D expert tensors, Q8_0 residual), f16 (Q4_K/Q6_K
base, F16 residual), q4k (Q4_K residual, an output head kept exact), iq2 (IQ2_XXS base), iq1m (IQ1_M
mix base; these two need an importance matrix, computed here with llama.cpp).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))

from synth import tiny_llama_weights, write_llama_gguf, write_tiny_llama  # noqa: E402

from bitsplit_llama.formats.split import split_model  # noqa: E402

NAMES = ("q6k", "moe-q8", "f16", "q4k", "iq2", "iq1m")


def main(argv: list[str]) -> int:
    if not argv or any(n not in NAMES for n in argv[1:]):
        print(__doc__.strip().split("\n\n")[1], file=sys.stderr)
        print(f"names: {', '.join(NAMES)}", file=sys.stderr)
        return 2
    work, names = Path(argv[0]), argv[1:] or list(NAMES)
    dense = write_tiny_llama(work / "tiny-f32.gguf")
    if "q6k" in names:
        split_model(dense, work / "q6k", threads=2)
    if "moe-q8" in names:
        moe = write_llama_gguf(work / "tiny-moe-f32.gguf", tiny_llama_weights(n_expert=4, n_layer=1))
        split_model(moe, work / "moe-q8", residual="q8_0", threads=2)
    if "f16" in names:
        split_model(dense, work / "f16", residual="f16", base_ftype="q4_k_m", threads=2)
    if "q4k" in names:
        from gguf.constants import GGMLQuantizationType as QT

        exact = write_llama_gguf(work / "tiny-exact.gguf", tiny_llama_weights(5), types={"output.weight": int(QT.Q6_K)})
        split_model(exact, work / "q4k", residual="q4_k", threads=2)
    if "iq2" in names or "iq1m" in names:
        from bitsplit_llama.tools.imatrix import calibration_text, compute_imatrix

        (work / "text.txt").write_text(calibration_text().read_text()[:6000])
        compute_imatrix(dense, work / "text.txt", work / "im.gguf", n_ctx=64, chunks=4, threads=2)
        if "iq2" in names:
            split_model(dense, work / "iq2", base_ftype="iq2_xxs", imatrix=work / "im.gguf", threads=2)
        if "iq1m" in names:
            split_model(dense, work / "iq1m", base_ftype="iq1_m", imatrix=work / "im.gguf", threads=2)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
