"""The device path without a GPU: the base on a llama.cpp RPC server (`bitsplit rpc-server`) on
loopback, whose buffers this process cannot touch, so every residual product is completed in add
mode (W2 . x computed by the device, R . x added here), with and without overlap.

The tolerance against the all-local verifier. The RPC server computes W2 . x with ggml's own CPU
kernels, which round the activations before a quantized product (to Q8_K blocks for the K-quants,
Q8_0 for Q4_0/Q8_0); the all-local verifier computes (W2 + R) . x in this library's kernels, which
round them differently. Add mode run locally (``set_mode("add")``: the same ggml kernels on this
CPU) makes exactly the device's rounding, so the RPC verifier must equal it bit for bit; and it
differs from the all-local verifier by that rounding alone, measured on these models below (and in
the README on real ones with ``bitsplit eval --rpc``).

Needs llama-cpp-python built with the RPC backend (``.ci/run`` makes sure it is; elsewhere the
tests are skipped with the reason, or fail with ``BITSPLIT_REQUIRE_RPC=1``).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from collections import Counter

import numpy as np
import pytest

from bitsplit_llama.native import policy
from bitsplit_llama.runtime import rpc
from bitsplit_llama.speculative.generate import Generator
from bitsplit_llama.speculative.sampling import SamplingParams
from test_engine import PROMPTS, _chi2_critical, _two_sample_chi2
from test_verifier import EXACT, make_f32_split

if not rpc.available():
    if os.environ.get("BITSPLIT_REQUIRE_RPC"):
        raise RuntimeError(f"BITSPLIT_REQUIRE_RPC is set but llama-cpp-python has no RPC backend; {rpc.REBUILD}")
    pytest.skip(f"llama-cpp-python was built without the RPC backend; rebuild it with: {rpc.REBUILD}",
                allow_module_level=True)

CLI = [sys.executable, "-c", "from bitsplit_llama.cli import entry; entry()"]
TEXT = [1] + list(range(260, 290))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`bitsplit rpc-server` on a free loopback port, in its own process."""

    def __init__(self, threads: int = 1):
        self.port = _free_port()
        self.endpoint = f"127.0.0.1:{self.port}"
        self.proc = subprocess.Popen([*CLI, "rpc-server", "--port", str(self.port), "-t", str(threads)],
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        deadline = time.monotonic() + 60
        while True:
            try:
                rpc.hello(rpc.Endpoint("127.0.0.1", self.port), 2.0)
                return
            except rpc.RpcError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    out = self.proc.communicate()[0] if self.proc.poll() is not None else ""
                    raise RuntimeError(f"rpc-server did not start: {out}")
                time.sleep(0.2)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.kill()
        self.proc.wait(timeout=30)


@pytest.fixture(scope="module")
def server():
    s = Server()
    yield s.endpoint
    s.stop()


@pytest.fixture(scope="module", params=["rpc", "gpu"])
def device(request):
    """Where the base goes: the RPC server on loopback (always), or this machine's GPU (where
    llama-cpp-python was built for one and sees it: bench/gpu_check.sh)."""
    if request.param == "gpu":
        if rpc.gpu_count() == 0:
            pytest.skip("no GPU seen by llama.cpp here (bench/gpu_check.sh runs these tests on one)")
        return {"n_gpu_layers": 99}
    return {"rpc": request.getfixturevalue("server")}


@pytest.fixture(scope="module")
def f32_pair(tmp_path_factory):
    return make_f32_split(tmp_path_factory.mktemp("f32split-rpc"))


@pytest.fixture(scope="module")
def f32_split(f32_pair):
    return f32_pair[1]


def _logits(split, text, **kw) -> tuple[np.ndarray, object]:
    from bitsplit_llama.runtime.verifier import SplitModel

    mode = kw.pop("mode", None)
    with SplitModel(split, **EXACT, **kw) as sm:  # llama.cpp's own batch noise off
        if mode:
            sm.residual.set_mode(mode)
        outs = []
        for _ in range(2):  # the second pass runs with what the first one learned (overlap)
            sm.ctx.clear()
            sm.residual.reset_counters()
            with sm.verifying() as ctx:
                ctx.decode(text, list(range(len(text))))
                outs.append(ctx.logits(len(text)).copy())
        assert np.array_equal(outs[0], outs[1])
        return outs[1], sm.residual.counters()


@pytest.mark.parametrize("which", ["f32", "quantized"])
def test_verifier_on_the_device_equals_add_mode_bit_for_bit(device, f32_pair, tiny_f32, tiny_split, which):
    from test_verifier import logits_of

    src, split = f32_pair if which == "f32" else (tiny_f32, tiny_split)
    ref = logits_of(src, TEXT, **EXACT)
    local, c_local = _logits(split, TEXT)
    add, c_add = _logits(split, TEXT, mode="add")
    # uncompensated: the device's own rounding, as add mode's ggml-cpu rounds (tests/test_compensation.py
    # checks the device with its rounding compensated, the default)
    dev_seq, c_seq = _logits(split, TEXT, overlap=False, compensation="off", **device)
    dev, c_dev = _logits(split, TEXT, compensation="off", **device)
    dev_at, c_at = _logits(split, TEXT, compensation="off", overlap_at="products", **device)
    # every product was completed in add mode, with its base's buffers on the server
    assert c_local.n_add_products == 0 and c_local.n_products > 0
    for c in (c_seq, c_dev):
        assert c.n_products == 0 and c.n_add_products == c_local.n_products and c.n_errors == 0
        assert c.bytes_from_device > 0 and c.bytes_to_device > 0
    assert c_add.bytes_from_device == 0  # local add mode moves nothing
    # overlap: every product's R . x ran beside the device's W2 . x; without it, none did
    assert c_dev.n_overlapped == c_dev.n_add_products and c_seq.n_overlapped == 0
    # the device synchronises once per product (the embedding lookup stays on the host, replaced),
    # plus once per input asked for with overlap (4 per layer: attention in and out, FFN in and inner)
    assert c_seq.n_stops == c_seq.n_add_products
    assert c_seq.n_stops < c_dev.n_stops < 2 * c_seq.n_stops
    assert np.array_equal(dev, dev_seq)
    # overlap started at each input's first product: no stop at the inputs, the products of inputs
    # with several (q, k, v; gate, up) taken from the runner, the others computed at their stop
    assert c_at.n_stops == c_seq.n_stops and c_at.n_add_products == c_seq.n_add_products and c_at.n_errors == 0
    assert 0 < c_at.n_overlapped < c_at.n_add_products
    assert np.array_equal(dev_at, dev)
    if "rpc" in device:  # the same ggml CPU kernels on the server: the same rounding, bit for bit
        assert np.array_equal(dev, add)
    # the all-local verifier differs by the device's activation rounding alone. None for F32
    # weights (ggml multiplies F32 by F32: float summation order only). For a Q2_K base, ggml
    # rounds x to 8 bits per 256 values (Q8_K) before W2 . x, the same order as the Q6_K residual's
    # own error on this random model: measured, the RMS error against the source goes from 0.019
    # (all local) to 0.046 (on the device), against 0.6 for the base alone; the gate is 4x.
    rms = lambda a: float(np.sqrt(np.mean((a - ref) ** 2)))  # noqa: E731
    print(f"{which}: RMS against the source: all local {rms(local):.3g}, device {rms(dev):.3g}")
    if which == "f32":
        assert float(np.abs(local - dev).max()) <= (1e-4 if "rpc" in device else 1e-2) * float(ref.std())
    else:
        base = logits_of(split / "base.gguf", TEXT, **EXACT)
        assert rms(dev) <= 4 * rms(local) < rms(base) / 4
        if "rpc" in device:
            assert rms(dev) > rms(local)  # the device's rounding costs something here
        assert (dev.argmax(-1) == ref.argmax(-1)).mean() >= 0.9


@pytest.mark.parametrize("nodes", [1, 4, 16])
def test_greedy_speculative_equals_verifier_alone_on_the_device(device, f32_split, nodes):
    with Generator(f32_split, n_ctx=512, tree_nodes=nodes, **device) as g:
        assert g.sm.n_gpu_layers > 0 and g.sm.drafter == "llama.cpp"
        # every layer on the device: the products are R . x alone, and the family pinned is the
        # generation's for that kind, whatever the tree (BITSPLIT_KERNEL's where set)
        assert g.sm.residual_alone and g.kernel == policy.generation_family(residual_alone=True)
        for p in PROMPTS[:3]:
            plain = g.generate(p, max_tokens=40, speculative=False)
            spec = g.generate(p, max_tokens=40, speculative=True)
            assert spec.tokens == plain.tokens
        assert g.sm.residual.counters().n_add_products > 0


def test_speculative_sampling_is_lossless_on_the_device(device, tiny_split):
    """As test_engine's chi-square test, with the base on the RPC server (fewer samples: each pass
    crosses the socket)."""
    n = 600
    with Generator(tiny_split, n_ctx=128, tree_nodes=8, **device) as g:
        samples = {}
        for spec, offset in ((False, 0), (True, 10_000)):
            c2 = Counter()
            for i in range(n):
                sp = SamplingParams(temperature=0.9, top_k=12, top_p=1.0, min_p=0.0, seed=offset + i)
                t = g.generate(PROMPTS[1], max_tokens=2, sampling=sp, speculative=spec).tokens
                c2[t[1]] += 1
            samples[spec] = c2
    stat, df = _two_sample_chi2(samples[False], samples[True])
    assert df >= 3
    assert stat < _chi2_critical(df, 0.001), (stat, df)


# -- faults ---------------------------------------------------------------------------------------

def test_refused_silent_and_bad_endpoints_are_one_clear_error(tiny_split):
    from bitsplit_llama.errors import InvalidOptionError

    port = _free_port()
    t0 = time.monotonic()
    with pytest.raises(rpc.RpcError, match=rf"127.0.0.1:{port}: connection refused.*bitsplit rpc-server"):
        Generator(tiny_split, n_ctx=128, tree_nodes=4, rpc=f"127.0.0.1:{port}")
    # a server that accepts and never answers (or one busy with another client)
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(4)
    try:
        ep = f"127.0.0.1:{silent.getsockname()[1]}"
        with pytest.raises(rpc.RpcError, match=rf"{ep}: no answer within 2 s"):
            Generator(tiny_split, n_ctx=128, tree_nodes=4, rpc=ep, rpc_timeout=2)
    finally:
        silent.close()
    assert time.monotonic() - t0 < 30
    for bad, msg in [("localhost", "not HOST:PORT"), ("h:0", "not HOST:PORT"), ("[::1]:5", "not IPv6"),
                     ("a:1,a:1", "given twice"), ("", "empty")]:
        with pytest.raises(InvalidOptionError, match=msg):
            rpc.parse_endpoints(bad)
    with pytest.raises(InvalidOptionError, match="puts nothing on the RPC device"):
        Generator(tiny_split, n_ctx=128, rpc="127.0.0.1:1", n_gpu_layers=0)


def test_bench_against_a_refused_server_says_so(capsys, tiny_split, tiny_f32):
    """bench loads its bitsplit side in a worker process: the worker's load error reaches the user as
    that error (it used to read "the bitsplit benchmark worker died: ...RpcError")."""
    from bitsplit_llama.cli import main

    port = _free_port()
    assert main(["bench", str(tiny_split), "--vs", str(tiny_f32), "--rpc", f"127.0.0.1:{port}", "-n", "4", "-q"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.endswith(f"127.0.0.1:{port}: connection refused; start one there with `bitsplit rpc-server "
                        f"--host 127.0.0.1 --port {port}`") and "worker" not in err, err
    assert len(err.splitlines()) == 1


_CHILD = textwrap.dedent("""
    import faulthandler, signal, sys
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # a hung child's stacks (_wait_or_dump)
    from bitsplit_llama.speculative.generate import Generator
    from bitsplit_llama.runtime.rpc import RpcError
    g = Generator(sys.argv[1], n_ctx=512, tree_nodes=4, rpc=sys.argv[2], rpc_timeout=float(sys.argv[3]))
    g.generate([1, 270, 271], max_tokens=4)
    print("ready", flush=True)
    sys.stdin.readline()
    if sys.argv[4] == "between":
        try:
            g.generate([1, 270, 271], max_tokens=8)
        except RpcError as e:
            print("raised:", e, flush=True)
        g.close()
        print("closed", flush=True)
        sys.exit(0)
    try:
        for _ in range(100000):
            g.generate([1, 270, 271], max_tokens=64)
    except RpcError as e:  # the server went between two passes: as the CLI reports it
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
""")


def _child(split, endpoint, timeout, how):
    return subprocess.Popen([sys.executable, "-c", _CHILD, str(split), endpoint, str(timeout), how],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_or_dump(child: subprocess.Popen, timeout: float, what: str) -> None:
    """Wait for the child; past ``timeout``, fail with its Python threads' stacks (faulthandler,
    SIGUSR1) and the end of its stderr, so that a hang says where it was."""
    try:
        child.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        child.send_signal(signal.SIGUSR1)
        time.sleep(2)
        child.kill()
        _, err = child.communicate(timeout=30)
        pytest.fail(f"the client did not end within {timeout:g} s of {what}; its stderr (with its stacks):\n{err[-6000:]}")


@pytest.mark.parametrize("fault", ["dies", "stalls"])
def test_server_lost_mid_generation_ends_with_one_message(tiny_split, fault):
    """llama.cpp's RPC client aborts on a lost connection; the process ends with one line naming the
    server (no stack trace, no core dump), within the --rpc-timeout for a server that stops answering."""
    srv = Server()
    child = _child(tiny_split, srv.endpoint, 3, "during")
    try:
        assert child.stdout.readline().strip() == "ready"
        child.stdin.write("go\n")
        child.stdin.flush()
        time.sleep(0.5)  # generating now
        t0 = time.monotonic()
        srv.proc.send_signal(signal.SIGKILL if fault == "dies" else signal.SIGSTOP)
        _wait_or_dump(child, 60, f"the server's {'death' if fault == 'dies' else 'stall'}")
        waited = time.monotonic() - t0
        err = child.stderr.read()
        assert child.returncode == 1, err
        if fault == "stalls" or "lost the RPC device" in err:  # during a pass: llama.cpp's abort, our words
            assert f"bitsplit: lost the RPC device {srv.endpoint}" in err and "within 3 s" in err, err
        else:  # between two passes: seen before llama.cpp talks to it
            assert f"RPC server {srv.endpoint} closed the connection" in err, err
        assert "Traceback" not in err and "ggml_abort" not in err, err
        assert sum(line.startswith(("bitsplit:", "error:")) for line in err.splitlines()) == 1, err
        assert waited < 30
    finally:
        if child.poll() is None:
            child.kill()
        srv.stop()


def test_server_lost_between_calls_raises_and_closes_cleanly(tiny_split):
    srv = Server()
    child = _child(tiny_split, srv.endpoint, 5, "between")
    try:
        assert child.stdout.readline().strip() == "ready"
        srv.stop()
        child.stdin.write("go\n")
        child.stdin.flush()
        out, err = child.communicate(timeout=60)
        assert child.returncode == 0, err
        assert f"raised: RPC server {srv.endpoint} closed the connection" in out
        assert out.strip().endswith("closed")
    finally:
        if child.poll() is None:
            child.kill()


def test_rpc_server_command(tmp_path):
    from bitsplit_llama.cli import main

    # a port in use is one clear error
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        r = subprocess.run([*CLI, "rpc-server", "--port", str(port)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and f"cannot listen on 127.0.0.1:{port}: already in use" in r.stderr
    assert main(["rpc-server", "--port", "0"]) == 2
    not_dir = tmp_path / "file"
    not_dir.write_text("x")
    assert main(["rpc-server", "--port", str(_free_port()), "--cache", str(not_dir)]) == 2
    # binding beyond loopback warns that the protocol has no authentication
    port = _free_port()
    p = subprocess.Popen([*CLI, "rpc-server", "--host", "0.0.0.0", "--port", str(port), "-t", "1"],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        first = p.stdout.readline()
        assert "no authentication" in first
        deadline = time.monotonic() + 30
        while True:
            try:
                assert rpc.hello(rpc.Endpoint("127.0.0.1", port), 2.0)[0] == rpc.PROTO_MAJOR
                break
            except rpc.RpcError:
                assert time.monotonic() < deadline
                time.sleep(0.2)
    finally:
        p.kill()
        p.wait()


def test_cli_run_and_eval_with_the_base_on_the_device(server, tiny_split, tiny_f32, tmp_path, capsys):
    import json

    from bitsplit_llama.cli import main

    out = {}
    for args in (["--tree-nodes", "4"], ["--no-spec"]):
        assert main(["run", str(tiny_split), "-p", "hello world", "-n", "12", "--rpc", server, "--json", *args]) == 0
        out[args[0]] = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["--tree-nodes"]["tokens"] == out["--no-spec"]["tokens"] and len(out["--no-spec"]["tokens"]) > 0
    text = tmp_path / "t.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 20)
    assert main(["eval", str(tiny_split), "--reference", str(tiny_f32), "--text", str(text), "--n-ctx", "32",
                 "--chunks", "2", "--rpc", server, "--json"]) == 0
    rep = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    names = [m["name"] for m in rep["models"]]
    # the device row as run computes it: its rounding compensated by the CPU backend's rule
    assert names == ["bitsplit verifier", f"bitsplit verifier, base on rpc {server}, compensated"]
    assert [m.get("compensation") for m in rep["models"]] == [None, "cpu"]
    assert all(m["kl_mean"] > 0 for m in rep["models"])
    # options: a bad endpoint or timeout is a usage error (exit 2) naming the value
    assert main(["run", str(tiny_split), "-p", "x", "--rpc", "nohost"]) == 2
    assert "'nohost' is not HOST:PORT" in capsys.readouterr().err
    assert main(["run", str(tiny_split), "-p", "x", "--rpc", server, "--rpc-timeout", "0"]) == 2
    capsys.readouterr()
    if rpc.gpu_count() == 0:  # -ngl without a GPU or --rpc would silently keep everything here
        assert main(["run", str(tiny_split), "-p", "x", "-ngl", "2"]) == 2
        assert "llama.cpp sees no GPU here" in capsys.readouterr().err
