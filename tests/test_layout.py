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


# --- the native units' order: which .c file calls which ------------------------------------------------------------

def _c_code(text: str) -> str:
    """C source without comments and with empty string and character literals."""
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
    text = re.sub(r"//[^\n]*", " ", text)
    return re.sub(r"\"(?:\\.|[^\"\\\n])*\"|'(?:\\.|[^'\\\n])*'", '""', text)


_NAME = r"\b((?:bs|bitsplit)_\w+)\b"
# a definition at file scope that other files can call or read: a function with its body, or an object
_DEFINITION = re.compile(r"^(?!static\b|extern\b|typedef\b)(?:[A-Za-z_]\w*[\s*]+)+?((?:bs|bitsplit)_\w+)\s*"
                         r"(?:\([^;{]*\)\s*(?:__attribute__\s*\(\(.*?\)\)\s*)?\{|=)", re.M)
_INLINE = re.compile(r"^static\s+inline\b[^;{(]*?\b(\w+)\s*\([^;{]*\)\s*\{", re.M)


def _inline_uses(src: Path) -> dict[str, set[str]]:
    """The library's names each static inline function of native/'s headers uses (a call through one
    of them is a call of the file that defines what it calls: bs_cpu_has calls bs_cpu_feats)."""
    uses = {}
    for h in sorted(src.glob("*.h")) + sorted((src / "arch").rglob("*.h")):
        text = _c_code(h.read_text(errors="replace"))
        for m in _INLINE.finditer(text):
            depth, i = 1, m.end()
            while depth and i < len(text):
                depth += {"{": 1, "}": -1}.get(text[i], 0)
                i += 1
            uses[m.group(1)] = set(re.findall(r"\b[A-Za-z_]\w*\b", text[m.end():i])) - {m.group(1)}
    return uses


def native_call_graph(src: Path) -> dict[str, dict[str, set[str]]]:
    """{unit: {unit it calls or reads: the names}} over native/*.c and native/arch/*/*.c. A unit is a .c
    file; one that includes another .c file (kernels_avxvnni_int.c) is that file's unit. A file under
    native/arch/<arch>/ is linked with the portable files and its own architecture's only."""
    files = sorted(src.glob("*.c")) + sorted((src / "arch").glob("*/*.c"))
    texts, unit_of = {}, {}
    for f in files:
        rel = f.relative_to(src).as_posix()
        raw = f.read_text(errors="replace")
        texts[rel] = _c_code(raw)
        inc = re.findall(r'^\s*#\s*include\s+"([^"]+\.c)"', raw, flags=re.M)
        unit_of[rel] = (f.parent / inc[0]).resolve().relative_to(src.resolve()).as_posix() if inc else rel
    defined: dict[str, set[str]] = {}
    for rel, text in texts.items():
        for m in _DEFINITION.finditer(text):
            defined.setdefault(m.group(1), set()).add(unit_of[rel])
    inline = _inline_uses(src)

    def arch(unit: str) -> str | None:
        return unit.split("/")[1] if unit.startswith("arch/") else None

    graph: dict[str, dict[str, set[str]]] = {u: {} for u in set(unit_of.values())}
    for rel, text in texts.items():
        me = unit_of[rel]
        words = set(re.findall(r"\b[A-Za-z_]\w*\b", text))
        names, todo = set(), [w for w in words if w in inline or re.fullmatch(_NAME, w)]
        while todo:  # through the headers' inline functions (avx2_fma_f16c -> bs_cpu_has -> bs_cpu_feats)
            n = todo.pop()
            if n not in names:
                names.add(n)
                todo += inline.get(n, ())
        for n in names:
            for d in defined.get(n, ()):
                if d != me and (arch(me) is None or arch(d) in (None, arch(me))):
                    graph[me].setdefault(d, set()).add(n)
    return graph


def find_cycle(graph: dict[str, dict[str, set[str]]]) -> list[str] | None:
    """One cycle of the graph as [a, b, ..., a], or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(u: str) -> list[str] | None:
        state[u] = 1
        path.append(u)
        for v in sorted(graph.get(u, {})):
            if state.get(v) == 1:
                return path[path.index(v):] + [v]
            if v not in state and (found := visit(v)) is not None:
                return found
        path.pop()
        state[u] = 2
        return None

    for u in sorted(graph):
        if u not in state and (found := visit(u)) is not None:
            return found
    return None


def readme_levels(readme: str) -> list[list[str]]:
    """The units of native/README.md's "units, bottom to top" list: one numbered item per level, its
    units in backquotes (``arch/<arch>/`` stands for any architecture's folder, ``*`` for any name)."""
    section = re.search(r"^## The units, bottom to top\n(.*?)(?=^## |\Z)", readme, flags=re.M | re.S)
    assert section, "native/README.md has no '## The units, bottom to top' section"
    items = re.findall(r"^\d+\.\s+(.*?)(?=^\d+\.\s|^\S|\Z)", section.group(1) + "\n", flags=re.M | re.S)
    return [[u.replace("<arch>", "*") for u in re.findall(r"`([^`]+\.c)`", item.split(" — ")[0])] for item in items]


def test_finding_a_cycle():
    assert find_cycle({"a.c": {"b.c": {"bs_b"}}, "b.c": {}}) is None
    assert find_cycle({"a.c": {"b.c": {"bs_b"}}, "b.c": {"c.c": {"bs_c"}}, "c.c": {"a.c": {"bs_a"}}}) == [
        "a.c", "b.c", "c.c", "a.c"]


def test_native_units_call_each_other_in_one_order():
    """The calls between native/'s .c files form no cycle (errors are recorded in errors.c, at the
    bottom, not in the public API's file that calls everything), and every call goes down the order that
    native/README.md writes down."""
    import fnmatch

    src = ROOT / "native"
    graph = native_call_graph(src)
    cycle = find_cycle(graph)
    assert cycle is None, "native/ units call each other in a circle: " + ", ".join(
        f"{a} -> {b} ({', '.join(sorted(graph[a][b]))})" for a, b in zip(cycle, cycle[1:]))
    assert {"errors.c", "util.c", "pool.c", "hook.c", "bitsplit.c", "arch/x86/cpu_feats.c"} <= set(graph)
    assert "bs_record_error" in graph["pool.c"]["errors.c"]  # the parser sees calls ...
    assert "bs_cpu_feats" in graph["kernels.c"]["arch/x86/cpu_feats.c"]  # ... through inline functions too
    assert "bs_family_avx512vnni_int16" in graph["kernels.c"]["arch/x86/kernels_avx2_int.c"]  # and objects
    levels = readme_levels((src / "README.md").read_text())
    level = {}
    for u in graph:
        at = [i for i, pats in enumerate(levels) if any(fnmatch.fnmatch(u, p) for p in pats)]
        assert len(at) == 1, f"native/README.md's units, bottom to top, name {u} {len(at)} times (once wanted)"
        level[u] = at[0]
    upward = [f"{a} (level {level[a] + 1}) -> {b} (level {level[b] + 1}): {', '.join(sorted(n))}"
              for a, calls in sorted(graph.items()) for b, n in sorted(calls.items()) if level[b] >= level[a]]
    assert not upward, "calls that do not go down native/README.md's order: " + "; ".join(upward)


def test_only_cpu_feats_asks_the_cpu():
    """cpuid, xgetbv, libgcc's CPU tests and the auxiliary vector are read in native/arch/<arch>/cpu_feats.c
    alone: every family's `available` and the policy ask it, so they cannot disagree about a CPU."""
    src = ROOT / "native"
    asks = re.compile(r"\bcpuid\b|\bxgetbv\b|__builtin_cpu_(?:supports|init|is)\b|\bgetauxval\b|ARCH_REQ_XCOMP_PERM")
    found = [f"{p.relative_to(src)}: {m.group(0)}" for p in sorted(src.rglob("*.[ch]"))
             if p.name != "cpu_feats.c" and p.parent.name != "tests"
             for m in [asks.search(_c_code(p.read_text(errors="replace")))] if m]
    assert not found, f"CPU detection outside native/arch/<arch>/cpu_feats.c: {found}"
    assert (src / "arch" / "x86" / "cpu_feats.c").is_file() and (src / "arch" / "arm" / "cpu_feats.c").is_file()
