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
from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence

from ..errors import BusyError, InvalidOptionError
from ..formats.profile import load_profile
from ..native import policy
from ..runtime.verifier import SplitModel
from . import autotree
from .engine import MAX_TREE_NODES, Engine, Stats, TreeShape, kernel_pinned_by_env, n_seq_max_for, reserve_for
from .options import GenerationOptions
from .sampling import SamplingParams


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


BUSY = "this model is busy with another generation; calls are not interleaved"


class Generator:
    """A split model ready to generate, as ``options`` say (a :class:`GenerationOptions`, or its
    fields as keywords, which override ``options``'s). ``shape`` fixes the tree's shape instead of
    ``tree_nodes``; ``log`` receives the progress of a first ``tree_nodes="auto"`` measurement."""

    def __init__(self, model_dir: str | os.PathLike[str], options: GenerationOptions | None = None, *,
                 shape: TreeShape | None = None, log: Callable[[str], None] | None = None, **overrides):
        opts = GenerationOptions.of(options, **overrides)  # every value checked before the model loads
        self.options = opts
        auto = shape is None and opts.tree_nodes == "auto"
        # the text's nodes: at most what a verify pass leaves beside the tree's
        text_for = lambda s: s.with_text(min(opts.text_nodes, MAX_TREE_NODES - s.nodes))  # noqa: E731
        if shape is None:  # (a shape given keeps its own text budget)
            shape = text_for(TreeShape(0, 1, 1) if auto else TreeShape.for_nodes(opts.tree_nodes))
        self.shape = shape
        self.shape.validate()
        split_prof = load_profile(model_dir) if auto else None  # the split's own (bitsplit profile), if any
        # the largest the choice may use
        room = text_for(autotree.room_for(split_prof)) if auto else self.shape
        room.validate()
        self.sm = SplitModel(model_dir, n_ctx=opts.n_ctx,
                             n_batch=max(opts.n_batch, room.nodes + room.text + 8, n_seq_max_for(room)),
                             n_seq_max=n_seq_max_for(room), reserve=reserve_for(room), n_threads=opts.n_threads,
                             n_gpu_layers=opts.n_gpu_layers, precision=opts.precision, act_bits=opts.act_bits,
                             draft_vocab=opts.draft_vocab, verbose=opts.verbose,
                             fast_drafter=None if opts.drafter == "auto" else opts.drafter == "native", rpc=opts.rpc,
                             rpc_timeout=opts.rpc_timeout, overlap=opts.overlap, overlap_at=opts.overlap_at,
                             compensation=opts.compensation)
        self.auto_choice = None
        # one family for every pass, whatever the tree (and with --no-spec): the verifier's arithmetic
        # is the same in every generation of this model here (BITSPLIT_KERNEL's, where set, pins it natively)
        kernel = opts.kernel or (None if kernel_pinned_by_env() else policy.generation_family(self.sm.residual_alone))
        if auto:
            self.shape, self.auto_choice, kernel = autotree.choose_for(
                self.sm, self.tokenize, split_prof, kernel=kernel, draft_stop=opts.draft_stop, log=log)
            self.shape = text_for(self.shape)
        self.kernel = self.sm.residual.choose_decode_kernel(2, kernel, residual_alone=self.sm.residual_alone)
        self.engine = Engine(self.sm, self.shape, draft_stop=opts.draft_stop)
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
