"""The options of a split model ready to generate: one object, validated once, passed down whole.

:class:`GenerationOptions` is built once by each entry point (``bitsplit run``, ``chat``, ``serve``,
``bench``, :class:`~bitsplit_llama.api.llama.BitsplitLlama`, :class:`~.generate.Generator`) and carries
every knob of the drafter and the verifier; :class:`SamplingParams`, how tokens are drawn. A bad
value is refused here, before any model loads, in one message naming the option and what it takes.
Every default is stated here and nowhere else (the CLI's, the server's and the API's come from it).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass, fields
from typing import Any, Mapping

from ..errors import InvalidOptionError

#: who computes the drafter's products
DRAFTERS = ("auto", "native", "llama.cpp")


class UnknownOptionError(InvalidOptionError, TypeError):
    """A keyword that is no option (a misspelling must not silently do nothing): an
    InvalidOptionError, and the TypeError Python raises for an unexpected keyword argument."""


@dataclass(frozen=True)
class GenerationOptions:
    """How a split model is loaded and decoded. Values are checked and normalised on creation
    (``tree_nodes="8"`` becomes 8, ``draft_stop="0"`` becomes None); ``replace(**kw)`` makes a
    checked copy."""

    #: positions a sequence may use (the prompt plus what is generated)
    n_ctx: int = 4096
    #: rows llama.cpp takes in one batch (raised to fit the tree when needed)
    n_batch: int = 512
    #: CPU threads (None: every core this process may use)
    n_threads: int | None = None
    #: the base's layers on the GPU or the ``rpc`` servers (None: 0, or all with ``rpc``)
    n_gpu_layers: int | None = None
    #: draft tree size: "auto" (the fastest on this machine, measured once and cached), or a number
    #: of nodes up to 256; 0: no drafter (with ``text_nodes=0`` too, the verifier alone)
    tree_nodes: int | str = "auto"
    #: draft nodes from the text itself (the continuation of an earlier occurrence of the last tokens:
    #: prompt lookup) verified beside the tree's, at most this many per pass (as many as their measured
    #: acceptance makes worth a row, and no more than the 256 a pass takes leave beside the tree); 0: off
    text_nodes: int = 32
    #: who computes the drafter's products: "native" (this library's integer kernels), "llama.cpp",
    #: or "auto" (native on CPU-only runs)
    drafter: str = "auto"
    #: end a draft before its node budget when the next drafter round holds too little probability:
    #: "auto" (less than the round costs in tokens, measured as it runs), None/"off", or a path
    #: probability in [0, 1]
    draft_stop: str | float | None = "auto"
    #: the drafter's vocabulary: "all" (the whole output head), a number N (the head for token ids
    #: below N and the control tokens; output unchanged), or "auto" (65536 where the head is an exact
    #: CPU tensor over twice that, the whole head while over 5% of the last 64 tokens fall outside)
    draft_vocab: str | int = "auto"
    #: the verifier's products: "auto", "bf16" or "f32"
    precision: str = "auto"
    #: the verifier's activations in the 16-bit integer kernels: "16", "8" (the high digit alone where
    #: a block has no outlier) or "auto" (8 with a q6_k residual on x86 CPUs without AVX-512, else 16)
    act_bits: str = "auto"
    #: the native kernel family of every verifier pass (None: ``native.policy.generation_family``, one
    #: family per machine and model whatever the tree and with --no-spec, so that speculative output is
    #: the verifier-alone output); ``bitsplit doctor`` lists the families this CPU runs
    kernel: str | None = None
    #: llama.cpp RPC servers ``HOST:PORT[,...]`` holding the base's layers (the device path without a GPU)
    rpc: str | None = None
    #: seconds an RPC server may take to answer
    rpc_timeout: float = 60.0
    #: with the base on a device: compute R . x beside the device's W2 . x (True) or after it
    overlap: bool = True
    #: where that R . x starts: "inputs" (the graph also stops at each product's input) or "products"
    #: (at an input's first product; its later products beside the device's: one stop per product)
    overlap_at: str = "inputs"
    #: with the base on a device: its rounding of the activations corrected by a second product on the
    #: device ("auto": by the device's own rule where one is written, "off", or a rule: cpu, cuda,
    #: cuda-mmvq, metal)
    compensation: str = "auto"
    #: show llama.cpp's log
    verbose: bool = False

    def __post_init__(self) -> None:
        set_ = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731 (frozen)
        set_("n_ctx", _int("--n-ctx", self.n_ctx, 8, "is too small (at least 8)"))
        set_("n_batch", _int("n_batch", self.n_batch, 1, "is not a positive integer"))
        if self.n_threads is not None:
            set_("n_threads", _int("--threads", self.n_threads, 1, "is not a positive integer"))
        if self.n_gpu_layers is not None:
            set_("n_gpu_layers", _int("--n-gpu-layers", self.n_gpu_layers, 0, "is negative"))
        set_("tree_nodes", parse_tree_nodes(self.tree_nodes))
        from .engine import MAX_TREE_NODES

        set_("text_nodes", _int("--text-nodes", self.text_nodes, 0, "is negative"))
        if self.text_nodes > MAX_TREE_NODES:
            raise InvalidOptionError(f"--text-nodes: {self.text_nodes} is more than {MAX_TREE_NODES}, the most nodes "
                                     "one verify pass takes")
        if self.drafter not in DRAFTERS:
            raise InvalidOptionError(f"--drafter: {self.drafter!r} is not one of {', '.join(DRAFTERS)}")
        from .engine import parse_draft_stop

        set_("draft_stop", parse_draft_stop(self.draft_stop))
        from ..native.residual import OVERLAP_AT, PRECISIONS, check_act_bits, check_draft_vocab

        set_("draft_vocab", check_draft_vocab(self.draft_vocab))
        if self.precision not in PRECISIONS:
            raise InvalidOptionError(f"--precision: {self.precision!r} is not one of {', '.join(PRECISIONS)}")
        set_("act_bits", check_act_bits(self.act_bits))
        if self.kernel is not None:
            from ..native.policy import ALL_FAMILIES  # whether this CPU runs it is asked when the model loads

            if self.kernel not in ALL_FAMILIES:
                raise InvalidOptionError(f"--kernel: {self.kernel!r} is not a kernel family (expected one of: "
                                         f"{', '.join(ALL_FAMILIES)})")
        from ..runtime import rpc as rpc_mod

        if isinstance(self.rpc, (list, tuple)):
            set_("rpc", ",".join(self.rpc))
        if self.rpc == "":
            set_("rpc", None)
        if self.rpc is not None:
            rpc_mod.parse_endpoints(self.rpc)
        set_("rpc_timeout", rpc_mod.check_timeout(self.rpc_timeout))
        set_("overlap", bool(self.overlap))
        if self.overlap_at not in OVERLAP_AT:
            raise InvalidOptionError(f"--overlap-at: {self.overlap_at!r} is not one of {', '.join(OVERLAP_AT)}")
        set_("compensation", rpc_mod.check_compensation(self.compensation))
        set_("verbose", bool(self.verbose))

    @classmethod
    def of(cls, options: "GenerationOptions | None" = None, /, **overrides: Any) -> "GenerationOptions":
        """``options`` (default: the defaults) with ``overrides`` applied: the constructor that every
        entry point taking keywords uses, so a misspelled keyword is refused by name."""
        base = options if options is not None else cls()
        if not isinstance(base, cls):
            raise InvalidOptionError(f"options: expected a GenerationOptions, got {type(base).__name__}")
        return base.replace(**overrides) if overrides else base

    def replace(self, **changes: Any) -> "GenerationOptions":
        unknown = sorted(set(changes) - set(self.names()))
        if unknown:
            raise UnknownOptionError(f"unknown option{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))} "
                                     f"(expected: {', '.join(self.names())})")
        return dataclasses.replace(self, **changes)

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> "GenerationOptions":
        return cls.of(**dict(obj))


#: the temperature of ``bitsplit chat`` and of server requests that set none (llama.cpp's own
#: default); ``run``, ``bench`` and the API default to greedy (SamplingParams' 0.0)
CHAT_TEMPERATURE = 0.8


@dataclass(frozen=True)
class SamplingParams:
    """How a token is drawn from the verifier's logits; every default of the project's is here."""

    temperature: float = 0.0
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    seed: int | None = None

    def __post_init__(self):
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise InvalidOptionError(f"temperature: {self.temperature} is negative (expected >= 0; 0 = greedy)")
        if not isinstance(self.top_k, numbers.Integral) or isinstance(self.top_k, bool) or self.top_k < 0:
            raise InvalidOptionError(f"top-k: {self.top_k} is not a non-negative integer (0 = off)")
        if not (0.0 < self.top_p <= 1.0):
            raise InvalidOptionError(f"top-p: {self.top_p} is outside (0, 1]")
        if not (0.0 <= self.min_p <= 1.0):
            raise InvalidOptionError(f"min-p: {self.min_p} is outside [0, 1]")
        if self.seed is not None and (not isinstance(self.seed, numbers.Integral) or self.seed < 0):
            raise InvalidOptionError(f"seed: {self.seed} is not a non-negative integer")

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


def parse_tree_nodes(value: int | str) -> int | str:
    """``--tree-nodes``: "auto" or a number of nodes in [0, 256] (a string of digits is read as one)."""
    if value == "auto":
        return "auto"
    if isinstance(value, bool):
        value = str(value)
    if isinstance(value, str):
        try:
            value = int(value.strip())
        except ValueError:
            raise InvalidOptionError(f"--tree-nodes: {value!r} is neither 'auto' nor a non-negative integer") from None
    if not isinstance(value, int):
        raise InvalidOptionError(f"--tree-nodes: {value!r} is neither 'auto' nor a non-negative integer")
    from .engine import TreeShape

    TreeShape.for_nodes(value)  # the one check of the range (negative, more than a verify pass takes)
    return value


def _int(option: str, value: Any, low: int, too_low: str) -> int:
    """``value`` as an integer of at least ``low`` (a string of digits is read as one)."""
    if isinstance(value, str):
        try:
            value = int(value.strip())
        except ValueError:
            pass
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidOptionError(f"{option}: {value!r} is not an integer")
    if value < low:
        raise InvalidOptionError(f"{option}: {value} {too_low}")
    return value
