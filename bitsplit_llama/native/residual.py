"""An owning object over the native residual context: residual.gguf mapped and checked against
its base, ready to be installed as a llama.cpp eval callback."""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .. import native
from ..errors import GGUFFormatError, InputError, InvalidOptionError, MismatchError, NativeError, UnsupportedModelError
from ..formats.gguf_file import GGUFFile
from ..formats.modeldir import check_pair, split_paths

PRECISIONS = {"auto": 0, "f32": 1, "bf16": 2}
# the verifier's activations in the 16-bit integer families (bitsplit.h's enum bitsplit_act_bits)
ACT_BITS = {"auto": 0, "16": 1, "8": 2}
MODES = {"auto": 0, "add": 1}
# where add mode's R . x starts beside the device (bitsplit.h's BITSPLIT_OVERLAP_*)
OVERLAP_AT = {"inputs": 1, "products": 2}
# emulated device numerics (bitsplit.h's enum bitsplit_numerics; native/numerics.c gives each rule)
NUMERICS = {"host": 0, "cpu": 1, "cuda": 2, "cuda-mmvq": 3, "metal": 4, "float": 5}
MAX_OUTLIERS = 64  # bitsplit.h's BITSPLIT_MAX_OUTLIERS

_STATUS_ERRORS = {1: InputError, 2: GGUFFormatError, 3: MismatchError, 4: UnsupportedModelError, 5: NativeError,
                  6: InvalidOptionError, 7: NativeError}


@dataclass
class Counters:
    n_products: int
    n_add_products: int
    n_get_rows: int
    n_columns: int
    bytes_residual: int
    bytes_base: int
    seconds_inside: float
    n_errors: int
    n_draft_products: int = 0
    seconds_draft: float = 0.0
    bytes_from_device: int = 0   # add mode: activations and W2 . x read from device buffers
    bytes_to_device: int = 0     # add mode: corrected results written back
    seconds_transfer: float = 0.0
    n_overlapped: int = 0        # add-mode products whose R . x ran while the device computed W2 . x
    seconds_wait: float = 0.0    # time the graph waited for those after the device's part
    n_stops: int = 0             # nodes the graph stopped after for the library (a device sync each)
    n_exact_products: int = 0    # base weights without residual computed by the library (batch invariance)
    n_attn_products: int = 0     # attention's KV-cache products (KQ, KQV) computed by the library (batch invariance)
    seconds_attn: float = 0.0
    n_softmax: int = 0           # attention's softmaxes computed by the library (batch invariance)
    bytes_outlier_base: int = 0  # emulated numerics with outlier channels: base bytes the host would read for them
    n_compensated: int = 0       # products whose device rounding a second product on the device corrected
    seconds_compensate: float = 0.0  # wall time of those second products (error, transfers, the device's graph)


def _cpu_device() -> int:
    """llama.cpp's CPU device (a ggml_backend_dev_t), from libggml, which the native library does not
    link: compensation computes with it where weights are in host memory; 0 where it is not found."""
    import ctypes

    import llama_cpp

    llama_cpp.llama_backend_init()
    d = Path(llama_cpp.__file__).parent / "lib"
    cands = sorted(d.glob("libggml.so*")) + sorted(d.glob("libggml.dylib")) + sorted(d.glob("ggml.dll"))
    if not cands:
        return 0
    g = ctypes.CDLL(str(cands[0]))
    g.ggml_backend_dev_by_type.restype = ctypes.c_void_p
    g.ggml_backend_dev_by_type.argtypes = [ctypes.c_int]
    return g.ggml_backend_dev_by_type(0) or 0  # GGML_BACKEND_DEVICE_TYPE_CPU


def check_numerics(value: str, option: str = "--device-numerics") -> str:
    """``value`` as a key of NUMERICS, or one message naming it and what was expected."""
    if value not in NUMERICS:
        raise InvalidOptionError(f"{option}: '{value}' unknown (expected one of: {', '.join(NUMERICS)})")
    return value


def check_outliers(value: int, option: str = "--outlier-channels") -> int:
    """``value`` as a number of exact outlier channels per row (0 to MAX_OUTLIERS), or one message."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_OUTLIERS:
        raise InvalidOptionError(f"{option}: {value!r} is not a number of channels from 0 to {MAX_OUTLIERS}")
    return value


def round_activations(numerics: str, weight_type: int, x, outliers: int = 0):
    """``x`` (rows x K float32, a pass's activations) rounded as the backend ``numerics`` rounds them
    before a product with weights of ggml type ``weight_type`` (native/numerics.c), each row's
    ``outliers`` channels of largest magnitude kept exact: a new array."""
    import numpy as np

    from . import load

    ffi, lib = load()
    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.ndim != 2:
        raise InvalidOptionError(f"round_activations: expected rows x K, got shape {x.shape}")
    out = np.empty_like(x)
    st = lib.bitsplit_round_activations(NUMERICS[check_numerics(numerics, "numerics")], int(weight_type),
                                        x.shape[1], x.shape[0], int(outliers), ffi.from_buffer("float[]", x),
                                        ffi.from_buffer("float[]", out))
    if st == 4:
        raise UnsupportedModelError(f"numerics '{numerics}' have no rounding rule for ggml type {weight_type} at "
                                    f"width {x.shape[1]}")
    if st != 0:
        raise InvalidOptionError(f"round_activations: ggml type {weight_type} unknown, or activations of shape "
                                 f"{x.shape} refused (status {st})")
    return out


def check_act_bits(value: str | int) -> str:
    """``value`` as a key of ACT_BITS, or one message naming it and what was expected."""
    key = str(value)
    if key not in ACT_BITS:
        raise InvalidOptionError(f"--act-bits: '{value}' unknown (expected one of: {', '.join(ACT_BITS)})")
    return key


def check_draft_vocab(value: str | int) -> str | int:
    """``value`` as "auto", "all" or a number of token ids >= 1, or one message naming it and what
    was expected."""
    key = str(value).strip().lower()
    if key in ("auto", "all"):
        return key
    try:
        n = int(key)
    except ValueError:
        n = 0
    if n < 1:
        raise InvalidOptionError(f"--draft-vocab: '{value}' unknown (expected auto, all, or a number of token ids >= 1)")
    return n


def _raise(status: int, message: str) -> None:
    raise _STATUS_ERRORS.get(status, NativeError)(message)


class Residual:
    """residual.gguf + base.gguf of a split model, validated, in a native context.

    Validation happens twice on purpose: in Python (format, fingerprint of the base, names,
    shapes, types, with messages naming the file and tensor) and again in C before the library
    touches any tensor memory.
    """

    def __init__(self, model_dir: str | os.PathLike[str] | None = None, *, base: str | os.PathLike[str] | None = None,
                 residual: str | os.PathLike[str] | None = None, check_fingerprint: bool = True):
        if model_dir is not None:
            base_p, res_p = split_paths(model_dir)
        else:
            if base is None or residual is None:
                raise InvalidOptionError("Residual needs a model directory, or both base= and residual=")
            base_p, res_p = Path(base), Path(residual)
        self.base_path, self.residual_path = base_p, res_p
        self.numerics, self.outliers = "host", 0  # set_numerics
        self.compensation = "host"  # set_compensation
        self.device_add = True  # set_device_add (the native default)
        with GGUFFile(base_p, role="base") as b, GGUFFile(res_p, role="residual") as r:
            check_pair(b, r, check_fingerprint=check_fingerprint)
            self.architecture = b.architecture
        self._ffi, self._lib = native.load()
        out = self._ffi.new("bitsplit_ctx **")
        err = self._ffi.new("char[]", 1024)
        st = self._lib.bitsplit_ctx_load(str(res_p).encode(), str(base_p).encode(), out, err, 1024)
        if st != 0:
            _raise(st, self._ffi.string(err).decode(errors="replace"))
        self._ptr = out[0]

    # -- ownership ---------------------------------------------------------------------------
    def close(self) -> None:
        if getattr(self, "_ptr", None) is not None:
            self._lib.bitsplit_ctx_free(self._ptr)
            self._ptr = None

    def __enter__(self) -> "Residual":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self):  # noqa: D105
        try:
            self.close()
        except Exception:
            pass

    @property
    def ptr(self):
        if self._ptr is None:
            raise NativeError("the residual context is closed")
        return self._ptr

    @property
    def address(self) -> int:
        """The context's address, for llama_context_params.cb_eval_user_data."""
        return int(self._ffi.cast("uintptr_t", self.ptr))

    # -- switches -----------------------------------------------------------------------------
    @property
    def enabled(self) -> bool:
        return bool(self._lib.bitsplit_ctx_get_enabled(self.ptr))

    @enabled.setter
    def enabled(self, on: bool) -> None:
        self._lib.bitsplit_ctx_set_enabled(self.ptr, bool(on))

    def set_draft_vocab(self, rows: int, tail: int) -> None:
        """With the draft kernel on, drafting passes compute the output head for token ids [0, rows) and
        [tail, n_vocab) alone (the others -inf); rows 0: the whole head."""
        if self._lib.bitsplit_ctx_set_draft_vocab(self.ptr, int(rows), int(tail)) != 0:
            raise InvalidOptionError(f"draft vocabulary: {rows} rows with the tail from {tail} (expected 0 <= rows <= tail)")

    def set_draft_kernel(self, on: bool) -> None:
        """With the residual off, compute the base's products in the native integer kernel too (CPU
        nodes): a faster drafter than ggml's K-quant kernels on CPUs."""
        self._lib.bitsplit_ctx_set_draft_kernel(self.ptr, bool(on))

    def set_precision(self, precision: str) -> None:
        if precision not in PRECISIONS:
            raise InvalidOptionError(f"precision '{precision}' unknown (expected one of: {', '.join(PRECISIONS)})")
        self._lib.bitsplit_ctx_set_precision(self.ptr, PRECISIONS[precision])

    def set_act_bits(self, act_bits: str | int) -> None:
        """The verifier's activations in the 16-bit integer families: ``"16"`` (two base-255 digits in
        every block), ``"8"`` (the high digit alone for W2 + R in blocks without an outlier: half the
        multiplies) or ``"auto"`` (8 with a Q6_K residual on x86 CPUs without AVX-512, else 16)."""
        self._lib.bitsplit_ctx_set_act_bits(self.ptr, ACT_BITS[check_act_bits(act_bits)])

    def act_bits_for(self, res_type: int) -> int:
        """The verifier's activation bits (8 or 16) for products with a residual of ggml type ``res_type``."""
        return int(self._lib.bitsplit_ctx_act_bits(self.ptr, int(res_type)))

    @property
    def act_bits(self) -> int | dict[str, int]:
        """The verifier's activation bits here (8 or 16, as the setting resolves on this CPU under
        ``BITSPLIT_MAX_ISA``); a dict by residual type where a split's types resolve differently."""
        from ..formats.gguf_file import type_name

        bits = {type_name(rt).lower(): self.act_bits_for(rt) for *_, rt in self.tensors()}
        values = set(bits.values())
        return values.pop() if len(values) == 1 else dict(sorted(bits.items()))

    def set_mode(self, mode: str) -> None:
        if mode not in MODES:
            raise InvalidOptionError(f"mode '{mode}' unknown (expected one of: {', '.join(MODES)})")
        self._lib.bitsplit_ctx_set_mode(self.ptr, MODES[mode])

    def set_numerics(self, numerics: str, outliers: int = 0) -> None:
        """Emulate a device's activation rounding before W2 . x (``NUMERICS``; "host": none), with R . x
        as add mode computes it: for scoring locally the verifier a device would give (bitsplit eval
        --device-numerics). ``outliers``: each row's channels of largest magnitude left out of the
        device's rounding and taken exactly (a correction measured before it is built; the base bytes
        it would read are counted in ``bytes_outlier_base``). Takes effect from the next pass; base on
        the host only."""
        outliers = check_outliers(outliers)
        if self._lib.bitsplit_ctx_set_numerics(self.ptr, NUMERICS[check_numerics(numerics)], outliers) != 0:
            raise InvalidOptionError("outlier channels do not combine with compensation of the device's rounding")
        self.numerics, self.outliers = numerics, outliers

    def set_compensation(self, numerics: str) -> None:
        """Correct a device's activation rounding with a second product of the base: ``numerics`` names
        the rule the device rounds by ("host": off). The host computes the rounding's error
        ``e = x - round(x)``; the device holding W2 computes ``W2 . e`` (add mode), or it is emulated
        here under :meth:`set_numerics`, and it is added with ``R . x``. Takes effect from the next
        pass; not with outlier channels."""
        cpu = self._ffi.cast("void *", _cpu_device() if numerics != "host" else 0)
        if self._lib.bitsplit_ctx_set_compensation(self.ptr, NUMERICS[check_numerics(numerics, "compensation")],
                                                   cpu) != 0:
            raise InvalidOptionError("compensation of the device's rounding does not combine with outlier channels")
        self.compensation = numerics

    def set_device_add(self, on: bool) -> None:
        """Add mode's sum made on the device (R . x up, added in place by a graph there) or on the host
        (W2 . x down, the sum back up): bitsplit_ctx_set_device_add."""
        self._lib.bitsplit_ctx_set_device_add(self.ptr, bool(on))
        self.device_add = bool(on)

    def release_devices(self, lost: bool = False) -> None:
        """Free what compensation opened on devices (its backends and buffers) before the model holding
        the weights goes; ``lost``: the device is gone, let them go without a word to it."""
        if getattr(self, "_ptr", None) is not None:
            self._lib.bitsplit_ctx_release_devices(self._ptr, bool(lost))

    def set_exact_channels(self, name: str, channels) -> None:
        """Under emulated numerics, a fixed set of exact channels for weight ``name`` (taken by every
        row instead of its own largest; empty clears it): see :meth:`set_numerics`."""
        ch = [int(c) for c in channels]
        if len(ch) > MAX_OUTLIERS:
            raise InvalidOptionError(f"{name}: {len(ch)} exact channels, at most {MAX_OUTLIERS}")
        arr = self._ffi.new("int32_t[]", ch or [0])
        if self._lib.bitsplit_ctx_set_exact_channels(self.ptr, name.encode(), len(ch), arr) != 0:
            raise InvalidOptionError(f"exact channels for '{name}': no such residual weight, or a channel outside its "
                                     f"row width ({ch[:8]}...)")

    def set_overlap(self, on: bool, at: str = "inputs") -> None:
        """Add mode: start R . x beside the device's W2 . x (default on): when its input is computed
        (``at`` "inputs", the graph stopping there too), or at the input's first product (``at``
        "products": one stop per product; the input's later products beside the device's)."""
        if at not in OVERLAP_AT:
            raise InvalidOptionError(f"overlap at '{at}': expected one of {', '.join(OVERLAP_AT)}")
        st = self._lib.bitsplit_ctx_set_overlap(self.ptr, OVERLAP_AT[at] if on else 0)
        if st != 0:
            _raise(st, "out of memory for the overlap's tables")

    @property
    def batch_invariant(self) -> bool:
        """Batch-invariant verification (default on): the pinned kernel family serves every batch size
        (outside :meth:`prompt`) and the base's weights without residual (the output head, tensors
        kept exact) are computed by the library's kernels too, so that a verified row does not
        depend on the rest of its batch."""
        return bool(self._lib.bitsplit_ctx_get_batch_invariant(self.ptr))

    @batch_invariant.setter
    def batch_invariant(self, on: bool) -> None:
        self._lib.bitsplit_ctx_set_batch_invariant(self.ptr, bool(on))

    @property
    def prompt_mode(self) -> bool:
        """Whether the passes now are a prompt's (:meth:`prompt`)."""
        return bool(self._lib.bitsplit_ctx_get_prompt(self.ptr))

    @contextlib.contextmanager
    def prompt(self):
        """Context manager: the passes inside decode a prompt. Their products take the kernel
        policy's family for a 64-row batch, whatever each pass's size (one family for every prompt
        token, however the prompt is cut into batches), rather than the family pinned for decode
        passes; ``BITSPLIT_KERNEL`` still pins. A prompt's rows are computed once and never verified
        again, so speculative output stays the verifier's; the pinned family, chosen for passes of a
        few rows, can be several times slower on a prompt's 64-row batches."""
        before = self.prompt_mode
        self._lib.bitsplit_ctx_set_prompt(self.ptr, True)
        try:
            yield
        finally:
            self._lib.bitsplit_ctx_set_prompt(self.ptr, before)

    def set_threads(self, n: int) -> None:
        if self._lib.bitsplit_ctx_set_threads(self.ptr, int(n)) != 0:
            raise InvalidOptionError(f"threads: {n} is not in 1..64")

    def set_kernel(self, name: str | None) -> str:
        st = self._lib.bitsplit_ctx_set_kernel(self.ptr, (name or "").encode())
        if st != 0:
            from . import policy

            raise UnsupportedModelError(f"kernel family '{name}' cannot run {policy.where_here()} (it runs: "
                                        f"{', '.join(policy.families())})")
        return self.kernel

    def choose_decode_kernel(self, batch: int, name: str | None = None, residual_alone: bool = False) -> str:
        """Pin the kernel family for decode passes of ``batch`` columns (one family for a whole
        generation keeps speculative output identical to plain decoding): ``name`` if given, else
        the native kernel policy's choice for that batch (the thresholds live only there) and for
        products of W2 + R, or of the residual alone (``residual_alone``: the base on a device)."""
        if name:
            return self.set_kernel(name)
        return self._ffi.string(self._lib.bitsplit_ctx_choose_kernel(self.ptr, int(batch), bool(residual_alone))).decode()

    def family_of(self, name: str, n_cols: int, with_base: bool = True) -> str:
        """The kernel family that computes :meth:`matmul` of ``name`` on ``n_cols`` columns now (the
        pinned family, or the one that takes a product the pinned family cannot compute)."""
        fam = self._ffi.string(self._lib.bitsplit_ctx_family_of(self.ptr, name.encode(), int(n_cols), with_base)).decode()
        if not fam:
            raise InvalidOptionError(f"no product of '{name}' on {n_cols} columns (with_base={with_base})")
        return fam

    @property
    def kernel(self) -> str:
        return self._ffi.string(self._lib.bitsplit_ctx_kernel(self.ptr)).decode()

    # -- observation ----------------------------------------------------------------------------
    def counters(self) -> Counters:
        c = self._ffi.new("bitsplit_counters *")
        self._lib.bitsplit_ctx_get_counters(self.ptr, c)
        return Counters(c.n_products, c.n_add_products, c.n_get_rows, c.n_columns, c.bytes_residual, c.bytes_base,
                        c.ns_inside / 1e9, c.n_errors, c.n_draft_products, c.ns_draft / 1e9, c.bytes_from_device,
                        c.bytes_to_device, c.ns_transfer / 1e9, c.n_overlapped, c.ns_wait / 1e9, c.n_stops,
                        c.n_exact_products, c.n_attn_products, c.ns_attn / 1e9, c.n_softmax, c.bytes_outlier_base,
                        c.n_compensated, c.ns_compensate / 1e9)

    def reset_counters(self) -> None:
        self._lib.bitsplit_ctx_reset_counters(self.ptr)

    def raise_pending_error(self) -> None:
        """Raise the first error the callback recorded during evaluation, if any."""
        buf = self._ffi.new("char[]", 1024)
        st = self._lib.bitsplit_ctx_take_error(self.ptr, buf, 1024)
        if st != 0:
            _raise(st, f"{self.residual_path}: {self._ffi.string(buf).decode(errors='replace')}")

    def tensors(self) -> list[tuple[str, tuple[int, ...], int, int]]:
        out = []
        name = self._ffi.new("char **")
        ne = self._ffi.new("int64_t[4]")
        bt = self._ffi.new("int *")
        rt = self._ffi.new("int *")
        for i in range(self._lib.bitsplit_ctx_n_tensors(self.ptr)):
            self._lib.bitsplit_ctx_tensor_info(self.ptr, i, self._ffi.cast("const char **", name), ne, bt, rt)
            out.append((self._ffi.string(name[0]).decode(), tuple(ne[j] for j in range(4)), bt[0], rt[0]))
        return out

    def exact_tensors(self) -> list[str]:
        """The base's matrices without residual (kept exact by the split), which the library
        computes in batch-invariant mode."""
        return list(self._exact_shapes())

    def _exact_shapes(self) -> dict[str, tuple[int, ...]]:
        """name -> 4-D shape of the base's matrices without residual (read from base.gguf once)."""
        if getattr(self, "_exact", None) is None:
            res = {t[0] for t in self.tensors()}
            with GGUFFile(self.base_path) as b:
                self._exact = {t.name: tuple(t.shape) + (1, 1) for t in b.tensors
                               if t.name not in res and len(t.shape) == 2 and t.shape[1] > 1}
        return self._exact

    def draft_matmul(self, name: str, x: np.ndarray) -> np.ndarray | None:
        """W2 . x as the fast drafter computes it with the residual off (the draft policy's family,
        8-bit activations), x of shape (n_cols, ne0); None where ggml's own kernel drafts that
        product instead (no draft family on this CPU, fewer columns than it takes, a type it does
        not read). For benchmarks and the machine profile."""
        if getattr(self, "_info", None) is None:
            self._info = {t[0]: t for t in self.tensors()}
        ne = self._info[name][1] if name in self._info else None
        if ne is None:
            raise InputError(f"{self.residual_path}: has no tensor '{name}' with a residual")
        x = np.ascontiguousarray(x, dtype=np.float32)
        if x.ndim != 2 or x.shape[1] != ne[0] or x.shape[0] < 1:
            raise InvalidOptionError(f"x must have shape (n_cols >= 1, {ne[0]}), got {x.shape}")
        y = np.empty((x.shape[0], ne[1]), dtype=np.float32)
        st = self._lib.bitsplit_ctx_draft_matmul(self.ptr, name.encode(), self._ffi.cast("float *", x.ctypes.data),
                                                 x.shape[0], self._ffi.cast("float *", y.ctypes.data))
        if st == self._lib.BITSPLIT_E_UNSUPPORTED:
            return None
        if st != 0:
            self.raise_pending_error()  # the kernel's own message (out of memory in a thread), if any
            _raise(st, f"draft_matmul on '{name}' failed: {native.status_text(st)}")
        return y

    def matmul(self, name: str, x: np.ndarray, with_base: bool = True) -> np.ndarray:
        """(W2 + R) . x (or R . x) for a 2-D weight, x of shape (n_cols, ne0): the callback's kernels
        on this context's own threads. Returns (n_cols, ne1) float32. For a base matrix without
        residual (``exact_tensors``), W2 . x at the verifier's precision (``with_base`` only)."""
        if getattr(self, "_info", None) is None:
            self._info = {t[0]: t for t in self.tensors()}
        info = self._info
        if name in info:
            ne = info[name][1]
        else:
            exact = self._exact_shapes()
            if name not in exact:
                raise InputError(f"{self.residual_path}: has no tensor '{name}'")
            if not with_base:
                raise InvalidOptionError(f"'{name}' has no residual: only with_base=True")
            ne = exact[name]
        x = np.ascontiguousarray(x, dtype=np.float32)
        if x.ndim != 2 or x.shape[1] != ne[0]:
            raise InvalidOptionError(f"x must have shape (n_cols, {ne[0]}), got {x.shape}")
        y = np.empty((x.shape[0], ne[1]), dtype=np.float32)
        st = self._lib.bitsplit_ctx_matmul(self.ptr, name.encode(), self._ffi.cast("float *", x.ctypes.data),
                                           x.shape[0], self._ffi.cast("float *", y.ctypes.data), bool(with_base))
        if st != 0:
            self.raise_pending_error()  # the kernel's own message (out of memory in a thread), if any
            _raise(st, f"matmul on '{name}' failed: {native.status_text(st)}")
        return y
