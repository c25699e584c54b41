"""``profile.json``, a split's measured acceptance profile (``bitsplit profile`` writes it beside
the split): its file format, reading and writing. The measurement itself is
:mod:`bitsplit_llama.tools.profile`; ``--tree-nodes auto`` and ``bitsplit plan`` read it through here.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from ..errors import InputError, OutputError
from .modeldir import residual_keys, validate_split

PROFILE_FILE = "profile.json"
PROFILE_FORMAT = 1


def profile_path(split: str | os.PathLike[str]) -> Path:
    return Path(split) / PROFILE_FILE


def split_keys(split: Path, *, with_fingerprint: bool = False) -> dict:
    """The split's base fingerprint, base type, residual type, whether its base was made with an
    importance matrix (residual.gguf's metadata) and with ``with_fingerprint`` the residual's own
    fingerprint, once validated."""
    _, res_p = validate_split(split)
    return residual_keys(res_p, with_fingerprint=with_fingerprint)


def profile_base_type(prof: dict, path: str | os.PathLike[str] | None = None) -> str | None:
    """The base type a profile was measured with: recorded in it (profiles from this version on),
    else read from the split it sits in; None where neither says."""
    if prof.get("base_type"):
        return str(prof["base_type"])
    if path is not None:
        d = Path(path)
        d = d if d.is_dir() else d.parent
        try:
            return split_keys(d)["base_type"]
        except (InputError, OSError):  # not a split directory: the type is unknown
            return None
    return None


def profile_rows(row: dict) -> int:
    """The rows of a verify pass at one of a profile's tree sizes: those it measured (the root, the
    drafter's nodes and the text's verified: ``rows_per_verify``), else (a profile written before
    that was recorded, of the drafter's trees alone) the tree's nodes and its root."""
    if row.get("rows_per_verify"):
        return max(1, round(float(row["rows_per_verify"])))
    return int(row["nodes"]) + 1


def write_profile(split: str | os.PathLike[str], prof: dict) -> Path:
    path = profile_path(split)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps(prof, indent=1))
        os.replace(tmp, path)
    except OSError as e:
        if tmp.exists():
            tmp.unlink()
        raise OutputError(f"{path}: cannot write the profile ({e.strerror or e})") from e
    return path


def load_profile(split: str | os.PathLike[str], *, strict: bool = False) -> dict | None:
    """The split's profile if it has one that belongs to its base, else None (``strict``: an
    InputError saying why)."""
    path = profile_path(split)
    if not path.is_file():
        if strict:
            raise InputError(f"{path}: no acceptance profile (make one with 'bitsplit profile {split}')")
        return None
    try:
        prof = json.loads(path.read_text())
        ok = (prof.get("format") == PROFILE_FORMAT and isinstance(prof.get("profile"), list) and prof["profile"]
              and all({"nodes", "tokens_per_verify", "ms_per_verify", "ms_drafting_per_cycle",
                       "draft_passes_per_cycle"} <= set(r) for r in prof["profile"]))
    except (OSError, ValueError, AttributeError):
        ok = False
    if not ok:
        if strict:
            raise InputError(f"{path}: not an acceptance profile of this bitsplit (remake it with 'bitsplit profile')")
        return None
    keys = split_keys(Path(split))
    if prof.get("base_fingerprint") != keys["base_fingerprint"]:
        if strict:
            raise InputError(f"{path}: measured on another base.gguf (remake it with 'bitsplit profile')")
        return None
    for k in ("base_type", "residual_type"):  # profiles written before they were recorded: the split says
        prof[k] = prof.get(k) or keys[k]
    return prof


def load_profile_file(path: str | os.PathLike[str]) -> dict:
    """A profile given by path (a profile.json, or a split directory holding one), for ``plan``."""
    p = Path(path)
    if p.is_dir():
        return load_profile(p, strict=True)
    if not p.is_file():
        raise InputError(f"{p}: profile not found")
    try:
        prof = json.loads(p.read_text())
        rows = prof["profile"]
        for r in rows:
            float(r["tokens_per_verify"]), int(r["nodes"]), float(r["draft_passes_per_cycle"])
    except (OSError, ValueError, KeyError, TypeError):
        raise InputError(f"{p}: not an acceptance profile (make one with 'bitsplit profile SPLIT')") from None
    return prof
