"""Whole layers: which transformer layers ``bitsplit split --keep-layers N / --vram GB`` leaves
unsplit, and the base GGUF that holds them.

A kept layer's weights go into ``base.gguf`` as they are in the source (a quantized source), or as
Q8_0 where the source is wider (F32/F16/BF16), and get no residual: the drafter then runs those
layers exactly and the verifier reads no residual for them. The other layers are split as usual
(llama.cpp's Q2_K mix + residual). Without either option every layer is split.

Which layers: the first and the last alternately (0, L-1, 1, L-2, ...): llama.cpp's own mixes give
the first and last layers more bits for the same reason (their errors matter most).

``--vram GB``: the Q2_K base, the KV cache for ``n_ctx`` tokens (f16 K and V) and a fixed reserve
for llama.cpp's compute buffers and the GPU runtime (:data:`COMPUTE_RESERVE`) must fit; the budget
left buys whole layers, in the order above, each at the bytes it adds over its Q2_K form.
"""

from __future__ import annotations

import os
import re
import struct
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as QT

from ..errors import InvalidOptionError
from . import _ggml
from .gguf_file import GGUF_MAGIC, GGUFFile, TensorInfo, iter_row_chunks

#: llama.cpp's compute buffers, the CUDA context and fragmentation: a round figure, stated here
COMPUTE_RESERVE = 768 << 20
#: source types a kept layer does not keep as they are (it stores them as Q8_0)
WIDE_TYPES = frozenset({int(QT.F32), int(QT.F16), int(QT.BF16)})
#: rows converted at a time when a kept tensor is requantized
CHUNK_ELEMENTS = 1 << 22

_LAYER = re.compile(r"^blk\.(\d+)\.")


def layer_of(name: str) -> int | None:
    """The layer index of a tensor name (``blk.N.``), or None for tensors outside the layers."""
    m = _LAYER.match(name)
    return int(m.group(1)) if m else None


def keep_order(n_layer: int) -> list[int]:
    """Layers in the order they are kept: 0, L-1, 1, L-2, ..."""
    order: list[int] = []
    lo, hi = 0, n_layer - 1
    while lo <= hi:
        order.append(lo)
        if hi != lo:
            order.append(hi)
        lo, hi = lo + 1, hi - 1
    return order


def n_layers(src: GGUFFile) -> int:
    n = src.kv.get(f"{src.architecture}.block_count")
    if not isinstance(n, int) or n < 1:
        found = {layer_of(t.name) for t in src.tensors} - {None}
        n = max(found) + 1 if found else 0
    return int(n)


def kept_type(t: TensorInfo) -> int:
    """The type a weight of a kept layer is stored in: its own, or Q8_0 for a wide 2-D weight."""
    if t.ggml_type in WIDE_TYPES and len(t.shape) >= 2 and t.n_per_row % 32 == 0:
        return int(QT.Q8_0)
    return t.ggml_type


def kept_bytes(t: TensorInfo) -> int:
    kt = kept_type(t)
    return t.nbytes if kt == t.ggml_type else _ggml.row_size(kt, t.n_per_row) * t.n_rows


def kv_cache_bytes(src: GGUFFile, n_ctx: int) -> int:
    """llama.cpp's f16 K and V for ``n_ctx`` tokens in every layer."""
    arch, kv = src.architecture, src.kv
    n_embd = int(kv.get(f"{arch}.embedding_length") or 0)
    n_head = int(kv.get(f"{arch}.attention.head_count") or 1) or 1
    n_head_kv = kv.get(f"{arch}.attention.head_count_kv") or n_head
    if isinstance(n_head_kv, (list, tuple)):  # per-layer counts
        n_head_kv = max(n_head_kv)
    k_len = int(kv.get(f"{arch}.attention.key_length") or n_embd // n_head)
    v_len = int(kv.get(f"{arch}.attention.value_length") or n_embd // n_head)
    return n_ctx * n_layers(src) * int(n_head_kv) * (k_len + v_len) * 2


def layers_for_vram(src: GGUFFile, base: GGUFFile, vram_bytes: int, n_ctx: int) -> tuple[list[int], dict]:
    """The layers kept whole within ``vram_bytes``, and the budget's terms (bytes)."""
    base_bytes = sum(t.nbytes for t in base.tensors)
    kv_bytes = kv_cache_bytes(src, n_ctx)
    left = vram_bytes - base_bytes - kv_bytes - COMPUTE_RESERVE
    extra: dict[int, int] = {}
    for bt in base.tensors:
        i = layer_of(bt.name)
        if i is not None and bt.name in src:
            extra[i] = extra.get(i, 0) + max(0, kept_bytes(src.tensor(bt.name)) - bt.nbytes)
    layers: list[int] = []
    for i in keep_order(n_layers(src)):
        if extra.get(i, 0) > left:
            break
        left -= extra.get(i, 0)
        layers.append(i)
    terms = {"vram": vram_bytes, "base": base_bytes, "kv_cache": kv_bytes, "reserve": COMPUTE_RESERVE,
             "left": max(left, 0), "fits": vram_bytes >= base_bytes + kv_bytes + COMPUTE_RESERVE}
    return layers, terms


def write_base_with_layers(src: GGUFFile, base_path: Path, out_path: Path, layers: list[int]) -> None:
    """``base_path`` with every tensor of ``layers`` taken from the source (as :func:`kept_type`)
    to ``out_path``: the header's key/values copied byte for byte, every other tensor as it is.
    Written directly (not through gguf-py's reader, which holds a numpy object per vocabulary
    string: 0.5 GB for a 150k-token vocabulary)."""
    with GGUFFile(base_path, role="base") as base, open(out_path, "wb") as fh:
        keep = set(layers)
        names = {bt.name for bt in base.tensors if layer_of(bt.name) in keep}
        align = base.alignment
        types = {bt.name: (kept_type(src.tensor(bt.name)) if bt.name in names else bt.ggml_type) for bt in base.tensors}
        sizes, offsets, off = {}, {}, 0
        for bt in base.tensors:
            sizes[bt.name] = _ggml.row_size(types[bt.name], bt.n_per_row) * bt.n_rows
            offsets[bt.name] = off
            off += -(-sizes[bt.name] // align) * align
        fh.write(GGUF_MAGIC + struct.pack("<IQQ", base.version, len(base.tensors), len(base.kv)))
        fh.write(base.header_bytes()[24:base.kv_end])
        for bt in base.tensors:
            name = bt.name.encode()
            fh.write(struct.pack("<Q", len(name)) + name + struct.pack("<I", len(bt.shape)))
            fh.write(struct.pack(f"<{len(bt.shape)}Q", *bt.shape) + struct.pack("<IQ", types[bt.name], offsets[bt.name]))
        fh.write(b"\0" * (-fh.tell() % align))
        data_start = fh.tell()
        for bt in base.tensors:
            assert fh.tell() - data_start == offsets[bt.name]
            if bt.name not in names:
                for start, count in iter_row_chunks(bt.n_rows, bt.n_per_row, CHUNK_ELEMENTS):
                    fh.write(base.read_rows(bt, start, count))
            else:
                st = src.tensor(bt.name)
                kt = types[bt.name]
                for start, count in iter_row_chunks(st.n_rows, st.n_per_row, CHUNK_ELEMENTS):
                    rows = src.read_rows(st, start, count)
                    if kt != st.ggml_type:
                        f = _ggml.dequantize_rows(rows, st.ggml_type, st.n_per_row)
                        rows = _ggml.quantize_rows(np.ascontiguousarray(f), kt)
                    fh.write(rows)
            fh.write(b"\0" * (-sizes[bt.name] % align))
        fh.flush()
        os.fsync(fh.fileno())


def check_options(keep_layers: int | None, vram_gb: float | None, n_ctx: int) -> None:
    if keep_layers is not None and vram_gb is not None:
        raise InvalidOptionError("--keep-layers and --vram both choose the layers kept whole: give one")
    if keep_layers is not None and (not isinstance(keep_layers, int) or keep_layers < 0):
        raise InvalidOptionError(f"--keep-layers: {keep_layers!r} is not a whole number of layers (0 or more)")
    if vram_gb is not None and not (vram_gb > 0 and vram_gb < 1e5):
        raise InvalidOptionError(f"--vram: {vram_gb!r} is not a GPU memory size in GB (e.g. 24)")
    if not isinstance(n_ctx, int) or n_ctx < 1:
        raise InvalidOptionError(f"--n-ctx: {n_ctx!r} is not a positive number of tokens")
