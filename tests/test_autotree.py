"""--tree-nodes auto end to end on a tiny model: measured once through the engine's measurement API,
cached, and the chosen tree still emits the verifier's tokens."""

from __future__ import annotations

from bitsplit_llama.speculative import autotree
from bitsplit_llama.speculative.engine import Engine, Stats, TreeShape
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
    assert list((tmp_path / "autotree").glob("*.json"))
    said.clear()
    with Generator(tiny_split, n_ctx=512, tree_nodes="auto", log=said.append) as g2:
        assert not any("measuring" in s for s in said)  # the cached profile
        assert g2.auto_choice == choice
