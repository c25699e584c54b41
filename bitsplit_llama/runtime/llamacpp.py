"""Owning wrappers over llama-cpp-python's low-level API: a model, a context, a batch.

The high-level ``llama_cpp.Llama`` offers no way to install an eval callback on the context it
creates, so the verifier's context is made here from the raw functions (``llama_init_from_model``
with ``cb_eval``/``cb_eval_user_data`` set in *this* context's parameters: nothing process-wide is
patched). The same wrappers load plain models (references, stock comparisons) so every model in
one measurement is loaded the same way.

Models are loaded with llama.cpp's extra buffer types off (``use_extra_bufts=False``): on AMX CPUs
llama-cpp-python 0.3.36 built by GCC 12 crashes in those kernels (see README), and the weights then
stay in ggml's standard layout, shared with the page cache through mmap.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path
from typing import Sequence

import numpy as np

from ..errors import ContextLimitError, InputError, InvalidOptionError, NativeError, UnsupportedModelError


def _llama():
    import llama_cpp

    return llama_cpp


def set_verbose(verbose: bool) -> None:
    """llama.cpp's log, shown or not, the way llama_cpp.Llama(verbose=...) does it."""
    try:
        from llama_cpp._logger import set_verbose as sv

        sv(verbose)
    except ImportError:
        pass


def default_threads() -> int:
    from ..formats._ggml import cpu_count

    return cpu_count()


class Model:
    """A llama.cpp model (llama_model *), freed on close()."""

    def __init__(self, path: str | os.PathLike[str], *, n_gpu_layers: int = 0, use_mmap: bool = True,
                 verbose: bool = False, devices=None):
        """``devices``: an :class:`rpc.Devices` (the offloaded layers go there), or None (llama.cpp's own)."""
        ll = _llama()
        self.path = Path(path)
        if not self.path.is_file():
            raise InputError(f"{self.path}: model file not found")
        set_verbose(verbose)
        ll.llama_backend_init()
        p = ll.llama_model_default_params()
        p.n_gpu_layers = int(n_gpu_layers)
        p.use_extra_bufts = False
        self.devices = devices  # kept alive while the model is
        if devices is not None:
            p.devices = devices.pointer
        if not use_mmap:
            p.load_mode = ll.LLAMA_LOAD_MODE_NONE
        self.params = p
        self.ptr = ll.llama_model_load_from_file(str(self.path).encode(), p)
        if not self.ptr:
            raise UnsupportedModelError(f"{self.path}: llama.cpp could not load the model (run with verbose=True for its log)")
        self.vocab = ll.llama_model_get_vocab(self.ptr)
        self.n_vocab = int(ll.llama_vocab_n_tokens(self.vocab))
        self.n_ctx_train = int(ll.llama_model_n_ctx_train(self.ptr))
        self.n_layer = int(ll.llama_model_n_layer(self.ptr))

    def close(self) -> None:
        if getattr(self, "ptr", None):
            _llama().llama_model_free(self.ptr)
            self.ptr = None

    def __del__(self):  # noqa: D105 - safety net; close() is the contract
        try:
            self.close()
        except Exception:
            pass

    # -- vocabulary -----------------------------------------------------------------------------
    def tokenize(self, text: str | bytes, add_special: bool = True, parse_special: bool = False) -> list[int]:
        ll = _llama()
        data = text.encode("utf-8") if isinstance(text, str) else text
        n_max = len(data) + 16
        buf = (ll.llama_token * n_max)()
        n = ll.llama_tokenize(self.vocab, data, len(data), buf, n_max, add_special, parse_special)
        if n < 0:
            n_max = -n
            buf = (ll.llama_token * n_max)()
            n = ll.llama_tokenize(self.vocab, data, len(data), buf, n_max, add_special, parse_special)
        if n < 0:
            raise InputError("llama.cpp could not tokenize the text")
        return list(buf[:n])

    def token_to_piece(self, token: int, special: bool = False) -> bytes:
        ll = _llama()
        buf = ctypes.create_string_buffer(64)
        n = ll.llama_token_to_piece(self.vocab, token, buf, len(buf), 0, special)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = ll.llama_token_to_piece(self.vocab, token, buf, len(buf), 0, special)
        return buf.raw[:max(n, 0)]

    def detokenize(self, tokens: Sequence[int], special: bool = False) -> bytes:
        return b"".join(self.token_to_piece(t, special) for t in tokens)

    def special_tail(self) -> int:
        """The first token id of the vocabulary's tail of tokens that are not normal text (control,
        user-defined, unused: BPE vocabularies put them last); n_vocab if the last token is normal."""
        ll = _llama()
        normal = 1 << 2  # LLAMA_TOKEN_ATTR_NORMAL
        t = self.n_vocab
        while t > 0 and not (int(ll.llama_vocab_get_attr(self.vocab, t - 1)) & normal):
            t -= 1
        return t

    def is_eog(self, token: int) -> bool:
        return bool(_llama().llama_vocab_is_eog(self.vocab, token))

    @property
    def bos(self) -> int:
        return int(_llama().llama_vocab_bos(self.vocab))

    @property
    def add_bos(self) -> bool:
        """Whether the vocabulary asks for a BOS token in front of a text."""
        return bool(_llama().llama_vocab_get_add_bos(self.vocab))


class Context:
    """A llama.cpp context (llama_context *) over a Model, with an optional eval callback.

    ``n_ctx`` is the number of positions a sequence may use (the user's ``--n-ctx``); ``reserve``
    more KV cells are allocated for rows that are not positions of the text: the speculative
    engine's drafted lanes, verified tree rows, rejected rows it parks and its dummy row. With them,
    a generation can use every one of its ``n_ctx`` positions. ``n_cells`` is the cache's size as
    llama.cpp made it (it rounds up to a multiple of 256).
    """

    def __init__(self, model: Model, *, n_ctx: int = 2048, n_batch: int = 512, n_ubatch: int | None = None,
                 n_seq_max: int = 1, n_threads: int | None = None, cb_eval: int | None = None,
                 cb_eval_user_data: int | None = None, kv_unified: bool = True, flash_attn: bool | None = None,
                 kv_type: str = "f16", reserve: int = 0, op_offload: bool | None = None):
        ll = _llama()
        if n_ctx < 8:
            raise InvalidOptionError(f"--n-ctx: {n_ctx} is too small (at least 8)")
        if n_threads is not None and n_threads < 1:
            raise InvalidOptionError(f"--threads: {n_threads} is not a positive integer")
        if reserve < 0:
            raise InvalidOptionError(f"reserve: {reserve} is negative")
        # llama.cpp caps the batch at the cache size and aborts the process (an assertion) when a
        # context has more sequences than batch rows: refuse that here, as an error
        if n_seq_max > min(n_ctx + reserve, n_batch):
            raise InvalidOptionError(f"a context of {n_ctx} positions (+{reserve} reserved cells) and n_batch "
                                     f"{n_batch} cannot hold {n_seq_max} sequences")
        self.model = model
        p = ll.llama_context_default_params()
        p.n_ctx = int(n_ctx + reserve)
        p.n_batch = int(n_batch)
        p.n_ubatch = int(n_ubatch or n_batch)
        p.n_seq_max = int(n_seq_max)
        threads = n_threads or default_threads()
        p.n_threads = threads
        p.n_threads_batch = threads
        p.kv_unified = bool(kv_unified)
        p.no_perf = True
        if flash_attn is not None:
            p.flash_attn_type = 1 if flash_attn else 0
        if op_offload is not None:
            p.op_offload = bool(op_offload)
        kv_types = {"f16": 1, "f32": 0, "q8_0": 8}
        if kv_type not in kv_types:
            raise InvalidOptionError(f"kv_type '{kv_type}' unknown (expected one of: {', '.join(kv_types)})")
        p.type_k = p.type_v = kv_types[kv_type]
        if cb_eval is not None:
            p.cb_eval = ctypes.cast(ctypes.c_void_p(cb_eval), ll.ggml_backend_sched_eval_callback)
            p.cb_eval_user_data = ctypes.c_void_p(cb_eval_user_data)
        self._params = p  # keep the callback object alive as long as the context
        self.ptr = ll.llama_init_from_model(model.ptr, p)
        if not self.ptr:
            raise NativeError(f"{model.path}: llama.cpp could not create a context (n_ctx={n_ctx})")
        # llama.cpp may round the cache up (to 256 cells); the limit users asked for is what counts
        self.n_cells = int(ll.llama_n_ctx(self.ptr))
        self.n_ctx = min(int(n_ctx), self.n_cells - reserve)
        self.n_batch = int(ll.llama_n_batch(self.ptr))
        self.n_seq_max = int(ll.llama_n_seq_max(self.ptr))
        self.n_threads = threads
        self.mem = ll.llama_get_memory(self.ptr)
        self._batch = None
        self._batch_cap = 0
        self._batch_seq = 0

    def close(self) -> None:
        ll = _llama()
        if self._batch is not None:
            ll.llama_batch_free(self._batch)
            self._batch = None
        if getattr(self, "ptr", None):
            ll.llama_free(self.ptr)
            self.ptr = None

    def __del__(self):  # noqa: D105
        try:
            self.close()
        except Exception:
            pass

    # -- KV cache -------------------------------------------------------------------------------
    def clear(self) -> None:
        _llama().llama_memory_clear(self.mem, True)

    def seq_rm(self, seq: int, p0: int, p1: int = -1) -> bool:
        return bool(_llama().llama_memory_seq_rm(self.mem, seq, p0, p1))

    def seq_cp(self, src: int, dst: int, p0: int = -1, p1: int = -1) -> None:
        _llama().llama_memory_seq_cp(self.mem, src, dst, p0, p1)

    def seq_pos_max(self, seq: int = 0) -> int:
        return int(_llama().llama_memory_seq_pos_max(self.mem, seq))

    # -- decoding -------------------------------------------------------------------------------
    def _ensure_batch(self, n: int, n_seq: int):
        ll = _llama()
        if self._batch is None or n > self._batch_cap or n_seq > self._batch_seq:
            if self._batch is not None:
                ll.llama_batch_free(self._batch)
            self._batch_cap = max(n, self._batch_cap, 16)
            self._batch_seq = max(n_seq, self._batch_seq, 1)
            self._batch = ll.llama_batch_init(self._batch_cap, 0, self._batch_seq)
        return self._batch

    def decode(self, tokens: Sequence[int], positions: Sequence[int], seq_ids: Sequence[Sequence[int]] | None = None,
               logits: Sequence[bool] | bool = True) -> None:
        """One llama_decode. ``seq_ids[i]`` lists the sequences token i belongs to (default: [0]);
        ``logits`` marks the tokens whose logits are wanted (True: all, False: none)."""
        ll = _llama()
        n = len(tokens)
        if n == 0:
            return
        if n > self.n_batch:
            raise InvalidOptionError(f"batch of {n} tokens exceeds n_batch={self.n_batch}")
        n_seq = max((len(s) for s in seq_ids), default=1) if seq_ids is not None else 1
        b = self._ensure_batch(n, n_seq)
        b.n_tokens = n
        flag = logits if isinstance(logits, bool) else None  # True: every row, False: none
        for i in range(n):
            b.token[i] = int(tokens[i])
            b.pos[i] = int(positions[i])
            sids = seq_ids[i] if seq_ids is not None else (0,)
            b.n_seq_id[i] = len(sids)
            for j, s in enumerate(sids):
                b.seq_id[i][j] = int(s)
            b.logits[i] = flag if flag is not None else bool(logits[i])
        rc = ll.llama_decode(self.ptr, b)
        if rc != 0:
            if rc == 1:
                raise ContextLimitError(
                    f"no room in the context for {n} more tokens (n_ctx={self.n_ctx}); use a larger --n-ctx"
                )
            raise NativeError(f"llama_decode failed with status {rc}")
        # with a device backend (GPU, RPC) llama_decode returns before the graph has run, and the
        # first read of the logits waits for it: wait here, so that a pass's time is its decode's
        # (the engine's time split) and not the Python that reads its logits. Nothing runs between
        # the two that could overlap the device's work.
        ll.llama_synchronize(self.ptr)

    def logits(self, n_rows: int) -> np.ndarray:
        """The last decode's logits as an (n_rows, n_vocab) float32 view (valid until the next decode)."""
        ll = _llama()
        ptr = ll.llama_get_logits(self.ptr)
        return np.ctypeslib.as_array(ptr, shape=(n_rows, self.model.n_vocab))

    def logits_ith(self, i: int) -> np.ndarray:
        ll = _llama()
        ptr = ll.llama_get_logits_ith(self.ptr, i)
        if not ptr:
            raise NativeError(f"no logits for batch row {i}")
        return np.ctypeslib.as_array(ptr, shape=(self.model.n_vocab,))
