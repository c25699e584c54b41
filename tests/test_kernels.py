"""The native kernel families, one by one: each against the float64 reference, batch-invariant,
on random (tiny split) and real (SmolLM2) tensors; the ISA cap; the policy.

A family this CPU cannot run is skipped with the reason, never replaced by another: run the suite
under ``BITSPLIT_MAX_ISA=generic|avx2|avxvnni|avx512`` to test the lower paths on a bigger CPU (.ci/run
does so for every level the machine has)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from bitsplit_llama.errors import InvalidOptionError, UnsupportedModelError
from bitsplit_llama.formats import _ggml
from bitsplit_llama.formats.gguf_file import GGUFFile
from bitsplit_llama.native import policy
from bitsplit_llama.native.residual import Residual

HERE = policy.families()

# relative error bound against the float64 product, per family: the f32 families and the integer
# one (exact weights, 24-bit activations) are exact up to f32 summation; the bf16 families round
# weights and activations to 8-bit mantissas; avx2-int16 is held to 1e-5 against the product of its
# own activation rounding (ACT_BITS: 16 bits for the base, the high digit's 8 for the residual) and
# to that rounding's bound against the exact one
TOL = {"vnni-int24": 1e-5, "avx2-int16": 1e-5, "avxvnni-int16": 1e-5, "avx512vnni-int16": 1e-5, "neon-int16": 1e-5, "avx2-f32": 1e-5, "neon-f32": 1e-5,
       "amx-bf16": 1e-2, "avx512-bf16": 1e-2,
       "generic": 1e-2}


# families that round activations to integers per block: the largest integer (x ~ s X, |X| <= it,
# s = the block's max|x| / it), blocks of 256 values where a 256-superblock type is in the product,
# else of 32
ACT_BITS = {"avx2-int16": 32512, "avxvnni-int16": 32512, "avx512vnni-int16": 32512, "neon-int16": 32512}
# families that use the weights as they are (integer or f32 arithmetic), not rounded to bf16
EXACT_WEIGHTS = {"vnni-int24", "avx2-int16", "avxvnni-int16", "avx512vnni-int16", "neon-int16", "avx2-f32", "neon-f32"}
SUPERBLOCK_TYPES = {10, 11, 12, 13, 14}  # Q2_K .. Q6_K


HI_SPAN = 16  # the residual's 8-bit blocks: max|X| (= ACT_BITS) within HI_SPAN x mean |X|


def _act_blocks(fam: str, x: np.ndarray, types: tuple[int, ...]):
    """Family ``fam``'s rounding of x per block of QA values: the block's scale s (f32), its integers
    X and whether the residual takes X's high base-255 digit alone (8 bits) there."""
    xmax = np.float32(ACT_BITS[fam])
    qa = 256 if SUPERBLOCK_TYPES & set(types) else 32
    xb = x.reshape(x.shape[0], -1, qa).astype(np.float32)
    amax = np.abs(xb).max(-1, keepdims=True)
    inv = np.where(amax > 0, xmax / np.where(amax > 0, amax, 1), 0).astype(np.float32)
    X = np.clip(np.rint(xb * inv), -xmax, xmax)
    hi = HI_SPAN * np.abs(X).astype(np.int64).sum(-1, keepdims=True) >= qa * int(xmax)
    return (amax / xmax).astype(np.float32), X, hi


def _act_rounded(fam: str, x: np.ndarray, types: tuple[int, ...], residual: bool = False) -> np.ndarray:
    """x as family ``fam`` sees it (float64), for a product of weights of ``types``; ``residual``: as
    its residual half sees it (the integer families: X's high digit alone in the blocks without an
    outlier)."""
    if fam not in ACT_BITS:
        return x.astype(np.float64)
    s, X, hi = _act_blocks(fam, x, types)
    if residual:
        H = np.rint(X.astype(np.float32) * np.float32(1.0 / 255.0)).astype(np.float64) * 255.0
        X = np.where(hi, H, X)
    return (X.astype(np.float64) * s).reshape(x.shape)


def _block_bound(x: np.ndarray, W: np.ndarray, qa: int, div) -> np.ndarray:
    """sum over blocks of qa values of max|x| / div times sum |W|: the largest |x W^T - x' W^T| when
    each activation moves by at most its block's max / div (div: a number, or per row and block)."""
    div = np.broadcast_to(np.asarray(div, np.float64), (x.shape[0], x.shape[1] // qa))
    bound = np.zeros((x.shape[0], W.shape[0]))
    for b, k0 in enumerate(range(0, x.shape[1], qa)):
        amax = np.abs(x[:, k0:k0 + qa]).max(axis=1).astype(np.float64)
        bound += (amax / div[:, b])[:, None] * np.abs(W[:, k0:k0 + qa]).sum(axis=1)[None, :]
    return bound


def _act_bound(fam: str, x: np.ndarray, W: np.ndarray, types: tuple[int, ...], residual: bool = False) -> np.ndarray:
    """The largest |x W^T - x' W^T| that family ``fam``'s rounding x' of the activations allows: per
    block, max|x| / (2 ACT_BITS) times sum |W| (16 bits), max|x| / 254 for the residual's 8 bits."""
    _, _, hi = _act_blocks(fam, x, types)
    div = np.where(residual & hi[..., 0], 254.0, 2.0 * ACT_BITS[fam])
    return _block_bound(x, W, 256 if SUPERBLOCK_TYPES & set(types) else 32, div)


def _runs_here(fam: str) -> None:
    if fam not in HERE:
        pytest.skip(f"{fam} does not run on this CPU under BITSPLIT_MAX_ISA={policy.max_isa()} "
                    f"(families here: {', '.join(HERE)})")


def _weights(split, name):
    with GGUFFile(split / "base.gguf") as b, GGUFFile(split / "residual.gguf") as rg:
        bt, rt = b.tensor(name), rg.tensor(name)
        w2 = _ggml.dequantize_rows(b.read_rows(bt, 0, bt.n_rows), bt.ggml_type, bt.n_per_row)
        r = _ggml.dequantize_rows(rg.read_rows(rt, 0, rt.n_rows), rt.ggml_type, rt.n_per_row)
        return w2.astype(np.float64), r.astype(np.float64), bt.ggml_type, rt.ggml_type


def _check_family(split, fam, names, n_cols=(1, 2, 3, 5, 13, 16, 17, 31), seed=5, fallback=EXACT_WEIGHTS,
                  act_bits="auto"):
    """``act_bits``: the verifier's activations setting (auto: as it resolves on this CPU and cap)."""
    with Residual(split) as res:
        res.set_precision("auto")
        res.set_act_bits(act_bits)
        assert res.set_kernel(fam) == fam
        for name in names:
            w2, r, bt, rt = _weights(split, name)
            x = np.random.default_rng(seed).standard_normal((max(n_cols), w2.shape[1])).astype(np.float32)
            # an outlier channel, as real activations have at a text's first position
            x[:, 3] *= 60.0
            # and one in column 2 alone: its block keeps both digits where its neighbours may not
            x[2 % len(x), w2.shape[1] // 2 + 7] *= 60.0
            # with 8-bit verifier activations, W2 + R takes them as R . x alone does
            act8 = res.act_bits_for(rt) == 8
            for with_base, W in ((True, w2 + r), (False, r)):
                # a product the family does not compute (vnni-int24 and a Q4_0 base, say) goes to
                # a family as precise (exact weights), and is held to that family's bound
                actual = res.family_of(name, max(n_cols), with_base)
                assert actual == fam or actual in fallback, (fam, name, with_base, actual)
                types = (bt, rt) if with_base else (rt,)
                # the integer families round the activations of R . x alone to 8 bits (the high
                # digit) where a block has no outlier
                eight = not with_base or act8
                ref = _act_rounded(actual, x, types, residual=eight) @ W.T
                full = res.matmul(name, x, with_base=with_base)
                err = np.abs(full - ref).max() / np.abs(ref).max()
                assert err < TOL[actual], (fam, actual, name, with_base, err)
                if actual in ACT_BITS:  # and the rounding is as small as it claims
                    exact = x.astype(np.float64) @ W.T
                    bound = _act_bound(actual, x, W, types, residual=eight)
                    assert np.all(np.abs(full - exact) <= bound * 1.001 + 1e-5 * np.abs(exact).max()), \
                        (fam, name, with_base)
                    if not eight:  # 16-bit activations throughout
                        assert np.abs(full - exact).max() / np.abs(exact).max() < 1e-3, (fam, name)
                for n in n_cols:  # a column's result never depends on the rest of the batch
                    assert np.array_equal(res.matmul(name, x[:n], with_base=with_base), full[:n]), (fam, name, n)
            assert res.counters().n_errors == 0


@pytest.mark.parametrize("fam", policy.ALL_FAMILIES)
def test_family_against_reference_tiny(tiny_split, fam):
    """Random weights (the tiny split's Q2_K mix base + Q6_K residual)."""
    _runs_here(fam)
    _check_family(tiny_split, fam, ("blk.0.ffn_down.weight", "blk.1.attn_q.weight", "output.weight"))


@pytest.mark.parametrize("fam", policy.ALL_FAMILIES)
def test_family_exact_weight_at_the_verifiers_precision(exact_split, fam):
    """A base weight without residual (the output head a split keeps exact) computed by the library
    for batch invariance: W2 . x at the verifier's activation precision (not the fast drafter's),
    each column independent of the batch."""
    _runs_here(fam)
    with Residual(exact_split) as res, GGUFFile(exact_split / "base.gguf") as b:
        res.set_precision("auto")
        assert res.set_kernel(fam) == fam
        bt = b.tensor("output.weight")
        w2 = _ggml.dequantize_rows(b.read_rows(bt, 0, bt.n_rows), bt.ggml_type, bt.n_per_row).astype(np.float64)
        x = np.random.default_rng(2).standard_normal((17, w2.shape[1])).astype(np.float32)
        x[:, 3] *= 60.0
        full = res.matmul("output.weight", x)
        ref = _act_rounded(fam, x, (bt.ggml_type,)) @ w2.T
        assert np.abs(full - ref).max() / np.abs(ref).max() < TOL[fam], fam
        if fam in ACT_BITS:  # two digits, not the drafter's one: as close as the verifier's products
            exact = x.astype(np.float64) @ w2.T
            assert np.abs(full - exact).max() / np.abs(exact).max() < 1e-3, fam
        for n in (1, 2, 5):
            assert np.array_equal(res.matmul("output.weight", x[:n]), full[:n]), (fam, n)
        with pytest.raises(InvalidOptionError):
            res.matmul("output.weight", x, with_base=False)


@pytest.mark.parametrize("act_bits", ["8", "16"])
@pytest.mark.parametrize("fam", sorted(ACT_BITS))
def test_int16_families_verifier_activation_bits(tiny_split, type_splits, fam, act_bits):
    """The 16-bit integer families with either verifier setting, on every type: with "8" W2 + R takes
    the high digit alone in every block without an outlier (both halves), with "16" both digits; held
    to the reference of that rounding and its bound, batch-invariant at 1-5 columns (avx512vnni-int16's
    sets of 4, 3 and 2, one of whose columns keeps both digits in a block its neighbours do not) and
    past them (9 and 16: avx2-int16's 8-bit W2 + R in tiles of 4 rows and pairs of columns, with an
    odd column and that column row by row)."""
    _runs_here(fam)
    names = ("blk.0.ffn_down.weight", "blk.1.attn_q.weight", "output.weight")
    for split in (tiny_split, *type_splits.values()):
        _check_family(split, fam, names, n_cols=(1, 2, 3, 4, 5, 9, 16), act_bits=act_bits)
        with Residual(split) as res:
            res.set_act_bits(act_bits)
            assert {res.act_bits_for(t[3]) for t in res.tensors()} == {int(act_bits)}


def test_act_bits_auto_by_cpu_and_residual(tiny_split, type_splits):
    """"auto" takes 8-bit verifier activations with a Q6_K residual on an x86 CPU without AVX-512
    (under the cap), 16 otherwise: checked for this CPU as it is, and under BITSPLIT_MAX_ISA=avx2."""
    import platform

    q6, q8 = tiny_split, type_splits[("q3_k_m", "q8_0")]
    code = ("import sys; from bitsplit_llama.native.residual import Residual\n"
            "for d in sys.argv[1:]:\n    with Residual(d) as r: print(r.act_bits)")
    x86 = platform.machine().lower() in ("x86_64", "amd64")
    caps = [None] + (["avx2"] if "avx2-int16" in HERE else [])
    for cap in caps:
        env = dict(os.environ)
        if cap:
            env["BITSPLIT_MAX_ISA"] = cap
        out = subprocess.run([sys.executable, "-c", code, str(q6), str(q8)], env=env, capture_output=True,
                             text=True, check=True).stdout.split()
        avx512 = cap is None and bool(policy.AVX512_FAMILIES & set(HERE))
        assert out == [("8" if x86 and not avx512 else "16"), "16"], (cap, out)
    with Residual(q6) as res:
        for bad in ("4", "32", "", "eight"):
            with pytest.raises(InvalidOptionError, match="act-bits"):
                res.set_act_bits(bad)


@pytest.fixture(scope="module")
def type_splits(tmp_path_factory, tiny_f32):
    """The tiny model split with other base types and every residual type, so that every weight
    type a split can hold goes through every family: Q3_K, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K, Q8_0 bases
    (with the Q2_K mix of tiny_split, all eight), Q4_K, Q5_K, Q6_K and Q8_0 residuals."""
    from bitsplit_llama.formats.split import split_model

    out = {}
    for base, res in (("q3_k_m", "q8_0"), ("q4_0", "q6_k"), ("q4_1", "q4_k"), ("q5_k_m", "q5_k"), ("q8_0", "q6_k"),
                      ("q2_k", "q4_k")):
        d = tmp_path_factory.mktemp(f"split-{base}-{res}")
        split_model(tiny_f32, d, residual=res, base_ftype=base, threads=2)
        out[(base, res)] = d
    return out


@pytest.mark.parametrize("fam", policy.ALL_FAMILIES)
def test_family_against_reference_every_type(type_splits, fam):
    _runs_here(fam)
    seen = set()
    for split in type_splits.values():
        with GGUFFile(split / "base.gguf") as b:
            seen |= {b.tensor(n).ggml_type for n in ("blk.0.ffn_down.weight", "blk.1.attn_q.weight", "output.weight")}
        _check_family(split, fam, ("blk.0.ffn_down.weight", "blk.1.attn_q.weight", "output.weight"), n_cols=(1, 2, 3, 16))
    # the base types the f32 families decode themselves (the tiny split covers Q2_K)
    assert {2, 3, 8, 11, 12, 13, 14} <= seen, sorted(seen)
    res_seen = set()
    for split in type_splits.values():
        with GGUFFile(split / "residual.gguf") as rg:
            res_seen |= {t.ggml_type for t in rg.tensors}
    assert {8, 12, 13, 14} <= res_seen, sorted(res_seen)  # Q8_0, Q4_K, Q5_K, Q6_K residuals


@pytest.fixture(scope="module")
def iq_splits(tmp_path_factory, tiny_f32):
    """The tiny model split on IQ2_XXS, IQ2_XS, llama.cpp's IQ2_S mix (IQ2_XS with IQ3_S) and IQ1_M
    bases (split --base iq2_xxs|iq2_xs|iq2_s|iq1_m; made with an importance matrix of the shipped
    calibration text)."""
    from bitsplit_llama.formats.split import split_model
    from bitsplit_llama.tools.imatrix import calibration_text, compute_imatrix

    d = tmp_path_factory.mktemp("iq")
    (d / "text.txt").write_text(calibration_text().read_text()[:6000])
    compute_imatrix(tiny_f32, d / "text.txt", d / "im.gguf", n_ctx=64, chunks=4, threads=2)
    out = {}
    for base in ("iq2_xxs", "iq2_xs", "iq2_s", "iq1_m"):
        out[base] = d / base
        split_model(tiny_f32, out[base], base_ftype=base, imatrix=d / "im.gguf", threads=2)
    return out


@pytest.mark.parametrize("fam", policy.ALL_FAMILIES)
def test_family_against_reference_iq_bases(iq_splits, fam):
    """IQ2_XXS, IQ2_XS, IQ3_S and IQ1_M bases: the families of IQ_DECODERS unpack them with their own
    SIMD code (tables read from ggml's dequantizer); every family computes them (or hands them to one
    as precise) within its bound, each column independent of the batch."""
    _runs_here(fam)
    for base, split in iq_splits.items():
        with GGUFFile(split / "base.gguf") as b:
            types = {b.tensor(n).ggml_type for n in ("blk.0.ffn_down.weight", "blk.1.attn_q.weight")}
        assert {"iq2_xxs": 16, "iq2_xs": 17, "iq2_s": 17, "iq1_m": 29}[base] in types, (base, types)
        # a pinned family that cannot decode IQ types hands them to the policy's
        _check_family(split, fam, ("blk.0.ffn_down.weight", "blk.1.attn_q.weight"), n_cols=(1, 2, 3, 16, 17),
                      fallback=set(HERE))
        with Residual(split) as res, GGUFFile(split / "base.gguf") as b:
            res.set_kernel(fam)
            for n in _iq_names(res, b):
                if fam in IQ_DECODERS[b.tensor(n).ggml_type]:  # these decode the blocks themselves, with SIMD
                    assert res.family_of(n, 17) == fam and res.family_of(n, 1) == fam, (fam, n)


#: the families with their own decoder of each IQ type (checked against ggml's at first use):
#: IQ2_XXS, IQ2_XS, IQ3_S, IQ1_M
IQ_DECODERS = {16: ("avx512-bf16", "amx-bf16", "avx2-f32"), 17: ("avx512-bf16", "amx-bf16", "avx2-f32"),
               21: ("avx512-bf16", "amx-bf16", "avx2-f32"), 29: ("avx2-f32",)}
IQ2_DECODERS = IQ_DECODERS[16]
IQ_TYPES = tuple(IQ_DECODERS)


def _iq_names(res, base) -> list[str]:
    """The weights with a residual whose base is an IQ type these families decode."""
    return [t[0] for t in res.tensors() if base.tensor(t[0]).ggml_type in IQ_TYPES and t[1][2] == 1]


def test_iq2_bases_never_reach_the_scalar_family(iq_splits):
    """No product on a CPU with SIMD falls to the portable family: on an IQ2_XXS / IQ2_XS / IQ3_S /
    IQ1_M base the policy picks a family that decodes it, at every batch size (AVX2-only CPUs:
    avx2-f32; the CI runs this under each ISA cap)."""
    if not any(f in HERE for f in IQ2_DECODERS):
        pytest.skip(f"no family here decodes IQ2 (families: {', '.join(HERE)}): generic is all there is")
    for base, split in iq_splits.items():
        with Residual(split) as res, GGUFFile(split / "base.gguf") as b:
            names = _iq_names(res, b)
            assert names, base
            if base == "iq2_s":  # the mix's IQ3_S quarter is among them
                assert any(b.tensor(n).ggml_type == 21 for n in names), base
            if base == "iq1_m":
                assert any(b.tensor(n).ggml_type == 29 for n in names), base
            for n in names:
                for cols in (1, 2, 4, 16, 17, 64):
                    assert res.family_of(n, cols) != "generic", (base, n, cols)


@pytest.mark.parametrize("fam", ["avx512-bf16", "amx-bf16"])
def test_tile_families_compute_every_residual_type(type_splits, fam):
    """The tile families (the policy's for trees and prompts on AVX-512 machines) compute Q4_K and
    Q5_K residuals themselves (split --residual q4_k|q5_k|auto), not through a slower family."""
    _runs_here(fam)
    with GGUFFile(type_splits[("q2_k", "q4_k")] / "residual.gguf") as rg:
        assert rg.tensor("blk.0.ffn_down.weight").ggml_type == 12  # Q4_K
    for key in (("q2_k", "q4_k"), ("q4_1", "q4_k"), ("q5_k_m", "q5_k")):
        with Residual(type_splits[key]) as res:
            res.set_kernel(fam)
            for n in (1, 17, 64):
                for with_base in (True, False):
                    assert res.family_of("blk.0.ffn_down.weight", n, with_base) == fam, (key, n, with_base)


@pytest.mark.parametrize("fam", ["avxvnni-int16", "avx512vnni-int16"])
def test_vnni_int16_families_are_avx2_int16_bit_for_bit(tiny_split, type_splits, fam):
    """The VNNI families compute avx2-int16's integers with other instructions (Q2_K's scales folded
    into its codes, vpdpbusd/vpdpwssd; avx512vnni-int16 in their EVEX form, one decoding of a row
    serving up to 4 columns, R alone too below 6 columns (a set whose columns' digit choices differ
    column by column), from 6 in tiles of 4 rows and pairs of columns, where avx2-int16 takes pairs
    to 3 and tiles from 4; a Q8_0 residual alone in pairs at every width), in the same floating-point
    order: every product of every type, with and without the base, at every batch size (1 to 5: sets
    of 4, 3, 2 and 1 columns, avx2-int16's tiles from 4; 6, 7, 9 and 15 to 17: tiles, with an odd
    column and a column whose block keeps both digits between pairs that take the high digit alone),
    is the same bits."""
    for f in (fam, "avx2-int16"):
        _runs_here(f)
    names = ("blk.0.ffn_down.weight", "blk.1.attn_q.weight", "output.weight")
    for split in (tiny_split, *type_splits.values()):
        with Residual(split) as res:
            res.set_precision("auto")
            for name in names:
                k = {t[0]: t[1][0] for t in res.tensors()}[name]
                x = np.random.default_rng(11).standard_normal((17, k)).astype(np.float32)
                x[:, 5] *= 40.0
                x[2, k // 2 + 7] *= 60.0  # column 2 keeps both digits in that block alone
                for act_bits in ("16", "8"):  # 8: W2 + R on the high digit where a block allows
                    res.set_act_bits(act_bits)
                    got = {}
                    for f in (fam, "avx2-int16"):
                        assert res.set_kernel(f) == f
                        got[f] = [res.matmul(name, x[:n], with_base=wb) for n in (1, 2, 3, 4, 5, 6, 7, 9, 15, 16, 17)
                                  for wb in (True, False)]
                    for a, b in zip(got[fam], got["avx2-int16"]):
                        assert np.array_equal(a, b), (split.name, name, act_bits)
            assert res.counters().n_errors == 0


@pytest.mark.real_model
@pytest.mark.parametrize("fam", policy.ALL_FAMILIES)
def test_family_against_reference_real(smollm2_split_q8, fam):
    """Real tensors: SmolLM2's split (Q4_0/Q8_0/Q6_K base rows 576 wide, Q8_0 residual)."""
    _runs_here(fam)
    _check_family(smollm2_split_q8, fam, ("blk.0.attn_q.weight", "blk.3.ffn_down.weight", "blk.5.ffn_up.weight"),
                  n_cols=(1, 2, 4, 9))


def test_every_family_this_cpu_runs_is_offered():
    """The CPU's own families are all there (none silently missing), in the policy's order."""
    assert HERE[-1] == "generic"
    assert set(HERE) <= set(policy.ALL_FAMILIES)
    assert policy.kernel_for_batch(1) == HERE[0] or os.environ.get("BITSPLIT_KERNEL")
    if sys.platform == "linux" and os.uname().machine == "x86_64" and policy.max_isa() != "generic":
        flags = open("/proc/cpuinfo").read().split("flags")[1].split("\n")[0].split()
        if {"avx2", "fma", "f16c"} <= set(flags):
            assert {"avx2-int16", "avx2-f32"} <= set(HERE)  # every AVX2 CPU has both SIMD families
        if "avx512_vnni" in flags and policy.max_isa() in ("avx512", "amx"):
            assert "vnni-int24" in HERE
        if {"avx2", "fma", "f16c", "avx_vnni"} <= set(flags) and policy.max_isa() in ("avxvnni", "avx512", "amx"):
            assert "avxvnni-int16" in HERE
        if "avx_vnni" not in flags:
            assert "avxvnni-int16" not in HERE
        evex_vnni = {"avx2", "fma", "f16c", "avx512f", "avx512vl", "avx512bw", "avx512_vnni"} <= set(flags)
        if evex_vnni and policy.max_isa() in ("avx512", "amx"):
            assert "avx512vnni-int16" in HERE
        if not evex_vnni:
            assert "avx512vnni-int16" not in HERE
    if sys.platform == "linux" and os.uname().machine == "aarch64" and policy.max_isa() != "generic":
        feats = open("/proc/cpuinfo").read().split("Features")[1].split("\n")[0].split()
        assert "neon-f32" in HERE  # Advanced SIMD: every AArch64 CPU
        assert ("neon-int16" in HERE) == ("asimddp" in feats)  # the dot product (FEAT_DotProd)


def _families_under(cap: str) -> subprocess.CompletedProcess:
    code = "import json; from bitsplit_llama.native import policy; " \
           "print(json.dumps([policy.max_isa(), policy.families(), policy.draft_kernel()]))"
    env = {**os.environ, "BITSPLIT_MAX_ISA": cap}
    env.pop("BITSPLIT_KERNEL", None)
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("cap", ["generic", "avx2", "avxvnni", "avx512"])
def test_isa_cap_limits_the_families(cap):
    p = _families_under(cap)
    assert p.returncode == 0, p.stderr
    isa, fams, drafter = json.loads(p.stdout.strip().splitlines()[-1])
    assert isa == cap or (cap == "avx2" and isa == "neon")
    assert fams[-1] == "generic"
    if cap == "generic":
        assert fams == ["generic"] and drafter is None
    if cap in ("generic", "avx2", "avxvnni"):
        assert not {"vnni-int24", "amx-bf16", "avx512-bf16", "avx512vnni-int16"} & set(fams)
        # on AVX2 the integer family drafts too (from its measured smallest batch); nothing on NEON yet
        int16 = [f for f in fams if f in ("avxvnni-int16", "avx2-int16")]
        assert drafter == (int16[0] if int16 else None)
    if cap in ("generic", "avx2"):
        assert "avxvnni-int16" not in fams  # the AVX2-only path is what runs under this cap
    assert "amx-bf16" not in fams


def test_avx2_policy_by_batch():
    """On AVX2 alone, the integer family takes the decode-sized batches of W2 + R (1-6 columns, where
    it reads weights at memory speed) and avx2-f32 the larger ones (where avx2-int16's multiplies
    cost more than f32 FMAs); for R . x alone (add mode, half the multiplies) the integer family up
    to 32 columns. Each measured crossover lives in C only."""
    if "avx2-f32" not in policy.families():
        pytest.skip(f"no AVX2 here (families: {', '.join(policy.families())})")
    batches = (1, 2, 4, 6, 7, 16, 32, 33, 64, 512)
    code = "import json; from bitsplit_llama.native import policy; " \
           f"print(json.dumps([[policy.kernel_for_batch(b, a) for b in {batches!r}] for a in (False, True)]))"
    env = {**os.environ, "BITSPLIT_MAX_ISA": "avx2"}
    env.pop("BITSPLIT_KERNEL", None)
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    with_base, alone = json.loads(p.stdout.strip().splitlines()[-1])
    assert with_base == ["avx2-int16"] * 4 + ["avx2-f32"] * 6
    assert alone == ["avx2-int16"] * 7 + ["avx2-f32"] * 3


def _policy_table(env_extra: dict, batches) -> tuple[bool, list, list, list, str | None]:
    code = "import json; from bitsplit_llama.native import policy; " \
           f"print(json.dumps([policy.half_rate_512(), policy.families(), policy.draft_kernel(), " \
           f"*[[policy.kernel_for_batch(b, a) for b in {tuple(batches)!r}] for a in (False, True)]]))"
    env = {**os.environ, **env_extra}
    env.pop("BITSPLIT_KERNEL", None)
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    hr, fams, drafter, with_base, alone = json.loads(p.stdout.strip().splitlines()[-1])
    return hr, fams, with_base, alone, drafter


def test_half_rate_512_order():
    """Where 512-bit operations run at half rate (AMD Zen 4, or BITSPLIT_HALF_RATE_512=1), the
    256-bit integer family takes W2 + R to 4 columns and R alone to 16 (avx512vnni-int16, where it
    runs: W2 + R to 12, R alone to 32), vnni-int24 W2 + R from 5 to 10 columns (where
    avx512vnni-int16 does not run), avx2-f32 to 16 (amx-bf16 where it runs), and an AVX-512 family
    the rest; =0 gives the built-in order, and under an AVX2
    cap the forced order changes nothing (no AVX-512 family to put behind). Testable on every x86
    CPU: the override stands in for the CPUID test."""
    if "avx2-f32" not in policy.families():
        pytest.skip(f"no AVX2 here (families: {', '.join(policy.families())})")
    batches = (1, 2, 4, 5, 6, 7, 10, 11, 16, 17, 32, 64)
    for cap in ("avx2", "avxvnni"):  # no AVX-512 family: the order is not in force
        on, off = _policy_table({"BITSPLIT_HALF_RATE_512": "1", "BITSPLIT_MAX_ISA": cap}, batches), \
            _policy_table({"BITSPLIT_HALF_RATE_512": "0", "BITSPLIT_MAX_ISA": cap}, batches)
        assert on[0] is False and off[0] is False
        assert on[1:] == off[1:], cap
    hr, fams, with_base, alone, drafter = _policy_table({"BITSPLIT_HALF_RATE_512": "1", "BITSPLIT_MAX_ISA": "amx"}, batches)
    wide = [f for f in ("amx-bf16", "avx512-bf16") if f in fams]
    if not wide:  # no AVX-512 family here: nothing to reorder, the override changes nothing
        assert hr is False
        assert (hr, fams, with_base, alone, drafter) == _policy_table({"BITSPLIT_HALF_RATE_512": "0",
                                                              "BITSPLIT_MAX_ISA": "amx"}, batches)
        return
    assert hr is True
    int16 = "avxvnni-int16" if "avxvnni-int16" in fams else "avx2-int16"
    mid = "vnni-int24" if "vnni-int24" in fams else "avx2-f32"
    if "avx512vnni-int16" in fams:  # W2 + R to 12 columns; R alone to 32
        first = "avx512vnni-int16"
        assert with_base == [first] * 8 + [wide[0] if "amx-bf16" in fams else "avx2-f32"] + [wide[0]] * 3
        assert alone == [first] * 11 + [wide[0]]
    else:
        first = int16
        assert with_base == [int16] * 3 + [mid] * 4 + ["avx2-f32"] * 2 + [wide[0]] * 3
        assert alone == [int16] * 9 + [wide[0]] * 3
    assert fams[0] == first
    # the drafter takes the same order: the first family that drafts (vnni-int24 in the built-in one)
    assert drafter == next(f for f in fams if f in ("avx512vnni-int16", "avxvnni-int16", "avx2-int16", "vnni-int24"))
    _, _, with_base0, alone0, drafter0 = _policy_table({"BITSPLIT_HALF_RATE_512": "0", "BITSPLIT_MAX_ISA": "amx"}, batches)
    assert with_base0[0] != first and alone0[0] != first  # the built-in order: an AVX-512 family first
    assert drafter0 == next(f for f in ("vnni-int24", "avx512vnni-int16", "avxvnni-int16", "avx2-int16") if f in fams)
    # here, as the suite runs: the CPUID test (or the override), where an AVX-512 family runs
    env_hr = os.environ.get("BITSPLIT_HALF_RATE_512")
    trait = env_hr == "1" if env_hr in ("0", "1") else _cpu_is_zen4()
    assert policy.half_rate_512() == (trait and bool({"vnni-int24", "avx512-bf16", "amx-bf16"} & set(HERE)))


def _cpu_is_zen4() -> bool:
    """AMD family 19h with AVX-512 (Zen 4), from /proc/cpuinfo: what the library's CPUID test finds."""
    try:
        info = open("/proc/cpuinfo").read()
    except OSError:
        return False
    first = info.split("\n\n")[0]
    fields = dict(line.split(":", 1) for line in first.splitlines() if ":" in line)
    fields = {k.strip(): v.strip() for k, v in fields.items()}
    return fields.get("vendor_id") == "AuthenticAMD" and fields.get("cpu family") == "25" and \
        "avx512f" in fields.get("flags", "").split()


@pytest.mark.parametrize("var,bad", [("BITSPLIT_MAX_ISA", "avx3"), ("BITSPLIT_HALF_RATE_512", "yes")])
def test_bad_isa_cap_is_refused(tiny_split, var, bad):
    """A misspelt cap (or half-rate override) is an error naming the value, not a silent fallback."""
    code = f"from bitsplit_llama.native.residual import Residual; Residual({str(tiny_split)!r})"
    p = subprocess.run([sys.executable, "-c", code], env={**os.environ, var: bad},
                       capture_output=True, text=True, timeout=120)
    assert p.returncode != 0 and f"{var}='{bad}'" in p.stderr, p.stderr


def test_unknown_kernel_is_refused(tiny_split):
    with Residual(tiny_split) as res:
        before = res.kernel
        with pytest.raises(UnsupportedModelError, match="no-such-family"):
            res.set_kernel("no-such-family")
        assert res.kernel == before


def test_family_of_names_who_computes_a_product(tiny_split, exact_split):
    """family_of: the pinned family for a product it computes, and for one it cannot, a family with
    exact weights (never a bf16 one); unknown weights and R . x of a weight without residual have none."""
    with Residual(tiny_split) as res:
        for fam in HERE:
            res.set_kernel(fam)
            for n in (1, 7, 40):
                got = res.family_of("blk.0.ffn_down.weight", n)
                assert got == fam or got in EXACT_WEIGHTS, (fam, n, got)
        with pytest.raises(InvalidOptionError, match="no-such"):
            res.family_of("no-such.weight", 1)
        with pytest.raises(InvalidOptionError):
            res.family_of("blk.0.ffn_down.weight", 0)
    with Residual(exact_split) as res:
        head = res.exact_tensors()[0]
        assert res.family_of(head, 2) in HERE
        with pytest.raises(InvalidOptionError):
            res.family_of(head, 2, with_base=False)


def test_draft_matmul_is_the_fast_drafters_product(tiny_split, exact_split):
    """draft_matmul (what the machine profile times as the native drafter): W2 . x within the 8-bit
    activations' rounding bound from the batch the draft family takes; None below it, or where this
    CPU has no draft family (ggml drafts); refused for a weight without residual and a bad x."""
    from bitsplit_llama.errors import InputError

    name = "blk.0.ffn_down.weight"
    with Residual(tiny_split) as res, GGUFFile(tiny_split / "base.gguf") as b:
        t = next(t for t in b.tensors if t.name == name)
        w2 = _ggml.dequantize_rows(b.read_rows(t, 0, t.n_rows), t.ggml_type, t.shape[0]).astype(np.float64)
        fam, min_cols = policy.draft_kernel(), policy.draft_min_cols()
        rng = np.random.default_rng(9)
        for n in (1, 2, 4, 17):
            x = rng.standard_normal((n, t.shape[0])).astype(np.float32)
            y = res.draft_matmul(name, x)
            if fam is None or n < min_cols:
                assert y is None, (fam, n)
                continue
            assert y is not None and y.shape == (n, t.shape[1])
            ref = x.astype(np.float64) @ w2.T
            # each activation moves by at most half a step of its 256-block's max / 127
            bound = _block_bound(x, w2, 256, 254.0)
            assert np.all(np.abs(y - ref) <= bound * 1.001 + 1e-5), (fam, n)
        with pytest.raises(InvalidOptionError):
            res.draft_matmul(name, np.zeros((2, t.shape[0] + 1), np.float32))
        with pytest.raises(InputError, match="no-such"):
            res.draft_matmul("no-such.weight", np.zeros((2, t.shape[0]), np.float32))
    with Residual(exact_split) as res:  # the output head has no residual: ggml drafts it
        head = res.exact_tensors()[0]
        with pytest.raises(InputError):
            res.draft_matmul(head, np.zeros((4, 256), np.float32))


def test_decode_kernel_follows_the_policy(tiny_split):
    """choose_decode_kernel asks the native policy (no thresholds in Python)."""
    with Residual(tiny_split) as res:
        for batch in (1, 2, 5, 17, 64):
            for alone in (False, True):
                want = policy.kernel_for_batch(batch, residual_alone=alone)
                assert res.choose_decode_kernel(batch, residual_alone=alone) == want
                assert res.kernel == want


def test_unpinned_products_follow_the_policy_for_their_kind(tiny_split):
    """With no family pinned, a product of the residual alone takes the policy's family for R . x
    alone and one with the base the family for W2 + R (the job says which, not the caller)."""
    with Residual(tiny_split) as res:
        name = res.tensors()[0][0]
        res.batch_invariant = False  # else the family pinned at load serves every batch
        res.set_kernel(None)  # (BITSPLIT_KERNEL pins one for every batch: the policy then names it too)
        for batch in (1, 7, 16, 64):
            assert res.family_of(name, batch, with_base=True) == policy.kernel_for_batch(batch)
            assert res.family_of(name, batch, with_base=False) == policy.kernel_for_batch(batch, residual_alone=True)


def test_prompt_mode_takes_the_policys_family_not_the_pinned_one(tiny_split):
    """Inside Residual.prompt() (a prompt's passes: rows computed once, never verified again) a
    product takes the kernel policy's family for a 64-row batch of its kind, whatever the pass's
    size, not the family pinned for decode passes; outside, the pin serves every batch again
    (batch-invariant mode). A pin by BITSPLIT_KERNEL holds inside too."""
    with Residual(tiny_split) as res:
        name = res.tensors()[0][0]
        assert res.batch_invariant and not res.prompt_mode
        forced = os.environ.get("BITSPLIT_KERNEL")
        if forced:
            with res.prompt():
                assert res.prompt_mode
                assert res.family_of(name, 64) == forced and res.family_of(name, 64, with_base=False) == forced
            assert not res.prompt_mode
            return
        want = {alone: policy.kernel_for_batch(64, residual_alone=alone) for alone in (False, True)}
        others = [f for f in HERE if f not in want.values()]
        pin = others[0] if others else HERE[-1]  # a family the policy would not pick at 64, where there is one
        res.set_kernel(pin)
        assert res.family_of(name, 64) == pin and res.family_of(name, 3) == pin
        with res.prompt():
            assert res.prompt_mode
            for alone in (False, True):
                for n in (1, 3, 64, 100):
                    assert res.family_of(name, n, with_base=not alone) == want[alone], (pin, alone, n)
            with res.prompt():  # nested: the outer one's state comes back
                pass
            assert res.prompt_mode
        assert not res.prompt_mode
        assert res.family_of(name, 64) == pin and res.kernel == pin


@pytest.mark.parametrize("bad", ["lots", "-1", "12kb"])
def test_bad_thread_minimum_is_refused(tiny_split, bad):
    """BITSPLIT_THREAD_MIN_KB (how much work a pool thread is worth) that is not a whole number of
    KB is an error naming the value, as a misspelt cap is."""
    code = f"from bitsplit_llama.native.residual import Residual; Residual({str(tiny_split)!r})"
    p = subprocess.run([sys.executable, "-c", code], env={**os.environ, "BITSPLIT_THREAD_MIN_KB": bad},
                       capture_output=True, text=True, timeout=120)
    assert p.returncode != 0 and f"BITSPLIT_THREAD_MIN_KB='{bad}'" in p.stderr
