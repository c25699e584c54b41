"""Draft branches from the text itself (speculative/lookup.py) and their place in the draft tree."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bitsplit_llama.speculative.lookup import MAX_MATCH, Branch, TextLookup, match_class
from bitsplit_llama.speculative.tree import DRAFTER, ROOT, TEXT, DraftTree, accept


def _index_of(tokens: list[int], max_ngram: int) -> list[dict]:
    fresh = TextLookup(max_ngram=max_ngram)
    fresh.extend(tokens)
    return fresh._index


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["extend", "truncate"]), st.lists(st.integers(0, 5), max_size=12),
                          st.integers(0, 40)), max_size=12))
def test_the_index_follows_extends_and_truncations(ops):
    """However the text grows and shrinks, the index is the one built from the text at once."""
    lk = TextLookup(max_ngram=3)
    text: list[int] = []
    for op, toks, n in ops:
        if op == "extend":
            lk.extend(toks)
            text += toks
        else:
            lk.truncate(n)
            del text[n:]
        assert lk.tokens == text
        assert lk._index == _index_of(text, 3)


def test_the_longest_match_comes_first_then_the_latest():
    lk = TextLookup(max_ngram=2, max_branches=3, min_p=1e-6)
    # "9 1 2 3" occurs once, "1 2" later once more followed by 7: the query "... 9 1 2" matches the
    # first occurrence over 3 tokens, the second over 2
    lk.extend([9, 1, 2, 3, 4, 5, 0, 1, 2, 7, 8, 6, 9, 1])
    b = lk.branches(2, max_len=4)
    assert [x.tokens for x in b][:2] == [[3, 4, 5, 0], [7, 8, 6, 9]]
    assert b[0].match == 3 and b[1].match == 2
    # distinct first tokens only; the continuation may run into the root itself
    lk2 = TextLookup(max_ngram=1, min_p=1e-6)
    lk2.extend([5, 6, 5])
    assert [x.tokens for x in lk2.branches(6, max_len=3)] == [[5, 6]]  # after the 6 at position 1: 5, then the root
    assert lk2.branches(42, max_len=3) == []  # no earlier occurrence
    assert lk2.branches(6, max_len=0) == []


def test_match_classes_and_the_count_in_full():
    assert [match_class(n) for n in (1, 2, 3, 4, 7, 8, 16, 32, 64, 1000)] == [0, 1, 1, 2, 2, 3, 4, 5, 6, 6]
    lk = TextLookup(max_ngram=2, min_p=1e-6)
    seq = list(range(100, 180))
    lk.extend(seq + [1] + seq[:-1])
    (b,) = lk.branches(seq[-1], max_len=1)
    assert b.match == MAX_MATCH and b.tokens == [1]


def test_measured_acceptance_decides_the_length():
    """Branches that the verifier takes whole grow longer; branches it refuses at once shrink to nothing."""
    lk = TextLookup(max_ngram=1, min_p=0.3)
    lk.extend([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 0])
    first = lk.branches(1, max_len=16)[0]
    assert first.tokens[:1] == [2] and all(a >= b for a, b in zip(first.logps, first.logps[1:]))
    assert all(lp >= math.log(0.3) for lp in first.logps)
    for _ in range(40):
        b = lk.branches(1, max_len=16)[0]
        lk.record(b, b.tokens + [99])  # all taken
    assert len(lk.branches(1, max_len=16)[0].tokens) > len(first.tokens)
    for _ in range(200):
        b = lk.branches(1, max_len=16)
        if not b:
            break
        lk.record(b[0], [77])  # the first token refused
    assert lk.branches(1, max_len=16) == []
    assert lk.p(1) < 0.3


def test_a_text_branch_grafts_onto_the_drafter_tree():
    tree = DraftTree(root_token=5)
    a = tree.add(10, ROOT, -0.1)
    tree.add(11, a, -0.3)
    added = tree.graft([10, 12, 13, 14], [-0.05, -0.2, -0.4, -0.6], TEXT, max_new=2)
    assert added == 2  # 10 shared, 12 and 13 new, 14 over the budget
    assert tree.nodes[a].source == DRAFTER | TEXT and tree.nodes[a].logp == pytest.approx(-0.05)
    new = [n for n in tree.nodes if n.source == TEXT]
    assert [n.token for n in new] == [12, 13] and [n.depth for n in new] == [2, 3]
    tree.validate()
    for i, n in enumerate(tree.nodes):  # log-probabilities never increase downwards: best() keeps ancestors
        if n.parent != ROOT:
            assert n.logp <= tree.nodes[n.parent].logp
    best = tree.best(3).dfs()  # by log-probability whatever the source: the drafter's 11 (-0.3) before 13 (-0.4)
    assert [(n.token, n.source) for n in best.nodes] == [(10, DRAFTER | TEXT), (12, TEXT), (11, DRAFTER)]
    # the verifier walks it as any tree: 10 and 12 taken, 7 instead of 13
    toks = iter([10, 12, 7])
    accepted, bonus, emitted = accept(best, lambda row: next(toks))
    assert emitted == [10, 12, 7] and bonus == 7 and len(accepted) == 2


# -- edits that rename ------------------------------------------------------------------------------
# a passage (distinct tokens) where OLD stands three times; the text writes it again with NEW
OLD, NEW = 50, (60, 61)
PASSAGE = [70, 71, 72, 1, 2, 3, OLD, 4, 5, 6, 7, 8, 9, OLD, 10, 11, 12, 13, 14, 15, 16, 17, OLD, 18, 19, 20, 21]


def _renamed(tokens: list[int]) -> list[int]:
    out: list[int] = []
    for t in tokens:
        out += list(NEW) if t == OLD else [t]
    return out


def test_a_rename_is_learnt_and_written_where_the_old_name_stood():
    lk = TextLookup(min_p=1e-6)
    lk.extend(PASSAGE + [99, 98])
    text = _renamed(PASSAGE[:13])  # ... 3, NEW, 4, ..., 9: in step again for 6 tokens
    lk.extend(text[:-1])
    (b, *_) = lk.branches(text[-1], max_len=12)
    assert lk.subs == {(OLD,): [NEW, 0, 0]}
    # the continuation carries the new name where the passage had the old one, and says where
    assert b.tokens[:3] == list(NEW) + [10] and b.subs[0] == (0, 2, (OLD,))
    # after the next renamed occurrence the match runs on through it (the new name read as the old)
    lk.extend([text[-1]] + _renamed(PASSAGE[13:16]))
    (b2, *_) = lk.branches(PASSAGE[16], max_len=12)
    assert b2.match > 10 and b2.tokens[:7] == [13, 14, 15, 16, 17] + list(NEW)
    # taken: counted for it
    lk.record(b2, b2.tokens + [0])
    assert lk.subs[(OLD,)][1:] == [1, 0]


def test_a_refused_substitution_is_forgotten_and_not_learnt_again():
    lk = TextLookup(min_p=1e-6)
    lk.extend(PASSAGE + [99, 98])
    text = _renamed(PASSAGE[:13])
    lk.extend(text[:-1])
    (b, *_) = lk.branches(text[-1], max_len=12)
    assert b.subs
    lk.record(b, [OLD])  # the verifier kept the old name after all: refused at the new one
    assert lk.subs == {}
    lk.branches(text[-1], max_len=12)
    assert lk.subs == {}


def test_text_in_step_with_a_passage_teaches_nothing():
    """Two lines that differ in one name, copied as they stand: the text is in step with the passage
    it copies, not with the similar line, so no substitution is learnt."""
    line_a = [80, 81, 82, 83, 40, 84, 85, 86, 87, 88, 89]
    line_b = [80, 81, 82, 83, 41, 84, 85, 86, 87, 88, 89]
    src = [1, 2, 3, 4] + line_a + [5, 6] + line_b + [7, 8]
    lk = TextLookup(min_p=1e-6)
    lk.extend(src + [99])
    copy = src[:-2]
    lk.extend(copy[:-1])
    lk.branches(copy[-1], max_len=8)
    assert lk.subs == {}


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 100), st.integers(0, 12), st.booleans()), max_size=40))
def test_shares_never_fall_with_the_match_length(records):
    """Whatever the verifier took or refused, a longer match is valued at least as a shorter one;
    where the running shares already rise they are the shares themselves."""
    lk = TextLookup(max_ngram=1, min_p=1e-6)
    for match, n, taken in records:
        toks = list(range(1, n + 2))
        lk.record(Branch(toks, match, [0.0] * len(toks)), toks + [0] if taken else [0])
        shares = lk.shares()
        assert all(a <= b + 1e-12 for a, b in zip(shares, shares[1:]))
        raw = [h / t for h, t in lk._acc]
        if all(a <= b for a, b in zip(raw, raw[1:])):
            assert shares == pytest.approx(raw)
        assert all(lk.p(m) == shares[match_class(m)] for m in (1, 5, 40, 100))
