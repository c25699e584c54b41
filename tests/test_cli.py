"""The command line: exit codes and one-line messages, through the real entry point."""

from __future__ import annotations

import json
import os
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
    (["split", "{src}", "-o", "{t}/o", "--residual", "q3_k"], 2, "unknown residual type 'q3_k'"),
    (["split", "{src}", "-o", "{t}/o", "--threads", "0"], 2, "--threads: 0"),
    (["split", "{src}", "-o", "{t}/o", "--residual", "auto"], 2, "give the budget with --residual-bpw"),
    (["split", "{src}", "-o", "{t}/o", "--base", "q9_k"], 2, "--base: 'q9_k' unknown"),
    (["split", "{src}", "-o", "{t}/o", "--base", "iq2_xs"], 2, "--base iq2_xs: llama.cpp makes it only with an importance matrix"),
    (["split", "{src}", "-o", "{t}/o", "--residual-bpw", "5"], 2, "--residual-bpw: only with --residual auto"),
    (["split", "{src}", "-o", "{t}/o", "--threads", "many"], 2, "--threads"),
    (["split", "{src}"], 2, "Missing option '-o'"),
    (["split"], 2, "Missing argument"),
    (["frobnicate"], 2, "No such command"),
    (["info", "{t}/nowhere"], 1, "model directory not found"),
    (["info", "{src}"], 1, "is not a directory"),
    (["info", "{t}"], 1, "not a split model directory"),
    (["fetch", "no-such-model"], 1, "unknown model 'no-such-model'"),
    (["run", "{t}", "-p", "x", "--tree-nodes", "300"], 2, "--tree-nodes: 300 is more than 256"),
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


def _one_error_line(err: str) -> str:
    """The one error line (llama.cpp's own log may precede it), and no traceback."""
    lines = [l for l in err.strip().splitlines() if l.startswith("bitsplit: error: ")]
    assert len(lines) == 1, err
    assert "Traceback" not in err
    return lines[0]


def test_os_error_in_a_command_is_one_line(capsys, monkeypatch, tmp_path):
    """An OSError a command meets (here: a full disk while describing a split) is one line, exit 1."""
    import bitsplit_llama.formats.modeldir as modeldir

    def full(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(modeldir, "split_info", full)
    monkeypatch.delenv("BITSPLIT_DEBUG", raising=False)
    code, out, err = run_main(capsys, "info", str(tmp_path))
    assert code == 1
    assert "No space left on device" in _one_error_line(err)


def test_llama_cpp_failure_in_run_is_one_line(capsys, monkeypatch, tiny_split):
    """A RuntimeError from inside llama-cpp-python (standing in for a llama.cpp failure while
    decoding) is one line naming it, exit 1."""
    from bitsplit_llama.runtime.llamacpp import Context

    def fail(self, *a, **k):
        raise RuntimeError("llama_decode returned -3")

    monkeypatch.setattr(Context, "decode", fail)
    monkeypatch.delenv("BITSPLIT_DEBUG", raising=False)
    code, out, err = run_main(capsys, "run", str(tiny_split), "-p", "the cat", "-n", "4", "--tree-nodes", "4",
                               "--n-ctx", "256")
    assert code == 1
    line = _one_error_line(err)
    assert "RuntimeError: llama_decode returned -3" in line and "BITSPLIT_DEBUG=1" in line


def test_interrupt_is_one_line_and_130(capsys, monkeypatch, tmp_path):
    import bitsplit_llama.formats.modeldir as modeldir

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(modeldir, "split_info", interrupted)
    monkeypatch.delenv("BITSPLIT_DEBUG", raising=False)
    code, out, err = run_main(capsys, "info", str(tmp_path))
    assert code == 130 and "interrupted" in _one_error_line(err)


def test_bitsplit_debug_shows_the_traceback(capsys, monkeypatch, tmp_path):
    import bitsplit_llama.formats.modeldir as modeldir

    def full(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(modeldir, "split_info", full)
    monkeypatch.setenv("BITSPLIT_DEBUG", "1")
    with pytest.raises(OSError, match="No space left"):
        main(["info", str(tmp_path)])
    # and in a fresh process, as a user sees it: the traceback on stderr, a non-zero status
    code = ("import sys, bitsplit_llama.formats.modeldir as m\n"
            "def full(*a, **k):\n    raise OSError(28, 'No space left on device')\n"
            "m.split_info = full\n"
            "from bitsplit_llama.cli import entry\n"
            f"sys.argv = ['bitsplit', 'info', {str(tmp_path)!r}]\n"
            "entry()\n")
    for debug, traceback in (("1", True), ("", False)):
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              env={**os.environ, "BITSPLIT_DEBUG": debug})
        assert proc.returncode == 1, proc.stderr
        assert ("Traceback" in proc.stderr) == traceback and "No space left on device" in proc.stderr, proc.stderr


def test_cli_bench_json_and_plot(capsys, tiny_split, tiny_f32, tmp_path):
    """`bitsplit bench` end to end on a tiny model: both workers run the same prompts (bitsplit also
    without speculation), the JSON line holds the contract's keys with consistent values, and the plot
    is a PNG."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("the cat\nonce upon a time\n")
    png = tmp_path / "bench.png"
    code, out, err = run_main(capsys, "bench", str(tiny_split), "--vs", str(tiny_f32), "--prompts", str(prompts),
                              "-n", "12", "--tree-nodes", "4", "--repeat", "2", "--with-no-spec", "--json",
                              "--plot", str(png), "--act-bits", "8")
    assert code == 0, err
    s = json.loads(out.strip().splitlines()[-1])
    for key in ("tokens_per_second", "vs_tokens_per_second", "speedup_vs", "accepted_per_verify", "tree_nodes"):
        assert key in s, key
    assert s["runs"] == 4 and s["prompts"] == 2 and s["tree_nodes"] == 4
    assert s["act_bits"] == 8  # as asked (a q6_k residual: one value)
    assert s["draft_vocab"] == 0  # auto: a tiny vocabulary (and a split head) keeps the whole head
    assert s["kernel_policy"] == "built-in"  # which kernel policy chose the family (the tests: built-in)
    assert s["tokens_per_second"] > 0 and s["vs_tokens_per_second"] > 0
    # ratios are rounded to 4 decimals, rates to 3
    assert s["speedup_vs"] == pytest.approx(s["tokens_per_second"] / s["vs_tokens_per_second"], rel=1e-3, abs=1e-4)
    assert 1.0 <= s["accepted_per_verify"] <= 5.0  # at most the root + a 4-node chain's depth
    from bitsplit_llama.native import policy

    # what ran: the native drafting family if it took any product (passes of its smallest batch on)
    assert s["drafter"] in {policy.draft_kernel() or "llama.cpp", "llama.cpp"}
    assert (s["drafter"] != "llama.cpp") == (s["draft_products"] > 0)
    assert s["peak_rss_bytes"] > 0 and s["memory_bandwidth_bytes_per_second"] > 0
    assert sum(s["time_split"][k] for k in ("draft", "verify", "other_python")) == pytest.approx(1.0, abs=0.02)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # --with-no-spec: the verifier alone ran on the same prompts, in the same run
    assert s["no_spec_tokens_per_second"] > 0
    assert s["speedup_vs_no_spec"] == pytest.approx(s["tokens_per_second"] / s["no_spec_tokens_per_second"], rel=1e-3, abs=1e-4)
    assert s["no_spec_vs_stock"] == pytest.approx(s["no_spec_tokens_per_second"] / s["vs_tokens_per_second"], rel=1e-3, abs=1e-4)


def test_cli_bench_refuses_plot_before_running(capsys, tiny_split, tiny_f32, tmp_path):
    code, out, err = run_main(capsys, "bench", str(tiny_split), "--vs", str(tiny_f32), "--plot", str(tmp_path / "x.jpg"))
    assert code == 2 and "--plot" in err and ".png" in err
    code, out, err = run_main(capsys, "bench", str(tiny_split), "--vs", str(tiny_f32),
                              "--plot", str(tmp_path / "nodir" / "x.png"))
    assert code == 1 and "not a writable directory" in err


def test_rpc_without_the_backend_says_how_to_rebuild(monkeypatch, tiny_split, capsys):
    """A llama-cpp-python built without RPC (pip's cache reuses such a wheel whatever CMAKE_ARGS
    say): --rpc and rpc-server are one line naming the rebuild, and doctor says it."""
    import llama_cpp

    from bitsplit_llama.cli import main
    from bitsplit_llama.runtime import rpc

    monkeypatch.setattr(llama_cpp, "llama_supports_rpc", lambda: False)
    assert not rpc.available()
    with pytest.raises(rpc.RpcUnavailableError, match="pip cache remove 'llama_cpp_python\\*'.*-DGGML_RPC=on"):
        rpc.require()
    assert main(["run", str(tiny_split), "-p", "x", "--rpc", "127.0.0.1:1"]) == 1
    err = capsys.readouterr().err
    assert "built without it" in err and "-DGGML_RPC=on" in err and len(err.strip().splitlines()) == 1
    assert main(["rpc-server", "--port", "50999"]) == 1
    assert "built without it" in capsys.readouterr().err


def test_commands_load_llama_cpp_before_numpy(tiny_split):
    """A llama.cpp linked with a static libstdc++ crashes in its tokenizer when numpy's shared
    libstdc++ was loaded first (stock llama_cpp.Llama too; seen on an H200 machine): every command
    loads llama.cpp's libraries first. A fresh process, so that nothing here was imported before."""
    code = ("import sys\nfrom bitsplit_llama.cli import main\n"
            f"rc = main(['info', {str(tiny_split)!r}])\n"
            "names = list(sys.modules)\n"
            "print(rc, names.index('llama_cpp.llama_cpp') < names.index('numpy'))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "0 True", out.stdout


@pytest.mark.parametrize("debug", ["", "1"])
def test_cli_turns_off_ggmls_debugger_backtrace(debug):
    """The console entry sets GGML_NO_BACKTRACE (unless BITSPLIT_DEBUG, or the user set it): a
    llama.cpp abort then prints its message, not gdb attaching to the process. Checked by what ggml
    itself does: its backtrace printer, called directly, writes nothing."""
    code = ("import ctypes, os, sys\n"
            "from bitsplit_llama import cli\n"
            "sys.argv = ['bitsplit', '--help']\n"
            "try:\n    cli.entry()\nexcept SystemExit:\n    pass\n"
            "print('GGML_NO_BACKTRACE=' + repr(os.environ.get('GGML_NO_BACKTRACE')), flush=True)\n"
            "if os.environ.get('GGML_NO_BACKTRACE'):\n"
            "    import llama_cpp\n"
            "    lib = ctypes.CDLL(os.path.join(os.path.dirname(llama_cpp.__file__), 'lib', 'libggml-base.so'))\n"
            "    sys.stderr.flush()\n"
            "    lib.ggml_print_backtrace()\n")
    env = {k: v for k, v in os.environ.items() if k not in ("GGML_NO_BACKTRACE", "BITSPLIT_DEBUG")}
    if debug:
        env["BITSPLIT_DEBUG"] = debug
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    if debug:
        assert "GGML_NO_BACKTRACE=None" in p.stdout
    else:
        assert "GGML_NO_BACKTRACE='1'" in p.stdout
        assert p.stderr.strip() == "", p.stderr  # no gdb, no backtrace_symbols
    # a value the user set is kept
    env["GGML_NO_BACKTRACE"] = "yes"
    env.pop("BITSPLIT_DEBUG", None)
    p = subprocess.run([sys.executable, "-c", code.split("if os.environ")[0]], env=env, capture_output=True, text=True,
                       timeout=120)
    assert "GGML_NO_BACKTRACE='yes'" in p.stdout, p.stderr
