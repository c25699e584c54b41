"""bitsplit eval: the verifier scored per kernel family (--kernel) against one reference pass."""

from __future__ import annotations

import pytest

from bitsplit_llama.errors import InvalidOptionError
from bitsplit_llama.native import policy
from bitsplit_llama.tools.quality import check_kernels, evaluate


@pytest.fixture()
def text(tmp_path):
    t = tmp_path / "t.txt"
    t.write_text("the quick brown fox jumps over the lazy dog. " * 20)
    return t


def test_eval_scores_each_kernel_family_as_the_environment_pins_it(tiny_split, tiny_f32, text, monkeypatch):
    monkeypatch.delenv("BITSPLIT_KERNEL", raising=False)
    here = policy.families()
    pick = list(dict.fromkeys([here[0], "generic"]))  # the policy's first and the portable one
    rep = evaluate(tiny_split, tiny_f32, text, n_ctx=32, max_chunks=2, kernels=",".join(pick))
    assert [m.name for m in rep.models] == [f"bitsplit verifier ({f})" for f in pick]
    assert [m.kernel for m in rep.models] == pick
    assert all(m.kl_mean > 0 for m in rep.models)
    # each family's scores are those of a run with BITSPLIT_KERNEL pinning it (the same products)
    for fam, m in zip(pick, rep.models):
        monkeypatch.setenv("BITSPLIT_KERNEL", fam)
        one = evaluate(tiny_split, tiny_f32, text, n_ctx=32, max_chunks=2).models[0]
        assert one.name == "bitsplit verifier" and one.kernel == fam
        assert (one.kl_mean, one.top1, one.ppl) == (m.kl_mean, m.top1, m.ppl)
    # unpinned, the row names the family that computed it
    monkeypatch.delenv("BITSPLIT_KERNEL")
    assert evaluate(tiny_split, tiny_f32, text, n_ctx=32, max_chunks=1).models[0].kernel in here
    assert evaluate(tiny_split, tiny_f32, text, n_ctx=32, max_chunks=1, kernels="all").models[-1].kernel == here[-1]


def test_kernel_option_values():
    here = policy.families()
    assert check_kernels(None) is None
    assert check_kernels("all") == here
    assert check_kernels(f"{here[-1]}, {here[-1]}") == [here[-1]]
    for bad in ("avx3", "", "all,generic"):
        with pytest.raises(InvalidOptionError, match="--kernel: "):
            check_kernels(bad)
