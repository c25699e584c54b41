"""Draft trees and acceptance, without a model (hypothesis properties)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bitsplit_llama.speculative.sampling import SamplingParams, draw, processed, top_candidates
from bitsplit_llama.speculative.tree import ROOT, DraftTree, TreeBuilder, accept


@st.composite
def trees(draw_, max_nodes=24):
    n = draw_(st.integers(0, max_nodes))
    t = DraftTree(root_token=0)
    for i in range(n):
        parent = draw_(st.integers(-1, len(t) - 1)) if len(t) else ROOT
        used = {t.nodes[c].token for c in t.children(parent)}
        token = draw_(st.integers(1, 50).filter(lambda x: x not in used))
        base = 0.0 if parent == ROOT else t.nodes[parent].logp
        t.add(token, parent, base - draw_(st.floats(0.0, 3.0)))
    return t


@given(trees(), st.integers(0, 30))
def test_best_is_ancestor_closed_and_keeps_the_most_probable(t, k):
    b = t.best(k)
    b.validate()
    assert len(b) == min(k, len(t))
    kept = sorted((n.logp for n in b.nodes), reverse=True)
    all_ = sorted((n.logp for n in t.nodes), reverse=True)
    assert kept == all_[:len(kept)]


@given(trees())
def test_layout_rows_see_their_subtree(t):
    tokens, depths, seen = t.layout()
    assert tokens[0] == t.root_token and depths[0] == 0
    assert len(tokens) == len(depths) == len(seen) == len(t) + 1
    assert seen[0] == list(range(len(t) + 1))  # every row attends to the root
    for i, n in enumerate(t.nodes):
        parent_row = 0 if n.parent == ROOT else 1 + n.parent
        assert set(seen[1 + i]) <= set(seen[parent_row]) and 1 + i in seen[1 + i]
        assert depths[1 + i] == n.depth
    # a row's query sees exactly its ancestors (plus itself): one row per depth
    for q in range(len(tokens)):
        visible = [r for r in range(len(tokens)) if q in seen[r]]
        assert sorted(depths[r] for r in visible) == list(range(depths[q] + 1))


@given(trees())
def test_dfs_keeps_the_tree_and_puts_the_main_chain_first(t):
    d = t.dfs()
    d.validate()
    assert sorted((n.token, n.depth, n.logp) for n in d.nodes) == sorted((n.token, n.depth, n.logp) for n in t.nodes)
    # following the most probable child from the root visits rows 1, 2, 3, ...
    cur, row = ROOT, 0
    while d.children(cur):
        best = max(d.children(cur), key=lambda c: (d.nodes[c].logp, -c))
        assert best == row
        cur, row = best, row + 1


@given(trees(), st.lists(st.integers(0, 60), min_size=1, max_size=40))
def test_accept_walks_a_path_and_emits_verifier_tokens(t, choices):
    seq = iter(choices + [99] * 40)
    drawn_rows = []

    def verifier(row):
        drawn_rows.append(row)
        return next(seq)

    acc, bonus, emitted = accept(t, verifier)
    assert 1 <= len(emitted) <= t.depth() + 1
    assert emitted[-1] == bonus and len(emitted) == len(acc) + 1
    # the accepted nodes form a chain from the root, and each is what the verifier drew
    prev = ROOT
    for i, node in enumerate(acc):
        assert t.nodes[node].parent == prev
        assert emitted[i] == t.nodes[node].token
        prev = node
    assert bonus not in [t.nodes[c].token for c in t.children(prev)]
    assert drawn_rows == [0] + [1 + a for a in acc]  # one draw per emitted token


def test_builder_grows_best_first_and_respects_budget():
    b = TreeBuilder(root_token=7, width=2, max_nodes=5)
    b.offer(ROOT, [1, 2, 3], [np.log(0.6), np.log(0.3), np.log(0.1)])
    assert b.next_round() == [0, 1]  # tokens 1 and 2
    b.offer(0, [4, 5], [np.log(0.9), np.log(0.1)])  # 0.54 and 0.06 cumulative
    added = b.next_round()
    assert [b.tree.nodes[i].token for i in added] == [4, 3]  # 0.54 > 0.1 > 0.06
    b.offer(1, [6], [np.log(0.5)])
    assert len(b.next_round()) == 1  # budget of 5 nodes
    assert len(b.tree) == 5 and b.next_round() == []


def test_priced_nodes_past_the_own_budget_need_the_floor():
    """With ``own`` < ``k`` the nodes past the ``own`` best are priced: one enters only where it is
    worth ``floor``; without a floor, or with ``own`` = ``k``, the builder is the unpriced one."""
    b = TreeBuilder(root_token=7, width=2, max_nodes=8)
    b.offer(ROOT, [1, 2, 3, 4], [np.log(0.5), np.log(0.3), np.log(0.15), np.log(0.05)])
    b.next_round()                                   # tokens 1 and 2: the own 2 are drafted
    floor = np.log(0.1)
    assert b.bar(4, own=2, floor=floor) == pytest.approx(floor)  # 3 (0.15) may enter, 4 (0.05) not
    assert b.bar(4) == -np.inf and b.bar(2) == pytest.approx(np.log(0.3))
    assert not b.settled(4, [], own=2, floor=floor)
    assert b.round_gain(4, [0, 1], own=2, floor=floor) == pytest.approx(0.4 + 0.2)
    assert b.drain(4, own=2, floor=floor) == 1      # token 3 only
    assert sorted(n.token for n in b.tree.nodes) == [1, 2, 3]
    assert b.settled(4, [], own=2, floor=floor)     # token 4 is worth less than the floor
    assert not b.settled(4, [])                      # unpriced: 3 nodes of 4, not settled
    assert b.drain(4) == 1 and len(b.tree) == 4


def test_the_drafters_own_chain_survives_pruning_and_reordering():
    """top_chain: the chain a 1-wide drafter would have drafted, read from a wider tree (what the
    auto tree prices --draft-stop's early stops from), through best() and dfs()."""
    from bitsplit_llama.speculative.engine import chain_record

    b = TreeBuilder(root_token=7, width=2, max_nodes=6)
    b.offer(ROOT, [1, 2], [np.log(0.6), np.log(0.4)])
    b.next_round()                                   # 0: token 1 (0.6), 1: token 2 (0.4)
    b.offer(0, [3, 4], [np.log(0.5), np.log(0.5)])   # 0.30, 0.30
    b.offer(1, [5, 6], [np.log(0.95), np.log(0.05)])  # 0.38, 0.02
    b.next_round()                                   # token 5 (0.38), token 3 (0.30)
    b.offer(3, [8], [np.log(0.7)])                   # under token 3 (node 3): the chain's third
    t = b.tree.best(5).dfs()
    chain = t.top_chain()
    assert [t.nodes[i].token for i, _ in chain if i >= 0] == [1, 3]
    assert [round(p, 6) for _, p in chain] == [0.6, 0.5, 0.7] and chain[-1][0] == -1  # 8 never added
    one = {t.nodes[i].token: i for i in range(len(t))}
    # the verifier followed the chain twice, then emitted 8: the chain would have taken it too
    assert chain_record(t, [one[1], one[3]], 8) == [3.0, 0.6, 0.5, 0.7]
    assert chain_record(t, [one[1], one[3]], 9) == [2.0, 0.6, 0.5, 0.7]
    assert chain_record(t, [one[2], one[5]], 0) == [0.0, 0.6, 0.5, 0.7]  # another branch: a miss
    assert chain_record(t, [one[1]], 4) == [1.0, 0.6, 0.5, 0.7]
    assert chain_record(t, [], 2) == [0.0, 0.6, 0.5, 0.7]
    assert DraftTree(0).top_chain() == []


def test_top_candidates_orders_and_clips():
    lp = np.log(np.array([0.1, 0.5, 0.05, 0.35]))
    ids, vals = top_candidates(lp, 3)
    assert list(ids) == [1, 3, 0] and np.all(np.diff(vals) <= 0)
    assert len(top_candidates(lp, 10)[0]) == 4


@settings(max_examples=50)
@given(st.lists(st.floats(-5, 5), min_size=3, max_size=30), st.floats(0.1, 2.0), st.integers(0, 10),
       st.floats(0.05, 1.0), st.floats(0.0, 0.5))
def test_processed_distribution_is_a_distribution(logits, temp, top_k, top_p, min_p):
    sp = SamplingParams(temperature=temp, top_k=top_k, top_p=top_p, min_p=min_p)
    l32 = np.array(logits, dtype=np.float32)
    ids, p = processed(l32, sp)
    assert len(ids) >= 1 and abs(p.sum() - 1) < 1e-9 and np.all(p > 0)
    assert len(set(ids.tolist())) == len(ids)
    if top_k:
        assert len(ids) <= top_k
    assert l32[ids[0]] == l32.max()


def test_sampling_rejects_bad_values():
    from bitsplit_llama.errors import InvalidOptionError

    for kw in ({"temperature": -0.1}, {"top_p": 0.0}, {"top_p": 1.5}, {"min_p": -0.1}, {"top_k": -1},
               {"seed": -3}, {"temperature": float("nan")}):
        with pytest.raises(InvalidOptionError):
            SamplingParams(**kw)


def test_draw_uses_one_random_number_per_token():
    sp = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=1)
    logits = np.array([0.0, 1.0, 2.0], dtype=np.float32)
    a, b = np.random.default_rng(5), np.random.default_rng(5)
    for _ in range(10):
        draw(logits, sp, a)
        b.random()
    assert a.random() == b.random()
