"""`bitsplit doctor`: the machine profile's keys and figures, its cache (reused, refreshed, keyed by
the ISA cap), and `bitsplit plan` taking its residual rate from it. No wall-clock speed is asserted."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest

from bitsplit_llama.cache import cache_dir
from bitsplit_llama.cli import main
from bitsplit_llama.native import policy

KEYS = ("memory_bandwidth_gb_s", "kernel_by_batch", "residual", "cpu", "isa", "families", "max_isa", "draft_kernel",
        "threads", "ggml_reference", "devices", "with_base_by_family", "fastest_by_batch_with_base")
ROW_KEYS = ("family", "batch", "gb_per_s", "gb_per_s_per_core", "bandwidth_use", "gw_cols_per_s_per_core")
#: the batches R . x is measured at for every family
BATCHES = (1, 2, 4, 8, 16, 32, 64)
#: the batches (W2 + R) . x is measured at for every family (the measured kernel policy's input)
WITH_BASE_FAMILY_BATCHES = (1, 2, 4, 8, 16)


@pytest.fixture()
def cache(tmp_path, monkeypatch):
    """A fresh bitsplit cache that shares the native builds of the real one (no recompilation)."""
    real = cache_dir() / "native"
    d = tmp_path / "cache"
    d.mkdir()
    if real.exists():
        (d / "native").symlink_to(real, target_is_directory=True)
    monkeypatch.setenv("BITSPLIT_CACHE", str(d))
    return d


def doctor(capsys, *args: str) -> tuple[dict, str]:
    code = main(["doctor", "--json", "--quick", *args])
    out, err = capsys.readouterr()
    assert code == 0, err
    return json.loads(out.strip().splitlines()[-1]), err


def positive(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def check_profile(p: dict) -> None:
    from bitsplit_llama.tools.machine import PROFILE_VERSION

    for k in KEYS:
        assert k in p, k
    assert p["version"] == PROFILE_VERSION == 9
    fams = policy.families()
    assert p["families"] == fams and p["max_isa"] == policy.max_isa() and p["draft_kernel"] == policy.draft_kernel()
    assert p["half_rate_512"] is policy.half_rate_512()
    # the verifier's activations its (W2+R).x rows ran with: "auto" for the synthetic split's Q6_K residual
    x86 = p["arch"].lower() in ("x86_64", "amd64")
    avx512 = bool(policy.AVX512_FAMILIES & set(fams))
    assert p["act_bits"] == (8 if x86 and not avx512 else 16)
    assert p["kernel_by_batch"] == {str(b): policy.kernel_for_batch(b) for b in (1, 2, 4, 5, 8, 16, 32, 64)}
    alone = {str(b): policy.kernel_for_batch(b, residual_alone=True) for b in (1, 2, 4, 5, 8, 16, 32, 64)}
    assert p["kernel_by_batch_alone"] == alone
    assert p["threads"] >= 1 and positive(p["memory_bandwidth_gb_s"])
    assert {(r["family"], r["batch"]) for r in p["residual"]} == {(f, b) for f in fams for b in BATCHES}
    for r in (p["residual"] + p["with_base"] + p["with_base_by_family"] + p["ggml_reference"] + p["ggml_q8_0"]
              + p["ggml_base"] + p["native_draft"]):
        for k in ROW_KEYS:
            assert k in r, (k, r)
        assert r["family"] in fams or r["family"] == "ggml", r
        for k in ("gb_per_s", "gb_per_s_per_core", "bandwidth_use", "weights_per_s", "seconds"):
            assert positive(r[k]), (k, r)
        assert r["gb_per_s_per_core"] == pytest.approx(r["gb_per_s"] / p["threads"], rel=0.01, abs=0.002)
        assert r["bandwidth_use"] == pytest.approx(r["gb_per_s"] / p["memory_bandwidth_gb_s"], rel=0.02, abs=1e-3)
    # the family measured fastest at each batch (the policy's pick may differ: it was tuned elsewhere)
    assert p["fastest_by_batch_alone"] == {
        str(b): max((r for r in p["residual"] if r["batch"] == b), key=lambda r: r["gb_per_s"])["family"]
        for b in BATCHES}
    check_peaks(p)
    for r in p["residual"]:  # the policy's family (for R . x alone) is flagged as such
        assert r["policy"] == (r["family"] == p["kernel_by_batch_alone"][str(r["batch"])])
    check_with_base_by_family(p)
    # the verifier's pass at the small batches a chain or a small tree verifies, and at 16
    assert [(r["batch"], r["family"]) for r in p["with_base"]] == [(b, p["kernel_by_batch"][str(b)]) for b in (1, 2, 4, 16)]
    assert {r["batch"] for r in p["ggml_reference"]} == {1, 16}  # llama-cpp-python's ggml is always there
    # ggml's reference timed in turn with the families at its batches: as many passes as each, and
    # each family's speed against it (the median ratio of their passes) beside its row
    for g in p["ggml_reference"]:
        at = [r for r in p["residual"] if r["batch"] == g["batch"]]
        assert all(r["passes"] == g["passes"] for r in at) and all(positive(r["vs_ggml"]) for r in at), at
    assert all("vs_ggml" not in r for r in p["residual"] if r["batch"] not in (1, 16))
    # and the verifier's pass against ggml's product of the same weights as Q8_0 (a stock Q8_0
    # model's), timed in turn at each of its batches: 34 bytes per 32 weights
    q8 = {r["batch"]: r for r in p["ggml_q8_0"]}
    assert sorted(q8) == [1, 2, 4, 16] and all(r["type"] == "q8_0" for r in q8.values())
    assert all(r["bytes"] == p["synthetic"]["tensors"] * p["synthetic"]["ne0"] * p["synthetic"]["ne1"] * 34 // 32
               for r in q8.values())
    for r in p["with_base"]:
        assert positive(r["vs_ggml_q8_0"]) and r["passes"] == q8[r["batch"]]["passes"], r
    # and the drafter's rate: ggml on the base's Q2_K bytes (plan --gpu none)
    assert {r["batch"] for r in p["ggml_base"]} == {1, 2, 4, 16} and all(r["type"] == "q2_k" for r in p["ggml_base"])
    # the native drafter's rate, at the batches its family takes (none where ggml drafts)
    want = {b for b in (1, 2, 4, 16) if policy.draft_kernel() and b >= policy.draft_min_cols()}
    assert {r["batch"] for r in p["native_draft"]} == want
    assert all(r["family"] == policy.draft_kernel() for r in p["native_draft"])
    assert all(r["bytes"] == p["ggml_base"][0]["bytes"] for r in p["native_draft"])  # the same base bytes
    assert all(r["bytes"] < p["ggml_reference"][0]["bytes"] for r in p["ggml_base"])  # 2-bit, smaller than Q6_K
    assert any(d["type"] == "cpu" for d in p["devices"])


def check_with_base_by_family(p: dict) -> None:
    """(W2 + R) . x for every SIMD family at 1, 2, 4, 8 and 16 columns, each family pinned with set_kernel and
    timed in turn with the others at its batch; the policy's family for W2 + R flagged, the family
    measured fastest per batch named."""
    from bitsplit_llama.tools.machine import fastest_by_batch

    fams = [f for f in p["families"] if f != "generic"] or p["families"]  # generic only where it is alone
    rows = p["with_base_by_family"]
    assert [(r["batch"], r["family"]) for r in rows] == [(b, f) for b in WITH_BASE_FAMILY_BATCHES for f in fams]
    s = p["synthetic"]
    res_bytes = {r["batch"]: r["bytes"] for r in p["residual"]}
    for r in rows:
        assert r["pinned_by"] == "set_kernel" and r["passes"] >= 1, r
        assert r["policy"] == (r["family"] == p["kernel_by_batch"][str(r["batch"])]), r
        # a pass reads the base as well as the residual: all of them, whichever family computes it
        assert r["bytes"] > res_bytes[r["batch"]], r
        assert r["bytes"] == res_bytes[r["batch"]] + s["base_bytes"], r
    # the families of one batch are timed in turn: as many rounds each
    for b in WITH_BASE_FAMILY_BATCHES:
        assert len({r["passes"] for r in rows if r["batch"] == b}) == 1, b
    # where the policy's row is measured in both lists it is the same product (the same bytes)
    for w in p["with_base"]:
        same = [r for r in rows if r["batch"] == w["batch"] and r["policy"]]
        assert len(same) == 1 and same[0]["family"] == w["family"] and same[0]["bytes"] == w["bytes"], (w, same)
    assert p["fastest_by_batch_with_base"] == fastest_by_batch(rows) == {
        str(b): max((r for r in rows if r["batch"] == b), key=lambda r: r["gb_per_s"])["family"]
        for b in WITH_BASE_FAMILY_BATCHES}


def check_peaks(p: dict) -> None:
    """Each family's peak (its multiply step in registers, one core) and each R . x row's rate in
    weight.columns per second and core, consistent with the row's own time, and its share of the
    peak. Wall-clock figures vary; units do not: a share far above 1 is a wrong unit, not a fast CPU."""
    fams = p["families"]
    assert set(p["peaks"]) == set(fams) and set(p["peak_instructions"]) == set(fams)
    native_arch = p["arch"].lower() in ("x86_64", "amd64", "aarch64", "arm64")  # where peak.c is compiled
    for f in fams:
        if native_arch:
            assert positive(p["peaks"][f]), (f, p["peaks"])
            assert p["peak_instructions"][f], f
        else:
            assert p["peaks"][f] is None or positive(p["peaks"][f])
    s = p["synthetic"]
    weights = s["tensors"] * s["ne0"] * s["ne1"]
    for r in p["residual"] + p["with_base"] + p["with_base_by_family"] + p["ggml_reference"] + p["native_draft"]:
        rate = r["gw_cols_per_s_per_core"]  # G weights x columns / s / thread, from the row's own time
        assert positive(rate), r
        # "seconds" is rounded to the microsecond: up to 0.5% of a quick profile's shortest pass
        tol = 1e-3 + 1e-6 / r["seconds"]
        assert rate == pytest.approx(weights * r["batch"] / r["seconds"] / p["threads"] / 1e9, rel=tol, abs=2e-4), r
        assert rate == pytest.approx(r["weights_per_s_per_core"] * r["batch"] / 1e9, rel=1e-3, abs=2e-4), r
    for r in p["residual"] + p["with_base_by_family"]:
        peak = p["peaks"][r["family"]]
        assert r["peak_gw_per_s_per_core"] == peak, r
        if peak is None:
            assert r["peak_share"] is None, r
            continue
        share = r["peak_share"]
        assert positive(share) and share < 10, r
        assert share == pytest.approx(r["gw_cols_per_s_per_core"] / peak, rel=1e-3, abs=1e-5), r


def test_family_peaks_from_the_library():
    """bitsplit_family_peak: a positive finite figure for every family this CPU runs, None (from 0 or
    -1) for an unknown name; the profile's figures are these."""
    from bitsplit_llama.native.build import arch_dir, load
    from bitsplit_llama.tools.measure import PEAK_INSTRUCTIONS, family_peaks

    fams = policy.families()
    assert set(fams) <= set(PEAK_INSTRUCTIONS)
    peaks = family_peaks(fams + ["no-such-family"], seconds=0.005)
    if arch_dir() is None:  # no peak.c for this architecture
        pytest.skip("no peaks on this architecture")
    assert all(positive(peaks[f]) for f in fams), peaks
    assert peaks["no-such-family"] is None
    ffi, lib = load()
    assert lib.bitsplit_family_peak(b"no-such-family", 0.01) < 0
    assert lib.bitsplit_family_peak(ffi.NULL, 0.01) < 0
    assert lib.bitsplit_family_peak(fams[0].encode(), 0.0) < 0
    assert lib.bitsplit_family_peak(fams[0].encode(), float("nan")) < 0


def test_passes_are_timed_in_turn_the_order_rotating():
    """The profile times its contenders (families, ggml) pass by pass in turn, each round starting
    one further along, so that drift falls on all alike, a settling step after the passes that ask
    for one; the rounds stop at the size's repeat count, or after one round once the budget is
    spent."""
    from dataclasses import replace

    from bitsplit_llama.tools.measure import interleaved
    from bitsplit_llama.tools.synthetic import QUICK

    calls: list[str] = []
    passes = {n: (lambda n=n: calls.append(n)) for n in ("a", "b", "c")}
    # ggml's pass is followed by a wait (untimed) for its OpenMP workers to stop spinning: "b" here
    times = interleaved(passes, replace(QUICK, repeat=4, budget_s=60.0), settle={"b": lambda: calls.append("~")})
    assert calls == list("ab~c" "b~ca" "cab~" "ab~c")
    assert {n: len(t) for n, t in times.items()} == {"a": 4, "b": 4, "c": 4}
    assert all(x >= 0 for t in times.values() for x in t)
    calls.clear()
    spent = interleaved(passes, replace(QUICK, repeat=4, budget_s=0.0))
    assert calls == list("abc") and all(len(t) == 1 for t in spent.values())


def test_doctor_json_cached_refreshed_and_keyed_by_isa_cap(capsys, cache):
    from bitsplit_llama.tools import machine

    first, err = doctor(capsys)
    check_profile(first)
    if os.path.exists("/proc/stat"):  # the load while it was measured (Linux)
        assert 0.0 <= first["load"]["others_share"] <= 1.0 and 0.0 <= first["load"]["steal_share"] <= 1.0
        assert first["load"]["busy"] == (first["load"]["others_share"] > machine.BUSY_SHARE)
    assert first["cached"] is False and "machine profile (quick)" in err
    assert os.path.dirname(first["path"]) == str(cache / "machine")

    again, err = doctor(capsys)  # the cache: nothing measured, the same figures
    assert again["cached"] is True and "machine profile" not in err
    assert again["path"] == first["path"] and again["key"] == first["key"]
    assert again["residual"] == first["residual"] and again["memory_bandwidth_gb_s"] == first["memory_bandwidth_gb_s"]

    fresh, err = doctor(capsys, "--refresh")
    check_profile(fresh)
    # the measured policy derived from it (not stored: computed from the rows each time)
    assert fresh["measured_policy"] == {"with_base": [list(x) for x in policy.measured_steps(fresh, False)],
                                        "alone": [list(x) for x in policy.measured_steps(fresh, True)]}
    assert fresh["measured_policy"]["with_base"] and fresh["measured_policy"]["alone"]
    assert fresh["cached"] is False and "machine profile (quick)" in err and fresh["path"] == first["path"]
    stored = json.loads(open(fresh["path"]).read())
    assert stored["residual"] == fresh["residual"]
    assert stored["with_base_by_family"] == fresh["with_base_by_family"]
    assert stored["fastest_by_batch_with_base"] == fresh["fastest_by_batch_with_base"]

    # a profile of an older version (7: no (W2+R).x per family) is measured again, not completed
    old = {k: v for k, v in stored.items() if k not in ("with_base_by_family", "fastest_by_batch_with_base")}
    old["version"] = 7
    with open(fresh["path"], "w") as f:
        json.dump(old, f)
    redone, err = doctor(capsys)
    assert redone["cached"] is False and "stale" in err and redone["version"] == 9
    check_with_base_by_family(redone)

    # another cap is another profile: only the generic family, measured anew
    env = dict(os.environ, BITSPLIT_MAX_ISA="generic", BITSPLIT_CACHE=str(cache))
    r = subprocess.run([sys.executable, "-m", "bitsplit_llama.cli", "doctor", "--json", "--quick"], env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    g = json.loads(r.stdout.strip().splitlines()[-1])
    assert g["cached"] is False and g["key"] != first["key"] and g["path"] != first["path"]
    assert g["families"] == ["generic"] and g["max_isa"] == "generic"
    assert {x["family"] for x in g["residual"]} == {"generic"}
    assert {x["family"] for x in g["with_base_by_family"]} == {"generic"}
    assert set(g["fastest_by_batch_with_base"].values()) == {"generic"}
    check_with_base_by_family(g)
    assert set(g["kernel_by_batch"].values()) == {"generic"}
    assert all(positive(x["gb_per_s"]) for x in g["residual"])
    assert list(g["peaks"]) == ["generic"]  # the families of the cap alone
    check_peaks(g)


def test_doctor_human_output(capsys, cache):
    assert main(["doctor", "--quick"]) == 0
    out, _ = capsys.readouterr()
    for fam in policy.families():
        assert fam in out
    assert "memory" in out and "GB/s" in out and "ggml Q6_K" in out and "ggml Q2_K base" in out and "ggml Q8_0" in out
    assert "fastest here: batch 1" in out
    assert "W2+R, fastest here: batch 1" in out
    # the table's (W2+R).x rows: every family's (one per family and batch, 1 to 16), then the
    # policy's family's against ggml Q8_0
    wb = [line.split() for line in out.splitlines() if line.lstrip().startswith("(W2+R).x")]
    fams = [f for f in policy.families() if f != "generic"] or policy.families()  # generic only where alone
    assert {(w[1].rstrip("*"), int(w[2])) for w in wb} == {(f, b) for f in fams for b in WITH_BASE_FAMILY_BATCHES}
    assert len(wb) == len(fams) * len(WITH_BASE_FAMILY_BATCHES) + 4
    # the policy split models take from this profile, said in a line
    assert "measured policy  W2 + R: " in out and "BITSPLIT_POLICY=builtin" in out
    starred = {int(w[2]): w[1][:-1] for w in wb if w[1].endswith("*")}
    assert starred == {b: policy.kernel_for_batch(b) for b in WITH_BASE_FAMILY_BATCHES}
    # each family's peak per core, and the R.x rows' rate and share of it
    assert "peak/core" in out and "G weight.column MAC/s" in out and "of peak" in out and "Gw.col/s/core" in out
    if os.path.exists("/proc/stat"):  # the load while it was measured, in a line
        assert "\nload         " in out
    # the native drafter's rows in the table too, where this CPU drafts with it (not only in the log)
    assert ("W2.x draft" in out) == bool(policy.draft_kernel() and policy.draft_min_cols() <= 16)


def test_plan_keeps_whole_the_layers_that_fit(capsys, cache, monkeypatch):
    """With the base on the GPU, the memory left buys whole layers (Q8_0, no residual), as split --vram
    does; the plan keeps the number (up to what fits, or --keep-layers) with the best projection:
    a whole layer saves residual time per verification but every draft pass reads more. A base that
    does not fit keeps none. The plan names the split command that makes it and states its
    constants."""
    from bitsplit_llama.tools import machine
    from bitsplit_llama.tools.plan import make_plan

    # a fixed machine (not this one's figures): 1 G residual weights/s per core
    prof = {"memory_bandwidth_gb_s": 20.0, "threads": 2, "size": "test", "kernel_by_batch": {"17": "avx2-f32"},
            "kernel_by_batch_alone": {"17": "avx2-f32"},
            "residual": [{"family": "avx2-f32", "batch": 16, "weights_per_s_per_core": 1e9}]}
    monkeypatch.setattr(machine, "machine_profile", lambda **kw: prof)
    kw = dict(ram_bw=60, cores=16, tokens_per_verify=4.0, rounds=5)
    plans = {v: make_plan("qwen2.5-32b", vram_gb=v, **kw) for v in (12, 20, 24, 40)}
    kept = {v: p["placement"]["kept_whole"] for v, p in plans.items()}
    assert kept[12] == 0 and plans[12]["bitsplit"]["base_gpu_layers"] < 64  # the base alone does not fit
    assert 0 < kept[20] < kept[24] < kept[40] == 64  # here every whole layer pays
    res = [plans[v]["bitsplit"]["residual_ram_gb"] for v in (20, 24, 40)]
    assert res[0] > res[1] > res[2] == 0
    # more of the model whole on the GPU: faster (whole layers' products are still observed and computed
    # twice for compensation, run's default, so by less than the residual they drop)
    assert plans[24]["bitsplit"]["tokens_per_second"] > plans[20]["bitsplit"]["tokens_per_second"]
    # the kept count is the best of every count that fits
    for cap in range(0, kept[24] + 1, 4):
        other = make_plan("qwen2.5-32b", vram_gb=24, keep_layers=cap, **kw)
        assert other["placement"]["kept_whole"] == cap
        assert other["bitsplit"]["tokens_per_second"] <= plans[24]["bitsplit"]["tokens_per_second"]
    assert "--vram 24" in plans[24]["split_command"] and "--vram" not in plans[12]["split_command"]
    assert plans[24]["constants"]["launch_and_sync_s_per_pass"] > 0 and "assumed:" in plans[24]["text"]
    # a residual so fast that a whole layer's longer draft passes cost more than it saves: none kept
    prof["residual"][0]["weights_per_s_per_core"] = 1e15
    fast = make_plan("qwen2.5-32b", vram_gb=24, ram_bw=6000, cores=16, tokens_per_verify=4.0, rounds=5)
    assert fast["placement"]["kept_whole"] < kept[24]


def test_plan_base_types(capsys, cache, monkeypatch):
    """A smaller base type fits the 70B's base on a 24 GB GPU where Q2_K does not, and the plan's
    split command makes it (with the importance matrix it needs)."""
    from bitsplit_llama.errors import InvalidOptionError
    from bitsplit_llama.tools import machine
    from bitsplit_llama.tools.plan import make_plan

    prof, _ = doctor(capsys)
    monkeypatch.setattr(machine, "machine_profile", lambda **kw: prof)
    kw = dict(ram_bw=60, cores=16, tokens_per_verify=4.0, rounds=5)
    q2 = make_plan("llama-3-70b", vram_gb=24, **kw)
    iq = make_plan("llama-3-70b", vram_gb=24, base_type="iq2_xxs", **kw)
    assert q2["bitsplit"]["base_gpu_layers"] < 80 and iq["bitsplit"]["base_gpu_layers"] == 80
    assert iq["bitsplit"]["draft_pass_s"] < q2["bitsplit"]["draft_pass_s"]
    assert "--base iq2_xxs --imatrix auto" in iq["split_command"] and "--base" not in q2["split_command"]
    with pytest.raises(InvalidOptionError, match="--base: 'q1'"):
        make_plan("llama-3-70b", vram_gb=24, base_type="q1", **kw)


@pytest.mark.skipif(not os.path.exists("/proc/stat"), reason="the load is read from /proc/stat (Linux)")
def test_load_watch_counts_other_processes_not_this_one():
    """A profile measured beside other work reads low rates and is cached: LoadWatch says how much of
    the CPUs other processes took meanwhile. This process's own work is not counted; a busy process
    per CPU is."""
    import time

    from bitsplit_llama.tools.machine import BUSY_SHARE, LoadWatch

    w = LoadWatch()
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < 0.6:  # this process, busy: not another's load
        pass
    own = w.result()
    assert own is not None and own["others_share"] < 0.4 and own["steal_share"] <= 1.0
    n = os.cpu_count() or 1
    spin = "import time\nt = time.perf_counter()\nwhile time.perf_counter() - t < 1.5: pass"
    kids = [subprocess.Popen([sys.executable, "-c", spin]) for _ in range(n)]
    try:
        time.sleep(0.3)  # the children started
        w = LoadWatch()
        time.sleep(0.8)
        busy = w.result()
    finally:
        for k in kids:
            k.wait(timeout=60)
    assert busy["others_share"] > max(0.5, BUSY_SHARE) and busy["busy"] is True


def test_plan_says_when_its_profile_was_measured_on_a_busy_machine(capsys, cache, monkeypatch):
    from bitsplit_llama.tools import machine
    from bitsplit_llama.tools.plan import make_plan

    prof, _ = doctor(capsys)
    prof["load"] = {"others_share": 0.48, "steal_share": 0.02, "busy": True}
    monkeypatch.setattr(machine, "machine_profile", lambda **kw: prof)
    src = make_plan("qwen2.5-coder-1.5b", vram_gb=24)["bitsplit"]["residual_rate_source"]
    assert "other processes took 48% of the CPUs" in src and "bitsplit doctor --refresh" in src
    prof["load"] = {"others_share": 0.03, "steal_share": 0.0, "busy": False}
    src = make_plan("qwen2.5-coder-1.5b", vram_gb=24)["bitsplit"]["residual_rate_source"]
    assert "other processes" not in src and "machine profile" in src


def test_plan_takes_its_residual_rate_from_the_machine_profile(capsys, cache, monkeypatch):
    from bitsplit_llama.tools import machine
    from bitsplit_llama.tools.plan import make_plan

    prof, _ = doctor(capsys)
    monkeypatch.setattr(machine, "machine_profile", lambda **kw: prof)  # the quick profile, not a full one
    p = make_plan("qwen2.5-coder-1.5b", vram_gb=24)
    fam = policy.kernel_for_batch(17, residual_alone=True)  # the plan's verify products are R . x alone
    rows = {r["batch"]: 1 / r["weights_per_s_per_core"] for r in prof["residual"] if r["family"] == fam}
    # 17 columns: the time per weight interpolated between the measured batches 16 and 32
    expect = 1 / (rows[16] + (17 - 16) * (rows[32] - rows[16]) / (32 - 16))
    b = p["bitsplit"]
    assert b["residual_rate_per_core"] == pytest.approx(expect, rel=1e-12)
    assert "machine profile" in b["residual_rate_source"] and fam in b["residual_rate_source"]
    assert "interpolated from 16 and 32" in b["residual_rate_source"]
    assert p["ram_bandwidth_gb_s"] == round(prof["memory_bandwidth_gb_s"], 1)
    assert p["ram_bandwidth_source"] == "measured here" and p["projection"] is True


def test_cpu_plan_reads_the_split_and_the_profile(capsys, cache, monkeypatch, tiny_split):
    """--gpu none: the split's own bytes, the (W2 + R) rate of the machine profile at the verify batch,
    and the stated model (t = bytes / (B_ram * e_ram) per pass)."""
    from bitsplit_llama.formats.gguf_file import GGUFFile
    from bitsplit_llama.tools import machine
    from bitsplit_llama.tools.plan import E_RAM, make_cpu_plan

    prof, _ = doctor(capsys)
    monkeypatch.setattr(machine, "machine_profile", lambda **kw: prof)
    p = make_cpu_plan(str(tiny_split), tokens_per_verify=3.0, rounds=4.0, verify_rows=17, measure=False)
    assert p["bitsplit"]["measured_products"] is None
    # the bytes a pass reads: not the embedding, looked up a row per token beside the output head
    with GGUFFile(tiny_split / "base.gguf") as b, GGUFFile(tiny_split / "residual.gguf") as r:
        assert any(t.name == "output.weight" for t in b.tensors)
        base = sum(t.nbytes for t in b.tensors if t.name != "token_embd.weight")
        res = sum(t.nbytes for t in r.tensors if t.name != "token_embd.weight")
        n_mm = sum(t.n_elements for t in b.tensors if t.name != "token_embd.weight")
    assert p["n_params"] == n_mm
    bs = p["bitsplit"]
    assert bs["base_gb"] == round(base / 1e9, 2) and bs["residual_ram_gb"] == round(res / 1e9, 2)
    # 17 rows: past the largest measured batch (16), extrapolated from the last two (4 and 16)
    s = {r["batch"]: 1 / r["weights_per_s_per_core"] for r in prof["with_base"]}
    rate = 1 / (s[16] + (17 - 16) * max(0.0, (s[16] - s[4]) / (16 - 4)))
    assert bs["verify_rate_per_core"] == pytest.approx(rate, rel=1e-12)
    stream = prof["memory_bandwidth_gb_s"] * 1e9 * E_RAM
    t_verify = max((base + res) / stream, p["n_params"] / (p["cores"] * rate))
    assert bs["verify_pass_s"] == round(t_verify, 4)
    # a drafter pass: the base's bytes, or the drafter's measured rate at its rows (16 nodes / 4
    # passes) if slower: the native drafter's where its family takes 4 columns, else ggml's on Q2_K
    rows = prof["native_draft"] if any(r["batch"] <= 4 for r in prof["native_draft"]) else prof["ggml_base"]
    d_rate = {r["batch"]: r["weights_per_s_per_core"] for r in rows}[4]
    assert ("native drafter" in p["bitsplit"]["draft_rate_source"]) == (rows is prof["native_draft"])
    t_draft = max(base / stream, p["n_params"] / (p["cores"] * d_rate))
    assert bs["draft_rows"] == 4 and bs["draft_rate_per_core"] == pytest.approx(d_rate, rel=1e-12)
    assert bs["draft_pass_s"] == round(t_draft, 4)
    assert bs["tokens_per_second"] == round(3.0 / (4.0 * t_draft + t_verify), 2)
    assert p["gpu"] == "none" and p["projection"] is True and "no GPU" in p["text"]


def test_cpu_plan_times_the_splits_own_products(capsys, cache, monkeypatch, exact_split):
    """--gpu none on a split directory: a drafter and a verify pass's products timed on the split's
    own tensors (every weight with a residual and the output head; the embedding is a lookup), the
    drafter's by the native drafter where it takes the rows, and the projection built from them,
    scaled from the threads measured to the cores planned."""
    from bitsplit_llama.formats.gguf_file import GGUFFile
    from bitsplit_llama.native.residual import Residual
    from bitsplit_llama.tools import machine, measure
    from bitsplit_llama.tools.cpuinfo import threads_or_default
    from bitsplit_llama.tools.plan import E_RAM, make_cpu_plan

    prof, _ = doctor(capsys)
    monkeypatch.setattr(machine, "machine_profile", lambda **kw: prof)
    with Residual(exact_split) as r, GGUFFile(exact_split / "base.gguf") as b:
        res = [t[0] for t in r.tensors() if t[0] != "token_embd.weight"]
        exact = [n for n in r.exact_tensors() if n != "token_embd.weight"]
        assert "output.weight" in exact
        n_of = {t.name: t.n_elements for t in b.tensors}
        ne0 = {t[0]: t[1][0] for t in r.tensors()}
        native1, native4 = ([n for n in res if r.draft_matmul(n, np.ones((k, ne0[n]), np.float32)) is not None]
                            for k in (1, 4))
        base = sum(t.nbytes for t in b.tensors if t.name != "token_embd.weight")
    with GGUFFile(exact_split / "residual.gguf") as rf:
        res_bytes = sum(t.nbytes for t in rf.tensors if t.name != "token_embd.weight")
    m1 = measure.measure_split(exact_split, draft_rows=1, verify_rows=5, threads=2, repeat=2, budget_s=0.2)
    # one row: the native drafter's where its family drafts from 1 column, ggml's for the rest
    mine = f"native drafter ({policy.draft_kernel()}) on {len(native1)} products, " if native1 else ""
    assert m1["draft_products"] == f"{mine}ggml on {len(res) + len(exact) - len(native1)}"
    assert (m1["draft_native_s"] > 0) == bool(native1)
    assert m1["weights_with_residual"] == sum(n_of[n] for n in res)
    assert m1["weights_without"] == sum(n_of[n] for n in exact)
    for k in ("draft_s", "draft_ggml_s", "verify_s", "memory_bandwidth_gb_s"):
        assert positive(m1[k]), (k, m1)
    m4 = measure.measure_split(exact_split, draft_rows=4, verify_rows=17, threads=2, repeat=2, budget_s=0.2)
    assert ("native drafter" in m4["draft_products"]) == bool(native4)
    assert m4["draft_s"] == pytest.approx(m4["draft_native_s"] + m4["draft_ggml_s"], abs=2e-6)

    for cores in (2, 4):
        p = make_cpu_plan(str(exact_split), tokens_per_verify=3.0, rounds=4.0, verify_rows=17, cores=cores)
        bs, mp = p["bitsplit"], p["bitsplit"]["measured_products"]
        assert mp["draft_rows"] == 4 and mp["verify_rows"] == 17 and mp["threads"] == threads_or_default(None)
        # the bandwidth measured with the products (the same moment), not the profile's
        assert p["ram_bandwidth_gb_s"] == round(mp["memory_bandwidth_gb_s"], 1) and "now" in p["ram_bandwidth_source"]
        stream = mp["memory_bandwidth_gb_s"] * 1e9 * E_RAM
        t_draft = max(base / stream, mp["draft_s"] * mp["threads"] / cores)
        t_verify = max((base + res_bytes) / stream, mp["verify_s"] * mp["threads"] / cores)
        assert bs["draft_pass_s"] == round(t_draft, 4) and bs["verify_pass_s"] == round(t_verify, 4)
        assert bs["tokens_per_second"] == round(3.0 / (4.0 * t_draft + t_verify), 2)
        assert "measured now on this split's tensors" in bs["draft_rate_source"] and "measured now" in p["text"]


def test_the_embedding_lookup_is_not_read_per_token(tmp_path, tiny_f32):
    """A pass reads the output head, not the token embedding beside it (one row is looked up); a
    model whose embedding is also its output head (tied) reads it whole."""
    from bitsplit_llama.formats.gguf_file import GGUFFile
    from bitsplit_llama.tools.plan import PRESETS, _lookup_weights
    from synth import tiny_llama_weights, write_llama_gguf

    with GGUFFile(tiny_f32) as g:
        emb = next(t.n_elements for t in g.tensors if t.name == "token_embd.weight")
    assert _lookup_weights(str(tiny_f32)) == emb
    w = tiny_llama_weights(3)
    del w["output.weight"]
    tied = write_llama_gguf(tmp_path / "tied.gguf", w)
    assert _lookup_weights(str(tied)) == 0.0
    L, E, F, H, KV, V = PRESETS["qwen2.5-32b"]
    assert _lookup_weights("qwen2.5-32b") == V * E


def test_rate_between_and_past_the_measured_batches():
    """The time per weight is interpolated linearly in the batch between measured batches and
    extrapolated past the largest (never falling): a 257-row pass is not given batch 64's rate."""
    from bitsplit_llama.tools.machine import rate_at

    rows = [{"batch": b, "weights_per_s_per_core": 1 / t} for b, t in ((1, 1.0), (4, 1.0), (16, 2.0), (64, 8.0))]
    assert rate_at(rows, 1) == (1.0, "batch 1") and rate_at(rows, 16)[0] == 0.5
    assert rate_at(rows, 40)[0] == pytest.approx(1 / 5.0) and "interpolated from 16 and 64" in rate_at(rows, 40)[1]
    r, where = rate_at(rows, 256)
    assert r == pytest.approx(1 / (8.0 + 192 * 6.0 / 48)) and "extrapolated from 16 and 64" in where
    falling = [{"batch": 1, "weights_per_s_per_core": 1.0}, {"batch": 16, "weights_per_s_per_core": 2.0}]
    assert rate_at(falling, 64)[0] == 2.0  # a cheaper larger batch is not extrapolated below its own cost


def _fixed_machine(monkeypatch):
    from bitsplit_llama.tools import machine

    prof = {"memory_bandwidth_gb_s": 20.0, "threads": 2, "size": "test", "kernel_by_batch": {},
            "kernel_by_batch_alone": {},
            "residual": [{"family": policy.kernel_for_batch(17, residual_alone=True), "batch": 16, "weights_per_s_per_core": 4e9}]}
    monkeypatch.setattr(machine, "machine_profile", lambda **kw: prof)


def _acceptance(base: str, tpv: dict) -> dict:
    return {"base_type": base, "profile": [{"nodes": n, "tokens_per_verify": a, "draft_passes_per_cycle": 6.0,
                                            "ms_per_verify": 1.0, "ms_drafting_per_cycle": 1.0}
                                           for n, a in tpv.items()]}


def test_plan_chooses_base_and_residual(cache, monkeypatch):
    """--base auto plans each base of the acceptance profiles given with its own profile, --residual
    auto each residual type measured within --max-kl of stock Q8_0's KL with that base; the best
    projection is the plan, its split command makes those types, and every pair is listed."""
    from bitsplit_llama.errors import InputError, InvalidOptionError
    from bitsplit_llama.tools import plan as P

    _fixed_machine(monkeypatch)
    monkeypatch.setattr(P, "FIDELITY_VS_Q8", {("q2_k", "q4_k"): 1.6, ("q2_k", "q5_k"): 0.6, ("q2_k", "q6_k"): 0.2,
                                              ("q2_k", "q8_0"): 0.1, ("iq2_xxs", "q6_k"): 0.5})
    q2 = _acceptance("q2_k", {4: 3.5, 16: 5.0})
    iq = _acceptance("iq2_xxs", {4: 3.4, 16: 4.6})
    kw = dict(vram_gb=24, ram_bw=60, cores=16)
    p = P.choose_plan("llama-3-70b", profiles=[(q2, "q2.json", "q2_k"), (iq, "iq.json", None)], **kw)
    # a profile whose base type is unknown is taken as q2_k: both were then q2_k profiles
    assert {c["base_type"] for c in p["choices"]} == {"q2_k"}
    p = P.choose_plan("llama-3-70b", profiles=[(q2, "q2.json", "q2_k"), (iq, "iq.json", "iq2_xxs")], **kw)
    pairs = {(c["base_type"], c["residual"]) for c in p["choices"]}
    assert pairs == {("q2_k", "q5_k"), ("q2_k", "q6_k"), ("q2_k", "q8_0"), ("iq2_xxs", "q6_k")}  # q4_k: 1.6x
    best = max(p["choices"], key=lambda c: c["tokens_per_second"])
    assert (p["base_type"], p["residual"]) == (best["base_type"], best["residual"])
    # on a 24 GB GPU the 70B's Q2_K base does not fit, its IQ2_XXS base does: the smaller base wins
    assert p["base_type"] == "iq2_xxs" and "--base iq2_xxs" in p["split_command"]
    assert f"--residual {p['residual']}" in p["split_command"] and p["fidelity"]["within"]
    # each pair is what make_plan projects with that base's own profile
    one = P.plan_with_profile(P.partial(P.make_plan, "llama-3-70b", base_type="q2_k", residual="q6_k", **kw), q2, "q2")
    got = next(c for c in p["choices"] if (c["base_type"], c["residual"]) == ("q2_k", "q6_k"))
    assert got["projected_speedup"] == one["projected_speedup"] and got["tree_nodes"] == one["tree_nodes"]
    assert "choices" in p["text"] and "<- chosen" in p["text"]
    # a tighter fidelity bound leaves fewer pairs; none measured within it is refused, naming it
    tight = P.choose_plan("llama-3-70b", profiles=[(q2, "q2", "q2_k")], max_kl=0.15, **kw)
    assert [(c["base_type"], c["residual"]) for c in tight["choices"]] == [("q2_k", "q8_0")]
    with pytest.raises(InvalidOptionError, match="--residual auto: no residual type .* within 0.05x"):
        P.choose_plan("llama-3-70b", max_kl=0.05, **kw)
    # an explicit pair whose fidelity was not measured is planned, with a warning
    w = P.choose_plan("llama-3-70b", base_type="iq2_xxs", residual="q4_k", profiles=[(iq, "iq", "iq2_xxs")], **kw)
    assert w["fidelity"]["kl_vs_q8_0"] is None and not w["fidelity"]["within"] and "WARNING" in w["text"]
    # no profile: q2_k alone (another base's acceptance is not assumed)
    d = P.choose_plan("qwen2.5-32b", tokens_per_verify=4.0, rounds=5, **kw)
    assert {c["base_type"] for c in d["choices"]} == {"q2_k"}
    # --ram: what stays in RAM (residual, base layers off the GPU) is counted; pairs that need more are not chosen
    need = {(c["base_type"], c["residual"]): c["ram_needed_gb"] for c in p["choices"]}
    assert need[("iq2_xxs", "q6_k")] == p["ram"]["needed_gb"] and p["ram"]["fits"] is None and "give --ram" in p["text"]
    roomy = P.choose_plan("llama-3-70b", profiles=[(q2, "q2", "q2_k"), (iq, "iq", "iq2_xxs")], ram_gb=200, **kw)
    assert roomy["ram"]["fits"] is True and roomy["base_type"] == p["base_type"]
    tight_ram = min(need.values()) + 0.5
    small = P.choose_plan("llama-3-70b", profiles=[(q2, "q2", "q2_k"), (iq, "iq", "iq2_xxs")], ram_gb=tight_ram, **kw)
    assert small["ram"]["fits"] and all(c["ram_needed_gb"] <= tight_ram for c in small["choices"])
    with pytest.raises(InputError, match=r"--ram 8: no plan fits; the smallest needs"):
        P.choose_plan("llama-3-70b", profiles=[(q2, "q2", "q2_k"), (iq, "iq", "iq2_xxs")], ram_gb=8, **kw)
    # one profile stands in for an explicit base it was not measured with, and says so
    s = P.choose_plan("llama-3-70b", base_type="iq2_xxs", residual="q6_k", profiles=[(q2, "q2.json", "q2_k")], **kw)
    assert "standing in for iq2_xxs" in s["bitsplit"]["tokens_per_verify_source"]


def _cache_entry(root, cpu, index, level, size, shared, kind="Unified"):
    d = root / f"cpu{cpu}" / "cache" / f"index{index}"
    d.mkdir(parents=True)
    for name, text in (("level", str(level)), ("size", size), ("shared_cpu_list", shared), ("type", kind)):
        (d / name).write_text(text + "\n")


def test_full_profile_outgrows_the_last_level_cache(tmp_path):
    """The synthetic split is at least 4x the last-level cache (summed over its instances), so a
    server's L3 cannot hold it (with the 83 MB default, ggml read a Xeon's at 1.4x its measured RAM
    bandwidth)."""
    from bitsplit_llama.tools import synthetic
    from bitsplit_llama.tools.cpuinfo import last_level_cache_bytes

    # two sockets, each with a 48 MB L3 over its cores (and per-core L1/L2, not counted)
    for cpu in range(4):
        shared = "0-1" if cpu < 2 else "2-3"
        _cache_entry(tmp_path, cpu, 0, 1, "48K", str(cpu), "Data")
        _cache_entry(tmp_path, cpu, 1, 1, "32K", str(cpu), "Instruction")
        _cache_entry(tmp_path, cpu, 2, 2, "2048K", str(cpu))
        _cache_entry(tmp_path, cpu, 3, 3, "48M", shared)
    llc = last_level_cache_bytes(tmp_path)
    assert llc == 2 * 48 * 2**20
    size = synthetic.full_size(llc)
    assert size.tensors * size.ne0 * size.ne1 * 210 / 256 >= 4 * llc
    assert (size.tensors - 1) * size.ne0 * size.ne1 * 210 / 256 < 4 * llc
    assert synthetic.full_size(0) == synthetic.FULL  # a desktop, or no sysfs: the default
    assert synthetic.full_size(2**40).tensors == synthetic.FULL_MAX_TENSORS
    assert last_level_cache_bytes(tmp_path / "missing") == 0
