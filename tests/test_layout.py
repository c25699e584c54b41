"""The package's layout and the native library's build inputs: every subpackage ships, the C API
is declared from bitsplit.h alone, and the build compiles what this architecture needs."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from bitsplit_llama.native import build, cdef

ROOT = Path(__file__).resolve().parent.parent


def test_every_subpackage_is_packaged():
    tomllib = pytest.importorskip("tomllib")
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(cfg["packages"])
    on_disk = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "bitsplit_llama").rglob("__init__.py")
               if "__pycache__" not in p.parts}
    assert on_disk <= listed, f"subpackages missing from pyproject.toml: {sorted(on_disk - listed)}"
    data = cfg["package-data"]["bitsplit_llama.native_src"]
    assert {"*.c", "*.h", "arch/**/*.c", "arch/**/*.h"} <= set(data)


def test_cdef_is_generated_from_the_header_and_parses():
    import cffi

    text = cdef.cdef(build.source_dir() / "bitsplit.h")
    assert "#" not in text and "extern" not in text and "/*" not in text
    ffi = cffi.FFI()
    ffi.cdef(text)  # raises on anything cffi cannot parse
    names = cdef.declared_functions(text)
    assert "bitsplit_ctx_load" in names and "bitsplit_eval_callback" in names
    assert ffi.typeof("bitsplit_counters").kind == "struct"


def test_header_preprocessing():
    header = '''/* a comment */
#ifndef X_H
#define X_H
#include <stdint.h>
#define BS_API
#ifdef __cplusplus
extern "C" {
#endif
// one line
BS_API int bitsplit_a(int x); /* trailing */
typedef struct bitsplit_s { int v; /* inside */ } bitsplit_s;
#ifdef __cplusplus
}
#endif
#endif
'''
    text = cdef.header_to_cdef(header)
    assert re.sub(r"\s+", " ", text).strip() == "int bitsplit_a(int x); typedef struct bitsplit_s { int v; } bitsplit_s;"
    assert cdef.declared_functions(text) == ["bitsplit_a"]


def test_every_declared_function_is_exported():
    from bitsplit_llama import native

    ffi, lib = native.load()
    missing = [n for n in cdef.declared_functions(cdef.cdef(build.source_dir() / "bitsplit.h"))
               if not hasattr(lib, n)]
    assert not missing, f"declared in bitsplit.h but not exported by the library: {missing}"


@pytest.mark.parametrize("machine,arch", [("x86_64", "x86"), ("aarch64", "arm"), ("riscv64", None)])
def test_sources_are_the_portable_files_plus_this_architectures(tmp_path, monkeypatch, machine, arch):
    for f in ("bitsplit.c", "kernels.c", "bitsplit.h", "arch/x86/tiles.c", "arch/x86/x86.h", "arch/arm/neon.c"):
        (tmp_path / f).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / f).write_text("")
    monkeypatch.setattr(build.platform, "machine", lambda: machine)
    want = {"x86": ["arch/x86/tiles.c"], "arm": ["arch/arm/neon.c"], None: []}[arch]
    assert build.sources(tmp_path) == ["bitsplit.c", "kernels.c"] + want
    assert build.include_dirs(tmp_path) == [tmp_path] + ([tmp_path / "arch" / arch] if arch else [])
    # the cache key covers every header, the other architectures' included
    assert build.headers(tmp_path) == ["bitsplit.h", "arch/x86/x86.h"]


def test_sources_of_a_flat_native_folder(tmp_path, monkeypatch):
    for f in ("bitsplit.c", "kernels_x86.c", "bitsplit.h"):
        (tmp_path / f).write_text("")
    monkeypatch.setattr(build.platform, "machine", lambda: "x86_64")
    assert build.sources(tmp_path) == ["bitsplit.c", "kernels_x86.c"]
    assert build.include_dirs(tmp_path) == [tmp_path]


def test_native_src_names_another_checkouts_sources(tmp_path, monkeypatch):
    """BITSPLIT_NATIVE_SRC builds from another native/ folder (bench/e2e_ab.py times two builds end to
    end with it): the same sources give the same cached build, a changed source another, and a folder
    without the sources is refused by name."""
    from bitsplit_llama.errors import NativeError

    monkeypatch.delenv(build.SRC_ENV, raising=False)
    default_key = build.build_key()[0]
    copy = tmp_path / "native"
    shutil.copytree(build.source_dir(), copy)
    monkeypatch.setenv(build.SRC_ENV, str(copy))
    assert build.source_dir() == copy.resolve()
    assert build.build_key()[0] == default_key
    with open(copy / build.sources(copy)[0], "a") as f:
        f.write("\n/* changed */\n")
    assert build.build_key()[0] != default_key
    empty = tmp_path / "empty"
    empty.mkdir()
    monkeypatch.setenv(build.SRC_ENV, str(empty))
    with pytest.raises(NativeError, match=r"BITSPLIT_NATIVE_SRC=.*empty: no bitsplit\.h there"):
        build.source_dir()
