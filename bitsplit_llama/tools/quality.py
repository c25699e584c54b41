"""``bitsplit eval``: how faithful is the split verifier to its source, next to other quantizations.

Every model scores the same tokens, in chunks of ``n_ctx`` tokens decoded as one batch (the same
batch size for all, inside llama.cpp on this machine). At every position we compare the model's
next-token distribution with the reference's: KL(reference || model) from float32 logits, whether
the argmaxes agree (top-1), and the model's perplexity on the text itself.

The reference should be the exact source: a quantized reference file (say the Q4_K_M a split was
made from) is first dequantized to an F32 GGUF (cached), so that llama.cpp computes it without any
weight or activation rounding of its own.
"""

from __future__ import annotations

import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from ..errors import InputError, InvalidOptionError, MismatchError
from ..formats.gguf_file import GGUFFile, check_readable_file, fingerprint

FLOAT_TYPES = {0, 1, 30}  # F32, F16, BF16


@dataclass
class ModelScore:
    name: str
    path: str
    kl_mean: float
    kl_p99: float
    kl_max: float
    kl_mean_after_first: float
    top1: float
    ppl: float
    seconds: float
    act_bits: int | dict | None = None  # a split verifier's activation bits (as --act-bits resolved here)
    kernel: str | None = None  # a split verifier's kernel family (what computed its products)
    # whose arithmetic rounded the activations of the base's (or the model's) weight products: "host"
    # (this library, exact activations), "cpu" (ggml-cpu: stock models, layers llama.cpp computes),
    # "cuda" / "cuda-mmvq" / "metal" (emulated on the host: --device-numerics), "rpc" / "gpu" (the device's own)
    numerics: str | None = None
    # emulated numerics with outlier channels kept exact (--outlier-channels): how many per row, and the
    # base bytes the host would read for them, as a share of the residual's bytes over the same passes
    outliers: int | None = None
    outliers_fixed: bool | None = None  # from --outlier-imatrix: one set per weight, not each row's own
    outlier_pool: int | None = None  # --outlier-pool: each row's own largest among the weight's set of this size
    outlier_bytes_share: float | None = None
    # the device's rounding corrected by a second product of the base (--compensation): the rule assumed
    compensation: str | None = None

    def to_json(self) -> dict:
        return {k: (round(v, 6) if isinstance(v, float) else v) for k, v in self.__dict__.items()
                if v is not None or k not in ("act_bits", "kernel", "outliers", "outliers_fixed", "outlier_pool",
                                                     "outlier_bytes_share", "compensation")}


@dataclass
class EvalReport:
    reference: str
    reference_used: str
    text: str
    n_tokens: int
    n_ctx: int
    n_chunks: int
    models: list[ModelScore] = field(default_factory=list)

    def to_json(self) -> dict:
        return {"reference": self.reference, "reference_used": self.reference_used, "text": self.text,
                "n_tokens": self.n_tokens, "n_ctx": self.n_ctx, "n_chunks": self.n_chunks,
                "models": [m.to_json() for m in self.models]}


def exact_reference(path: Path, threads: int, log: Callable[[str], None] | None = None) -> Path:
    """``path`` itself if its weights are float already, else its dequantization to F32 (cached)."""
    with GGUFFile(path, role="reference") as g:
        if all(t.ggml_type in FLOAT_TYPES for t in g.tensors):
            return path
        fp = fingerprint(g)[:16]
    from ..cache import cache_dir
    from ..formats.split import quantize_model

    out_dir = cache_dir() / "references"
    out = out_dir / f"{path.stem}.{fp}.f32.gguf"
    if out.exists():
        return out
    out_dir.mkdir(parents=True, exist_ok=True)
    if log:
        log(f"dequantizing the reference {path.name} to F32 (once; cached as {out})")
    tmp = out_dir / f".{out.name}.{os.getpid()}.tmp"
    try:
        quantize_model(path, tmp, "f32", threads)
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return out


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float32, copy=True)
    x -= x.max(axis=1, keepdims=True)
    x -= np.log(np.exp(x).sum(axis=1, keepdims=True))
    return x


def load_text_tokens(model, text_path: Path) -> list[int]:
    check_readable_file(text_path, "text")
    text = text_path.read_text(encoding="utf-8", errors="replace")
    if not text.strip():
        raise InputError(f"{text_path}: the text file is empty")
    return model.tokenize(text, add_special=False)


def _option_list(value: str | list, check: Callable, everything: list | None = None) -> list:
    """A comma-separated option's items (or a list's), each through ``check`` (the item as used, or one
    message naming it), repeats dropped; "all" alone: ``everything``."""
    items = value if isinstance(value, list) else str(value).split(",")
    items = [v.strip() if isinstance(v, str) else v for v in items]
    if everything is not None and items == ["all"]:
        return list(everything)
    out: list = []
    for v in items:
        v = check(v)
        if v not in out:
            out.append(v)
    return out


def check_kernels(value: str | list[str] | None) -> list[str] | None:
    """``--kernel``: comma-separated kernel families this CPU runs (under ``BITSPLIT_MAX_ISA``), or
    "all" (every one of them, the policy's order); None: the kernel policy's choice."""
    if value is None:
        return None
    from ..native import policy

    here = policy.families()

    def family(n: str) -> str:
        if n not in here:
            raise InvalidOptionError(f"--kernel: '{n}' is not a kernel family that runs {policy.where_here()} (expected 'all' or "
                                     f"a comma-separated list of: {', '.join(here)})")
        return n

    return _option_list(value, family, here)


# --compensation: the runs of each device row, without and with the correction
COMPENSATION = {"auto": None, "off": [False], "on": [True], "both": [False, True]}


def check_numerics_list(value: str | list[str] | None) -> list[str] | None:
    """``--device-numerics``: a comma-separated list of backends (or "all") as a list, each checked;
    None: the verifier as this machine computes it ("host") alone."""
    from ..native.residual import NUMERICS, check_numerics

    if value is None:
        return None
    return _option_list(value, check_numerics, list(NUMERICS))


def check_outliers_list(value: str | list[int] | None) -> list[int]:
    """``--outlier-channels``: comma-separated numbers of exact channels per row (default [0])."""
    from ..native.residual import check_outliers

    if value is None:
        return [0]

    def channels(v) -> int:
        try:
            n = int(v)
        except (TypeError, ValueError):
            raise InvalidOptionError(f"--outlier-channels: '{v}' is not a number of channels") from None
        return check_outliers(n)

    return _option_list(value, channels)


def set_fixed_channels(residual, tensors, importance: dict, n: int, source) -> None:
    """Each residual weight's ``n`` channels of largest importance (0: none) as its fixed exact set. A
    weight the imatrix does not name (the token embedding: a lookup, no product) gets none; an imatrix
    naming none of them is another model's."""
    found = 0
    for name, ne, *_ in tensors:
        v = importance.get(name)
        if v is None:
            continue
        if len(v) != ne[0]:
            raise MismatchError(f"{source}: the imatrix entry for '{name}' has {len(v)} columns, the weight {ne[0]}")
        found += 1
        residual.set_exact_channels(name, np.argsort(-np.asarray(v), kind="stable")[:n].tolist() if n else [])
    if not found and tensors:
        raise MismatchError(f"{source}: the imatrix names none of the split's weights (made for another model?)")


def evaluate(model_dir: str | os.PathLike[str], reference: str | os.PathLike[str], text: str | os.PathLike[str], *,
             vs: list[str | os.PathLike[str]] = (), n_ctx: int = 512, max_chunks: int | None = None,
             threads: int | None = None, precision: str = "auto", log: Callable[[str], None] | None = None,
             progress=None, rpc: str | None = None, rpc_timeout: float = 60.0,
             n_gpu_layers: int | None = None, act_bits: str = "auto",
             kernels: str | list[str] | None = None, numerics: str | list[str] | None = None,
             outliers: str | list[int] | None = None, outlier_imatrix: str | os.PathLike[str] | None = None,
             outlier_pool: int | None = None, compensation: str = "auto") -> EvalReport:
    """Score the split verifier in ``model_dir`` and each ``vs`` GGUF against ``reference``. With
    ``rpc`` or ``n_gpu_layers``, the verifier whose base is on those RPC servers or on the GPU (add
    mode) is scored too, after the all-local one. ``kernels`` (:func:`check_kernels`): score each
    verifier once per kernel family, pinned for all its products (as ``BITSPLIT_KERNEL`` pins one),
    against the one reference pass. ``numerics`` (:func:`check_numerics_list`): score the all-local
    verifier once per backend whose activation rounding before ``W2 . x`` the host emulates
    (native/numerics.c), with ``R . x`` as add mode computes it: the verifier that device would give;
    ``outliers`` (numbers of channels, each row's largest kept exact: a correction measured before it is
    built): each emulated backend once per number; with ``outlier_imatrix``, each weight's channels of
    largest importance in that imatrix, the same for every row (the host would keep those columns as a
    dense slab), instead of each row's largest; with ``outlier_pool`` P too, each weight's P most
    important channels are the slab and each row takes its own N largest among them. ``compensation``
    ("off", "on", "both": each row without and with it; "auto": the device rows as ``run`` computes
    them, compensated where the device's rule is known, the emulated ones not): the device's rounding
    corrected by a second product of the base on the device, ``W2 . (x - round(x))``
    (bitsplit_ctx_set_compensation), for each emulated backend by its own rule and for a real device
    by its own (:func:`rpc_mod.compensation_rule`)."""
    from ..formats.modeldir import validate_split
    from ..runtime.llamacpp import Context, Model, default_threads
    from ..runtime.verifier import SplitModel

    if n_ctx < 16:
        raise InvalidOptionError(f"--n-ctx: {n_ctx} is too small for evaluation (at least 16)")
    if max_chunks is not None and max_chunks < 1:
        raise InvalidOptionError(f"--chunks: {max_chunks} is not a positive integer")
    kernels = check_kernels(kernels)
    numerics = check_numerics_list(numerics)
    outliers = check_outliers_list(outliers)
    if outliers != [0] and not numerics:
        raise InvalidOptionError("--outlier-channels applies to emulated device numerics: give --device-numerics too")
    importance = None
    if outlier_imatrix is not None:
        from ..formats.imatrix import load_imatrix

        if outliers == [0]:
            raise InvalidOptionError("--outlier-imatrix chooses the channels --outlier-channels counts: give it too")
        importance = load_imatrix(outlier_imatrix)
    if outlier_pool is not None:
        from ..native.residual import check_outliers

        check_outliers(outlier_pool, "--outlier-pool")
        if importance is None or outlier_pool < max(outliers):
            raise InvalidOptionError(f"--outlier-pool {outlier_pool}: needs --outlier-imatrix and at least the largest "
                                     f"--outlier-channels ({max(outliers)})")
    if compensation not in COMPENSATION:
        raise InvalidOptionError(f"--compensation: '{compensation}' unknown (expected one of: {', '.join(COMPENSATION)})")
    if compensation in ("on", "both") and outliers != [0]:
        raise InvalidOptionError("--compensation and --outlier-channels are two corrections of the same rounding: "
                                 "give one")
    if compensation in ("on", "both") and not (numerics or rpc or n_gpu_layers):
        raise InvalidOptionError("--compensation corrects a device's rounding: give --device-numerics, --rpc or -ngl")
    threads = threads or default_threads()
    base_p, _ = validate_split(model_dir)
    from ..runtime import rpc as rpc_mod

    if rpc:
        rpc_mod.parse_endpoints(rpc)
        rpc_mod.check_timeout(rpc_timeout)
        rpc_mod.require()
    reference, text = Path(reference), Path(text)
    vs = [Path(v) for v in vs]
    for v in vs:
        check_readable_file(v, "--vs model")
    ref_used = exact_reference(reference, threads, log)

    base_model = Model(base_p)
    try:
        tokens = load_text_tokens(base_model, text)
        n_vocab = base_model.n_vocab
        add_bos = base_model.add_bos
        bos = base_model.bos
    finally:
        base_model.close()
    n_chunks = len(tokens) // n_ctx
    if max_chunks:
        n_chunks = min(n_chunks, max_chunks)
    if n_chunks < 1:
        raise InputError(f"{text}: {len(tokens)} tokens, fewer than one chunk of --n-ctx {n_ctx}")
    chunks = [tokens[i * n_ctx:(i + 1) * n_ctx] for i in range(n_chunks)]
    if add_bos:  # as llama-perplexity does: each chunk starts like a document
        for c in chunks:
            c[0] = bos

    report = EvalReport(reference=str(reference), reference_used=str(ref_used), text=str(text),
                        n_tokens=n_chunks * n_ctx, n_ctx=n_ctx, n_chunks=n_chunks)
    positions = list(range(n_ctx))

    with tempfile.TemporaryDirectory(prefix="bitsplit-eval-") as tmp:
        ref_lp = np.lib.format.open_memmap(Path(tmp) / "ref.npy", mode="w+", dtype=np.float32,
                                           shape=(n_chunks, n_ctx, n_vocab))

        def run_plain(path: Path, consume) -> float:
            m = Model(path)
            try:
                if m.n_vocab != n_vocab:
                    raise MismatchError(f"{path}: vocabulary of {m.n_vocab} tokens, the split model has {n_vocab}")
                c = Context(m, n_ctx=n_ctx, n_batch=n_ctx, n_threads=threads)
                try:
                    t0 = time.monotonic()
                    for i, chunk in enumerate(chunks):
                        c.clear()
                        c.decode(chunk, positions)
                        consume(i, c.logits(n_ctx))
                    return time.monotonic() - t0
                finally:
                    c.close()
            finally:
                m.close()

        def store_ref(i, logits):
            ref_lp[i] = _log_softmax(logits)
            if progress:
                progress.advance(tensors=1)

        if progress:
            progress.phase("reference", n_chunks, 0)
        run_plain(ref_used, store_ref)

        def scorer(name: str, path: str):
            kls, top1, nll = [], [], []

            def consume(i, logits):
                lp = _log_softmax(logits)
                r = ref_lp[i]
                kls.append((np.exp(r) * (r - lp)).sum(axis=1))
                top1.append(np.argmax(r, axis=1) == np.argmax(lp, axis=1))
                nxt = np.asarray(chunks[i][1:])
                nll.append(-lp[np.arange(n_ctx - 1), nxt])
                if progress:
                    progress.advance(tensors=1)

            def finish(seconds: float) -> ModelScore:
                kl = np.concatenate(kls)
                kl_pos = np.stack(kls)  # chunks x positions
                return ModelScore(name=name, path=path, kl_mean=float(kl.mean()), kl_p99=float(np.percentile(kl, 99)),
                                  kl_max=float(kl.max()), kl_mean_after_first=float(kl_pos[:, 1:].mean()),
                                  top1=float(np.concatenate(top1).mean()), ppl=float(np.exp(np.concatenate(nll).mean())),
                                  seconds=seconds)

            return consume, finish

        # the split verifier first (all local, then with its base on the RPC servers)
        configs = [("bitsplit verifier", {}, numerics or ["host"])]
        if rpc or n_gpu_layers:
            where = f"rpc {rpc}" if rpc else "the GPU"
            ngl = "" if n_gpu_layers is None else f" (-ngl {n_gpu_layers})"
            configs.append((f"bitsplit verifier, base on {where}{ngl}",
                            {"rpc": rpc, "rpc_timeout": rpc_timeout, "n_gpu_layers": n_gpu_layers},
                            ["rpc" if rpc else "gpu"]))
        for name, kw, numerics_here in configs:
            sm = SplitModel(model_dir, n_ctx=n_ctx, n_batch=n_ctx, n_threads=threads, precision=precision,
                            act_bits=act_bits, **kw)
            try:
                if sm.model.n_vocab != n_vocab:
                    raise MismatchError(f"{model_dir}: vocabulary differs from the reference")
                ts = sm.residual.tensors()
                first = ts[0][0] if ts else None  # none: every layer kept whole
                # the rule each row's device is taken to round by: an emulated backend's own, a real device's own
                dev_rule = {"rpc": "cpu" if rpc else "host",
                            "gpu": rpc_mod.compensation_rule("auto", False, n_gpu_layers or 999) if not rpc else "host"}

                def comps_of(n: str) -> list[bool]:
                    if n == "host" or dev_rule.get(n, n) == "host":
                        return [False]
                    if compensation == "auto":
                        return [n in ("rpc", "gpu")]
                    return COMPENSATION[compensation]

                runs = [(n, o, f, cp) for n in numerics_here for o in (outliers if n not in ("host", "rpc", "gpu") else [0])
                        for cp in comps_of(n) for f in (kernels or [None])]
                for num, out_ch, fam, comp in runs:
                    label = name if num in ("host", "rpc", "gpu") or numerics is None else f"{name}, {num} numerics"
                    pool = outlier_pool if out_ch and outlier_pool else None
                    if out_ch:
                        kind = f"of a fixed {pool} " if pool else "fixed " if importance is not None else ""
                        label = f"{label}, {out_ch} {kind}exact channels"
                    if importance is not None and num not in ("rpc", "gpu"):
                        set_fixed_channels(sm.residual, ts, importance, pool or out_ch, outlier_imatrix)
                    # the rule the device is taken to round by: an emulated backend's own; llama.cpp's CPU
                    # backend behind an RPC server (bitsplit rpc-server); CUDA for a GPU
                    comp_rule = dev_rule.get(num, num) if comp else "host"
                    if comp:
                        label = f"{label}, compensated"
                    if fam is not None:
                        label = f"{label} ({fam})"
                    if num not in ("rpc", "gpu"):  # fixed sets alone where an imatrix names them
                        sm.residual.set_compensation("host")
                        sm.residual.set_numerics(num, 0 if importance is not None and not pool else out_ch)
                    sm.residual.set_compensation(comp_rule)
                    sm.residual.reset_counters()
                    if fam is not None:
                        sm.residual.set_kernel(fam)  # pinned for every pass: the verifier is batch-invariant
                    if progress:
                        progress.phase(label, n_chunks, 0)
                    consume, finish = scorer(label, str(model_dir))
                    t0 = time.monotonic()
                    for i, chunk in enumerate(chunks):
                        sm.ctx.clear()
                        with sm.verifying() as ctx:
                            ctx.decode(chunk, positions)
                            consume(i, ctx.logits(n_ctx))
                    score = finish(time.monotonic() - t0)
                    score.numerics = num
                    score.compensation = comp_rule if comp else None
                    if out_ch:
                        c = sm.residual.counters()
                        score.outliers = out_ch
                        score.outliers_fixed = importance is not None
                        score.outlier_pool = pool
                        score.outlier_bytes_share = c.bytes_outlier_base / max(c.bytes_residual, 1)
                    score.act_bits = sm.residual.act_bits
                    # what computed the products (of the first weight; one family for all with --kernel)
                    if first is not None:
                        score.kernel = sm.residual.family_of(first, n_ctx, with_base=not sm.residual_alone)
                    report.models.append(score)
            finally:
                sm.close()

        for v in vs:
            if progress:
                progress.phase(v.name, n_chunks, 0)
            consume, finish = scorer(v.name, str(v))
            score = finish(run_plain(v, consume))
            score.numerics = "cpu"  # llama.cpp's CPU backend computed it
            report.models.append(score)
        del ref_lp
    return report
