"""`bitsplit demo`: fetch (cached), split (cached), then the speculative engine next to the verifier
alone and stock llama.cpp on the source, on the real SmolLM2-135M."""

from __future__ import annotations

import json

import pytest

from bitsplit_llama.cli import main
from bitsplit_llama.errors import OutputError
from bitsplit_llama.tools.demo import ensure_split, reusable_split

KEYS = ("text", "tokens_per_second", "accepted_per_verify", "no_spec_tokens_per_second", "stock_tokens_per_second",
        "identical_to_verifier", "model", "split_dir")


@pytest.mark.real_model
def test_demo_on_the_real_model(smollm2, tmp_path, capsys):
    split = tmp_path / "split"
    # the model given as a file (the fixture's cached download: nothing is fetched again)
    code = main(["demo", "--model", str(smollm2), "-o", str(split), "--json", "-n", "16", "--tree-nodes", "4"])
    out, err = capsys.readouterr()
    assert code == 0, err
    d = json.loads(out.strip().splitlines()[-1])
    for key in KEYS:
        assert key in d, key
    assert d["identical_to_verifier"] is True  # greedy: the speculative tokens are the verifier's
    assert d["n_tokens"] == 16 and d["text"].strip()
    for key in ("tokens_per_second", "no_spec_tokens_per_second", "stock_tokens_per_second"):
        assert d[key] > 0, key
    assert d["accepted_per_verify"] >= 1 and d["tree_shape"] == [4, 1, 4]
    assert d["split_dir"] == str(split) and d["split_reused"] is False and d["model"] == smollm2.stem
    assert 0 <= d["stock_agreement_tokens"] <= 16
    assert "splitting" in err and "stock llama.cpp" in err
    # again, for a person: the split is reused, the text streams, then the table and what each row is
    code = main(["demo", "--model", str(smollm2), "-o", str(split), "-n", "16", "--tree-nodes", "4"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "reusing the split" in err and "splitting" not in err
    assert out.startswith("The three primary colors are" + d["text"])
    for frag in ("speculative", "verifier alone (--no-spec)", "stock llama.cpp", "drafter  = base.gguf alone",
                 "verifier = base + residual.gguf", "token for token: they are."):
        assert frag in out, frag


def test_demo_split_cache(tmp_path):
    """A split is reused only when it was made from this very source; a stale one in the cache is
    replaced, one in a directory the user named is left alone (the split refuses to overwrite)."""
    from synth import write_tiny_llama

    a = write_tiny_llama(tmp_path / "a.gguf", seed=1)
    b = write_tiny_llama(tmp_path / "b.gguf", seed=2)
    said = []
    d = tmp_path / "cache-split"
    assert not reusable_split(d, a)
    assert ensure_split(a, d, in_cache=True, threads=2, log=said.append) is False
    assert reusable_split(d, a) and not reusable_split(d, b)
    assert ensure_split(a, d, in_cache=True, threads=2, log=said.append) is True
    assert ensure_split(b, d, in_cache=True, threads=2, log=said.append) is False  # stale: replaced
    assert reusable_split(d, b)
    with pytest.raises(OutputError):
        ensure_split(a, d, in_cache=False, threads=2, log=said.append)
    assert reusable_split(d, b)


def test_demo_bad_options(capsys, tmp_path):
    for args, frag in ((["-n", "0"], "-n: 0"), (["--model", "no-such-model"], "neither a known model"),
                       (["--model", str(tmp_path / "missing.gguf")], "model file not found")):
        code = main(["demo", *args])
        out, err = capsys.readouterr()
        lines = [l for l in err.strip().splitlines() if l.startswith("bitsplit: error: ")]
        assert code != 0 and len(lines) == 1 and frag in lines[0], err
