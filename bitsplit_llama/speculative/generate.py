"""Text in, text out: a split model with its speculative engine, tokenization, stops and streaming.

:class:`Generator` is what ``bitsplit run``, ``bitsplit bench`` and
:class:`~bitsplit_llama.api.llama.BitsplitLlama` use, all through :meth:`Generator.tokens`: the one
path to the engine, under the one lock. Calls on one Generator are serialised (one KV cache); a
second concurrent call gets :class:`~bitsplit_llama.errors.BusyError` instead of corrupting the first.
"""

from __future__ import annotations

import codecs
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence

from .engine import Engine, Stats, TreeShape, kernel_pinned_by_env, n_seq_max_for, parse_draft_stop, reserve_for
from ..errors import BusyError, InvalidOptionError
from .sampling import SamplingParams
from ..runtime.verifier import SplitModel


@dataclass
class Result:
    text: str
    tokens: list[int]
    prompt_tokens: int
    finish_reason: str  # "stop" (EOG token or stop string), "length" (-n or context full)
    stats: Stats = field(default_factory=Stats)

    def to_json(self) -> dict:
        d = {"text": self.text, "tokens": self.tokens, "n_tokens": len(self.tokens),
             "finish_reason": self.finish_reason}
        d.update(self.stats.to_json())
        d["n_tokens"] = len(self.tokens)
        return d


DRAFTERS = ("auto", "native", "llama.cpp")
BUSY = "this model is busy with another generation; calls are not interleaved"


class Generator:
    """A split model ready to generate. ``tree_nodes=0`` decodes with the verifier alone."""

    def __init__(self, model_dir: str | os.PathLike[str], *, n_ctx: int = 4096, n_threads: int | None = None,
                 n_gpu_layers: int | None = None, tree_nodes: int | str = 16, shape: TreeShape | None = None,
                 precision: str = "auto", verbose: bool = False, n_batch: int = 512, kernel: str | None = None,
                 drafter: str = "auto", log=None, rpc=None, rpc_timeout: float = 60.0, overlap: bool = True,
                 draft_stop: str | float | None = "auto", act_bits: str = "auto",
                 draft_vocab: str | int = "auto"):
        auto = shape is None and tree_nodes == "auto"
        draft_stop = parse_draft_stop(draft_stop)  # a bad value fails before the model loads
        if not auto and shape is None and not isinstance(tree_nodes, int):
            raise InvalidOptionError(f"--tree-nodes: {tree_nodes!r} is neither 'auto' nor a non-negative integer")
        self.shape = shape or (TreeShape(0, 1, 1) if auto else TreeShape.for_nodes(tree_nodes))
        self.shape.validate()
        if drafter not in DRAFTERS:
            raise InvalidOptionError(f"--drafter: {drafter!r} is not one of {', '.join(DRAFTERS)}")
        split_prof = None
        if auto:
            from ..tools.profile import load_profile

            split_prof = load_profile(model_dir)  # None without one (or one of another base)
        room = TreeShape(24, 4, 10) if auto else self.shape  # the largest an automatic choice may use
        if split_prof:
            big = max(int(r["nodes"]) for r in split_prof["profile"])
            if big > room.nodes:
                room = TreeShape.for_nodes(big)
        self.sm = SplitModel(model_dir, n_ctx=n_ctx, n_batch=max(n_batch, room.nodes + 8),
                             n_seq_max=n_seq_max_for(room), reserve=reserve_for(room), n_threads=n_threads, n_gpu_layers=n_gpu_layers,
                             precision=precision, act_bits=act_bits, draft_vocab=draft_vocab, verbose=verbose,
                             fast_drafter=None if drafter == "auto" else drafter == "native", rpc=rpc,
                             rpc_timeout=rpc_timeout, overlap=overlap)
        self.auto_choice = None
        if auto:
            from ..formats.modeldir import residual_keys
            from . import autotree

            keys = residual_keys(self.sm.residual.residual_path, with_fingerprint=True)
            fp = keys["base_fingerprint"]
            setup = autotree.setup_of(self.sm, keys["residual_fingerprint"])
            key = autotree.machine_key(self.sm.ctx.n_threads, setup)
            prof = None
            prefer = None  # rows -> the policy's family: the cost curves price the family the run pins
            if kernel is None and not kernel_pinned_by_env():
                from ..native import policy

                def prefer(rows: int) -> str | None:
                    return policy.kernel_for_batch(rows, residual_alone=self.sm.residual_alone)
            if split_prof is None or split_prof.get("machine_key") != key:
                prof = autotree.load_or_measure(Engine(self.sm, self.shape), self.tokenize, self.sm.model.is_eog, fp,
                                                self.sm.ctx.n_threads, log, setup)
            if split_prof is not None:
                self.shape, best_tps, table = autotree.choose_measured(split_prof, key, prof, prefer)
                self.auto_choice = {"shape": [self.shape.nodes, self.shape.width, self.shape.rounds],
                                    "expected_tokens_per_second": round(best_tps, 3),
                                    "from": "acceptance profile" + (" (its times)" if prof is None else
                                                                    " (this machine's cost curves)")}
            else:
                self.shape, best_tps, table = autotree.choose(prof, prefer=prefer, draft_stop=draft_stop)
                fixed16 = next((r for r in table if (r[0].nodes, r[0].width, r[0].rounds) == (16, 4, 7)), None)
                self.auto_choice = {"shape": [self.shape.nodes, self.shape.width, self.shape.rounds],
                                    "expected_tokens_per_second": round(best_tps, 3),
                                    "expected_tokens_per_second_fixed16": round(fixed16[3], 3) if fixed16 else None,
                                    "rank_probs": prof.rank_probs, "from": "rank model",
                                    # calibration cycles that priced chains (0: the rank model did)
                                    "chain_paths": len(prof.chains) if autotree.priced_from_paths(
                                        TreeShape(1, 1, 1), prof) else 0}
        # plain steps carry two rows; tree passes 1 + nodes. With the auto tree's cost curves, the
        # family measured fastest at that size here (unless one was asked for, or BITSPLIT_KERNEL)
        rows = max(2, self.shape.nodes + 1)
        if auto and prof is not None and prefer is not None:
            kernel = prof.kernel(rows, prefer=prefer(rows))
            if kernel not in policy.families():  # a profile of families this run cannot pin: the policy's
                kernel = None
            if kernel is not None:
                self.auto_choice["kernel"] = kernel
        self.kernel = self.sm.residual.choose_decode_kernel(rows, kernel, residual_alone=self.sm.residual_alone)
        self.engine = Engine(self.sm, self.shape, draft_stop=draft_stop)
        self.model = self.sm.model
        self._lock = threading.Lock()
        self.last_stats: Stats | None = None

    def close(self) -> None:
        self.sm.close()

    def __enter__(self) -> "Generator":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def n_ctx(self) -> int:
        return self.sm.ctx.n_ctx

    def tokenize(self, text: str | bytes, add_special: bool = True, parse_special: bool = False) -> list[int]:
        return self.sm.model.tokenize(text, add_special=add_special, parse_special=parse_special)

    def reset(self) -> None:
        """Forget the cached prompt (the KV cache); refused while a generation runs."""
        if not self._lock.acquire(blocking=False):
            raise BusyError(BUSY)
        try:
            self.engine.reset()
        finally:
            self._lock.release()

    def tokens(self, prompt: Sequence[int], *, max_tokens: int = 256, sampling: SamplingParams | None = None,
               speculative: bool = True, stats: Stats | None = None) -> Iterator[list[int]]:
        """The verifier's tokens after ``prompt``, a cycle at a time, until ``max_tokens``, an
        end-of-generation token (yielded, nothing after it) or a full context. The model's lock is
        held from the first step until the iterator ends or is closed; a concurrent call gets
        BusyError. ``last_stats`` is this call's statistics from its first step on."""
        sp = sampling or SamplingParams()
        if not self._lock.acquire(blocking=False):
            raise BusyError(BUSY)
        try:
            toks = list(prompt)
            if not toks:
                raise InvalidOptionError("the prompt is empty (no tokens)")
            stats = stats if stats is not None else Stats()
            self.last_stats = stats
            yield from self.engine.generate(toks, max_tokens, sp, speculative=speculative,
                                            is_stop=self.sm.model.is_eog, stats=stats)
        finally:
            self._lock.release()

    def stream(self, prompt: str | Sequence[int], *, max_tokens: int = 256, sampling: SamplingParams | None = None,
               stop: Sequence[str] = (), speculative: bool = True, add_special: bool = True,
               parse_special: bool = True, stats: Stats | None = None,
               on_finish: Callable[[Result], None] | None = None) -> Iterator[tuple[str, list[int]]]:
        """Yield (text piece, tokens) as the verifier accepts them. Stop strings end the text before
        them; the final Result goes to ``on_finish``."""
        if isinstance(stop, str):
            stop = [stop]
        stop = [s for s in stop if s]
        toks = list(prompt) if not isinstance(prompt, str) else self.tokenize(prompt, add_special, parse_special)
        stats = stats if stats is not None else Stats()
        chunks = self.tokens(toks, max_tokens=max_tokens, sampling=sampling, speculative=speculative, stats=stats)
        try:
            dec = codecs.getincrementaldecoder("utf-8")(errors="replace")
            text = ""
            emitted_text = 0  # chars of `text` already yielded
            out_tokens: list[int] = []
            finish = "length"
            hold = max((len(s) for s in stop), default=0)
            model = self.sm.model
            for chunk in chunks:
                piece_tokens = []
                for t in chunk:
                    if model.is_eog(t):
                        finish = "stop"
                        break
                    piece_tokens.append(t)
                    text += dec.decode(model.token_to_piece(t))
                out_tokens.extend(piece_tokens)
                if stop:
                    cut = min((i for i in (text.find(s, max(0, emitted_text - hold)) for s in stop) if i >= 0),
                              default=-1)
                    if cut >= 0:
                        text = text[:cut]
                        finish = "stop"
                        if len(text) > emitted_text:
                            yield text[emitted_text:], piece_tokens
                        emitted_text = len(text)
                        break
                    # hold back a tail that could be the start of a stop string
                    safe = max(emitted_text, len(text) - hold)
                else:
                    safe = len(text)
                if safe > emitted_text or piece_tokens:
                    yield text[emitted_text:safe], piece_tokens
                    emitted_text = safe
                if finish == "stop":
                    break
            chunks.close()  # the engine's statistics are complete, and the model free, once it ends
            if finish != "stop":
                text += dec.decode(b"", final=True)
                if len(text) > emitted_text:
                    yield text[emitted_text:], []
            if on_finish is not None:
                on_finish(Result(text=text, tokens=out_tokens, prompt_tokens=len(toks), finish_reason=finish,
                                 stats=stats))
        finally:
            chunks.close()

    def generate(self, prompt: str | Sequence[int], **kw) -> Result:
        box: list[Result] = []
        for _ in self.stream(prompt, on_finish=box.append, **kw):
            pass
        return box[0]
