"""bitsplit split / info on tiny synthetic models: reconstruction, metadata, atomicity, errors."""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
from gguf.constants import GGMLQuantizationType as QT

from bitsplit_llama.formats import _ggml
from bitsplit_llama.errors import (GGUFFormatError, InputError, InvalidOptionError, MismatchError, OutputError,
                                   UnsupportedModelError)
from bitsplit_llama.formats.gguf_file import GGUFFile, fingerprint
from bitsplit_llama.formats.modeldir import check_pair, split_info
from bitsplit_llama.formats.split import residual_type_for, split_model
from synth import tiny_llama_weights, write_llama_gguf, write_tiny_llama


def full(g: GGUFFile, name: str) -> np.ndarray:
    t = g.tensor(name)
    return _ggml.dequantize_rows(g.read_rows(t, 0, t.n_rows), t.ggml_type, t.n_per_row)


def reconstruction_bound(d: np.ndarray, rtype: int) -> np.ndarray:
    """Largest error the residual type's own quantization may leave, elementwise, for residual d."""
    # scales are stored as f16: relative rounding 2^-11, absolute 2^-25 once subnormal (tiny residuals)
    if rtype == QT.Q8_0:  # one scale per 32: half a step, plus the f16 rounding of the scale
        amax = np.abs(d.reshape(-1, 32)).max(1, keepdims=True)
        b = amax * (0.5 / 127 + 2.0**-10) + 127 * 2.0**-25 + 1e-7
        return np.broadcast_to(b, (amax.shape[0], 32)).reshape(d.shape)
    if rtype == QT.Q6_K:  # 16 sub-scales (int8) of one f16 super-scale per 256
        amax = np.abs(d.reshape(-1, 256)).max(1, keepdims=True)
        b = amax * 0.05 + 127 * 32 * 2.0**-25 + 1e-7
        return np.broadcast_to(b, (amax.shape[0], 256)).reshape(d.shape)
    if rtype in (QT.Q4_K, QT.Q5_K):  # 8 sub-blocks of 32 with 6-bit scales and mins, 4 or 5 bits each
        amax = np.abs(d.reshape(-1, 256)).max(1, keepdims=True)
        b = amax * (0.2 if rtype == QT.Q4_K else 0.1) + 127 * 32 * 2.0**-25 + 1e-7
        return np.broadcast_to(b, (amax.shape[0], 256)).reshape(d.shape)
    if rtype == QT.F16:
        return np.abs(d) * 2.0**-10 + 1e-7
    return np.abs(d) * 1e-6 + 1e-9


def assert_reconstructs(src_path: Path, out: Path, names: list[str] | None = None) -> int:
    checked = 0
    with GGUFFile(src_path) as s, GGUFFile(out / "base.gguf") as b, GGUFFile(out / "residual.gguf") as r:
        for t in r.tensors:
            if names is not None and t.name not in names:
                continue
            S, B, R = full(s, t.name), full(b, t.name), full(r, t.name)
            d = S - B
            err = np.abs(S - (B + R))
            bound = reconstruction_bound(d, t.ggml_type)
            worst = np.argmax(err - bound)
            assert err.flat[worst] <= bound.flat[worst], (
                f"{t.name}: error {err.flat[worst]} > bound {bound.flat[worst]} ({t.type_name})")
            # the stored residual is exactly ggml's quantization of (source - base)
            if t.ggml_type in (QT.Q8_0, QT.Q6_K):
                assert np.array_equal(r.read_rows(t, 0, t.n_rows), _ggml.quantize_rows(d, t.ggml_type))
            checked += 1
        # every tensor the base does not keep exactly has a residual
        for bt in b.tensors:
            if bt.name in r:
                continue
            assert np.array_equal(full(s, bt.name), full(b, bt.name)), f"{bt.name} differs but has no residual"
    return checked


def assert_verifier_runs(split: Path) -> None:
    """The split loads and its verifier decodes a few tokens to finite logits."""
    from bitsplit_llama.runtime.verifier import SplitModel

    with SplitModel(split, n_ctx=64) as sm, sm.verifying() as ctx:
        ctx.decode([1, 300, 301], [0, 1, 2])
        assert np.isfinite(ctx.logits(3)).all()


@pytest.mark.parametrize("residual", ["q6_k", "q8_0", "f16"])
def test_split_reconstructs_source(tiny_f32, tmp_path, residual):
    rep = split_model(tiny_f32, tmp_path / "out", residual=residual, threads=2)
    assert rep.base_path.exists() and rep.residual_path.exists()
    n = assert_reconstructs(tiny_f32, tmp_path / "out")
    assert n == len(rep.residual_tensors) > 0
    # base + residual is far closer to the source than the base alone
    with GGUFFile(tiny_f32) as s, GGUFFile(rep.base_path) as b, GGUFFile(rep.residual_path) as r:
        S, B, R = (full(g, "blk.0.ffn_up.weight") for g in (s, b, r))
        rel = lambda e: float(np.sqrt((e**2).mean() / (S**2).mean()))  # noqa: E731
        assert rel(S - B - R) < rel(S - B) / 10
    assert not list((tmp_path / "out").glob(".bitsplit-*"))


def test_split_metadata_and_fingerprint(tiny_split, tiny_f32):
    with GGUFFile(tiny_split / "base.gguf") as b, GGUFFile(tiny_split / "residual.gguf") as r, GGUFFile(tiny_f32) as s:
        assert r.kv["bitsplit.format_version"] == 1
        assert r.kv["bitsplit.residual_type"] == "q6_k"
        assert r.kv["bitsplit.source.file"] == tiny_f32.name
        assert r.kv["bitsplit.source.architecture"] == "llama"
        assert r.kv["bitsplit.base_fingerprint"] == fingerprint(b)
        assert r.kv["bitsplit.source.fingerprint"] == fingerprint(s)
        assert check_pair(b, r) is True
        # llama.cpp's own Q2_K mix: real Q2_K at width 256
        assert sum(t.ggml_type == QT.Q2_K for t in b.tensors) >= 4
        # norms are kept exact by the base and get no residual
        assert "blk.0.attn_norm.weight" not in r and "blk.0.attn_norm.weight" in b
    info = split_info(tiny_split)
    assert info.fingerprint_ok and info.architecture == "llama" and info.fallbacks == 0
    assert info.residual_types == {"Q6_K": info.residual_tensors}


def test_fingerprint_sees_data_not_only_header(tiny_split, tmp_path):
    """A base with identical header but other data (another imatrix, say) has another fingerprint."""
    copy = tmp_path / "base.gguf"
    shutil.copy(tiny_split / "base.gguf", copy)
    with GGUFFile(copy) as g:
        t = g.tensor("blk.0.ffn_up.weight")
        fp0 = fingerprint(g)
    with open(copy, "r+b") as f:
        f.seek(t.offset)
        b = f.read(1)
        f.seek(t.offset)
        f.write(bytes([b[0] ^ 0xFF]))
    with GGUFFile(copy) as g:
        assert fingerprint(g) != fp0


def test_base_loads_and_generates_in_stock_llama_cpp(tiny_split):
    from bitsplit_llama.runtime.stock import stock_llama

    llm = stock_llama(tiny_split / "base.gguf", n_ctx=128)
    try:
        out = llm.create_completion("the cat is", max_tokens=6, temperature=0.0)
        assert out["usage"]["completion_tokens"] >= 1
        assert isinstance(out["choices"][0]["text"], str)
    finally:
        llm.close()


@pytest.mark.parametrize("qtype", [QT.F16, QT.Q8_0, QT.Q4_K, QT.Q5_0, QT.Q4_1])
def test_quantized_sources(tmp_path, qtype):
    """Quantized sources split too (llama.cpp requantizes); the dequantized source is the reference."""
    src = write_tiny_llama(tmp_path / f"tiny-{qtype.name}.gguf", qtype=int(qtype))
    split_model(src, tmp_path / "out", residual="q8_0", threads=2)
    assert assert_reconstructs(src, tmp_path / "out") > 0


def test_bf16_source(tmp_path):
    src = write_tiny_llama(tmp_path / "tiny-bf16.gguf", qtype=int(QT.BF16))
    with GGUFFile(src) as g:
        assert g.tensor("blk.0.ffn_up.weight").ggml_type == QT.BF16
    split_model(src, tmp_path / "out", residual="q6_k", threads=2)
    assert assert_reconstructs(src, tmp_path / "out") > 0


def test_width_fallback(tmp_path):
    """Rows not a multiple of 256 cannot be Q6_K: the residual falls back to Q8_0 and is counted."""
    assert residual_type_for(256, QT.Q6_K) == QT.Q6_K
    assert residual_type_for(576, QT.Q6_K) == QT.Q8_0
    assert residual_type_for(48, QT.Q6_K) == QT.F16
    assert residual_type_for(48, QT.Q8_0) == QT.F16
    # width 288 = 9 x 32: no K-quant fits, as with SmolLM2's 576
    src = write_llama_gguf(tmp_path / "tiny.gguf", tiny_llama_weights(n_embd=288, n_ff=576))
    rep = split_model(src, tmp_path / "out", residual="q6_k", threads=2)
    assert rep.fallbacks == len(rep.residual_tensors) > 0
    assert rep.residual_types == {"Q8_0": rep.fallbacks}
    assert split_info(tmp_path / "out").fallbacks == rep.fallbacks
    assert assert_reconstructs(src, tmp_path / "out") == rep.fallbacks


def test_existing_output_refused_then_forced(tiny_f32, tmp_path):
    out = tmp_path / "out"
    split_model(tiny_f32, out, threads=2)
    before = (out / "residual.gguf").stat().st_mtime_ns
    with pytest.raises(OutputError, match="already holds base.gguf and residual.gguf"):
        split_model(tiny_f32, out, threads=2)
    assert (out / "residual.gguf").stat().st_mtime_ns == before
    split_model(tiny_f32, out, threads=2, force=True, residual="q8_0")
    assert split_info(out).residual_type == "q8_0"


def _no_outputs(out: Path) -> None:
    if out.exists():
        names = sorted(p.name for p in out.iterdir())
        assert "base.gguf" not in names and "residual.gguf" not in names, names
        assert not [n for n in names if n.startswith(".bitsplit") or ".bitsplit-" in n], names


def test_bad_inputs(tmp_path, tiny_f32):
    out = tmp_path / "out"
    cases = []
    (tmp_path / "empty.gguf").write_bytes(b"")
    (tmp_path / "text.gguf").write_text("hello, I am not a model\n" * 4)
    data = tiny_f32.read_bytes()
    (tmp_path / "trunc.gguf").write_bytes(data[: len(data) // 2])
    (tmp_path / "header-only.gguf").write_bytes(data[:100])
    cases += [
        (tmp_path / "missing.gguf", InputError, "source file not found"),
        (tmp_path, InputError, "is a directory"),
        (tmp_path / "empty.gguf", GGUFFormatError, "not a GGUF file"),
        (tmp_path / "text.gguf", GGUFFormatError, "not a GGUF file"),
        (tmp_path / "trunc.gguf", GGUFFormatError, "truncated GGUF"),
        (tmp_path / "header-only.gguf", GGUFFormatError, "truncated GGUF"),
    ]
    for path, exc, msg in cases:
        with pytest.raises(exc, match=msg) as ei:
            split_model(path, out, threads=2)
        assert str(path) in str(ei.value)
        _no_outputs(out)


def test_unknown_architecture(tmp_path):
    src = write_llama_gguf(tmp_path / "alien.gguf", tiny_llama_weights(), arch="notanarch")
    with pytest.raises(UnsupportedModelError, match="llama.cpp could not quantize it: .*notanarch"):
        split_model(src, tmp_path / "out", threads=2)
    _no_outputs(tmp_path / "out")


def test_invalid_options(tiny_f32, tmp_path):
    with pytest.raises(InvalidOptionError, match="unknown residual type 'q3_k'"):
        split_model(tiny_f32, tmp_path / "out", residual="q3_k")
    with pytest.raises(InvalidOptionError, match="threads"):
        split_model(tiny_f32, tmp_path / "out", threads=0)
    with pytest.raises(InputError, match="imatrix file not found"):
        split_model(tiny_f32, tmp_path / "out", imatrix=tmp_path / "nope.dat")
    f = tmp_path / "afile"
    f.write_text("x")
    with pytest.raises(OutputError, match="not a directory"):
        split_model(tiny_f32, f, threads=2)
    _no_outputs(tmp_path / "out")


def test_unwritable_output_dir(tiny_f32, tmp_path):
    if os.geteuid() == 0:
        ro = Path("/proc/bitsplit-test-out")  # not creatable even by root
    else:
        ro = tmp_path / "ro"
        ro.mkdir()
        ro.chmod(0o500)
    with pytest.raises(OutputError):
        split_model(tiny_f32, ro, threads=2)


def test_disk_full_predicted(tiny_f32, tmp_path, monkeypatch):
    import bitsplit_llama.formats.split as sp

    monkeypatch.setattr(sp.shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10, 10, 1000))
    with pytest.raises(OutputError, match="disk full"):
        split_model(tiny_f32, tmp_path / "out", threads=2)
    _no_outputs(tmp_path / "out")


def test_disk_full_predicted_counts_the_whole_layers_copy(tiny_f32, tmp_path, monkeypatch):
    """With whole layers the base is written twice (quantized, then with the kept layers): a disk
    with room for a plain split only is refused before anything is written."""
    import bitsplit_llama.formats.split as sp

    with GGUFFile(tiny_f32) as g:
        n_params = sum(t.n_elements for t in g.tensors)
    plain = int(n_params * 12 / 8) + (64 << 20)
    monkeypatch.setattr(sp.shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(plain * 4, plain * 2, plain + 1))
    split_model(tiny_f32, tmp_path / "plain", threads=2)  # fits
    with pytest.raises(OutputError, match="disk full"):
        split_model(tiny_f32, tmp_path / "out", threads=2, keep_layers=1)
    _no_outputs(tmp_path / "out")


def test_disk_full_during_write(tiny_f32, tmp_path, monkeypatch):
    from bitsplit_llama.formats import gguf_file

    calls = {"n": 0}
    real = gguf_file.StreamingGGUFWriter.write

    def failing(self, data):
        calls["n"] += 1
        if calls["n"] == 3:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(self, data)

    monkeypatch.setattr(gguf_file.StreamingGGUFWriter, "write", failing)
    with pytest.raises(OutputError, match="disk full while writing"):
        split_model(tiny_f32, tmp_path / "out", threads=2)
    _no_outputs(tmp_path / "out")


def test_interrupt_leaves_nothing(tiny_f32, tmp_path, monkeypatch):
    from bitsplit_llama.formats import gguf_file

    def interrupted(self, data):
        raise KeyboardInterrupt

    monkeypatch.setattr(gguf_file.StreamingGGUFWriter, "write", interrupted)
    with pytest.raises(KeyboardInterrupt):
        split_model(tiny_f32, tmp_path / "out", threads=2)
    _no_outputs(tmp_path / "out")


def test_mismatched_residual_refused(tmp_path):
    a = write_tiny_llama(tmp_path / "a.gguf", seed=1)
    b = write_tiny_llama(tmp_path / "b.gguf", seed=2)
    split_model(a, tmp_path / "A", threads=2)
    split_model(b, tmp_path / "B", threads=2)
    # residual of A with the base of B: same shapes, other weights
    with GGUFFile(tmp_path / "B" / "base.gguf") as base, GGUFFile(tmp_path / "A" / "residual.gguf") as res:
        with pytest.raises(MismatchError, match="not made from this base"):
            check_pair(base, res)
        assert check_pair(base, res, check_fingerprint=False) is False
    shutil.copy(tmp_path / "B" / "base.gguf", tmp_path / "A" / "base.gguf")
    assert split_info(tmp_path / "A").fingerprint_ok is False


@pytest.mark.parametrize("sig,delay", [("SIGINT", 0.0), ("SIGINT", 1.5), ("SIGTERM", 1.0), ("SIGKILL", 0.0), ("SIGKILL", 1.5)])
def test_killed_split_leaves_no_outputs_and_rerun_succeeds(tmp_path, sig, delay):
    """A split killed part-way leaves no base.gguf/residual.gguf; the next run succeeds."""
    import signal
    import subprocess
    import sys
    import time

    src = write_llama_gguf(tmp_path / "mid.gguf", tiny_llama_weights(n_layer=8, n_embd=1024, n_ff=2048))
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "bitsplit_llama.cli", "split", str(src), "-o", str(out), "-q", "-t", "2"]
    # SIGINT as at a terminal: a shell starts a background job (as CI may run the suite) with SIGINT
    # ignored, which the child would inherit, finishing the split (the test then checked nothing)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    t0 = time.monotonic()  # wait until the split is under way (its temporaries exist), then a while more
    while not list(out.glob(".*.tmp")) and proc.poll() is None and time.monotonic() - t0 < 60:
        time.sleep(0.02)
    time.sleep(delay)
    proc.send_signal(getattr(signal, sig))
    _, err = proc.communicate(timeout=120)
    if proc.returncode == 0:
        # the split takes seconds after its temporaries appear: a signal sent then must stop it
        assert delay > 0, f"{sig} sent while the split was under way did not stop it"
        pytest.skip(f"split finished before {sig} at {delay}s")  # nothing to check: it completed
    names = sorted(p.name for p in out.iterdir()) if out.exists() else []
    assert "base.gguf" not in names and "residual.gguf" not in names, names
    if sig != "SIGKILL":
        assert not names, names  # temporaries removed too
        assert proc.returncode in (1, 130) and "interrupted" in err
    # the quantizer child must not survive its parent
    time.sleep(0.5)
    ps = subprocess.run(["pgrep", "-f", f"_quantize_worker.*{out}"], capture_output=True, text=True)
    assert not ps.stdout.strip(), ps.stdout
    rerun = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr
    assert sorted(p.name for p in out.iterdir()) == ["base.gguf", "residual.gguf"]


def _write_legacy_imatrix(path: Path, weights: dict[str, np.ndarray], seed: int = 7) -> None:
    import struct

    rng = np.random.default_rng(seed)
    entries = {k: v for k, v in weights.items() if v.ndim == 2 and k != "token_embd.weight"}
    with open(path, "wb") as f:
        f.write(struct.pack("<i", len(entries)))
        for name, w in entries.items():
            vals = (rng.random(w.shape[1]) ** 4 * 100).astype(np.float32)  # very uneven importance
            nb = name.encode()
            f.write(struct.pack("<i", len(nb)) + nb + struct.pack("<ii", 1, vals.size) + vals.tobytes())
        f.write(struct.pack("<i", 10) + struct.pack("<i", 4) + b"test")


def _write_gguf_imatrix(path: Path, weights: dict[str, np.ndarray]) -> None:
    import gguf

    w = gguf.GGUFWriter(str(path), "imatrix")
    for name, t in weights.items():
        if t.ndim == 2 and name != "token_embd.weight":
            w.add_tensor(name + ".in_sum2", (np.arange(t.shape[1], dtype=np.float32)[None, :] + 1.0) * 3)
            w.add_tensor(name + ".counts", np.array([[3.0]], dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("fmt", ["legacy", "gguf"])
def test_imatrix_changes_the_base(tmp_path, tiny_f32, tiny_split, fmt):
    from bitsplit_llama.formats.imatrix import load_imatrix

    weights = tiny_llama_weights()
    im = tmp_path / f"imatrix.{fmt}"
    (_write_legacy_imatrix if fmt == "legacy" else _write_gguf_imatrix)(im, weights)
    data = load_imatrix(im)
    assert data["blk.0.ffn_up.weight"].shape == (256,)
    if fmt == "gguf":  # sums / counts
        assert np.allclose(data["blk.0.ffn_up.weight"][:3], [1.0, 2.0, 3.0])
    rep = split_model(tiny_f32, tmp_path / "out", imatrix=im, threads=2)
    with GGUFFile(rep.base_path) as b, GGUFFile(tiny_split / "base.gguf") as b0, GGUFFile(rep.residual_path) as r:
        t, t0 = b.tensor("blk.0.ffn_up.weight"), b0.tensor("blk.0.ffn_up.weight")
        assert t.ggml_type == t0.ggml_type == QT.Q2_K
        assert not np.array_equal(b.read_rows(t, 0, t.n_rows), b0.read_rows(t0, 0, t0.n_rows))
        assert r.kv["bitsplit.imatrix"] == im.name
    assert assert_reconstructs(tiny_f32, tmp_path / "out") > 0


def test_bad_imatrix(tmp_path, tiny_f32):
    bad = tmp_path / "bad.dat"
    bad.write_bytes(b"\x05\x00\x00\x00\x10\x00\x00\x00abc")
    with pytest.raises(GGUFFormatError, match="truncated imatrix"):
        split_model(tiny_f32, tmp_path / "out", imatrix=bad)
    _no_outputs(tmp_path / "out")


def test_info_verify_names_the_tensor_whose_data_changed(tiny_split, tmp_path, capsys):
    """The split records a CRC-32 of every base and residual tensor; `bitsplit info --verify`
    checks them and names the tensor a flipped bit changed (before, nothing noticed it)."""
    import json

    from bitsplit_llama.cli import main
    from bitsplit_llama.formats.modeldir import verify_split

    d = tmp_path / "split"
    shutil.copytree(tiny_split, d)
    rep = verify_split(d)
    assert rep.recorded and not rep.bad and rep.checked > 0
    assert main(["info", str(d), "--verify"]) == 0
    assert f"verify: {rep.checked} tensors checked, every one matches" in capsys.readouterr().out
    for fname in ("residual.gguf", "base.gguf"):
        with GGUFFile(d / fname) as g:
            t = g.tensors[len(g.tensors) // 2]
        with open(d / fname, "r+b") as f:  # flip one bit in the middle of that tensor's data
            f.seek(t.offset + t.nbytes // 2)
            b = f.read(1)[0]
            f.seek(t.offset + t.nbytes // 2)
            f.write(bytes([b ^ 0x10]))
        if fname == "residual.gguf":  # without --verify nothing reads the residual's data: unnoticed
            assert main(["info", str(d)]) == 0
            capsys.readouterr()
        assert main(["info", str(d), "--verify", "--json"]) == 1
        got = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["verify"]
        assert {"file": fname, "tensor": t.name} in got["bad"] and not got["ok"]
    assert main(["info", str(d), "--verify"]) == 1
    out = capsys.readouterr().out
    assert "2 of" in out and "do NOT match their checksum" in out


# --- whole layers (--keep-layers / --vram) ------------------------------------------------------

def _layers_with_residual(out: Path) -> set[int]:
    with GGUFFile(out / "residual.gguf") as r:
        return {int(t.name.split(".")[1]) for t in r.tensors if t.name.startswith("blk.")}


def test_keep_layers_quantized_source_kept_as_is(tmp_path):
    """A kept layer of a Q8_0 source is the source's own bytes in the base, with no residual; the
    other layers are split as usual; info reports the placement."""
    src = write_tiny_llama(tmp_path / "tiny-q8.gguf", qtype=int(QT.Q8_0))
    rep = split_model(src, tmp_path / "out", residual="q8_0", threads=2, keep_layers=1)
    assert rep.kept_layers == [0] and rep.n_layers == 2
    assert _layers_with_residual(tmp_path / "out") == {1}
    with GGUFFile(src) as s, GGUFFile(tmp_path / "out" / "base.gguf") as b:
        kept = [t for t in b.tensors if t.name.startswith("blk.0.")]
        assert kept
        for bt in kept:
            st = s.tensor(bt.name)
            assert bt.ggml_type == st.ggml_type
            assert np.array_equal(b.read_rows(bt, 0, bt.n_rows), s.read_rows(st, 0, st.n_rows)), bt.name
        # the split layer is still llama.cpp's Q2_K mix, not the source
        assert b.tensor("blk.1.ffn_up.weight").ggml_type != QT.Q8_0
    assert assert_reconstructs(src, tmp_path / "out") > 0
    info = split_info(tmp_path / "out")
    assert info.kept_layers == [0] and info.n_layers == 2
    assert info.to_json()["placement"] == {"layers": 2, "kept_whole": [0]}


def test_keep_layers_wide_source_becomes_q8_0_and_verifier_stays_exact(tmp_path):
    """An F32 source's kept layer is stored as Q8_0 (no residual); the verifier still equals the
    source within Q8_0's rounding of that layer, and the base loads in stock llama.cpp."""
    src = write_tiny_llama(tmp_path / "tiny.gguf")
    out = tmp_path / "out"
    rep = split_model(src, out, residual="q8_0", threads=2, keep_layers=2)
    assert rep.kept_layers == [0, 1] and _layers_with_residual(out) == set()
    with GGUFFile(src) as s, GGUFFile(out / "base.gguf") as b:
        bt = b.tensor("blk.1.attn_q.weight")
        assert bt.ggml_type == QT.Q8_0
        st = s.tensor(bt.name)
        assert np.array_equal(b.read_rows(bt, 0, bt.n_rows), _ggml.quantize_rows(full(s, bt.name), QT.Q8_0))
        assert b.tensor("blk.1.attn_norm.weight").ggml_type == QT.F32  # 1-D tensors as they were
    from bitsplit_llama.runtime.stock import stock_llama

    llm = stock_llama(out / "base.gguf", n_ctx=128)
    try:
        assert llm.create_completion("the cat is", max_tokens=4, temperature=0.0)["usage"]["completion_tokens"] >= 1
    finally:
        llm.close()


def test_keep_layers_and_vram_options(tiny_f32, tmp_path):
    out = tmp_path / "out"
    with pytest.raises(InvalidOptionError, match="--keep-layers 3: .* has 2 layers"):
        split_model(tiny_f32, out, keep_layers=3)
    with pytest.raises(InvalidOptionError, match="give one"):
        split_model(tiny_f32, out, keep_layers=1, vram_gb=24)
    with pytest.raises(InvalidOptionError, match="--keep-layers: -1"):
        split_model(tiny_f32, out, keep_layers=-1)
    with pytest.raises(InvalidOptionError, match="--vram: 0"):
        split_model(tiny_f32, out, vram_gb=0)
    with pytest.raises(InvalidOptionError, match="--n-ctx: 0"):
        split_model(tiny_f32, out, vram_gb=8, n_ctx=0)
    _no_outputs(out)


def test_vram_budget_chooses_the_layers(tiny_f32, tmp_path):
    """--vram: a budget smaller than the base splits every layer (and says the base does not fit);
    a large one keeps every layer; in between, layers in the order first, last, second..."""
    from bitsplit_llama.formats import placement

    assert placement.keep_order(5) == [0, 4, 1, 3, 2]
    small = split_model(tiny_f32, tmp_path / "small", threads=2, vram_gb=0.001)
    assert small.kept_layers == [] and small.vram_budget["fits"] is False
    assert _layers_with_residual(tmp_path / "small") == {0, 1}
    big = split_model(tiny_f32, tmp_path / "big", threads=2, vram_gb=1000)
    assert big.kept_layers == [0, 1] and big.vram_budget["fits"] is True
    assert _layers_with_residual(tmp_path / "big") == set()
    # exactly the base + KV + reserve + one layer's extra bytes: layer 0 only
    with GGUFFile(tiny_f32) as s, GGUFFile(tmp_path / "small" / "base.gguf") as b:
        one = sum(max(0, placement.kept_bytes(s.tensor(t.name)) - t.nbytes) for t in b.tensors
                  if t.name.startswith("blk.0."))
        need = sum(t.nbytes for t in b.tensors) + placement.kv_cache_bytes(s, 4096) + placement.COMPUTE_RESERVE
        layers, terms = placement.layers_for_vram(s, b, need + one, 4096)
    assert layers == [0] and terms["left"] == 0


def test_cli_split_keep_layers_reports_placement(tiny_f32, tmp_path):
    from typer.testing import CliRunner

    from bitsplit_llama.cli import app

    res = CliRunner().invoke(app, ["split", str(tiny_f32), "-o", str(tmp_path / "out"), "--keep-layers", "1", "-q"])
    assert res.exit_code == 0, res.output
    assert "placement: 1 of 2 layers whole in base.gguf (0), 1 split" in res.output
    res = CliRunner().invoke(app, ["info", str(tmp_path / "out")])
    assert res.exit_code == 0 and "placement: 1 of 2 layers whole in base.gguf (0), 1 split" in res.output
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "bitsplit_llama.cli", "split", str(tiny_f32), "-o", str(tmp_path / "o2"),
                           "--keep-layers", "1", "--vram", "8"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "give one" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    _no_outputs(tmp_path / "o2")


@pytest.mark.parametrize("value,fragment", [
    (b"x", "not a list of layer numbers"),
    (b"7", "names layer 7, the model has layers 0 to 1"),
    (b"1", "layer 1 is whole in the base, but the residual holds tensors of it"),
])
def test_info_refuses_a_corrupt_kept_layers_record(tiny_f32, tmp_path, value, fragment):
    """bitsplit.kept_layers is checked when read: layer numbers of the model, none with a residual."""
    out = tmp_path / "s"
    split_model(tiny_f32, out, threads=2, keep_layers=1)
    res = out / "residual.gguf"
    data = res.read_bytes()
    key = b"bitsplit.kept_layers"
    at = data.index(key) + len(key) + 4 + 8  # value type (u32), string length (u64), then "0"
    assert data[at:at + 1] == b"0"
    res.write_bytes(data[:at] + value + data[at + 1:])
    with pytest.raises(InputError, match=fragment):
        split_info(out)


def _recon_error(src_path: Path, out: Path) -> float:
    total = 0.0
    with GGUFFile(src_path) as s, GGUFFile(out / "base.gguf") as b, GGUFFile(out / "residual.gguf") as r:
        for t in r.tensors:
            total += float(((full(s, t.name) - full(b, t.name) - full(r, t.name)) ** 2).sum())
    return total


def test_residual_auto_meets_the_budget_and_spends_it_well(tiny_f32, tmp_path):
    """--residual auto: each tensor gets one of Q4_K..Q8_0, the residual stays within the bits per
    weight asked, reconstructs the source within each chosen type's bound, and a larger budget never
    makes the weights worse; the verifier runs on the mixed types."""
    errors = []
    for bpw in (4.5, 5.0, 5.5, 6.6, 8.5):
        out = tmp_path / f"auto-{bpw}"
        rep = split_model(tiny_f32, out, residual="auto", residual_bpw=bpw, threads=2)
        assert rep.residual_bpw_corrected <= bpw + 1e-6, (bpw, rep.residual_bpw_corrected)
        assert rep.residual_bpw_corrected > bpw - 0.5  # the budget is spent, not just respected
        assert set(rep.residual_types) <= {"Q4_K", "Q5_K", "Q6_K", "Q8_0"}
        assert assert_reconstructs(tiny_f32, out) == len(rep.residual_tensors)
        errors.append(_recon_error(tiny_f32, out))
        info = split_info(out)
        assert info.residual_type == "auto"
    assert all(a >= b for a, b in zip(errors, errors[1:])), errors
    assert errors[0] > errors[-1]
    assert split_info(tmp_path / "auto-4.5").residual_types == {"Q4_K": len(rep.residual_tensors)}
    assert split_info(tmp_path / "auto-8.5").residual_types == {"Q8_0": len(rep.residual_tensors)}
    assert len(split_info(tmp_path / "auto-5.5").residual_types) > 1  # a real mix in between
    assert_verifier_runs(tmp_path / "auto-5.5")


def test_residual_auto_follows_the_importance_matrix(tiny_f32, tmp_path):
    """Columns an importance matrix says matter make their tensor's error count: with one tensor
    weighted a million times the others, a tight budget gives it the best type."""
    from bitsplit_llama.formats.imatrix import write_imatrix

    with GGUFFile(tiny_f32) as g:
        names = [t.name for t in g.tensors if t.name.startswith("blk.") and len(t.shape) == 2]
        widths = {t.name: t.n_per_row for t in g.tensors}
    heavy = "blk.1.ffn_up.weight"
    entries = {n: (np.full((1, widths[n]), 1e6 if n == heavy else 1.0), np.array([1.0])) for n in names}
    write_imatrix(tmp_path / "im.gguf", entries, architecture="llama", datasets=["x"], chunk_count=1, chunk_size=1)
    plain = split_model(tiny_f32, tmp_path / "plain", residual="auto", residual_bpw=5.0, threads=2)
    weighted = split_model(tiny_f32, tmp_path / "w", residual="auto", residual_bpw=5.0, threads=2,
                           imatrix=tmp_path / "im.gguf")
    kind = {r.name: r.residual_type for r in weighted.residual_tensors}
    assert kind[heavy] == int(QT.Q8_0)
    assert {r.name: r.residual_type for r in plain.residual_tensors}[heavy] != int(QT.Q8_0)


@pytest.mark.parametrize("kw,fragment", [
    ({"residual": "auto"}, "give the budget with --residual-bpw"),
    ({"residual": "q6_k", "residual_bpw": 5.0}, "only with --residual auto"),
    ({"residual": "auto", "residual_bpw": 3.0}, "--residual-bpw: 3.0 is outside 4.5"),
    ({"residual": "auto", "residual_bpw": 9.0}, "is outside"),
])
def test_residual_auto_options_refused(tiny_f32, tmp_path, kw, fragment):
    with pytest.raises(InvalidOptionError, match=fragment):
        split_model(tiny_f32, tmp_path / "out", threads=2, **kw)
    assert not (tmp_path / "out").exists()
