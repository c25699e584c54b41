"""Compensation of a device's activation rounding (native/compensate.c, bitsplit_ctx_set_compensation):
the host knows x and the device's rule, so it knows the rounding's error e = x - round(x); a second
product of the base on the device, W2 . e, added with R . x, takes most of that error away. Checked
emulated (replace mode, numerics.c), in add mode with llama.cpp's CPU backend as the device, and with
the base on an RPC server, where it must equal local add mode bit for bit (the same ggml-cpu kernels)."""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from bitsplit_llama.errors import InvalidOptionError
from test_numerics import TEXT
from test_rpc import Server
from test_verifier import EXACT

CLI = [sys.executable, "-c", "from bitsplit_llama.cli import entry; entry()"]


def _logits(split, numerics=None, mode=None, comp=None, passes=1, device_add=True, **kw):
    from bitsplit_llama.runtime.verifier import SplitModel

    with SplitModel(split, **EXACT, **kw) as sm:
        sm.residual.set_device_add(device_add)
        if mode:
            sm.residual.set_mode(mode)
        if numerics:
            sm.residual.set_numerics(numerics)
        if comp:
            sm.residual.set_compensation(comp)
        outs = []
        with sm.verifying() as ctx:  # a pass that wants no logits: the head's product has no rows
            ctx.decode(TEXT[:4], list(range(4)), logits=False)
        for _ in range(passes):  # a second pass runs with what the first learned (overlap)
            sm.ctx.clear()
            sm.residual.reset_counters()
            with sm.verifying() as ctx:
                ctx.decode(TEXT, list(range(len(TEXT))))
                outs.append(ctx.logits(len(TEXT)).copy())
        c = sm.residual.counters()
        assert c.n_errors == 0
        for o in outs[1:]:
            assert np.array_equal(o, outs[0])
        return outs[-1], c


def _gap(a, b) -> float:
    return float(np.abs(a - b).max())


def _input_widths(split) -> int:
    """The widths summed over a pass's distinct inputs of products: q's (k and v read it too),
    attn_output's, gate's (up reads it too), down's, the output head's."""
    from gguf import GGUFReader

    names = ("attn_q", "attn_output", "ffn_gate", "ffn_down")
    tensors = GGUFReader(str(split / "base.gguf")).tensors
    return sum(int(t.shape[0]) for t in tensors if t.name.split(".")[-2] in names or t.name == "output.weight")


@pytest.mark.parametrize("backend", ["cpu", "cuda"])
def test_emulated_compensation_takes_the_devices_rounding_away(tiny_split, backend):
    host, _ = _logits(tiny_split)
    dev, _ = _logits(tiny_split, numerics=backend)
    comp, c = _logits(tiny_split, numerics=backend, comp=backend)
    floor, _ = _logits(tiny_split, numerics="float")  # no rounding of W2 . x at all: add mode's R . x alone
    print(f"{backend}: gap to the host {_gap(dev, host):.3g}, compensated {_gap(comp, host):.3g}, "
          f"float {_gap(floor, host):.3g}")
    # the rounding shows on this model: 1.8x the floor's gap with a 2-core Zen 4's policy (R . x alone
    # avx512vnni-int16, W2 + R another family), over 2x where one family takes both
    assert _gap(dev, floor) > 1.5 * _gap(floor, host)
    # compensated, what is left of the rounding is e's own, ~1/254 of x's: the floor (R . x's own rounding);
    # 0.109x with the int16 families on a 2-core Zen 4 (cuda), below 0.1x with avx512-bf16
    assert _gap(comp, floor) < 0.15 * _gap(dev, floor)
    assert _gap(comp, host) < 1.1 * _gap(floor, host)
    assert c.n_compensated == 0 and c.n_add_products == 0  # emulated: nothing on a device
    # a wrong rule compensates little: the cuda rule's error does not cancel ggml-cpu's rounding
    if backend == "cpu":
        wrong, _ = _logits(tiny_split, numerics="cpu", comp="cuda")
        assert _gap(wrong, floor) > 0.3 * _gap(dev, floor)


def test_compensation_in_add_mode_on_llama_cpps_cpu_backend(tiny_split):
    """Add mode run locally: W2 . x by llama.cpp's CPU kernels (Q8_K activations), W2 . e by a CPU
    backend of the library's own on the same weights; close to the emulation of the same thing."""
    floor, _ = _logits(tiny_split, numerics="float")
    add, _ = _logits(tiny_split, mode="add")
    add_c, c = _logits(tiny_split, mode="add", comp="cpu", passes=2)
    emul_c, _ = _logits(tiny_split, numerics="cpu", comp="cpu")
    print(f"add mode: gap to the floor {_gap(add, floor):.3g}, compensated {_gap(add_c, floor):.3g}")
    assert _gap(add_c, floor) < 0.1 * _gap(add, floor)
    assert _gap(add_c, emul_c) < 0.1 * _gap(add, floor)
    # every product with a residual (and any weight kept exact) had a second product
    assert c.n_add_products > 0 and c.n_compensated >= c.n_add_products and c.seconds_compensate > 0
    assert c.n_overlapped == c.n_add_products  # with overlap: W2 . e for each input's products at its stop


def test_compensation_in_chunks_of_columns_gives_the_same(tiny_split, monkeypatch):
    """The device's part is cut into chunks of columns (its memory bounded): one column per chunk
    gives the whole pass's compensation, up to ggml-cpu's own arithmetic, which is not the same for
    1 column as for many on this model's weight types (its multi-column kernels)."""
    add, _ = _logits(tiny_split, mode="add")
    whole, c_whole = _logits(tiny_split, mode="add", comp="cpu")
    monkeypatch.setenv("BITSPLIT_COMP_CHUNK_KB", "1")  # under one column of the widest product
    chunked, c_chunked = _logits(tiny_split, mode="add", comp="cpu")
    print(f"chunked vs whole {_gap(chunked, whole):.3g}, the compensation itself {_gap(add, whole):.3g}")
    assert _gap(chunked, whole) < 0.05 * _gap(add, whole)
    assert c_chunked.n_compensated == c_whole.n_compensated > 0


def test_compensation_with_the_base_on_an_rpc_device_equals_add_mode(tiny_split, tiny_f32):
    floor, _ = _logits(tiny_split, numerics="float")
    add_c, _ = _logits(tiny_split, mode="add", comp="cpu")
    server = Server()
    try:
        dev, c_dev = _logits(tiny_split, rpc=server.endpoint, compensation="off", passes=2)
        seq_c, c_seq = _logits(tiny_split, rpc=server.endpoint, comp="cpu", overlap=False)
        dev_c, c_c = _logits(tiny_split, rpc=server.endpoint, passes=2)  # compensation "auto": the CPU's rule
        # the overlap started at each input's first product: one stop per product, the same sums
        dev_p, c_p = _logits(tiny_split, rpc=server.endpoint, passes=2, overlap_at="products")
        # the sum made on the host instead (W2 . x and W2 . e down, the sum back up): the same logits, more bytes
        dev_h, c_h = _logits(tiny_split, rpc=server.endpoint, passes=2, device_add=False)
        dev_h0, c_h0 = _logits(tiny_split, rpc=server.endpoint, passes=2, device_add=False, compensation="off")
        # bench reports it per verify pass, in its JSON and its table
        b = subprocess.run([*CLI, "bench", str(tiny_split), "--vs", str(tiny_f32), "--rpc", server.endpoint, "-n", "6",
                            "--repeat", "1", "--json", "-q"], capture_output=True, text=True, timeout=600)
        assert b.returncode == 0, b.stderr
        rep = json.loads(b.stdout.strip().splitlines()[-1])
        assert rep["compensation"] == "cpu" and rep["add_mode_per_pass"]["compensated_per_pass"] > 0
        b = subprocess.run([*CLI, "bench", str(tiny_split), "--vs", str(tiny_f32), "--rpc", server.endpoint, "-n", "6",
                            "--repeat", "1", "-q", "--compensation", "off"], capture_output=True, text=True, timeout=600)
        assert b.returncode == 0, b.stderr
        assert "per verify pass" in b.stdout and "rounding" in b.stdout
    finally:
        server.stop()
    print(f"rpc device: gap to the floor {_gap(dev, floor):.3g}, compensated {_gap(dev_c, floor):.3g}")
    # the same ggml-cpu kernels on the server as in local add mode: bit for bit, with overlap or without,
    # the sum made on the device or on the host
    assert np.array_equal(dev_c, add_c) and np.array_equal(seq_c, add_c) and np.array_equal(dev_h, add_c)
    assert np.array_equal(dev_h0, dev)
    assert np.array_equal(dev_p, add_c) and c_p.n_stops < c_c.n_stops
    assert c_p.bytes_to_device == c_c.bytes_to_device  # e still once per input
    assert c_h.bytes_from_device > c_h0.bytes_from_device > c_c.bytes_from_device == c_dev.bytes_from_device
    assert _gap(dev_c, floor) < 0.1 * _gap(dev, floor)
    # one second product per product with overlap too (each input's products in one graph)
    assert c_seq.n_compensated == c_c.n_compensated >= c_c.n_add_products == c_dev.n_add_products > 0
    assert c_c.n_overlapped == c_c.n_add_products
    # with the sum on the device (the default) e goes up and nothing more comes down; e goes up once per
    # input, not once per product: k and v use q's, up uses gate's
    assert c_c.bytes_to_device > c_dev.bytes_to_device and c_c.bytes_from_device == c_dev.bytes_from_device
    assert c_c.bytes_to_device - c_dev.bytes_to_device == 4 * len(TEXT) * _input_widths(tiny_split)


def test_compensation_refusals(tiny_split, tiny_f32, tmp_path):
    from bitsplit_llama.runtime.verifier import SplitModel

    with SplitModel(tiny_split, **EXACT) as sm:
        with pytest.raises(InvalidOptionError, match="compensation: 'vulkan' unknown"):
            sm.residual.set_compensation("vulkan")
        sm.residual.set_numerics("cpu", 4)
        with pytest.raises(InvalidOptionError, match="outlier channels"):
            sm.residual.set_compensation("cpu")
        sm.residual.set_numerics("cpu", 0)
        sm.residual.set_compensation("cpu")
        with pytest.raises(InvalidOptionError):
            sm.residual.set_numerics("cpu", 4)
    from bitsplit_llama.speculative.options import GenerationOptions

    with pytest.raises(InvalidOptionError, match="--compensation: 'vulkan' unknown"):
        GenerationOptions(compensation="vulkan")
    out = subprocess.run([*CLI, "run", str(tiny_split), "-p", "x", "--compensation", "vulkan"], capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 2 and "--compensation: 'vulkan' unknown" in out.stderr, out.stderr
    # all local (no device) nothing is compensated, whatever the setting
    with SplitModel(tiny_split, **EXACT, compensation="cpu") as sm:
        assert sm.compensation == "off"
    text = tmp_path / "t.txt"
    text.write_text("def add(a, b):\n    return a + b\n" * 60)
    base = [*CLI, "eval", str(tiny_split), "--reference", str(tiny_f32), "--text", str(text)]
    for extra, msg in ((["--compensation", "maybe"], "--compensation: 'maybe' unknown"),
                       (["--compensation", "on"], "give --device-numerics, --rpc or -ngl"),
                       (["--compensation", "on", "--device-numerics", "cpu", "--outlier-channels", "4"],
                        "give one")):
        out = subprocess.run([*base, *extra], capture_output=True, text=True, timeout=600)
        assert out.returncode != 0 and msg in out.stderr, out.stderr
        assert out.stderr.count("\n") <= 2


def test_eval_scores_each_row_without_and_with_compensation(tiny_split, tiny_f32, tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("def add(a, b):\n    return a + b\n" * 60)
    out = subprocess.run([*CLI, "eval", str(tiny_split), "--reference", str(tiny_f32), "--text", str(text),
                          "--n-ctx", "64", "--chunks", "2", "--device-numerics", "host,cpu",
                          "--compensation", "both", "--json"], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    rows = json.loads(out.stdout.strip().splitlines()[-1])["models"]
    assert [(r["numerics"], r.get("compensation")) for r in rows] == [("host", None), ("cpu", None), ("cpu", "cpu")]
    assert rows[2]["name"].endswith("cpu numerics, compensated")
    assert rows[2]["kl_mean"] < rows[1]["kl_mean"]
