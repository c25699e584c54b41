"""Fuzzing the GGUF validation (Python) and the native residual loader with corrupted copies of a
tiny split: truncations, byte flips, inserted and removed bytes, absurd counts, lengths, dimensions,
types and offsets.

- ``GGUFFile`` either parses a file or raises a ``BitsplitError``: never another exception, never a
  hang (every example runs under a deadline). What it accepts stays usable (fingerprint, rows).
- ``Residual(base=..., residual=...)`` (Python validation, then the native loader) either loads or
  raises a ``BitsplitError``, and never takes the process down: it runs in a worker process, so a
  crash is reported as such. Mutations that break the file for certain (truncation, an absurd
  field, bytes removed from the data) must be refused; random damage may leave a file that is still
  well-formed (a changed metadata string, damaged tensor data), which loads and must stay usable.

Hypothesis is derandomized (same examples every run). The native loader is also fuzzed in C under
ASan/UBSan: ``test_native_sanitizers`` runs ``native/tests/run_sanitizers.sh`` on every run of the
suite (about a minute or two; ``pytest tests/test_fuzz.py -k sanitizers`` alone).
"""

from __future__ import annotations

import json
import os
import select
import shutil
import struct
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import pytest

pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from bitsplit_llama.errors import BitsplitError  # noqa: E402
from bitsplit_llama.formats.gguf_file import GGUFFile, fingerprint  # noqa: E402
from bitsplit_llama.formats.modeldir import check_pair  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
U64 = (1 << 64) - 1

FUZZ = dict(derandomize=True, database=None, deadline=5000, print_blob=False,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


# --- where the fields of a valid GGUF are (for targeted damage) --------------------------------------

@dataclass(frozen=True)
class Field:
    pos: int
    width: int
    kind: str      # n_tensors, n_kv, key_len, kv_type, str_len, arr_type, arr_len, name_len, n_dims, dim, ttype, offset
    label: str
    value: int


@dataclass
class Layout:
    data: bytes
    fields: list[Field]
    header_end: int
    data_offset: int
    tensors_end: int = 0   # end of the last tensor's data: a shorter file is broken for certain


def layout(data: bytes) -> Layout:
    """Walk a valid GGUF (v3) and record the position of every count, length, type and offset."""
    fields: list[Field] = []
    pos = 0

    def take(fmt: str, kind: str | None = None, label: str = "") -> int:
        nonlocal pos
        (v,) = struct.unpack_from(fmt, data, pos)
        if kind:
            fields.append(Field(pos, struct.calcsize(fmt), kind, label, v))
        pos += struct.calcsize(fmt)
        return v

    scalar = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}

    def value(vt: int, label: str, depth: int = 0) -> None:
        nonlocal pos
        if vt == 8:
            n = take("<Q", "str_len", label)
            pos += n
        elif vt == 9:
            sub = take("<I", "arr_type", label)
            cnt = take("<Q", "arr_len", label)
            if sub in scalar:
                pos += cnt * scalar[sub]
            else:
                for i in range(cnt):  # strings: record a few, skip the rest
                    if i < 3:
                        value(sub, f"{label}[{i}]", depth + 1)
                    else:
                        (n,) = struct.unpack_from("<Q", data, pos)
                        pos += 8 + n
        else:
            pos += scalar[vt]

    assert data[:4] == b"GGUF"
    pos = 8
    n_tensors = take("<Q", "n_tensors", "tensor count")
    n_kv = take("<Q", "n_kv", "key/value count")
    alignment = 32
    for i in range(n_kv):
        n = take("<Q", "key_len", f"key #{i}")
        key = data[pos:pos + n].decode()
        pos += n
        vt = take("<I", "kv_type", key)
        if key == "general.alignment":
            (alignment,) = struct.unpack_from("<I", data, pos)
        value(vt, key)
    for i in range(n_tensors):
        n = take("<Q", "name_len", f"tensor #{i}")
        name = data[pos:pos + n].decode()
        pos += n
        nd = take("<I", "n_dims", name)
        for d in range(nd):
            take("<Q", "dim", f"{name} ne{d}")
        take("<I", "ttype", name)
        take("<Q", "offset", name)
    return Layout(data, fields, pos, -(-pos // alignment) * alignment)


# values that make each kind of field invalid for certain (strict), besides arbitrary ones
ABSURD = {
    "n_tensors": [U64, 1 << 63, 1 << 40, 1 << 32, (1 << 20) + 1],
    "n_kv": [U64, 1 << 63, 1 << 40, 1 << 32, (1 << 20) + 1],
    "key_len": [U64, 1 << 63, 1 << 40, (1 << 26) + 1],
    "str_len": [U64, 1 << 63, 1 << 40, (1 << 26) + 1],
    "name_len": [U64, 1 << 63, 1 << 40, (1 << 26) + 1],
    "kv_type": [13, 255, 0xFFFFFFFF, 0x80000008],
    "arr_type": [13, 255, 0xFFFFFFFF],
    "arr_len": [U64, 1 << 62, 1 << 40],
    "n_dims": [0, 5, 0xFFFFFFFF, 1 << 31],
    "dim": [0, U64, 1 << 62, (1 << 48) + 1, 1 << 40],
    "ttype": [4, 5, 43, 1000, 0xFFFFFFFF],   # 4, 5: removed Q4_2/Q4_3; 43+: past the last type
    "offset": [U64, U64 - 31, 1 << 63, 1 << 40],
}


@dataclass(frozen=True, repr=False)
class Mutation:
    data: bytes
    strict: bool   # the result is broken for certain: must be refused
    what: str

    def __repr__(self) -> str:  # what hypothesis prints for a falsifying example (not megabytes)
        return f"Mutation({self.what!r}, {len(self.data)} bytes, strict={self.strict})"


def mutations(lay: Layout) -> st.SearchStrategy[Mutation]:
    data, size = lay.data, len(lay.data)
    head = lay.header_end
    fields = lay.fields

    @st.composite
    def truncate(draw):
        n = draw(st.one_of(st.integers(0, lay.data_offset + 64), st.integers(0, size - 1)))
        return Mutation(data[:n], n < lay.tensors_end, f"truncated to {n} of {size} bytes")

    @st.composite
    def flip(draw):
        b = bytearray(data)
        spots = draw(st.lists(st.tuples(st.one_of(st.integers(0, head - 1), st.integers(0, size - 1)),
                                        st.integers(0, 255), st.booleans()), min_size=1, max_size=8))
        for p, v, xor in spots:
            b[p] = (b[p] ^ (1 << (v % 8))) if xor else v
        return Mutation(bytes(b), False, f"bytes changed at {sorted({p for p, _, _ in spots})}")

    @st.composite
    def insert(draw):
        p = draw(st.integers(0, head))
        extra = draw(st.binary(min_size=1, max_size=16))
        return Mutation(data[:p] + extra + data[p:], False, f"{len(extra)} bytes inserted at {p}")

    @st.composite
    def remove(draw):
        p = draw(st.one_of(st.integers(0, head - 1), st.integers(head, size - 1)))
        n = draw(st.integers(1, 64))
        # past the header the parse is unchanged and the last tensor now ends past the end of the file
        strict = head <= p < lay.tensors_end
        return Mutation(data[:p] + data[p + n:], strict, f"{min(n, size - p)} bytes removed at {p}")

    @st.composite
    def absurd(draw):
        f = draw(st.sampled_from(fields))
        strict_values = ABSURD[f.kind]
        v = draw(st.one_of(st.sampled_from(strict_values), st.integers(0, (1 << (8 * f.width)) - 1)))
        v &= (1 << (8 * f.width)) - 1
        strict = v in strict_values
        if f.kind == "offset" and v % 32:
            strict = True      # unaligned
        if f.kind == "n_dims" and not 1 <= v <= 4:
            strict = True
        b = bytearray(data)
        b[f.pos:f.pos + f.width] = v.to_bytes(f.width, "little")
        return Mutation(bytes(b), strict and v != f.value, f"{f.kind} of {f.label} = {v:#x} (was {f.value:#x})")

    @st.composite
    def several(draw):  # a field made absurd plus random damage
        m1 = draw(absurd())
        b = bytearray(m1.data)
        for p, v in draw(st.lists(st.tuples(st.integers(0, head - 1), st.integers(0, 255)), min_size=1, max_size=4)):
            b[p] = v
        return Mutation(bytes(b), False, m1.what + " + random bytes")

    return st.one_of(truncate(), flip(), insert(), remove(), absurd(), several())


# --- fixtures ------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def split_bytes(tiny_split: Path) -> dict[str, bytes]:
    return {name: (tiny_split / f"{name}.gguf").read_bytes() for name in ("base", "residual")}


@pytest.fixture(scope="module")
def layouts(tiny_split, split_bytes) -> dict[str, Layout]:
    out = {}
    for name, b in split_bytes.items():
        lay = layout(b)
        with GGUFFile(tiny_split / f"{name}.gguf") as g:
            lay.tensors_end = max(t.offset + t.nbytes for t in g.tensors)
            assert g.data_offset == lay.data_offset and g.header_end == lay.header_end
        out[name] = lay
    return out


@pytest.fixture(scope="module")
def fuzz_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("fuzz")


def _exercise(g: GGUFFile) -> None:
    """What callers do with a parsed file: none of it may raise anything but a BitsplitError."""
    try:
        g.architecture
    except BitsplitError:
        pass
    fingerprint(g)
    g.header_bytes()
    for t in g.tensors:
        rows = g.read_rows(t, 0, 1)
        assert rows.shape == (1, t.row_bytes)
        g.read_rows(t, t.n_rows - 1, 1)


def _parse(path: Path, data: bytes, role: str) -> str:
    path.write_bytes(data)
    try:
        with GGUFFile(path, role=role) as g:
            _exercise(g)
    except BitsplitError as exc:
        return type(exc).__name__
    return "ok"


# --- (a) GGUFFile ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("which,n", [("residual", 1200), ("base", 600)])
def test_gguf_file_parses_or_raises_bitsplit_error(which, n, split_bytes, layouts, fuzz_dir):
    path = fuzz_dir / f"parse-{which}.gguf"
    assert _parse(path, split_bytes[which], which) == "ok"
    outcomes: Counter[str] = Counter()

    @settings(max_examples=n, **FUZZ)
    @given(mutations(layouts[which]))
    def run(m: Mutation) -> None:
        t0 = time.monotonic()
        result = _parse(path, m.data, which)
        assert time.monotonic() - t0 < 5, f"{m.what}: parsing took {time.monotonic() - t0:.1f}s"
        if m.strict:
            assert result != "ok", f"{m.what}: broken file accepted"
        outcomes["strict" if m.strict else "random", result] += 1

    run()
    print(f"\nGGUFFile fuzz ({which}): {sum(outcomes.values())} examples: {dict(sorted(outcomes.items()))}")
    assert sum(v for (k, r), v in outcomes.items() if k == "strict") > n // 10


def test_gguf_file_absurd_counts_fail_fast(split_bytes, fuzz_dir):
    """Counts and lengths near 2^64 are refused before any allocation or loop they would imply."""
    base = bytearray(split_bytes["residual"])
    lay = layout(bytes(base))
    path = fuzz_dir / "absurd.gguf"
    n = 0
    for f in lay.fields:
        for v in ABSURD[f.kind]:
            b = bytearray(base)
            b[f.pos:f.pos + f.width] = (v & ((1 << (8 * f.width)) - 1)).to_bytes(f.width, "little")
            t0 = time.monotonic()
            assert _parse(path, bytes(b), "residual") != "ok", f"{f.kind} of {f.label} = {v:#x} accepted"
            assert time.monotonic() - t0 < 1.0, f"{f.kind} of {f.label} = {v:#x}: slow refusal"
            n += 1
    assert n > 100


# --- (b) Residual: Python validation, then the native loader, in a worker process -----------------------

WORKER = r"""
import json, sys
import numpy as np
from bitsplit_llama.errors import BitsplitError
from bitsplit_llama.native.residual import Residual
base = sys.argv[1]
for line in sys.stdin:
    path = line.rstrip("\n")
    try:
        r = Residual(base=base, residual=path)
        try:
            for name, ne, _bt, _rt in r.tensors():
                if ne[2] == 1 and ne[3] == 1:
                    y = r.matmul(name, np.ones((2, ne[0]), dtype=np.float32))
                    assert y.shape == (2, ne[1])
        finally:
            r.close()
        out = {"result": "ok"}
    except BitsplitError as exc:
        out = {"result": type(exc).__name__, "msg": str(exc)[:300]}
    except BaseException as exc:
        out = {"result": "OTHER", "msg": f"{type(exc).__name__}: {exc}"[:500]}
    print(json.dumps(out), flush=True)
"""


class Worker:
    """One Python process that loads residuals on request; a crash there is a finding, not our end."""

    def __init__(self, base: Path, log: Path):
        self.base, self.log = base, log
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        if getattr(self, "err", None):
            self.err.close()
        self.err = open(self.log, "ab")
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
        self.proc = subprocess.Popen([sys.executable, "-c", WORKER, str(self.base)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.err, env=env, cwd=ROOT)

    def load(self, path: Path, timeout: float = 60.0) -> dict:
        if self.proc is None or self.proc.poll() is not None:
            self.start()
        assert self.proc is not None and self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write((str(path) + "\n").encode())
        self.proc.stdin.flush()
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        line = self.proc.stdout.readline() if ready else b""
        if not line:
            if ready:  # EOF: the worker died
                rc = self.proc.wait(timeout=10)
                self.proc = None
                tail = self.log.read_bytes()[-2000:].decode(errors="replace")
                return {"result": "CRASH", "msg": f"worker exited with {rc}: {tail}"}
            self.proc.kill()
            self.proc.wait()
            self.proc = None
            return {"result": "HANG", "msg": f"no answer within {timeout}s"}
        return json.loads(line)

    def close(self) -> None:
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.stdin.close()
                try:
                    self.proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait()
            self.proc = None
        if getattr(self, "err", None):
            self.err.close()
            self.err = None


@pytest.fixture(scope="module")
def worker(tiny_split, fuzz_dir):
    w = Worker(tiny_split / "base.gguf", fuzz_dir / "worker.log")
    w.start()
    yield w
    w.close()


def _python_verdict(base: Path, res: Path) -> str:
    try:
        with GGUFFile(base, role="base") as b, GGUFFile(res, role="residual") as r:
            check_pair(b, r)
    except BitsplitError as exc:
        return type(exc).__name__
    return "ok"


def test_residual_loads_or_raises_bitsplit_error(tiny_split, split_bytes, layouts, fuzz_dir, worker):
    base = tiny_split / "base.gguf"
    path = fuzz_dir / "residual.gguf"
    # the valid split loads (and warms the worker: the native library is built or found here)
    path.write_bytes(split_bytes["residual"])
    first = worker.load(path, timeout=300)
    assert first["result"] == "ok", first
    outcomes: Counter[str] = Counter()

    @settings(max_examples=1000, **{**FUZZ, "deadline": 30000})
    @given(mutations(layouts["residual"]))
    def run(m: Mutation) -> None:
        path.write_bytes(m.data)
        py = _python_verdict(base, path)
        got = worker.load(path)
        res = got["result"]
        assert res not in ("CRASH", "HANG", "OTHER"), f"{m.what}: {res}: {got.get('msg')}"
        if py != "ok":   # Python validation runs first inside Residual: the same refusal
            assert res == py, f"{m.what}: Python refused it ({py}) but Residual gave {res}"
        if m.strict:
            assert res != "ok", f"{m.what}: broken residual loaded"
        outcomes[("py-refused" if py != "ok" else "py-accepted"), ("refused" if res != "ok" else "loaded")] += 1

    run()
    print(f"\nResidual fuzz: {sum(outcomes.values())} examples: {dict(sorted(outcomes.items()))}")


def test_residual_refuses_what_only_the_native_loader_checks(tiny_split, split_bytes, layouts, fuzz_dir, worker):
    """Files the Python validation accepts but the C loader refuses: the error still is a
    BitsplitError (from the native status), and the worker survives."""
    lay = layouts["residual"]
    data = split_bytes["residual"]
    path = fuzz_dir / "native-only.gguf"
    fv = next(f for f in lay.fields if f.kind == "kv_type" and f.label == "bitsplit.format_version")
    # the version as an int32 1: an int to Python, not the u32 the C loader requires
    b = bytearray(data)
    b[fv.pos:fv.pos + 4] = struct.pack("<I", 5)
    path.write_bytes(bytes(b))
    assert _python_verdict(tiny_split / "base.gguf", path) == "ok"
    got = worker.load(path)
    assert got["result"] == "GGUFFormatError", got
    assert "format version" in got["msg"], got
    # and the worker is still fine
    path.write_bytes(data)
    assert worker.load(path)["result"] == "ok"


# --- the sanitizer run ------------------------------------------------------------------------------------

@pytest.mark.sanitizer
def test_native_sanitizers():
    """native/tests/run_sanitizers.sh: the native library built with ASan/UBSan/LSan runs its own test
    driver (every kernel family, corrupt and randomly damaged files); zero reports (about 15 minutes on
    2 cores, most of it compiling the library with ASan, one compiler per core)."""
    assert shutil.which(os.environ.get("CC", "gcc")) is not None, "the sanitizer build needs gcc (or $CC)"
    script = ROOT / "native" / "tests" / "run_sanitizers.sh"
    proc = subprocess.run(["bash", str(script)], cwd=ROOT, env={**os.environ, "PYTHON": sys.executable},
                          capture_output=True, text=True, timeout=2400)
    out = proc.stdout + proc.stderr
    print(proc.stdout)
    assert proc.returncode == 0, out[-12000:]
    assert "run_sanitizers: PASS" in proc.stdout, out[-12000:]
