"""A split model on disk: ``DIR/base.gguf`` + ``DIR/residual.gguf``, opened and checked together.

:func:`open_split` is the one place that decides whether a base and a residual belong together
(format version, base fingerprint, tensor names, shapes and types). Everything that loads a split
model goes through it before handing files to llama.cpp or to the native library.
"""

from __future__ import annotations

import concurrent.futures as cf
import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from gguf.constants import GGMLQuantizationType as QT

from ..errors import GGUFFormatError, InputError, MismatchError, UnsupportedModelError
from .gguf_file import GGUFFile, fingerprint, tensor_checksum, type_name
from .placement import n_layers
from .split import (BASE_CHECKSUMS_KEY, BASE_NAME, FORMAT_VERSION, KEPT_LAYERS_KEY, RESIDUAL_CHECKSUMS_KEY,
                    RESIDUAL_NAME, BitsPerWeight)

#: residual tensor types the verifier knows how to apply
SUPPORTED_RESIDUAL_TYPES = {int(QT.Q4_K), int(QT.Q5_K), int(QT.Q6_K), int(QT.Q8_0), int(QT.F16), int(QT.F32)}


@dataclass
class SplitInfo(BitsPerWeight):
    dir: Path
    architecture: str
    base_path: Path
    residual_path: Path
    base_tensors: int
    residual_tensors: int
    base_types: dict[str, int]
    residual_types: dict[str, int]
    base_bytes: int
    residual_bytes: int
    n_params: int
    residual_type: str
    fallbacks: int
    fingerprint_ok: bool
    source_file: str
    base_fingerprint: str
    n_layers: int = 0
    kept_layers: list[int] = field(default_factory=list)  # layers whole in base.gguf, no residual

    def to_json(self) -> dict:
        return {
            "dir": str(self.dir), "architecture": self.architecture, "base": str(self.base_path),
            "residual": str(self.residual_path), "base_tensors": self.base_tensors,
            "residual_tensors": self.residual_tensors, "base_types": self.base_types,
            "residual_types": self.residual_types, "base_bytes": self.base_bytes,
            "residual_bytes": self.residual_bytes, "n_params": self.n_params,
            "base_bpw": round(self.base_bpw, 4), "residual_bpw": round(self.residual_bpw, 4),
            "residual_type": self.residual_type, "fallbacks": self.fallbacks,
            "fingerprint_ok": self.fingerprint_ok, "source_file": self.source_file,
            "base_fingerprint": self.base_fingerprint,
            "placement": {"layers": self.n_layers, "kept_whole": self.kept_layers},
        }


def split_paths(model_dir: str | os.PathLike[str]) -> tuple[Path, Path]:
    d = Path(model_dir)
    if not d.exists():
        raise InputError(f"{d}: model directory not found")
    if not d.is_dir():
        raise InputError(f"{d}: is not a directory; expected a split model directory holding {BASE_NAME} and {RESIDUAL_NAME}")
    base, res = d / BASE_NAME, d / RESIDUAL_NAME
    missing = [p.name for p in (base, res) if not p.exists()]
    if missing:
        raise InputError(f"{d}: not a split model directory: {' and '.join(missing)} missing (make one with 'bitsplit split')")
    return base, res


def _meta(res: GGUFFile, key: str, kind: type):
    v = res.kv.get(key)
    if not isinstance(v, kind):
        raise GGUFFormatError(f"{res.path}: not a bitsplit residual: metadata key '{key}' missing or of the wrong type")
    return v


def check_pair(base: GGUFFile, res: GGUFFile, *, check_fingerprint: bool = True) -> bool:
    """Validate that ``res`` is a residual made from ``base``; raises on any mismatch.

    Returns whether the fingerprint matched (always True when ``check_fingerprint``).
    """
    version = _meta(res, "bitsplit.format_version", int)
    if version != FORMAT_VERSION:
        raise UnsupportedModelError(f"{res.path}: residual format version {version}, this bitsplit reads version {FORMAT_VERSION}")
    arch = _meta(res, "bitsplit.source.architecture", str)
    if arch != base.architecture:
        raise MismatchError(f"{res.path}: residual is for architecture '{arch}' but the base {base.path} is '{base.architecture}'")
    expected_fp = _meta(res, "bitsplit.base_fingerprint", str)
    fp_ok = fingerprint(base) == expected_fp
    if check_fingerprint and not fp_ok:
        raise MismatchError(
            f"{res.path}: residual was not made from this base {base.path} (base fingerprint differs): "
            "split the source again"
        )
    expected_count = res.kv.get("bitsplit.tensor_count")
    if expected_count is not None and expected_count != len(res.tensors):
        raise MismatchError(
            f"{res.path}: residual holds {len(res.tensors)} tensors but was written with {expected_count}: "
            "the file is damaged; split the source again"
        )
    for rt in res.tensors:
        if rt.name not in base:
            raise MismatchError(f"{res.path}: tensor '{rt.name}' has no weight of that name in the base {base.path}")
        bt = base.tensor(rt.name)
        if rt.shape != bt.shape:
            raise MismatchError(f"{res.path}: tensor '{rt.name}' is {rt.shape_str()} but the base has {bt.shape_str()}")
        if rt.ggml_type not in SUPPORTED_RESIDUAL_TYPES:
            raise UnsupportedModelError(
                f"{res.path}: tensor '{rt.name}' has type {rt.type_name}; residuals must be Q4_K, Q5_K, Q6_K, Q8_0, F16 or F32"
            )
    return fp_ok


def validate_split(model_dir: str | os.PathLike[str]) -> tuple[Path, Path]:
    """Check a split model directory completely (files, format, fingerprint, names, shapes, types)
    before anything loads it; returns (base path, residual path)."""
    base_p, res_p = split_paths(model_dir)
    with GGUFFile(base_p, role="base") as base, GGUFFile(res_p, role="residual") as res:
        check_pair(base, res)
    return base_p, res_p


def split_info(model_dir: str | os.PathLike[str]) -> SplitInfo:
    """Describe a split model; a fingerprint mismatch is reported (``fingerprint_ok``), not raised."""
    base_p, res_p = split_paths(model_dir)
    with GGUFFile(base_p, role="base") as base, GGUFFile(res_p, role="residual") as res:
        fp_ok = check_pair(base, res, check_fingerprint=False)
        return SplitInfo(
            dir=Path(model_dir), architecture=base.architecture, base_path=base_p, residual_path=res_p,
            base_tensors=len(base.tensors), residual_tensors=len(res.tensors),
            base_types=dict(Counter(t.type_name for t in base.tensors)),
            residual_types=dict(Counter(t.type_name for t in res.tensors)),
            base_bytes=sum(t.nbytes for t in base.tensors), residual_bytes=sum(t.nbytes for t in res.tensors),
            n_params=sum(t.n_elements for t in base.tensors),
            residual_type=str(res.kv.get("bitsplit.residual_type", "?")),
            fallbacks=int(res.kv.get("bitsplit.fallback_count", 0)),
            fingerprint_ok=fp_ok, source_file=str(res.kv.get("bitsplit.source.file", "?")),
            base_fingerprint=str(res.kv.get("bitsplit.base_fingerprint", "")),
            n_layers=n_layers(base), kept_layers=_kept_layers(res, n_layers(base)),
        )


def residual_keys(res_p: str | os.PathLike[str], *, with_fingerprint: bool = False) -> dict:
    """What a residual.gguf says of its split, read with one open: the base fingerprint it was made
    from, the base and residual types, whether the base was made with an importance matrix, and
    with ``with_fingerprint`` the residual's own fingerprint (16 hex digits; splits of one source
    share a base, not a residual), which costs a read of every tensor's edges: only the auto tree's
    setup key needs it."""
    with GGUFFile(res_p, role="residual") as rg:
        kv = rg.kv
        keys = {"base_fingerprint": str(kv.get("bitsplit.base_fingerprint", "")),
                "base_type": str(kv.get("bitsplit.base_type", "") or "") or None,
                "residual_type": str(kv.get("bitsplit.residual_type", "") or "") or None,
                "imatrix": bool(kv.get("bitsplit.imatrix"))}
        if with_fingerprint:
            keys["residual_fingerprint"] = fingerprint(rg)[:16]
        return keys


def _kept_layers(res: GGUFFile, n_layer: int) -> list[int]:
    """The layers the split left whole (none for splits made before it recorded them), each checked:
    a layer of the model, with no tensor in the residual."""
    value = res.kv.get(KEPT_LAYERS_KEY, "")
    try:
        layers = sorted(int(x) for x in str(value).split(",") if x.strip())
    except ValueError:
        raise InputError(f"{res.path}: {KEPT_LAYERS_KEY} is {value!r}, not a list of layer numbers") from None
    bad = [x for x in layers if not 0 <= x < n_layer]
    if bad:
        raise InputError(f"{res.path}: {KEPT_LAYERS_KEY} names layer {bad[0]}, the model has layers 0 to {n_layer - 1}")
    with_residual = sorted({int(t.name.split(".")[1]) for t in res.tensors
                            if t.name.startswith("blk.") and t.name.split(".")[1].isdigit()} & set(layers))
    if with_residual:
        raise InputError(f"{res.path}: {KEPT_LAYERS_KEY} says layer {with_residual[0]} is whole in the base, but the "
                         "residual holds tensors of it")
    return layers


@dataclass
class VerifyReport:
    """What `bitsplit info --verify` found: tensors checked, and those whose data changed."""

    checked: int
    bad: list[tuple[str, str]]  # (file, tensor name)
    recorded: bool              # False: the split predates checksums

    def to_json(self) -> dict:
        return {"checked": self.checked, "recorded": self.recorded, "ok": self.recorded and not self.bad,
                "bad": [{"file": f, "tensor": t} for f, t in self.bad]}


def _recorded(res: GGUFFile, key: str, n: int, what: str) -> list[int] | None:
    value = res.kv.get(key)
    if value is None:
        return None
    items = value.split(",") if isinstance(value, str) and value else []
    if len(items) != n or not all(len(i) == 8 for i in items):
        raise GGUFFormatError(f"{res.path}: {key} holds {len(items)} checksums for {n} {what} tensors")
    try:
        return [int(i, 16) for i in items]
    except ValueError:
        raise GGUFFormatError(f"{res.path}: {key} is not a list of hexadecimal checksums") from None


def verify_split(model_dir: str | os.PathLike[str], progress=None) -> VerifyReport:
    """Check every tensor of base.gguf and residual.gguf against the CRC-32 the split recorded."""
    base_p, res_p = split_paths(model_dir)
    with GGUFFile(base_p, role="base") as base, GGUFFile(res_p, role="residual") as res:
        want = {"residual.gguf": (res, _recorded(res, RESIDUAL_CHECKSUMS_KEY, len(res.tensors), "residual")),
                "base.gguf": (base, _recorded(res, BASE_CHECKSUMS_KEY, len(base.tensors), "base"))}
        if any(crcs is None for _, crcs in want.values()):
            return VerifyReport(0, [], False)
        if progress:
            progress.phase("verify", len(res.tensors) + len(base.tensors),
                           sum(t.nbytes for t in res.tensors) + sum(t.nbytes for t in base.tensors))
        bad, checked = [], 0
        # one tensor per thread: zlib and the reads release the GIL
        with cf.ThreadPoolExecutor(max_workers=max(1, os.cpu_count() or 1)) as pool:
            for fname, (g, crcs) in want.items():
                got = pool.map(lambda t, g=g: tensor_checksum(g, t), g.tensors)
                for t, crc, have in zip(g.tensors, crcs, got):
                    if have != crc:
                        bad.append((fname, t.name))
                    checked += 1
                    if progress:
                        progress.advance(tensors=1, nbytes=t.nbytes)
        return VerifyReport(checked, bad, True)


__all__ = ["SplitInfo", "VerifyReport", "verify_split", "split_info", "split_paths", "validate_split", "check_pair", "type_name",
           "SUPPORTED_RESIDUAL_TYPES"]
