"""The only package that knows the native library: how it is built against the installed
llama-cpp-python (:mod:`.build`), its declarations, generated from ``native/bitsplit.h``
(:mod:`.cdef`), and the owning Python object over a residual context (:mod:`.residual`).
"""

from __future__ import annotations

from .build import build_key, load, source_dir, sources


def status_text(status: int) -> str:
    ffi, lib = load()
    return ffi.string(lib.bitsplit_status_str(status)).decode()


def callback_address() -> int:
    """Address of bitsplit_eval_callback, for llama_context_params.cb_eval."""
    ffi, lib = load()
    return int(ffi.cast("uintptr_t", lib.bitsplit_eval_callback))


def kernel_name() -> str:
    """The fastest kernel family this CPU runs (or the one BITSPLIT_KERNEL names)."""
    ffi, lib = load()
    return ffi.string(lib.bitsplit_kernel_name()).decode()


def set_abort_message(message: str | None) -> None:
    """From now on, a llama.cpp abort prints ``message`` (and llama.cpp's own line) and exits 1."""
    ffi, lib = load()
    lib.bitsplit_set_abort_message(ffi.NULL if message is None else message.encode()[:1023])


__all__ = ["set_abort_message", "build_key", "load", "source_dir", "sources", "status_text", "callback_address", "kernel_name"]
