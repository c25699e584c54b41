"""Reading GGUF files defensively, and writing them tensor by tensor.

A GGUF file is parsed here (header, key/values, tensor infos) with every count, length, type and
offset checked against the file's size before anything is read, so a truncated or crafted file
gives one clear :class:`GGUFFormatError` naming the file and the field, never a crash or a
multi-gigabyte allocation. Tensor data is read on demand, a few rows at a time (see
:meth:`GGUFFile.read_rows`), which keeps the split's memory bounded whatever the model's size.

Shapes: :attr:`TensorInfo.shape` is in GGUF/ggml order, ``(ne0, ne1, ...)`` where ``ne0`` is the row
width (the contiguous dimension). Numpy arrays of rows are ``(n_rows, ne0)``.
"""

from __future__ import annotations

import hashlib
import math
import mmap
import os
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Iterable

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

from ..errors import GGUFFormatError, InputError, OutputError

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
# Limits well beyond any real model; they exist so a crafted header cannot make us loop or
# allocate without bound before the size checks catch it.
MAX_TENSORS = 1 << 20
MAX_KV = 1 << 20
MAX_DIMS = 4
MAX_STRING = 1 << 26

_SCALAR_FORMATS = {
    GGUFValueType.UINT8: "<B", GGUFValueType.INT8: "<b", GGUFValueType.UINT16: "<H",
    GGUFValueType.INT16: "<h", GGUFValueType.UINT32: "<I", GGUFValueType.INT32: "<i",
    GGUFValueType.FLOAT32: "<f", GGUFValueType.BOOL: "<?", GGUFValueType.UINT64: "<Q",
    GGUFValueType.INT64: "<q", GGUFValueType.FLOAT64: "<d",
}
_NUMPY_DTYPES = {
    GGUFValueType.UINT8: np.uint8, GGUFValueType.INT8: np.int8, GGUFValueType.UINT16: np.uint16,
    GGUFValueType.INT16: np.int16, GGUFValueType.UINT32: np.uint32, GGUFValueType.INT32: np.int32,
    GGUFValueType.FLOAT32: np.float32, GGUFValueType.BOOL: np.bool_, GGUFValueType.UINT64: np.uint64,
    GGUFValueType.INT64: np.int64, GGUFValueType.FLOAT64: np.float64,
}


def type_name(ggml_type: int) -> str:
    try:
        return GGMLQuantizationType(ggml_type).name
    except ValueError:
        return f"type#{ggml_type}"


def type_sizes(ggml_type: int) -> tuple[int, int]:
    """(block size in elements, bytes per block) of a ggml type."""
    return GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]   # GGUF order: (ne0 = row width, ne1, ...)
    ggml_type: int
    offset: int              # absolute byte offset of the data in the file
    nbytes: int

    @property
    def n_per_row(self) -> int:
        return self.shape[0]

    @property
    def n_rows(self) -> int:
        return math.prod(self.shape[1:])

    @property
    def n_elements(self) -> int:
        return math.prod(self.shape)

    @property
    def row_bytes(self) -> int:
        blck, size = type_sizes(self.ggml_type)
        return self.n_per_row // blck * size

    @property
    def type_name(self) -> str:
        return type_name(self.ggml_type)

    def shape_str(self) -> str:
        return "x".join(str(d) for d in self.shape)


class _Cursor:
    """Bounds-checked little-endian reader over a memory map."""

    def __init__(self, buf: mmap.mmap, path: Path):
        self.buf, self.pos, self.path, self.size = buf, 0, path, len(buf)

    def need(self, n: int, what: str) -> None:
        if n < 0 or self.pos + n > self.size:
            raise GGUFFormatError(
                f"{self.path}: truncated GGUF: {what} needs {n} bytes at offset {self.pos} "
                f"but the file has {self.size} bytes"
            )

    def scalar(self, vtype: GGUFValueType, what: str) -> Any:
        fmt = _SCALAR_FORMATS[vtype]
        n = struct.calcsize(fmt)
        self.need(n, what)
        (v,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += n
        return v

    def u32(self, what: str) -> int:
        return self.scalar(GGUFValueType.UINT32, what)

    def u64(self, what: str) -> int:
        return self.scalar(GGUFValueType.UINT64, what)

    def string(self, what: str) -> str:
        n = self.u64(f"length of {what}")
        if n > MAX_STRING:
            raise GGUFFormatError(f"{self.path}: {what} claims a length of {n} bytes (limit {MAX_STRING})")
        self.need(n, what)
        raw = bytes(self.buf[self.pos:self.pos + n])
        self.pos += n
        return raw.decode("utf-8", errors="replace")

    def value(self, vtype: int, what: str, depth: int = 0) -> Any:
        try:
            vt = GGUFValueType(vtype)
        except ValueError:
            raise GGUFFormatError(f"{self.path}: {what} has unknown value type {vtype}") from None
        if vt == GGUFValueType.STRING:
            return self.string(what)
        if vt == GGUFValueType.ARRAY:
            if depth > 2:
                raise GGUFFormatError(f"{self.path}: {what} nests arrays too deeply")
            sub = self.u32(f"element type of {what}")
            count = self.u64(f"length of {what}")
            try:
                sub_t = GGUFValueType(sub)
            except ValueError:
                raise GGUFFormatError(f"{self.path}: {what} has unknown element type {sub}") from None
            if sub_t in _NUMPY_DTYPES:
                itemsize = np.dtype(_NUMPY_DTYPES[sub_t]).itemsize
                self.need(count * itemsize, what)
                arr = np.frombuffer(self.buf, dtype=_NUMPY_DTYPES[sub_t], count=count, offset=self.pos).copy()
                self.pos += count * itemsize
                return arr
            if count > self.size:  # every element takes at least one byte
                raise GGUFFormatError(f"{self.path}: {what} claims {count} elements, more than the file's size")
            if sub_t == GGUFValueType.STRING:  # vocabularies: 10^5 strings, keep this loop tight
                buf, pos, size, out = self.buf, self.pos, self.size, []
                unpack = struct.unpack_from
                for i in range(count):
                    if pos + 8 > size:
                        self.pos = pos
                        self.need(8, f"{what}[{i}]")
                    (n,) = unpack("<Q", buf, pos)
                    pos += 8
                    if n > MAX_STRING or pos + n > size:
                        self.pos = pos
                        self.need(n, f"{what}[{i}]")
                    out.append(buf[pos:pos + n].decode("utf-8", errors="replace"))
                    pos += n
                self.pos = pos
                return out
            return [self.value(sub, f"{what}[{i}]", depth + 1) for i in range(count)]
        return self.scalar(vt, what)


class GGUFFile:
    """A parsed, validated GGUF header with on-demand access to tensor rows.

    ``role`` names the file in messages ("source", "base", "residual") when the path alone is not
    telling enough. Use as a context manager or call :meth:`close`.
    """

    def __init__(self, path: str | os.PathLike[str], role: str = "GGUF"):
        self.path = Path(path)
        self.role = role
        check_readable_file(self.path, role)
        self._fh: BinaryIO = open(self.path, "rb")
        try:
            self.size = os.fstat(self._fh.fileno()).st_size
            if self.size < 24:
                raise GGUFFormatError(f"{self.path}: not a GGUF file ({self.size} bytes, too short for a GGUF header)")
            with mmap.mmap(self._fh.fileno(), 0, access=mmap.ACCESS_READ) as buf:
                self._parse(buf)
        except BaseException:
            self._fh.close()
            raise

    # -- parsing ----------------------------------------------------------------------------
    def _parse(self, buf: mmap.mmap) -> None:
        cur = _Cursor(buf, self.path)
        magic = bytes(buf[:4])
        if magic != GGUF_MAGIC:
            raise GGUFFormatError(f"{self.path}: not a GGUF file (starts with {magic!r}, expected b'GGUF')")
        cur.pos = 4
        self.version = cur.u32("version")
        if self.version not in (2, 3):
            raise GGUFFormatError(f"{self.path}: unsupported GGUF version {self.version} (expected 2 or 3)")
        n_tensors = cur.u64("tensor count")
        n_kv = cur.u64("key/value count")
        if n_tensors > MAX_TENSORS or n_kv > MAX_KV:
            raise GGUFFormatError(
                f"{self.path}: header claims {n_tensors} tensors and {n_kv} key/values (limits {MAX_TENSORS}, {MAX_KV})"
            )
        self.kv: dict[str, Any] = {}
        for i in range(n_kv):
            key = cur.string(f"key #{i}")
            vtype = cur.u32(f"type of key '{key}'")
            self.kv[key] = cur.value(vtype, f"value of key '{key}'")
        self.kv_end = cur.pos  # the key/value section is bytes [24, kv_end) (GGUF v2/v3 header: 24 bytes)
        align = self.kv.get("general.alignment", DEFAULT_ALIGNMENT)
        if not isinstance(align, int) or align <= 0 or align & (align - 1) or align > 1 << 20:
            raise GGUFFormatError(f"{self.path}: general.alignment is {align!r}, expected a power of two")
        self.alignment = int(align)

        raw_infos = []
        for i in range(n_tensors):
            name = cur.string(f"name of tensor #{i}")
            n_dims = cur.u32(f"dimension count of tensor '{name}'")
            if not 1 <= n_dims <= MAX_DIMS:
                raise GGUFFormatError(f"{self.path}: tensor '{name}' has {n_dims} dimensions (expected 1..{MAX_DIMS})")
            dims = tuple(cur.u64(f"dimension {d} of tensor '{name}'") for d in range(n_dims))
            ttype = cur.u32(f"type of tensor '{name}'")
            rel = cur.u64(f"offset of tensor '{name}'")
            raw_infos.append((name, dims, ttype, rel))
        self.header_end = cur.pos
        self.data_offset = -(-cur.pos // self.alignment) * self.alignment

        self.tensors: list[TensorInfo] = []
        self._by_name: dict[str, TensorInfo] = {}
        for name, dims, ttype, rel in raw_infos:
            try:
                qt = GGMLQuantizationType(ttype)
                blck, bsize = GGML_QUANT_SIZES[qt]
            except (ValueError, KeyError):
                raise GGUFFormatError(f"{self.path}: tensor '{name}' has unknown ggml type id {ttype}") from None
            if any(d <= 0 for d in dims) or math.prod(dims) > 1 << 48:
                raise GGUFFormatError(f"{self.path}: tensor '{name}' has absurd dimensions {'x'.join(map(str, dims))}")
            if dims[0] % blck:
                raise GGUFFormatError(
                    f"{self.path}: tensor '{name}' is {qt.name} with row width {dims[0]}, "
                    f"not a multiple of the block size {blck}"
                )
            nbytes = math.prod(dims) // blck * bsize
            if rel % self.alignment:
                raise GGUFFormatError(f"{self.path}: tensor '{name}' data offset {rel} is not aligned to {self.alignment}")
            start = self.data_offset + rel
            if start + nbytes > self.size:
                raise GGUFFormatError(
                    f"{self.path}: truncated GGUF: tensor '{name}' needs bytes up to {start + nbytes} "
                    f"but the file has {self.size} bytes"
                )
            if name in self._by_name:
                raise GGUFFormatError(f"{self.path}: duplicate tensor name '{name}'")
            info = TensorInfo(name, dims, int(qt), start, nbytes)
            self.tensors.append(info)
            self._by_name[name] = info
        # overlapping tensor data is never produced by writers; it would make a residual alias a weight
        spans = sorted((t.offset, t.offset + t.nbytes, t.name) for t in self.tensors)
        for (a0, a1, an), (b0, b1, bn) in zip(spans, spans[1:]):
            if b0 < a1:
                raise GGUFFormatError(f"{self.path}: tensors '{an}' and '{bn}' overlap in the file")

    # -- access -----------------------------------------------------------------------------
    @property
    def architecture(self) -> str:
        arch = self.kv.get("general.architecture")
        if not isinstance(arch, str):
            raise GGUFFormatError(f"{self.path}: has no general.architecture key")
        return arch

    def tensor(self, name: str) -> TensorInfo:
        try:
            return self._by_name[name]
        except KeyError:
            raise InputError(f"{self.path}: has no tensor '{name}'") from None

    def __contains__(self, name: str) -> bool:
        return name in self._by_name

    def read_rows(self, t: TensorInfo, start: int, count: int) -> np.ndarray:
        """Raw bytes of rows [start, start+count) of ``t`` as a (count, row_bytes) uint8 array."""
        if not (0 <= start and count >= 0 and start + count <= t.n_rows):
            raise IndexError(f"rows {start}..{start + count} out of range for '{t.name}' ({t.n_rows} rows)")
        rb = t.row_bytes
        out = np.empty((count, rb), dtype=np.uint8)
        n = os.preadv(self._fh.fileno(), [memoryview(out).cast("B")], t.offset + start * rb) if count else 0
        if n != out.nbytes:
            raise GGUFFormatError(f"{self.path}: file shrank while reading tensor '{t.name}'")
        return out

    def header_bytes(self) -> bytes:
        self._fh.seek(0)
        return self._fh.read(self.data_offset)

    def close(self) -> None:
        self._fh.close()

    def __enter__(self) -> "GGUFFile":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def check_readable_file(path: Path, role: str) -> None:
    """Raise InputError unless ``path`` is an existing, readable regular file."""
    if not path.exists():
        raise InputError(f"{path}: {role} file not found")
    if path.is_dir():
        raise InputError(f"{path}: is a directory, expected a {role} GGUF file")
    if not path.is_file():
        raise InputError(f"{path}: is not a regular file, expected a {role} GGUF file")
    if not os.access(path, os.R_OK):
        raise InputError(f"{path}: {role} file is not readable (permission denied)")


FINGERPRINT_SAMPLE = 64


def fingerprint(g: GGUFFile) -> str:
    """A cheap identity of a GGUF model: its header, key/values and tensor infos, plus a few bytes
    from the start, middle and end of every tensor's data.

    O(header + n_tensors) to compute: a residual can refuse a base it was not made from without
    hashing gigabytes. The data samples catch a base re-quantized with identical types (another
    imatrix, say), which a header-only hash would miss.
    """
    h = hashlib.sha256()
    h.update(b"bitsplit-fingerprint-v1\0")
    h.update(g.header_bytes())
    fd = g._fh.fileno()
    for t in g.tensors:
        for off in sorted({0, max(0, t.nbytes // 2 - FINGERPRINT_SAMPLE // 2), max(0, t.nbytes - FINGERPRINT_SAMPLE)}):
            n = min(FINGERPRINT_SAMPLE, t.nbytes - off)
            h.update(os.pread(fd, n, t.offset + off))
    return h.hexdigest()


class StreamingGGUFWriter:
    """Writes a GGUF whose tensor infos are known up front and whose data arrives in pieces.

    gguf-py's GGUFWriter writes the header, key/values and tensor infos; the data section is then
    appended here chunk by chunk, so no tensor needs to be in memory at once.
    """

    def __init__(self, path: Path, arch: str, alignment: int = DEFAULT_ALIGNMENT):
        import gguf

        self.path = path
        self._w = gguf.GGUFWriter(path=None, arch=arch)
        self._w.data_alignment = alignment
        self.alignment = alignment
        self._infos: list[tuple[str, int]] = []
        self._fh: BinaryIO | None = None
        self._current: tuple[str, int, int] | None = None  # name, expected bytes, written
        self._checksum_key: str | None = None
        self._crc = 0
        self._crcs: list[int] = []

    @property
    def kv(self):  # the GGUFWriter, for its add_* methods
        return self._w

    def add_tensor_info(self, name: str, shape: tuple[int, ...], ggml_type: int) -> None:
        """``shape`` in GGUF order (ne0 first)."""
        blck, bsize = type_sizes(ggml_type)
        nbytes = math.prod(shape) // blck * bsize
        # GGUFWriter expects numpy order (reversed) and reverses it again when writing.
        self._w.add_tensor_info(name, tuple(reversed(shape)), np.dtype(np.float32), nbytes,
                                raw_dtype=GGMLQuantizationType(ggml_type))
        self._infos.append((name, nbytes))

    def reserve_checksums(self, key: str) -> None:
        """Record a CRC-32 of every tensor's data under ``key`` (a string of 8 hex digits per tensor,
        comma-separated, in tensor order). Call after the last add_tensor_info: a placeholder of the
        final length goes into the header now and is filled in by :meth:`finish`."""
        self._checksum_key = key
        self._w.add_string(key, ",".join(["0" * 8] * len(self._infos)))

    def begin_data(self) -> None:
        self._w.write_header_to_file(path=self.path)
        self._w.write_kv_data_to_file()
        self._w.write_ti_data_to_file()
        self._fh = self._w.fout[0]
        self._pad()
        self._next = 0

    def _pad(self) -> None:
        assert self._fh is not None
        pos = self._fh.tell()
        pad = -pos % self.alignment
        if pad:
            self._fh.write(b"\0" * pad)

    def begin_tensor(self, name: str) -> None:
        exp_name, nbytes = self._infos[self._next]
        if name != exp_name:
            raise RuntimeError(f"tensor data out of order: got '{name}', expected '{exp_name}'")
        self._current = (name, nbytes, 0)
        self._crc = 0

    def write(self, data: np.ndarray) -> None:
        assert self._fh is not None and self._current is not None
        name, nbytes, done = self._current
        b = memoryview(np.ascontiguousarray(data)).cast("B")
        if done + len(b) > nbytes:
            raise RuntimeError(f"too much data for tensor '{name}'")
        self._fh.write(b)
        if self._checksum_key is not None:
            self._crc = zlib.crc32(b, self._crc)
        self._current = (name, nbytes, done + len(b))

    def end_tensor(self) -> None:
        assert self._current is not None
        name, nbytes, done = self._current
        if done != nbytes:
            raise RuntimeError(f"tensor '{name}' got {done} bytes, expected {nbytes}")
        self._pad()
        self._current = None
        self._next += 1
        self._crcs.append(self._crc)

    def finish(self) -> None:
        """Check every tensor was written and make the file durable (call before :meth:`close`)."""
        if self._fh is None or self._next != len(self._infos):
            raise RuntimeError(f"{self.path}: finished after {getattr(self, '_next', 0)} of {len(self._infos)} tensors")
        if self._checksum_key is not None:
            self._fill_checksums()
        self._fh.flush()
        os.fsync(self._fh.fileno())

    def _fill_checksums(self) -> None:
        """Write the tensors' CRCs over the placeholder reserve_checksums put in the header."""
        assert self._fh is not None and self._checksum_key is not None
        key = self._checksum_key.encode()
        value = ",".join(f"{c:08x}" for c in self._crcs).encode()
        self._fh.flush()
        end = self._fh.tell()
        with open(self.path, "rb") as r:  # the writer's handle is write-only
            head = r.read(min(end, 64 * 1024 * 1024))
        # the key/value as GGUF writes it: u64 key length, key, u32 type (8: string), u64 length, bytes
        needle = struct.pack("<Q", len(key)) + key + struct.pack("<IQ", 8, len(value))
        at = head.find(needle)
        if at < 0 or head.find(needle, at + 1) >= 0 or head[at + len(needle):at + len(needle) + len(value)].strip(b"0,"):
            raise RuntimeError(f"{self.path}: the checksum placeholder was not found in the header")
        self._fh.seek(at + len(needle))
        self._fh.write(value)
        self._fh.seek(end)

    def close(self) -> None:
        self._w.close()


def tensor_checksum(g: "GGUFFile", t: TensorInfo, chunk: int = 64 * 1024 * 1024) -> int:
    """CRC-32 of a tensor's data bytes (as StreamingGGUFWriter records them)."""
    crc, done = 0, 0
    buf = bytearray(min(chunk, max(t.nbytes, 1)))
    while done < t.nbytes:
        n = min(len(buf), t.nbytes - done)
        view = memoryview(buf)[:n]
        got = os.preadv(g._fh.fileno(), [view], t.offset + done)
        if got != n:
            raise GGUFFormatError(f"{g.path}: file shrank while reading tensor '{t.name}'")
        crc = zlib.crc32(view, crc)
        done += n
    return crc


def iter_row_chunks(n_rows: int, n_per_row: int, max_elements: int) -> Iterable[tuple[int, int]]:
    """(start, count) chunks of whole rows holding at most ``max_elements`` elements (at least one row)."""
    step = max(1, max_elements // max(1, n_per_row))
    for s in range(0, n_rows, step):
        yield s, min(step, n_rows - s)


def write_error(path: Path, exc: OSError) -> OutputError:
    import errno

    if exc.errno == errno.ENOSPC:
        return OutputError(f"{path}: disk full while writing ({exc.strerror})")
    if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return OutputError(f"{path}: cannot write ({exc.strerror})")
    return OutputError(f"{path}: write failed: {exc.strerror or exc}")
