"""The drafter's calibration: the measured chance the verifier takes a candidate, per drafter
probability, and trees grown and pruned by it (without a model)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bitsplit_llama.speculative.calibration import EDGES, MAX_SHARE, WINDOW, DraftCalibration
from bitsplit_llama.speculative.tree import DRAFTER, ROOT, TEXT, DraftTree, TreeBuilder


def _tree(q: float, depth: int = 1) -> DraftTree:
    """A chain of ``depth`` drafter nodes, each given probability ``q`` by the drafter."""
    t = DraftTree(0)
    parent = ROOT
    for d in range(depth):
        parent = t.add(10 + d, parent, d * math.log(q), DRAFTER, q)
    return t


def test_the_prior_is_the_drafters_own_probability():
    c = DraftCalibration()
    for q in (0.01, 0.15, 0.55, 0.93, 0.999):
        b = c.bucket(q)
        lo = 0.0 if b == 0 else EDGES[b - 1]
        hi = 1.0 if b == len(EDGES) else EDGES[b]
        assert lo <= q <= hi and c.share(q) == pytest.approx(min((lo + hi) / 2, MAX_SHARE))


def test_the_share_follows_what_the_verifier_takes():
    c = DraftCalibration()
    for _ in range(3 * WINDOW):  # the drafter says 0.55, the verifier always takes it
        c.record(_tree(0.55), [0])
    assert c.share(0.55) > 0.95
    assert c.share(0.15) == pytest.approx(0.15)  # other buckets untouched
    for _ in range(3 * WINDOW):  # now it never does
        c.record(_tree(0.55), [])
    assert c.share(0.55) < 0.05
    for _ in range(3 * WINDOW):
        c.record(_tree(0.999), [0])
    assert c.share(0.999) == MAX_SHARE  # never certain: a chain of sure nodes still costs its rows


def test_only_reached_drafter_candidates_count():
    c = DraftCalibration()
    before = c.table()
    c.record(_tree(0.55, depth=2), [])  # the second node's parent was not taken: only the first counts
    after = c.table()
    b = c.bucket(0.55)
    assert after[b]["weight"] == pytest.approx(before[b]["weight"] * (1 - 1 / WINDOW) + 1, abs=0.05)
    t = DraftTree(0)
    t.add(5, ROOT, math.log(0.5), TEXT)  # the text's alone: the drafter gave it nothing
    c2 = DraftCalibration()
    c2.record(t, [0])
    assert c2.table() == DraftCalibration().table()


def test_builder_values_nodes_by_the_calibration_and_keeps_the_drafters_probability():
    cal = DraftCalibration()
    for _ in range(3 * WINDOW):
        cal.record(_tree(0.55), [0])  # 0.5-0.6: taken nearly always
        cal.record(_tree(0.25), [])   # 0.2-0.3: never
    b = TreeBuilder(7, width=2, max_nodes=8, calibrate=cal.logp)
    b.offer(ROOT, [1, 2], [math.log(0.55), math.log(0.25)])
    first, second = b.next_round()
    n1, n2 = b.tree.nodes[first], b.tree.nodes[second]
    assert n1.q == pytest.approx(0.55) and n2.q == pytest.approx(0.25)
    assert math.exp(n1.logp) == pytest.approx(cal.share(0.55)) and math.exp(n2.logp) < 0.01
    b.offer(first, [3], [math.log(0.55)])
    (third,) = b.next_round()[:1]
    assert b.tree.nodes[third].logp == pytest.approx(2 * math.log(cal.share(0.55)))


def test_settled_when_nothing_left_can_enter_the_best():
    """As the engine drafts: each round decodes (offers the children of) the nodes the last one added;
    a child is worth at most its parent."""
    b = TreeBuilder(0, width=2, max_nodes=10)
    assert not b.settled(1, [])
    b.offer(ROOT, [1, 2, 5], [math.log(0.9), math.log(0.3), math.log(0.02)])
    a, x = b.next_round()                     # 0.9, 0.3
    assert not b.settled(3, [a, x])           # fewer than 3 nodes
    assert not b.settled(2, [a, x])           # node 1's children (up to 0.9) may beat 0.3
    assert b.settled(1, [a, x])               # nothing can beat 0.9
    b.offer(a, [3], [math.log(0.5)])          # 0.45
    b.offer(x, [4], [math.log(0.1)])          # 0.03
    b.next_round()                            # 0.45 and 0.03 (the pool keeps 0.02)
    assert b.settled(2, [])                   # the best 2 are 0.9 and 0.45; nothing left beats 0.45
    assert not b.settled(3, [len(b.tree) - 2])  # 0.45's children may beat the third best, 0.3
    assert b.settled(0, [])


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(0.0, 1.0), min_size=1, max_size=40), st.lists(st.booleans(), min_size=1, max_size=40))
def test_shares_stay_probabilities(qs, hits):
    c = DraftCalibration()
    for q, h in zip(qs, hits):
        c.record(_tree(max(q, 1e-6)), [0] if h else [])
    for q in np.linspace(0, 1, 23):
        assert 0.0 < c.share(q) <= MAX_SHARE and c.logp(math.log(max(q, 1e-9))) <= 0.0


def test_a_rounds_gain_counts_what_its_children_would_push_out():
    b = TreeBuilder(0, width=2, max_nodes=10)
    b.offer(ROOT, [1, 2, 3], [math.log(0.6), math.log(0.3), math.log(0.1)])
    a, x = b.next_round()                                 # 0.6, 0.3
    assert b.round_gain(4, [a, x]) == pytest.approx(0.9)  # the tree is not full: the values themselves
    assert b.round_gain(2, [a, x]) == pytest.approx(0.3)  # full: 0.6 and 0.3 over the 2nd best (0.3)
    assert b.round_gain(1, [a, x]) == pytest.approx(0.0)  # nothing can beat the best (0.6)


def test_drain_takes_the_known_candidates_that_beat_the_kth():
    b = TreeBuilder(0, width=1, max_nodes=10)
    b.offer(ROOT, [1, 2, 3], [math.log(0.5), math.log(0.3), math.log(0.2)])
    b.next_round()                                        # 0.5; the pool keeps 0.3 and 0.2
    assert b.drain(2) == 1 and len(b.tree) == 2           # 0.3 fills the 2 best; 0.2 beats nothing
    assert sorted(n.token for n in b.tree.nodes) == [1, 2]
    assert b.drain(2) == 0
    assert b.drain(3) == 1 and len(b.tree) == 3
