"""``bitsplit split``: a GGUF model -> DIR/base.gguf (llama.cpp's Q2_K) + DIR/residual.gguf.

The base is made by llama.cpp itself (``llama_model_quantize``, its own Q2_K tensor mix), so it is
an ordinary GGUF any llama.cpp loads. The residual holds, under the same tensor names, the
difference ``dequant(source) - dequant(base)`` for every tensor the base does not keep exactly,
quantized with ggml's own quantizers. Work is streamed in chunks of rows, so memory stays bounded
by a small multiple of the chunk size whatever the model's size; outputs appear under their final
names only once complete.
"""

from __future__ import annotations

import concurrent.futures as cf
import heapq
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Protocol

import numpy as np
from gguf.constants import GGMLQuantizationType as QT

from . import _ggml, placement
from .._platform import peak_rss, pid_alive
from ..errors import InputError, InvalidOptionError, OutputError, UnsupportedModelError
from .gguf_file import (GGUFFile, StreamingGGUFWriter, TensorInfo, fingerprint, iter_row_chunks, tensor_checksum,
                        type_name, write_error)

FORMAT_VERSION = 1
RESIDUAL_CHECKSUMS_KEY = "bitsplit.checksums.crc32"   # 8 hex digits per residual tensor, in file order
BASE_CHECKSUMS_KEY = "bitsplit.base_checksums.crc32"  # the same for base.gguf's tensors
KEPT_LAYERS_KEY = "bitsplit.kept_layers"              # layers kept whole in base.gguf ("0,27,1"; "" if none)
BASE_NAME = "base.gguf"
RESIDUAL_NAME = "residual.gguf"

#: residual types offered to users, and the ggml type each one stores
RESIDUAL_TYPES: dict[str, int] = {"q4_k": int(QT.Q4_K), "q5_k": int(QT.Q5_K), "q6_k": int(QT.Q6_K), "q8_0": int(QT.Q8_0),
                                  "f16": int(QT.F16), "f32": int(QT.F32)}
#: llama_ftype of llama.cpp's mixes; q2_k is the product, q8_0/q6_k/... make comparison models
FTYPES: dict[str, int] = {"q2_k": 10, "q3_k_m": 12, "q4_0": 2, "q4_1": 3, "q4_k_m": 15, "q5_k_m": 17, "q6_k": 18,
                          "q8_0": 7, "f16": 1, "f32": 0, "iq2_xxs": 19, "iq2_xs": 20, "iq2_s": 28, "iq1_m": 31}
#: base types `split --base` offers (the drafter's weights); the IQ ones need an importance matrix
BASE_TYPES = ("q2_k", "iq2_s", "iq2_xs", "iq2_xxs", "iq1_m", "q3_k_m")
NEEDS_IMATRIX = frozenset({"iq2_s", "iq2_xs", "iq2_xxs", "iq1_m"})

# Fallback chain when a row width is not a multiple of the residual type's block.
_FALLBACK = {int(QT.Q4_K): int(QT.Q8_0), int(QT.Q5_K): int(QT.Q8_0), int(QT.Q6_K): int(QT.Q8_0), int(QT.Q8_0): int(QT.F16)}

#: rows are processed in chunks of at most this many elements (4 float32 copies live per chunk)
CHUNK_ELEMENTS = 1 << 22


class Progress(Protocol):
    """What the split reports while it works; the CLI draws it, the API may pass None."""

    def phase(self, name: str, total_tensors: int, total_bytes: int) -> None: ...
    def advance(self, tensors: int = 0, nbytes: int = 0) -> None: ...
    def close(self) -> None: ...


@dataclass
class ResidualTensor:
    name: str
    shape: tuple[int, ...]
    base_type: int
    residual_type: int
    fallback: bool


class BitsPerWeight:
    """Bits per weight of each half, for a dataclass with ``n_params``, ``base_bytes`` and
    ``residual_bytes`` (the split's report and a split directory's description)."""

    n_params: int
    base_bytes: int
    residual_bytes: int

    @property
    def base_bpw(self) -> float:
        return 8 * self.base_bytes / max(1, self.n_params)

    @property
    def residual_bpw(self) -> float:
        return 8 * self.residual_bytes / max(1, self.n_params)


@dataclass
class SplitReport(BitsPerWeight):
    source: Path
    out_dir: Path
    base_path: Path
    residual_path: Path
    residual_type: str
    seconds: float
    base_seconds: float
    residual_seconds: float
    peak_rss_bytes: int | None           # None: not measured on this platform
    quantizer_peak_rss_bytes: int | None
    n_params: int
    base_bytes: int
    residual_bytes: int
    base_types: dict[str, int]
    residual_types: dict[str, int]
    fallbacks: int
    exact_tensors: int
    residual_tensors: list[ResidualTensor] = field(default_factory=list)
    kept_layers: list[int] = field(default_factory=list)
    n_layers: int = 0
    vram_budget: dict | None = None

    @property
    def residual_bpw_corrected(self) -> float:
        """Bits per weight of the residual over the weights it corrects (the scale of the types and
        of --residual-bpw: Q4_K 4.5 ... Q8_0 8.5); residual_bpw divides by all the model's weights."""
        n = sum(math.prod(r.shape) for r in self.residual_tensors)
        return 8 * self.residual_bytes / max(1, n)

    def to_json(self) -> dict:
        return {
            "source": str(self.source), "out_dir": str(self.out_dir), "base": str(self.base_path),
            "residual": str(self.residual_path), "residual_type": self.residual_type,
            "seconds": round(self.seconds, 3), "base_seconds": round(self.base_seconds, 3),
            "residual_seconds": round(self.residual_seconds, 3), "peak_rss_bytes": self.peak_rss_bytes,
            "quantizer_peak_rss_bytes": self.quantizer_peak_rss_bytes, "n_params": self.n_params,
            "base_bytes": self.base_bytes, "residual_bytes": self.residual_bytes,
            "base_bpw": round(self.base_bpw, 4), "residual_bpw": round(self.residual_bpw, 4),
            "residual_bpw_corrected": round(self.residual_bpw_corrected, 4),
            "base_types": self.base_types, "residual_types": self.residual_types,
            "fallbacks": self.fallbacks, "exact_tensors": self.exact_tensors,
            "placement": {"layers": self.n_layers, "kept_whole": self.kept_layers, "vram_budget": self.vram_budget},
        }


def residual_type_for(n_per_row: int, wanted: int) -> int:
    """The residual type for a row width: ``wanted`` if its block divides the width, else the
    next in (Q4_K | Q5_K | Q6_K) -> Q8_0 -> F16 whose block does."""
    t = wanted
    while True:
        blck = _ggml.traits(t).blck_size
        if n_per_row % blck == 0:
            return t
        t = _FALLBACK.get(t, int(QT.F16))


#: ``--residual auto``: a type per tensor, to a bits-per-weight budget (:func:`choose_auto_types`)
AUTO = -1
AUTO_TYPES = (int(QT.Q4_K), int(QT.Q5_K), int(QT.Q6_K), int(QT.Q8_0))
#: rows of each tensor whose quantization error ``auto`` measures (spread over the tensor)
AUTO_SAMPLE_ROWS = 128


def parse_residual_type(name: str) -> int:
    key = name.lower()
    if key == "auto":
        return AUTO
    if key not in RESIDUAL_TYPES:
        raise InvalidOptionError(f"--residual: unknown residual type '{name}' (expected one of: "
                                 f"{', '.join(RESIDUAL_TYPES)}, auto)")
    return RESIDUAL_TYPES[key]


def check_residual_bpw(residual: str, bpw: float | None) -> None:
    """``--residual-bpw`` goes with ``--residual auto``, and only there."""
    if residual.lower() == "auto":
        if bpw is None:
            raise InvalidOptionError("--residual auto: give the budget with --residual-bpw (e.g. 5.5)")
        lo, hi = _ggml.row_size(int(QT.Q4_K), 256) * 8 / 256, _ggml.row_size(int(QT.Q8_0), 256) * 8 / 256
        if not lo <= bpw <= hi:
            raise InvalidOptionError(f"--residual-bpw: {bpw} is outside {lo:g} (all Q4_K) to {hi:g} (all Q8_0)")
    elif bpw is not None:
        raise InvalidOptionError(f"--residual-bpw: only with --residual auto (--residual is {residual})")


def _auto_weights(imat: dict[str, np.ndarray] | None, name: str, n_per_row: int) -> np.ndarray | None:
    v = (imat or {}).get(name)
    if v is None:
        return None
    if v.size == n_per_row:
        return v.astype(np.float64)
    if v.size % n_per_row == 0:  # experts: their mean
        return v.reshape(-1, n_per_row).mean(axis=0).astype(np.float64)
    return None


def choose_auto_types(src: GGUFFile, base: GGUFFile, plan: list[ResidualTensor], bpw: float,
                      imatrix: Path | None = None, progress: Progress | None = None) -> dict:
    """Pick each planned tensor's residual type among Q4_K, Q5_K, Q6_K and Q8_0 so that the residual
    holds at most ``bpw`` bits per weight and the summed error is smallest. A tensor's error for a
    type is the squared error of its quantized residual on AUTO_SAMPLE_ROWS rows spread over it,
    scaled to all its rows, each column weighted by the importance matrix where one is given (the
    expected squared error of the product's output for activations of those mean squares). Greedy
    by error saved per byte, from all Q4_K up. Returns a report of the choice; ``plan`` is updated."""
    imat = None
    if imatrix is not None:
        from .imatrix import load_imatrix

        imat = load_imatrix(imatrix)
    if progress:
        progress.phase("residual: choosing types (auto)", len(plan), 0)
    options: list[list[tuple[int, int, float]]] = []  # per tensor: (type, bytes, error), bytes ascending
    for r in plan:
        st, bt = src.tensor(r.name), base.tensor(r.name)
        n_rows, k = st.n_rows, st.n_per_row
        blocks = 4
        per = max(1, min(AUTO_SAMPLE_ROWS // blocks, n_rows // blocks or 1))
        starts = sorted({int(x) for x in np.linspace(0, max(n_rows - per, 0), blocks)})
        rows = np.concatenate([_residual_rows(src, st, base, bt, a, min(per, n_rows - a)) for a in starts])
        w = _auto_weights(imat, r.name, k)
        types = sorted({residual_type_for(k, t) for t in AUTO_TYPES}, key=lambda t: _ggml.row_size(t, k))
        opts = []
        for t in types:
            deq = _ggml.dequantize_rows(_ggml.quantize_rows(rows, t), t, k)
            d = (rows.astype(np.float64) - deq) ** 2
            err = float((d * w).sum() if w is not None else d.sum()) * n_rows / rows.shape[0]
            opts.append((t, _ggml.row_size(t, k) * n_rows, err))
        options.append(opts)
        if progress:
            progress.advance(tensors=1)
    n_weights = sum(math.prod(r.shape) for r in plan)
    budget = bpw / 8 * n_weights
    level = [0] * len(plan)
    used = sum(o[0][1] for o in options)
    heap = []

    def push(i: int) -> None:
        j = level[i]
        if j + 1 < len(options[i]):
            (_, b0, e0), (_, b1, e1) = options[i][j], options[i][j + 1]
            heapq.heappush(heap, (-(e0 - e1) / max(b1 - b0, 1), i, j))

    for i in range(len(plan)):
        push(i)
    while heap:
        _, i, j = heapq.heappop(heap)
        if level[i] != j:
            continue
        extra = options[i][j + 1][1] - options[i][j][1]
        if used + extra > budget:
            continue  # this step does not fit; a cheaper one elsewhere may
        used += extra
        level[i] = j + 1
        push(i)
    for r, opts, j in zip(plan, options, level):
        r.residual_type = opts[j][0]
        r.fallback = False
    return {"bpw_target": bpw, "bpw": round(used * 8 / max(n_weights, 1), 4),
            "error": sum(o[j][2] for o, j in zip(options, level)), "weighted": imat is not None}


def _residual_rows(src: GGUFFile, st: TensorInfo, base: GGUFFile, bt: TensorInfo, start: int, count: int) -> np.ndarray:
    s = _ggml.dequantize_rows(src.read_rows(st, start, count), st.ggml_type, st.n_per_row)
    b = _ggml.dequantize_rows(base.read_rows(bt, start, count), bt.ggml_type, bt.n_per_row)
    return np.ascontiguousarray(s - b, dtype=np.float32)




def _check_source(src: GGUFFile) -> None:
    _ = src.architecture
    for t in src.tensors:
        if t.ggml_type != int(QT.F32) and not _ggml.traits(t.ggml_type).to_float:
            raise UnsupportedModelError(f"{src.path}: tensor '{t.name}' has type {t.type_name}, which ggml cannot dequantize")
        if t.ggml_type in (int(QT.Q8_1), int(QT.Q8_K)) or t.ggml_type >= int(QT.I8) and t.ggml_type <= int(QT.F64):
            raise UnsupportedModelError(f"{src.path}: tensor '{t.name}' has type {t.type_name}, not a weight type this tool splits")


def _prepare_out_dir(out_dir: Path, force: bool) -> None:
    if out_dir.exists() and not out_dir.is_dir():
        raise OutputError(f"{out_dir}: exists and is not a directory")
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise OutputError(f"{out_dir}: cannot create output directory ({exc.strerror})") from None
    if not os.access(out_dir, os.W_OK | os.X_OK):
        raise OutputError(f"{out_dir}: output directory is not writable")
    existing = [n for n in (BASE_NAME, RESIDUAL_NAME) if (out_dir / n).exists()]
    if existing and not force:
        raise OutputError(f"{out_dir}: already holds {' and '.join(existing)} (use --force to replace)")
    # temporaries of an earlier run that was killed (SIGKILL leaves them behind)
    for p in out_dir.glob(".*.bitsplit-*.tmp"):
        try:
            pid = int(p.name.split(".")[-2].rsplit("-", 1)[-1])
        except ValueError:
            pid = -1
        if pid != os.getpid() and not pid_alive(pid):
            p.unlink(missing_ok=True)


def _check_space(out_dir: Path, need: int) -> None:
    free = shutil.disk_usage(out_dir).free
    if free < need:
        raise OutputError(
            f"{out_dir}: disk full: the split needs about {need / 2**30:.2f} GiB, {free / 2**30:.2f} GiB free"
        )


_PROGRESS_RE = re.compile(r"^\[\s*(\d+)/\s*(\d+)\]")


def quantize_model(src: Path, dst: Path, ftype: str | int, threads: int, imatrix: Path | None = None,
                   progress: Progress | None = None, log_tail: list[str] | None = None) -> int:
    """Run llama.cpp's quantizer in a child process; returns the child's peak RSS in bytes.

    ``dst`` is written directly; callers that need atomicity pass a temporary path. Raises
    :class:`UnsupportedModelError` with llama.cpp's own reason when it refuses the model.
    """
    ftype_id = FTYPES[ftype] if isinstance(ftype, str) else int(ftype)
    args = {"src": str(src), "dst": str(dst), "ftype": ftype_id, "nthread": threads,
            "imatrix": str(imatrix) if imatrix else None, "parent": os.getpid()}
    cmd = [sys.executable, "-m", "bitsplit_llama.formats._quantize_worker", json.dumps(args)]
    env = dict(os.environ)
    pkg_root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = pkg_root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    tail: list[str] = [] if log_tail is None else log_tail
    before = peak_rss(children=True)
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            env=env, text=True, errors="replace", start_new_session=True)
    done = 0
    try:
        assert proc.stderr is not None
        for line in proc.stderr:
            line = line.rstrip("\n")
            tail.append(line)
            del tail[:-200]
            m = _PROGRESS_RE.match(line)
            if m and progress is not None:
                i = int(m.group(1))
                progress.advance(tensors=i - done)
                done = i
        rc = proc.wait()
    except BaseException:
        # Ctrl-C, SIGTERM or an error of ours: the quantizer must not outlive us
        proc.kill()
        proc.wait()
        raise
    if rc != 0:
        raise UnsupportedModelError(f"{src}: llama.cpp could not quantize it: {_quantizer_reason(tail, rc)}")
    after = peak_rss(children=True)
    return None if after is None else max(after, before or 0)


def _quantizer_reason(tail: list[str], rc: int) -> str:
    for line in reversed(tail):
        for marker in ("bitsplit-error: ", "failed to quantize: "):
            if marker in line:
                return line.split(marker, 1)[1].strip()
    for line in reversed(tail):
        if "error" in line.lower() or "failed" in line.lower():
            return line.strip()
    if rc < 0:
        return f"the quantizer was killed by signal {-rc}"
    return f"the quantizer exited with status {rc}"


def _plan_residuals(src: GGUFFile, base: GGUFFile, wanted: int,
                    kept_layers: frozenset[int] = frozenset()) -> tuple[list[ResidualTensor], int]:
    """Which base tensors need a residual, and of which type (none for those of ``kept_layers``,
    left whole). Returns (plan, exact_count)."""
    plan: list[ResidualTensor] = []
    exact = 0
    for bt in base.tensors:
        if bt.name not in src:
            raise UnsupportedModelError(f"{base.path}: tensor '{bt.name}' does not exist in the source {src.path}")
        st = src.tensor(bt.name)
        if st.shape != bt.shape:
            raise UnsupportedModelError(
                f"{base.path}: tensor '{bt.name}' is {bt.shape_str()} but the source has {st.shape_str()}"
            )
        if placement.layer_of(bt.name) in kept_layers or (st.ggml_type == bt.ggml_type
                                                          and _same_bytes(src, st, base, bt)):
            exact += 1
            continue
        rtype = residual_type_for(bt.n_per_row, wanted)
        plan.append(ResidualTensor(bt.name, bt.shape, bt.ggml_type, rtype, rtype != wanted))
    return plan, exact


def _same_bytes(a: GGUFFile, ta: TensorInfo, b: GGUFFile, tb: TensorInfo) -> bool:
    for start, count in iter_row_chunks(ta.n_rows, ta.n_per_row, CHUNK_ELEMENTS):
        if not np.array_equal(a.read_rows(ta, start, count), b.read_rows(tb, start, count)):
            return False
    return True


def _residual_chunk(src: GGUFFile, st: TensorInfo, base: GGUFFile, bt: TensorInfo, rtype: int,
                    start: int, count: int) -> np.ndarray:
    s = _ggml.dequantize_rows(src.read_rows(st, start, count), st.ggml_type, st.n_per_row)
    b = _ggml.dequantize_rows(base.read_rows(bt, start, count), bt.ggml_type, bt.n_per_row)
    np.subtract(s, b, out=s)
    del b
    if rtype == int(QT.F32):
        return s.view(np.uint8)
    if rtype == int(QT.F16):
        return s.astype(np.float16).view(np.uint8)
    return _ggml.quantize_rows(s, rtype)


def split_model(
    source: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    *,
    residual: str = "q6_k",
    imatrix: str | os.PathLike[str] | None = None,
    threads: int | None = None,
    force: bool = False,
    progress: Progress | None = None,
    base_ftype: str = "q2_k",
    keep_layers: int | None = None,
    vram_gb: float | None = None,
    n_ctx: int = 4096,
    residual_bpw: float | None = None,
) -> SplitReport:
    """Split ``source`` into ``out_dir/base.gguf`` + ``out_dir/residual.gguf``; see the module doc.

    ``keep_layers`` (a count) or ``vram_gb`` (a GPU's memory, with ``n_ctx`` tokens of KV cache)
    leave that many layers whole in the base, with no residual (:mod:`.placement`); neither: every
    layer is split.

    Raises :class:`InputError` subclasses for unusable inputs and :class:`OutputError` when the
    output cannot be written; in every failure case no ``base.gguf``/``residual.gguf`` is left that
    was not there before (with ``force``, replaced files are only replaced on success).
    """
    t0 = time.monotonic()
    source, out_dir = Path(source), Path(out_dir)
    wanted = parse_residual_type(residual)
    check_residual_bpw(residual, residual_bpw)
    if base_ftype not in FTYPES:
        raise InvalidOptionError(f"--base: '{base_ftype}' unknown (expected one of: {', '.join(BASE_TYPES)})")
    if base_ftype in NEEDS_IMATRIX and not imatrix:
        raise InvalidOptionError(f"--base {base_ftype}: llama.cpp makes it only with an importance matrix "
                                 "(--imatrix FILE, or --imatrix auto)")
    threads = _ggml.cpu_count() if threads is None else threads
    if not isinstance(threads, int) or threads < 1:
        raise InvalidOptionError(f"--threads: {threads!r} is not a positive integer")
    placement.check_options(keep_layers, vram_gb, n_ctx)
    imatrix_path = Path(imatrix) if imatrix else None
    if imatrix_path is not None:
        from .imatrix import load_imatrix

        load_imatrix(imatrix_path)  # fail here, with our message, not in the child

    with GGUFFile(source, role="source") as src:
        _check_source(src)
        n_layer = placement.n_layers(src)
        if keep_layers is not None and keep_layers > n_layer:
            raise InvalidOptionError(f"--keep-layers {keep_layers}: {source} has {n_layer} layers")
        _prepare_out_dir(out_dir, force)
        n_params = sum(t.n_elements for t in src.tensors)
        # Q2_K mix ~3.3 bpw, residual up to 8.5 bpw (Q8_0), and with whole layers a second copy of the
        # base while it is rewritten (kept layers up to Q8_0, at most --vram of them): refuse early
        # rather than fail half-way
        whole_copy = 0.0
        if keep_layers:
            whole_copy = n_params * (3.5 + 5.0 * keep_layers / max(n_layer, 1)) / 8
        elif vram_gb is not None:
            whole_copy = min(n_params * 3.5 / 8 + vram_gb * 1e9, n_params * 8.5 / 8)
        _check_space(out_dir, int(n_params * (3.5 + 8.5) / 8 + whole_copy) + (64 << 20))

        tag = f".bitsplit-{os.getpid()}.tmp"
        base_tmp = out_dir / (".base" + tag)
        res_tmp = out_dir / (".residual" + tag)
        whole_tmp = out_dir / (".whole" + tag)
        layers: list[int] = []
        budget: dict | None = None
        try:
            if progress:
                progress.phase("base: llama.cpp quantize", len(src.tensors), 0)
            t_base = time.monotonic()
            child_rss = quantize_model(source, base_tmp, base_ftype, threads, imatrix_path, progress)
            if vram_gb is not None:
                with GGUFFile(base_tmp, role="base") as qb:
                    layers, budget = placement.layers_for_vram(src, qb, int(vram_gb * 1e9), n_ctx)
            elif keep_layers:
                layers = placement.keep_order(n_layer)[:keep_layers]
            if layers:
                if progress:
                    progress.phase(f"base: {len(layers)} of {n_layer} layers whole", 0, 0)
                placement.write_base_with_layers(src, base_tmp, whole_tmp, layers)
                os.replace(whole_tmp, base_tmp)
            base_seconds = time.monotonic() - t_base

            t_res = time.monotonic()
            plan, exact = _make_residual(src, base_tmp, res_tmp, wanted, residual.lower(), base_ftype, imatrix_path,
                                         threads, progress, sorted(layers), residual_bpw)
            with GGUFFile(base_tmp, role="base") as base:
                base_types = dict(Counter(t.type_name for t in base.tensors))
                base_bytes = sum(t.nbytes for t in base.tensors)
            residual_seconds = time.monotonic() - t_res

            # base first: residual.gguf, written last, is what marks a split as complete
            os.replace(base_tmp, out_dir / BASE_NAME)
            os.replace(res_tmp, out_dir / RESIDUAL_NAME)
            _fsync_dir(out_dir)
        except OSError as exc:
            raise write_error(out_dir, exc) from None
        finally:
            for p in (base_tmp, res_tmp, whole_tmp):
                p.unlink(missing_ok=True)
            if progress:
                progress.close()

    with GGUFFile(out_dir / RESIDUAL_NAME, role="residual") as rg:
        residual_bytes = sum(t.nbytes for t in rg.tensors)
    return SplitReport(
        source=source, out_dir=out_dir, base_path=out_dir / BASE_NAME, residual_path=out_dir / RESIDUAL_NAME,
        residual_type=residual.lower(), seconds=time.monotonic() - t0, base_seconds=base_seconds,
        residual_seconds=residual_seconds, peak_rss_bytes=peak_rss(),
        quantizer_peak_rss_bytes=child_rss, n_params=n_params, base_bytes=base_bytes,
        residual_bytes=residual_bytes, base_types=base_types,
        residual_types=dict(Counter(type_name(r.residual_type) for r in plan)),
        fallbacks=sum(r.fallback for r in plan), exact_tensors=exact, residual_tensors=plan,
        kept_layers=sorted(layers), n_layers=n_layer, vram_budget=budget,
    )


def _make_residual(src: GGUFFile, base_path: Path, res_path: Path, wanted: int, residual: str, base_ftype: str,
                   imatrix: Path | None, threads: int, progress: Progress | None,
                   kept_layers: list[int] | None = None, residual_bpw: float | None = None
                   ) -> tuple[list[ResidualTensor], int]:
    with GGUFFile(base_path, role="base") as base:
        plan, exact = _plan_residuals(src, base, int(QT.Q6_K) if wanted == AUTO else wanted,
                                      frozenset(kept_layers or ()))
        if wanted == AUTO:
            choose_auto_types(src, base, plan, residual_bpw, imatrix, progress)
        res_bytes_est = sum(_ggml.row_size(r.residual_type, r.shape[0]) * math.prod(r.shape[1:]) for r in plan)
        _check_space(res_path.parent, res_bytes_est + (16 << 20))
        _write_residual(res_path, src, base, plan, residual, fingerprint(base), fingerprint(src), base_ftype,
                        imatrix, threads, progress, kept_layers or [], residual_bpw)
    return plan, exact


def make_residual(source: str | os.PathLike[str], base: str | os.PathLike[str], out: str | os.PathLike[str], *,
                  residual: str = "q6_k", threads: int = 1, base_type: str = "custom") -> list[ResidualTensor]:
    """Write the residual of ``source`` against an existing ``base`` GGUF to ``out`` (no atomicity:
    for tests and experiments with bases not made by llama.cpp's quantizer, e.g. an F32 base)."""
    wanted = parse_residual_type(residual)
    with GGUFFile(source, role="source") as src:
        plan, _ = _make_residual(src, Path(base), Path(out), wanted, residual.lower(), base_type, None, threads, None)
    return plan


def _fsync_dir(d: Path) -> None:
    try:
        fd = os.open(d, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _write_residual(path: Path, src: GGUFFile, base: GGUFFile, plan: list[ResidualTensor], residual: str,
                    base_fp: str, src_fp: str, base_ftype: str, imatrix: Path | None, threads: int,
                    progress: Progress | None, kept_layers: list[int], residual_bpw: float | None = None) -> None:
    w = StreamingGGUFWriter(path, arch="bitsplit-residual")
    kv = w.kv
    kv.add_uint32("bitsplit.format_version", FORMAT_VERSION)
    kv.add_string("bitsplit.residual_type", residual)
    if residual == "auto":
        kv.add_float32("bitsplit.residual_bpw_target", float(residual_bpw))
    kv.add_string("bitsplit.base_type", base_ftype)
    kv.add_string("bitsplit.base_fingerprint", base_fp)
    kv.add_string("bitsplit.source.file", src.path.name)
    kv.add_uint64("bitsplit.source.size", src.size)
    kv.add_string("bitsplit.source.fingerprint", src_fp)
    kv.add_string("bitsplit.source.architecture", src.architecture)
    if isinstance(src.kv.get("general.name"), str):
        kv.add_string("bitsplit.source.name", src.kv["general.name"])
    kv.add_uint32("bitsplit.fallback_count", sum(r.fallback for r in plan))
    kv.add_uint32("bitsplit.tensor_count", len(plan))
    kv.add_string("bitsplit.imatrix", imatrix.name if imatrix else "")
    kv.add_string(KEPT_LAYERS_KEY, ",".join(str(i) for i in kept_layers))
    # integrity: a CRC-32 of every base tensor (read back now) and of every residual tensor (as it
    # is written), checked by `bitsplit info --verify`
    kv.add_string(BASE_CHECKSUMS_KEY, ",".join(f"{tensor_checksum(base, t):08x}" for t in base.tensors))
    for r in plan:
        w.add_tensor_info(r.name, r.shape, r.residual_type)
    w.reserve_checksums(RESIDUAL_CHECKSUMS_KEY)
    total_bytes = sum(base.tensor(r.name).nbytes for r in plan)
    if progress:
        progress.phase(f"residual: {residual}", len(plan), total_bytes)
    try:
        w.begin_data()
        with cf.ThreadPoolExecutor(max_workers=threads) as pool:
            for r in plan:
                st, bt = src.tensor(r.name), base.tensor(r.name)
                w.begin_tensor(r.name)
                pending: list[tuple[cf.Future, int]] = []
                for start, count in iter_row_chunks(bt.n_rows, bt.n_per_row, CHUNK_ELEMENTS):
                    pending.append((pool.submit(_residual_chunk, src, st, base, bt, r.residual_type, start, count),
                                    count * bt.row_bytes))
                    if len(pending) > threads:  # bounded in-flight work keeps memory bounded
                        fut, nb = pending.pop(0)
                        w.write(fut.result())
                        if progress:
                            progress.advance(nbytes=nb)
                for fut, nb in pending:
                    w.write(fut.result())
                    if progress:
                        progress.advance(nbytes=nb)
                w.end_tensor()
                if progress:
                    progress.advance(tensors=1)
        w.finish()
    finally:
        w.close()


def install_sigterm_handler() -> Callable[[], None]:
    """Make SIGTERM (and on Windows Ctrl-Break, SIGBREAK) unwind like Ctrl-C, so that temporaries are
    removed; returns a restore function."""
    def handler(signum, frame):  # noqa: ARG001
        raise KeyboardInterrupt

    sigs = [signal.SIGTERM] + ([signal.SIGBREAK] if hasattr(signal, "SIGBREAK") else [])
    old = {sig: signal.signal(sig, handler) for sig in sigs}

    def restore() -> None:
        for sig, h in old.items():
            signal.signal(sig, h)
    return restore
