"""Draft trees and the acceptance rule: pure Python, testable without a model.

A draft tree hangs under a *root*: the last emitted token, not yet in the KV cache. Each node is a
drafted token with its parent, depth (root = 0) and cumulative log-value: the log of the chance the
verifier reaches and takes it, as estimated (by the drafter's own probabilities, or by the
acceptance the engine measured for such candidates: :mod:`.calibration`, :mod:`.lookup`). The engine
grows it best-first with the drafter (:class:`TreeBuilder`), prunes it to the verification budget
(:meth:`DraftTree.best`), lays it out for one batched verifier pass (:meth:`DraftTree.layout`), and
walks it with the verifier's distributions (:func:`accept`).

Acceptance, for any tree and any sampling settings: at the current node draw the verifier's token
``t`` from its processed distribution (the argmax when greedy); if a child carries ``t`` descend to
it, otherwise emit ``t`` and stop. Every emitted token is therefore a draw from the verifier's own
distribution given the path before it: the output has exactly the verifier's distribution, and one
random number is used per emitted token, as plain decoding uses it. (Deterministic drafts make
this the optimal lossless rule: it accepts a child with the verifier's probability of that child.)
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field
from typing import Callable, Sequence

ROOT = -1
# where a node came from (bits of Node.source): the drafter, the text itself (a continuation of an
# earlier occurrence of the last tokens: speculative/lookup.py), or both
DRAFTER = 1
TEXT = 2


@dataclass
class Node:
    token: int
    parent: int          # index of the parent node, ROOT for children of the root
    depth: int           # 1 for children of the root
    logp: float          # cumulative log-value from the root (non-increasing from parent to child)
    children: list[int] = field(default_factory=list)
    source: int = DRAFTER  # DRAFTER, TEXT or both (bits)
    q: float = 0.0         # the drafter's probability of the token given the parent (0: not its candidate)


class DraftTree:
    """Nodes in insertion order; a parent is always inserted before its children."""

    def __init__(self, root_token: int):
        self.root_token = root_token
        self.nodes: list[Node] = []
        self.root_children: list[int] = []
        # the drafter's ranked candidates at nodes it expanded (ROOT included): for acceptance profiles
        self.cands: dict[int, list[int]] = {}
        # and the log-probability of its best candidate there (how sure the drafter was)
        self.top_lp: dict[int, float] = {}

    def __len__(self) -> int:
        return len(self.nodes)

    def add(self, token: int, parent: int, logp: float, source: int = DRAFTER, q: float = 0.0) -> int:
        if parent != ROOT and not 0 <= parent < len(self.nodes):
            raise IndexError(f"parent {parent} not in the tree")
        depth = 1 if parent == ROOT else self.nodes[parent].depth + 1
        siblings = self.root_children if parent == ROOT else self.nodes[parent].children
        if any(self.nodes[s].token == token for s in siblings):
            raise ValueError(f"token {token} is already a child of node {parent}")
        self.nodes.append(Node(token, parent, depth, logp, source=source, q=q))
        i = len(self.nodes) - 1
        siblings.append(i)
        return i

    def children(self, i: int) -> list[int]:
        return self.root_children if i == ROOT else self.nodes[i].children

    def child_with(self, i: int, token: int) -> int | None:
        """The child of node ``i`` (ROOT included) that carries ``token``, if any."""
        return next((c for c in self.children(i) if self.nodes[c].token == token), None)

    def _carry_drafter_info(self, out: "DraftTree", remap: dict[int, int]) -> None:
        """Give ``out`` (a copy of this tree renumbered by ``remap``) the drafter's candidates and
        best-candidate log-probabilities of the nodes it kept."""
        out.cands = {remap[k]: v for k, v in self.cands.items() if k in remap}
        out.top_lp = {remap[k]: v for k, v in self.top_lp.items() if k in remap}

    def path(self, i: int) -> list[int]:
        """Node indices from the root's child down to i."""
        out = []
        while i != ROOT:
            out.append(i)
            i = self.nodes[i].parent
        return out[::-1]

    def depth(self) -> int:
        return max((n.depth for n in self.nodes), default=0)

    def best(self, k: int) -> "DraftTree":
        """The sub-tree of the k nodes with the highest cumulative log-probability.

        Cumulative log-probabilities never increase from parent to child, so taking nodes in that
        order (ties: shallower, then earlier first) keeps every chosen node's ancestors chosen.
        """
        order = sorted(range(len(self.nodes)), key=lambda i: (-self.nodes[i].logp, self.nodes[i].depth, i))
        keep = sorted(order[:max(0, k)])
        remap = {ROOT: ROOT}
        out = DraftTree(self.root_token)
        for i in keep:  # insertion order: parents first
            n = self.nodes[i]
            if n.parent not in remap:
                continue  # cannot happen with non-increasing logp; defensive for hand-made trees
            remap[i] = out.add(n.token, remap[n.parent], n.logp, n.source, n.q)
        self._carry_drafter_info(out, remap)
        return out

    def graft(self, tokens: Sequence[int], logps: Sequence[float], source: int, max_new: int,
              under: int = ROOT) -> int:
        """Hang the chain ``tokens`` under node ``under`` (the root by default), token ``i`` with
        cumulative log-probability ``logps[i]`` (non-increasing, at most ``under``'s): where a node
        already carries the chain's token it is shared (its log-probability the larger of the two,
        ``source`` added to its sources), otherwise a node is added, at most ``max_new`` of them (the
        chain ends there). Returns the nodes added. Log-probabilities stay non-increasing from parent
        to child, as :meth:`best` needs."""
        cur, added = under, 0
        for tok, lp in zip(tokens, logps):
            nxt = self.child_with(cur, int(tok))
            if nxt is None:
                if added >= max_new:
                    break
                nxt = self.add(int(tok), cur, float(lp), source)
                added += 1
            else:
                node = self.nodes[nxt]
                node.logp = max(node.logp, float(lp))
                node.source |= source
            cur = nxt
        return added

    def top_chain(self) -> list[tuple[int, float]]:
        """The chain a drafter of width 1 would have drafted under this tree's root: from the root, the
        best candidate of each expanded node in turn, as (its node index, -1 where the tree did not
        keep it; the drafter's probability of it given its parent). Ends at the first node not
        expanded or not kept."""
        out: list[tuple[int, float]] = []
        cur = ROOT
        while self.cands.get(cur) and cur in self.top_lp:
            tok = self.cands[cur][0]
            nxt = self.child_with(cur, tok)
            out.append((-1 if nxt is None else nxt, math.exp(self.top_lp[cur])))
            if nxt is None:
                break
            cur = nxt
        return out

    def leaves(self) -> list[int]:
        return [i for i, n in enumerate(self.nodes) if not n.children]

    def dfs(self) -> "DraftTree":
        """The same tree with nodes in depth-first order, most probable child first: the chain the
        drafter believes in most comes first, so an accepted main chain is a prefix of the batch."""
        out = DraftTree(self.root_token)
        remap = {ROOT: ROOT}

        def visit(i: int, parent: int) -> None:
            n = self.nodes[i]
            j = remap[i] = out.add(n.token, parent, n.logp, n.source, n.q)
            for c in sorted(n.children, key=lambda c: (-self.nodes[c].logp, c)):
                visit(c, j)

        for c in sorted(self.root_children, key=lambda c: (-self.nodes[c].logp, c)):
            visit(c, ROOT)
        self._carry_drafter_info(out, remap)
        return out

    def layout(self) -> tuple[list[int], list[int], list[list[int]]]:
        """One verifier batch for the root and every node: (tokens, depths, rows_seen_by).

        Row 0 is the root (depth 0), row 1 + i is node i. ``rows_seen_by[r]`` lists the rows whose
        queries may attend to row r: r itself and every row below it. The engine turns each row
        into its own sequence id, so attention inside the batch follows the tree and each row's
        KV entry can be kept, parked or freed on its own after acceptance.
        """
        n = len(self.nodes)
        seen: list[set[int]] = [{r} for r in range(n + 1)]
        for i in range(n - 1, -1, -1):  # children come after parents: fold subtrees upwards
            p = self.nodes[i].parent
            seen[0 if p == ROOT else 1 + p] |= seen[1 + i]
        tokens = [self.root_token] + [nd.token for nd in self.nodes]
        depths = [0] + [nd.depth for nd in self.nodes]
        return tokens, depths, [sorted(x) for x in seen]

    def validate(self) -> None:
        for i, n in enumerate(self.nodes):
            if n.parent != ROOT:
                p = self.nodes[n.parent]
                assert n.parent < i and n.depth == p.depth + 1 and i in p.children
            else:
                assert n.depth == 1 and i in self.root_children


def accept(tree: DraftTree, draw: Callable[[int], int]) -> tuple[list[int], int, list[int]]:
    """Walk ``tree`` with the verifier: ``draw(row)`` returns the verifier's token at batch row
    ``row`` (0 = root, 1 + i = node i), drawn from its processed distribution.

    Returns (accepted node indices, bonus token, emitted tokens); emitted = the accepted nodes'
    tokens followed by the bonus token, so at least one token is emitted and at most depth + 1.
    """
    accepted: list[int] = []
    cur = ROOT
    while True:
        t = draw(0 if cur == ROOT else 1 + cur)
        nxt = tree.child_with(cur, t)
        if nxt is None:
            return accepted, t, [tree.nodes[i].token for i in accepted] + [t]
        accepted.append(nxt)
        cur = nxt


@dataclass
class _Cand:
    neg_logp: float
    seq: int
    token: int
    parent: int
    q: float

    def __lt__(self, other: "_Cand") -> bool:
        return (self.neg_logp, self.seq) < (other.neg_logp, other.seq)


class TreeBuilder:
    """Grows a draft tree best-first, one drafter batch per round.

    ``offer(node, tokens, logps)`` registers a decoded node's best children (log-probabilities of
    the drafter's processed distribution); ``next_round()`` moves the ``width`` best candidates of
    the whole pool into the tree and returns them (they are the next drafter batch). With
    ``calibrate`` (a drafter log-probability -> the log of the measured chance the verifier takes
    such a candidate: :class:`~bitsplit_llama.speculative.calibration.DraftCalibration`), a node's
    value is the sum of the calibrated terms along its path instead of the drafter's own; each node
    keeps the drafter's probability in ``q`` either way.
    """

    def __init__(self, root_token: int, width: int, max_nodes: int,
                 calibrate: Callable[[float], float] | None = None):
        if width < 1 or max_nodes < 0:
            raise ValueError("width must be >= 1 and max_nodes >= 0")
        self.tree = DraftTree(root_token)
        self.width = width
        self.max_nodes = max_nodes
        self._pool: list[_Cand] = []
        self._seq = 0
        self.calibrate = calibrate

    def offer(self, node: int, tokens: Sequence[int], logps: Sequence[float]) -> None:
        base = 0.0 if node == ROOT else self.tree.nodes[node].logp
        self.tree.cands[node] = [int(t) for t in tokens]
        if len(logps):
            self.tree.top_lp[node] = float(logps[0])
        for t, lp in zip(tokens, logps):
            self._seq += 1
            v = float(lp) if self.calibrate is None else self.calibrate(float(lp))
            heapq.heappush(self._pool, _Cand(-(base + v), self._seq, int(t), node, math.exp(float(lp))))

    def settled(self, k: int, frontier: Sequence[int], own: int | None = None, floor: float = -math.inf) -> bool:
        """Whether no node drafted from here on can be among the ``k`` best: the tree holds ``k``
        nodes already and neither the pool's best candidate nor a child of an undecoded ``frontier``
        node (its value is at most its parent's) is worth more than the ``k``-th best node. With
        ``own`` < ``k``, the nodes past the ``own`` best must also be worth ``floor`` (:meth:`bar`)."""
        if own is None and (len(self.tree) < k or k <= 0):
            return len(self.tree) >= k
        values = [self.tree.nodes[i].logp for i in frontier]
        if self._pool:
            values.append(-self._pool[0].neg_logp)
        return max(values, default=-math.inf) <= self.bar(k, own, floor)

    def bar(self, k: int, own: int | None = None, floor: float = -math.inf) -> float:
        """The value (log) a new node must beat to be kept: the ``k``-th best node's; with ``own`` <
        ``k`` (``k`` - ``own`` nodes priced), the ``own``-th best's or, past it, the larger of the
        ``k``-th best's and ``floor``: -inf while the tree has fewer than ``own``."""
        if own is None or own >= k:
            return self._kth(k)
        return min(self._kth(own), max(self._kth(k), floor))

    def _kth(self, k: int) -> float:
        """The ``k``-th best node's value (log), -inf while the tree has fewer than ``k`` nodes."""
        if k <= 0 or len(self.tree) < k:
            return -math.inf
        return heapq.nlargest(k, (n.logp for n in self.tree.nodes))[-1]

    def round_gain(self, k: int, frontier: Sequence[int], own: int | None = None, floor: float = -math.inf) -> float:
        """At most what decoding ``frontier`` (the nodes the last round added) can add to the
        expected accepted tokens of the ``k`` best nodes: its children are worth at most their parent
        together, and each one that enters the best ``k`` pushes out a node worth at least the
        ``k``-th best. So: the sum over the frontier of what its value exceeds the ``k``-th best by
        (the whole value while the tree has fewer than ``k`` nodes); with ``own``, by :meth:`bar`."""
        kth = math.exp(self.bar(k, own, floor))
        return sum(max(0.0, math.exp(self.tree.nodes[i].logp) - kth) for i in frontier)

    def drain(self, k: int, own: int | None = None, floor: float = -math.inf) -> int:
        """After the last round: move the pool's candidates into the tree while one is worth more
        than the ``k``-th best node, or the tree has fewer than ``k`` (a candidate already known needs
        no drafter pass); with ``own``, while one beats :meth:`bar`. Returns how many were moved."""
        moved = 0
        while self._pool and ((len(self.tree) < k and own is None) or
                              -self._pool[0].neg_logp > self.bar(k, own, floor)):
            c = heapq.heappop(self._pool)
            self.tree.add(c.token, c.parent, -c.neg_logp, DRAFTER, c.q)
            moved += 1
        return moved

    def next_round(self) -> list[int]:
        added: list[int] = []
        while self._pool and len(added) < self.width and len(self.tree) < self.max_nodes:
            c = heapq.heappop(self._pool)
            added.append(self.tree.add(c.token, c.parent, -c.neg_logp, DRAFTER, c.q))
        return added
