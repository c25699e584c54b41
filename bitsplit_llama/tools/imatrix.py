"""``bitsplit imatrix``: an importance matrix computed through this project's own eval callback.

llama-cpp-python cannot run llama.cpp's imatrix tool; the native library's collector
(``bitsplit_imatrix_callback``) observes every product of a ``blk.*`` weight while the source model
reads a text in chunks of ``n_ctx`` tokens (each chunk a fresh sequence, one batch, BOS first where
the vocabulary wants one, as llama-imatrix does) and sums the squared activations entering each input
column. The file is llama.cpp's imatrix GGUF, so stock ``llama-quantize --imatrix`` reads it too.

A calibration text ships with the package (:func:`calibration_text`): original code in a dozen
languages and prose in several, written for this purpose and not any evaluation text.
``bitsplit split SRC --imatrix auto`` computes the matrix from it (cached by source and text).
"""

from __future__ import annotations

import hashlib
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from ..errors import InputError, InvalidOptionError, NativeError, UnsupportedModelError

CALIBRATION = "calibration.txt"


def calibration_text() -> Path:
    """The calibration text shipped with the package."""
    return Path(__file__).resolve().parent.parent / "data" / CALIBRATION


@dataclass
class ImatrixReport:
    source: str
    text: str
    out: str
    n_chunks: int
    n_ctx: int
    n_tokens: int
    n_entries: int
    n_products: int
    seconds: float

    def to_json(self) -> dict:
        return asdict(self)


def compute_imatrix(source: str | os.PathLike[str], text: str | os.PathLike[str], out: str | os.PathLike[str], *,
                    chunks: int | None = None, n_ctx: int = 512, threads: int | None = None, progress=None,
                    log: Callable[[str], None] | None = None) -> ImatrixReport:
    """Read ``text`` with ``source`` and write its importance matrix to ``out`` (see the module doc)."""
    from ..formats.gguf_file import GGUFFile, check_readable_file
    from ..formats.imatrix import write_imatrix
    from ..native import load
    from ..runtime.llamacpp import Context, Model, default_threads

    source, text, out = Path(source), Path(text), Path(out)
    if n_ctx < 16:
        raise InvalidOptionError(f"--n-ctx: {n_ctx} is too small (at least 16: shorter passes are not collected)")
    if chunks is not None and chunks < 1:
        raise InvalidOptionError(f"--chunks: {chunks} is not a positive integer")
    check_readable_file(source, "source")
    check_readable_file(text, "text")
    if out.is_dir():
        raise InvalidOptionError(f"-o {out}: is a directory (expected the imatrix file to write)")
    if not out.parent.is_dir():
        raise InvalidOptionError(f"-o {out}: directory {out.parent} does not exist")
    with GGUFFile(source, role="source") as g:
        arch = g.architecture
    body = text.read_text(encoding="utf-8", errors="replace")
    if not body.strip():
        raise InputError(f"{text}: the text file is empty")
    threads = threads or default_threads()
    t0 = time.monotonic()
    model = Model(source)
    ffi, lib = load()
    holder = ffi.new("bitsplit_imatrix **")
    if lib.bitsplit_imatrix_new(holder) != 0:
        model.close()
        raise NativeError("out of memory creating the imatrix collector")
    im = holder[0]
    ctx = None
    try:
        tokens = model.tokenize(body, add_special=False)
        n_chunks = len(tokens) // n_ctx
        if chunks is not None:
            n_chunks = min(n_chunks, chunks)
        if n_chunks < 1:
            raise InputError(f"{text}: {len(tokens)} tokens, fewer than one chunk of --n-ctx {n_ctx}")
        ctx = Context(model, n_ctx=n_ctx, n_batch=n_ctx, n_threads=threads, op_offload=False,
                      cb_eval=int(ffi.cast("uintptr_t", lib.bitsplit_imatrix_callback)),
                      cb_eval_user_data=int(ffi.cast("uintptr_t", im)))
        if progress:
            progress.phase("imatrix", n_chunks, 0)
        positions = list(range(n_ctx))
        msg = ffi.new("char[512]")
        for i in range(n_chunks):
            chunk = tokens[i * n_ctx:(i + 1) * n_ctx]
            if model.add_bos:
                chunk[0] = model.bos
            ctx.clear()
            # every row's logits, as llama-imatrix asks: llama.cpp computes the last layer's
            # feed-forward for output rows only, so fewer would starve those weights' statistics
            ctx.decode(chunk, positions, logits=True)
            status = lib.bitsplit_imatrix_take_error(im, msg, 512)
            if status != 0:
                raise NativeError(f"{source}: chunk {i}: {ffi.string(msg).decode(errors='replace')}")
            if progress:
                progress.advance(tensors=1)
            if log:
                log(f"chunk {i + 1}/{n_chunks}")
        entries: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        name_p = ffi.new("char **")
        k_p, m_p = ffi.new("int64_t *"), ffi.new("int64_t *")
        for i in range(lib.bitsplit_imatrix_n_entries(im)):
            lib.bitsplit_imatrix_entry(im, i, name_p, k_p, m_p, ffi.NULL, ffi.NULL)
            k, m = k_p[0], m_p[0]
            sums = np.empty(k * m, dtype=np.float64)
            counts = np.empty(m, dtype=np.int64)
            lib.bitsplit_imatrix_entry(im, i, ffi.NULL, ffi.NULL, ffi.NULL, ffi.from_buffer("double[]", sums),
                                       ffi.from_buffer("int64_t[]", counts))
            entries[ffi.string(name_p[0]).decode()] = (sums.reshape(m, k), counts)
        n_products = int(lib.bitsplit_imatrix_n_products(im))
    finally:
        if ctx is not None:
            ctx.close()
        model.close()
        lib.bitsplit_imatrix_free(im)
    if not entries:
        raise UnsupportedModelError(f"{source}: no product of a 'blk.*' weight was seen: not a layered model "
                                    "llama.cpp computes on this machine")
    write_imatrix(out, entries, architecture=arch, datasets=[text.name], chunk_count=n_chunks, chunk_size=n_ctx)
    return ImatrixReport(source=str(source), text=str(text), out=str(out), n_chunks=n_chunks, n_ctx=n_ctx,
                         n_tokens=n_chunks * n_ctx, n_entries=len(entries), n_products=n_products,
                         seconds=round(time.monotonic() - t0, 2))


def auto_imatrix(source: str | os.PathLike[str], *, threads: int | None = None, progress=None,
                 log: Callable[[str], None] | None = None) -> Path:
    """The importance matrix of ``source`` on the shipped calibration text, computed once and cached
    (keyed by the source's fingerprint and the text's hash)."""
    from ..cache import cache_dir
    from ..formats.gguf_file import GGUFFile, fingerprint

    text = calibration_text()
    with GGUFFile(source, role="source") as g:
        fp = fingerprint(g)
    key = hashlib.sha256((fp + hashlib.sha256(text.read_bytes()).hexdigest()).encode()).hexdigest()[:16]
    d = cache_dir() / "imatrix"
    d.mkdir(parents=True, exist_ok=True)
    path = d / f"{Path(source).stem}-{key}.gguf"
    if path.is_file():
        if log:
            log(f"importance matrix: {path} (cached)")
        return path
    if log:
        log(f"computing the importance matrix of {Path(source).name} on the calibration text -> {path}")
    rep = compute_imatrix(source, text, path, threads=threads, progress=progress)
    if log:
        log(f"importance matrix: {rep.n_entries} weights, {rep.n_tokens} tokens, {rep.seconds:.0f} s")
    return path
