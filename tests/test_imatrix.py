"""`bitsplit imatrix` and `split --imatrix auto`: the importance matrix collected by the native
eval callback, against sums computed here from the model's own weights, in llama.cpp's format."""

from __future__ import annotations

import json

import gguf
import numpy as np
import pytest

from bitsplit_llama.cli import main
from bitsplit_llama.formats.imatrix import load_imatrix
from bitsplit_llama.tools.imatrix import calibration_text, compute_imatrix

TEXT = ("the cat of the house is on a mat and it was said that all of them are in the box; "
        "what do we do with this one when there is no other? ") * 40


@pytest.fixture()
def text(tmp_path):
    p = tmp_path / "text.txt"
    p.write_text(TEXT)
    return p


def _weights(path):
    r = gguf.GGUFReader(path)
    return {t.name: np.array(t.data, dtype=np.float32) for t in r.tensors}, r


def _reader_entries(path):
    """(sums, counts) per weight, read with gguf-py (not our loader), checking the layout
    llama.cpp's imatrix loader requires: F32 '<name>.in_sum2' [n_per_row, n_mat] beside
    '<name>.counts' [1, n_mat], and the imatrix.* keys."""
    r = gguf.GGUFReader(path)
    assert r.fields["general.type"].contents() == "imatrix"
    for key in ("imatrix.datasets", "imatrix.chunk_count", "imatrix.chunk_size"):
        assert key in r.fields
    ts = {t.name: t for t in r.tensors}
    out = {}
    for name, t in ts.items():
        if name.endswith(".in_sum2"):
            w = name[: -len(".in_sum2")]
            c = ts[w + ".counts"]
            assert t.tensor_type == gguf.GGMLQuantizationType.F32 and c.tensor_type == gguf.GGMLQuantizationType.F32
            n_per_row, n_mat = int(t.shape[0]), int(t.shape[1])
            assert [int(x) for x in c.shape] == [1, n_mat]
            out[w] = (np.array(t.data, dtype=np.float64).reshape(n_mat, n_per_row), np.array(c.data).reshape(-1))
    assert len(out) * 2 == len(ts)
    return out, r


def test_first_layer_sums_match_the_weights(tmp_path, tiny_f32, text):
    """blk.0's attention weights read rmsnorm(embedding) * attn_norm: their sums of squares are
    computed here from the GGUF's own tensors, chunk by chunk (BOS first, as llama-imatrix)."""
    from bitsplit_llama.runtime.llamacpp import Model

    out = tmp_path / "im.gguf"
    n_ctx = 32
    rep = compute_imatrix(tiny_f32, text, out, n_ctx=n_ctx, chunks=5, threads=2)
    assert rep.n_chunks == 5 and rep.n_tokens == 160
    got, r = _reader_entries(out)
    assert int(r.fields["imatrix.chunk_count"].contents()) == 5
    assert int(r.fields["imatrix.chunk_size"].contents()) == n_ctx
    # every layer weight of the 2-layer model, the last layer's feed-forward included
    names = [f"blk.{i}.{w}.weight" for i in range(2)
             for w in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")]
    assert sorted(got) == sorted(names)
    for name in names:
        assert got[name][1].tolist() == [160.0], name

    m = Model(tiny_f32)
    try:
        toks = m.tokenize(TEXT, add_special=False)
        bos = m.bos
    finally:
        m.close()
    w, _ = _weights(tiny_f32)
    emb = w["token_embd.weight"].reshape(-1, 256)
    norm = w["blk.0.attn_norm.weight"]
    want = np.zeros(256)
    for c in range(5):
        chunk = list(toks[c * n_ctx:(c + 1) * n_ctx])
        chunk[0] = bos
        x = emb[chunk].astype(np.float64)
        x = x / np.sqrt((x * x).mean(axis=1, keepdims=True) + 1e-5) * norm
        want += (x * x).sum(axis=0)
    for name in ("blk.0.attn_q.weight", "blk.0.attn_k.weight", "blk.0.attn_v.weight"):
        np.testing.assert_allclose(got[name][0][0], want, rtol=2e-4, err_msg=name)
    # other weights see other activations
    assert not np.allclose(got["blk.0.ffn_up.weight"][0][0], want, rtol=0.1)

    # our loader gives llama-quantize's normalisation (sums / counts)
    loaded = load_imatrix(out)
    np.testing.assert_allclose(loaded["blk.0.attn_q.weight"], want / 160, rtol=2e-4)


def test_experts_are_counted_per_expert(tmp_path, text):
    """A mixture of experts (MUL_MAT_ID): one row of sums and one count per expert; each token is
    routed to 2 experts, so the counts add up to 2 per token."""
    from synth import tiny_llama_weights, write_llama_gguf

    src = write_llama_gguf(tmp_path / "moe.gguf", tiny_llama_weights(3, n_expert=4))
    out = tmp_path / "im.gguf"
    compute_imatrix(src, text, out, n_ctx=32, chunks=3, threads=2)
    got, _ = _reader_entries(out)
    for i in range(2):
        for w in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"):
            sums, counts = got[f"blk.{i}.{w}.weight"]
            assert sums.shape[0] == 4 and counts.sum() == 2 * 96, (w, counts)
            assert np.all((counts > 0) == (sums.sum(axis=1) > 0))
        # gate and up read the same activations, expert by expert
        np.testing.assert_allclose(got[f"blk.{i}.ffn_gate_exps.weight"][0], got[f"blk.{i}.ffn_up_exps.weight"][0])
        assert got[f"blk.{i}.ffn_gate_inp.weight"][1].tolist() == [96.0]


def test_split_with_auto_imatrix(tmp_path, tiny_f32, monkeypatch, capsys):
    """--imatrix auto: the matrix of the shipped calibration text, computed once and cached; the base
    it makes differs from the plain one, and the residual names the matrix."""
    assert calibration_text().is_file() and calibration_text().stat().st_size > 20_000
    monkeypatch.setenv("BITSPLIT_CACHE", str(tmp_path / "cache"))
    code = main(["split", str(tiny_f32), "-o", str(tmp_path / "a"), "--imatrix", "auto", "-q", "-t", "2"])
    assert code == 0, capsys.readouterr()
    cached = list((tmp_path / "cache" / "imatrix").glob("*.gguf"))
    assert len(cached) == 1
    stamp = cached[0].stat().st_mtime_ns
    code = main(["split", str(tiny_f32), "-o", str(tmp_path / "b"), "--imatrix", "auto", "--json", "-t", "2"])
    assert code == 0
    assert cached[0].stat().st_mtime_ns == stamp  # reused, not recomputed
    capsys.readouterr()
    assert main(["split", str(tiny_f32), "-o", str(tmp_path / "plain"), "-q", "-t", "2"]) == 0
    a, b, plain = ((tmp_path / d / "base.gguf").read_bytes() for d in ("a", "b", "plain"))
    assert a == b and a != plain
    r = gguf.GGUFReader(tmp_path / "a" / "residual.gguf")
    assert r.fields["bitsplit.imatrix"].contents() == cached[0].name


def test_cli_json_and_errors(tmp_path, tiny_f32, text, capsys):
    out = tmp_path / "im.gguf"
    assert main(["imatrix", str(tiny_f32), "-o", str(out), "--text", str(text), "--chunks", "2", "--n-ctx", "64",
                 "--json"]) == 0
    obj = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert obj["n_entries"] == 14 and obj["n_tokens"] == 128 and obj["out"] == str(out)
    short = tmp_path / "short.txt"
    short.write_text("the cat")
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n")
    cases = [
        (["imatrix", str(tmp_path / "none.gguf"), "-o", str(tmp_path / "x.gguf"), "--text", str(text)], 1,
         "source file not found"),
        (["imatrix", str(tiny_f32), "-o", str(tmp_path / "x.gguf"), "--text", str(tmp_path / "none.txt")], 1,
         "text file not found"),
        (["imatrix", str(tiny_f32), "-o", str(tmp_path / "x.gguf"), "--text", str(empty)], 1, "text file is empty"),
        (["imatrix", str(tiny_f32), "-o", str(tmp_path / "x.gguf"), "--text", str(short)], 1,
         "fewer than one chunk"),
        (["imatrix", str(tiny_f32), "-o", str(tmp_path / "x.gguf"), "--text", str(text), "--chunks", "0"], 2,
         "--chunks: 0"),
        (["imatrix", str(tiny_f32), "-o", str(tmp_path / "x.gguf"), "--text", str(text), "--n-ctx", "8"], 2,
         "--n-ctx: 8"),
        (["imatrix", str(tiny_f32), "-o", str(tmp_path / "nodir" / "x.gguf"), "--text", str(text)], 2,
         "does not exist"),
        (["split", str(tiny_f32), "-o", str(tmp_path / "s"), "--imatrix", "auto", "--residual", "q3_k"], 2,
         "unknown residual type"),
    ]
    for args, code, fragment in cases:
        got = main(args)
        err = capsys.readouterr().err.strip().splitlines()
        assert got == code and len(err) == 1 and fragment in err[0], (args, got, err)
    assert not (tmp_path / "x.gguf").exists()
    assert not any(p.name.endswith(".tmp") for p in tmp_path.iterdir())


@pytest.mark.parametrize("base", ["iq2_xs", "iq1_m"])
def test_iq_bases_with_an_importance_matrix(tmp_path, tiny_f32, text, base):
    """IQ2/IQ1 bases (for models whose Q2_K does not fit) are made with a computed matrix; the
    residual still reconstructs the source and the verifier runs on them."""
    from bitsplit_llama.formats.split import split_model

    compute_imatrix(tiny_f32, text, tmp_path / "im.gguf", n_ctx=64, threads=2)
    rep = split_model(tiny_f32, tmp_path / base, base_ftype=base, imatrix=tmp_path / "im.gguf", threads=2)
    assert base.upper() in rep.base_types
    from test_split import assert_reconstructs, assert_verifier_runs

    assert assert_reconstructs(tiny_f32, tmp_path / base) == len(rep.residual_tensors)
    assert_verifier_runs(tmp_path / base)
