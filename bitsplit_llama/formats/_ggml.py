"""The one place Python calls ggml: cffi (ABI mode) over the ggml that llama_cpp loaded.

We must use the very ``libggml-base`` (and ``libggml-cpu``, ``libggml``) that ``llama_cpp`` already
mapped into the process (the wheel ships several copies of a file under different names; loading
another copy would give a second, independent ggml). So each library is located through
``/proc/self/maps`` after importing ``llama_cpp``, and loaded lazily on first use, never at import
time.

The declarations are not written here: the prototypes of the functions below and the layouts of
the structs they pass (``ggml_init_params`` by value, ``ggml_cplan`` returned by value,
``ggml_type_traits``) are read from llama-cpp-python's installed ggml headers
(:mod:`._ggml_header`). What is called:

- the split's quantizer and dequantizer (``ggml_quantize_chunk``, the type traits' ``to_float``),
  row sizes and block sizes;
- stock ggml's CPU product (``ggml_mul_mat`` in a graph, ``ggml_graph_plan``,
  ``ggml_graph_compute``): :class:`MulMatPasses`, the reference ``bitsplit doctor`` and
  ``bitsplit plan`` time the native kernels against;
- the backend registry's devices (:func:`backend_devices`).

The native residual library declares its own API through cffi in :mod:`bitsplit_llama.native.cdef`.
"""

from __future__ import annotations

import functools
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Optional

import numpy as np

from ..errors import NativeError
from . import _ggml_header

#: the ggml functions called from Python, each from the library that exports it
BASE_FUNCTIONS = (
    "ggml_quantize_chunk", "ggml_quantize_requires_imatrix", "ggml_row_size", "ggml_get_type_traits",
    "ggml_quantize_init", "ggml_init", "ggml_free", "ggml_new_tensor_2d", "ggml_mul_mat", "ggml_new_graph",
    "ggml_build_forward_expand", "ggml_get_data", "ggml_nbytes", "ggml_tensor_overhead", "ggml_graph_overhead",
)
CPU_FUNCTIONS = ("ggml_cpu_init", "ggml_graph_plan", "ggml_graph_compute")
BACKEND_FUNCTIONS = (
    "ggml_backend_dev_count", "ggml_backend_dev_get", "ggml_backend_dev_name", "ggml_backend_dev_description",
    "ggml_backend_dev_type", "ggml_backend_dev_memory",
)
#: the structs whose fields are read or written here (others are passed by pointer only)
STRUCTS = ("ggml_type_traits", "ggml_init_params", "ggml_cplan")

GGML_TYPE_F32 = 0


def llama_cpp_lib_dir() -> Path:
    """Directory holding the shared libraries of the installed llama-cpp-python."""
    import llama_cpp  # noqa: F401  (imported for its side effect of loading libllama/libggml)

    return Path(llama_cpp.__file__).resolve().parent / "lib"


def loaded_lib(stem: str) -> Path:
    """The file of llama-cpp-python's ``stem`` (``libggml-base``, ``libggml-cpu``, ``libggml``) that
    is mapped in this process (after ``import llama_cpp``), else the one in its lib directory."""
    lib_dir = llama_cpp_lib_dir()
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as f:
            for line in f:
                path = line.rsplit(None, 1)[-1]
                if ".so" in path and os.path.basename(path).split(".so")[0] == stem:
                    return Path(path)
    except OSError:
        pass
    tried = []
    for name in (f"{stem}.so.0", f"{stem}.so", f"{stem}.dylib", f"{stem.removeprefix('lib')}.dll"):
        cand = lib_dir / name
        tried.append(str(cand))
        if cand.exists():
            return cand
    raise NativeError(f"cannot find {stem} of llama-cpp-python; tried /proc/self/maps and " + ", ".join(tried))


def loaded_ggml_base_path() -> Path:
    """Path of the libggml-base that is mapped in this process (after ``import llama_cpp``)."""
    return loaded_lib("libggml-base")


# the FFI and the libraries are made once per process, on first use; the split quantizes from several
# threads, which must all get the same FFI (cdata of one FFI's types do not pass to another's functions)
_LOCK = threading.RLock()


def ffi():
    """The cffi FFI declaring what this module calls, from the installed ggml headers."""
    with _LOCK:
        return _make_ffi()


@functools.lru_cache(maxsize=1)
def _make_ffi():
    import cffi

    inc = _ggml_header.include_dir()
    idx = _ggml_header.index([inc / h for h in _ggml_header.HEADERS])
    text = _ggml_header.cdef(idx, [*BASE_FUNCTIONS, *CPU_FUNCTIONS, *BACKEND_FUNCTIONS], list(STRUCTS))
    f = cffi.FFI()
    try:
        f.cdef(text)
    except Exception as exc:  # a header cffi cannot read: say which declarations
        raise NativeError(f"cffi cannot parse the ggml declarations taken from {inc}: {exc}\n{text}") from exc
    return f


def _open(stem: str):
    with _LOCK:
        return _dlopen(stem)


@functools.lru_cache(maxsize=None)
def _dlopen(stem: str):
    path = loaded_lib(stem)
    try:
        return ffi().dlopen(str(path))
    except OSError as exc:
        raise NativeError(f"{path}: cannot load {stem}: {exc}") from exc


def lib():
    """libggml-base: tensors, graphs, quantization."""
    return _open("libggml-base")


def cpu_lib():
    """libggml-cpu: the CPU backend's graph plan and compute."""
    return _open("libggml-cpu")


def backend_lib():
    """libggml: the backend registry (its devices)."""
    return _open("libggml")


def _ptr(a: np.ndarray, ctype: str = "void *"):
    return ffi().cast(ctype, a.ctypes.data)


# -- quantization -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class TypeTraits:
    """ggml's ``ggml_type_traits`` of one type, as Python values (``to_float``: the dequantizer, a
    function pointer, or None where ggml has none)."""
    type_name: str
    blck_size: int
    type_size: int
    is_quantized: bool
    to_float: Any


@functools.lru_cache(maxsize=None)
def traits(ggml_type: int) -> TypeTraits:
    f = ffi()
    p = lib().ggml_get_type_traits(ggml_type)
    if p == f.NULL:
        raise ValueError(f"unknown ggml type id {ggml_type}")
    return TypeTraits(f.string(p.type_name).decode() if p.type_name != f.NULL else str(ggml_type),
                      int(p.blck_size), int(p.type_size), bool(p.is_quantized),
                      p.to_float if p.to_float != f.NULL else None)


def _as_f32_rows(x: np.ndarray) -> np.ndarray:
    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.ndim != 2:
        raise ValueError(f"expected a 2-D float32 array (rows, n_per_row), got shape {x.shape}")
    return x


def quantize_rows(x: np.ndarray, ggml_type: int, imatrix: np.ndarray | None = None) -> np.ndarray:
    """Quantize a (rows, n_per_row) float32 array with ggml's own quantizer; returns the raw bytes.

    ggml does not check the row width against the type's block size and writes past its buffer on
    a bad width, so the width is checked here first.
    """
    x = _as_f32_rows(x)
    nrows, n_per_row = x.shape
    tr = traits(ggml_type)
    if n_per_row % tr.blck_size:
        raise ValueError(f"row width {n_per_row} is not a multiple of {tr.type_name}'s block of {tr.blck_size}")
    dll = lib()
    if imatrix is not None:
        imatrix = np.ascontiguousarray(imatrix, dtype=np.float32)
        if imatrix.shape != (n_per_row,):
            raise ValueError(f"imatrix has shape {imatrix.shape}, expected ({n_per_row},)")
    elif dll.ggml_quantize_requires_imatrix(ggml_type):
        raise ValueError(f"{tr.type_name} cannot be quantized without an importance matrix")
    row_bytes = dll.ggml_row_size(ggml_type, n_per_row)
    out = np.empty((nrows, row_bytes), dtype=np.uint8)
    dll.ggml_quantize_init(ggml_type)
    written = dll.ggml_quantize_chunk(
        ggml_type, _ptr(x, "float *"), _ptr(out), 0, nrows, n_per_row,
        _ptr(imatrix, "float *") if imatrix is not None else ffi().NULL,
    )
    if written != out.nbytes:
        raise NativeError(f"ggml_quantize_chunk wrote {written} bytes, expected {out.nbytes}")
    return out


def dequantize_rows(raw: np.ndarray, ggml_type: int, n_per_row: int) -> np.ndarray:
    """Dequantize raw rows (rows, row_bytes) of ``ggml_type`` into float32 (rows, n_per_row) with ggml."""
    raw = np.ascontiguousarray(raw, dtype=np.uint8)
    row_bytes = lib().ggml_row_size(ggml_type, n_per_row)
    if raw.ndim != 2 or raw.shape[1] != row_bytes:
        raise ValueError(f"expected raw rows of {row_bytes} bytes, got shape {raw.shape}")
    out = np.empty((raw.shape[0], n_per_row), dtype=np.float32)
    if ggml_type == GGML_TYPE_F32:  # F32: ggml has no to_float for its own float type
        out[...] = raw.view(np.float32).reshape(out.shape)
        return out
    tr = traits(ggml_type)
    if tr.to_float is None:
        raise ValueError(f"ggml has no dequantizer for type {tr.type_name}")
    tr.to_float(_ptr(raw), _ptr(out, "float *"), out.size)
    return out


def row_size(ggml_type: int, n_per_row: int) -> int:
    return int(lib().ggml_row_size(ggml_type, n_per_row))


def cpu_count() -> int:
    return max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1))


# -- stock ggml's CPU product -------------------------------------------------------------------------

class MulMatPasses:
    """ggml's own products (``ggml_mul_mat`` on the CPU, standard layout: what llama.cpp computes for
    a split's drafter) over ``tensors`` (each with ``name``, ``ggml_type``, ``shape`` (ne0, ne1) and
    ``nbytes``), whose bytes ``read(t)`` returns, copied into one ggml context (one at a time).
    ``passes(rows)`` -> one_pass: a graph of one product per tensor at ``rows`` columns of random
    input, computed with ``threads`` threads. Keep the object while timing (it owns the weights and
    every graph made), then :meth:`free` it."""

    def __init__(self, tensors: Iterable, read: Callable[[Any], np.ndarray], threads: int) -> None:
        import llama_cpp  # noqa: F401  (loads libggml*: the one ggml of the process)

        f, base = ffi(), lib()
        self._threads = threads
        self._ctxs: list = []
        cpu_lib().ggml_cpu_init()
        tensors = list(tensors)
        total = sum(t.nbytes for t in tensors)
        self._wctx = base.ggml_init(self._params(total + len(tensors) * (base.ggml_tensor_overhead() + 4096) + 2**20))
        if self._wctx == f.NULL:
            raise MemoryError("ggml_init failed for the weights")
        self._ws = []
        for t in tensors:
            w = base.ggml_new_tensor_2d(self._wctx, t.ggml_type, t.shape[0], t.shape[1])
            if base.ggml_nbytes(w) != t.nbytes:
                self.free()
                raise ValueError(f"ggml sizes '{t.name}' at {base.ggml_nbytes(w)} bytes, the file at {t.nbytes}")
            raw = np.ascontiguousarray(read(t))
            f.memmove(base.ggml_get_data(w), f.cast("void *", raw.ctypes.data), t.nbytes)
            del raw
            self._ws.append((t, w))

    @staticmethod
    def _params(mem_size: int):
        return ffi().new("struct ggml_init_params *", {"mem_size": mem_size, "mem_buffer": ffi().NULL,
                                                        "no_alloc": False})[0]

    def __call__(self, rows: int) -> Callable[[], None]:
        f, base, cpu = ffi(), lib(), cpu_lib()
        ws = self._ws
        mem = (sum(rows * (t.shape[0] + t.shape[1]) * 4 for t, _ in ws) + (3 * len(ws) + 2) * base.ggml_tensor_overhead()
               + base.ggml_graph_overhead() + 2**22)
        cctx = base.ggml_init(self._params(mem))
        if cctx == f.NULL:
            raise MemoryError("ggml_init failed for the products")
        self._ctxs.append(cctx)
        rng = np.random.default_rng(4)
        gf = base.ggml_new_graph(cctx)
        for t, w in ws:
            x = base.ggml_new_tensor_2d(cctx, GGML_TYPE_F32, t.shape[0], rows)
            xv = rng.standard_normal((rows, t.shape[0]), dtype=np.float32)
            f.memmove(base.ggml_get_data(x), f.cast("void *", xv.ctypes.data), xv.nbytes)
            base.ggml_build_forward_expand(gf, base.ggml_mul_mat(cctx, w, x))
        # the work buffer is ours, sized by ggml_graph_plan (a guess of it fell short on a 16-thread
        # Xeon: ggml aborted)
        plan = cpu.ggml_graph_plan(gf, self._threads, f.NULL)
        work = np.empty(max(int(plan.work_size), 1) + 64, dtype=np.uint8)
        plan.work_data = f.cast("uint8_t *", (work.ctypes.data + 63) & ~63)
        pplan = f.addressof(plan)

        def one_pass() -> None:
            _ = work, plan  # the work buffer and the plan live as long as the pass
            st = cpu.ggml_graph_compute(gf, pplan)
            if st != 0:
                raise RuntimeError(f"ggml_graph_compute returned status {st}")
        return one_pass

    def free(self) -> None:
        base = lib()
        for c in self._ctxs:
            base.ggml_free(c)
        self._ctxs.clear()
        if self._wctx is not None:
            base.ggml_free(self._wctx)
            self._wctx = None


# -- the backend registry -----------------------------------------------------------------------------

def backend_devices() -> list[dict]:
    """The devices llama.cpp's ggml backend registry lists (CPU, GPUs, accelerators): name,
    description, type (``cpu``, ``gpu``, ``igpu``, ``accel``, ...; ``other`` for a type these headers
    do not name) and total memory."""
    import llama_cpp  # noqa: F401  (loads libggml*: the one ggml of the process)

    f, g = ffi(), backend_lib()
    prefix = "GGML_BACKEND_DEVICE_TYPE_"
    out = []
    for i in range(g.ggml_backend_dev_count()):
        d = g.ggml_backend_dev_get(i)
        free, total = f.new("size_t *"), f.new("size_t *")
        g.ggml_backend_dev_memory(d, free, total)
        kind = f.string(f.cast("enum ggml_backend_dev_type", g.ggml_backend_dev_type(d)))
        name, desc = g.ggml_backend_dev_name(d), g.ggml_backend_dev_description(d)
        out.append({"name": f.string(name).decode(errors="replace") if name != f.NULL else "",
                    "description": f.string(desc).decode(errors="replace") if desc != f.NULL else "",
                    "type": kind[len(prefix):].lower() if kind.startswith(prefix) else "other",
                    "memory_total_bytes": int(total[0])})
    return out
