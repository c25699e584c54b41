"""ctypes bindings to the few ggml functions the split needs, from the ggml that llama_cpp loaded.

We must use the very ``libggml-base`` that ``llama_cpp`` already mapped into the process (the
wheel ships several copies of the file under different names; loading another copy would give a
second, independent ggml). So the library is located through ``/proc/self/maps`` after importing
``llama_cpp``, and loaded lazily on first use, never at import time.

Only functions used by the Python side live here; the native residual library declares its own
through cffi in :mod:`bitsplit_llama.native.cdef`.
"""

from __future__ import annotations

import ctypes
import functools
import os
from pathlib import Path

import numpy as np

from ..errors import NativeError


class ggml_type_traits(ctypes.Structure):
    # struct ggml_type_traits { const char * type_name; int64_t blck_size; int64_t blck_size_interleave;
    #                           size_t type_size; bool is_quantized; ggml_to_float_t to_float;
    #                           ggml_from_float_t from_float_ref; };
    _fields_ = [
        ("type_name", ctypes.c_char_p),
        ("blck_size", ctypes.c_int64),
        ("blck_size_interleave", ctypes.c_int64),
        ("type_size", ctypes.c_size_t),
        ("is_quantized", ctypes.c_bool),
        ("to_float", ctypes.c_void_p),
        ("from_float_ref", ctypes.c_void_p),
    ]


# typedef void (*ggml_to_float_t)(const void * x, float * y, int64_t k);
_to_float_t = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)


def llama_cpp_lib_dir() -> Path:
    """Directory holding the shared libraries of the installed llama-cpp-python."""
    import llama_cpp  # noqa: F401  (imported for its side effect of loading libllama/libggml)

    return Path(llama_cpp.__file__).resolve().parent / "lib"


def loaded_ggml_base_path() -> Path:
    """Path of the libggml-base that is mapped in this process (after ``import llama_cpp``)."""
    lib_dir = llama_cpp_lib_dir()
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as f:
            for line in f:
                path = line.rsplit(None, 1)[-1]
                if os.path.basename(path).startswith("libggml-base.so"):
                    return Path(path)
    except OSError:
        pass
    tried = []
    for name in ("libggml-base.so.0", "libggml-base.so", "libggml-base.dylib", "ggml-base.dll"):
        cand = lib_dir / name
        tried.append(str(cand))
        if cand.exists():
            return cand
    raise NativeError(
        "cannot find libggml-base of llama-cpp-python; tried /proc/self/maps and " + ", ".join(tried)
    )


@functools.lru_cache(maxsize=1)
def lib() -> ctypes.CDLL:
    path = loaded_ggml_base_path()
    try:
        dll = ctypes.CDLL(str(path))
    except OSError as exc:
        raise NativeError(f"{path}: cannot load libggml-base: {exc}") from exc

    # size_t ggml_quantize_chunk(enum ggml_type type, const float * src, void * dst, int64_t start,
    #                            int64_t nrows, int64_t n_per_row, const float * imatrix);
    dll.ggml_quantize_chunk.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                        ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
    dll.ggml_quantize_chunk.restype = ctypes.c_size_t
    # bool ggml_quantize_requires_imatrix(enum ggml_type type);
    dll.ggml_quantize_requires_imatrix.argtypes = [ctypes.c_int]
    dll.ggml_quantize_requires_imatrix.restype = ctypes.c_bool
    # size_t ggml_row_size(enum ggml_type type, int64_t ne);
    dll.ggml_row_size.argtypes = [ctypes.c_int, ctypes.c_int64]
    dll.ggml_row_size.restype = ctypes.c_size_t
    # const struct ggml_type_traits * ggml_get_type_traits(enum ggml_type type);
    dll.ggml_get_type_traits.argtypes = [ctypes.c_int]
    dll.ggml_get_type_traits.restype = ctypes.POINTER(ggml_type_traits)
    # void ggml_quantize_init(enum ggml_type type);
    dll.ggml_quantize_init.argtypes = [ctypes.c_int]
    dll.ggml_quantize_init.restype = None
    return dll


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
        raise ValueError(f"row width {n_per_row} is not a multiple of {tr.type_name.decode()}'s block of {tr.blck_size}")
    dll = lib()
    if imatrix is not None:
        imatrix = np.ascontiguousarray(imatrix, dtype=np.float32)
        if imatrix.shape != (n_per_row,):
            raise ValueError(f"imatrix has shape {imatrix.shape}, expected ({n_per_row},)")
    elif dll.ggml_quantize_requires_imatrix(ggml_type):
        raise ValueError(f"{tr.type_name.decode()} cannot be quantized without an importance matrix")
    row_bytes = dll.ggml_row_size(ggml_type, n_per_row)
    out = np.empty((nrows, row_bytes), dtype=np.uint8)
    dll.ggml_quantize_init(ggml_type)
    written = dll.ggml_quantize_chunk(
        ggml_type, x.ctypes.data, out.ctypes.data, 0, nrows, n_per_row,
        imatrix.ctypes.data if imatrix is not None else None,
    )
    if written != out.nbytes:
        raise NativeError(f"ggml_quantize_chunk wrote {written} bytes, expected {out.nbytes}")
    return out


@functools.lru_cache(maxsize=None)
def traits(ggml_type: int) -> ggml_type_traits:
    p = lib().ggml_get_type_traits(ggml_type)
    if not p:
        raise ValueError(f"unknown ggml type id {ggml_type}")
    return p.contents


@functools.lru_cache(maxsize=None)
def _to_float(ggml_type: int):
    tr = traits(ggml_type)
    if not tr.to_float:
        raise ValueError(f"ggml has no dequantizer for type {tr.type_name.decode()}")
    return _to_float_t(tr.to_float)


def dequantize_rows(raw: np.ndarray, ggml_type: int, n_per_row: int) -> np.ndarray:
    """Dequantize raw rows (rows, row_bytes) of ``ggml_type`` into float32 (rows, n_per_row) with ggml."""
    raw = np.ascontiguousarray(raw, dtype=np.uint8)
    dll = lib()
    row_bytes = dll.ggml_row_size(ggml_type, n_per_row)
    if raw.ndim != 2 or raw.shape[1] != row_bytes:
        raise ValueError(f"expected raw rows of {row_bytes} bytes, got shape {raw.shape}")
    out = np.empty((raw.shape[0], n_per_row), dtype=np.float32)
    if ggml_type == 0:  # F32: ggml has no to_float for its own float type
        out[...] = raw.view(np.float32).reshape(out.shape)
        return out
    _to_float(ggml_type)(raw.ctypes.data, out.ctypes.data, out.size)
    return out


def row_size(ggml_type: int, n_per_row: int) -> int:
    return int(lib().ggml_row_size(ggml_type, n_per_row))


def cpu_count() -> int:
    return max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1))
