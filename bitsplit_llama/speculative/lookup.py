"""Draft branches from the text itself: prompt lookup.

Much of what a model writes repeats text it has already seen: a function being edited written out
again, a quoted file, JSON keys, a name used once more. After the last few tokens, the tokens that
followed an earlier occurrence of them are a draft that costs no drafter pass. :class:`TextLookup`
keeps an index of the n-grams (1 to ``max_ngram`` tokens) of the text in the verifier's cache, and
offers the continuations of the longest recent matches of the text's end as branches of the draft
tree (:meth:`~bitsplit_llama.speculative.tree.DraftTree.graft`), verified in the same pass as the
drafter's and accepted by the same rule, so the output is the verifier's, token for token when
greedy and in distribution when sampling.

How many of a branch's tokens are worth a verifier row is decided by the acceptance measured in this
generation (running averages that start from a prior and follow the text): the chance that the
verifier takes a branch token once it took the ones before, per length of the match the token
continues (the tokens before it that equal those before its earlier occurrence, counted in full, in
classes 1, 2-3, 4-7, ..., 64+; a branch's token at depth ``d`` continues a match ``d - 1`` longer than
its first): the longer a match, the likelier it goes on as it did (an edited function written out
again holds for dozens of tokens, a word that recurs in prose for one or two). Their product is a
token's path probability; the tree keeps the tokens whose path probability is at least ``min_p``,
up to the shape's text budget.

Edits that rename. When the text the model writes follows an earlier passage with one short span
changed (a variable renamed: ``totals`` written ``spent_by_customer``) and then goes on as that
passage did, the change is learnt as a substitution (at most ``MAX_SUB_OLD`` tokens replaced by at
most ``MAX_SUB_NEW``, with ``SUB_CONTEXT`` + 1 equal tokens before and twice ``SUB_CONTEXT``
after). From then on a continuation copied from the text carries the new span wherever the old one
stood, and the text's end is matched with the new spans read as the old ones, so the match runs on
through each renamed occurrence instead of starting over after it. A substitution the verifier refuses more often than it takes is
forgotten. Like every draft, these only change how many tokens a pass accepts, never which.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

# The acceptance before any measurement, as (hits, tries), per class of match length (1, 2-3, 4-7,
# 8-15, 16-31, 32-63, 64+ tokens): guesses the first verify passes correct
PRIOR = ((0.6, 2.0), (1.0, 2.0), (1.4, 2.0), (1.7, 2.0), (1.84, 2.0), (1.92, 2.0), (1.94, 2.0))
CLASSES = len(PRIOR)
# The longest match counted at the root (deeper tokens count on from it)
MAX_MATCH = 64
# The weight of the past in a running acceptance (per branch token that reached it): about the last 50
DECAY = 0.98
# The most earlier occurrences of an n-gram looked at, the latest first
SCAN = 16
# Substitutions (edits that rename): the longest old and new spans, the tokens that must be equal
# before and after them, and how many are kept (the latest)
MAX_SUB_OLD = 8
MAX_SUB_NEW = 16
SUB_CONTEXT = 3
MAX_SUBS = 8


def match_class(length: int) -> int:
    """The class of a match of ``length`` >= 1 tokens: 0 for 1, 1 for 2-3, 2 for 4-7, ..."""
    return min(max(length, 1).bit_length() - 1, CLASSES - 1)


@dataclass
class Branch:
    tokens: list[int]   # the continuation proposed after the root (and after ``after``)
    match: int          # the length of the match it follows (the more tokens matched, the likelier)
    logps: list[float]  # the path log-probability of each token (from where it hangs)
    after: tuple[int, ...] = ()  # the drafted tokens it hangs under (none: under the root)
    # the spans of ``tokens`` written by a substitution: (first, end, its old span)
    subs: tuple[tuple[int, int, tuple[int, ...]], ...] = ()


class TextLookup:
    """An n-gram index over the text in the verifier's cache, kept in step by the engine
    (:meth:`extend` as tokens enter it, :meth:`truncate` as they leave), and the acceptance of its
    branches (:meth:`record`)."""

    def __init__(self, max_ngram: int = 4, max_branches: int = 3, min_p: float = 0.3):
        if max_ngram < 1 or max_branches < 1 or not 0.0 < min_p <= 1.0:
            raise ValueError("max_ngram and max_branches must be >= 1 and min_p in (0, 1]")
        self.max_ngram = max_ngram
        self.max_branches = max_branches
        self.min_p = min_p
        self.tokens: list[int] = []
        # _index[n]: n-gram -> the positions that followed its occurrences, in increasing order
        self._index: list[dict[tuple[int, ...], list[int]]] = [{} for _ in range(max_ngram + 1)]
        # (hits, tries) per match class
        self._acc = [list(c) for c in PRIOR]
        # substitutions learnt from the text: old span -> [new span, taken, refused], oldest first
        self.subs: dict[tuple[int, ...], list] = {}
        self._refused: set[tuple[tuple[int, ...], tuple[int, ...]]] = set()  # forgotten: not learnt again

    # -- the text ----------------------------------------------------------------------------------
    def reset(self) -> None:
        self.tokens = []
        self._index = [{} for _ in range(self.max_ngram + 1)]
        self.subs = {}
        self._refused = set()

    def extend(self, tokens: Sequence[int]) -> None:
        for t in tokens:
            self.tokens.append(int(t))
            end = len(self.tokens)
            for n in range(1, min(self.max_ngram, end) + 1):
                self._index[n].setdefault(tuple(self.tokens[end - n:end]), []).append(end)

    def truncate(self, n: int) -> None:
        """Forget the text from position ``n`` on (latest first: each n-gram's positions list ends
        with the latest occurrence, so its removal is a pop)."""
        while len(self.tokens) > max(n, 0):
            end = len(self.tokens)
            for k in range(1, min(self.max_ngram, end) + 1):
                key = tuple(self.tokens[end - k:end])
                pos = self._index[k][key]
                pos.pop()
                if not pos:
                    del self._index[k][key]
            self.tokens.pop()

    # -- acceptance --------------------------------------------------------------------------------
    def p(self, match: int) -> float:
        """The measured chance that the verifier takes a branch token that continues a match of
        ``match`` tokens, once it took the ones before it in the branch: the running shares per
        class made non-decreasing in the match's length (pooled where a longer class measured less
        than a shorter one, each weighted by its tries), as a longer match goes on at least as
        often. So one cycle's refusals in a class that is rarely tried (several branches of one
        tree refused at an edit) cannot hold its share under the shorter classes' for good."""
        return self.shares()[match_class(match)]

    def shares(self) -> list[float]:
        """The acceptance per match class, non-decreasing (pool-adjacent-violators over the
        running (hits, tries))."""
        blocks: list[list[float]] = []  # [hits, tries, classes]
        for h, t in self._acc:
            blocks.append([h, t, 1])
            while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
                h2, t2, n2 = blocks.pop()
                blocks[-1][0] += h2
                blocks[-1][1] += t2
                blocks[-1][2] += n2
        out: list[float] = []
        for h, t, n in blocks:
            out += [h / t] * int(n)
        return out

    def record(self, branch: Branch, emitted: Sequence[int]) -> None:
        """Fold one verified branch into the acceptance: for each token the verifier reached (those
        it had in common with what it emitted, and the one after, if the branch had it), whether it
        took it, in the class of the match that token continues."""
        k = len(branch.after)
        if tuple(emitted[:k]) != branch.after or len(emitted) <= k:
            return  # the verifier did not reach it
        emitted = emitted[k:]
        m = 0
        for a, b in zip(branch.tokens, emitted):
            if a != b:
                break
            m += 1
        reached = min(m + 1, len(branch.tokens))
        for d in range(1, reached + 1):
            cell = self._acc[match_class(branch.match + d - 1)]
            cell[0] = DECAY * cell[0] + (1.0 if d <= m else 0.0)
            cell[1] = DECAY * cell[1] + 1.0
        for first, end, old in branch.subs:
            sub = self.subs.get(old)
            if sub is None or first >= reached:
                continue  # forgotten since, or not reached
            if m >= min(end, len(branch.tokens)):
                sub[1] += 1
            else:
                sub[2] += 1
                if sub[2] > sub[1]:
                    del self.subs[old]
                    self._refused.add((old, tuple(sub[0])))

    # -- branches ----------------------------------------------------------------------------------
    def branches(self, last: int, max_len: int, after: Sequence[int] = ()) -> list[Branch]:
        """The continuations of the text after its cached tokens, ``last`` (the tree's root, not in
        the cache yet) and the drafted tokens ``after`` it (a path of the drafter's tree, for branches
        hung under its end): of the latest ``SCAN`` occurrences of each of its last 1 to ``max_ngram``
        tokens, longest match first (counted in full, up to ``MAX_MATCH``), then latest; at most
        ``max_branches`` with distinct first tokens, each cut where its path probability falls under
        ``min_p`` or at ``max_len``."""
        if max_len <= 0:
            return []
        hist = self.tokens
        full = hist + [int(last)] + [int(t) for t in after]
        if not after:
            self._learn(full)
        starts: dict[int, int] = {}  # continuation start -> match length
        self._match(full, starts)
        view = self._as_before(full)
        if view is not None:  # the end read with the new spans as the old ones
            self._match(view, starts)
        out: list[Branch] = []
        firsts: set[int] = set()
        for start, m in sorted(starts.items(), key=lambda kv: (-kv[1], -kv[0])):
            logps = self._path_logps(m, max_len)
            # the continuation: cached text from `start` on (the new span for each old one), and the
            # root itself where it reaches it
            cont, subs = self._continuation(full, start, len(logps))
            if not cont or cont[0] in firsts:
                continue
            firsts.add(cont[0])
            out.append(Branch(cont, m, logps[:len(cont)], tuple(int(t) for t in after), subs))
            if len(out) >= self.max_branches:
                break
        return out

    def _match(self, end: list[int], starts: dict[int, int]) -> None:
        """Into ``starts``: the earlier occurrences of the last 1 to ``max_ngram`` tokens of ``end``
        (the latest ``SCAN`` of each), each with its match counted in full (up to ``MAX_MATCH``)."""
        hist = self.tokens
        for n in range(min(self.max_ngram, len(end)), 0, -1):
            for start in reversed(self._index[n].get(tuple(end[len(end) - n:]), ())[-SCAN:]):
                # count the match in full: back from the n-gram, while the tokens before the earlier
                # occurrence equal those before the text's end
                m = n
                while m < MAX_MATCH and start - m - 1 >= 0 and hist[start - m - 1] == end[len(end) - m - 1]:
                    m += 1
                if m > starts.get(start, 0):
                    starts[start] = m

    def _continuation(self, full: list[int], start: int, n: int) -> tuple[list[int], tuple]:
        """Up to ``n`` tokens of ``full`` from ``start`` on, each old span of a substitution written
        as its new one; and the spans so written."""
        pairs = [(old, tuple(v[0])) for old, v in self.subs.items()]
        out, spans = _rewrite(full, start, pairs, n)
        return out[:n], tuple(spans)

    def _as_before(self, full: list[int]) -> list[int] | None:
        """The text's end (its last ``MAX_MATCH`` + a few tokens) with each new span of a
        substitution read as its old one (the longest first); None where there is none."""
        if not self.subs:
            return None
        tail = full[-(MAX_MATCH + 2 * MAX_SUB_NEW):]
        pairs = sorted(((tuple(v[0]), old) for old, v in self.subs.items()), key=lambda x: -len(x[0]))
        out, spans = _rewrite(tail, 0, pairs, len(tail) * MAX_SUB_OLD)
        return out if spans else None

    def _learn(self, full: list[int]) -> None:
        """Learn a substitution where the text's end is in step with an earlier passage after a
        short change: its last ``2 * SUB_CONTEXT`` or more tokens equal a passage's, the tokens
        before differ, and before those (after at most ``MAX_SUB_NEW`` tokens of the text and
        ``MAX_SUB_OLD`` of the passage) ``SUB_CONTEXT`` + 1 tokens are equal again; the changed
        spans, both non-empty, are the new and the old (the shortest such pair)."""
        hist, c = self.tokens, SUB_CONTEXT
        if len(full) < 3 * c + 2 or c > self.max_ngram:
            return
        # the passage the text's end is in step with: the longest match (the latest of equals)
        start, m = -1, 0
        for s in reversed(self._index[c].get(tuple(full[-c:]), ())[-SCAN:]):
            k = c
            while k < MAX_MATCH and s - k - 1 >= 0 and hist[s - k - 1] == full[len(full) - k - 1]:
                k += 1
            if k > m:
                start, m = s, k
        if m < 2 * c or m >= MAX_MATCH or start - m - 1 < 0:
            return  # too short to be a passage, or no change within reach
        a, b = len(full) - m, start - m  # the changed spans end before a (text) and b (passage)
        best = None
        for ln in range(1, MAX_SUB_NEW + 1):
            for lo in range(1, MAX_SUB_OLD + 1):
                if a - ln - c - 1 < 0 or b - lo - c - 1 < 0 or (best is not None and ln + lo >= sum(best)):
                    continue
                if full[a - ln - c - 1:a - ln] == hist[b - lo - c - 1:b - lo]:
                    best = (ln, lo)
        if best is None:
            return
        ln, lo = best
        old, new = tuple(hist[b - lo:b]), tuple(full[a - ln:a])
        if old == new or old in self.subs or (old, new) in self._refused:
            return
        if len(self.subs) >= MAX_SUBS:
            del self.subs[next(iter(self.subs))]
        self.subs[old] = [new, 0, 0]

    def _path_logps(self, match: int, max_len: int) -> list[float]:
        """The path log-probabilities of a branch's tokens after a match of ``match`` tokens, as
        long as they stay at least ``log(min_p)`` (at most ``max_len``)."""
        floor = math.log(self.min_p)
        out: list[float] = []
        lp = 0.0
        shares = self.shares()
        for d in range(1, max_len + 1):
            p = shares[match_class(match + d - 1)]
            lp += math.log(max(p, 1e-12))
            if lp < floor:
                break
            out.append(lp)
        return out


def _rewrite(seq: Sequence[int], start: int, pairs: Sequence[tuple[tuple[int, ...], tuple[int, ...]]],
             limit: int) -> tuple[list[int], list[tuple[int, int, tuple[int, ...]]]]:
    """``seq`` from ``start`` on with each span ``a`` of ``pairs`` (the first that fits, left to
    right) written as its ``b``, until ``limit`` tokens are out; and where each was written, as
    (first, end, ``a``)."""
    out: list[int] = []
    spans: list[tuple[int, int, tuple[int, ...]]] = []
    i = start
    while len(out) < limit and i < len(seq):
        for a, b in pairs:
            if seq[i] == a[0] and tuple(seq[i:i + len(a)]) == a:
                spans.append((len(out), len(out) + len(b), a))
                out.extend(b)
                i += len(a)
                break
        else:
            out.append(seq[i])
            i += 1
    return out, spans
