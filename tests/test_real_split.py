"""End-to-end split of a real model (SmolLM2-135M from PyPI, cached)."""

from __future__ import annotations

import numpy as np
import pytest
from gguf.constants import GGMLQuantizationType as QT

from bitsplit_llama.formats.gguf_file import GGUFFile
from bitsplit_llama.formats.modeldir import split_info
from test_split import assert_reconstructs, full

pytestmark = pytest.mark.real_model


def test_smollm2_split_end_to_end(smollm2, smollm2_split_q8):
    info = split_info(smollm2_split_q8)
    assert info.architecture == "llama" and info.fingerprint_ok
    # width 576 is no multiple of 256: llama.cpp's Q2_K mix falls back to Q4_0/Q3_K there
    assert set(info.base_types) >= {"Q4_0", "Q3_K", "F32"}
    assert info.residual_types == {"Q8_0": info.residual_tensors}
    names = ["blk.0.ffn_down.weight", "blk.7.attn_q.weight", "blk.29.ffn_up.weight"]
    assert assert_reconstructs(smollm2, smollm2_split_q8, names) == 3
    # the premise: base + Q8_0 residual reconstructs the source better than Q8_0 of the source
    from bitsplit_llama.formats import _ggml

    with GGUFFile(smollm2) as s, GGUFFile(smollm2_split_q8 / "base.gguf") as b, \
            GGUFFile(smollm2_split_q8 / "residual.gguf") as r:
        for name in names:
            S = full(s, name)
            split_err = S - full(b, name) - full(r, name)
            q8_err = S - _ggml.dequantize_rows(_ggml.quantize_rows(S, QT.Q8_0), QT.Q8_0, S.shape[1])
            assert np.sqrt((split_err**2).mean()) < 0.5 * np.sqrt((q8_err**2).mean()), name


def test_smollm2_base_generates(smollm2_split_q8):
    from bitsplit_llama.runtime.stock import stock_llama

    llm = stock_llama(smollm2_split_q8 / "base.gguf")
    try:
        out = llm.create_completion("The capital of France is", max_tokens=8, temperature=0.0)
        assert out["usage"]["completion_tokens"] >= 1
        assert out["choices"][0]["text"].strip()
    finally:
        llm.close()
