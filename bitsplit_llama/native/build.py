"""Build, locate and load the native library (the C sources of the repository's ``native/``).

The library is compiled on first use (or by ``bitsplit build-native``) with the system C compiler,
one source per CPU at a time, against exactly the ggml headers that llama-cpp-python installed and linked to exactly the
``libggml-base`` it loaded, so the process holds one ggml. The sources are every ``native/*.c`` plus
the kernel families of the running architecture, ``native/arch/<arch>/*.c`` (x86 on x86-64, arm on
aarch64; other machines build the portable sources alone). Builds are cached under
``<cache>/native/`` per hash of every source and header compiled, compiler flags, llama-cpp-python
version and library path; nothing is compiled twice. The sources compile heaviest first, by their
times in the last build here (``<cache>/native/compile-times.json``; by their bytes the first time).
Each load marks its build used; a new build
removes the other builds unused for :data:`STALE_DAYS` days (each upgrade or source change leaves
one behind), and ``bitsplit build-native --prune`` all of them but the current one. Calls go through cffi's ABI mode with the
declarations generated from ``bitsplit.h`` (:mod:`.cdef`); the hot path, the eval callback, is
called by llama.cpp directly.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from importlib import resources
from pathlib import Path

from .._platform import lock_exclusive
from ..errors import NativeError

ARCH_DIRS = {"x86_64": "x86", "amd64": "x86", "aarch64": "arm", "arm64": "arm"}
WINDOWS = os.name == "nt"


def cflags(windows: bool = WINDOWS) -> tuple[str, ...]:
    """The compiler flags of every source (Windows: MinGW-w64 gcc, where code is position-independent
    anyway and every symbol is visible to the linker, which exports what the .def file names)."""
    return ("-std=c11", "-O3", "-Wall") if windows else ("-std=c11", "-O3", "-fPIC", "-Wall", "-fvisibility=default")


CFLAGS = cflags()
LIB = "bitsplit.dll" if WINDOWS else "libbitsplit.so"
STALE_DAYS = 30  # a new build removes the other builds no process has loaded for this long
USED = "used"    # touched by each load: when a build was last used
TIMES = "compile-times.json"  # in the cache root: each source's compile seconds in the last build here


def arch_dir() -> str | None:
    """The ``native/arch/`` folder of this machine's architecture (None: portable sources only)."""
    return ARCH_DIRS.get(platform.machine().lower())


def sources(src: Path) -> list[str]:
    """What is compiled, relative to ``src``: native/*.c, then native/arch/<arch>/*.c."""
    names = sorted(p.name for p in src.glob("*.c"))
    arch = arch_dir()
    if arch:
        names += sorted(f"arch/{arch}/{p.name}" for p in (src / "arch" / arch).glob("*.c"))
    return names


def _by_cost(src: Path, names: list[str], seconds: dict[str, float] | None = None) -> list[str]:
    """``names`` in the order to compile them in parallel: the heaviest first. By ``seconds`` (each
    source's compile time in the last build on this machine, :func:`_compile_times`) where it covers
    every name, else by the bytes of each source and of the sources it includes (the int16 kernels are
    one file compiled three times). Bytes misjudge the templates: on a 2-core Zen 5 kernels_avx2.c
    (16 kB) takes 23 s and kernels_tiles.c (44 kB) 0.6 s, so by bytes the 23 s file started last and
    the build took the two longest compiles back to back (37 + 23 s of a ~100 s total)."""
    if seconds and all(n in seconds for n in names):
        return sorted(names, key=lambda n: (-seconds[n], n))

    def cost(name: str) -> int:
        p = src / name
        text = p.read_text(errors="replace")
        inc = re.findall(r'^#include "([^"]+\.c)"', text, flags=re.M)
        return len(text) + sum((p.parent / i).stat().st_size for i in inc if (p.parent / i).is_file())

    return sorted(names, key=lambda n: (-cost(n), n))


def _compile_times() -> dict[str, float]:
    """The compile seconds of each source in the last build on this machine ({} if none or unreadable:
    then the sources are ordered by their bytes). A source's time changes little from one version to
    the next, so an upgrade's build is ordered by the previous version's."""
    try:
        data = json.loads((_cache_root() / TIMES).read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict):
        return {}
    return {k: float(v) for k, v in data.items() if isinstance(k, str) and isinstance(v, (int, float)) and v >= 0}


def _save_compile_times(seconds: dict[str, float]) -> None:
    """Record ``seconds`` for the next build's order, over the times recorded before (another checkout's
    sources, BITSPLIT_NATIVE_SRC, keep theirs); atomically; a failure only loses the order."""
    path = _cache_root() / TIMES
    tmp = path.with_name(f".{TIMES}.{os.getpid()}")
    merged = {**_compile_times(), **seconds}
    try:
        tmp.write_text(json.dumps({k: round(v, 2) for k, v in sorted(merged.items())}, indent=0))
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)


def _jobs() -> int:
    """Compilers run at once: the CPUs this process may use."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return max(1, os.cpu_count() or 1)


def headers(src: Path) -> list[str]:
    """Every header the sources may include: native/*.h and native/arch/**/*.h."""
    return sorted(p.name for p in src.glob("*.h")) + sorted(
        p.relative_to(src).as_posix() for p in (src / "arch").rglob("*.h"))


def include_dirs(src: Path) -> list[Path]:
    arch = arch_dir()
    return [src] + ([src / "arch" / arch] if arch and (src / "arch" / arch).is_dir() else [])


SRC_ENV = "BITSPLIT_NATIVE_SRC"


def source_dir() -> Path:
    """The C sources: packaged as bitsplit_llama.native_src (the repository's native/ folder), or the
    folder ``BITSPLIT_NATIVE_SRC`` names (another checkout's ``native/``, for timing two builds end to end:
    bench/e2e_ab.py). Such a build is cached like any other, per hash of its sources."""
    env = os.environ.get(SRC_ENV, "")
    if env:
        p = Path(env).expanduser()
        if not (p / "bitsplit.h").is_file():
            raise NativeError(f"{SRC_ENV}={env}: no bitsplit.h there (expected the native/ folder of a bitsplit-llama "
                              "checkout, or unset it to use the installed sources)")
        return p.resolve()
    try:
        p = Path(str(resources.files("bitsplit_llama.native_src")))
        if (p / "bitsplit.h").exists():
            return p
    except (ModuleNotFoundError, TypeError):
        pass
    p = Path(__file__).resolve().parents[2] / "native"
    if (p / "bitsplit.h").exists():
        return p
    raise NativeError("cannot find the native sources (bitsplit_llama.native_src or ../native next to the package)")


def _llama_paths() -> tuple[Path, Path, Path, str]:
    """(include dir, lib dir, libggml-base path, llama-cpp-python version) of the installed llama_cpp."""
    try:
        import llama_cpp
    except ImportError as exc:
        raise NativeError(f"llama-cpp-python is not importable: {exc}") from None
    from ..formats import _ggml

    base = _ggml.loaded_ggml_base_path()
    lib_dir = base.parent
    pkg = Path(llama_cpp.__file__).resolve().parent
    tried = [pkg.parent / "include", pkg / "include", Path(sys.prefix) / "include"]
    for inc in tried:
        if (inc / "ggml.h").exists() and (inc / "gguf.h").exists() and (inc / "ggml-backend.h").exists():
            return inc, lib_dir, base, getattr(llama_cpp, "__version__", "?")
    raise NativeError("cannot find the ggml headers of llama-cpp-python (ggml.h, gguf.h, ggml-backend.h); tried "
                      + ", ".join(str(t) for t in tried))


#: what to install where no compiler is found, per platform
WINDOWS_COMPILER_HINT = ("install MinGW-w64 gcc (MSYS2: pacman -S mingw-w64-ucrt-x86_64-gcc, or WinLibs) and put its bin "
                         "folder on PATH, or name it in CC; MSVC's cl cannot build it (GCC vector extensions, inline "
                         "assembly)")


def _compiler() -> str:
    tried = ("gcc", "clang", "cc") if WINDOWS else ("cc", "gcc", "clang")
    for cand in (os.environ.get("CC"), *tried):
        if cand and shutil.which(cand):
            return cand
    hint = WINDOWS_COMPILER_HINT if WINDOWS else "install gcc"
    raise NativeError(f"no C compiler found (tried $CC, {', '.join(tried)}): {hint} to build the native library")


def export_def(header: Path) -> str:
    """The module-definition file that exports the API (every ``bitsplit_*`` function of ``bitsplit.h``)
    from the Windows DLL: the header stays free of export markers, and nothing else is exported."""
    from .cdef import cdef, declared_functions

    return "EXPORTS\n" + "".join(f"    {name}\n" for name in declared_functions(cdef(header)))


def link_command(cc: str, objs: list[str], out: Path, lib_dir: Path, base: Path, def_file: Path | None = None,
                 windows: bool = WINDOWS) -> list[str]:
    """The command that links ``objs`` into the shared library ``out`` against llama-cpp-python's ggml-base:
    on Linux by file name with an rpath to its folder; on Windows (MinGW-w64 gcc) straight to ggml-base.dll,
    whose import the loader resolves to the ggml-base.dll llama_cpp already loaded, with ``def_file``'s
    exports and libgcc linked in (no libgcc DLL to find at run time)."""
    if windows:
        return [cc, "-shared", *objs, "-o", str(out), str(base), *([str(def_file)] if def_file else []),
                "-static-libgcc"]
    return [cc, "-shared", *objs, "-o", str(out), f"-L{lib_dir}", f"-l:{base.name}", f"-Wl,-rpath,{lib_dir}",
            "-lpthread"]


def _cache_root() -> Path:
    from ..cache import cache_dir

    return cache_dir() / "native"


def build_key() -> tuple[str, dict]:
    src = source_dir()
    inc, lib_dir, base, version = _llama_paths()
    h = hashlib.sha256()
    for name in sources(src) + headers(src):
        h.update(name.encode() + b"\0" + (src / name).read_bytes())
    for name in ("ggml.h", "gguf.h", "ggml-backend.h"):
        h.update((inc / name).read_bytes())
    h.update(" ".join(CFLAGS).encode())
    h.update(f"{version}|{base}|{platform.machine()}|{sys.platform}".encode())
    return h.hexdigest()[:20], {"src": src, "inc": inc, "lib_dir": lib_dir, "base": base, "version": version}


def build(force: bool = False, log=None) -> Path:
    """Compile the library if this exact build is not cached; returns the shared library's path."""
    key, info = build_key()
    out_dir = _cache_root() / key
    target = out_dir / LIB
    if target.exists() and not force:
        return target
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise NativeError(f"{out_dir}: cannot create the native build cache ({exc.strerror})") from None
    with open(out_dir / ".lock", "w") as lock:
        lock_exclusive(lock)  # another process may be building the same thing
        if target.exists() and not force:
            return target
        out_dir.mkdir(parents=True, exist_ok=True)  # a prune may have removed it while this one waited
        cc = _compiler()
        tmp = out_dir / f".{os.getpid()}.{LIB}"
        objs = out_dir / f".objs.{os.getpid()}"
        srcs = _by_cost(info["src"], sources(info["src"]), _compile_times())
        flags = [*CFLAGS, *[f"-I{d}" for d in include_dirs(info["src"])], f"-I{info['inc']}"]
        compiles = [[cc, *flags, "-c", str(info["src"] / s), "-o", str(objs / (s.replace("/", "_") + ".o"))]
                    for s in srcs]
        def_file = None
        if WINDOWS:
            def_file = out_dir / "bitsplit.def"
            def_file.write_text(export_def(info["src"] / "bitsplit.h"))
        link = link_command(cc, [c[-1] for c in compiles], tmp, info["lib_dir"], info["base"], def_file)
        jobs = _jobs()
        if log:
            log(f"building the native library ({cc}, {len(srcs)} sources, {min(jobs, len(srcs))} at a time: a few "
                f"minutes) against llama-cpp-python {info['version']} in {info['lib_dir']}")
        def timed(cmd: list[str]) -> tuple[subprocess.CompletedProcess, float]:
            t0 = time.monotonic()
            return subprocess.run(cmd, capture_output=True, text=True), time.monotonic() - t0

        try:
            objs.mkdir(parents=True, exist_ok=True)
            with ThreadPoolExecutor(max_workers=jobs) as pool:
                done = list(pool.map(timed, compiles))
            runs = [r for r, _ in done]
            failed = next(((c, r) for c, r in zip(compiles, runs) if r.returncode != 0), None)
            if failed is None:
                failed = (link, subprocess.run(link, capture_output=True, text=True))
                if failed[1].returncode == 0:
                    failed = None
        finally:
            shutil.rmtree(objs, ignore_errors=True)
        if failed is not None:
            tmp.unlink(missing_ok=True)
            cmd, proc = failed
            what = f"compiling {cmd[cmd.index('-c') + 1]}" if "-c" in cmd else "linking"
            tail = " | ".join((proc.stderr or proc.stdout).strip().splitlines()[-6:])
            raise NativeError(f"building the native library failed ({what}; {cc}, sources {info['src']}, headers "
                              f"{info['inc']}, libggml-base {info['base']}): {tail}")
        (out_dir / "build.txt").write_text("".join(" ".join(c) + "\n" for c in [*compiles, link]))
        os.replace(tmp, target)
        _save_compile_times({s: dt for s, (_, dt) in zip(srcs, done)})
    try:
        prune(keep=key, older_than_s=STALE_DAYS * 86400.0)
    except OSError:
        pass  # tidying the cache must never fail a build
    return target


def _last_used(d: Path) -> float:
    """When the build in ``d`` was last loaded or made: the latest modification time of its marks."""
    times = [d.stat().st_mtime]
    for name in (USED, LIB):
        try:
            times.append((d / name).stat().st_mtime)
        except OSError:
            pass
    return max(times)


def _tree_bytes(d: Path) -> int:
    n = 0
    for f in d.rglob("*"):
        try:
            n += f.lstat().st_size if f.is_file() and not f.is_symlink() else 0
        except OSError:
            pass
    return n


def prune(keep: str | None = None, older_than_s: float | None = None) -> list[tuple[Path, int]]:
    """Remove the cached builds other than ``keep`` (a build key): those unused for ``older_than_s``
    seconds, or of any age with None. A build another process is compiling (its lock held) stays; a
    process that loaded a removed build keeps its mapping. Returns (folder, bytes) of each removed."""
    root = _cache_root()
    if not root.is_dir():
        return []
    now = time.time()
    removed = []
    for d in sorted(root.iterdir()):
        if d.name == keep or d.is_symlink() or not d.is_dir():
            continue
        if older_than_s is not None and now - _last_used(d) < older_than_s:
            continue
        try:
            lock = open(d / ".lock", "a")
        except OSError:
            continue
        with lock:
            try:
                free = lock_exclusive(lock, blocking=False)
            except OSError:
                free = False
            if not free:
                continue  # being built now
            size = _tree_bytes(d)
            shutil.rmtree(d, ignore_errors=True)
        if not d.exists():
            removed.append((d, size))
    return removed


@functools.lru_cache(maxsize=1)
def load():
    """(ffi, lib) of the native library, building it first if needed."""
    import cffi

    from .cdef import cdef

    # a build happens once per install, upgrade or source change, and takes minutes: say so
    path = build(log=lambda s: print(f"bitsplit: {s} (once per install or upgrade)", file=sys.stderr, flush=True))
    try:
        (path.parent / USED).touch()  # this build is in use: no prune of stale builds takes it
    except OSError:
        pass
    ffi = cffi.FFI()
    ffi.cdef(cdef(source_dir() / "bitsplit.h"))
    try:
        lib = ffi.dlopen(str(path))
    except OSError as exc:
        raise NativeError(f"{path}: cannot load the native library: {exc} (try 'bitsplit build-native --force')") from None
    return ffi, lib
