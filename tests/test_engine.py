"""The speculative engine: exactness, lossless sampling, stops, KV bookkeeping."""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest

from bitsplit_llama.errors import ContextLimitError, InvalidOptionError
from bitsplit_llama.runtime.llamacpp import Context
from bitsplit_llama.speculative.engine import (MAX_SEQ, MAX_TREE_DEPTH, MAX_TREE_NODES, Engine, Stats, TreeShape,
                                               cycle_cells, max_lanes, n_seq_max_for, parse_draft_stop)
from bitsplit_llama.speculative.generate import Generator
from bitsplit_llama.speculative.sampling import SamplingParams
from test_verifier import make_f32_split

PROMPTS = [[1] + list(range(260 + 3 * p, 272 + 3 * p)) for p in range(6)]


@pytest.fixture(scope="module")
def f32_split(tmp_path_factory):
    return make_f32_split(tmp_path_factory.mktemp("f32split"))[1]


@pytest.mark.parametrize("nodes", [1, 4, 16])
def test_greedy_speculative_equals_verifier_alone_f32(f32_split, nodes):
    with Generator(f32_split, n_ctx=512, tree_nodes=nodes) as g:
        for p in PROMPTS:
            plain = g.generate(p, max_tokens=48, speculative=False)
            spec = g.generate(p, max_tokens=48, speculative=True)
            assert spec.tokens == plain.tokens
            assert plain.stats.tokens_per_verify == pytest.approx(1.0)


def test_greedy_speculative_equals_verifier_alone_quantized(tiny_split):
    """Q2_K base + Q6_K residual: the verifier's products are batch-invariant and the KV cache stays
    in position order, so speculation changes no token even on a quantized model."""
    with Generator(tiny_split, n_ctx=512, tree_nodes=16) as g:
        for p in PROMPTS:
            plain = g.generate(p, max_tokens=64, speculative=False)
            spec = g.generate(p, max_tokens=64, speculative=True)
            assert spec.tokens == plain.tokens
        assert g.last_stats.n_verify < 64


def test_either_drafter_gives_the_verifiers_tokens(tiny_split):
    """The drafter (a native family or llama.cpp's own kernels) changes what is proposed, never what
    is emitted. Where this CPU has no native drafting family, asking for one is a clear error."""
    from bitsplit_llama.errors import UnsupportedModelError
    from bitsplit_llama.native import policy

    out = {}
    drafters = ["llama.cpp", "auto"]
    if policy.draft_kernel() is not None:
        drafters.append("native")
    else:
        with pytest.raises(UnsupportedModelError, match="no native drafting kernel"):
            Generator(tiny_split, n_ctx=512, tree_nodes=8, drafter="native")
    for drafter in drafters:
        with Generator(tiny_split, n_ctx=512, tree_nodes=8, drafter=drafter) as g:
            native_ran = g.sm.drafter != "llama.cpp"
            assert native_ran == (drafter == "native" or (drafter == "auto" and policy.draft_kernel() is not None))
            if native_ran:
                assert g.sm.drafter == policy.draft_kernel()
            out[drafter] = [g.generate(p, max_tokens=48).tokens for p in PROMPTS]
            counters = g.sm.residual.counters()
            # llama.cpp's drafter leaves every product to ggml; the native one takes those of draft
            # passes from its family's smallest batch on (1 or 2 columns; a wider one a tree might
            # never reach: test_fast_drafter_computes_the_base_products checks it drafts there)
            if not native_ran or policy.draft_min_cols() <= 2:
                assert (counters.n_draft_products > 0) == native_ran
            plain = [g.generate(p, max_tokens=48, speculative=False).tokens for p in PROMPTS]
        assert out[drafter] == plain
    assert all(o == out["llama.cpp"] for o in out.values())


def test_same_seed_same_sample(tiny_split):
    sp = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=1234)
    with Generator(tiny_split, n_ctx=256, tree_nodes=8) as g:
        a = g.generate(PROMPTS[0], max_tokens=40, sampling=sp, speculative=False).tokens
        b = g.generate(PROMPTS[0], max_tokens=40, sampling=sp, speculative=True).tokens
    assert a == b


def _chi2_critical(df: int, alpha: float) -> float:
    # Wilson-Hilferty approximation of the chi-square quantile
    z = {0.001: 3.0902, 0.01: 2.3263, 0.05: 1.6449}[alpha]
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def _two_sample_chi2(a: Counter, b: Counter, min_count: int = 5) -> tuple[float, int]:
    keys = sorted(set(a) | set(b), key=lambda k: -(a[k] + b[k]))
    big = [k for k in keys if a[k] + b[k] >= min_count]
    rest = [k for k in keys if a[k] + b[k] < min_count]
    cells = [(a[k], b[k]) for k in big] + ([(sum(a[k] for k in rest), sum(b[k] for k in rest))] if rest else [])
    na, nb = sum(a.values()), sum(b.values())
    stat = 0.0
    for x, y in cells:
        tot = x + y
        ea, eb = tot * na / (na + nb), tot * nb / (na + nb)
        stat += (x - ea) ** 2 / ea + (y - eb) ** 2 / eb
    return stat, len(cells) - 1


@pytest.mark.parametrize("nodes", [8, 64])
def test_speculative_sampling_is_lossless(tiny_split, nodes):
    """Independent seeds, 1500 samples each: the 2nd and 3rd generated tokens (drawn inside a
    speculative cycle) follow the same distribution as verifier-alone sampling (chi-square, alpha=0.001),
    with a small tree and a deep one (64 nodes: 24 rounds of 4, one lane per leaf)."""
    n = 1500
    with Generator(tiny_split, n_ctx=128, tree_nodes=nodes) as g:
        samples = {}
        for spec, offset in ((False, 0), (True, 10_000)):
            c2, c3 = Counter(), Counter()
            for i in range(n):
                sp = SamplingParams(temperature=0.9, top_k=12, top_p=1.0, min_p=0.0, seed=offset + i)
                t = g.generate(PROMPTS[1], max_tokens=3, sampling=sp, speculative=spec).tokens
                c2[t[1]] += 1
                c3[tuple(t[1:3])] += 1
            samples[spec] = (c2, c3)
    for idx in (0, 1):
        stat, df = _two_sample_chi2(samples[False][idx], samples[True][idx])
        assert df >= 3, "the test needs several outcomes to mean anything"
        assert stat < _chi2_critical(df, 0.001), (idx, stat, df)


def test_draft_vocabulary_changes_no_token_and_no_distribution(exact_split, monkeypatch):
    """A draft vocabulary (the drafter's head keeps token ids [0, rows)) changes what is proposed, never
    what is emitted: greedy output is the verifier's, and sampling's second token follows the
    verifier-alone distribution (chi-square, alpha=0.001) though the drafter gives the other tokens
    probability 0."""
    from bitsplit_llama.native import policy

    if policy.draft_kernel() is None:
        pytest.skip(f"no native drafting family on this CPU under BITSPLIT_MAX_ISA={policy.max_isa()}")
    with Generator(exact_split, n_ctx=256, tree_nodes=8, draft_vocab="all") as g:
        rows = g.sm.model.n_vocab // 2
        plain = [g.generate(p, max_tokens=32, speculative=False).tokens for p in PROMPTS]
        n = 800
        alone = Counter(g.generate(PROMPTS[1], max_tokens=2, speculative=False, sampling=SamplingParams(
            temperature=0.9, top_k=12, top_p=1.0, min_p=0.0, seed=i)).tokens[1] for i in range(n))
    from bitsplit_llama.runtime.verifier import DraftVocab

    # this random model's text spreads over the whole vocabulary: keep the draft vocabulary on
    monkeypatch.setattr(DraftVocab, "MAX_OUTSIDE", 1.0)
    with Generator(exact_split, n_ctx=256, tree_nodes=8, draft_vocab=rows) as g:
        assert g.sm.draft_vocab.rows == rows
        assert [g.generate(p, max_tokens=32).tokens for p in PROMPTS] == plain
        assert g.sm.draft_vocab.active and g.sm.residual.counters().n_draft_products > 0
        spec = Counter(g.generate(PROMPTS[1], max_tokens=2, sampling=SamplingParams(
            temperature=0.9, top_k=12, top_p=1.0, min_p=0.0, seed=10_000 + i)).tokens[1] for i in range(n))
    assert any(t >= rows for t in alone), "the test needs tokens outside the draft vocabulary"
    stat, df = _two_sample_chi2(alone, spec)
    assert df >= 3 and stat < _chi2_critical(df, 0.001), (stat, df)


def test_draft_stop_values(tiny_split):
    assert parse_draft_stop(None) is None and parse_draft_stop("off") is None and parse_draft_stop("0") is None
    assert parse_draft_stop("auto") == "auto" and parse_draft_stop("0.25") == 0.25 and parse_draft_stop(1) == 1.0
    for bad in ("sometimes", "1.5", "-0.1", "nan", ""):
        with pytest.raises(InvalidOptionError, match="--draft-stop"):
            parse_draft_stop(bad)
    with pytest.raises(InvalidOptionError, match="'often'"):
        Generator(tiny_split, n_ctx=128, tree_nodes=8, draft_stop="often")


def test_draft_stop_auto_prices_a_round_in_tokens(tiny_split):
    """auto: no early stop until a cycle has been measured; then the threshold is the seconds per
    drafter round over the seconds per emitted token (exponential averages)."""
    with Generator(tiny_split, n_ctx=128, tree_nodes=16, draft_stop="auto") as g:
        e = g.engine
        assert e.stop_mass() == 0.0
        e._measure_cycle(seconds=1.0, n_emitted=10, draft_s=0.2, n_passes=4)
        assert e.stop_mass() == pytest.approx(0.05 / 0.1)
        e._measure_cycle(seconds=1.0, n_emitted=5, draft_s=0.2, n_passes=4)  # tokens dearer: stop later
        assert e.stop_mass() == pytest.approx(0.05 / (0.7 * 0.1 + 0.3 * 0.2))
        g.engine._round_s = g.engine._token_s = None
        g.generate(PROMPTS[0], max_tokens=24)
        assert g.engine.stop_mass() > 0.0  # measured by a real cycle


@pytest.mark.parametrize("stop", [0.9, "auto"])
def test_early_stop_drafts_less_and_changes_no_token(tiny_split, stop):
    """A draft that ends before its budget (the next round's nodes hold less path probability than the
    threshold) keeps its last nodes as leaves: fewer drafter passes, the verifier's tokens unchanged."""
    runs = {}
    for s in (None, stop):
        with Generator(tiny_split, n_ctx=512, tree_nodes=64, draft_stop=s) as g:
            res = [g.generate(p, max_tokens=40) for p in PROMPTS[:3]]
            plain = [g.generate(p, max_tokens=40, speculative=False).tokens for p in PROMPTS[:3]]
            assert [r.tokens for r in res] == plain
            runs[s] = ([r.tokens for r in res], sum(r.stats.n_draft_passes for r in res),
                       sum(r.stats.n_early_stops for r in res), sum(r.stats.n_verify for r in res))
    assert runs[None][0] == runs[stop][0]
    assert runs[None][2] == 0
    if stop == 0.9:  # a threshold this high stops nearly every draft after its first rounds
        assert runs[stop][2] > 0
        assert runs[stop][1] / runs[stop][3] < runs[None][1] / runs[None][3]


def test_separate_kv_drafter_gives_the_verifiers_tokens(tiny_split):
    with Generator(tiny_split, n_ctx=256, tree_nodes=16) as g:
        ref = g.generate(PROMPTS[2], max_tokens=40, speculative=False).tokens
        dctx = Context(g.model, n_ctx=256, n_batch=max(64, n_seq_max_for(g.shape)), n_seq_max=n_seq_max_for(g.shape))
        try:
            eng = Engine(g.sm, g.shape, draft_ctx=dctx)
            st = Stats()
            got = [t for chunk in eng.generate(PROMPTS[2], 40, SamplingParams(), stats=st) for t in chunk]
        finally:
            dctx.close()
    assert got == ref and st.n_verify < 40


def test_limits_and_kv_bookkeeping(tiny_split):
    with Generator(tiny_split, n_ctx=64, tree_nodes=16) as g:
        r = g.generate(PROMPTS[0], max_tokens=7)
        assert len(r.tokens) == 7 and r.finish_reason == "length"
        eng = g.engine
        # the cache holds the prompt and every emitted token but the last, in sequence 0 only
        assert eng.n_past == len(PROMPTS[0]) + 6 and eng.tokens[:len(PROMPTS[0])] == PROMPTS[0]
        assert g.sm.ctx.seq_pos_max(0) == eng.n_past - 1
        for lane in range(1, n_seq_max_for(g.shape)):
            if lane == eng._junk_lane:  # rejected tree rows parked between the text's cells (kept in order)
                assert g.sm.ctx.seq_pos_max(lane) < eng.n_past
            else:
                assert g.sm.ctx.seq_pos_max(lane) == -1
        # generation that reaches the context limit stops cleanly
        r = g.generate(PROMPTS[0], max_tokens=500)
        assert r.finish_reason in ("length", "stop") and len(PROMPTS[0]) + len(r.tokens) <= 64 + 1
        # a prompt longer than the context is a clear error, and the model stays usable
        with pytest.raises(ContextLimitError, match="prompt has 80 tokens but the context holds 64"):
            g.generate([1] + [300] * 79, max_tokens=4)
        assert len(g.generate(PROMPTS[1], max_tokens=5).tokens) == 5
        with pytest.raises(InvalidOptionError):
            g.generate([], max_tokens=3)


def test_prompt_cache_reuse_gives_the_same_output(tiny_split):
    with Generator(tiny_split, n_ctx=256, tree_nodes=8) as g:
        a = g.generate(PROMPTS[3], max_tokens=20).tokens
        b = g.generate(PROMPTS[3], max_tokens=20).tokens  # reuses the cached prompt
        g.engine.reset()
        c = g.generate(PROMPTS[3], max_tokens=20).tokens
    assert a == b == c


def test_stop_strings_and_streaming(tiny_split):
    with Generator(tiny_split, n_ctx=256, tree_nodes=8) as g:
        full = g.generate("the cat", max_tokens=30)
        assert full.text
        stop = full.text[len(full.text) // 2: len(full.text) // 2 + 2]
        pieces = []
        res = []
        for piece, _ in g.stream("the cat", max_tokens=30, stop=[stop], on_finish=res.append):
            pieces.append(piece)
        assert "".join(pieces) == res[0].text == full.text[:full.text.find(stop)]
        assert res[0].finish_reason == "stop"


def test_tree_shape_validation():
    with pytest.raises(InvalidOptionError):
        TreeShape.for_nodes(-1)
    with pytest.raises(InvalidOptionError):
        TreeShape(4, 0, 3).validate()
    assert TreeShape.for_nodes(1).width == 1 and TreeShape.for_nodes(16).nodes == 16
    with pytest.raises(InvalidOptionError, match="257 is more than 256"):
        TreeShape.for_nodes(257)
    with pytest.raises(InvalidOptionError, match="too large"):
        TreeShape(64, 4, MAX_TREE_DEPTH + 1).validate()
    for n in range(1, MAX_TREE_NODES + 1):  # every size drafts enough candidates and fits llama.cpp's sequences
        s = TreeShape.for_nodes(n)
        s.validate()
        assert s.nodes == n and s.width * s.rounds >= n and n_seq_max_for(s) <= MAX_SEQ, s
        if n > 24:
            assert s.width * s.rounds >= 1.5 * n and s.rounds <= MAX_TREE_DEPTH, s
        # with the text's nodes beside it (as run gives them), a tree drafts as deep as the whole budget
        t = s.with_text(min(32, MAX_TREE_NODES - n))
        t.validate()
        assert (t.nodes, t.width, t.rounds) == (n, s.width, s.rounds) and n_seq_max_for(t) <= MAX_SEQ
        r = t.draft_rounds(t.text)
        assert t.draft_rounds(0) == s.rounds and s.rounds <= r <= MAX_TREE_DEPTH
        if s.width == 1 or t.text == 0:
            assert r == s.rounds, t  # a chain keeps its depth
        else:
            assert r == MAX_TREE_DEPTH or t.width * r >= 1.5 * (n + t.text), t
        assert cycle_cells(t) >= max(n + t.text, t.width * r) + 1


def test_lanes_capped_prunes_the_tree_and_keeps_the_output(tiny_split):
    """With fewer lanes than a tree has leaves, the drafter stops early and the verified tree is
    pruned to the lanes (one per leaf): the output is still the verifier's, and no lane is left
    holding cells."""
    with Generator(tiny_split, n_ctx=256, tree_nodes=64) as g:
        ref = g.generate(PROMPTS[4], max_tokens=40, speculative=False).tokens
        eng = Engine(g.sm, g.shape)
        eng.lane_cap = 5
        passes = []  # (rows, sequence ids used besides 0) of every multi-row decode
        decode = g.sm.ctx.decode

        def spy(tokens, positions, seq_ids=None, logits=True):
            if seq_ids is not None and len(tokens) > 1:
                passes.append((len(tokens), len({s for ids in seq_ids for s in ids} - {0})))
            return decode(tokens, positions, seq_ids=seq_ids, logits=logits)

        g.sm.ctx.decode = spy
        st = Stats()
        try:
            got = [t for chunk in eng.generate(PROMPTS[4], 40, SamplingParams(), stats=st) for t in chunk]
        finally:
            del g.sm.ctx.decode
        assert got == ref
        assert max(lanes for _, lanes in passes) <= 5
        assert max(rows for rows, _ in passes) > 5 + 1, "trees deeper than their lanes: the cap was exercised"
        for lane in range(1, n_seq_max_for(g.shape)):
            if lane == eng._junk_lane:  # rejected tree rows parked between the text's cells (kept in order)
                assert g.sm.ctx.seq_pos_max(lane) < eng.n_past
            else:
                assert g.sm.ctx.seq_pos_max(lane) == -1


# -- draft branches from the text itself (speculative/lookup.py) --------------------------------------
# a prompt that repeats itself, so that the text offers branches from the first cycle on
REPEATING = [PROMPTS[2] + PROMPTS[2][1:] + PROMPTS[2][1:6], PROMPTS[4] + PROMPTS[4][1:] * 2]


@pytest.mark.parametrize("nodes,text", [(0, 16), (4, 16), (16, 32)])
def test_text_branches_change_no_token(tiny_split, nodes, text):
    """Branches from the text, alone or in the drafter's tree, are verified and accepted like the
    drafter's: greedy output is the verifier's own, and some of them are taken."""
    with Generator(tiny_split, n_ctx=512, tree_nodes=nodes, text_nodes=text) as g:
        drafted = taken = 0
        for p in REPEATING + PROMPTS[:3]:
            plain = g.generate(p, max_tokens=48, speculative=False)
            spec = g.generate(p, max_tokens=48)
            assert spec.tokens == plain.tokens
            st = spec.stats
            drafted += st.n_text_drafted
            taken += st.n_accepted_text + st.n_accepted_both
            assert st.n_accepted_text <= st.n_accepted and st.n_text_drafted <= st.n_drafted
            if nodes == 0:
                assert st.n_draft_passes == 0 and st.n_accepted_text == st.n_accepted  # the text alone drafted
        assert drafted > 0 and taken > 0


def test_no_text_nodes_and_no_spec_draft_nothing_from_the_text(tiny_split):
    with Generator(tiny_split, n_ctx=512, tree_nodes=4, text_nodes=0) as g:
        assert g.shape.text == 0
        r = g.generate(REPEATING[0], max_tokens=32)
        assert r.stats.n_text_drafted == 0 and r.stats.n_accepted_text == r.stats.n_accepted_both == 0
    with Generator(tiny_split, n_ctx=512, tree_nodes=0, text_nodes=16) as g:
        assert g.shape.speculates
        r = g.generate(REPEATING[0], max_tokens=32, speculative=False)
        assert r.stats.n_drafted == 0 and r.stats.tokens_per_verify == pytest.approx(1.0)


def test_sampling_with_text_branches_is_lossless(tiny_split):
    """A tree that mixes the drafter's nodes and the text's (the prompt holds every token once, so every
    root has an earlier occurrence): the 2nd and 3rd sampled tokens follow verifier-alone sampling
    (chi-square, alpha=0.001)."""
    n = 1200
    everything = [1] + list(range(3, 336))
    with Generator(tiny_split, n_ctx=512, tree_nodes=4, text_nodes=8) as g:
        # every branch in, however rarely this random model repeats its text (the acceptance measured
        # would soon leave them out)
        g.engine.text_min_p = lambda: 1e-9
        samples, text_nodes = {}, 0
        for spec, offset in ((False, 0), (True, 10_000)):
            c2, c3 = Counter(), Counter()
            for i in range(n):
                sp = SamplingParams(temperature=0.9, top_k=12, top_p=1.0, min_p=0.0, seed=offset + i)
                r = g.generate(everything, max_tokens=4, sampling=sp, speculative=spec)
                c2[r.tokens[1] if len(r.tokens) > 1 else -1] += 1  # (-1: the end of the text came first)
                c3[tuple(r.tokens[1:3])] += 1
                text_nodes += r.stats.n_text_drafted
            samples[spec] = (c2, c3)
    assert text_nodes > n  # the trees did carry text branches
    for idx in (0, 1):
        stat, df = _two_sample_chi2(samples[False][idx], samples[True][idx])
        assert df >= 3, "the test needs several outcomes to mean anything"
        assert stat < _chi2_critical(df, 0.001), (idx, stat, df)


def test_a_text_row_is_priced_from_the_measured_passes(tiny_split):
    """The path probability a text token needs is the measured cost of one more verify row over the
    measured cost of an emitted token, kept within TEXT_MIN_P_RANGE; TEXT_MIN_P until both are known."""
    from bitsplit_llama.speculative.engine import ROW_COST_MIN_PASSES, TEXT_MIN_P, TEXT_MIN_P_RANGE

    with Generator(tiny_split, n_ctx=256, tree_nodes=4, text_nodes=8) as g:
        e = g.engine
        e._pass_times.clear()
        e._token_s = None
        assert e.row_seconds() is None and e.text_min_p() == TEXT_MIN_P
        for i in range(ROW_COST_MIN_PASSES):
            e._pass_times.append((2 + i, 0.010 + 0.002 * i))  # 2 ms a row
        assert e.row_seconds() == pytest.approx(0.002)
        assert e.text_min_p() == TEXT_MIN_P  # no token cost measured yet
        e._token_s = 0.008
        assert e.text_min_p() == pytest.approx(0.25)
        e._token_s = 0.001
        assert e.text_min_p() == TEXT_MIN_P_RANGE[1]
        e._token_s = 1.0
        assert e.text_min_p() == TEXT_MIN_P_RANGE[0]
        e._pass_times.clear()
        e._pass_times.extend([(5, 0.01)] * ROW_COST_MIN_PASSES)  # one size only: no slope
        assert e.row_seconds() is None
        r = g.generate(REPEATING[0], max_tokens=40)  # a real generation measures its own
        assert len(e._pass_times) >= 1 and r.stats.n_verify > 1


def test_text_nodes_fill_what_the_tree_leaves_of_a_pass(tiny_split):
    """--text-nodes is a ceiling: beside a tree near the 256 nodes a pass takes, the text gets what is
    left (none beside 256), and a default never refuses a tree size the user asked for."""
    for nodes, text, want in ((256, 32, 0), (250, 32, 6), (16, 32, 32)):
        with Generator(tiny_split, n_ctx=512, tree_nodes=nodes, text_nodes=text) as g:
            assert g.shape.nodes == nodes and g.shape.text == want
            if nodes == 256:
                assert g.generate(REPEATING[0], max_tokens=4).tokens


def test_drafter_takes_the_text_share_the_text_cannot_use(tiny_split):
    """The text's budget less what the text offers under the root goes to the drafter, priced as the
    text's nodes are: with nothing to copy it may add the text's whole budget, with a long match
    nothing; with rows priced free the tree grows past the drafter's own nodes, priced out it keeps
    them; the tree never holds more than nodes + text."""
    from bitsplit_llama.speculative.lookup import Branch
    from bitsplit_llama.speculative.tree import DRAFTER

    asked: list[int] = []
    offers = ([], [Branch([7, 8, 9], 3, [-0.1, -0.2, -0.3], (), ())],
              [Branch(list(range(9, 19)), 6, [-0.01 * i for i in range(1, 11)], (), ())])
    with Generator(tiny_split, n_ctx=256, tree_nodes=8, text_nodes=8) as g:
        e = g.engine
        real = e._draft_model

        def spy(id_last, sp, nodes, stats, depth=None, extra=0, min_p=0.0):
            asked.append(extra)
            return real(id_last, sp, nodes, stats, depth, extra, min_p)

        e._draft_model = spy
        root = PROMPTS[0][5]
        drafted = {}
        for price in (1e-9, 0.999):
            e.text_min_p = lambda price=price: price
            for offer in offers:
                e.lookup.branches = lambda last, max_len, after=(), o=offer: o if not after else []
                e.prefill(PROMPTS[0], Stats())
                tree, _ = e._draft(root, SamplingParams(), 8, Stats())
                e.reset()
                assert 0 < len(tree) <= 16
                drafted[price, len(offer[0].tokens) if offer else 0] = sum(1 for n in tree.nodes
                                                                           if n.source & DRAFTER)
        assert asked == [8, 5, 0] * 2
        assert drafted[1e-9, 0] > 8 and drafted[0.999, 0] <= 8 and drafted[1e-9, 10] <= 8


def test_drafter_and_text_nodes_share_one_budget(tiny_split):
    """Every node is valued by the measured chance the verifier takes it: with the drafter's candidates
    measured worthless and the text measured sure, a text branch runs past the text's own budget into
    the drafter's; the other way round the drafter keeps its nodes and the text gets the rest. The
    tree never holds more than nodes + text."""
    from bitsplit_llama.speculative.calibration import EDGES
    from bitsplit_llama.speculative.tree import DRAFTER as D, TEXT as T, DraftTree

    def calibrate(e, hit: bool) -> None:
        for q in [0.0] + list(EDGES):
            t = DraftTree(0)
            t.add(1, -1, 0.0, D, min(q + 1e-3, 1.0))
            for _ in range(1500):
                e.calibration.record(t, [0] if hit else [])

    prompt, root = REPEATING[0], PROMPTS[2][6]  # the root continues the prompt's repeat
    with Generator(tiny_split, n_ctx=256, tree_nodes=4, text_nodes=4) as g:
        e = g.engine
        e.text_min_p = lambda: 1e-3
        counts = {}
        for drafter_sure in (False, True):
            calibrate(e, drafter_sure)
            e.lookup._acc = [[0.5, 2.0] if drafter_sure else [1.98, 2.0] for _ in e.lookup._acc]
            e.prefill(prompt, Stats())
            tree, branches = e._draft(root, SamplingParams(), 4, Stats())
            e.reset()
            assert branches and 0 < len(tree) <= 8
            counts[drafter_sure] = (sum(1 for n in tree.nodes if n.source & T),
                                    sum(1 for n in tree.nodes if n.source & D))
        assert counts[False][0] > 4   # the text took the drafter's share of the budget
        assert counts[True][1] == 4   # the drafter's 4 nodes stayed
