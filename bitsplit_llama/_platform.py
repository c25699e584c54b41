"""What differs between operating systems, in one place: file locks, peak memory, whether a process
is alive, and the parent-death signal. Imports nothing POSIX-only or Windows-only at module level,
so that every module of the package imports on Linux, macOS and Windows alike."""

from __future__ import annotations

import os
import sys
import time
from typing import IO

WINDOWS = os.name == "nt"


def lock_exclusive(f: IO, *, blocking: bool = True) -> bool:
    """An exclusive lock on the open file ``f`` for this process, released when ``f`` is closed.
    ``blocking=False``: False (at once) while another process holds it."""
    if WINDOWS:
        import msvcrt

        while True:
            f.seek(0)
            try:
                msvcrt.locking(f.fileno(), msvcrt.LK_NBLCK, 1)  # the file's first byte stands for it
                return True
            except OSError:
                if not blocking:
                    return False
                time.sleep(0.2)  # LK_LOCK gives up after 10 s; a native build takes minutes
    import fcntl

    try:
        fcntl.flock(f, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
    except BlockingIOError:
        return False
    return True


def peak_rss(children: bool = False) -> int | None:
    """Peak resident memory in bytes: of this process, or (``children``) of the largest child it
    waited for. None where this platform does not say (Windows, for children; or no way to ask)."""
    try:
        import resource
    except ImportError:
        resource = None
    if resource is not None:
        ru = resource.getrusage(resource.RUSAGE_CHILDREN if children else resource.RUSAGE_SELF).ru_maxrss
        return int(ru) if sys.platform == "darwin" else int(ru) * 1024  # macOS: bytes; Linux, BSD: KiB
    if WINDOWS and not children:
        return _windows_peak_working_set()
    return None


def _windows_peak_working_set() -> int | None:
    import ctypes
    from ctypes import wintypes

    class Counters(ctypes.Structure):  # PROCESS_MEMORY_COUNTERS (psapi.h)
        _fields_ = [("cb", wintypes.DWORD), ("PageFaultCount", wintypes.DWORD),
                    ("PeakWorkingSetSize", ctypes.c_size_t), ("WorkingSetSize", ctypes.c_size_t),
                    ("QuotaPeakPagedPoolUsage", ctypes.c_size_t), ("QuotaPagedPoolUsage", ctypes.c_size_t),
                    ("QuotaPeakNonPagedPoolUsage", ctypes.c_size_t), ("QuotaNonPagedPoolUsage", ctypes.c_size_t),
                    ("PagefileUsage", ctypes.c_size_t), ("PeakPagefileUsage", ctypes.c_size_t)]

    try:
        c = Counters(cb=ctypes.sizeof(Counters))
        k32 = ctypes.WinDLL("kernel32")
        ok = k32.K32GetProcessMemoryInfo(k32.GetCurrentProcess(), ctypes.byref(c), c.cb)
        return int(c.PeakWorkingSetSize) if ok else None
    except (OSError, AttributeError):
        return None


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists (one we may not signal counts). Never signals it: on Windows
    ``os.kill(pid, 0)`` would terminate it."""
    if pid <= 0:
        return False
    if WINDOWS:
        import ctypes

        k32 = ctypes.WinDLL("kernel32", use_last_error=True)
        handle = k32.OpenProcess(0x1000, False, pid)  # PROCESS_QUERY_LIMITED_INFORMATION
        if not handle:
            return ctypes.get_last_error() == 5  # ERROR_ACCESS_DENIED: it exists
        try:
            code = ctypes.c_ulong()
            return bool(k32.GetExitCodeProcess(handle, ctypes.byref(code))) and code.value == 259  # STILL_ACTIVE
        finally:
            k32.CloseHandle(handle)
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def die_with_parent(parent: int) -> None:
    """Linux: this (child) process is killed when ``parent`` dies, even by SIGKILL, so that no worker
    is left orphaned; elsewhere nothing (the parent kills its children on its way out)."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, 9, 0, 0, 0)  # PR_SET_PDEATHSIG, SIGKILL
    except (OSError, AttributeError, TypeError):
        return
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(5)
