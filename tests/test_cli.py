"""The command line: exit codes and one-line messages, through the real entry point."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from bitsplit_llama.cli import app, main


def run_main(capsys, *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture()
def files(tmp_path, tiny_f32):
    (tmp_path / "empty.gguf").write_bytes(b"")
    (tmp_path / "notgguf.gguf").write_text("plain text\n" * 10)
    data = tiny_f32.read_bytes()
    (tmp_path / "trunc.gguf").write_bytes(data[: len(data) * 2 // 3])
    return tmp_path


CASES = [
    # args (with {t} = tmp dir), exit code, message fragment
    (["split", "{t}/missing.gguf", "-o", "{t}/o"], 1, "source file not found"),
    (["split", "{t}", "-o", "{t}/o"], 1, "is a directory"),
    (["split", "{t}/empty.gguf", "-o", "{t}/o"], 1, "not a GGUF file"),
    (["split", "{t}/notgguf.gguf", "-o", "{t}/o"], 1, "not a GGUF file"),
    (["split", "{t}/trunc.gguf", "-o", "{t}/o"], 1, "truncated GGUF"),
    (["split", "{src}", "-o", "{t}/o", "--residual", "q5_k"], 2, "unknown residual type 'q5_k'"),
    (["split", "{src}", "-o", "{t}/o", "--threads", "0"], 2, "--threads: 0"),
    (["split", "{src}", "-o", "{t}/o", "--threads", "many"], 2, "--threads"),
    (["split", "{src}"], 2, "Missing option '-o'"),
    (["split"], 2, "Missing argument"),
    (["frobnicate"], 2, "No such command"),
    (["info", "{t}/nowhere"], 1, "model directory not found"),
    (["info", "{src}"], 1, "is not a directory"),
    (["info", "{t}"], 1, "not a split model directory"),
    (["fetch", "no-such-model"], 1, "unknown model 'no-such-model'"),
]


@pytest.mark.parametrize("args,code,fragment", CASES, ids=[" ".join(c[0])[:40] for c in CASES])
def test_cli_errors(capsys, files, tiny_f32, args, code, fragment):
    argv = [a.format(t=files, src=tiny_f32) for a in args]
    got, out, err = run_main(capsys, *argv)
    assert got == code, (got, out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("bitsplit: error: ") and fragment in lines[0], lines[0]
    assert "Traceback" not in err
    assert not (files / "o" / "base.gguf").exists()


def test_cli_split_info_json(capsys, tiny_f32, tmp_path):
    code, out, err = run_main(capsys, "split", str(tiny_f32), "-o", str(tmp_path / "m"), "--json", "-t", "2")
    assert code == 0, err
    rep = json.loads(out.strip().splitlines()[-1])
    assert rep["residual_type"] == "q6_k" and rep["fallbacks"] == 0 and rep["base_bpw"] > 2
    code, out, err = run_main(capsys, "info", str(tmp_path / "m"), "--json")
    assert code == 0, err
    info = json.loads(out.strip().splitlines()[-1])
    assert info["fingerprint_ok"] is True and info["residual_tensors"] == sum(rep["residual_types"].values())
    # refusing to overwrite, then --force
    code, out, err = run_main(capsys, "split", str(tiny_f32), "-o", str(tmp_path / "m"), "-q")
    assert code == 1 and "use --force" in err
    code, out, err = run_main(capsys, "split", str(tiny_f32), "-o", str(tmp_path / "m"), "-q", "--force",
                              "--residual", "q8_0")
    assert code == 0 and "residual.gguf" in out


def test_cli_info_reports_fingerprint_mismatch(capsys, tmp_path):
    from synth import write_tiny_llama

    for seed, d in ((1, "a"), (2, "b")):
        src = write_tiny_llama(tmp_path / f"{d}.gguf", seed=seed)
        assert main(["split", str(src), "-o", str(tmp_path / d), "-q"]) == 0
    (tmp_path / "a" / "base.gguf").write_bytes((tmp_path / "b" / "base.gguf").read_bytes())
    capsys.readouterr()
    code, out, err = run_main(capsys, "info", str(tmp_path / "a"))
    assert code == 1 and "DOES NOT MATCH" in out


def test_cli_runner_help_lists_commands():
    res = CliRunner().invoke(app, ["--help"])
    assert res.exit_code == 0
    for cmd in ("split", "info", "fetch", "demo"):
        assert cmd in res.output


def test_console_script_one_line_errors(tmp_path):
    """The installed entry point, in a fresh process: one line on stderr, status 2 for usage."""
    proc = subprocess.run([sys.executable, "-m", "bitsplit_llama.cli", "split", str(tmp_path / "x.gguf")],
                          capture_output=True, text=True)
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "Missing option" in proc.stderr
    proc = subprocess.run([sys.executable, "-m", "bitsplit_llama.cli", "split", str(tmp_path / "x.gguf"), "-o",
                           str(tmp_path / "o")], capture_output=True, text=True)
    assert proc.returncode == 1 and proc.stderr.startswith("bitsplit: error: ") and "not found" in proc.stderr
    assert not Path(tmp_path / "o" / "base.gguf").exists()
