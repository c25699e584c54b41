"""On the real SmolLM2: the split verifier is closer to the source than stock Q8_0, in the same run."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from bitsplit_llama.tools.quality import evaluate
from bitsplit_llama.formats.split import quantize_model

pytestmark = pytest.mark.real_model


def test_verifier_beats_q8_0(smollm2, smollm2_split_q8, tmp_path):
    q8 = tmp_path / "smollm2-q8_0.gguf"
    quantize_model(smollm2, q8, "q8_0", threads=2)
    text = Path(argparse.__file__)  # real text nobody here wrote: the standard library's argparse
    rep = evaluate(smollm2_split_q8, smollm2, text, vs=[q8], n_ctx=256, max_chunks=4)
    ver, stock = rep.models
    assert rep.n_tokens == 1024 and ver.name == "bitsplit verifier" and stock.path == str(q8)
    assert ver.kl_mean < stock.kl_mean, (ver.kl_mean, stock.kl_mean)
    assert ver.top1 >= stock.top1 - 0.005
    assert ver.kl_mean < 0.01  # far from the 2-bit base alone
