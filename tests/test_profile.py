"""`bitsplit profile`: tokens per verify against tree size, written next to the split, and read by
--tree-nodes auto and `bitsplit plan`."""

from __future__ import annotations

import json
import shutil

import pytest

from bitsplit_llama.cli import main
from bitsplit_llama.speculative.generate import Generator
from bitsplit_llama.speculative.sampling import SamplingParams
from bitsplit_llama.formats.profile import PROFILE_FILE, load_profile, write_profile
from bitsplit_llama.tools.profile import measure_profile

PROMPTS = ["the cat of the house is", "what do we do with"]


@pytest.fixture()
def split(tmp_path, tiny_split):
    """A private copy of the tiny split (a profile written into the shared one would change the
    other tests' automatic trees)."""
    d = tmp_path / "split"
    d.mkdir()
    for f in ("base.gguf", "residual.gguf"):
        shutil.copy(tiny_split / f, d / f)
    return d


def test_profile_measures_sizes_and_writes_them(split, capsys):
    code = main(["profile", str(split), "--nodes", "0,1,4,64", "-n", "12", "--prompts", _prompts(split), "--json"])
    assert code == 0
    obj = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    rows = obj["profile"]
    assert [r["nodes"] for r in rows] == [0, 1, 4, 64]  # 64: more lanes than a small batch holds
    assert rows[0]["tokens_per_verify"] == 1.0 and rows[0]["draft_passes_per_cycle"] == 0
    # 0 nodes: the verifier alone, one row a pass and no text; every other size with run's text budget
    assert rows[0]["text"] == 0 and rows[0]["rows_per_verify"] == 1.0 and rows[0]["accepted_from_text"] == 0
    assert obj["text_nodes"] == 32 and [r["text"] for r in rows[1:]] == [32, 32, 32]
    for r in rows[1:]:
        # a tree of n nodes and t text nodes emits between 1 and n + t + 1 tokens per verification,
        # with drafter passes, from passes of at most n + t + 1 rows
        assert 1.0 <= r["tokens_per_verify"] <= r["nodes"] + r["text"] + 1 and r["draft_passes_per_cycle"] > 0
        assert 1.0 < r["rows_per_verify"] <= r["nodes"] + r["text"] + 1 and 0 <= r["accepted_from_text"] <= 1
        assert r["ms_per_verify"] > 0 and r["tokens"] == rows[0]["tokens"]  # greedy: the same tokens
    assert rows[0]["tokens"] == 24  # 12 from each prompt: every generation counted, none cut short
    on_disk = json.loads((split / PROFILE_FILE).read_text())
    assert on_disk["profile"] == rows and load_profile(split) is not None
    # the split's types, for `plan --base auto` (one profile per base type)
    from bitsplit_llama.formats.gguf_file import GGUFFile

    with GGUFFile(split / "residual.gguf") as rg:
        assert obj["base_type"] == rg.kv["bitsplit.base_type"] and obj["residual_type"] == rg.kv["bitsplit.residual_type"]
    assert obj["base_type"] == "q2_k" and obj["imatrix"] is False


def test_profile_without_text_measures_the_drafters_trees(split, capsys):
    code = main(["profile", str(split), "--nodes", "0,2", "-n", "12", "--prompts", _prompts(split), "--text-nodes",
                 "0", "--json"])
    assert code == 0
    obj = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    r = obj["profile"][1]
    assert obj["text_nodes"] == 0 and r["text"] == 0 and r["accepted_from_text"] == 0
    assert 1.0 < r["rows_per_verify"] <= 3 and r["tokens_per_verify"] <= 3  # the chain's 2 nodes and the root


def _prompts(split) -> str:
    p = split.parent / "prompts.json"
    p.write_text(json.dumps(PROMPTS))
    return str(p)


def _fake(split, key: str, best: int) -> None:
    """A profile of this split whose size ``best`` is by far the fastest."""
    prof = measure_profile(split, nodes=[0, 1, 4], prompts=PROMPTS[:1], n_tokens=4)
    for r in prof["profile"]:
        r["tokens_per_verify"] = 20.0 if r["nodes"] == best else 1.0
        r["ms_per_verify"], r["ms_drafting_per_cycle"] = 10.0, 1.0
    prof["machine_key"] = key
    write_profile(split, prof)


def test_auto_tree_picks_the_measured_best_size(split, tmp_path, monkeypatch):
    monkeypatch.setenv("BITSPLIT_CACHE", str(tmp_path / "cache"))
    prof = measure_profile(split, nodes=[0], prompts=PROMPTS[:1], n_tokens=2)
    for best in (4, 1):
        _fake(split, prof["machine_key"], best)
        with Generator(split, n_ctx=256, tree_nodes="auto") as g:
            assert g.shape.nodes == best and g.auto_choice["from"] == "acceptance profile (its times)"
            # and the chosen tree keeps the verifier's tokens
            ids = g.tokenize(PROMPTS[0])
            spec = [t for c in g.engine.generate(ids, 16, SamplingParams()) for t in c]
            g.engine.reset()
            plain = [t for c in g.engine.generate(ids, 16, SamplingParams(), speculative=False) for t in c]
            assert spec == plain
    # measured on another machine: its acceptance, this machine's cost curves (measured once, cached)
    _fake(split, "elsewhere", 4)
    with Generator(split, n_ctx=256, tree_nodes="auto") as g:
        assert g.shape.nodes == 4 and "cost curves" in g.auto_choice["from"]
    assert list((tmp_path / "cache" / "autotree").glob("*.json"))


def test_profile_of_another_base_is_ignored(split, tmp_path, monkeypatch, tiny_split):
    monkeypatch.setenv("BITSPLIT_CACHE", str(tmp_path / "cache"))
    prof = measure_profile(split, nodes=[0, 1], prompts=PROMPTS[:1], n_tokens=2)
    prof["base_fingerprint"] = "0" * 16
    write_profile(split, prof)
    assert load_profile(split) is None
    with Generator(split, n_ctx=256, tree_nodes="auto") as g:
        assert g.auto_choice["from"] == "rank model"
    (split / PROFILE_FILE).write_text("{not json")
    assert load_profile(split) is None


def test_plan_reads_the_profile(split, capsys, tmp_path, monkeypatch):
    from bitsplit_llama.cache import cache_dir
    from bitsplit_llama.tools import machine, measure

    # the machine profile of a fresh cache, quick size (not this machine's figures: none are asserted)
    d = tmp_path / "cache"
    d.mkdir()
    if (cache_dir() / "native").exists():
        (d / "native").symlink_to(cache_dir() / "native", target_is_directory=True)
    monkeypatch.setenv("BITSPLIT_CACHE", str(d))
    assert main(["doctor", "--json", "--quick"]) == 0
    mprof = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    # the quick profile times a few hundred microseconds per pass, twice: one preemption of a shared
    # host can make a batch look 25x slower than its neighbours, and the plan extrapolates from it
    # (a CI run once chose 1 node here). Each measured row keeps its place, at one rate per batch
    # that falls as a product's cost grows with its columns
    for key in ("residual", "with_base", "ggml_base", "native_draft"):
        assert all(r["weights_per_s_per_core"] > 0 for r in mprof[key]), key
        for r in mprof[key]:
            r["weights_per_s_per_core"] = 4e9 / (1 + 0.1 * (r["batch"] - 1))
    monkeypatch.setattr(machine, "machine_profile", lambda **kw: mprof)
    prof = measure_profile(split, nodes=[0, 1, 4], prompts=PROMPTS[:1], n_tokens=4)
    for r in prof["profile"]:
        r["tokens_per_verify"] = {0: 1.0, 1: 1.5, 4: 45.0}[r["nodes"]]  # 4 nodes wins at these rates
        r["rows_per_verify"] = {0: 1.0, 1: 2.0, 4: 7.2}[r["nodes"]]  # 4 nodes: 2 text rows a pass besides
    # no acceptance profile yet: the sizes a CPU-only run picks among, at an assumed acceptance
    assert main(["plan", str(split), "--gpu", "none", "--no-measure", "--json"]) == 0
    p = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    sizes = p["tree_sizes"]
    assert [s["nodes"] for s in sizes] == [1, 2, 3, 4, 16] and "assumed" in p["bitsplit"]["tokens_per_verify_source"]
    assert [s["tokens_per_verify"] for s in sizes[:2]] == pytest.approx([1.85, 1 + 0.85 + 0.85 ** 2])
    assert [s["rounds"] for s in sizes] == [1, 2, 3, 4, 5]
    assert p["tree_nodes"] == max(sizes, key=lambda s: s["projected_speedup"])["nodes"]
    write_profile(split, prof)
    # (the machine profile's rates: the split's own products, timed, are test_doctor's)
    assert main(["plan", str(split), "--gpu", "none", "--no-measure", "--json"]) == 0
    p = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert p["bitsplit"]["measured_products"] is None
    assert p["tree_nodes"] == 4 and p["bitsplit"]["tokens_per_verify"] == 45.0
    # timed on the split: every tree size against one bandwidth, measured once per plan
    calls = []
    monkeypatch.setattr(measure, "bandwidth_now", lambda threads=None: calls.append(threads) or 40e9)
    assert main(["plan", str(split), "--gpu", "none", "--json"]) == 0
    p = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert len(calls) == 1 and p["ram_bandwidth_gb_s"] == 40.0 and "now" in p["ram_bandwidth_source"]
    # the rows the profile measured (the text's with the tree's), not the tree's nodes + 1
    assert p["tree_nodes"] == 4 and p["bitsplit"]["measured_products"]["verify_rows"] == 7
    assert [(s["nodes"], s["text_nodes"], s["verify_rows"]) for s in p["tree_sizes"]] == [(1, 32, 2), (4, 32, 7)]
    assert "acceptance profile" in p["bitsplit"]["tokens_per_verify_source"]
    assert [s["nodes"] for s in p["tree_sizes"]] == [1, 4]
    # figures given on the command line win over the split's own profile (bench's, to check the model)
    assert main(["plan", str(split), "--gpu", "none", "--tokens-per-verify", "2", "--rounds", "1", "--json"]) == 0
    p = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert p["bitsplit"]["tokens_per_verify"] == 2 and p["bitsplit"]["tokens_per_verify_source"] == "given"
    # a preset planned with a measured profile
    assert main(["plan", "qwen2.5-32b", "--vram", "24", "--ram-bandwidth", "60", "--cpu-cores", "16",
                 "--profile", str(split / PROFILE_FILE), "--json"]) == 0
    p = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert p["tree_nodes"] in (1, 4) and "acceptance profile" in p["bitsplit"]["tokens_per_verify_source"]
    assert p["base_type"] == "q2_k" and {c["base_type"] for c in p["choices"]} == {"q2_k"}
    # a second profile, of another base type: --base auto plans both, each with its own acceptance
    other = dict(prof, base_type="iq2_xxs")
    other["profile"] = [dict(r, tokens_per_verify=r["tokens_per_verify"] * 0.9) for r in prof["profile"]]
    (tmp_path / "iq.json").write_text(json.dumps(other))
    assert main(["plan", "llama-3-70b", "--vram", "24", "--ram-bandwidth", "60", "--cpu-cores", "16",
                 "--profile", str(split / PROFILE_FILE), "--profile", str(tmp_path / "iq.json"), "--json"]) == 0
    p = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert {c["base_type"] for c in p["choices"]} == {"q2_k", "iq2_xxs"}
    assert p["base_type"] in ("q2_k", "iq2_xxs") and f"--residual {p['residual']}" in p["split_command"]
    assert max(c["tokens_per_second"] for c in p["choices"]) == p["bitsplit"]["tokens_per_second"]
    # --base with one of them: that base alone, with its own profile
    assert main(["plan", "llama-3-70b", "--vram", "24", "--base", "iq2_xxs", "--residual", "q6_k",
                 "--profile", str(split / PROFILE_FILE), "--profile", str(tmp_path / "iq.json"), "--json"]) == 0
    p = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [(c["base_type"], c["residual"]) for c in p["choices"]] == [("iq2_xxs", "q6_k")]
    assert "iq.json" in p["bitsplit"]["tokens_per_verify_source"]


@pytest.mark.parametrize("args,code,fragment", [
    (["profile", "{s}", "--nodes", "1,x"], 2, "--nodes: '1,x'"),
    (["profile", "{s}", "--nodes", "300"], 2, "each size must be 0 to 256"),
    (["profile", "{s}", "-n", "0"], 2, "-n: 0"),
    (["profile", "{s}", "--text-nodes", "-1"], 2, "--text-nodes: -1"),
    (["profile", "{s}", "--text-nodes", "300"], 2, "--text-nodes: 300"),
    (["profile", "{t}/nowhere"], 1, "model directory not found"),
    (["plan", "qwen2.5-32b", "--vram", "24", "--profile", "{t}/none.json"], 1, "profile not found"),
    (["plan", "qwen2.5-32b", "--vram", "24", "--profile", "{t}/bad.json"], 1, "not an acceptance profile"),
    (["plan", "qwen2.5-32b", "--vram", "24", "--profile", "{s}"], 1, "no acceptance profile"),
    (["plan", "qwen2.5-32b", "--vram", "24", "--residual", "q3_k"], 2, "--residual: 'q3_k'"),
    (["plan", "qwen2.5-32b", "--vram", "24", "--base", "q1"], 2, "--base: 'q1'"),
    (["plan", "qwen2.5-32b", "--vram", "24", "--max-kl", "0"], 2, "--max-kl: 0"),
    (["plan", "qwen2.5-32b", "--vram", "24", "--ram", "0"], 2, "--ram: 0"),
    (["plan", "{s}", "--gpu", "none", "--ram", "64"], 2, "--ram with --gpu none"),
    (["plan", "qwen2.5-32b", "--vram", "24", "--max-kl", "0.0001"], 2, "--residual auto: no residual type"),
])
def test_errors(split, tmp_path, capsys, args, code, fragment):
    (tmp_path / "bad.json").write_text('{"profile": [{"nodes": 1}]}')
    got = main([a.format(s=split, t=tmp_path) for a in args])
    err = capsys.readouterr().err.strip().splitlines()
    assert got == code and len(err) == 1 and fragment in err[0], (got, err)
    assert not (split / PROFILE_FILE).exists()
