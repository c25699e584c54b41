"""Timed passes: what the machine profile measures, and ``bitsplit plan --gpu none``'s products.

The residual product per kernel family and batch (:func:`measure_residual`, with stock ggml's product
on the same bytes timed in turn: ``vs_ggml``), the verifier's product W2 + R per family too (the
measured kernel policy's input) and with the policy's family against stock Q8_0, the native drafter
(:func:`measure_native_draft`), stock ggml alone (:func:`measure_ggml`; its passes are :class:`..formats._ggml.MulMatPasses`), the
memory bandwidth now (:func:`bandwidth_now`), and one split's own drafter and verify passes
(:func:`measure_split`). Contenders are timed pass by pass in turn (:func:`interleaved`), so that a
shared machine's drift falls on each alike.
"""

from __future__ import annotations

import contextlib
import math
import os
import statistics
import time
from pathlib import Path
from typing import Callable, Iterator, Optional

import numpy as np

from .cpuinfo import threads_or_default
from .synthetic import Q8_0_NAME, Log, Size

#: batch sizes measured for every family (each power of two to 64: the rate and its share of the
#: family's peak, :func:`family_peaks`, column by column as a product becomes compute-bound)
BATCHES = (1, 2, 4, 8, 16, 32, 64)
#: batch sizes of the verifier pass (W2 + R) measured with the policy's family
WITH_BASE_BATCHES = (1, 2, 4, 16)
#: batch sizes of the verifier pass (W2 + R) measured for every SIMD family (the measured kernel policy's
#: input); all within PIN_MAX_COLS, so each family is pinned with Residual.set_kernel. The quick size
#: measures all five too: its passes take 0.2-6 ms, these rows about 0.1 s of a quick profile's ~2 s
#: (7 families, a 2-core AMD EPYC VM)
WITH_BASE_FAMILY_BATCHES = (1, 2, 4, 8, 16)
#: batch sizes of the stock ggml reference
GGML_BATCHES = (1, 16)
#: batch sizes of ggml on the base (a drafter pass: a chain drafts 1 row, a tree a few per round)
GGML_BASE_BATCHES = (1, 2, 4, 16)
#: batch sizes of the native drafter (those it takes: from the draft family's smallest)
DRAFT_BATCHES = (1, 2, 4, 16)
#: a family pinned with Residual.set_kernel serves passes up to this many columns (BS_DECODE_COLS in
#: native/bs_internal.h); larger passes are measured on a context loaded with BITSPLIT_KERNEL set
PIN_MAX_COLS = 32


def _say(log: Optional[Log], msg: str) -> None:
    if log is not None:
        log(msg)


def _timed(one_pass: Callable[[], None], size: Size, warm_up: bool = True) -> tuple[float, int]:
    """(median seconds of a pass, passes timed): one warm-up pass (unless the caller made one), then
    up to ``size.repeat`` passes or ``size.budget_s`` seconds of them, at least one."""
    if warm_up:
        one_pass()
    ts = interleaved({"pass": one_pass}, size)["pass"]  # one pass in turn with itself: the same rounds
    return statistics.median(ts), len(ts)


@contextlib.contextmanager
def _env(name: str, value: str) -> Iterator[None]:
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


def _row(family: str, batch: int, seconds: float, nbytes: int, weights: int, threads: int, bandwidth: float,
         **extra) -> dict:
    gbs = nbytes / seconds / 1e9
    return {"family": family, "batch": batch, "seconds": round(seconds, 6), "bytes": nbytes,
            "gb_per_s": round(gbs, 3), "gb_per_s_per_core": round(gbs / threads, 3),
            "weights_per_s": round(weights / seconds), "weights_per_s_per_core": round(weights / seconds / threads),
            # weight.column products (a weight times one column's activation) per second and core, in G:
            # what the family's peak (family_peaks) bounds
            "gw_cols_per_s_per_core": round(weights * batch / seconds / threads / 1e9, 4),
            "bandwidth_use": round(gbs * 1e9 / bandwidth, 4) if bandwidth > 0 else None, **extra}


#: what native/arch/<arch>/peak.c times for each family's peak, and the weight.column MACs one step
#: counts (the C source is the reference; these label doctor's output). The 16-bit integer families
#: count one 8-bit activation digit per MAC: R alone takes the high digit alone in every block
#: without an outlier (all of doctor's); both digits take two steps, so half the peak is their ceiling.
PEAK_INSTRUCTIONS = {
    "generic": "mulps + addps xmm (SSE2), 4 MACs",
    "avx2-f32": "vfmadd231ps ymm, 8 MACs",
    "avx2-int16": "vpmaddubsw + vpmaddwd + vpaddd ymm, 32 MACs (one 8-bit activation digit)",
    "avxvnni-int16": "vpmaddubsw + {vex} vpdpwssd ymm, 32 MACs (one 8-bit activation digit)",
    "avx512vnni-int16": "vpmaddubsw + vpdpwssd ymm (EVEX), 32 MACs (one 8-bit activation digit)",
    "vnni-int24": "vpdpbusd zmm, 64 / 3 MACs (three 8-bit activation digits)",
    "avx512-bf16": "vdpbf16ps zmm, 32 MACs",
    "amx-bf16": "tdpbf16ps, 8192 MACs (untested on AMX hardware)",
    "neon-f32": "fmla .4s, 4 MACs",
    "neon-int16": "sdot + mla .4s, 16 MACs (one 8-bit activation digit)",
}
#: seconds each family's peak is timed for (the fastest of runs of a fortieth of it)
PEAK_SECONDS = 0.05


def family_peaks(families: list[str], seconds: float = PEAK_SECONDS) -> dict[str, Optional[float]]:
    """Each family's peak on one core: G weight.column multiply-accumulates per second of its multiply
    step, timed in registers on this thread (``bitsplit_family_peak``, native/arch/<arch>/peak.c).
    None where the library has no figure: a family this CPU does not run, or a build without the
    function (an architecture without a peak.c)."""
    from ..native.build import load

    _, lib = load()
    try:
        peak = lib.bitsplit_family_peak
    except AttributeError:  # cffi: declared in bitsplit.h, not in this architecture's library
        return {f: None for f in families}
    out: dict[str, Optional[float]] = {}
    for f in families:
        v = float(peak(f.encode(), float(seconds)))
        out[f] = round(v / 1e9, 3) if math.isfinite(v) and v > 0 else None
    return out


def with_peak_share(rows: list[dict], peaks: dict[str, Optional[float]]) -> list[dict]:
    """``rows`` (one family's products each), each with its family's peak and the share of it the
    row's rate reached (``gw_cols_per_s_per_core / peak_gw_per_s_per_core``; None without a peak)."""
    for r in rows:
        p = peaks.get(r["family"])
        r["peak_gw_per_s_per_core"] = p
        r["peak_share"] = round(r["gw_cols_per_s_per_core"] / p, 5) if p else None
    return rows


#: how long a pass waits after a ggml pass (busy): libgomp's workers spin after ggml's graph before
#: they sleep (its default wait policy). On a 2-core Zen 4 a residual pass right after a ggml pass
#: took 1.9x its time, 5 ms later 1.2x, 10 ms or more later 0.9-1.1x (medians of 7)
OPENMP_SETTLE_S = 0.05


def openmp_settled(seconds: float = OPENMP_SETTLE_S) -> None:
    """Wait ``seconds``, busy on this thread, for ggml's OpenMP workers to stop spinning (so that the
    next pass timed has every core). Busy, not asleep: after sleeping 0.2 s every pass timed,
    ggml's too, came out 1.3-1.9x slower (the vCPU idled)."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        pass


def interleaved(passes: dict, size: Size, settle: Optional[dict] = None) -> dict:
    """Time the ``passes`` (name -> one pass, each warmed up by the caller) in turn, round after
    round, the order rotating by one each round: up to ``size.repeat`` rounds, fewer once the rounds
    took ``size.budget_s`` seconds per pass (at least one). Drift on a shared machine (another
    tenant, the clock) then falls on every pass alike, where one family after another took it alone
    (sequential figures swung 2x from run to run on a 2-core VM). ``settle``: name -> what to run,
    untimed, after that pass (:func:`openmp_settled` after ggml's). Returns name -> seconds per
    round."""
    names = list(passes)
    times: dict = {n: [] for n in names}
    spent = 0.0
    for i in range(max(1, size.repeat)):
        if i and spent >= size.budget_s * len(names):
            break
        k = i % len(names)
        for n in names[k:] + names[:k]:
            t0 = time.perf_counter()
            passes[n]()
            dt = time.perf_counter() - t0
            times[n].append(dt)
            spent += dt
            if settle and n in settle:
                settle[n]()
    return times


def measure_residual(split: Path, size: Size, threads: int, bandwidth: float, families: list[str],
                     log: Optional[Log] = None, reference: Optional[Callable[[int], Callable[[], None]]] = None,
                     reference_bytes: int = 0, reference_q8: Optional[Callable[[int], Callable[[], None]]] = None,
                     reference_q8_bytes: int = 0
                     ) -> tuple[list[dict], list[dict], list[dict], list[dict], list[dict]]:
    """R . x per family and batch (``residual``), stock ggml's product on the same Q6_K bytes at
    GGML_BATCHES (``reference``: make(rows) -> one pass, from :func:`ggml_passes`; rows in the third
    list), (W2 + R) . x with the policy's family (``with_base``), and (W2 + R) . x per family at
    WITH_BASE_FAMILY_BATCHES (``with_base_by_family``, the fifth list: each family pinned with
    ``set_kernel``, the families timed in turn at each batch, no ggml among them; ``policy`` marks
    the family the policy picks for W2 + R at that batch), each a pass over every tensor of the
    split in turn (so that, the split being larger than the caches, every pass reads the weights
    from memory). At each batch the families and ggml are timed pass by pass in turn
    (:func:`interleaved`); a family's row there holds ``vs_ggml``, the median over the rounds of
    ggml's time over the family's (above 1: faster than ggml on the same bytes). Likewise each
    (W2 + R) . x pass with the policy's family with ggml's product of the same weights as Q8_0
    (``reference_q8``; rows in the fourth list): its row's ``vs_ggml_q8_0`` is the verifier's pass
    against a stock Q8_0 model's. Returns (residual, with_base, ggml, ggml_q8, with_base_by_family)."""
    from ..native import policy
    from ..native.residual import Residual

    rng = np.random.default_rng(1)
    xs = {b: rng.standard_normal((b, size.ne0), dtype=np.float32)
          for b in set(BATCHES) | set(WITH_BASE_BATCHES) | set(WITH_BASE_FAMILY_BATCHES)}
    residual: list[dict] = []
    with_base: list[dict] = []
    with_base_by_family: list[dict] = []
    ggml: list[dict] = []
    ggml_q8: list[dict] = []

    def pass_of(r: Residual, b: int, base: bool, fam: Optional[str] = None) -> Callable[[], None]:
        names = [t[0] for t in r.tensors()]

        def one_pass() -> None:
            if fam is not None:
                r.set_kernel(fam)  # the families share one context up to PIN_MAX_COLS columns
            for n in names:
                r.matmul(n, xs[b], with_base=base)
        return one_pass

    def against(passes: dict, make: Optional[Callable[[int], Callable[[], None]]], b: int, what: str) -> dict:
        """``passes`` and ggml's pass of ``make`` at ``b`` columns (where it runs), timed in turn"""
        if make is not None:
            try:
                passes["ggml"] = make(b)
                passes["ggml"]()  # its warm-up
            except Exception as exc:  # the reference is a comparison: the rest is measured still
                passes.pop("ggml", None)
                _say(log, f"  {what} at batch {b} not measured: {type(exc).__name__}: {exc}")
        return interleaved(passes, size, settle={"ggml": openmp_settled})

    def vs(times: dict, fam: str) -> Optional[float]:
        """the median over the rounds of ggml's time over the family's"""
        if "ggml" not in times:
            return None
        return round(statistics.median(g / t for g, t in zip(times["ggml"], times[fam])), 3)

    def ggml_row(times: dict, b: int, nbytes: int, wtype: str, rows: list[dict]) -> None:
        if "ggml" in times:
            row = _row("ggml", b, statistics.median(times["ggml"]), nbytes, size.weights, threads, bandwidth,
                       type=wtype, passes=len(times["ggml"]))
            rows.append(row)
            _say(log, f"  ggml {wtype.upper():<17} batch {b:3d}: {1000 * row['seconds']:8.1f} ms/pass, "
                      f"{row['gb_per_s']:6.2f} GB/s")

    def counted(r: Residual, one_pass: Callable[[], None], base: bool) -> int:
        """bytes one pass reads (the counted pass is the pass's warm-up)"""
        r.reset_counters()
        one_pass()
        c = r.counters()
        return c.bytes_residual + (c.bytes_base if base else 0)

    with Residual(split) as r, contextlib.ExitStack() as own:
        r.set_threads(threads)
        for b in BATCHES:
            policy_fam = policy.kernel_for_batch(b, residual_alone=True)
            passes: dict[str, Callable[[], None]] = {}
            nbytes: dict[str, int] = {}
            how: dict[str, str] = {}
            for fam in families:
                if b <= PIN_MAX_COLS:
                    passes[fam] = pass_of(r, b, False, fam)
                    nbytes[fam] = counted(r, passes[fam], False)
                    how[fam] = "set_kernel"
                else:  # a pinned family serves 32 columns at most: pin it for every size instead
                    with _env("BITSPLIT_KERNEL", fam):
                        rf = own.enter_context(Residual(split))  # the same mapped files: no copy
                    rf.set_threads(threads)
                    passes[fam] = pass_of(rf, b, False)
                    nbytes[fam] = counted(rf, passes[fam], False)
                    how[fam] = "BITSPLIT_KERNEL"
            times = against(passes, reference if b in GGML_BATCHES else None, b, "ggml Q6_K")
            for fam in families:
                ratio = vs(times, fam)
                extra = {} if ratio is None else {"vs_ggml": ratio}
                row = _row(fam, b, statistics.median(times[fam]), nbytes[fam], size.weights, threads, bandwidth,
                           policy=fam == policy_fam, pinned_by=how[fam], passes=len(times[fam]), **extra)
                residual.append(row)
                _say(log, f"  R.x       {fam:>12} batch {b:3d}: {1000 * row['seconds']:8.1f} ms/pass, "
                          f"{row['gb_per_s']:6.2f} GB/s" + ("" if ratio is None else f", {ratio:.2f}x ggml's speed"))
            ggml_row(times, b, reference_bytes, "q6_k", ggml)
        # (W2 + R) . x for every SIMD family: what a measured policy picks from (no ggml here: the
        # with_base rows below hold the comparison with stock Q8_0)
        _say(log, f"  (W2+R).x  every SIMD family, batch {', '.join(map(str, WITH_BASE_FAMILY_BATCHES))}:")
        # (the portable family, a policy's last resort that no measured policy picks, only where it is alone:
        # at ~0.5 GB/s it took 25 s of a 116 s full profile)
        simd = [f for f in families if f != "generic"] or list(families)
        for b in WITH_BASE_FAMILY_BATCHES:
            r.set_kernel(None)  # (every batch here is within PIN_MAX_COLS: each family pinned on this context)
            policy_fam = r.choose_decode_kernel(b)  # the policy's pick for W2 + R (pinned: reset below)
            passes = {fam: pass_of(r, b, True, fam) for fam in simd}
            nbytes = {fam: counted(r, passes[fam], True) for fam in simd}  # the counted pass is the warm-up
            times = interleaved(passes, size)
            for fam in simd:
                row = _row(fam, b, statistics.median(times[fam]), nbytes[fam], size.weights, threads, bandwidth,
                           policy=fam == policy_fam, pinned_by="set_kernel", passes=len(times[fam]))
                with_base_by_family.append(row)
                _say(log, f"  (W2+R).x  fam {fam:>16} batch {b:3d}: {1000 * row['seconds']:8.1f} ms/pass, "
                          f"{row['gb_per_s']:6.2f} GB/s" + (" (policy's)" if fam == policy_fam else ""))
        for b in WITH_BASE_BATCHES:
            r.set_kernel(None)
            fam = r.choose_decode_kernel(b)
            passes = {fam: pass_of(r, b, True)}
            nb = counted(r, passes[fam], True)  # the counted pass is the warm-up
            times = against(passes, reference_q8, b, "ggml Q8_0")
            ratio = vs(times, fam)
            extra = {} if ratio is None else {"vs_ggml_q8_0": ratio}
            row = _row(fam, b, statistics.median(times[fam]), nb, size.weights, threads, bandwidth, policy=True,
                       passes=len(times[fam]), **extra)
            with_base.append(row)
            _say(log, f"  (W2+R).x  {fam:>12} batch {b:3d}: {1000 * row['seconds']:8.1f} ms/pass, "
                      f"{row['gb_per_s']:6.2f} GB/s" + ("" if ratio is None else f", {ratio:.2f}x ggml Q8_0's speed"))
            ggml_row(times, b, reference_q8_bytes, "q8_0", ggml_q8)
    return residual, with_base, ggml, ggml_q8, with_base_by_family


def measure_native_draft(split: Path, size: Size, threads: int, bandwidth: float,
                         log: Optional[Log] = None) -> list[dict]:
    """W2 . x as the fast drafter computes it (residual off, the draft family, 8-bit activations), a
    pass over every tensor of the split's base, at each of DRAFT_BATCHES the family takes; [] where
    the drafter has no family here (ggml's kernels draft: ``ggml_base``)."""
    from ..native import policy
    from ..native.residual import Residual

    fam = policy.draft_kernel()
    if not fam:
        return []
    from ..formats.gguf_file import GGUFFile
    from ..formats.split import BASE_NAME

    with GGUFFile(split / BASE_NAME, role="base") as g:  # what a drafter pass reads
        nbytes = sum(t.nbytes for t in g.tensors if len(t.shape) == 2 and t.shape[0] == size.ne0)
    rng = np.random.default_rng(3)
    rows: list[dict] = []
    with Residual(split) as r:
        r.set_threads(threads)
        names = [t[0] for t in r.tensors()]
        for b in DRAFT_BATCHES:
            x = rng.standard_normal((b, size.ne0), dtype=np.float32)
            if any(r.draft_matmul(n, x) is None for n in names):
                continue  # below the family's smallest batch: ggml drafts these

            def one_pass() -> None:
                for n in names:
                    r.draft_matmul(n, x)

            t, n = _timed(one_pass, size, warm_up=False)  # the check above was the warm-up
            row = _row(fam, b, t, nbytes, size.weights, threads, bandwidth, passes=n)
            rows.append(row)
            _say(log, f"  W2.x draft {fam:>11} batch {b:3d}: {1000 * t:8.1f} ms/pass, {row['gb_per_s']:6.2f} GB/s")
    return rows


def ggml_passes(infos: list, g, threads: int) -> Callable[[int], Callable[[], None]]:
    """Stock ggml's products over ``infos``, tensors of the open GGUF ``g``, copied into one ggml
    context: make(rows) -> one pass (a graph of one product per tensor; see
    :class:`..formats._ggml.MulMatPasses`). The caller keeps ``make`` (it owns the weights) while
    timing, then calls ``make.free()``."""
    from ..formats._ggml import MulMatPasses

    return MulMatPasses(infos, lambda t: g.read_rows(t, 0, t.n_rows), threads)


def open_ggml(split: Path, size: Size, threads: int, which: str = "residual") -> tuple[Callable, int]:
    """Stock ggml's products on the split's synthetic weights: the residual's Q6_K bytes, the base's
    Q2_K bytes (``which="base"``, what a drafter pass reads), or the whole weights as Q8_0
    (``which="q8_0"``, what a stock Q8_0 model reads for them). Returns (make, bytes a pass
    reads), make as :func:`ggml_passes`'s (call ``make.free()`` after)."""
    from ..formats.gguf_file import GGUFFile
    from ..formats.split import BASE_NAME, RESIDUAL_NAME

    fname = {"base": BASE_NAME, "residual": RESIDUAL_NAME, "q8_0": Q8_0_NAME}[which]
    with GGUFFile(split / fname, role="Q8_0 reference" if which == "q8_0" else which) as g:
        # the synthetic weights (the base file holds nothing else, but only these are the measured pass)
        infos = [t for t in g.tensors if len(t.shape) == 2 and t.shape[0] == size.ne0]
        return ggml_passes(infos, g, threads), sum(t.nbytes for t in infos)


def measure_ggml(split: Path, size: Size, threads: int, bandwidth: float, log: Optional[Log] = None,
                 which: str = "base", batches: tuple[int, ...] = GGML_BASE_BATCHES) -> list[dict]:
    """Stock ggml's CPU kernels (ggml_mul_mat, ggml_graph_plan, ggml_graph_compute) on the base's
    Q2_K bytes (``which="residual"``: the residual's Q6_K bytes; :func:`measure_residual` times
    those interleaved with the families): one graph of one product per tensor, the same pass as
    :func:`measure_residual`'s, timed alone."""
    wtype, label = ("q2_k", "Q2_K base") if which == "base" else ("q6_k", "Q6_K")
    make, total = open_ggml(split, size, threads, which)
    try:
        rows = []
        for b in batches:
            t, n = _timed(make(b), size)
            row = _row("ggml", b, t, total, size.weights, threads, bandwidth, type=wtype, passes=n)
            rows.append(row)
            _say(log, f"  ggml {label:<17} batch {b:3d}: {1000 * t:8.1f} ms/pass, {row['gb_per_s']:6.2f} GB/s")
        return rows
    finally:
        make.free()


def bandwidth_now(threads: Optional[int] = None) -> float:
    """RAM bytes/s now: the median of 5 threaded numpy reductions over 1 GiB (on a shared machine a
    burst is not the rate)."""
    from .bench import memory_bandwidth

    threads = threads_or_default(threads)
    return statistics.median(memory_bandwidth(threads, 1.0, 1) for _ in range(5))


def measure_split(model_dir: Path, *, draft_rows: int, verify_rows: int, threads: Optional[int] = None,
                  repeat: int = 5, budget_s: float = 4.0, bandwidth: Optional[float] = None,
                  log: Optional[Log] = None) -> dict:
    """The weight products of one drafter pass and one verify pass of a CPU-only run, timed on this
    split's own tensors (their shapes and types: a row of 1,536 weights runs ggml's Q2_K kernel at
    about 0.6x the rate of the profile's 4,096, measured on a 2-core Zen 5), each pass as the engine
    computes it:

    - drafter, ``draft_rows`` columns: the native drafter (residual off) for each weight with a
      residual it takes at that many columns, ggml's kernel for the others and for the matrices
      without residual (the output head, whole layers);
    - verifier, ``verify_rows`` columns: (W2 + R) . x by the library for every weight with a
      residual and, the verifier being batch-invariant, W2 . x for the matrices without.

    The token embedding is a row lookup, not a product, unless the model has no output head (then
    it is the output head). Medians of up to ``repeat`` passes after one warm-up. The memory
    bandwidth is measured in the same run (:func:`bandwidth_now`; ``bandwidth``: one taken already,
    e.g. once for every tree size of a plan), so that a shared machine's load at the time weighs on
    both alike (``memory_bandwidth_gb_s``)."""
    from ..formats.gguf_file import GGUFFile
    from ..formats.modeldir import split_paths
    from ..native.residual import Residual

    import llama_cpp  # noqa: F401  (loads libggml*: the one ggml of the process)

    threads = threads_or_default(threads)
    size = Size("split", 0, 0, 0, repeat, budget_s, 0.0)
    bw = bandwidth if bandwidth is not None else bandwidth_now(threads)
    base_p, _ = split_paths(model_dir)
    rng = np.random.default_rng(5)
    with Residual(model_dir) as r, GGUFFile(base_p, role="base") as g:
        r.set_threads(threads)
        has_output = any(t.name == "output.weight" for t in g.tensors)

        def product(n: str) -> bool:  # the embedding is looked up, not multiplied, beside an output head
            return not (has_output and n == "token_embd.weight")

        res = {t[0]: t[1] for t in r.tensors() if t[1][2] == 1 and t[1][3] == 1 and product(t[0])}
        exact = [n for n in r.exact_tensors() if product(n)]
        shapes = {t.name: t for t in g.tensors}
        xs: dict[tuple[int, int], np.ndarray] = {}

        def x_for(ne0: int, rows: int) -> np.ndarray:
            if (ne0, rows) not in xs:
                xs[(ne0, rows)] = rng.standard_normal((rows, ne0), dtype=np.float32)
            return xs[(ne0, rows)]

        # the verify pass
        def verify() -> None:
            for n in list(res) + exact:
                r.matmul(n, x_for(shapes[n].shape[0], verify_rows), with_base=True)

        verify()
        t_verify, n_verify = _timed(verify, size, warm_up=False)
        # the drafter pass: which products the native drafter takes at this many rows
        native = [n for n in res if r.draft_matmul(n, x_for(res[n][0], draft_rows)) is not None]
        ggml_names = [n for n in res if n not in native] + exact

        def draft_native() -> None:
            for n in native:
                r.draft_matmul(n, x_for(res[n][0], draft_rows))

        t_native, _ = _timed(draft_native, size) if native else (0.0, 0)
        make = ggml_passes([shapes[n] for n in ggml_names], g, threads)
        try:
            t_ggml, _ = _timed(make(draft_rows), size)
        finally:
            make.free()
        w_res = sum(shapes[n].n_elements for n in res)
        w_exact = sum(shapes[n].n_elements for n in exact)
    from ..native import policy

    draft_how = ", ".join(filter(None, [f"native drafter ({policy.draft_kernel()}) on {len(native)} products"
                                        if native else "", f"ggml on {len(ggml_names)}"]))
    out = {"threads": threads, "draft_rows": draft_rows, "verify_rows": verify_rows,
           "memory_bandwidth_gb_s": round(bw / 1e9, 3),
           "draft_s": round(t_native + t_ggml, 6), "draft_native_s": round(t_native, 6), "draft_ggml_s": round(t_ggml, 6),
           "draft_products": draft_how, "verify_s": round(t_verify, 6), "verify_passes": n_verify,
           "weights_with_residual": w_res, "weights_without": w_exact}
    _say(log, f"  this split's products, {threads} threads: drafter pass ({draft_rows} rows; {draft_how}) "
              f"{1000 * out['draft_s']:.1f} ms, verify pass ({verify_rows} rows) {1000 * t_verify:.1f} ms; memory "
              f"bandwidth {bw / 1e9:.1f} GB/s")
    return out
