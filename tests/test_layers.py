"""The package's layer order (docs/architecture.md): each subpackage imports only from the ones below
it, and nothing below the top climbs to the package root. Checked on the source (every import
statement, at module level or inside a function), so a climbing import fails here before it can make
a cycle at run time."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "bitsplit_llama"

#: bottom to top; modules of one rank may import each other
LAYERS: tuple[tuple[str, ...], ...] = (
    ("_version", "_platform", "errors", "cache"),
    ("formats",),
    ("native",),
    ("runtime",),
    ("speculative",),
    ("api",),
    ("tools",),
    ("cli",),
)
RANK = {name: i for i, names in enumerate(LAYERS) for name in names}


def _module_name(path: Path, pkg_dir: Path) -> str:
    parts = list(path.relative_to(pkg_dir.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path, module: str) -> list[tuple[int, str]]:
    """(line, absolute dotted target) of every import in the file; ``from X import a`` gives X.a
    (a submodule, or a name that is then resolved to its module by the caller)."""
    is_pkg = path.name == "__init__.py"
    here = module.split(".") if is_pkg else module.split(".")[:-1]
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here[:len(here) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            out += [(node.lineno, f"{target}.{a.name}") for a in node.names]
    return out


def _layer_of(target: str, pkg_dir: Path) -> str | None:
    """The layer a dotted import target belongs to: the package's first component below the root,
    '' for the root itself (``from bitsplit_llama import __version__``), None outside the package."""
    parts = target.split(".")
    if parts[0] != pkg_dir.name:
        return None
    if len(parts) == 1:
        return ""
    first = parts[1]
    if (pkg_dir / first).is_dir() or (pkg_dir / f"{first}.py").is_file():
        return first
    return ""  # a name defined in the package's __init__


def violations(pkg_dir: Path) -> list[str]:
    """Every import in ``pkg_dir`` that climbs: to a higher layer, or to the package root from a layer."""
    found = []
    for path in sorted(pkg_dir.rglob("*.py")):
        module = _module_name(path, pkg_dir)
        parts = module.split(".")
        if len(parts) == 1:
            continue  # the package root is the public facade: it may name any layer (lazily)
        mine = parts[1]
        if mine not in RANK:
            found.append(f"{module}: '{mine}' is in no layer (add it to LAYERS and docs/architecture.md)")
            continue
        for line, target in _imports(path, module):
            layer = _layer_of(target, pkg_dir)
            if layer is None or layer == mine:
                continue
            where = f"{path.relative_to(pkg_dir.parent)}:{line}"
            if layer == "":
                found.append(f"{where}: {module} imports the package root ({target})")
            elif layer not in RANK:
                found.append(f"{where}: {module} imports {target}, in no layer")
            elif RANK[layer] > RANK[mine]:
                found.append(f"{where}: {module} ({mine}) imports {target} ({layer}), a higher layer")
    return found


def test_no_import_climbs_the_layers():
    assert violations(ROOT / PACKAGE) == []


def test_every_subpackage_is_in_a_layer():
    pkg = ROOT / PACKAGE
    names = {p.parent.name for p in pkg.glob("*/__init__.py")} | {p.stem for p in pkg.glob("*.py")} - {"__init__"}
    assert names - {"data"} <= set(RANK), sorted(names - set(RANK))


@pytest.mark.parametrize("source,expected", [
    ("from ..tools.profile import load_profile\n", "a higher layer"),
    ("def f():\n    from ...tools import plan\n", "a higher layer"),
    ("import bitsplit_llama.api.server\n", "a higher layer"),
    ("from .. import __version__\n", "imports the package root"),
    ("from ..native import build\nfrom ..errors import InputError\n", None),
])
def test_a_climbing_import_is_found(tmp_path, source, expected):
    """The checker on a tiny copy of the layout: a climbing import (module level or inside a
    function, relative or absolute) is reported; one that goes down is not."""
    pkg = tmp_path / PACKAGE
    for sub in ("formats", "native", "runtime", "speculative", "speculative/deeper", "api", "tools"):
        (pkg / sub).mkdir(parents=True, exist_ok=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("__version__ = '0'\n")
    (pkg / "errors.py").write_text("class InputError(Exception):\n    pass\n")
    (pkg / "tools" / "profile.py").write_text("")
    (pkg / "tools" / "plan.py").write_text("")
    (pkg / "api" / "server.py").write_text("")
    (pkg / "native" / "build.py").write_text("")
    target = pkg / "speculative" / ("deeper/generate.py" if "..." in source else "generate.py")
    target.write_text(source)
    found = violations(pkg)
    if expected is None:
        assert found == []
    else:
        assert len(found) == 1 and expected in found[0], found
