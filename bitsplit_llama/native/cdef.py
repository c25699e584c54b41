"""The cffi declarations of the native library, generated from its header ``native/bitsplit.h``.

The header is the one description of the C API; cffi reads it after a minimal preprocessing:
comments, preprocessor lines, ``#ifdef __cplusplus`` blocks (the ``extern "C"`` wrapper) and
macros defined empty (include guards, export markers) are removed. Whatever is left must be plain
C declarations that cffi parses (tests/test_verifier.py checks it does, and that every
``bitsplit_*`` function the header declares is exported by the built library).
"""

from __future__ import annotations

import re
from pathlib import Path

_COMMENT = re.compile(r"/\*.*?\*/|//[^\n]*", re.S)
_FUNCTION = re.compile(r"\b(bitsplit_\w+)\s*\(")


def header_to_cdef(text: str) -> str:
    """The declarations of a C header, in the subset of C that cffi's cdef accepts."""
    text = _COMMENT.sub(" ", text).replace("\\\n", " ")
    out: list[str] = []
    empty_macros: list[str] = []
    skip = 0  # nesting depth inside an #if(def) __cplusplus block
    for line in text.splitlines():
        s = line.strip()
        if s.startswith("#"):
            d = s[1:].strip()
            if skip:
                if d.startswith("if"):
                    skip += 1
                elif d.startswith("endif"):
                    skip -= 1
            elif re.match(r"if(def)?\s*\(?\s*(defined\s*\(?\s*)?__cplusplus", d):
                skip = 1
            else:
                m = re.match(r"define\s+(\w+)\s*$", d)
                if m:
                    empty_macros.append(m.group(1))
            continue
        if skip or not s:
            continue
        out.append(line.rstrip())
    body = "\n".join(out)
    body = re.sub(r'extern\s+"C"\s*\{', "", body)
    for name in empty_macros:
        body = re.sub(rf"\b{name}\b", "", body)
    return body + "\n"


def cdef(header: str | Path) -> str:
    """``header_to_cdef`` of a header file."""
    return header_to_cdef(Path(header).read_text(encoding="utf-8"))


def declared_functions(cdef_text: str) -> list[str]:
    """The ``bitsplit_*`` functions declared in generated declarations, in order."""
    return list(dict.fromkeys(_FUNCTION.findall(cdef_text)))
