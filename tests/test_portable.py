"""The package on a platform without POSIX's modules and Linux's /proc and sysfs (Windows): every
module imports, and what the OS-specific helpers answer there. Each case runs in a fresh
interpreter where importing ``fcntl`` or ``resource`` fails and opening, listing or stat-ing anything
under /proc or /sys raises FileNotFoundError, as on Windows."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

WITHOUT_POSIX = textwrap.dedent("""
    import builtins, io, os, sys
    for name in ("fcntl", "resource"):
        sys.modules[name] = None  # `import fcntl` raises ImportError, as on Windows
    def _linux_only(path):
        p = os.fspath(path) if isinstance(path, (str, bytes, os.PathLike)) else ""
        p = p.decode() if isinstance(p, bytes) else p
        return p.startswith(("/proc", "/sys"))
    _open, _io_open, _listdir, _scandir, _stat, _lstat = builtins.open, io.open, os.listdir, os.scandir, os.stat, os.lstat
    def _guard(real):
        def call(path=".", *a, **k):
            if _linux_only(path):
                raise FileNotFoundError(2, "No such file or directory (not Linux)", path)
            return real(path, *a, **k)
        return call
    builtins.open, io.open, os.listdir, os.scandir, os.stat, os.lstat = map(
        _guard, (_open, _io_open, _listdir, _scandir, _stat, _lstat))
""")


def _run(body: str) -> dict:
    code = WITHOUT_POSIX + textwrap.dedent(body)
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-4000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_every_module_imports_without_fcntl_resource_and_proc():
    out = _run("""
        import importlib, json, pkgutil
        import bitsplit_llama
        names = [m.name for m in pkgutil.walk_packages(bitsplit_llama.__path__, "bitsplit_llama.")]
        for n in names:
            importlib.import_module(n)
        print(json.dumps({"modules": names, "fcntl": "fcntl" in sys.modules and sys.modules["fcntl"] is not None}))
    """)
    mods = set(out["modules"])
    # the modules that used to import POSIX-only modules at module level are among them
    assert {"bitsplit_llama.formats.split", "bitsplit_llama.native.build", "bitsplit_llama.cli",
            "bitsplit_llama.tools.bench", "bitsplit_llama.api.server"} <= mods, sorted(mods)
    assert len(mods) > 40 and not out["fcntl"]


def test_platform_helpers_without_posix_modules_and_proc():
    out = _run("""
        import json
        from bitsplit_llama import _platform
        from bitsplit_llama.tools import cpuinfo
        info = cpuinfo.cpu_info()
        print(json.dumps({"rss": _platform.peak_rss(), "rss_children": _platform.peak_rss(children=True),
                          "llc": cpuinfo.last_level_cache_bytes(), "info": sorted(info)}))
    """)
    # not Windows and no resource module: peak memory is "not measured", never a wrong number
    assert out["rss"] is None and out["rss_children"] is None
    assert isinstance(out["llc"], int) and out["info"]


def test_platform_helpers_here(tmp_path):
    from bitsplit_llama import _platform

    assert _platform.peak_rss() > 0 and _platform.pid_alive(__import__("os").getpid())
    assert not _platform.pid_alive(-1) and not _platform.pid_alive(0)
    with open(tmp_path / "lock", "w") as a:
        assert _platform.lock_exclusive(a)
        # another process cannot take it while this one holds it, and can once it is closed
        code = ("import sys; from bitsplit_llama import _platform\n"
                "f = open(sys.argv[1], 'a'); print(_platform.lock_exclusive(f, blocking=False))")
        held = subprocess.run([sys.executable, "-c", code, str(tmp_path / "lock")], capture_output=True, text=True)
        assert held.stdout.strip() == "False", held.stderr
    free = subprocess.run([sys.executable, "-c", code, str(tmp_path / "lock")], capture_output=True, text=True)
    assert free.stdout.strip() == "True", free.stderr


# --- the native library on Windows (built and run under wine by tests/test_wine.py, marked `wine`) ---

NATIVE = ROOT / "native"
POSIX_HEADERS = ("pthread.h", "unistd.h", "sys/mman.h", "sys/stat.h", "fcntl.h", "sched.h", "sys/syscall.h",
                 "sys/auxv.h", "dlfcn.h")


def test_native_sources_reach_posix_only_through_os_layer():
    """POSIX-only headers appear only in the OS layer (bs_os.h, os.c) and in Linux-guarded CPU detection,
    so the library compiles for Windows; this holds without MinGW or wine installed."""
    import re

    offenders = []
    for path in sorted([*NATIVE.glob("*.[ch]"), *(NATIVE / "arch" / "x86").glob("*.[ch]")]):
        rel = path.relative_to(NATIVE).as_posix()
        if rel in ("bs_os.h", "os.c"):
            continue
        depth_linux = 0  # inside `#if defined(__linux__)`
        for line in path.read_text().splitlines():
            s = line.strip()
            if re.match(r"#\s*if.*__linux__", s):
                depth_linux += 1
            elif re.match(r"#\s*endif", s) and depth_linux:
                depth_linux -= 1
            m = re.match(r'#\s*include\s*<([^>]+)>', s)
            if m and m.group(1) in POSIX_HEADERS and not depth_linux:
                offenders.append(f"{rel}: {s}")
            if re.search(r"\b(pthread_\w+|posix_memalign|mmap|munmap|sched_yield|clock_gettime)\s*\(", s) and not depth_linux:
                offenders.append(f"{rel}: {s}")
    assert not offenders, offenders


def test_windows_link_command_and_exports(tmp_path):
    from bitsplit_llama.native import build
    from bitsplit_llama.native.cdef import cdef, declared_functions

    header = build.source_dir() / "bitsplit.h"
    text = build.export_def(header)
    names = [line.strip() for line in text.splitlines()[1:]]
    assert text.startswith("EXPORTS\n") and names == declared_functions(cdef(header))
    assert "bitsplit_eval_callback" in names and all(n.startswith("bitsplit_") for n in names)

    base = tmp_path / "lib" / "ggml-base.dll"
    win = build.link_command("gcc", ["a.o", "b.o"], tmp_path / "bitsplit.dll", base.parent, base,
                             tmp_path / "bitsplit.def", windows=True)
    # straight to the DLL llama_cpp loaded (the Windows loader resolves the import to that module), the
    # exports from the .def file, libgcc linked in; nothing of ELF's (rpath, -l:, pthread)
    assert win[:2] == ["gcc", "-shared"] and str(base) in win and str(tmp_path / "bitsplit.def") in win
    assert "-static-libgcc" in win and not any(a.startswith(("-Wl,-rpath", "-l:", "-lpthread")) for a in win)
    lin = build.link_command("cc", ["a.o"], tmp_path / "libbitsplit.so", base.parent, base.with_name("libggml-base.so.0"),
                             windows=False)
    assert f"-l:libggml-base.so.0" in lin and f"-Wl,-rpath,{base.parent}" in lin
    assert "-fPIC" not in build.cflags(windows=True) and "-fPIC" in build.cflags(windows=False)


def test_no_compiler_on_windows_says_what_to_install(monkeypatch):
    import pytest

    from bitsplit_llama.errors import NativeError
    from bitsplit_llama.native import build

    monkeypatch.setattr(build, "WINDOWS", True)
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setattr(build.shutil, "which", lambda name: None)
    with pytest.raises(NativeError) as err:
        build._compiler()
    msg = str(err.value)
    assert "tried $CC, gcc, clang, cc" in msg and "MinGW-w64" in msg and "cl cannot build it" in msg
