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
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

# The acceptance before any measurement, as (hits, tries), per class of match length (1, 2-3, 4-7,
# 8-15, 16-31, 32-63, 64+ tokens): guesses the first verify passes correct
PRIOR = ((0.6, 2.0), (1.0, 2.0), (1.4, 2.0), (1.6, 2.0), (1.7, 2.0), (1.8, 2.0), (1.8, 2.0))
CLASSES = len(PRIOR)
# The longest match counted at the root (deeper tokens count on from it)
MAX_MATCH = 64
# The weight of the past in a running acceptance (per branch token that reached it): about the last 50
DECAY = 0.98
# The most earlier occurrences of an n-gram looked at, the latest first
SCAN = 16


def match_class(length: int) -> int:
    """The class of a match of ``length`` >= 1 tokens: 0 for 1, 1 for 2-3, 2 for 4-7, ..."""
    return min(max(length, 1).bit_length() - 1, CLASSES - 1)


@dataclass
class Branch:
    tokens: list[int]   # the continuation proposed after the root (and after ``after``)
    match: int          # the length of the match it follows (the more tokens matched, the likelier)
    logps: list[float]  # the path log-probability of each token (from where it hangs)
    after: tuple[int, ...] = ()  # the drafted tokens it hangs under (none: under the root)


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

    # -- the text ----------------------------------------------------------------------------------
    def reset(self) -> None:
        self.tokens = []
        self._index = [{} for _ in range(self.max_ngram + 1)]

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
        ``match`` tokens, once it took the ones before it in the branch."""
        h, t = self._acc[match_class(match)]
        return h / t

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
        starts: dict[int, int] = {}  # continuation start -> match length
        for n in range(min(self.max_ngram, len(full)), 0, -1):
            for start in reversed(self._index[n].get(tuple(full[len(full) - n:]), ())[-SCAN:]):
                if start in starts:
                    continue
                # count the match in full: back from the n-gram, while the tokens before the earlier
                # occurrence equal those before the text's end
                m = n
                while m < MAX_MATCH and start - m - 1 >= 0 and hist[start - m - 1] == full[len(full) - m - 1]:
                    m += 1
                starts[start] = m
        out: list[Branch] = []
        firsts: set[int] = set()
        for start, m in sorted(starts.items(), key=lambda kv: (-kv[1], -kv[0])):
            logps = self._path_logps(m, max_len)
            # the continuation: cached text from `start` on, and the root itself where it reaches it
            cont = full[start:start + len(logps)]
            if not cont or cont[0] in firsts:
                continue
            firsts.add(cont[0])
            out.append(Branch(cont, m, logps[:len(cont)], tuple(int(t) for t in after)))
            if len(out) >= self.max_branches:
                break
        return out

    def _path_logps(self, match: int, max_len: int) -> list[float]:
        """The path log-probabilities of a branch's tokens after a match of ``match`` tokens, as
        long as they stay at least ``log(min_p)`` (at most ``max_len``)."""
        floor = math.log(self.min_p)
        out: list[float] = []
        lp = 0.0
        for d in range(1, max_len + 1):
            p = self.p(match + d - 1)
            lp += math.log(max(p, 1e-12))
            if lp < floor:
                break
            out.append(lp)
        return out
