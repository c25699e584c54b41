"""``BitsplitLlama``: a split model where apps expect a ``llama_cpp.Llama``.

What is reused from llama-cpp-python, unchanged: the whole completion and chat layer of
``llama_cpp.Llama`` — ``create_completion``/``__call__`` (prompt handling, echo, stop strings,
streaming chunks, ``usage``), ``create_chat_completion`` (the model's own chat template from the GGUF
metadata through llama-cpp-python's Jinja2 chat formatter, chat formats and handlers), ``tokenize``
and ``detokenize`` (its tokenizer over the same vocabulary).

What is replaced: model and context creation (the base model with the residual's eval callback,
see :mod:`bitsplit_llama.runtime.verifier`) and token generation — ``generate`` runs the speculative engine
(the base drafts, base + residual verifies) and yields the verifier's tokens one by one, so every
caller of ``generate`` above it behaves as with a plain Llama, only faster where speculation pays.

Stopping criteria are called with the context's tokens after each new token (their logits
argument is zeros: logits are not kept). Not supported (a clear error, never silently ignored):
grammars, logits processors, repetition /
frequency / presence penalties, typical-p, tail-free and mirostat sampling, logprobs, embeddings,
state save/load and prompt caches.
"""

from __future__ import annotations

import contextlib
import os
import re
import threading
from pathlib import Path
from typing import Iterator, Optional, Sequence

import numpy as np

from ..errors import ContextWindowError, InvalidOptionError
from ..speculative.engine import Stats
from ..speculative.options import GenerationOptions, SamplingParams


def _make_class():
    import llama_cpp
    import llama_cpp._internals as internals
    from llama_cpp import llama_chat_format
    from llama_cpp.llama_tokenizer import LlamaTokenizer

    Llama = llama_cpp.Llama

    class BitsplitLlama(Llama):  # noqa: D101 - documented in the module
        def __init__(self, model_dir: str | os.PathLike[str], options: Optional[GenerationOptions] = None, *,
                     seed: int = llama_cpp.LLAMA_DEFAULT_SEED, chat_format: Optional[str] = None, chat_handler=None,
                     **overrides):
            """``options`` (a :class:`~bitsplit_llama.GenerationOptions`), or any of its fields as
            keywords (``n_ctx=2048, tree_nodes=16, act_bits="16"``, ...), which override ``options``'s;
            an unknown keyword is a TypeError naming it. ``seed``, ``chat_format`` and ``chat_handler``
            are llama_cpp.Llama's."""
            from ..speculative.generate import Generator

            opts = GenerationOptions.of(options, **overrides)
            self.verbose = opts.verbose
            self._stack = contextlib.ExitStack()
            self.model_dir = Path(model_dir)
            # set by a server for the generation it runs: when set, generate() stops at the next cycle
            self.cancel_event: threading.Event | None = None
            self._gen = Generator(model_dir, opts)
            self._stack.callback(self._gen.close)
            sm = self._gen.sm
            self.model_path = str(sm.residual.base_path)
            verbose = opts.verbose

            # llama-cpp-python's wrappers over *our* model and context: they do not own them
            self._model = _borrow(internals.LlamaModel, model=sm.model.ptr, vocab=sm.model.vocab,
                                  path_model=self.model_path, verbose=verbose)
            self._ctx = _borrow(internals.LlamaContext, ctx=sm.ctx.ptr, model=self._model, verbose=verbose,
                                memory=sm.ctx.mem)
            self.model_params = sm.model.params
            self.context_params = sm.ctx._params
            self.n_batch = sm.ctx.n_batch
            self.n_threads = self.n_threads_batch = sm.ctx.n_threads
            self._seed = seed or llama_cpp.LLAMA_DEFAULT_SEED
            self.cache = None
            self.spm_infill = False
            self.draft_model = None
            self.lora_path = self.lora_base = None
            self._logits_all = False
            self.numa = llama_cpp.GGML_NUMA_STRATEGY_DISABLED
            self.tokenizer_ = LlamaTokenizer(self)
            self._n_vocab = self.n_vocab()
            self._n_ctx = self.n_ctx()
            self._token_nl = self.token_nl()
            self._token_eos = self.token_eos()
            self.n_tokens = 0
            self.input_ids = np.zeros((self._n_ctx,), dtype=np.intc)
            self.scores = np.zeros((1, self._n_vocab), dtype=np.single)
            self.last_n_tokens_size = 64
            self._is_recurrent = self._is_hybrid = False
            self._requires_eval = True

            # chat templates from the GGUF metadata, exactly as llama_cpp.Llama sets them up
            self.chat_format = chat_format
            self.chat_handler = chat_handler
            self._chat_handlers = {}
            try:
                self.metadata = self._model.metadata()
            except Exception:
                self.metadata = {}
            eos_id, bos_id = self.token_eos(), self.token_bos()
            eos = self._model.token_get_text(eos_id) if eos_id != -1 else ""
            bos = self._model.token_get_text(bos_id) if bos_id != -1 else ""
            templates = {name[10:]: t for name, t in self.metadata.items() if name.startswith("tokenizer.chat_template.")}
            if "tokenizer.chat_template" in self.metadata:
                templates["chat_template.default"] = self.metadata["tokenizer.chat_template"]
            for name, template in templates.items():
                self._chat_handlers[name] = llama_chat_format.Jinja2ChatFormatter(
                    template=template, eos_token=eos, bos_token=bos, stop_token_ids=[eos_id]).to_chat_handler()
            if self.chat_format is None and self.chat_handler is None and "chat_template.default" in templates:
                guessed = llama_chat_format.guess_chat_format_from_gguf_metadata(self.metadata)
                self.chat_format = guessed or "chat_template.default"
            if self.chat_format is None and self.chat_handler is None:
                self.chat_format = "llama-2"

        # -- generation: the speculative engine replaces llama_cpp.Llama's token loop -------------
        def generate(self, tokens: Sequence[int], top_k: int = 40, top_p: float = 0.95, min_p: float = 0.05,
                     typical_p: float = 1.0, temp: float = 0.80, repeat_penalty: float = 1.0, reset: bool = True,
                     frequency_penalty: float = 0.0, presence_penalty: float = 0.0, tfs_z: float = 1.0,
                     mirostat_mode: int = 0, mirostat_tau: float = 5.0, mirostat_eta: float = 0.1,
                     penalize_nl: bool = True, logits_processor=None, stopping_criteria=None, grammar=None,
                     ) -> Iterator[int]:
            """Yield the verifier's tokens after ``tokens`` (speculatively decoded); see the module doc
            for the sampling options that are not supported."""
            unsupported = {
                "typical_p": (typical_p, 1.0), "repeat_penalty": (repeat_penalty, 1.0),
                "frequency_penalty": (frequency_penalty, 0.0), "presence_penalty": (presence_penalty, 0.0),
                "tfs_z": (tfs_z, 1.0), "mirostat_mode": (mirostat_mode, 0),
            }
            for name, (value, neutral) in unsupported.items():
                if value != neutral:
                    raise InvalidOptionError(f"{name}={value} is not supported by BitsplitLlama (use {neutral})")
            for name, value in (("logits_processor", logits_processor), ("grammar", grammar)):
                if value:
                    raise InvalidOptionError(f"{name} is not supported by BitsplitLlama")
            seed = int(self._seed) % (2**63)
            sp = SamplingParams(temperature=max(0.0, float(temp)), top_k=int(top_k), top_p=float(top_p),
                                min_p=float(min_p), seed=seed)
            tokens = list(tokens)
            # the Generator's path and lock, as for every other caller: one generation at a time per
            # model (one KV cache), a concurrent caller gets BusyError
            chunks = self._gen.tokens(tokens, max_tokens=max(1, self._gen.n_ctx - len(tokens)), sampling=sp)
            try:
                first = True
                for chunk in chunks:
                    cancel = self.cancel_event
                    if cancel is not None and cancel.is_set():
                        return  # the caller gave up (a server whose client went away): stop here
                    if first:  # the lock is held from here: llama_cpp.Llama's callers read input_ids[:n_tokens]
                        self.input_ids[:len(tokens)] = tokens
                        self.n_tokens = len(tokens)
                        first = False
                    for t in chunk:
                        if self.n_tokens < len(self.input_ids):
                            self.input_ids[self.n_tokens] = t
                            self.n_tokens += 1
                        yield t
                        # stopping criteria see the tokens (logits are not kept: they get zeros)
                        if stopping_criteria is not None and stopping_criteria(self._input_ids, self.scores[-1, :]):
                            return
            finally:
                chunks.close()

        def _create_completion(self, *args, **kwargs):
            # llama_cpp.Llama checks the prompt against our n_ctx but names its context's size,
            # which includes the KV cells reserved for tree rows: name the user's (still a ValueError)
            try:
                yield from super()._create_completion(*args, **kwargs)
            except ValueError as exc:
                m = re.match(r"Requested tokens \((\d+)\) exceed context window", str(exc))
                if m is None:
                    raise
                raise ContextWindowError(f"the prompt has {m.group(1)} tokens; the context holds {self._n_ctx} "
                                         f"(n_ctx), and at least one must be left to generate") from None

        @property
        def last_stats(self) -> Stats | None:
            """The statistics of the latest generation (filled in as it runs)."""
            return self._gen.last_stats

        # -- the parts of llama_cpp.Llama that do not apply -------------------------------------
        def eval(self, tokens):  # noqa: D102
            raise NotImplementedError("BitsplitLlama evaluates inside generate(); eval() is not available")

        def sample(self, *args, **kwargs):  # noqa: D102
            raise NotImplementedError("BitsplitLlama samples inside generate(); sample() is not available")

        def create_embedding(self, *args, **kwargs):  # noqa: D102
            raise NotImplementedError("embeddings are not supported by BitsplitLlama")

        def embed(self, *args, **kwargs):  # noqa: D102
            raise NotImplementedError("embeddings are not supported by BitsplitLlama")

        def set_cache(self, cache):  # noqa: D102
            if cache is not None:
                raise NotImplementedError("prompt caches are not supported by BitsplitLlama (the KV prefix is reused)")

        def save_state(self):  # noqa: D102
            raise NotImplementedError("state save/load is not supported by BitsplitLlama")

        def load_state(self, state):  # noqa: D102
            raise NotImplementedError("state save/load is not supported by BitsplitLlama")

        def __getstate__(self):
            raise NotImplementedError("BitsplitLlama cannot be pickled")

        def reset(self):  # noqa: D102
            self._gen.reset()

        def n_ctx(self) -> int:  # noqa: D102
            return self._gen.n_ctx

        @property
        def options(self) -> GenerationOptions:
            """The options this model was loaded with (checked and normalised)."""
            return self._gen.options

        @property
        def kernel(self) -> str:
            """The native kernel family used for decoding passes."""
            return self._gen.kernel

        def close(self) -> None:  # noqa: D102
            stack = getattr(self, "_stack", None)
            if stack is not None:
                self._stack = None
                stack.close()

        def __del__(self) -> None:
            try:
                self.close()
            except Exception:
                pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.close()

    return BitsplitLlama


def _borrow(cls, **attrs):
    """An instance of a llama-cpp-python wrapper class pointing at our objects, owning nothing
    (its close() frees nothing: our Model/Context do)."""
    obj = cls.__new__(cls)
    obj._exit_stack = contextlib.ExitStack()
    obj.sampler = None
    obj.custom_samplers = []
    obj.params = None
    for k, v in attrs.items():
        setattr(obj, k, v)
    return obj


_CLASS = None


def get_class():
    """The BitsplitLlama class (created on first use: defining it imports llama_cpp)."""
    global _CLASS
    if _CLASS is None:
        _CLASS = _make_class()
        _CLASS.__module__ = __name__
        _CLASS.__qualname__ = _CLASS.__name__ = "BitsplitLlama"
        _CLASS.__doc__ = __doc__
    return _CLASS


def __getattr__(name: str):
    if name == "BitsplitLlama":
        return get_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
