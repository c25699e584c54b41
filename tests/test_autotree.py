"""--tree-nodes auto end to end on a tiny model: measured once through the engine's measurement API
(in a context of its own), cached, and the chosen tree still emits the verifier's tokens, with any
context size."""

from __future__ import annotations

import json

import pytest

from bitsplit_llama.cli import main
from bitsplit_llama.speculative import autotree
from bitsplit_llama.speculative.engine import Engine, Stats, TreeShape, max_lanes
from bitsplit_llama.speculative.generate import Generator
from bitsplit_llama.speculative.sampling import SamplingParams

PROMPT = [1] + list(range(260, 275))


def test_engine_measurements_leave_the_cache_as_they_found_it(tiny_split):
    with Generator(tiny_split, n_ctx=512, tree_nodes=8) as g:
        eng = Engine(g.sm, g.shape)
        eng.prefill(PROMPT, Stats())
        for verify in (True, False):
            assert eng.time_pass(5, verify=verify, reps=2) > 0
            assert g.sm.ctx.seq_pos_max(0) == len(PROMPT) - 1
        before = g.sm.residual.kernel
        with eng.decode_kernel(13):
            pass
        assert g.sm.residual.kernel == before
        counts = eng.rank_profile([PROMPT], 12, TreeShape(4, 2, 2))
        assert len(counts) == autotree.CANDIDATES_PER_NODE + 1 and sum(counts) > 0
        # one record per verify cycle: the drafter's own chain through each tree (2 rounds: <= 2
        # probabilities), how far the verifier followed it; fewer tokens followed than emitted
        paths = eng.chain_paths
        assert paths and all(1 <= len(r) <= 3 and 0 <= r[0] <= len(r) - 1 for r in paths)
        assert all(0 < p <= 1 for r in paths for p in r[1:])
        assert sum(r[0] for r in paths) <= 12 - len(paths) + 1
        assert eng.n_past == 0 and g.sm.ctx.seq_pos_max(0) == -1  # rank_profile clears the cache


def test_auto_tree_is_measured_once_and_keeps_the_verifiers_tokens(tiny_split, tmp_path, monkeypatch):
    monkeypatch.setenv("BITSPLIT_CACHE", str(tmp_path))
    said = []
    with Generator(tiny_split, n_ctx=512, tree_nodes="auto", log=said.append) as g:
        assert any("measuring" in s for s in said) and any("acceptance by drafter rank" in s for s in said)
        choice = g.auto_choice
        assert choice["shape"] == [g.shape.nodes, g.shape.width, g.shape.rounds]
        assert choice["expected_tokens_per_second"] > 0 and 0 <= sum(choice["rank_probs"]) <= 1 + 1e-9
        spec = g.generate(PROMPT, max_tokens=32, sampling=SamplingParams()).tokens
        plain = g.generate(PROMPT, max_tokens=32, speculative=False).tokens
        assert spec == plain
    cached = list((tmp_path / "autotree").glob("*.json"))
    chains = json.loads(cached[0].read_text())["chains"]  # the calibration's cycles, for the chains
    assert chains and choice["chain_paths"] == (len(chains) if len(chains) >= autotree.PATH_MIN_CYCLES else 0)
    said.clear()
    with Generator(tiny_split, n_ctx=512, tree_nodes="auto", log=said.append) as g2:
        assert not any("measuring" in s for s in said)  # the cached profile
        assert g2.auto_choice == choice


def _to_the_end(g, n_ctx):
    """Greedy to the end of the context, speculative and verifier alone."""
    spec = g.generate(PROMPT, max_tokens=10 * n_ctx)
    plain = g.generate(PROMPT, max_tokens=10 * n_ctx, speculative=False)
    if spec.finish_reason == "length":  # every position used: the last token emitted is not cached
        assert len(PROMPT) + len(spec.tokens) == n_ctx + 1
    return spec, plain


@pytest.mark.parametrize("n_ctx", [256, 128, 48])
def test_auto_tree_with_any_context_size(tiny_split, tmp_path, monkeypatch, capsys, n_ctx):
    """The calibration runs in a context of its own: a small --n-ctx neither refuses nor limits it,
    the user's context keeps its size and cache, and greedy output is the verifier's to the last
    position of the context."""
    monkeypatch.setenv("BITSPLIT_CACHE", str(tmp_path))
    said = []
    with Generator(tiny_split, n_ctx=n_ctx, tree_nodes="auto", log=said.append) as g:
        assert any("measuring" in s for s in said) and any("acceptance by drafter rank" in s for s in said)
        assert g.n_ctx == n_ctx and g.engine.n_past == 0 and g.sm.ctx.seq_pos_max(0) == -1
        spec, plain = _to_the_end(g, n_ctx)
        assert spec.tokens == plain.tokens
    # the same through the command line, which used to refuse --n-ctx below 512
    code = main(["run", str(tiny_split), "-p", "the cat", "-n", "8", "--n-ctx", str(n_ctx), "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert json.loads(out.strip().splitlines()[-1])["n_tokens"] == 8


@pytest.mark.parametrize("n_ctx", [256, 128, 40])
def test_auto_trees_fill_small_contexts_with_the_verifiers_tokens(tiny_split, tmp_path, monkeypatch, n_ctx):
    """A profile under which wide trees win (every pass costs the same) makes auto choose one; near a
    small context's end the tree's lanes, rows and dummy row still fit (cells reserved beyond n_ctx)."""
    monkeypatch.setenv("BITSPLIT_CACHE", str(tmp_path))
    flat = autotree.Profile({b: 10.0 for b in autotree.VERIFY_BATCHES}, {b: 0.1 for b in autotree.DRAFT_BATCHES},
                            [0.7, 0.1, 0.05, 0.05], 10.0)
    monkeypatch.setattr(autotree, "measure", lambda *a, **k: flat)
    with Generator(tiny_split, n_ctx=n_ctx, tree_nodes="auto") as g:
        assert g.shape.nodes >= 16, g.shape
        spec, plain = _to_the_end(g, n_ctx)
        assert spec.tokens == plain.tokens and spec.stats.n_verify < len(spec.tokens)


def test_a_calibration_on_a_busy_machine_is_not_kept(tiny_split, tmp_path, monkeypatch):
    """A drafting pass slower than a verify pass (which reads more) means other work had the cores:
    that profile serves its run and is not cached; a sound one is."""
    monkeypatch.setenv("BITSPLIT_CACHE", str(tmp_path))
    sound = autotree.Profile({b: 50.0 + b for b in autotree.VERIFY_BATCHES}, {1: 20.0, 2: 30.0, 4: 45.0},
                             [0.6, 0.1, 0.05, 0.05], 52.0)
    assert autotree.busy_sign(sound) == ""
    busy = autotree.Profile(dict(sound.verify_ms), {1: 2300.0, 2: 30.0, 4: 45.0}, sound.rank_probs, 52.0)
    assert "1-row drafting pass took 2300 ms" in autotree.busy_sign(busy) and "2-row verify pass (52 ms)" in autotree.busy_sign(busy)
    # the 4-row drafting pass against the 4-row verify pass; tiny passes' jitter is not a sign
    assert "4-row" in autotree.busy_sign(autotree.Profile(sound.verify_ms, {1: 20.0, 4: 90.0}, [0.5], 52.0))
    assert autotree.busy_sign(autotree.Profile({2: 1.0, 4: 1.2}, {1: 3.0, 4: 5.0}, [0.5], 1.0)) == ""
    for prof, kept in ((busy, False), (sound, True)):
        monkeypatch.setattr(autotree, "measure", lambda *a, **k: prof)
        said = []
        with Generator(tiny_split, n_ctx=256, tree_nodes="auto", log=said.append):
            pass
        assert bool(list((tmp_path / "autotree").glob("*.json"))) == kept
        assert any("was busy" in s and "not cached" in s for s in said) != kept


@pytest.mark.parametrize("n_ctx", [256, 17])
def test_fixed_trees_reach_the_end_of_the_context(tiny_split, n_ctx):
    """A context of 256 positions gets exactly 256 cells from llama.cpp: without cells reserved for
    the dummy row and the tree's lanes, the last steps found no room (a ContextLimitError mid-answer)."""
    for nodes in (24, 4):
        with Generator(tiny_split, n_ctx=n_ctx, tree_nodes=nodes) as g:
            assert g.sm.ctx.n_cells >= n_ctx + max_lanes(g.shape) + 1
            spec, plain = _to_the_end(g, n_ctx)
            assert spec.tokens == plain.tokens and spec.finish_reason == plain.finish_reason == "length"


def test_a_near_tie_goes_to_the_shape_with_fewer_nodes():
    """The rank model overrates deep trees (it multiplies the calibration's acceptance per level):
    among shapes within NEAR_TIE of the best, the fewest nodes win; a clear lead still wins."""
    # a calibration measured on a 2-core Zen 4 (Qwen2.5-Coder-1.5B, q5_k residual), ms
    verify = {2: 150.1, 3: 179.8, 4: 242.5, 5: 294.3, 7: 442.1, 9: 453.9, 13: 607.4, 17: 734.8, 25: 781.2}
    probs = [0.8655, 0.0924, 0.0084, 0.0168]
    tied = autotree.Profile(verify, {1: 48.4, 2: 70.1, 4: 90.6}, probs, 150.1)
    shape, tps, table = autotree.choose(tied)
    best = table[0]
    assert best[0].nodes == 2 and shape.nodes == 1  # the 2-node chain led by less than NEAR_TIE
    assert tps >= best[3] * (1 - autotree.NEAR_TIE) and tps < best[3]
    assert all(r[0].nodes >= 1 for r in table if r[3] >= best[3] * (1 - autotree.NEAR_TIE))
    # drafting 5x cheaper: a deeper tree leads by more than NEAR_TIE and is taken
    clear = autotree.Profile(verify, {1: 9.7, 2: 14.0, 4: 18.1}, probs, 150.1)
    shape, tps, table = autotree.choose(clear)
    assert shape == table[0][0] and shape.nodes >= 2


def test_draft_stops_price_chains_from_the_calibrations_paths():
    """Chains are priced from the calibration's cycles as the engine would run them under
    --draft-stop: a second node is drafted only while the drafter's path probability holds the stop
    mass, and a cycle that stops costs a drafting pass and a 2-row verify. Where the drafter is
    unsure exactly where the verifier goes elsewhere, the stops make the 2-node chain the better one
    (on a 2-core Zen 4, bench measured a 2-node chain at 1.04-1.06x stock Q8_0 with the stops, the
    1-node chain the model without them chose at 0.93-1.00x)."""
    verify = {2: 97.0, 3: 119.0, 4: 150.0, 5: 190.0, 7: 300.0, 9: 380.0, 13: 480.0, 17: 515.0, 25: 700.0}
    draft = {1: 39.0, 2: 52.0, 4: 68.0}
    rank = [0.7, 0.1, 0.04, 0.01]
    # 35% of cycles: the drafter unsure of its first token (0.25), and wrong; else sure and right twice
    paths = [[0.0, 0.25, 0.6, 0.5]] * 35 + [[2.0, 0.97, 0.97, 0.9]] * 65
    prof = autotree.Profile(verify, draft, rank, 97.0, {}, paths)
    chain1, chain2 = TreeShape(1, 1, 1), TreeShape(2, 1, 2)
    assert autotree.expected(chain1, prof) == pytest.approx((1.65, (39.0 + 97.0) / 1000))
    # never stopping: both nodes drafted and verified in every cycle
    assert autotree.expected(chain2, prof) == pytest.approx((2.30, (2 * 39.0 + 119.0) / 1000))
    # a mass above every path probability: always one node, the 1-node chain's cycle
    assert autotree.expected(chain2, prof, stop=0.99) == pytest.approx(autotree.expected(chain1, prof))
    # auto: the mass (a drafting pass over the time per token, ~0.5) stops the unsure cycles only
    tok, sec = autotree.expected(chain2, prof, stop="auto")
    assert (tok, sec) == pytest.approx((2.30, (0.35 * (39.0 + 97.0) + 0.65 * (2 * 39.0 + 119.0)) / 1000))
    assert autotree.choose(prof)[0] == chain1
    assert autotree.choose(prof, draft_stop="auto")[0] == chain2
    # without paths (an old profile) or past the calibration's depth: the rank model, no stops
    assert autotree.choose(autotree.Profile(verify, draft, rank, 97.0), draft_stop="auto")[0] == chain1
    assert not autotree.priced_from_paths(TreeShape(4, 1, 4), prof)
    assert not autotree.priced_from_paths(TreeShape(2, 2, 1), prof)
    assert not autotree.priced_from_paths(chain2, autotree.Profile(verify, draft, rank, 97.0, {}, paths[:10]))
    # a generation pins the family of its full pass: a stopped cycle's 2-row pass is timed in it
    fam = autotree.Profile(verify, draft, rank, 97.0, {"a": {2: 90.0, 3: 200.0}, "b": {2: 100.0, 3: 110.0}}, paths)
    assert autotree.expected(chain2, fam, stop=0.99)[1] == pytest.approx((39.0 + 100.0) / 1000)


def test_profile_takes_the_fastest_family_per_pass_size():
    prof = autotree.Profile({2: 99.0, 25: 99.0}, {1: 1.0}, [0.5], 99.0,
                            {"a": {2: 10.0, 25: 50.0}, "b": {2: 20.0, 25: 30.0}})
    assert prof.kernel(2) == "a" and prof.verify(2) == 10.0
    assert prof.kernel(25) == "b" and prof.verify(25) == 30.0
    assert prof.kernel(5) == "a" and prof.verify(5) == pytest.approx(10.0 + 40.0 * 3 / 23)
    assert prof.kernel(13) == "b" and prof.verify(13) == pytest.approx(20.0 + 10.0 * 11 / 23)
    assert autotree.Profile({2: 5.0}, {1: 1.0}, [0.5], 5.0).kernel(2) is None  # not measured per family
    # the policy's family keeps its place against a lead within the calibration's noise
    assert prof.kernel(2, prefer="b") == "a"  # 20 against 10: a real lead
    close = autotree.Profile({2: 99.0}, {1: 1.0}, [0.5], 99.0, {"a": {2: 10.0}, "b": {2: 10.4}})
    assert close.kernel(2) == "a" and close.kernel(2, prefer="b") == "b" and close.kernel(2, prefer="c") == "a"
    assert autotree.Profile({2: 99.0}, {1: 1.0}, [0.5], 99.0, {"a": {2: 10.0}, "b": {2: 10.6}}).kernel(2, prefer="b") == "a"
    # the cost curves price the family the run will pin: the policy's, where it keeps its place
    assert close.verify(2) == 10.0 and close.verify(2, lambda rows: "b") == 10.4
    assert close.plain() == 10.0 and close.plain(lambda rows: "b") == 10.4
    assert prof.verify(2, lambda rows: "b") == 10.0  # a real lead: the faster family's time
    shape = autotree.TreeShape(1, 1, 1)  # a 1-node chain: one 2-row verify pass and one draft
    assert autotree.expected(shape, close, lambda rows: "b")[1] == pytest.approx((1.0 + 10.4) / 1000)
    assert autotree.expected(shape, close)[1] == pytest.approx((1.0 + 10.0) / 1000)


def test_auto_tree_pins_the_generation_family_whatever_was_fastest(tiny_split, tmp_path, monkeypatch):
    """The calibration times the verifier's passes with every kernel family this CPU runs, but a
    generation pins the one family every generation of this model pins here (the policy's
    generation_family, as --no-spec and any explicit tree size do), even where another was measured
    faster: one verifier arithmetic, so the auto tree's output is --no-spec's token for token. With
    BITSPLIT_KERNEL set nothing is timed per family."""
    from bitsplit_llama.native import policy

    monkeypatch.setenv("BITSPLIT_CACHE", str(tmp_path))
    fams = autotree.candidate_families()
    assert fams == [f for f in policy.families() if f != "generic"] or len(policy.families()) <= 2
    if len(fams) < 2:
        pytest.skip(f"one kernel family on this CPU ({policy.families()})")
    pinned = policy.generation_family()
    fast = next(f for f in reversed(fams) if f != pinned)  # measured fastest below, not the one pinned
    timed = []
    real = Engine.time_pass

    def fake(self, rows, *, verify, reps=3):
        real(self, rows, verify=verify, reps=1)
        if not verify:
            return 1.0
        timed.append(self.sm.residual.kernel)
        return 2.0 + rows if self.sm.residual.kernel == fast else 9.0 + rows

    monkeypatch.setattr(Engine, "time_pass", fake)
    with Generator(tiny_split, n_ctx=256, tree_nodes="auto") as g:
        assert set(fams) <= set(timed)
        assert g.kernel == pinned and g.auto_choice["kernel"] == pinned
        assert g.sm.residual.kernel == pinned
        spec = g.generate(PROMPT, max_tokens=24).tokens
    for nodes in (0, 16):
        with Generator(tiny_split, n_ctx=256, tree_nodes=nodes) as g:
            assert g.kernel == pinned
            assert g.generate(PROMPT, max_tokens=24, speculative=nodes > 0).tokens == spec
    monkeypatch.setenv("BITSPLIT_KERNEL", fams[0])
    assert autotree.candidate_families() == []


def test_the_cost_curves_are_kept_per_residual(tiny_f32, tiny_split, tmp_path):
    """Two splits of one source share their base (the same base.gguf, the same fingerprint) but not
    their verify passes' cost: the auto tree's cached profile is keyed by the residual too."""
    from types import SimpleNamespace

    from bitsplit_llama.formats.gguf_file import GGUFFile, fingerprint
    from bitsplit_llama.formats.split import split_model

    other = tmp_path / "q8"
    split_model(tiny_f32, other, residual="q8_0", threads=2)
    fps = []
    for d in (tiny_split, other):
        with GGUFFile(d / "base.gguf") as g:
            fps.append(fingerprint(g))
    assert fps[0] == fps[1]

    def setup(d):
        res = SimpleNamespace(residual_path=d / "residual.gguf", act_bits=16)
        return autotree.setup_of(SimpleNamespace(n_gpu_layers=0, fast_drafter=None, rpc=None, residual=res))

    assert setup(tiny_split) == setup(tiny_split)
    assert setup(tiny_split) != setup(other)
    # the fingerprint is read only where asked (it reads every tensor's edges), and is the one
    # setup_of reads for itself
    from bitsplit_llama.formats.modeldir import residual_keys

    assert "residual_fingerprint" not in residual_keys(tiny_split / "residual.gguf")
    fp = residual_keys(tiny_split / "residual.gguf", with_fingerprint=True)["residual_fingerprint"]
    assert len(fp) == 16 and fp in setup(tiny_split)
    assert autotree.cache_path(fps[0], 2, setup(tiny_split)) != autotree.cache_path(fps[1], 2, setup(other))


def test_a_cap_set_after_a_cached_profile_measures_again(tiny_split, tmp_path, monkeypatch):
    """A profile measured without BITSPLIT_MAX_ISA pinned a family that the cap then refused (every
    run under the cap failed with 'cannot run on this CPU'): the cap, BITSPLIT_HALF_RATE_512 and
    BITSPLIT_KERNEL are part of the profile's key (next test), and a family the run cannot pin is
    left to the policy: the run under the cap pins what the cap allows, its output the verifier's."""
    from bitsplit_llama.errors import UnsupportedModelError

    monkeypatch.setenv("BITSPLIT_CACHE", str(tmp_path))
    fams = autotree.candidate_families()
    if not fams:
        pytest.skip("one fast kernel family on this CPU: nothing is timed per family")
    want = fams[0]
    real = Engine.time_pass

    def fake(self, rows, *, verify, reps=3):
        real(self, rows, verify=verify, reps=1)
        return 1.0 if not verify or self.sm.residual.kernel == want else 9.0

    monkeypatch.setattr(Engine, "time_pass", fake)
    with Generator(tiny_split, n_ctx=256, tree_nodes="auto") as g:
        assert g.kernel == want
    monkeypatch.setenv("BITSPLIT_MAX_ISA", "generic")
    with Generator(tiny_split, n_ctx=256, tree_nodes="auto") as g:
        assert g.kernel == "generic"
        spec = g.generate(PROMPT, max_tokens=12).tokens
        assert spec == g.generate(PROMPT, max_tokens=12, speculative=False).tokens
        with pytest.raises(UnsupportedModelError, match=r"'avx2-f32' cannot run on this CPU under "
                                                        r"BITSPLIT_MAX_ISA=generic \(it runs: generic\)"):
            g.sm.residual.set_kernel("avx2-f32")


def test_the_cost_curves_are_kept_per_kernel_setting(tiny_split, monkeypatch):
    """The profile's key holds the cap, the half-rate override and BITSPLIT_KERNEL: each changes
    which families run or which the policy prefers, so none reuses the others' pinned family; and the
    verifier's activation bits, which change a verify pass's cost."""
    from types import SimpleNamespace

    def setup(act_bits=16):
        res = SimpleNamespace(residual_path=tiny_split / "residual.gguf", act_bits=act_bits)
        return autotree.setup_of(SimpleNamespace(n_gpu_layers=0, fast_drafter=None, rpc=None, residual=res))

    for name in ("BITSPLIT_MAX_ISA", "BITSPLIT_HALF_RATE_512", "BITSPLIT_KERNEL"):
        monkeypatch.delenv(name, raising=False)
    plain = setup()
    assert plain == setup()
    monkeypatch.setenv("BITSPLIT_MAX_ISA", "generic")
    capped = setup()
    assert capped != plain and "isa=generic" in capped
    monkeypatch.delenv("BITSPLIT_MAX_ISA")
    monkeypatch.setenv("BITSPLIT_KERNEL", "generic")
    assert setup() not in (plain, capped)
    monkeypatch.delenv("BITSPLIT_KERNEL")
    # the verifier's activation bits (--act-bits, as resolved): 8 halves the multiplies of a pass
    assert setup(8) != setup(16) == plain and "act_bits=8" in setup(8)


def test_a_profile_family_this_run_cannot_pin_is_left_to_the_policy(tiny_split, tmp_path, monkeypatch):
    """A cached profile whose fastest family this run cannot pin (a hand-made or foreign cache) changes
    nothing: the generation's family is pinned, where pinning the other would fail the run."""
    from bitsplit_llama.native import policy

    monkeypatch.setenv("BITSPLIT_CACHE", str(tmp_path))
    monkeypatch.delenv("BITSPLIT_KERNEL", raising=False)
    odd = autotree.Profile({2: 5.0, 8: 9.0}, {1: 1.0, 4: 2.0}, [0.9, 0.05], 5.0,
                           {"no-such-family": {2: 1.0, 8: 2.0}, policy.kernel_for_batch(2): {2: 50.0, 8: 90.0}})
    assert odd.kernel(2) == "no-such-family"
    monkeypatch.setattr(autotree, "load_or_measure", lambda *a, **k: odd)
    with Generator(tiny_split, n_ctx=256, tree_nodes="auto") as g:
        assert g.kernel == policy.generation_family() == g.auto_choice["kernel"]
