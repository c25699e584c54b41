"""`bitsplit plan --product-overhead-us`: each hooked product's fixed cost per verify pass, given, read
from the last GPU measurement found, or the stated default; the choice projected at 10 us, 100 us
and 1 ms beside it. A fixed machine profile (not this machine's figures); no wall-clock time is
asserted."""

from __future__ import annotations

import json
import os

import pytest

from bitsplit_llama.cli import main
from bitsplit_llama.errors import InvalidOptionError
from bitsplit_llama.native import policy
from bitsplit_llama.tools import plan as P

ARGS = ["plan", "qwen2.5-32b", "--vram", "24", "--ram-bandwidth", "60", "--cpu-cores", "16"]


@pytest.fixture()
def fixed(tmp_path, monkeypatch):
    """A fixed machine profile, an empty cache and no checkout results: no measurement to find."""
    from bitsplit_llama.tools import machine

    prof = {"memory_bandwidth_gb_s": 20.0, "threads": 2, "size": "test", "kernel_by_batch": {},
            "kernel_by_batch_alone": {},
            "residual": [{"family": policy.kernel_for_batch(17, residual_alone=True), "batch": 16,
                          "weights_per_s_per_core": 4e9}]}
    monkeypatch.setattr(machine, "machine_profile", lambda **kw: prof)
    cache = tmp_path / "cache"
    cache.mkdir()
    monkeypatch.setenv("BITSPLIT_CACHE", str(cache))
    monkeypatch.setattr(P, "REPO_RESULTS", tmp_path / "checkout" / "bench" / "results")
    return tmp_path


def plan_json(capsys, *extra: str) -> dict:
    assert main([*ARGS, *extra, "--json"]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_hooked_products_per_pass():
    """7 products with a residual per split layer (q, k, v, o, gate, up, down) and the output head."""
    assert P.hooked_products(64, 0) == 64 * 7 + 1
    assert P.hooked_products(64, 21) == 43 * 7 + 1
    assert P.hooked_products(80, 80) == 1
    assert P.hooked_products(64, 21, compensation=True) == 64 * 7 + 1  # whole layers' products observed too


def test_compensation_costs_the_gpu_a_second_pass():
    """run's default with the base on a device: the plan charges the GPU's weights read again and the
    activations' extra trips; without it the projection is the older one."""
    kw = dict(vram_gb=24, ram_bw=60, cores=16, tokens_per_verify=4.0, rounds=5, product_overhead_us=20)
    on = P.make_plan("qwen2.5-32b", **kw)
    off = P.make_plan("qwen2.5-32b", compensation=False, **kw)
    assert on["bitsplit"]["compensation"] and on["bitsplit"]["compensation_s"] > 0
    assert not off["bitsplit"]["compensation"] and off["bitsplit"]["compensation_s"] == 0
    assert on["bitsplit"]["verify_pass_s"] > off["bitsplit"]["verify_pass_s"]
    assert on["projected_speedup"] <= off["projected_speedup"]
    assert "rounding compensated" in on["text"] and "not compensated" in off["text"]


def test_more_overhead_never_projects_faster(fixed, capsys):
    """The option's value is what each hooked product costs: the projection falls (or stays) as it
    grows, the chosen plan's overhead per pass is its products times it, and at the default the
    projection is the one every plan before the option made (2 PCIe transfers x 10 us)."""
    speedups, tps = [], []
    for us in (0, 10, 20, 100, 1000, 5000):
        p = plan_json(capsys, "--product-overhead-us", str(us))
        assert p["product_overhead_us"] == us and p["product_overhead_source"] == "given"
        b = p["bitsplit"]
        assert b["hooked_products"] == P.hooked_products(64, p["placement"]["kept_whole"], compensation=True)
        assert b["product_overhead_s"] == pytest.approx(b["hooked_products"] * us * 1e-6, abs=1e-4)
        speedups.append(p["projected_speedup"])
        tps.append(b["tokens_per_second"])
    assert speedups == sorted(speedups, reverse=True) and tps == sorted(tps, reverse=True)
    assert speedups[0] > speedups[-1]
    d = plan_json(capsys)
    assert d["product_overhead_us"] == P.DEFAULT_PRODUCT_OVERHEAD_US == 20
    assert d["product_overhead_source"].startswith("default: no GPU measurement found")
    assert d["projected_speedup"] == speedups[2]
    # the library takes it too, and its default is the same
    kw = dict(vram_gb=24, ram_bw=60, cores=16, tokens_per_verify=4.0, rounds=5)
    lo = P.make_plan("llama-3-70b", product_overhead_us=10, **kw)
    hi = P.make_plan("llama-3-70b", product_overhead_us=1000, **kw)
    assert hi["bitsplit"]["tokens_per_second"] <= lo["bitsplit"]["tokens_per_second"]
    assert P.make_plan("llama-3-70b", **kw)["product_overhead_us"] == 20


def test_the_choice_at_three_overheads(fixed, capsys):
    """Beside its choice the plan prints it at 10 us, 100 us and 1 ms per product (products per pass,
    overhead per pass, tokens/s, speedup), and the JSON lists the same."""
    assert main([*ARGS, "--product-overhead-us", "100"]) == 0
    out = capsys.readouterr().out
    assert "overhead per hooked product: 100 us (given)" in out
    head = next(i for i, line in enumerate(out.splitlines()) if "overhead per product" in line)
    lines = out.splitlines()
    assert "products per verify pass" in lines[head] and "vs stock Q8_0" in lines[head]
    rows = lines[head + 1:head + 4]
    assert [r.split()[0:2] for r in rows] == [["10", "us"], ["100", "us"], ["1", "ms"]]
    assert lines[head + 4].startswith("  fidelity:")  # three rows, no more
    assert out.index("<- chosen") < out.index(lines[head])  # beside the choice, after the choices
    p = plan_json(capsys, "--product-overhead-us", "100")
    sens = p["overhead_sensitivity"]
    assert [r["product_overhead_us"] for r in sens] == [10, 100, 1000]
    hooks = p["bitsplit"]["hooked_products"]
    for r, row in zip(sens, rows):
        assert r["hooked_products"] == hooks and r["overhead_per_pass_ms"] == pytest.approx(hooks * r["product_overhead_us"] / 1000)
        assert row.split()[2] == str(hooks) and row.split()[-1] == f"{r['speedup']:.2f}x"
    assert [r["speedup"] for r in sens] == sorted((r["speedup"] for r in sens), reverse=True)
    # the row at the value used is the plan itself (the same placement, not chosen again)
    assert sens[1]["speedup"] == p["projected_speedup"]
    assert sens[1]["tokens_per_second"] == p["bitsplit"]["tokens_per_second"]


def test_a_measurement_found_is_used_and_named(fixed, capsys):
    """The newest gpu_check*.json (checkout's bench/results or the cache's results/) holding
    overhead_per_product_us, at any depth, is the default; files without it are passed over."""
    repo, cache = P.REPO_RESULTS, fixed / "cache" / "results"
    repo.mkdir(parents=True)
    cache.mkdir()
    (repo / "gpu_check-old.json").write_text(json.dumps({"gpu": "H200", "overhead_per_product_us": 2000}))
    os.utime(repo / "gpu_check-old.json", (1_000_000, 1_000_000))
    p = plan_json(capsys)
    assert p["product_overhead_us"] == 2000
    assert p["product_overhead_source"] == f"measured: {repo / 'gpu_check-old.json'}"
    # a newer one in the cache wins; its logs before the JSON line and the nesting do not matter
    (cache / "gpu_check.json").write_text("gpu_check: building\n" + json.dumps({"bench": {"overhead_per_product_us": 150.5}}))
    assert main(ARGS) == 0
    out = capsys.readouterr().out
    assert f"overhead per hooked product: 150.5 us (measured: {cache / 'gpu_check.json'})" in out
    # newer still, but no figure (or a bad one): not a measurement
    (cache / "gpu_check-x.json").write_text(json.dumps({"gpu": "H100", "tests": "ok"}))
    (repo / "gpu_check-y.json").write_text(json.dumps({"overhead_per_product_us": -3}))
    (repo / "gpu_check-z.json").write_text("{not json")
    (repo / "other.json").write_text(json.dumps({"overhead_per_product_us": 7}))  # not gpu_check*.json
    assert plan_json(capsys)["product_overhead_us"] == 150.5
    # a value given wins over any measurement
    g = plan_json(capsys, "--product-overhead-us", "10")
    assert g["product_overhead_us"] == 10 and g["product_overhead_source"] == "given"


@pytest.mark.parametrize("value", ["-1", "nan", "inf"])
def test_a_bad_value_exits_2(fixed, capsys, value):
    assert main([*ARGS, "--product-overhead-us", value]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--product-overhead-us" in err[0] and value in err[0], err
    with pytest.raises(InvalidOptionError, match="--product-overhead-us"):
        P.make_plan("qwen2.5-32b", vram_gb=24, product_overhead_us=float(value))


def test_not_with_gpu_none(fixed, capsys):
    assert main(["plan", "qwen2.5-coder-1.5b", "--gpu", "none", "--product-overhead-us", "10"]) == 2
    assert "--product-overhead-us with --gpu none" in capsys.readouterr().err
