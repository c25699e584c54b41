"""The kernel policy measured on this machine: ``bitsplit doctor``'s profile puts the family it measured
fastest for each batch first (native.policy.measured_steps / apply_measured, the library's
bitsplit_set_measured_policy), the built-in order elsewhere; a generation keeps one family whatever its
tree, so greedy output stays the verifier-alone output under a measured policy."""

from __future__ import annotations

import json
import os

import pytest

from bitsplit_llama.errors import InvalidOptionError
from bitsplit_llama.native import policy
from bitsplit_llama.native.build import build_key
from bitsplit_llama.speculative.generate import Generator

PROMPTS = [[1] + list(range(260 + 3 * p, 272 + 3 * p)) for p in range(4)]


@pytest.fixture(autouse=True)
def builtin_after():
    """every test leaves the built-in order in force, whatever it set"""
    yield
    policy.clear_measured()


def row(fam: str, batch: int, rate: float, builtin: bool = False) -> dict:
    return {"family": fam, "batch": batch, "weights_per_s_per_core": rate, "gb_per_s": rate / 1e9, "policy": builtin}


def test_steps_take_the_fastest_unless_the_builtin_is_within_the_margin():
    prof = {"with_base_by_family": [
        row("a", 1, 100, builtin=True), row("b", 1, 102),          # within 3%: the built-in stays
        row("a", 2, 100, builtin=True), row("b", 2, 110),          # 10% faster: b
        row("a", 4, 100, builtin=True), row("b", 4, 120),          # b again: merged with 2
        row("a", 16, 130, builtin=True), row("b", 16, 90),         # the built-in is fastest
    ], "residual": [row("c", 1, 50, builtin=True), row("d", 1, 80), row("c", 64, 50), row("d", 64, 10)]}
    assert policy.measured_steps(prof, residual_alone=False) == [(1, "a"), (4, "b"), (16, "a")]
    # no row flagged as the built-in pick: the fastest
    assert policy.measured_steps(prof, residual_alone=True) == [(1, "d"), (64, "c")]
    # an older profile without W2 + R per family: nothing measured for it
    assert policy.measured_steps({"residual": prof["residual"]}, residual_alone=False) == []


def test_the_library_puts_the_measured_family_first_and_keeps_the_builtin_order_past_it():
    fams = policy.families()
    if len(fams) < 3:
        pytest.skip(f"one SIMD family here ({fams}): nothing to reorder")
    builtin = {b: policy.kernel_for_batch(b) for b in (1, 2, 3, 8, 40)}
    alone = {b: policy.kernel_for_batch(b, residual_alone=True) for b in (1, 2, 40)}
    # the last SIMD family of the one-column order (never the built-in pick at one column)
    other = [f for f in fams if f != "generic"][-1]
    second = next(f for f in fams if f not in ("generic", other))
    policy.set_measured(False, [(2, other), (8, second)])
    assert policy.measured_table(False) == [(2, other), (8, second)] and policy.measured_table(True) == []
    assert policy.kernel_for_batch(1) == policy.kernel_for_batch(2) == other
    assert policy.kernel_for_batch(3) == policy.kernel_for_batch(8) == second
    assert policy.kernel_for_batch(40) == builtin[40]                  # past the last step
    assert {b: policy.kernel_for_batch(b, residual_alone=True) for b in alone} == alone  # the other table
    assert policy.families()[0] == other and sorted(policy.families()) == sorted(fams)
    assert policy.generation_family() == other
    policy.clear_measured()
    assert {b: policy.kernel_for_batch(b) for b in builtin} == builtin


def test_bad_tables_are_refused_and_change_nothing():
    fams = [f for f in policy.families() if f != "generic"]
    if not fams:
        pytest.skip("no SIMD family here")
    policy.set_measured(False, [(4, fams[0])])
    for bad in ([(4, fams[0]), (2, fams[0])], [(0, fams[0])], [(2, "no-such-family")], [(i + 1, fams[0]) for i in range(17)]):
        with pytest.raises(InvalidOptionError):
            policy.set_measured(False, bad)
        assert policy.measured_table(False) == [(4, fams[0])]


def test_a_family_the_cap_leaves_out_is_passed_over(monkeypatch):
    if "avx512-bf16" not in policy.families() or "avx2-f32" not in policy.families():
        pytest.skip("needs avx512-bf16 and avx2-f32 here")
    policy.set_measured(False, [(16, "avx512-bf16")])
    assert policy.kernel_for_batch(4) == "avx512-bf16"
    monkeypatch.setenv("BITSPLIT_MAX_ISA", "avx2")  # the library reads the cap each time
    assert policy.kernel_for_batch(4) != "avx512-bf16" and policy.kernel_for_batch(4) in policy.families()


def write_profile(root, name: str, *, size: str = "full", build: str | None = None, families=None, steps=None,
                  **env) -> os.PathLike:
    fams = families if families is not None else policy.families()
    rows = []
    for b, fam in (steps or []):
        rows += [row(f, b, 200.0 if f == fam else 100.0, builtin=f == fams[0]) for f in fams if f != "generic"]
    parts = {"native_build": build or build_key()[0], "max_isa": "", "half_rate_512": "", "kernel": "", **env}
    p = root / "machine" / f"profile-{size}-{name}.json"
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps({"size": size, "families": fams, "key_parts": parts, "with_base_by_family": rows,
                             "residual": rows}))
    return p


def test_the_profile_is_found_for_this_build_and_settings_only(tmp_path, monkeypatch):
    monkeypatch.setenv("BITSPLIT_CACHE", str(tmp_path))
    monkeypatch.delenv("BITSPLIT_MAX_ISA", raising=False)
    assert policy.find_profile() is None
    write_profile(tmp_path, "other-build", build="0" * 20)
    write_profile(tmp_path, "capped", max_isa="avx2")
    write_profile(tmp_path, "other-cpu", families=["generic"])
    assert policy.find_profile() is None
    quick = write_profile(tmp_path, "q", size="quick")
    assert policy.find_profile() == quick
    full = write_profile(tmp_path, "f")
    assert policy.find_profile() == full  # a full profile before a quick one


def test_apply_measured_from_the_profile_and_the_switch(tmp_path, monkeypatch):
    fams = [f for f in policy.families() if f != "generic"]
    if len(fams) < 2:
        pytest.skip("one SIMD family here")
    monkeypatch.setenv("BITSPLIT_CACHE", str(tmp_path))
    monkeypatch.delenv("BITSPLIT_KERNEL", raising=False)
    path = write_profile(tmp_path, "f", steps=[(2, fams[-1]), (16, fams[0])])
    monkeypatch.setenv("BITSPLIT_POLICY", "measured")
    got = policy.apply_measured()
    assert got["policy"] == "measured" and got["profile"] == str(path)
    assert got["with_base"] == policy.measured_table(False) == [(2, fams[-1]), (16, fams[0])]
    assert policy.kernel_for_batch(2) == fams[-1]
    monkeypatch.setenv("BITSPLIT_POLICY", "builtin")
    assert policy.apply_measured() == {"policy": "built-in", "profile": None, "with_base": [], "alone": []}
    assert policy.measured_table(False) == []
    monkeypatch.setenv("BITSPLIT_POLICY", "fastest")
    with pytest.raises(InvalidOptionError, match="BITSPLIT_POLICY='fastest'"):
        policy.apply_measured()


def test_a_measured_policy_keeps_speculative_output_the_verifiers(tiny_split, tmp_path, monkeypatch):
    """The split model applies the profile when it loads; the generation pins the measured family for
    2 rows and keeps it for every pass, at any tree size and with --no-spec."""
    fams = [f for f in policy.families() if f != "generic"]
    if len(fams) < 2:
        pytest.skip("one SIMD family here")
    builtin = policy.generation_family()
    measured = next(f for f in reversed(fams) if f != builtin)
    monkeypatch.setenv("BITSPLIT_CACHE", str(tmp_path))
    monkeypatch.setenv("BITSPLIT_POLICY", "measured")
    monkeypatch.delenv("BITSPLIT_KERNEL", raising=False)
    write_profile(tmp_path, "f", steps=[(2, measured), (16, builtin)])
    for nodes in (1, 16):
        with Generator(tiny_split, n_ctx=512, tree_nodes=nodes) as g:
            assert g.sm.policy["policy"] == "measured" and g.kernel == measured
            for p in PROMPTS:
                plain = g.generate(p, max_tokens=40, speculative=False)
                spec = g.generate(p, max_tokens=40)
                assert spec.tokens == plain.tokens
                assert g.sm.residual.kernel == measured  # every pass, the tree's included
