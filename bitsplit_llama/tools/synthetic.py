"""The synthetic split the machine profile is measured on, and its sizes.

A split directory of random weights (Q2_K ``base.gguf``, Q6_K ``residual.gguf``, and the same
weights, W2 + R, as stock Q8_0 in ``q8_0.gguf``: a Q8_0 model's bytes for the verifier's pass),
made once per size and cached under ``<cache>/machine/`` beside the profiles. :class:`Size` says
how large (``FULL``: larger than the last-level cache, :func:`full_size`; ``QUICK``: for tests) and
how long each point is timed.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Optional

import numpy as np

from .cpuinfo import last_level_cache_bytes

Q8_0, Q2_K, Q6_K = 8, 10, 14
#: the synthetic split's weights as stock Q8_0 (W2 + R's competitor: what a Q8_0 model reads), beside it
Q8_0_NAME = "q8_0.gguf"

Log = Callable[[str], None]


def _say(log: Optional[Log], msg: str) -> None:
    if log is not None:
        log(msg)


def machine_dir() -> Path:
    """Where the machine profiles and their synthetic splits are cached."""
    from ..cache import cache_dir

    return cache_dir() / "machine"


@dataclass(frozen=True)
class Size:
    """The synthetic split measured: ``tensors`` Q6_K residuals (Q2_K base) of ``ne0`` x ``ne1``."""
    name: str
    tensors: int
    ne0: int       # row width (the product's input size)
    ne1: int       # rows
    repeat: int    # timed passes per point (after one warm-up), fewer when a pass is slow
    budget_s: float  # timed passes stop once they took this long (at least one)
    bandwidth_gib: float

    @property
    def weights(self) -> int:
        return self.tensors * self.ne0 * self.ne1


#: about 83 MB of Q6_K residual (33 MB of Q2_K base): larger than the L3 of desktop CPUs; servers
#: get more tensors (full_size). Up to 15 rounds per batch: a pass at batch 1 takes a few ms, and with
#: 5 rounds one family's ``vs_ggml`` at batch 1 read 0.73-1.23 over four runs on a 2-core Zen 4
#: (0.84-0.85 over three with 15; the profile then takes ~50 s there instead of ~33)
FULL = Size("full", 3, 4096, 8192, 15, 1.5, 1.0)
#: at most this many tensors of FULL's shape (1.8 GB of residual)
FULL_MAX_TENSORS = 64


def full_size(llc_bytes: Optional[int] = None) -> Size:
    """FULL with enough tensors that the residual is at least 4x the last-level cache: with FULL's
    83 MB, stock ggml read a Xeon's at 1.4x its measured RAM bandwidth (2026-11): from its L3."""
    llc = last_level_cache_bytes() if llc_bytes is None else llc_bytes
    per_tensor = FULL.ne0 * FULL.ne1 * 210 // 256  # Q6_K: 210 bytes per 256 weights
    n = min(FULL_MAX_TENSORS, max(FULL.tensors, -(-4 * llc // per_tensor)))
    return replace(FULL, tensors=n)


#: for tests: small, few repeats (fits in caches; its figures are not the machine's)
QUICK = Size("quick", 2, 1024, 1024, 2, 0.2, 0.125)


def synthetic_split(size: Size = FULL, log: Optional[Log] = None) -> Path:
    """A split directory (base.gguf Q2_K, residual.gguf Q6_K, and the same weights as Q8_0 in
    q8_0.gguf) of ``size.tensors`` random weights of ``size.ne0`` x ``size.ne1``, made once and
    cached. Quantized 1024 rows at a time and tiled: the kernels' speed does not depend on the
    values, and the tiles make it cheap to build."""
    from ..formats import _ggml
    from ..formats.gguf_file import GGUFFile, StreamingGGUFWriter, fingerprint
    from ..formats.split import BASE_NAME, FORMAT_VERSION, RESIDUAL_NAME

    # "q8": with the Q8_0 reference (a split made before it is made again, once)
    tag = f"synthetic-v{FORMAT_VERSION}q8-{size.tensors}x{size.ne0}x{size.ne1}"
    out = machine_dir() / tag
    if all((out / n).exists() for n in (BASE_NAME, RESIDUAL_NAME, Q8_0_NAME)):
        return out
    _say(log, f"building a synthetic split ({size.tensors} tensors of {size.ne0}x{size.ne1}, Q2_K + Q6_K) in {out}")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{tag}.", dir=out.parent))
    try:
        rows = min(1024, size.ne1)
        rng = np.random.default_rng(0)
        w = rng.standard_normal((rows, size.ne0), dtype=np.float32) * np.float32(0.02)
        q2 = _ggml.quantize_rows(w, Q2_K)
        q6 = _ggml.quantize_rows(w - _ggml.dequantize_rows(q2, Q2_K, size.ne0), Q6_K)
        names = [f"blk.{i}.ffn_down.weight" for i in range(size.tensors)]

        def write(path: Path, arch: str, ggml_type: int, block: np.ndarray, kv: Callable | None = None) -> None:
            wr = StreamingGGUFWriter(path, arch)
            if kv is not None:
                kv(wr.kv)
            for n in names:
                wr.add_tensor_info(n, (size.ne0, size.ne1), ggml_type)
            wr.begin_data()
            for n in names:
                wr.begin_tensor(n)
                for s in range(0, size.ne1, rows):
                    wr.write(block[: min(rows, size.ne1 - s)])
                wr.end_tensor()
            wr.finish()
            wr.close()

        base_p = tmp / BASE_NAME
        write(base_p, "llama", Q2_K, q2)
        with GGUFFile(base_p, role="base") as b:
            base_fp = fingerprint(b)

        def res_kv(kv) -> None:
            kv.add_uint32("bitsplit.format_version", FORMAT_VERSION)
            kv.add_string("bitsplit.residual_type", "q6_k")
            kv.add_string("bitsplit.base_fingerprint", base_fp)
            kv.add_string("bitsplit.source.architecture", "llama")
            kv.add_string("bitsplit.source.file", "synthetic (bitsplit machine profile)")
            kv.add_uint32("bitsplit.tensor_count", len(names))

        write(tmp / RESIDUAL_NAME, "bitsplit-residual", Q6_K, q6, res_kv)
        # the same weights (W2 + R, dequantized) as stock Q8_0: ggml's reference for the verifier's pass
        w8 = _ggml.dequantize_rows(q2, Q2_K, size.ne0) + _ggml.dequantize_rows(q6, Q6_K, size.ne0)
        write(tmp / Q8_0_NAME, "llama", Q8_0, _ggml.quantize_rows(w8, Q8_0))
        try:
            os.rename(tmp, out)
        except OSError:  # another process made it meanwhile
            if not (out / Q8_0_NAME).exists():
                raise
        # the same split as made before the Q8_0 reference: superseded
        shutil.rmtree(machine_dir() / f"synthetic-v{FORMAT_VERSION}-{size.tensors}x{size.ne0}x{size.ne1}",
                      ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out
