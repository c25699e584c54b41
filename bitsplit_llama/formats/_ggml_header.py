"""cffi declarations for the few ggml functions and structs we call, taken from the installed headers.

No ggml struct is copied by hand into Python: the layouts we need (``ggml_init_params``,
``ggml_cplan``, ``ggml_type_traits``) and the prototypes of the functions :mod:`._ggml` calls are
read from llama-cpp-python's own ``ggml.h``, ``ggml-cpu.h`` and ``ggml-backend.h`` at run time, so a
ggml whose structs change is declared as it is (the native library's :mod:`..native.cdef` does the
same with ``bitsplit.h``). ggml's headers are much larger than cffi's C subset, so rather than the
whole header only the named declarations are extracted, with what they need: the ``enum`` and
``typedef`` definitions they use, a struct's fields where it is used by value (or named), and an
opaque ``struct X;`` where it is only pointed to.

Pure text: nothing here loads a library (that is :mod:`._ggml`, the one module that calls ggml).
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import NativeError

#: the headers declarations are taken from, in this order (ggml-cpu.h includes the other two)
HEADERS = ("ggml.h", "ggml-backend.h", "ggml-cpu.h")

_COMMENT = re.compile(r"/\*.*?\*/|//[^\n]*", re.S)
# ggml's export and attribute macros, removed from a declaration (none carries meaning for cffi)
_MACROS = re.compile(r"\bGGML_\w*API\b|\bGGML_RESTRICT\b|\bGGML_NORETURN\b|\bGGML_ATTRIBUTE_FORMAT\s*\([^)]*\)")
_STRUCT_REF = re.compile(r"\bstruct\s+(\w+)(\s*\*)?")
_ENUM_REF = re.compile(r"\benum\s+(\w+)")
_IDENT = re.compile(r"\b[A-Za-z_]\w*\b")


def include_dir() -> Path:
    """The directory of the ggml headers llama-cpp-python installed (the ones its libraries were
    built from; the native build compiles against the same)."""
    try:
        import llama_cpp
    except ImportError as exc:
        raise NativeError(f"llama-cpp-python is not importable: {exc}") from None
    pkg = Path(llama_cpp.__file__).resolve().parent
    tried = [pkg.parent / "include", pkg / "include", Path(sys.prefix) / "include"]
    for inc in tried:
        if all((inc / h).exists() for h in HEADERS):
            return inc
    raise NativeError(f"cannot find the ggml headers of llama-cpp-python ({', '.join(HEADERS)}); tried "
                      + ", ".join(str(t) for t in tried))


def _clean(text: str) -> str:
    """The header's text without comments, line continuations, preprocessor lines and the
    ``#ifdef __cplusplus`` blocks (the ``extern "C"`` wrapper)."""
    text = _COMMENT.sub(" ", text).replace("\\\n", " ")
    out, skip = [], 0
    for line in text.splitlines():
        s = line.strip()
        if s.startswith("#"):
            d = s[1:].strip()
            if skip:
                skip += d.startswith("if")
                skip -= d.startswith("endif")
            elif re.match(r"if(def)?\s*\(?\s*(defined\s*\(?\s*)?__cplusplus", d):
                skip = 1
            continue
        if not skip:
            out.append(line)
    return "\n".join(out)


def _statements(text: str) -> list[str]:
    """The top-level declarations of cleaned header text, each ending at its ``;`` (an inline
    function's body ends at its closing brace)."""
    out, depth, start = [], 0, 0
    for m in re.finditer(r"[{};]", text):
        c, i = m.group(), m.start()
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0 and not re.match(r"\s*(\w+\s*)?;", text[i + 1:i + 200]):  # a function's body
                out.append(text[start:i + 1])
                start = i + 1
        elif depth == 0:
            out.append(text[start:i + 1])
            start = i + 1
    return [" ".join(_MACROS.sub(" ", s).split()) for s in out if s.strip()]


@dataclass
class Index:
    """The top-level declarations of some headers, by kind and name (the first one of a name)."""
    structs: dict[str, str] = field(default_factory=dict)    # name -> "struct name { ... };"
    enums: dict[str, str] = field(default_factory=dict)      # name -> "enum name { ... };"
    typedefs: dict[str, str] = field(default_factory=dict)   # name -> "typedef ... name;"
    functions: dict[str, str] = field(default_factory=dict)  # name -> "ret name(args);"

    def add(self, text: str) -> None:
        for s in _statements(_clean(text)):
            if s.startswith("typedef "):
                m = re.search(r"\(\s*\*\s*(\w+)\s*\)\s*\(", s) or re.search(r"(\w+)\s*;$", s)
                if m:
                    self.typedefs.setdefault(m.group(1), s)
            elif m := re.match(r"(struct|enum)\s+(\w+)\s*\{", s):
                (self.structs if m.group(1) == "struct" else self.enums).setdefault(m.group(2), s)
            elif "{" not in s and (m := re.search(r"(\w+)\s*\(", s)):
                self.functions.setdefault(m.group(1), s)


def index(headers: list[Path]) -> Index:
    idx = Index()
    for h in headers:
        idx.add(Path(h).read_text(encoding="utf-8", errors="replace"))
    return idx


def cdef(idx: Index, functions: list[str], structs: list[str] = ()) -> str:
    """cffi declarations of ``functions`` and of ``structs`` (their fields: structs whose members we
    read or write), with what they use, from ``idx``. Types come before their users."""
    missing = [f for f in functions if f not in idx.functions] + [s for s in structs if s not in idx.structs]
    if missing:
        raise NativeError("the installed ggml headers do not declare " + ", ".join(missing))
    opaque: list[str] = []
    out: list[str] = []
    done: set[tuple[str, str]] = set()

    def need(kind: str, name: str) -> None:
        if (kind, name) in done:
            return
        done.add((kind, name))
        text = {"struct": idx.structs, "enum": idx.enums, "typedef": idx.typedefs}[kind][name]
        uses(text, own=(kind, name))
        out.append(text)

    def uses(text: str, own: tuple[str, str] = ("", "")) -> None:
        for m in _ENUM_REF.finditer(text):
            if m.group(1) in idx.enums and ("enum", m.group(1)) != own:
                need("enum", m.group(1))
        for m in _STRUCT_REF.finditer(text):
            name, pointer = m.group(1), bool(m.group(2))
            if ("struct", name) == own or ("struct", name) in done:
                continue
            if not pointer and name in idx.structs:  # by value: its layout matters
                need("struct", name)
            elif name not in opaque:
                opaque.append(name)
        for ident in _IDENT.findall(text):
            if ident in idx.typedefs and ("typedef", ident) != own:
                need("typedef", ident)

    for s in structs:
        need("struct", s)
    for f in functions:
        uses(idx.functions[f])
    decls = [f"struct {n};" for n in opaque if ("struct", n) not in done]
    return "\n".join(decls + out + [idx.functions[f] for f in functions]) + "\n"
