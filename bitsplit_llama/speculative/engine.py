"""The draft/verify loop: the base drafts a tree, base + residual verifies it in one batch.

Vocabulary follows llama.cpp's speculative code: ``n_past`` tokens are in the KV cache (all of them
written by the verifier), ``id_last`` is the last emitted token (not yet in the cache; the root of
the next tree). One cycle:

1. draft: the :class:`Drafter` decodes ``id_last`` and then, round by round, the best candidates of
   a best-first tree (:class:`~bitsplit_llama.speculative.tree.TreeBuilder`), each node in its own
   lane (sequence id) so that attention follows the tree; its nodes are valued by the measured chance
   that the verifier takes such a candidate (:mod:`.calibration`), rounds go on until no new node
   can be among the best, and text branches (:mod:`.lookup`) share the budget on the same scale.
   The default, :class:`SharedKVDrafter`, is
   the verifier's own context with the residual off: it reads the verifier's cache for the prefix,
   nothing is copied. :class:`SeparateKVDrafter` keeps a cache of its own (stock llama.cpp's
   arrangement, for measurements).
2. roll back: every drafted KV entry is removed (``seq_rm`` from ``n_past``), so the verifier never
   attends to the drafter's KV for positions it computes itself.
3. verify: the best ``tree_nodes`` nodes plus the root go through the verifier in one decode.
4. accept (:func:`~bitsplit_llama.speculative.tree.accept`): walk the tree with the verifier's draws; the
   accepted path's KV (written by the verifier) is kept in sequence 0, the rest removed.

Contract: each cycle emits at least one token, every one a draw from the verifier's distribution.
"""

from __future__ import annotations

import collections
import contextlib
import math
import os
import time
from dataclasses import dataclass, field, replace
from typing import Callable, Iterator, Sequence

import numpy as np

from ..errors import ContextLimitError, InvalidOptionError
from ..runtime.llamacpp import Context
from .calibration import DraftCalibration
from .lookup import Branch, TextLookup
from .sampling import SamplingParams, draft_candidates, draw
from .tree import DRAFTER, ROOT, TEXT, DraftTree, TreeBuilder, accept

CANDIDATES_PER_NODE = 4
# llama.cpp's limit on sequence ids (LLAMA_MAX_SEQ): sequence 0, the junk and dummy sequences, and
# the lanes (one per leaf of a tree: see Engine._verify) share it
MAX_SEQ = 256
MAX_LANES = MAX_SEQ - 3
MAX_TREE_NODES = 256  # nodes verified in one pass (the root's row comes on top)
MAX_TREE_DEPTH = 32   # drafter rounds
# Text branches (lookup.py): the path probability a token needs before rows are priced, and the
# range the priced one is kept in; the verify passes the price of a row is fitted over
TEXT_MIN_P = 0.3
TEXT_MIN_P_RANGE = (0.05, 0.9)
ROW_COST_PASSES = 48
ROW_COST_MIN_PASSES = 8


def kernel_pinned_by_env() -> str | None:
    """The kernel family ``BITSPLIT_KERNEL`` pins for every pass of the verifier (the native library
    reads it), or None. While it is set nothing here chooses, times or restores a family."""
    return os.environ.get("BITSPLIT_KERNEL") or None


def _rounds_for(nodes: int, width: int) -> int:
    """Drafter rounds for a tree of ``nodes`` at ``width``: 1.5 candidates drafted per verified node,
    at most MAX_TREE_DEPTH."""
    return min(MAX_TREE_DEPTH, -(-3 * nodes // (2 * width)))


@dataclass
class TreeShape:
    """How the draft tree grows: ``nodes`` verified per cycle, ``width`` nodes added per drafter
    round, at most ``rounds`` drafter rounds (the depth) after decoding the root; and at most
    ``text`` nodes more from the text itself (prompt lookup, :mod:`.lookup`), verified in the same
    pass."""

    nodes: int = 16
    width: int = 4
    rounds: int = 6
    text: int = 0

    @classmethod
    def for_nodes(cls, nodes: int) -> "TreeShape":
        """A sensible shape for a node budget: a chain up to 4 nodes, then wider and deeper; from 25
        nodes on, a width of nodes / 16 (at least 4) and the rounds that draft 1.5 candidates per
        verified node (at most 32): a chain the verifier follows can grow that deep, and drafting
        ends sooner once no new node can be among the ``nodes`` best (``TreeBuilder.settled``).
        64 nodes: 24 rounds of 4; 256: 24 of 16."""
        if nodes < 0:
            raise InvalidOptionError(f"--tree-nodes: {nodes} is negative")
        if nodes > MAX_TREE_NODES:
            raise InvalidOptionError(f"--tree-nodes: {nodes} is more than {MAX_TREE_NODES}, the largest tree one "
                                     "verify pass takes")
        if nodes <= 4:
            return cls(nodes, 1, max(nodes, 1))
        if nodes <= 8:
            return cls(nodes, 2, min(8, nodes))
        if nodes <= 24:
            width = 4
            return cls(nodes, width, min(10, max(4, (nodes * 3) // (2 * width) + 1)))
        width = max(4, -(-nodes // 16))
        return cls(nodes, width, _rounds_for(nodes, width))

    def with_text(self, text: int) -> "TreeShape":
        """This shape with ``text`` nodes from the text beside it (the cells and lanes a cycle takes
        grow with it: :meth:`draft_rounds`)."""
        return replace(self, text=text)

    def draft_rounds(self, extra: int) -> int:
        """The drafter's rounds when it drafts ``extra`` nodes of the text's share beside its own
        (:meth:`Engine._draft`): a tree (``width`` > 1) gets the rounds of its whole budget, as
        :meth:`for_nodes` gives them at its width, so a chain the verifier follows grows as deep as
        that budget allows (a 32-node tree's 12 rounds reach half the depth of a 64-node tree's 24:
        code on a Zen 4, 10.8 tokens per verify at 32 + 32 text nodes against 16.0 at 64; 14.5 with
        these rounds); with no extra nodes (the text offers its whole share), and for a chain, the
        shape's own rounds."""
        if self.width <= 1 or extra <= 0:
            return self.rounds
        return max(self.rounds, _rounds_for(self.nodes + extra, self.width))

    def validate(self) -> None:
        if self.nodes < 0 or self.width < 1 or self.rounds < 1 or self.text < 0:
            raise InvalidOptionError(f"tree shape {self} is invalid (nodes >= 0, width >= 1, rounds >= 1, text >= 0)")
        if self.nodes + self.text > MAX_TREE_NODES or self.rounds > MAX_TREE_DEPTH:
            raise InvalidOptionError(f"tree shape {self} is too large (at most {MAX_TREE_NODES} nodes, the text's "
                                     f"included, and {MAX_TREE_DEPTH} rounds)")

    @property
    def speculates(self) -> bool:
        """Whether a cycle drafts anything: drafter nodes or text nodes."""
        return self.nodes > 0 or self.text > 0


@dataclass
class Stats:
    n_prompt: int = 0
    n_emitted: int = 0
    n_verify: int = 0            # verifier passes after the prompt (spec cycles or plain steps)
    n_draft_passes: int = 0
    n_drafted: int = 0           # tree nodes verified
    n_accepted: int = 0          # drafted nodes accepted
    n_text_drafted: int = 0      # of the nodes verified, those the text alone proposed (not the drafter)
    n_accepted_text: int = 0     # of the nodes accepted, those the text alone proposed
    n_accepted_both: int = 0     # ... those the drafter and the text both proposed
    prompt_seconds: float = 0.0
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    total_seconds: float = 0.0
    residual_seconds: float = 0.0
    residual_bytes: int = 0      # residual (and base) bytes read by the native products
    draft_decode_seconds: float = 0.0   # inside llama_decode while drafting (the rest is Python)
    n_early_stops: int = 0       # drafts ended before their budget: the next round was not worth its cost
    n_rebuilt: int = 0           # cached positions decoded again to free parked rows in order (see _flush_junk)
    verify_decode_seconds: float = 0.0  # inside llama_decode while verifying
    accept_hist: list[int] = field(default_factory=list)

    @property
    def tokens_per_verify(self) -> float:
        return self.n_emitted / self.n_verify if self.n_verify else 0.0

    @property
    def tokens_per_second(self) -> float:
        gen = self.total_seconds - self.prompt_seconds
        return self.n_emitted / gen if gen > 0 else 0.0

    def to_json(self) -> dict:
        return {
            "n_prompt": self.n_prompt, "n_tokens": self.n_emitted, "n_verify": self.n_verify,
            "accepted_per_verify": round(self.tokens_per_verify, 4),
            "tokens_per_second": round(self.tokens_per_second, 3), "n_draft_passes": self.n_draft_passes,
            "n_drafted": self.n_drafted, "n_accepted": self.n_accepted,
            "n_text_drafted": self.n_text_drafted, "n_accepted_text": self.n_accepted_text,
            "n_accepted_both": self.n_accepted_both,
            "prompt_seconds": round(self.prompt_seconds, 4), "draft_seconds": round(self.draft_seconds, 4),
            "verify_seconds": round(self.verify_seconds, 4), "residual_seconds": round(self.residual_seconds, 4),
            "residual_bytes": self.residual_bytes, "draft_decode_seconds": round(self.draft_decode_seconds, 4),
            "verify_decode_seconds": round(self.verify_decode_seconds, 4),
            "draft_early_stops": self.n_early_stops, "kv_rebuilt_tokens": self.n_rebuilt,
            "total_seconds": round(self.total_seconds, 4),
        }


class Drafter:
    """Who drafts, and in which KV cache. The engine asks it for a context to draft in
    (:meth:`drafting`), to decode the root of a tree (:meth:`decode_root`), and to keep its cache in
    step with the verifier's (:meth:`reset`, :meth:`truncate`)."""

    ctx: Context

    def drafting(self):
        """Context manager: decodes inside are drafter passes; yields the context to decode in."""
        raise NotImplementedError

    def decode_root(self, engine: "Engine", id_last: int) -> int:
        """Decode the tree's root ``id_last`` at position ``engine.n_past`` (inside :meth:`drafting`);
        returns the batch row that holds its logits."""
        raise NotImplementedError

    def n_cached(self, engine: "Engine") -> int:
        """Positions of sequence 0 in the drafter's cache (where its next pass starts)."""
        raise NotImplementedError

    def reset(self) -> None:
        """The verifier's cache was cleared."""

    def truncate(self, n: int) -> None:
        """The verifier forgot positions from ``n`` on."""


class SharedKVDrafter(Drafter):
    """The base alone in the verifier's own context: the residual off, the same KV cache (the
    prefix the verifier wrote is read, never copied)."""

    def __init__(self, sm):
        self.sm = sm
        self.ctx = sm.ctx

    def drafting(self):
        return self.sm.drafting()

    def decode_root(self, engine: "Engine", id_last: int) -> int:
        self.ctx.decode([id_last], [engine.n_past])
        return 0

    def n_cached(self, engine: "Engine") -> int:
        return engine.n_past


class SeparateKVDrafter(Drafter):
    """The base in a context of its own (over the same model), with its own KV cache, brought up to
    date with the tokens the verifier accepted at the start of each draft: the stock-llama.cpp-style
    baseline (measurements)."""

    def __init__(self, ctx: Context):
        self.ctx = ctx
        self.tokens: list[int] = []  # tokens in this context's KV, positions 0..len-1

    def drafting(self):
        return contextlib.nullcontext(self.ctx)

    def decode_root(self, engine: "Engine", id_last: int) -> int:
        pend = engine.tokens[len(self.tokens):] + [id_last]
        start = len(self.tokens)
        self.ctx.decode(pend, range(start, start + len(pend)), logits=[False] * (len(pend) - 1) + [True])
        self.tokens.extend(pend[:-1])
        return len(pend) - 1

    def n_cached(self, engine: "Engine") -> int:
        return len(self.tokens)

    def reset(self) -> None:
        self.ctx.clear()
        self.tokens = []

    def truncate(self, n: int) -> None:
        if n < len(self.tokens):
            self.ctx.seq_rm(0, n, -1)
            del self.tokens[n:]


class Engine:
    """Speculative decoding over a :class:`~bitsplit_llama.runtime.verifier.SplitModel`.

    ``drafter``: a :class:`Drafter`; by default :class:`SharedKVDrafter` (the verifier's own context
    and KV cache). ``draft_ctx``, a separate :class:`Context` over the same base, is short for
    ``drafter=SeparateKVDrafter(draft_ctx)``.
    """

    def __init__(self, sm, shape: TreeShape | None = None, draft_ctx: Context | None = None,
                 drafter: Drafter | None = None, draft_stop: str | float | None = None):
        self.sm = sm
        self.draft_stop = parse_draft_stop(draft_stop)
        # measured costs for draft_stop "auto" (exponential averages, None until a cycle measured
        # them): seconds per drafter round, seconds per emitted token
        self._round_s: float | None = None
        self._token_s: float | None = None
        # (rows, seconds) of the last verify passes: what one more row costs (text_min_p)
        self._pass_times: collections.deque[tuple[int, float]] = collections.deque(maxlen=ROW_COST_PASSES)
        self.ctx: Context = sm.ctx
        self.shape = shape or TreeShape.for_nodes(16)
        self.shape.validate()
        if drafter is None:
            drafter = SeparateKVDrafter(draft_ctx) if draft_ctx is not None else SharedKVDrafter(sm)
        self.drafter = drafter
        need = n_seq_max_for(self.shape)  # lanes, sequence 0, the junk and the dummy sequences
        for c in {id(self.ctx): self.ctx, id(drafter.ctx): drafter.ctx}.values():
            if self.shape.speculates and c.n_seq_max < need:
                raise InvalidOptionError(
                    f"the context was made with n_seq_max={c.n_seq_max}; a tree of {self.shape.nodes} nodes needs {need}")
        self.n_past = 0
        self.tokens: list[int] = []     # tokens in the verifier's KV, positions 0..n_past-1
        # the n-gram index of those tokens, for draft branches from the text (kept in step with them)
        self.lookup = TextLookup()
        # how often the verifier took the drafter's candidates, per drafter probability: the values
        # trees are grown and pruned by (kept across generations, as the text's acceptance is)
        self.calibration = DraftCalibration()
        # when a list, counts of the verifier's token rank among the drafter's candidates at each
        # verified node (index CANDIDATES_PER_NODE: not among them): the acceptance profile
        self.rank_counts: list[int] | None = None
        # with rank_counts, one entry per verify cycle: [accepted nodes of the drafter's own chain,
        # then its probabilities along that chain] (chain_record): what --draft-stop acts on, paths kept
        self.chain_paths: list[list[float]] = []
        self._junk_lane = self.ctx.n_seq_max - 1
        self._dummy_lane = self.ctx.n_seq_max - 2
        # lanes 1..lane_cap: drafting and verifying use at most that many (one per leaf)
        self.lane_cap = min(c.n_seq_max for c in (self.ctx, drafter.ctx)) - 3
        self.reset()  # the engine owns the KV state from here on
        self._n_junk = 0                # rejected rows parked in the junk sequence
        self._junk_min = 0              # the first parked position (when _n_junk > 0)

    def _flush_junk(self, stats: Stats | None = None) -> None:
        """Free the parked rows. Their cells, between the text's, would be refilled by later
        positions out of position order, and attention sums over cells in index order; so, in
        batch-invariant mode, the text from the first parked position on is taken out too and
        decoded again at once through the verifier (counted in ``stats``), whose results depend
        neither on the batch nor on masked cells: the cache it makes is the one it replaces, bit for
        bit, in order. Without batch invariance the rows are freed and nothing else."""
        if not self._n_junk:
            return
        p0 = self._junk_min
        self.ctx.seq_rm(self._junk_lane, -1, -1)
        self._n_junk = 0
        if p0 >= self.n_past or not self.sm.residual.batch_invariant:
            return
        tail = self.tokens[p0:self.n_past]
        self._truncate(p0)
        self._append(tail, last_logits=False)
        if stats is not None:
            stats.n_rebuilt += len(tail)

    def _append(self, tokens: list[int], *, last_logits: bool) -> np.ndarray | None:
        """Decode ``tokens`` into sequence 0 after the cached text, through the verifier, in
        batches of n_batch; the verifier's logits after the last one if ``last_logits``."""
        nb = self.ctx.n_batch
        with self.sm.verifying() as ctx:
            for i in range(0, len(tokens), nb):
                part = tokens[i:i + nb]
                last = last_logits and i + nb >= len(tokens)
                ctx.decode(part, range(self.n_past, self.n_past + len(part)),
                           logits=[False] * (len(part) - 1) + [last])
                self.n_past += len(part)
                self.tokens.extend(part)
                self.lookup.extend(part)
            return ctx.logits_ith(len(part) - 1).copy() if last_logits else None

    # -- KV state ---------------------------------------------------------------------------------
    def reset(self) -> None:
        self.ctx.clear()
        self._n_junk = 0
        self.n_past = 0
        self.tokens = []
        self.lookup.reset()
        self.drafter.reset()

    def _truncate(self, n: int) -> None:
        """Forget KV from position n on (the caller's tokens beyond n are no longer cached)."""
        if n < self.n_past:
            self.ctx.seq_rm(0, n, -1)
            self.n_past = n
            del self.tokens[n:]
            self.lookup.truncate(n)
        self.drafter.truncate(n)

    # -- prompt -----------------------------------------------------------------------------------
    def prefill(self, prompt: Sequence[int], stats: Stats) -> np.ndarray:
        """Put ``prompt`` into the verifier's KV (reusing a cached common prefix); returns the
        verifier's logits after its last token."""
        if not prompt:
            raise InvalidOptionError("the prompt is empty (no tokens)")
        n_ctx = self.ctx.n_ctx
        if len(prompt) >= n_ctx:
            raise ContextLimitError(f"the prompt has {len(prompt)} tokens but the context holds {n_ctx} "
                                    f"(--n-ctx {n_ctx}); shorten the prompt or raise --n-ctx")
        t0 = time.perf_counter()
        common = 0
        for a, b in zip(self.tokens, prompt):
            if a != b:
                break
            common += 1
        common = min(common, len(prompt) - 1)  # the last prompt token is always decoded: its logits are needed
        if self._n_junk and self.sm.residual.batch_invariant:
            common = min(common, self._junk_min)  # from there on the cells are not in order once the junk goes
        self._truncate(common)
        self._flush_junk()  # nothing cached after the parked rows: they are freed and nothing else
        # the prompt's rows are computed once (never verified again, never rebuilt by _flush_junk,
        # which starts past them): the kernel policy's family for a full batch, for every prompt
        # token however the prompt is cut, not the one pinned for the generation's few-row passes
        with self.sm.residual.prompt():
            logits = self._append(list(prompt[common:]), last_logits=True)
        stats.n_prompt = len(prompt)
        stats.prompt_seconds += time.perf_counter() - t0
        return logits

    # -- measurement (what the auto tree's cost and acceptance profile are made of) -------------------
    def time_pass(self, rows: int, *, verify: bool, reps: int = 3) -> float:
        """Median milliseconds of one pass of ``rows`` tokens after the cached prefix (all logits),
        through the verifier or through the drafter. The passes leave no KV behind."""
        if verify:
            role, start = self.sm.verifying, self.n_past
        else:
            role, start = self.drafter.drafting, self.drafter.n_cached(self)
        ts = []
        for _ in range(reps):
            with role() as ctx:
                ctx.seq_rm(0, start, -1)
                t0 = time.perf_counter()
                ctx.decode([100 + i for i in range(rows)], range(start, start + rows), logits=True)
                ts.append(time.perf_counter() - t0)
                ctx.seq_rm(0, start, -1)
        return 1000 * float(np.median(ts))

    @contextlib.contextmanager
    def decode_kernel(self, batch: int, name: str | None = None):
        """Context manager: the verifier's products use the kernel family ``name``, else the one the
        kernel policy gives a generation whose passes have ``batch`` rows; the family before is
        restored after. With ``BITSPLIT_KERNEL`` set (its family pinned for every pass) nothing
        changes: restoring by name would unpin it for batches past the decode limit."""
        res = self.sm.residual
        if kernel_pinned_by_env():
            yield res.kernel
            return
        saved = res.kernel
        res.choose_decode_kernel(batch, name, residual_alone=self.sm.residual_alone)
        try:
            yield res.kernel
        finally:
            res.set_kernel(saved)

    @contextlib.contextmanager
    def own_context(self, n_ctx: int, shape: TreeShape, n_batch: int = 64):
        """Context manager: an engine over the same split model (weights, residual, kernel settings)
        in a llama.cpp context of its own with ``n_ctx`` positions, for trees of ``shape``, freed
        on exit. Measurements made through it need nothing of this engine's context: not its size,
        not its cache (left as it is)."""
        n_seq = n_seq_max_for(shape)
        with self.sm.own_context(n_ctx=n_ctx, n_batch=max(n_batch, shape.nodes + shape.text + 1, n_seq), n_seq_max=n_seq,
                                 reserve=reserve_for(shape)) as view:
            yield Engine(view, shape)

    def rank_profile(self, prompts: Sequence[Sequence[int]], max_tokens: int, shape: TreeShape,
                     is_stop: Callable[[int], bool] | None = None) -> list[int]:
        """Greedy generations of ``prompts`` with trees of ``shape`` (an engine of its own over the same
        model and drafter, with the kernel family of that shape). Returns how often the verifier's
        token was the drafter's first, second, ... candidate at a verified node (last: none of them).
        Each cycle's :func:`chain_record` is left in ``self.chain_paths``. Clears this engine's cache."""
        self.reset()
        calib = Engine(self.sm, shape, drafter=self.drafter)
        calib.rank_counts = [0] * (CANDIDATES_PER_NODE + 1)
        with self.decode_kernel(shape.nodes + 1):
            try:
                for p in prompts:
                    for _ in calib.generate(p, max_tokens, SamplingParams(), is_stop=is_stop, stats=Stats()):
                        pass
            finally:
                calib.reset()
        self.chain_paths = calib.chain_paths
        return calib.rank_counts

    # -- drafting ---------------------------------------------------------------------------------
    def _draft(self, id_last: int, sp: SamplingParams, nodes: int, stats: Stats,
               depth: int | None = None) -> tuple[DraftTree, list[Branch]]:
        """A draft tree under ``id_last``: up to ``nodes`` nodes from the drafter, at most ``depth``
        deep (default: the shape's rounds; the draft KV is rolled back), and with a text budget (the
        shape's ``text`` > 0) the text's own continuations, with those branches (their acceptance is
        recorded after the verify pass). Text branches hang under the root and under each node of
        the drafter's most probable chain (where the drafter wrote what the text did not say, as a
        renamed variable, and the text goes on after it), the likeliest first. Both kinds share one
        budget of ``nodes`` + ``text`` nodes: every node is valued by the measured chance that the
        verifier reaches and takes it (the drafter's candidates through :attr:`calibration`, the
        text's through its match lengths), and the tree keeps the likeliest nodes of both. So a long
        match (an edited function written out again) may run as deep as the whole budget where the
        drafter's unsure siblings are worth less, and with nothing to copy the drafter's nodes stay.
        The text's share the text cannot use goes to the drafter: before drafting, the branches
        under the root are known, and the drafter may add up to the text's budget less their nodes
        to its own, priced as the text's are (a node beyond its own ``nodes`` needs the path
        probability a text node needs, :meth:`text_min_p`). So with nothing to copy, as in most
        English, a pass whose rows are cheap (a GPU's) verifies the drafter's tree of ``nodes`` +
        ``text``, and one whose rows cost (a CPU's) only its own nodes and the near-sure rest."""
        branches: list[Branch] = []
        total = nodes + self.shape.text
        limit = total if depth is None else min(total, depth)
        root_offers: list[Branch] = []
        if self.shape.text > 0:
            self.lookup.min_p = self.text_min_p()
            root_offers = self.lookup.branches(id_last, limit)
        spare = max(0, self.shape.text - sum(len(b.tokens) for b in root_offers))
        tree = (self._draft_model(id_last, sp, nodes, stats, depth, spare, self.lookup.min_p) if nodes > 0
                else DraftTree(id_last))
        if self.shape.text > 0:
            offers = [(ROOT, 0.0, b) for b in root_offers]
            path: list[int] = []
            for node in self._main_chain(tree):
                nd = tree.nodes[node]
                path.append(nd.token)
                if nd.depth < limit:
                    offers += [(node, nd.logp, b) for b in self.lookup.branches(id_last, limit - nd.depth, path)[:1]]
            budget = total
            for under, base, b in sorted(offers, key=lambda o: -(o[1] + o[2].logps[0])):
                if budget <= 0:
                    break
                budget -= tree.graft(b.tokens, [base + lp for lp in b.logps], TEXT, budget, under)
                branches.append(b)
            if len(tree) > total:
                tree = tree.best(total)
        return tree.dfs(), branches

    @staticmethod
    def _main_chain(tree: DraftTree) -> list[int]:
        """The drafter's most probable chain in ``tree``: from the root, the likeliest child each time."""
        out: list[int] = []
        kids = tree.root_children
        while kids:
            best = max(kids, key=lambda c: (tree.nodes[c].logp, -c))
            out.append(best)
            kids = tree.nodes[best].children
        return out

    def _draft_model(self, id_last: int, sp: SamplingParams, nodes: int, stats: Stats,
                     depth: int | None = None, extra: int = 0, min_p: float = 0.0) -> DraftTree:
        """The drafter's tree under ``id_last`` with up to ``nodes`` nodes, at most ``depth`` deep
        (default: the shape's rounds), and up to ``extra`` more whose path probability is at least
        ``min_p``; the draft KV is rolled back."""
        own, nodes = nodes, nodes + extra
        # the extra nodes are priced: past the ``own`` best, a node must be worth ``min_p`` (TreeBuilder.bar)
        priced = dict(own=own, floor=math.log(min_p) if min_p > 0 else -math.inf) if extra > 0 else {}
        shape = self.shape
        rounds = shape.draft_rounds(extra)
        rounds = rounds if depth is None else max(1, min(rounds, depth))
        # the builder may draft every round in full (rounds x width nodes, the cells a cycle reserves);
        # drafting stops once nothing more can be among the best ``nodes`` (TreeBuilder.settled), and
        # the best ``nodes`` by value are kept: where the verifier follows the drafter the tree is as
        # deep as its rounds, where it does not, as wide as its width
        builder = TreeBuilder(id_last, shape.width, max(max(nodes, 0), shape.width * rounds), self.calibration.logp)
        t0 = time.perf_counter()
        lane_of: dict[int, int] = {ROOT: 0}
        first_child_taken: set[int] = set()
        next_lane = 1
        with self.drafter.drafting() as ctx:
            # the root (plus, for a separate drafter, the accepted tokens it has not seen yet)
            td = time.perf_counter()
            row_of = {ROOT: self.drafter.decode_root(self, id_last)}
            stats.draft_decode_seconds += time.perf_counter() - td
            stats.n_draft_passes += 1
            frontier = [ROOT]
            for rnd in range(rounds):
                for node in frontier:
                    ids, lps = draft_candidates(ctx.logits_ith(row_of[node]), sp, CANDIDATES_PER_NODE)
                    builder.offer(node, ids, lps)
                added = builder.next_round()
                if not added or rnd == rounds - 1 or builder.settled(nodes, added, **priced):
                    break
                # early stop: decoding these nodes yields their children, which can add at most
                # what the nodes are worth beyond the nodes they would push out of the best ``nodes``
                # (TreeBuilder.round_gain) in expected accepted tokens; a round costs stop_mass
                # tokens' worth of time. They stay in the tree as leaves.
                stop_mass = self.stop_mass()
                if stop_mass > 0 and builder.round_gain(nodes, added, **priced) < stop_mass:
                    stats.n_early_stops += 1
                    break
                # lanes: a first child continues its parent's lane, others get a copy of it; past the
                # context's lanes, this round's nodes stay undecoded leaves (as the last round's)
                parents = {builder.tree.nodes[i].parent for i in added}
                new_lanes = len(added) - sum(1 for p in parents if p not in first_child_taken)
                if next_lane - 1 + new_lanes > self.lane_cap:
                    break
                for i in added:
                    p = builder.tree.nodes[i].parent
                    if p not in first_child_taken:
                        first_child_taken.add(p)
                        lane_of[i] = lane_of[p]
                    else:
                        lane_of[i] = next_lane
                        ctx.seq_cp(lane_of[p], next_lane, -1, self.n_past + builder.tree.nodes[i].depth)
                        next_lane += 1
                toks = [builder.tree.nodes[i].token for i in added]
                pos = [self.n_past + builder.tree.nodes[i].depth for i in added]
                td = time.perf_counter()
                ctx.decode(toks, pos, seq_ids=[[lane_of[i]] for i in added])
                stats.draft_decode_seconds += time.perf_counter() - td
                stats.n_draft_passes += 1
                row_of = {i: r for r, i in enumerate(added)}
                frontier = added
            # candidates known but not taken by the last round need no pass: in, where they are worth it
            builder.drain(nodes, **priced)
            # roll back every drafted entry: the verifier writes its own
            ctx.seq_rm(0, self.n_past, -1)
            for lane in range(1, next_lane):
                ctx.seq_rm(lane, -1, -1)
        stats.draft_seconds += time.perf_counter() - t0
        if extra > 0:  # the ``own`` best, then the extra nodes worth their rows
            lps = sorted((n.logp for n in builder.tree.nodes), reverse=True)
            nodes = own + sum(1 for lp in lps[own:nodes] if lp >= priced["floor"])
        return builder.tree.best(nodes)

    def stop_mass(self) -> float:
        """The path probability below which a drafter round is not worth its cost (0: never stop
        early): the fixed ``draft_stop``, or for "auto" the measured seconds per drafter round over
        the seconds per emitted token (a round's cost in tokens), once a cycle has measured them."""
        if self.draft_stop is None:
            return 0.0
        if self.draft_stop != "auto":
            return float(self.draft_stop)
        if self._round_s is None or not self._token_s:
            return 0.0
        return self._round_s / self._token_s

    def _measure_cycle(self, seconds: float, n_emitted: int, draft_s: float, n_passes: int) -> None:
        """Fold one speculative cycle's costs into the averages draft_stop "auto" and the text
        branches' row price read."""
        if n_emitted < 1:
            return
        a = 0.3
        tok = seconds / n_emitted
        self._token_s = tok if self._token_s is None else (1 - a) * self._token_s + a * tok
        if n_passes >= 1:
            rnd = draft_s / n_passes
            self._round_s = rnd if self._round_s is None else (1 - a) * self._round_s + a * rnd

    def row_seconds(self) -> float | None:
        """What one more row costs a verify pass here: the slope of the last passes' times over
        their rows (least squares), once they had different sizes; None before."""
        if len(self._pass_times) < ROW_COST_MIN_PASSES:
            return None
        rows = np.array([r for r, _ in self._pass_times], dtype=np.float64)
        secs = np.array([s for _, s in self._pass_times], dtype=np.float64)
        var = float(((rows - rows.mean()) ** 2).sum())
        if var < 1.0:
            return None
        return max(float(((rows - rows.mean()) * (secs - secs.mean())).sum()) / var, 0.0)

    def text_min_p(self) -> float:
        """The path probability a text branch's token needs to be verified: a row is worth adding
        when the tokens it is expected to give (its path probability) cost more than the row, i.e.
        from the measured seconds per row over the seconds per emitted token; TEXT_MIN_P until
        measured, within TEXT_MIN_P_RANGE (a GPU's rows are nearly free, a CPU's integer kernels
        pay for each)."""
        row = self.row_seconds()
        if row is None or not self._token_s:
            return TEXT_MIN_P
        lo, hi = TEXT_MIN_P_RANGE
        return min(max(row / self._token_s, lo), hi)

    # -- one cycle --------------------------------------------------------------------------------
    def _verify(self, tree: DraftTree, sp: SamplingParams, rng, stats: Stats) -> list[int]:
        t0 = time.perf_counter()
        while len(tree.leaves()) > self.lane_cap:  # (rare) more leaves than lanes: drop the least likely
            tree = tree.best(len(tree) - 1).dfs()
        tokens, depths, seen = tree.layout()
        rows = len(tokens)
        # One lane (sequence id) per leaf: a row's KV entry belongs to the lanes of the leaves below
        # it, and its query attends through the first of them, which holds exactly the row's
        # ancestors and itself at positions up to its own (the rows below it come later: causal mask).
        # So attention follows the tree with as many sequences as leaves (a 256-node tree fits
        # llama.cpp's 256), and each row's cell is the one cell of its first lane at its position.
        lane_of = {r: 1 + j for j, r in enumerate(r for r in range(rows) if len(seen[r]) == 1)}
        row_lanes = [[lane_of[q] for q in seen[r] if q in lane_of] for r in range(rows)]
        for lane in lane_of.values():  # every leaf's lane sees the prefix
            self.ctx.seq_cp(0, lane, -1, -1)
        c0 = self.sm.residual.counters()
        with self.sm.verifying() as ctx:
            td = time.perf_counter()
            ctx.decode(tokens, [self.n_past + d for d in depths], seq_ids=row_lanes)
            td = time.perf_counter() - td
            stats.verify_decode_seconds += td
            self._pass_times.append((rows, td))
            accepted, bonus, emitted = accept(tree, lambda row: self._draw_row(tree, ctx, row, sp, rng))
        self._count_residual(c0, stats)
        self.calibration.record(tree, accepted)
        if self.rank_counts is not None:
            self.chain_paths.append(chain_record(tree, accepted, bonus))
        # Keep the root and the accepted path (verifier-written) in sequence 0. A rejected row after
        # the last kept one is freed; one before it is parked in the junk sequence instead: a freed
        # cell would be refilled by a later position, and llama.cpp's attention visits cells in
        # index order, so its float sums would no longer be plain decoding's. With the cache kept
        # in position order, speculative output equals the verifier's own, token for token. Nodes
        # come in depth-first order, so an accepted main chain leaves nothing to park. The junk is
        # freed when space runs short and at the end of each generation.
        kept = [0] + [1 + i for i in accepted]
        last = kept[-1]
        junk = self._junk_lane
        keep_set = set(kept)
        for r in range(1, last):
            if r not in keep_set:
                pos = self.n_past + depths[r]
                self.ctx.seq_cp(row_lanes[r][0], junk, pos, pos + 1)
                self._junk_min = pos if self._n_junk == 0 else min(self._junk_min, pos)
                self._n_junk += 1
        self.ctx.seq_cp(row_lanes[last][0], 0, self.n_past, self.n_past + depths[last] + 1)
        for lane in lane_of.values():
            self.ctx.seq_rm(lane, -1, -1)
        self.tokens.extend(tokens[0:1] + [tree.nodes[i].token for i in accepted])
        self.lookup.extend(tokens[0:1] + [tree.nodes[i].token for i in accepted])
        self.n_past += len(kept)
        stats.n_verify += 1
        stats.n_drafted += len(tree)
        stats.n_accepted += len(accepted)
        stats.n_text_drafted += sum(1 for nd in tree.nodes if nd.source == TEXT)
        stats.n_accepted_text += sum(1 for i in accepted if tree.nodes[i].source == TEXT)
        stats.n_accepted_both += sum(1 for i in accepted if tree.nodes[i].source == DRAFTER | TEXT)
        stats.accept_hist.append(len(accepted))
        stats.verify_seconds += time.perf_counter() - t0
        return emitted

    def _draw_row(self, tree: DraftTree, ctx, row: int, sp: SamplingParams, rng) -> int:
        t = draw(ctx.logits_ith(row), sp, rng)
        if self.rank_counts is not None:
            cands = tree.cands.get(ROOT if row == 0 else row - 1)
            if cands is not None:
                self.rank_counts[cands.index(t) if t in cands else CANDIDATES_PER_NODE] += 1
        return t

    def _count_residual(self, before, stats: Stats) -> None:
        after = self.sm.residual.counters()
        stats.residual_seconds += after.seconds_inside - before.seconds_inside
        stats.residual_bytes += (after.bytes_residual - before.bytes_residual) + (after.bytes_base - before.bytes_base)

    def _plain_step(self, id_last: int, sp: SamplingParams, rng, stats: Stats) -> list[int]:
        """One verifier step. A second, throw-away row keeps llama.cpp's attention on the path it
        takes for batches (one token alone may take a split-KV path with other float sums), so plain
        steps and tree steps compute exactly the same thing."""
        t0 = time.perf_counter()
        c0 = self.sm.residual.counters()
        dummy = self._dummy_lane
        with self.sm.verifying() as ctx:
            td = time.perf_counter()
            ctx.decode([id_last, id_last], [self.n_past, self.n_past], seq_ids=[[0], [dummy]], logits=[True, False])
            stats.verify_decode_seconds += time.perf_counter() - td
            t = draw(ctx.logits_ith(0), sp, rng)
        self.ctx.seq_rm(dummy, -1, -1)
        self._count_residual(c0, stats)
        self.tokens.append(id_last)
        self.lookup.extend([id_last])
        self.n_past += 1
        stats.n_verify += 1
        stats.accept_hist.append(0)
        stats.verify_seconds += time.perf_counter() - t0
        return [t]

    def generate(self, prompt: Sequence[int], max_tokens: int, sp: SamplingParams, *, speculative: bool = True,
                 is_stop: Callable[[int], bool] | None = None, stats: Stats | None = None) -> Iterator[list[int]]:
        """Yield newly emitted tokens, a cycle at a time, until ``max_tokens`` were emitted, a token
        for which ``is_stop`` is true was emitted (it is yielded, nothing after it), or the context is
        full. Emitted tokens beyond these limits are discarded and their KV rolled back."""
        if max_tokens < 0:
            raise InvalidOptionError(f"-n: {max_tokens} is negative")
        stats = stats if stats is not None else Stats()
        t0 = time.perf_counter()
        rng = np.random.default_rng(sp.seed) if not sp.greedy else None
        logits = self.prefill(prompt, stats)
        vocab = getattr(self.sm, "draft_vocab", None)  # the drafter's vocabulary watches the text
        if vocab is not None:
            vocab.note(prompt)
        try:
            if max_tokens == 0:
                return
            id_last = draw(logits, sp, rng)
            out = [id_last]
            stats.n_emitted += 1
            stats.n_verify += 1  # the prompt's verifier pass produced this token
            yield out
            if is_stop is not None and is_stop(id_last):
                return
            n_ctx = self.ctx.n_ctx
            spec = speculative and self.shape.speculates
            # cells one cycle takes beyond the cached text: the drafted lanes or the verified rows (a
            # plain step: its token and the dummy row); the context reserves them beyond n_ctx
            n_cycle = cycle_cells(self.shape) if spec else 2
            while stats.n_emitted < max_tokens:
                room = n_ctx - self.n_past - 1  # positions left after the root
                if room < 0:
                    return  # the context is full: stop cleanly
                if self.n_past + self._n_junk + n_cycle > self.ctx.n_cells:
                    self._flush_junk(stats)
                # what is left (positions, tokens to emit) limits the tree's depth, not its size: a
                # tree emits at most its depth + 1 tokens, and its nodes take reserved cells
                depth = min(room, max_tokens - stats.n_emitted - 1) if spec else 0
                tree = None
                if depth > 0:
                    tc, dd, dp = time.perf_counter(), stats.draft_decode_seconds, stats.n_draft_passes
                    tree, branches = self._draft(id_last, sp, self.shape.nodes, stats, depth)
                if tree:  # (a tree of the text alone may be empty: a plain step then)
                    emitted = self._verify(tree, sp, rng, stats)
                    for b in branches:
                        self.lookup.record(b, emitted)
                    self._measure_cycle(time.perf_counter() - tc, len(emitted), stats.draft_decode_seconds - dd,
                                        stats.n_draft_passes - dp)
                else:
                    emitted = self._plain_step(id_last, sp, rng, stats)
                # limits: max_tokens and stop tokens cut the emitted list. The cycle left the root
                # and emitted[:-1] in the KV; after a cut only the root and emitted[:keep-1] stay.
                keep = min(len(emitted), max_tokens - stats.n_emitted)
                if is_stop is not None:
                    for j, t in enumerate(emitted[:keep]):
                        if is_stop(t):
                            keep = j + 1
                            break
                self._truncate(self.n_past - (len(emitted) - keep))
                emitted = emitted[:keep]
                stats.n_emitted += len(emitted)
                if vocab is not None:
                    vocab.note(emitted)
                yield emitted
                if is_stop is not None and is_stop(emitted[-1]):
                    return
                id_last = emitted[-1]
        finally:
            if not self.sm.residual.batch_invariant:
                self._flush_junk()
            # else parked rows stay (freeing them would mean decoding again what follows them): the
            # next prompt reuses the cache up to them, or room runs short and they go then
            stats.total_seconds += time.perf_counter() - t0


def chain_record(tree: DraftTree, accepted: Sequence[int], bonus: int) -> list[float]:
    """What one verified tree says of the chain a 1-wide drafter would have drafted in its place
    (:meth:`DraftTree.top_chain`): ``[lead, p1, p2, ...]``, ``lead`` the verifier's tokens that
    followed that chain before the first miss, ``p`` the drafter's probability of each chain token
    given the one before (the stops of ``--draft-stop`` compare their products). Where the tree
    did not keep a chain node, the verifier's token at its parent (the bonus, if the chain got that
    far) still says whether it would have been accepted; the record ends there."""
    chain = tree.top_chain()
    lead = 0
    for (node, _), a in zip(chain, accepted):
        if node != a:
            break
        lead += 1
    if lead < len(chain) and chain[lead][0] == -1 and lead == len(accepted):
        parent = ROOT if lead == 0 else chain[lead - 1][0]
        if tree.cands[parent][0] == bonus:
            lead += 1
    return [float(lead)] + [round(p, 4) for _, p in chain]


def parse_draft_stop(value: str | float | None) -> str | float | None:
    """``--draft-stop``: "off" (or None: draft every round the tree's budget allows), "auto" (stop
    when the next round's nodes hold less path probability than a round costs in tokens, measured),
    or a fixed path probability in [0, 1]."""
    if value is None or value == "off":
        return None
    if value == "auto":
        return "auto"
    try:
        v = float(value)
    except (TypeError, ValueError):
        v = math.nan
    if not 0.0 <= v <= 1.0:  # also not a number at all (nan)
        raise InvalidOptionError(f"--draft-stop: {value!r} is not 'off', 'auto' or a probability in [0, 1]")
    return v if v > 0 else None


def cycle_cells(shape: TreeShape) -> int:
    """KV cells one cycle of this shape may take beyond the cached text: the drafted nodes (and the
    root; with the text's share drafted, :meth:`TreeShape.draft_rounds`) or the verified rows (the
    text's nodes included)."""
    return max(shape.nodes + shape.text + 1, shape.width * shape.draft_rounds(shape.text) + 1)


def max_lanes(shape: TreeShape) -> int:
    """Sequence ids a tree of this shape may use besides sequence 0: one per leaf, drafting or
    verifying (never more than the tree's cells, and capped at MAX_LANES: the drafter stops and the
    verified tree is pruned at the cap)."""
    return min(cycle_cells(shape), MAX_LANES)


def n_seq_max_for(shape: TreeShape) -> int:
    """n_seq_max a context needs for this shape: sequence 0, the lanes, the junk and dummy sequences."""
    return max_lanes(shape) + 3


def reserve_for(shape: TreeShape) -> int:
    """KV cells a context for this shape reserves beyond its n_ctx positions: a cycle's cells, the
    dummy row and room for parked rows."""
    return cycle_cells(shape) + 3
