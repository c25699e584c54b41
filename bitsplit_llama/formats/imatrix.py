"""Importance matrices (llama.cpp's ``llama-imatrix`` output), for a better Q2_K base.

Both formats llama.cpp writes are read: the GGUF one (``<tensor>.in_sum2`` and ``<tensor>.counts``)
and the legacy ``.dat`` one. Values are normalised the way ``llama-quantize`` normalises them
(sums divided by their counts), so the base equals what ``llama-quantize --imatrix`` would make.
"""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np

from ..errors import GGUFFormatError, InputError
from .gguf_file import GGUFFile, check_readable_file


def load_imatrix(path: str | Path) -> dict[str, np.ndarray]:
    """Tensor name -> float32 importance (length n_per_row, or n_per_row * n_expert for MoE)."""
    path = Path(path)
    check_readable_file(path, "imatrix")
    with open(path, "rb") as f:
        magic = f.read(4)
    data = _load_gguf(path) if magic == b"GGUF" else _load_legacy(path)
    if not data:
        raise InputError(f"{path}: imatrix holds no entries")
    for name, v in data.items():
        if not np.all(np.isfinite(v)):
            raise InputError(f"{path}: imatrix entry '{name}' contains NaN or infinite values")
    return data


def _load_gguf(path: Path) -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    with GGUFFile(path, role="imatrix") as g:
        sums = {t.name[: -len(".in_sum2")]: t for t in g.tensors if t.name.endswith(".in_sum2")}
        counts = {t.name[: -len(".counts")]: t for t in g.tensors if t.name.endswith(".counts")}
        if not sums:
            raise InputError(f"{path}: GGUF file has no '*.in_sum2' tensors: not an imatrix")
        for name, ts in sums.items():
            tc = counts.get(name)
            if tc is None:
                raise InputError(f"{path}: imatrix entry '{name}' has sums but no counts")
            if ts.ggml_type != 0 or tc.ggml_type != 0:
                raise InputError(f"{path}: imatrix entry '{name}' must be F32, is {ts.type_name}/{tc.type_name}")
            s = g.read_rows(ts, 0, ts.n_rows).view(np.float32).reshape(ts.n_rows, ts.n_per_row)
            c = g.read_rows(tc, 0, tc.n_rows).view(np.float32).reshape(-1)
            if c.size != s.shape[0]:
                raise InputError(f"{path}: imatrix entry '{name}' has {s.shape[0]} rows of sums but {c.size} counts")
            c = np.rint(c)
            norm = np.where(c[:, None] > 0, s / np.maximum(c, 1)[:, None], 1.0)
            out[name] = norm.astype(np.float32).reshape(-1)
    return out


def _load_legacy(path: Path) -> dict[str, np.ndarray]:
    raw = path.read_bytes()
    pos = 0

    def take(n: int, what: str) -> bytes:
        nonlocal pos
        if n < 0 or pos + n > len(raw):
            raise GGUFFormatError(f"{path}: truncated imatrix: {what} needs {n} bytes at offset {pos}, file has {len(raw)}")
        b = raw[pos:pos + n]
        pos += n
        return b

    (n_entries,) = struct.unpack("<i", take(4, "entry count"))
    if not 0 < n_entries < 1 << 20:
        raise InputError(f"{path}: not an imatrix file (neither GGUF nor legacy .dat: entry count {n_entries})")
    out: dict[str, np.ndarray] = {}
    for i in range(n_entries):
        (ln,) = struct.unpack("<i", take(4, f"name length of entry {i}"))
        name = take(ln, f"name of entry {i}").decode("utf-8", errors="replace")
        ncall, nval = struct.unpack("<ii", take(8, f"header of entry '{name}'"))
        if nval <= 0:
            raise InputError(f"{path}: imatrix entry '{name}' has {nval} values")
        vals = np.frombuffer(take(4 * nval, f"values of entry '{name}'"), dtype=np.float32).copy()
        out[name] = vals / ncall if ncall > 0 else vals
    return out


def write_imatrix(path: str | Path, entries: dict[str, tuple[np.ndarray, np.ndarray]], *, architecture: str,
                  datasets: list[str], chunk_count: int, chunk_size: int) -> None:
    """Write llama.cpp's imatrix GGUF: per weight, ``<name>.in_sum2`` (sums of squared activations,
    n_mat x n_per_row) and ``<name>.counts`` (rows summed, n_mat x 1), both F32, with the
    ``imatrix.*`` keys. ``entries``: name -> (sums (n_mat, n_per_row), counts (n_mat,)). Written to
    a temporary file beside ``path`` and renamed: a failure leaves no partial file."""
    import os

    import gguf

    from ..errors import OutputError

    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        w = gguf.GGUFWriter(tmp, architecture)
        w.add_type(gguf.GGUFType.IMATRIX)
        w.add_array(gguf.Keys.IMatrix.DATASETS, list(datasets))
        w.add_uint32(gguf.Keys.IMatrix.CHUNK_COUNT, int(chunk_count))
        w.add_uint32(gguf.Keys.IMatrix.CHUNK_SIZE, int(chunk_size))
        for name in sorted(entries):
            sums, counts = entries[name]
            sums = np.ascontiguousarray(sums, dtype=np.float32)
            counts = np.ascontiguousarray(counts, dtype=np.float32).reshape(-1, 1)
            if sums.ndim != 2 or sums.shape[0] != counts.shape[0]:
                raise ValueError(f"imatrix entry '{name}': sums {sums.shape} and counts {counts.shape} disagree")
            w.add_tensor(f"{name}.in_sum2", sums)
            w.add_tensor(f"{name}.counts", counts)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        os.replace(tmp, path)
    except OSError as e:
        raise OutputError(f"{path}: cannot write the imatrix ({e.strerror or e})") from e
    finally:
        if tmp.exists():
            tmp.unlink()
