"""The CPU as the machine profile describes it: model, architecture, the ISA flags that matter here,
the last-level cache, physical memory, and the thread count a measurement runs with. Read from the
OS only (``/proc/cpuinfo``, sysfs, sysconf); nothing is measured."""

from __future__ import annotations

import functools
import os
import platform
import sys
from pathlib import Path
from typing import Optional

X86_FLAGS = ("avx2", "fma", "f16c", "avx_vnni", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16",
             "amx_int8")
ARM_FLAGS = ("asimd", "asimddp", "i8mm", "sve", "sve2", "bf16")


@functools.lru_cache(maxsize=None)
def last_level_cache_bytes(sysfs: Path = Path("/sys/devices/system/cpu")) -> int:
    """Bytes of the highest cache level summed over its instances (one per socket, or per core
    complex on AMD), from Linux's sysfs; 0 where it says nothing. Read once per process (the
    profile's key and its measurement both ask)."""
    best_level, groups = 0, {}
    for idx in sysfs.glob("cpu[0-9]*/cache/index[0-9]*"):
        try:
            level = int((idx / "level").read_text())
            text = (idx / "size").read_text().strip().upper()
            shared = (idx / "shared_cpu_list").read_text().strip()
            if (idx / "type").read_text().strip() == "Instruction":
                continue
            unit = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:], 1)
            size = int(text[:-1] if text[-1:] in "KMG" else text) * unit
        except (OSError, ValueError):
            continue
        if level > best_level:
            best_level, groups = level, {}
        if level == best_level:
            groups[shared] = size
    return sum(groups.values())


def _cpuinfo() -> dict[str, str]:
    """The first processor's fields of /proc/cpuinfo (empty where there is none)."""
    out: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if not line.strip():
                    if out:
                        break
                    continue
                k, _, v = line.partition(":")
                out.setdefault(k.strip().lower(), v.strip())
    except OSError:
        pass
    return out


def cpu_info() -> dict:
    """CPU model, architecture, all flags the OS reports, and the ones that matter here as name -> bool."""
    info = _cpuinfo()
    arch = platform.machine()
    model = info.get("model name") or info.get("hardware") or info.get("cpu model") or ""
    if not model and sys.platform == "darwin":
        import subprocess

        try:
            model = subprocess.run(["sysctl", "-n", "machdep.cpu.brand_string"], capture_output=True, text=True,
                                   timeout=5).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            model = ""
    if not model and "cpu implementer" in info:
        model = f"ARM implementer {info['cpu implementer']} part {info.get('cpu part', '?')}"
    flags = (info.get("flags") or info.get("features") or "").split()
    wanted = ARM_FLAGS if arch.lower() in ("aarch64", "arm64") else X86_FLAGS
    have = set(flags)
    return {"model": model or platform.processor() or arch, "arch": arch, "flags": flags,
            "isa": {f: f in have for f in wanted}}


def physical_memory() -> int:
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 0


def threads_or_default(threads: Optional[int]) -> int:
    """``threads``, else the thread count a run uses by default here (llama.cpp's runtime default)."""
    from ..runtime.llamacpp import default_threads

    return int(threads or default_threads())
