"""The only module that knows the native library: where its sources are, how it is built against
the installed llama-cpp-python, its C declarations, and its status codes.

The library is compiled on first use (or by ``bitsplit build-native``) with the system C compiler,
against exactly the ggml headers that llama-cpp-python installed and linked to exactly the
``libggml-base`` it loaded, so the process holds one ggml. Builds are cached per source hash,
llama-cpp-python version and library path under ``<cache>/native/``; nothing is compiled twice.
Calls go through cffi's ABI mode (the hot path, the eval callback, is called by llama.cpp directly).
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import sys
from importlib import resources
from pathlib import Path

from .errors import NativeError

# --- declarations (keep in sync with native/bitsplit.h) ---------------------------------------
CDEF = """
typedef struct bitsplit_ctx bitsplit_ctx;
struct ggml_tensor;

enum bitsplit_status {
    BITSPLIT_OK = 0, BITSPLIT_E_IO = 1, BITSPLIT_E_FORMAT = 2, BITSPLIT_E_MISMATCH = 3,
    BITSPLIT_E_UNSUPPORTED = 4, BITSPLIT_E_NOMEM = 5, BITSPLIT_E_INVALID = 6, BITSPLIT_E_STATE = 7,
};
enum bitsplit_precision { BITSPLIT_PREC_AUTO = 0, BITSPLIT_PREC_F32 = 1, BITSPLIT_PREC_BF16 = 2 };
enum bitsplit_mode { BITSPLIT_MODE_AUTO = 0, BITSPLIT_MODE_ADD = 1 };

typedef struct bitsplit_counters {
    uint64_t n_products; uint64_t n_add_products; uint64_t n_get_rows; uint64_t n_columns;
    uint64_t bytes_residual; uint64_t bytes_base; uint64_t ns_inside; uint64_t n_errors;
    uint64_t n_draft_products; uint64_t ns_draft;
} bitsplit_counters;

const char * bitsplit_status_str(int status);
int bitsplit_ctx_load(const char * residual_path, const char * base_path, bitsplit_ctx ** out, char * err, size_t err_size);
void bitsplit_ctx_free(bitsplit_ctx * ctx);
int64_t bitsplit_ctx_n_tensors(const bitsplit_ctx * ctx);
int bitsplit_ctx_tensor_info(const bitsplit_ctx * ctx, int64_t i, const char ** name, int64_t ne[4], int * base_type, int * res_type);
void bitsplit_ctx_set_enabled(bitsplit_ctx * ctx, bool enabled);
void bitsplit_ctx_set_draft_kernel(bitsplit_ctx * ctx, bool on);
bool bitsplit_ctx_get_enabled(const bitsplit_ctx * ctx);
int bitsplit_ctx_set_precision(bitsplit_ctx * ctx, int precision);
int bitsplit_ctx_set_mode(bitsplit_ctx * ctx, int mode);
int bitsplit_ctx_set_threads(bitsplit_ctx * ctx, int n_threads);
void bitsplit_ctx_get_counters(const bitsplit_ctx * ctx, bitsplit_counters * out);
void bitsplit_ctx_reset_counters(bitsplit_ctx * ctx);
int bitsplit_ctx_take_error(bitsplit_ctx * ctx, char * buf, size_t buf_size);
bool bitsplit_eval_callback(struct ggml_tensor * t, bool ask, void * user_data);
int bitsplit_ctx_matmul(bitsplit_ctx * ctx, const char * name, const float * x, int64_t n_cols, float * y, bool with_base);
const char * bitsplit_kernel_name(void);
int bitsplit_ctx_set_kernel(bitsplit_ctx * ctx, const char * name);
const char * bitsplit_ctx_kernel(const bitsplit_ctx * ctx);
"""

STATUS_NAMES = {0: "OK", 1: "E_IO", 2: "E_FORMAT", 3: "E_MISMATCH", 4: "E_UNSUPPORTED", 5: "E_NOMEM",
                6: "E_INVALID", 7: "E_STATE"}

SOURCES = ("bitsplit.c", "kernels.c", "kernels_x86.c", "kernels_int.c")
HEADERS = ("bitsplit.h", "bs_internal.h")
CFLAGS = ("-std=c11", "-O3", "-fPIC", "-Wall", "-fvisibility=default")


def source_dir() -> Path:
    """The C sources: packaged as bitsplit_llama.native_src (the repository's native/ folder)."""
    try:
        p = Path(str(resources.files("bitsplit_llama.native_src")))
        if (p / "bitsplit.h").exists():
            return p
    except (ModuleNotFoundError, TypeError):
        pass
    p = Path(__file__).resolve().parent.parent / "native"
    if (p / "bitsplit.h").exists():
        return p
    raise NativeError("cannot find the native sources (bitsplit_llama.native_src or ../native next to the package)")


def _llama_paths() -> tuple[Path, Path, Path, str]:
    """(include dir, lib dir, libggml-base path, llama-cpp-python version) of the installed llama_cpp."""
    try:
        import llama_cpp
    except ImportError as exc:
        raise NativeError(f"llama-cpp-python is not importable: {exc}") from None
    from . import _ggml

    base = _ggml.loaded_ggml_base_path()
    lib_dir = base.parent
    pkg = Path(llama_cpp.__file__).resolve().parent
    tried = [pkg.parent / "include", pkg / "include", Path(sys.prefix) / "include"]
    for inc in tried:
        if (inc / "ggml.h").exists() and (inc / "gguf.h").exists() and (inc / "ggml-backend.h").exists():
            return inc, lib_dir, base, getattr(llama_cpp, "__version__", "?")
    raise NativeError("cannot find the ggml headers of llama-cpp-python (ggml.h, gguf.h, ggml-backend.h); tried "
                      + ", ".join(str(t) for t in tried))


def _compiler() -> str:
    for cand in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if cand and shutil.which(cand):
            return cand
    raise NativeError("no C compiler found (tried $CC, cc, gcc, clang): install gcc to build the native library")


def _cache_root() -> Path:
    from .fetch import cache_dir

    return cache_dir() / "native"


def build_key() -> tuple[str, dict]:
    src = source_dir()
    inc, lib_dir, base, version = _llama_paths()
    h = hashlib.sha256()
    for name in SOURCES + HEADERS:
        h.update(name.encode() + b"\0" + (src / name).read_bytes())
    for name in ("ggml.h", "gguf.h", "ggml-backend.h"):
        h.update((inc / name).read_bytes())
    h.update(" ".join(CFLAGS).encode())
    h.update(f"{version}|{base}|{platform.machine()}|{sys.platform}".encode())
    return h.hexdigest()[:20], {"src": src, "inc": inc, "lib_dir": lib_dir, "base": base, "version": version}


def library_path() -> Path:
    key, _ = build_key()
    return _cache_root() / key / "libbitsplit.so"


def build(force: bool = False, log=None) -> Path:
    """Compile the library if this exact build is not cached; returns the shared library's path."""
    key, info = build_key()
    out_dir = _cache_root() / key
    target = out_dir / "libbitsplit.so"
    if target.exists() and not force:
        return target
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise NativeError(f"{out_dir}: cannot create the native build cache ({exc.strerror})") from None
    with open(out_dir / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be building the same thing
        if target.exists() and not force:
            return target
        cc = _compiler()
        tmp = out_dir / f".libbitsplit.{os.getpid()}.so"
        cmd = [cc, *CFLAGS, "-shared", f"-I{info['src']}", f"-I{info['inc']}",
               *[str(info["src"] / s) for s in SOURCES], "-o", str(tmp),
               f"-L{info['lib_dir']}", f"-l:{info['base'].name}", f"-Wl,-rpath,{info['lib_dir']}", "-lpthread"]
        if log:
            log(f"building the native library ({cc}) against llama-cpp-python {info['version']} in {info['lib_dir']}")
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            tmp.unlink(missing_ok=True)
            tail = " | ".join((proc.stderr or proc.stdout).strip().splitlines()[-6:])
            raise NativeError(f"building the native library failed ({cc}, sources {info['src']}, headers "
                              f"{info['inc']}, libggml-base {info['base']}): {tail}")
        (out_dir / "build.txt").write_text(" ".join(cmd) + "\n")
        os.replace(tmp, target)
    return target


@functools.lru_cache(maxsize=1)
def load():
    """(ffi, lib) of the native library, building it first if needed."""
    import cffi

    path = build()
    ffi = cffi.FFI()
    ffi.cdef(CDEF)
    try:
        lib = ffi.dlopen(str(path))
    except OSError as exc:
        raise NativeError(f"{path}: cannot load the native library: {exc} (try 'bitsplit build-native --force')") from None
    return ffi, lib


def status_text(status: int) -> str:
    ffi, lib = load()
    return ffi.string(lib.bitsplit_status_str(status)).decode()


def callback_address() -> int:
    """Address of bitsplit_eval_callback, for llama_context_params.cb_eval."""
    ffi, lib = load()
    return int(ffi.cast("uintptr_t", lib.bitsplit_eval_callback))
