"""Emulated device numerics (native/numerics.c, ``bitsplit eval --device-numerics``): each backend's
rounding of the activations before ``W2 . x``, checked against an independent numpy transcription of
the vendored llama.cpp rules, and the verifier it gives checked against the real thing where this
machine has it: llama.cpp's CPU backend computing ``W2 . x`` (add mode run locally, which the RPC
device equals bit for bit: tests/test_rpc.py)."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from bitsplit_llama.errors import InvalidOptionError, UnsupportedModelError
from bitsplit_llama.native.residual import NUMERICS, round_activations
from bitsplit_llama.tools.quality import check_numerics_list

Q2_K, Q8_0, F16, F32, Q4_K, IQ1_M, Q4_0 = 10, 8, 1, 0, 12, 29, 2
F = np.float32


def _blocks(x: np.ndarray, b: int) -> np.ndarray:
    return x.reshape(x.shape[0], -1, b)


def _round_away(v: np.ndarray) -> np.ndarray:
    """C's roundf (halves away from zero), the sum taken in float64 so that 0.49999997 stays below 1/2"""
    return (np.sign(v) * np.floor(np.abs(v).astype(np.float64) + 0.5)).astype(F)


def _half(v) -> np.ndarray:
    with np.errstate(over="ignore"):  # beyond half's range: inf, as the C conversion gives
        return np.asarray(v, dtype=F).astype(np.float16).astype(F)


def ref_q8_k(x: np.ndarray) -> np.ndarray:
    """ggml-quants.c quantize_row_q8_K_ref, dequantized"""
    xb = _blocks(x, 256)
    idx = np.abs(xb).argmax(-1)[..., None]  # the first of equal magnitudes, as `ax > amax`
    mx = np.take_along_axis(xb, idx, -1)
    with np.errstate(divide="ignore", invalid="ignore"):
        iscale = F(-127.0) / mx
        q = np.minimum(np.rint(iscale * xb), F(127))
        out = q * (F(1) / iscale)
    return np.where(mx == 0, F(0), out).reshape(x.shape).astype(F)


def ref_q8_0(x: np.ndarray) -> np.ndarray:
    """ggml-cpu arch/x86 quantize_row_q8_0 (AVX2), dequantized"""
    xb = _blocks(x, 32)
    amax = np.abs(xb).max(-1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        out = np.rint(xb * (F(127) / amax)) * _half(amax / F(127))
    return np.where(amax == 0, F(0), out).reshape(x.shape).astype(F)


def ref_mmvq(x: np.ndarray) -> np.ndarray:
    """ggml-cuda quantize_q8_1, dequantized"""
    xb = _blocks(x, 32)
    amax = np.abs(xb).max(-1, keepdims=True)
    d = amax / F(127)
    with np.errstate(divide="ignore", invalid="ignore"):
        out = _round_away(xb / d) * _half(d)
    return np.where(amax == 0, F(0), out).reshape(x.shape).astype(F)


def ref_mmq(x: np.ndarray, block: int, half_d: bool) -> np.ndarray:
    """ggml-cuda quantize_mmq_q8_1, dequantized: one d per `block` values, float or half"""
    xb = _blocks(x, block)
    amax = np.abs(xb).max(-1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        d_inv = F(127) / amax
        d = F(1) / d_inv
        out = _round_away(xb * d_inv) * (_half(d) if half_d else d)
    return np.where(amax == 0, F(0), out).reshape(x.shape).astype(F)


def _acts(rows: int, k: int = 512, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, k)).astype(F)
    x[:, 7] *= 40  # an outlier channel, as real activations have
    x[0, 256:512] = 0  # a block of zeros
    x[-1, 300] = 3.0e-6  # tiny values: half's subnormals
    return x


@pytest.mark.parametrize("rows", [1, 8, 9, 32])
def test_each_backend_rounds_as_the_vendored_llama_cpp_does(rows):
    x = _acts(rows)
    eq = np.testing.assert_array_equal
    eq(round_activations("host", Q2_K, x), x)
    eq(round_activations("float", Q2_K, x), x)
    eq(round_activations("cpu", Q2_K, x), ref_q8_k(x))
    eq(round_activations("cpu", Q4_K, x), ref_q8_k(x))
    eq(round_activations("cpu", Q8_0, x), ref_q8_0(x))
    eq(round_activations("cpu", Q4_0, x), ref_q8_0(x))
    eq(round_activations("cpu", F16, x), _half(x))
    eq(round_activations("cpu", F32, x), x)
    eq(round_activations("cuda-mmvq", Q2_K, x), ref_mmvq(x))
    if rows <= 8:  # mul_mat_vec_q: the same q8_1 for every quantized type
        for t in (Q2_K, Q8_0, Q4_K, IQ1_M):
            eq(round_activations("cuda", t, x), ref_mmvq(x))
        eq(round_activations("cuda", F16, x), x)
        eq(round_activations("metal", Q2_K, x), x)
    else:  # mmq's layouts: D2S6 for Q2_K, DS4 for Q4_K / Q4_0, D4 for Q8_0; IQ1_M and F16 through cuBLAS
        eq(round_activations("cuda", Q2_K, x), ref_mmq(x, 64, True))
        eq(round_activations("cuda", Q4_K, x), ref_mmq(x, 32, True))
        eq(round_activations("cuda", Q4_0, x), ref_mmq(x, 32, True))
        eq(round_activations("cuda", Q8_0, x), ref_mmq(x, 32, False))
        eq(round_activations("cuda", IQ1_M, x), _half(x))
        eq(round_activations("cuda", F16, x), _half(x))
        eq(round_activations("metal", Q2_K, x), _half(x))


def test_half_rounding_matches_numpy_everywhere_in_its_range():
    rng = np.random.default_rng(1)
    x = np.concatenate([
        rng.standard_normal(4096).astype(F) * F(10) ** rng.integers(-9, 5, 4096).astype(F),
        np.array([65504, 65519.99, 65520, 1e6, -70000, 6.1e-5, 5.96e-8, 2.98e-8, 2.99e-8, 0.0, -0.0], F),
        (np.arange(-2048, 2048, dtype=F) + F(0.5)) * F(2 ** -10),  # ties of half's mantissa
    ]).astype(F)
    x = np.pad(x, (0, (-len(x)) % 256))[None, :]
    np.testing.assert_array_equal(round_activations("metal", Q2_K, np.repeat(x, 9, 0))[0], _half(x[0]))


@pytest.mark.parametrize("m", [1, 8, 64])
def test_outlier_channels_are_exact_and_the_rest_rounded_without_them(m):
    x = _acts(3, k=512, seed=5)
    got = round_activations("cpu", Q2_K, x, outliers=m)
    for r in range(x.shape[0]):
        top = np.argsort(-np.abs(x[r]), kind="stable")[:m]
        np.testing.assert_array_equal(got[r, top], x[r, top])
        rest = x[r].copy()
        rest[top] = 0
        want = ref_q8_k(rest[None, :])[0]
        want[top] = x[r, top]
        np.testing.assert_array_equal(got[r], want)
    # the outlier channel (40x) no longer sets its block's scale: the rest is rounded more finely
    err = lambda n: float(np.abs(round_activations("cpu", Q2_K, x, outliers=n) - x).max())  # noqa: E731
    assert err(m) < err(0)
    with pytest.raises(InvalidOptionError):
        round_activations("cpu", Q2_K, x, outliers=65)


def test_rounding_costs_what_its_block_and_bits_say():
    """8 bits per block: every value within about half a step of its block's scale; the coarser the
    block, the larger the error on the channels beside an outlier"""
    x = _acts(16, seed=3)
    err = {n: float(np.sqrt(np.mean((round_activations(n, Q2_K, x) - x) ** 2))) for n in ("cpu", "cuda", "cuda-mmvq", "metal")}
    assert err["metal"] < err["cuda-mmvq"] < err["cuda"] < err["cpu"]  # half; 8 bits per 32, 64, 256
    q = round_activations("cuda-mmvq", Q2_K, x)
    step = np.abs(_blocks(x, 32)).max(-1, keepdims=True) / 127
    # half a step, plus the scale's own rounding to half (2^-11 of it, times |q| <= 127)
    assert (np.abs(_blocks(q - x, 32)) <= step * (0.5 + 127 / 2048) + 1e-7).all()


def test_unknown_backends_types_and_widths_are_refused():
    x = _acts(2)
    with pytest.raises(InvalidOptionError, match="'rocm' unknown"):
        round_activations("rocm", Q2_K, x)
    with pytest.raises(UnsupportedModelError, match="no rounding rule"):
        round_activations("cpu", Q2_K, x[:, :96])  # Q8_K needs whole blocks of 256
    with pytest.raises(UnsupportedModelError, match="ggml type 24"):
        round_activations("cpu", 24, x)  # I8: no weight type, no rule
    with pytest.raises(InvalidOptionError, match="ggml type 999"):
        round_activations("cpu", 999, x)
    assert check_numerics_list("all") == list(NUMERICS)
    assert check_numerics_list("cuda, cpu,cuda") == ["cuda", "cpu"]
    for bad in ("", "cuda,vulkan"):
        with pytest.raises(InvalidOptionError, match="--device-numerics"):
            check_numerics_list(bad)


TEXT = [1] + list(range(260, 290))


def _logits(split, numerics=None, mode=None, text=TEXT, outliers=0, fixed=None):
    from bitsplit_llama.runtime.verifier import SplitModel
    from test_verifier import EXACT

    with SplitModel(split, **EXACT) as sm:
        if mode:
            sm.residual.set_mode(mode)
        if numerics:
            sm.residual.set_numerics(numerics, outliers)
        for name, ch in (fixed or {}).items():
            sm.residual.set_exact_channels(name, ch)
        sm.ctx.clear()
        with sm.verifying() as ctx:
            ctx.decode(text, list(range(len(text))))
            out = ctx.logits(len(text)).copy()
        c = sm.residual.counters()
        assert c.n_errors == 0
        return out, c


def test_cpu_numerics_give_the_verifier_of_llama_cpps_cpu_device(tiny_split):
    """The emulation against the real thing: add mode run locally is W2 . x by llama.cpp's CPU kernels
    (the RPC device's arithmetic, bit for bit) plus R . x here. The emulated verifier must be that one,
    up to summation order, where the all-local verifier differs from it by the whole rounding."""
    host, c_host = _logits(tiny_split)
    add, _ = _logits(tiny_split, mode="add")
    cpu, c_cpu = _logits(tiny_split, numerics="cpu")
    assert np.array_equal(_logits(tiny_split, numerics="host")[0], host)
    gap = float(np.abs(host - add).max())
    assert gap > 0.05 * float(add.std())  # the rounding shows on this model
    # position by position: most match the real device to float noise. A position may differ by more,
    # never by the whole rounding: the two verifiers' activations differ by float noise (~1e-7 relative:
    # summation order), and where a value sits on a rounding boundary of the next Q8_K product the
    # noise moves its integer by one, which the later layers carry on at that position. Seen on a 2-core
    # Zen 4 with avx512vnni-int16: blk.1.attn_output's input at position 19 has x * iscale = -46.499996,
    # rounded to -46 by one and -47 by the other; position 19 then differs by 0.4x the whole rounding
    # (0.05x with avx512-bf16, whose noise falls elsewhere)
    per_pos = np.abs(cpu - add).max(axis=1)
    assert float(np.median(per_pos)) < 0.01 * gap
    assert float(per_pos.max()) < 0.5 * gap
    assert c_cpu.n_products == c_host.n_products and c_cpu.n_add_products == 0 and c_cpu.bytes_outlier_base == 0
    # outlier channels kept exact: the host's share of the base is counted, and the verifier moves
    # towards the host's (what the device's rounding costs shrinks)
    cpu8, c8 = _logits(tiny_split, numerics="cpu", outliers=8)
    assert 0 < c8.bytes_outlier_base
    assert float(np.abs(cpu8 - host).max()) < float(np.abs(cpu - host).max())
    # each backend's verifier differs from the host's by its own rounding; Metal keeps floats at 1-8 rows
    # as "float" does at every size: what is left there is add mode's R . x, far below any rounding of W2 . x
    short = TEXT[:8]
    host8 = _logits(tiny_split, text=short)[0]
    dev = {n: float(np.abs(_logits(tiny_split, numerics=n, text=short)[0] - host8).max())
           for n in ("cuda", "cuda-mmvq", "metal", "float")}
    assert dev["cuda"] == dev["cuda-mmvq"] > 2 * dev["metal"] and dev["metal"] == dev["float"]
    assert np.array_equal(_logits(tiny_split, numerics="metal")[0], _logits(tiny_split, numerics="metal")[0])
    assert not np.array_equal(_logits(tiny_split, numerics="metal")[0], _logits(tiny_split, numerics="float")[0])


def test_eval_scores_the_verifier_under_each_backends_numerics(tiny_split, tiny_f32, tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("def add(a, b):\n    return a + b\n" * 60)
    cli = [sys.executable, "-c", "from bitsplit_llama.cli import entry; entry()"]
    out = subprocess.run([*cli, "eval", str(tiny_split), "--reference", str(tiny_f32), "--text", str(text),
                          "--n-ctx", "64", "--chunks", "2", "--vs", str(tiny_f32), "--device-numerics", "host,cpu,cuda",
                          "--outlier-channels", "0,4", "--json"], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    rows = json.loads(out.stdout.strip().splitlines()[-1])["models"]
    assert [(r["numerics"], r.get("outliers")) for r in rows] == [
        ("host", None), ("cpu", None), ("cpu", 4), ("cuda", None), ("cuda", 4), ("cpu", None)]
    assert 0 < rows[2]["outlier_bytes_share"] < 1 and "outlier_bytes_share" not in rows[1]
    rows = [rows[i] for i in (0, 1, 3, 5)]
    assert rows[1]["name"].endswith("cpu numerics") and rows[3]["kl_mean"] < 1e-6  # the source itself
    assert rows[1]["kl_mean"] > rows[0]["kl_mean"]  # Q8_K's rounding costs fidelity the host does not lose
    bad = subprocess.run([*cli, "eval", str(tiny_split), "--reference", str(tiny_f32), "--text", str(text),
                          "--device-numerics", "vulkan"], capture_output=True, text=True, timeout=600)
    assert bad.returncode != 0 and "--device-numerics: 'vulkan' unknown" in bad.stderr
    assert bad.stderr.count("\n") <= 2
    bad = subprocess.run([*cli, "eval", str(tiny_split), "--reference", str(tiny_f32), "--text", str(text),
                          "--outlier-channels", "8"], capture_output=True, text=True, timeout=600)
    assert bad.returncode != 0 and "give --device-numerics too" in bad.stderr


def test_fixed_exact_channels_per_weight(tiny_split):
    """A fixed set per weight (an importance matrix's choice) instead of each row's largest: every row
    takes it, the host's bytes are a dense slab of those columns (N x n halves per product)"""
    from bitsplit_llama.native.residual import Residual

    with Residual(tiny_split) as r:
        ts = r.tensors()
        name, ne = ts[0][0], ts[0][1]
        for bad in ([ne[0]], [-1], list(range(65))):
            with pytest.raises(InvalidOptionError):
                r.set_exact_channels(name, bad)
        with pytest.raises(InvalidOptionError, match="no such residual weight"):
            r.set_exact_channels("blk.99.none.weight", [0])
    cpu, _ = _logits(tiny_split, numerics="cpu")
    fixed = {n: [0, 5, 9] for n, *_ in ts}
    got, c = _logits(tiny_split, numerics="cpu", fixed=fixed)
    slab = sum(t[1][1] * 3 * 2 for t in ts)  # N x 3 halves for each weight, were each one product a pass
    assert 0 < c.bytes_outlier_base <= slab and c.bytes_outlier_base % 6 == 0
    assert not np.array_equal(got, cpu)
    # with a per-row count too, each row takes its own largest among the set: the slab's bytes, other values
    pool = {n: list(range(0, 64, 4)) for n in fixed}
    whole, c16 = _logits(tiny_split, numerics="cpu", fixed=pool)
    some, c2 = _logits(tiny_split, numerics="cpu", outliers=2, fixed=pool)
    assert c2.bytes_outlier_base == c16.bytes_outlier_base > 0
    assert not np.array_equal(some, whole) and not np.array_equal(some, _logits(tiny_split, numerics="cpu", outliers=2)[0])
    assert np.array_equal(_logits(tiny_split, numerics="cpu", outliers=16, fixed=pool)[0], whole)
    # while any weight has a set, one without takes no exact channels (not each row's own)
    w = next(t for t in ts if "token_embd" not in t[0])  # a weight with a product (the embedding is a lookup)
    first = {w[0]: [0, 5, 9]}
    partial, cp = _logits(tiny_split, numerics="cpu", outliers=8, fixed=first)
    assert np.array_equal(partial, _logits(tiny_split, numerics="cpu", fixed=first)[0])
    assert cp.bytes_outlier_base == w[1][1] * 3 * 2  # its slab alone, one pass
    # cleared (in the same context), the rows' rounding is back
    from bitsplit_llama.runtime.verifier import SplitModel
    from test_verifier import EXACT

    with SplitModel(tiny_split, **EXACT) as sm:
        sm.residual.set_numerics("cpu")
        outs = []
        for sets in (fixed, {n: [] for n in fixed}):
            for name, ch in sets.items():
                sm.residual.set_exact_channels(name, ch)
            sm.ctx.clear()
            with sm.verifying() as ctx:
                ctx.decode(TEXT, list(range(len(TEXT))))
                outs.append(ctx.logits(len(TEXT)).copy())
    assert np.array_equal(outs[0], got) and np.array_equal(outs[1], cpu)


def test_eval_with_fixed_channels_from_an_imatrix(tiny_split, tiny_f32, tmp_path):
    """--outlier-imatrix: each weight's channels of largest importance, the same for every row; the
    token embedding (a lookup, in no imatrix) gets none; an imatrix of another model is refused"""
    from bitsplit_llama.errors import MismatchError
    from bitsplit_llama.formats.imatrix import load_imatrix, write_imatrix
    from bitsplit_llama.tools.imatrix import calibration_text, compute_imatrix
    from bitsplit_llama.tools.quality import evaluate

    imx = tmp_path / "tiny.imatrix.gguf"
    compute_imatrix(tiny_f32, calibration_text(), imx, chunks=2, n_ctx=64)
    text = tmp_path / "t.txt"
    text.write_text("def add(a, b):\n    return a + b\n" * 60)
    rep = evaluate(tiny_split, tiny_f32, text, n_ctx=64, max_chunks=2, numerics="cpu", outliers="0,4",
                   outlier_imatrix=imx)
    rows = [m.to_json() for m in rep.models]
    assert [(r["numerics"], r.get("outliers"), r.get("outliers_fixed")) for r in rows] == [("cpu", None, None),
                                                                                          ("cpu", 4, True)]
    assert 0 < rows[1]["outlier_bytes_share"] < 0.05  # a slab of 4 columns per weight, in halves
    assert rows[1]["kl_mean"] != rows[0]["kl_mean"]
    other = tmp_path / "other.imatrix.gguf"
    write_imatrix(other, {f"x.{k}": (v[None, :], np.ones(1, np.float32)) for k, v in load_imatrix(imx).items()},
                  architecture="llama", datasets=["t"], chunk_count=1, chunk_size=64)
    with pytest.raises(MismatchError, match="names none of the split's weights"):
        evaluate(tiny_split, tiny_f32, text, n_ctx=64, max_chunks=1, numerics="cpu", outliers="4", outlier_imatrix=other)
    with pytest.raises(InvalidOptionError, match="give it too"):
        evaluate(tiny_split, tiny_f32, text, n_ctx=64, max_chunks=1, numerics="cpu", outlier_imatrix=imx)
    rep = evaluate(tiny_split, tiny_f32, text, n_ctx=64, max_chunks=1, numerics="cuda", outliers="2",
                   outlier_imatrix=imx, outlier_pool=16)
    r = rep.models[0].to_json()
    assert (r["outliers"], r["outlier_pool"], r["outliers_fixed"]) == (2, 16, True) and "of a fixed 16" in r["name"]
    with pytest.raises(InvalidOptionError, match="--outlier-pool 1"):
        evaluate(tiny_split, tiny_f32, text, n_ctx=64, max_chunks=1, numerics="cuda", outliers="2",
                 outlier_imatrix=imx, outlier_pool=1)
