"""Where bitsplit keeps what it makes once and reuses: fetched models, splits made by the demo,
native builds, auto-tree profiles, eval references.

``$BITSPLIT_CACHE``, else ``$XDG_CACHE_HOME/bitsplit-llama``, else ``~/.cache/bitsplit-llama``.
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    env = os.environ.get("BITSPLIT_CACHE")
    if env:
        return Path(env)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "bitsplit-llama"
