"""Bad input at every entry point, soak, concurrency.

Every bad split directory is refused by the CLI (run, eval, bench, serve, info: one line, exit 1)
and by the Python API (a BitsplitError subclass), leaving the process usable.
"""

from __future__ import annotations

import os
import shutil
import struct
import threading
from pathlib import Path

import numpy as np
import pytest

from bitsplit_llama.cli import main
from bitsplit_llama.errors import (BitsplitError, BusyError, ContextLimitError, GGUFFormatError, InputError,
                                   InvalidOptionError, MismatchError, UnsupportedModelError)
from bitsplit_llama.formats.gguf_file import GGUFFile, StreamingGGUFWriter, fingerprint
from bitsplit_llama.formats.split import split_model
from synth import tiny_llama_weights, write_llama_gguf, write_tiny_llama


def _copy_split(src: Path, dst: Path) -> Path:
    dst.mkdir(parents=True)
    for n in ("base.gguf", "residual.gguf"):
        shutil.copy(src / n, dst / n)
    return dst


@pytest.fixture(scope="module")
def bad_dirs(tmp_path_factory, tiny_split, tiny_f32):
    """name -> (split dir or path, expected exception class, message fragment)"""
    root = tmp_path_factory.mktemp("bad")
    cases = {}
    cases["missing-dir"] = (root / "nope", InputError, "model directory not found")
    f = root / "a-file"
    f.write_text("x")
    cases["file-not-dir"] = (f, InputError, "is not a directory")
    (root / "empty").mkdir()
    cases["empty-dir"] = (root / "empty", InputError, "base.gguf and residual.gguf missing")
    d = _copy_split(tiny_split, root / "base-empty")
    (d / "base.gguf").write_bytes(b"")
    cases["base-empty"] = (d, GGUFFormatError, "not a GGUF file")
    d = _copy_split(tiny_split, root / "base-not-gguf")
    (d / "base.gguf").write_text("hello\n" * 100)
    cases["base-not-gguf"] = (d, GGUFFormatError, "not a GGUF file")
    d = _copy_split(tiny_split, root / "base-truncated")
    data = (d / "base.gguf").read_bytes()
    (d / "base.gguf").write_bytes(data[: len(data) // 2])
    cases["base-truncated"] = (d, GGUFFormatError, "truncated GGUF")
    d = _copy_split(tiny_split, root / "residual-truncated")
    data = (d / "residual.gguf").read_bytes()
    (d / "residual.gguf").write_bytes(data[: len(data) - 1000])  # mid-tensor: the last one
    cases["residual-truncated"] = (d, GGUFFormatError, "truncated GGUF")
    # another model with the same shapes
    other = write_tiny_llama(root / "other.gguf", seed=9)
    split_model(other, root / "other-split", threads=2)
    d = _copy_split(tiny_split, root / "residual-other-model")
    shutil.copy(root / "other-split" / "residual.gguf", d / "residual.gguf")
    cases["residual-other-model"] = (d, MismatchError, "not made from this base")
    # another base of the same model: an imatrix changes the base, not its header
    from test_split import _write_legacy_imatrix

    im = root / "imatrix.dat"
    _write_legacy_imatrix(im, tiny_llama_weights())
    split_model(tiny_f32, root / "imatrix-split", imatrix=im, threads=2)
    d = _copy_split(tiny_split, root / "residual-other-base")
    shutil.copy(root / "imatrix-split" / "residual.gguf", d / "residual.gguf")
    cases["residual-other-base"] = (d, MismatchError, "not made from this base")
    # the residual claims another architecture
    d = _copy_split(tiny_split, root / "other-arch")
    raw = bytearray((d / "residual.gguf").read_bytes())
    key = b"bitsplit.source.architecture"
    i = raw.find(key) + len(key) + 4 + 8  # value type (u32), string length (u64)
    assert raw[i:i + 5] == b"llama"
    raw[i:i + 5] = b"gemma"
    (d / "residual.gguf").write_bytes(bytes(raw))
    cases["other-architecture"] = (d, MismatchError, "architecture 'gemma'")
    # corrupted tensor infos
    for label, patch in (("absurd-dims", lambda raw, off: raw.__setitem__(slice(off + 4, off + 12), struct.pack("<Q", 1 << 44))),
                         ("offset-past-end", lambda raw, off: raw.__setitem__(slice(off + 24, off + 32), struct.pack("<Q", 1 << 40))),
                         ("unknown-type", lambda raw, off: raw.__setitem__(slice(off + 20, off + 24), struct.pack("<I", 97)))):
        d = _copy_split(tiny_split, root / label)
        raw = bytearray((d / "residual.gguf").read_bytes())
        name = b"blk.0.ffn_up.weight"
        off = raw.find(name) + len(name)  # n_dims (u32), dims (2 x u64), type (u32), offset (u64)
        patch(raw, off)
        (d / "residual.gguf").write_bytes(bytes(raw))
        cases[label] = (d, GGUFFormatError, "blk.0.ffn_up.weight")
    # the header claims one tensor fewer than the split wrote (damage a parser cannot see by itself)
    d = _copy_split(tiny_split, root / "residual-missing-tensor")
    raw = bytearray((d / "residual.gguf").read_bytes())
    (n,) = struct.unpack_from("<Q", raw, 8)
    struct.pack_into("<Q", raw, 8, n - 1)
    (d / "residual.gguf").write_bytes(bytes(raw))
    cases["residual-missing-tensor"] = (d, MismatchError, f"holds {n - 1} tensors but was written with {n}")
    # a residual of an unsupported type (Q4_0)
    d = _copy_split(tiny_split, root / "unsupported-type")
    with GGUFFile(d / "base.gguf") as b, GGUFFile(tiny_split / "residual.gguf") as r:
        fp = fingerprint(b)
        kv = r.kv
        t = b.tensor("blk.0.ffn_up.weight")
    w = StreamingGGUFWriter(d / "residual.gguf", "bitsplit-residual")
    w.kv.add_uint32("bitsplit.format_version", 1)
    w.kv.add_string("bitsplit.base_fingerprint", fp)
    w.kv.add_string("bitsplit.source.architecture", kv["bitsplit.source.architecture"])
    w.add_tensor_info(t.name, t.shape, 2)  # Q4_0
    w.begin_data()
    w.begin_tensor(t.name)
    w.write(np.zeros(t.n_rows * (t.n_per_row // 32) * 18, dtype=np.uint8))
    w.end_tensor()
    w.finish()
    w.close()
    cases["unsupported-type"] = (d, UnsupportedModelError, "Q4_0")
    return cases


BAD = ["missing-dir", "file-not-dir", "empty-dir", "base-empty", "base-not-gguf", "base-truncated",
       "residual-truncated", "residual-other-model", "residual-other-base", "other-architecture", "absurd-dims",
       "offset-past-end", "unknown-type", "unsupported-type", "residual-missing-tensor"]


@pytest.mark.parametrize("case", BAD)
def test_api_refuses_bad_split(bad_dirs, tiny_split, case):
    from bitsplit_llama import BitsplitLlama
    from bitsplit_llama.native.residual import Residual

    path, exc, frag = bad_dirs[case]
    with pytest.raises(exc) as ei:
        BitsplitLlama(path, n_ctx=128, verbose=False, tree_nodes=4)
    assert frag in str(ei.value) and isinstance(ei.value, BitsplitError)
    if path.is_dir() and (path / "residual.gguf").exists():
        with pytest.raises(BitsplitError):
            Residual(path)
    # the process is still fine: a good model loads and generates
    with BitsplitLlama(tiny_split, n_ctx=128, verbose=False, tree_nodes=4) as ok:
        assert ok("the", max_tokens=3, temperature=0)["usage"]["completion_tokens"] >= 1


@pytest.mark.parametrize("case", BAD)
@pytest.mark.parametrize("command", ["run", "info", "eval", "bench", "serve"])
def test_cli_refuses_bad_split(bad_dirs, tiny_f32, tmp_path, capsys, case, command):
    path, exc, frag = bad_dirs[case]
    text = tmp_path / "t.txt"
    text.write_text("the cat is on the mat. " * 40)
    argv = {
        "run": ["run", str(path), "-p", "the cat", "-n", "4", "--tree-nodes", "4"],
        "info": ["info", str(path)],
        "eval": ["eval", str(path), "--reference", str(tiny_f32), "--text", str(text), "--n-ctx", "64", "-q"],
        "bench": ["bench", str(path), "--vs", str(tiny_f32), "-n", "4", "-q"],
        "serve": ["serve", str(path), "--port", "1"],
    }[command]
    if command == "info" and case in ("residual-other-model", "residual-other-base"):
        code = main(argv)  # info reports a fingerprint mismatch instead of refusing
        out, err = capsys.readouterr()
        assert code == 1 and "DOES NOT MATCH" in out
        return
    code = main(argv)
    out, err = capsys.readouterr()
    lines = [l for l in err.strip().splitlines() if l.startswith("bitsplit: error:")]
    assert code == 1, (code, err)
    assert len(lines) == 1 and "Traceback" not in err, err
    if command != "info" or case not in ("unsupported-type",):
        assert frag in lines[0] or frag.lower() in lines[0].lower(), lines[0]


OPTION_CASES = [
    (["run", "{split}", "-p", "x", "--temp", "-1"], 2, "temperature: -1.0 is negative"),
    (["run", "{split}", "-p", "x", "--top-p", "0"], 2, "top-p: 0.0 is outside (0, 1]"),
    (["run", "{split}", "-p", "x", "--top-p", "1.5"], 2, "top-p: 1.5 is outside (0, 1]"),
    (["run", "{split}", "-p", "x", "--min-p", "2"], 2, "min-p"),
    (["run", "{split}", "-p", "x", "--top-k", "-3"], 2, "top-k"),
    (["run", "{split}", "-p", "x", "--tree-nodes", "lots"], 2, "--tree-nodes: 'lots'"),
    (["run", "{split}", "-p", "x", "-n", "-5"], 2, "-n: -5"),
    (["run", "{split}", "-p", "the cat " * 100, "--n-ctx", "64", "--tree-nodes", "4"], 1,
     "prompt has"),
    (["run", "{split}", "-p", "x", "--threads", "0"], 2, "--threads: 0"),
    (["run", "{split}", "-p", "x", "--precision", "fp8"], 2, "precision"),
    (["run", "{split}", "-p", "x", "--drafter", "gpu"], 2, "--drafter: 'gpu'"),
    (["bench", "{split}", "--vs", "{src}", "--drafter", "gpu"], 2, "--drafter: 'gpu'"),
    (["run", "{split}", "-p", "x", "--act-bits", "4"], 2, "--act-bits: '4' unknown (expected one of: auto, 16, 8)"),
    (["bench", "{split}", "--vs", "{src}", "--act-bits", "12"], 2, "--act-bits: '12'"),
    (["eval", "{split}", "--reference", "{src}", "--text", "{tmp}/t.txt", "--act-bits", "auto8"], 2,
     "--act-bits: 'auto8'"),
    (["run", "{split}", "-p", "x", "--draft-vocab", "0"], 2,
     "--draft-vocab: '0' unknown (expected auto, all, or a number of token ids >= 1)"),
    (["bench", "{split}", "--vs", "{src}", "--draft-vocab", "most"], 2, "--draft-vocab: 'most'"),
    (["run", "{split}", "-p", "x", "--draft-vocab", "100"], 2, "--draft-vocab 100: needs the native drafter"),
    (["eval", "{split}", "--reference", "{src}", "--text", "{tmp}/nope.txt"], 1, "text file not found"),
    (["eval", "{split}", "--reference", "{tmp}/nope.gguf", "--text", "{tmp}/t.txt"], 1, "reference file not found"),
    (["eval", "{split}", "--reference", "{src}", "--text", "{tmp}/t.txt", "--vs", "{tmp}/nope.gguf"], 1,
     "--vs model file not found"),
    (["eval", "{split}", "--reference", "{src}", "--text", "{tmp}/t.txt", "--n-ctx", "4"], 2, "--n-ctx: 4"),
    (["eval", "{split}", "--reference", "{src}", "--text", "{tmp}/t.txt", "--kernel", "generic,avx3"], 2,
     "--kernel: 'avx3' is not a kernel family that runs on this CPU"),
    (["bench", "{split}", "--vs", "{tmp}/nope.gguf"], 1, "--vs model file not found"),
    (["bench", "{split}", "--vs", "{src}", "-n", "1"], 2, "-n: 1"),
    (["bench", "{split}", "--vs", "{src}", "--prompts", "{tmp}/nope.txt"], 1, "prompts file not found"),
    (["serve", "{split}", "--port", "0"], 2, "--port: 0"),
    (["plan", "{tmp}/nope", "--vram", "24"], 1, "neither a GGUF file nor a known model"),
    (["plan", "llama-3-70b", "--vram", "-1"], 2, "--vram: -1"),
    (["plan", "llama-3-70b", "--vram", "24", "--residual", "q4"], 2, "--residual: 'q4'"),
    (["plan", "llama-3-70b"], 2, "--vram: required"),
    (["plan", "llama-3-70b", "--gpu", "igpu"], 2, "--gpu: 'igpu'"),
    (["plan", "{split}", "--gpu", "none", "--vram", "24"], 2, "--vram with --gpu none"),
    (["plan", "{split}", "--vram", "24"], 2, "planned with --gpu none"),
    (["plan", "{tmp}", "--gpu", "none"], 1, "not a split model directory"),
    (["split", "{src}", "-o", "{tmp}/out", "--residual", "q3_k"], 2, "--residual: unknown residual type 'q3_k'"),
]


@pytest.mark.parametrize("args,code,frag", OPTION_CASES, ids=[" ".join(c[0][:1] + c[0][3:5]) for c in OPTION_CASES])
def test_cli_bad_options(tiny_split, tiny_f32, tmp_path, capsys, args, code, frag):
    (tmp_path / "t.txt").write_text("the cat is on the mat. " * 40)
    argv = [a.format(split=tiny_split, src=tiny_f32, tmp=tmp_path) for a in args]
    got = main(argv)
    out, err = capsys.readouterr()
    lines = [l for l in err.strip().splitlines() if l.startswith("bitsplit: error:")]
    assert got == code, (got, err)
    assert len(lines) == 1 and frag in lines[0], err
    assert "Traceback" not in err


def test_api_bad_values(tiny_split):
    from bitsplit_llama import BitsplitLlama
    from bitsplit_llama.speculative.generate import Generator

    with BitsplitLlama(tiny_split, n_ctx=128, verbose=False, tree_nodes=4) as llm:
        with pytest.raises(ValueError):
            llm("the " * 200, max_tokens=4)  # llama_cpp.Llama's own check: the prompt exceeds n_ctx
        assert llm("the", max_tokens=2, temperature=0)["usage"]["completion_tokens"] >= 1
    with Generator(tiny_split, n_ctx=64, tree_nodes=4) as g:
        with pytest.raises(ContextLimitError):
            g.generate([1] + [300] * 80, max_tokens=4)
    with pytest.raises(InvalidOptionError):
        Generator(tiny_split, tree_nodes="many")
    with pytest.raises(InvalidOptionError, match="act-bits"):
        Generator(tiny_split, act_bits="7")
    with pytest.raises(InvalidOptionError, match="draft-vocab"):
        Generator(tiny_split, draft_vocab="-3")


# -- soak and leaks -----------------------------------------------------------------------------

def _rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _maps() -> int:
    with open("/proc/self/maps") as f:
        return sum(1 for _ in f)


def test_soak_many_calls_and_reloads(tiny_split):
    """5,000 generated tokens over many calls on one model, then repeated create/close: memory settles,
    no descriptor or mapping leaks. Prints the RSS curve's first and last values."""
    from bitsplit_llama import BitsplitLlama

    curve = []
    with BitsplitLlama(tiny_split, n_ctx=512, verbose=False, tree_nodes=8) as llm:
        total = 0
        i = 0
        while total < 5000:
            out = llm(f"the cat number {i} is", max_tokens=64, temperature=0.8, seed=i)
            total += out["usage"]["completion_tokens"]
            i += 1
            if i % 10 == 0:
                curve.append(_rss())
    print(f"soak: {total} tokens in {i} calls, RSS {curve[0] / 2**20:.1f} -> {curve[-1] / 2**20:.1f} MiB")
    assert curve[-1] - curve[len(curve) // 4] < 16 * 2**20  # settled after warm-up
    fds0, maps0 = _fds(), _maps()
    rss = []
    for k in range(8):
        with BitsplitLlama(tiny_split, n_ctx=256, verbose=False, tree_nodes=4) as llm:
            llm("the", max_tokens=4, temperature=0)
        rss.append(_rss())
    print(f"reloads: RSS {rss[0] / 2**20:.1f} -> {rss[-1] / 2**20:.1f} MiB, fds {fds0} -> {_fds()}, maps {maps0} -> {_maps()}")
    assert _fds() <= fds0 and _maps() <= maps0 + 8
    assert rss[-1] - rss[1] < 32 * 2**20


def test_two_models_in_one_process_are_independent(tiny_split, tmp_path):
    from bitsplit_llama import BitsplitLlama

    other = write_tiny_llama(tmp_path / "o.gguf", seed=5)
    split_model(other, tmp_path / "o", threads=2)
    with BitsplitLlama(tiny_split, n_ctx=256, verbose=False, tree_nodes=8) as a:
        ref_a = a("the cat", max_tokens=20, temperature=0)["choices"][0]["text"]
    with BitsplitLlama(tmp_path / "o", n_ctx=256, verbose=False, tree_nodes=8) as b:
        ref_b = b("the cat", max_tokens=20, temperature=0)["choices"][0]["text"]
    with BitsplitLlama(tiny_split, n_ctx=256, verbose=False, tree_nodes=8) as a, \
            BitsplitLlama(tmp_path / "o", n_ctx=256, verbose=False, tree_nodes=8) as b:
        for _ in range(2):
            assert a("the cat", max_tokens=20, temperature=0)["choices"][0]["text"] == ref_a
            assert b("the cat", max_tokens=20, temperature=0)["choices"][0]["text"] == ref_b


def test_concurrent_calls_on_one_model_never_interleave(tiny_split):
    from bitsplit_llama import BitsplitLlama

    with BitsplitLlama(tiny_split, n_ctx=512, verbose=False, tree_nodes=8) as llm:
        ref = llm("the dog", max_tokens=48, temperature=0)["choices"][0]["text"]
        results, errors = [], []

        def call():
            try:
                results.append(llm("the dog", max_tokens=48, temperature=0)["choices"][0]["text"])
            except BusyError as exc:
                errors.append(str(exc))

        ts = [threading.Thread(target=call) for _ in range(4)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        assert results and all(r == ref for r in results)  # whoever ran got the right text
        assert len(results) + len(errors) == 4 and all("busy" in e for e in errors)
        assert llm("the dog", max_tokens=48, temperature=0)["choices"][0]["text"] == ref  # state intact
