"""A split model loaded for inference: one llama.cpp context over base.gguf whose eval callback
is the native residual context. With the residual enabled the context computes the verifier
(base + residual); disabled, the plain base (the drafter). Both roles share the one KV cache.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import os
import threading
from pathlib import Path

from .. import native
from ..errors import BusyError, InvalidOptionError, UnsupportedModelError
from ..native import policy
from ..native.residual import Residual, check_act_bits, check_draft_vocab
from . import rpc as rpc_mod
from .llamacpp import Context, Model


# "--draft-vocab auto": the drafter's head keeps the first DRAFT_VOCAB token ids (and the control
# tokens at the end) where the vocabulary holds over twice as many. Qwen2.5's BPE ids below 65,536
# cover 98% of the tokens of code and English text (argparse.py + textwrap.py, the GPL-3), 99% of
# German, but 63% of Russian and 37% of Chinese: hence DraftVocab's watch. Measured on a 2-core
# Zen 4 with llama.cpp and the library on AVX2 alone (Qwen2.5-Coder-1.5B q6_k split, bitsplit bench
# --prompts P4 -n 32, four rounds in alternating order): speedup_vs stock Q8_0 1.026x the whole
# head's with the auto tree (median of the rounds' ratios), 1.055x with --tree-nodes 1 in another
# four; 32,768 ids there 1.04x (1.4% fewer tokens per verify)
DRAFT_VOCAB = 65536


class DraftVocab:
    """The drafter's vocabulary. A model's output head is a large share of a drafting pass's bytes
    (Qwen2.5-Coder-1.5B: the exact Q6_K head is 191 MB of the 670 MB a pass reads); with a draft
    vocabulary the native drafter computes the head for token ids [0, rows) and [tail, n_vocab) (the
    control tokens) alone and gives the others probability 0. What is emitted never changes (the
    verifier decides; speculative sampling stays exact for any draft distribution): a token outside
    costs a rejected draft. So it watches the text: once more than MAX_OUTSIDE of the last WINDOW
    tokens (prompt and output) fall outside, drafting takes the whole head again, until they no
    longer do."""

    WINDOW = 64
    MAX_OUTSIDE = 0.05

    def __init__(self, sm: "SplitModel", setting: str | int):
        self._res = sm.residual
        self.rows = self.tail = 0  # rows 0: the whole head, always
        self.active = False
        self._recent: collections.deque[bool] = collections.deque(maxlen=self.WINDOW)
        if setting == "all":
            return
        exact_head = "output.weight" in self._res.exact_tensors()
        if not (sm.fast_drafter and exact_head):
            if setting != "auto":
                raise InvalidOptionError(
                    f"--draft-vocab {setting}: needs the native drafter (CPU-only runs) and an output head the split "
                    f"kept exact (here: drafter {sm.drafter}, head {'exact' if exact_head else 'split or tied'}); use "
                    "--draft-vocab all or auto")
            return
        tail = sm.model.special_tail()
        rows = DRAFT_VOCAB if setting == "auto" else int(setting)
        if rows >= tail or (setting == "auto" and tail < 2 * rows):
            return
        self.rows, self.tail = rows, tail
        self._set(True)

    def _set(self, on: bool) -> None:
        self._res.set_draft_vocab(self.rows if on else 0, self.tail if on else 0)
        self.active = on

    def note(self, tokens) -> None:
        """Tokens of the text (a prompt, then what is emitted): on or off by the share outside."""
        if self.rows == 0:
            return
        for t in tokens[-self.WINDOW:]:
            self._recent.append(self.rows <= t < self.tail)
        on = sum(self._recent) <= self.MAX_OUTSIDE * len(self._recent)
        if on != self.active:
            self._set(on)


class SplitModel:
    """base.gguf in llama.cpp + residual.gguf in the native library, one context.

    Use ``with m.verifying(): m.ctx.decode(...)`` for verifier passes and ``with m.drafting():``
    for base-only passes. ``close()`` frees the context, then the model, then the residual (the
    callback must not outlive what it points to).
    """

    def __init__(self, model_dir: str | os.PathLike[str], *, n_ctx: int = 2048, n_batch: int = 512,
                 n_ubatch: int | None = None, n_seq_max: int = 1, n_threads: int | None = None,
                 n_gpu_layers: int | None = None, precision: str = "auto", act_bits: str = "auto", verbose: bool = False,
                 check_fingerprint: bool = True, flash_attn: bool | None = None, kv_type: str = "f16",
                 fast_drafter: bool | None = None, reserve: int | None = None, rpc=None,
                 rpc_timeout: float = rpc_mod.DEFAULT_TIMEOUT_S, overlap: bool = True, overlap_at: str = "inputs",
                 batch_invariant: bool = True,
                 draft_vocab: str | int = "auto", compensation: str = "auto"):
        """``rpc``: ``HOST:PORT[,...]`` of llama.cpp RPC servers: the base's ``n_gpu_layers`` layers
        (None: all) live there, the residual here, products are completed in add mode (``overlap``:
        R . x beside the device's W2 . x, started at each product's input, or with ``overlap_at``
        "products" at the input's first product: one graph stop per product instead of two).

        ``batch_invariant`` (default): a verified row's logits do not depend on the rest of its batch
        (of any number of rows), so speculative greedy output is plain decoding's at any tree size
        and a prompt decoded in one batch gives generation's logits: one kernel family for every
        pass, the products without residual (output head) in the library's kernels, and, on the CPU
        with an f16/f32 KV cache, llama.cpp's plain attention (``flash_attn`` None becomes False)
        with its two products of the KV cache in the library's kernels too: ggml's switch from a
        dot product to a tiled GEMM at 2 rows, its flash attention to a tiled path at 64.

        ``act_bits``: the verifier's activations in the 16-bit integer kernel families, "16", "8"
        (the high digit alone where a block has no outlier) or "auto" (:meth:`Residual.set_act_bits`).

        ``draft_vocab``: the drafter's vocabulary (:class:`DraftVocab`): "all" (the whole output
        head), a number of token ids N (drafting passes compute the head for ids below N and the
        control tokens at the vocabulary's end alone; the native drafter only) or "auto" (DRAFT_VOCAB
        ids where the head is an exact CPU tensor over twice as many ids).

        ``compensation`` (with the base on a device): the device's rounding of the activations before
        ``W2 . x`` corrected by a second product on the device, ``W2 . (x - round(x))``
        (native/compensate.c): "auto" (by the device's own rule where one is written: RPC servers' CPU
        backend, CUDA, Metal), "off", or a rule (:data:`rpc_mod.COMPENSATIONS`). ``self.compensation``:
        the rule in use, "off" for none."""
        self.dir = Path(model_dir)
        check_act_bits(act_bits)  # before anything loads
        draft_vocab = check_draft_vocab(draft_vocab)
        self._lock = threading.Lock()
        # KV cells beyond the n_ctx positions (see Context): by default one per sequence, which holds
        # the rows a tree that fits the sequences puts in the cache besides the text's positions
        if reserve is None:
            reserve = n_seq_max if n_seq_max > 1 else 0
        self._ctx_kw = {"n_threads": n_threads, "flash_attn": flash_attn, "kv_type": kv_type}
        self.rpc = None
        self.n_verify_passes = 0  # verifying() blocks entered: one per verify pass, one for a prompt
        if rpc is not None and rpc != "" and rpc != []:
            endpoints = rpc_mod.parse_endpoints(rpc if isinstance(rpc, str) else ",".join(rpc))
            rpc_mod.check_timeout(rpc_timeout)
            if n_gpu_layers == 0:
                raise InvalidOptionError("--rpc with --n-gpu-layers 0 puts nothing on the RPC device; leave -ngl out "
                                         "(all layers) or give how many")
        if n_gpu_layers is None:
            n_gpu_layers = 999 if rpc else 0
        if n_gpu_layers < 0:
            raise InvalidOptionError(f"--n-gpu-layers: {n_gpu_layers} is negative")
        if n_gpu_layers > 0 and not rpc and rpc_mod.gpu_count() == 0:
            raise InvalidOptionError(
                f"--n-gpu-layers {n_gpu_layers}: llama.cpp sees no GPU here (this llama-cpp-python was built for the "
                "CPU: see the README on building it for CUDA, Vulkan or Metal); use --rpc HOST:PORT for a remote device")
        self.n_gpu_layers = n_gpu_layers
        rpc_mod.check_compensation(compensation)
        if flash_attn is None and batch_invariant and n_gpu_layers == 0 and kv_type in ("f16", "f32"):
            # llama.cpp's plain attention, whose two products of the KV cache the library computes
            # (batch-invariant at any number of rows); its CPU flash attention changes path at 64
            # query rows, and for one row from 512 cached positions. (A quantized V cache needs
            # flash attention.)
            self._ctx_kw["flash_attn"] = False
        self.residual = Residual(model_dir, check_fingerprint=check_fingerprint)
        try:
            # this machine's measured kernel policy (bitsplit doctor's profile), before any product:
            # the generation's family is chosen from it (native.policy.apply_measured)
            self.policy = policy.apply_measured()
            self.residual.batch_invariant = batch_invariant
            self.residual.set_precision(precision)
            self.residual.set_act_bits(act_bits)
            self.residual.set_overlap(overlap, overlap_at)
            if rpc is not None and rpc != "" and rpc != []:
                self.rpc = rpc_mod.Devices(endpoints, rpc_timeout)
            self.model = Model(self.residual.base_path, n_gpu_layers=n_gpu_layers, verbose=verbose, devices=self.rpc)
            if self.rpc is not None:
                self.rpc.attach()
            try:
                self.ctx = self._context(n_ctx=n_ctx, n_batch=n_batch, n_ubatch=n_ubatch, n_seq_max=n_seq_max,
                                         reserve=reserve)
            except BaseException:
                self.model.close()
                raise
            self.residual.set_threads(self.ctx.n_threads)
            rule = rpc_mod.compensation_rule(compensation, self.rpc is not None, n_gpu_layers)
            self.residual.set_compensation(rule)
            self.compensation = "off" if rule == "host" else rule
            # where the native policy has a drafting family (AVX512-VNNI today), the base's own
            # products go faster through it than through ggml's K-quant kernels on the CPU; with GPU
            # layers, or without such a family, the drafter stays stock
            draft_family = policy.draft_kernel()
            if fast_drafter is None:
                fast_drafter = n_gpu_layers == 0 and draft_family is not None
            if fast_drafter and draft_family is None:
                raise UnsupportedModelError(
                    "--drafter native: this CPU has no native drafting kernel (it needs AVX2 or AVX512-VNNI; kernel "
                    f"families here: {', '.join(policy.families())}); use --drafter llama.cpp or auto")
            self.fast_drafter = bool(fast_drafter)
            # who computes the drafter's products: the native family, or llama.cpp's own kernels
            self.drafter = draft_family if self.fast_drafter else "llama.cpp"
            self.residual.set_draft_kernel(self.fast_drafter)
            self.draft_vocab = DraftVocab(self, draft_vocab)
        except BaseException:
            self.close()  # the context and the model too, where they were made
            raise

    @property
    def residual_alone(self) -> bool:
        """Whether the verifier's residual products are R . x alone (add mode: every layer of the base
        on a device, which computes W2 . x), the kernel policy's other case beside W2 + R."""
        return self.n_gpu_layers >= self.model.n_layer

    def _context(self, **kw) -> Context:
        """A llama.cpp context over this model whose eval callback is this residual.

        Without llama.cpp's op offload: with it, a GPU build computes the large batches (32+ rows:
        prompts, big trees) of the layers left in RAM on the GPU, from copies of their base weights
        sent over PCIe each time, so those layers would take two code paths by batch size (no batch
        invariance) and read their base twice; the residual is read here anyway. (Seen on an H200,
        all layers in RAM: the copies' names hid the weights from the callback, and the verifier
        scored KL 0.175, the base alone's 0.173, instead of 3e-6; the callback knows those names now.)"""
        return Context(self.model, cb_eval=native.callback_address(), cb_eval_user_data=self.residual.address,
                       op_offload=False, **self._ctx_kw, **kw)

    @contextlib.contextmanager
    def own_context(self, *, n_ctx: int, n_batch: int, n_seq_max: int, reserve: int | None = None):
        """Context manager: a view of this split model (the same weights, residual and lock) with a
        llama.cpp context of its own, freed on exit; this model's context and cache are untouched.
        For measurements that must not depend on, or disturb, the user's context."""
        view = copy.copy(self)  # shares model, residual, lock and settings; never closed itself
        view.ctx = self._context(n_ctx=n_ctx, n_batch=n_batch, n_seq_max=n_seq_max,
                                 reserve=n_seq_max if reserve is None else reserve)
        try:
            yield view
        finally:
            view.ctx.close()

    def close(self) -> None:
        residual = getattr(self, "residual", None)
        if residual is not None:  # compensation's device buffers go before the model's
            residual.release_devices(lost=self.rpc is not None and self.rpc.dead() is not None)
        if self.rpc is not None and self.rpc.dead() is not None:
            # freeing the context and the model would talk to the lost server, and llama.cpp's RPC
            # client aborts the process when it cannot: let their memory go with the process instead
            for name in ("ctx", "model"):
                obj = getattr(self, name, None)
                if obj is not None:
                    obj.ptr = None
        for name in ("ctx", "model", "residual"):
            obj = getattr(self, name, None)
            if obj is not None:
                obj.close()
        if self.rpc is not None:
            self.rpc.detach()

    def __enter__(self) -> "SplitModel":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @contextlib.contextmanager
    def _role(self, verify: bool):
        if not self._lock.acquire(blocking=False):
            raise BusyError(f"{self.dir}: the model is in use by another call")
        try:
            if self.rpc is not None:
                self.rpc.check_alive()
            self.n_verify_passes += verify
            self.residual.enabled = verify
            yield self.ctx
            if verify:
                self.residual.raise_pending_error()
        finally:
            self.residual.enabled = False
            self._lock.release()

    def verifying(self):
        """Context manager: decodes inside run as the verifier (base + residual)."""
        return self._role(True)

    def drafting(self):
        """Context manager: decodes inside run on the base alone."""
        return self._role(False)
