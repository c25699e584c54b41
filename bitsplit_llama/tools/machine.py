"""The machine as bitsplit sees it: one profile, measured once per machine and native build, cached.

What it holds: the CPU model and the ISA flags that matter, threads, physical memory, the kernel
families the native library runs here and which one its policy picks for each batch size (asked of
the library: the thresholds live only in C), memory bandwidth (a threaded numpy reduction), the
residual product's throughput per family at batch 1, 4, 16 and 64 on a synthetic split of at least
83 MB and 4x the last-level cache (up to 1.8 GB), stock ggml's own throughput on the same bytes
(the families and ggml timed pass by pass in turn at each batch, so that their ratio, ``vs_ggml``,
is not skewed by drift), and the devices llama.cpp sees.

``bitsplit doctor`` prints it; ``bitsplit plan`` takes its residual rate per core from it. The
profile is cached as JSON under ``<cache>/machine/``, keyed by the CPU model and flags, the native
build key, ``BITSPLIT_MAX_ISA``, ``BITSPLIT_KERNEL``, the thread count and the size (full or quick,
and its tensor count): anything that changes what would be measured gives another file.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Iterator, Optional

import numpy as np

PROFILE_VERSION = 6  # 2: ggml_base (the drafter's rate); 3: small batches of W2 + R and ggml_base, native_draft;
# 4: kernel_by_batch_alone (the policy for R . x alone); 5: R . x timed interleaved with ggml, vs_ggml;
# ggml_q8_0 (the same weights as Q8_0) interleaved with W2 + R, vs_ggml_q8_0; 6: native_draft at batch 1
# (the 256-bit integer families draft from 1 column)
#: batch sizes measured for every family
BATCHES = (1, 4, 16, 64)
#: batch sizes the policy is asked about
POLICY_BATCHES = (1, 2, 4, 5, 8, 16, 32, 64)
#: batch sizes of the verifier pass (W2 + R) measured with the policy's family
WITH_BASE_BATCHES = (1, 2, 4, 16)
#: batch sizes of the stock ggml reference
GGML_BATCHES = (1, 16)
#: batch sizes of ggml on the base (a drafter pass: a chain drafts 1 row, a tree a few per round)
GGML_BASE_BATCHES = (1, 2, 4, 16)
#: batch sizes of the native drafter (those it takes: from the draft family's smallest)
DRAFT_BATCHES = (1, 2, 4, 16)
#: a family pinned with Residual.set_kernel serves passes up to this many columns (BS_DECODE_COLS in
#: native/bs_internal.h); larger passes are measured on a context loaded with BITSPLIT_KERNEL set
PIN_MAX_COLS = 32

X86_FLAGS = ("avx2", "fma", "f16c", "avx_vnni", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16",
             "amx_int8")
ARM_FLAGS = ("asimd", "asimddp", "i8mm", "sve", "sve2", "bf16")

Q8_0, Q2_K, Q6_K = 8, 10, 14
#: the synthetic split's weights as stock Q8_0 (W2 + R's competitor: what a Q8_0 model reads), beside it
Q8_0_NAME = "q8_0.gguf"

Log = Callable[[str], None]


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


@functools.lru_cache(maxsize=None)
def last_level_cache_bytes(sysfs: Path = Path("/sys/devices/system/cpu")) -> int:
    """Bytes of the highest cache level summed over its instances (one per socket, or per core
    complex on AMD), from Linux's sysfs; 0 where it says nothing. Read once per process (the
    profile's key and its measurement both ask)."""
    best_level, groups = 0, {}
    for idx in sysfs.glob("cpu[0-9]*/cache/index[0-9]*"):
        try:
            level = int((idx / "level").read_text())
            text = (idx / "size").read_text().strip().upper()
            shared = (idx / "shared_cpu_list").read_text().strip()
            if (idx / "type").read_text().strip() == "Instruction":
                continue
            unit = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:], 1)
            size = int(text[:-1] if text[-1:] in "KMG" else text) * unit
        except (OSError, ValueError):
            continue
        if level > best_level:
            best_level, groups = level, {}
        if level == best_level:
            groups[shared] = size
    return sum(groups.values())


def full_size(llc_bytes: Optional[int] = None) -> Size:
    """FULL with enough tensors that the residual is at least 4x the last-level cache: with FULL's
    83 MB, stock ggml read a Xeon's at 1.4x its measured RAM bandwidth (2026-11): from its L3."""
    llc = last_level_cache_bytes() if llc_bytes is None else llc_bytes
    per_tensor = FULL.ne0 * FULL.ne1 * 210 // 256  # Q6_K: 210 bytes per 256 weights
    n = min(FULL_MAX_TENSORS, max(FULL.tensors, -(-4 * llc // per_tensor)))
    return replace(FULL, tensors=n)
#: for tests: small, few repeats (fits in caches; its figures are not the machine's)
QUICK = Size("quick", 2, 1024, 1024, 2, 0.2, 0.125)


def _say(log: Optional[Log], msg: str) -> None:
    if log is not None:
        log(msg)


# -- the CPU --------------------------------------------------------------------------------------

def _cpuinfo() -> dict[str, str]:
    """The first processor's fields of /proc/cpuinfo (empty where there is none)."""
    out: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if not line.strip():
                    if out:
                        break
                    continue
                k, _, v = line.partition(":")
                out.setdefault(k.strip().lower(), v.strip())
    except OSError:
        pass
    return out


def cpu_info() -> dict:
    """CPU model, architecture, all flags the OS reports, and the ones that matter here as name -> bool."""
    info = _cpuinfo()
    arch = platform.machine()
    model = info.get("model name") or info.get("hardware") or info.get("cpu model") or ""
    if not model and sys.platform == "darwin":
        import subprocess

        try:
            model = subprocess.run(["sysctl", "-n", "machdep.cpu.brand_string"], capture_output=True, text=True,
                                   timeout=5).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            model = ""
    if not model and "cpu implementer" in info:
        model = f"ARM implementer {info['cpu implementer']} part {info.get('cpu part', '?')}"
    flags = (info.get("flags") or info.get("features") or "").split()
    wanted = ARM_FLAGS if arch.lower() in ("aarch64", "arm64") else X86_FLAGS
    have = set(flags)
    return {"model": model or platform.processor() or arch, "arch": arch, "flags": flags,
            "isa": {f: f in have for f in wanted}}


def physical_memory() -> int:
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 0


def _threads(threads: Optional[int]) -> int:
    from ..runtime.llamacpp import default_threads

    return int(threads or default_threads())


# -- the cache ------------------------------------------------------------------------------------

def profile_key(threads: Optional[int] = None, quick: bool = False) -> tuple[str, dict]:
    """(key, what it is made of): the profile is measured again when any part changes."""
    from ..native.build import build_key

    cpu = cpu_info()
    size = QUICK if quick else full_size()
    parts = {
        "version": PROFILE_VERSION,
        "cpu": cpu["model"],
        "arch": cpu["arch"],
        "flags": hashlib.sha256(" ".join(sorted(cpu["flags"])).encode()).hexdigest()[:16],
        "native_build": build_key()[0],
        "max_isa": os.environ.get("BITSPLIT_MAX_ISA", ""),
        "half_rate_512": os.environ.get("BITSPLIT_HALF_RATE_512", ""),
        "kernel": os.environ.get("BITSPLIT_KERNEL", ""),
        "threads": _threads(threads),
        "size": size.name,
        "tensors": size.tensors,
        "rounds": size.repeat,  # a profile taken with fewer rounds is measured again
    }
    key = hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:20]
    return key, parts


def _machine_dir() -> Path:
    from ..cache import cache_dir

    return cache_dir() / "machine"


def profile_path(threads: Optional[int] = None, quick: bool = False) -> Path:
    key, parts = profile_key(threads, quick)
    return _machine_dir() / f"profile-{parts['size']}-{key}.json"


def machine_profile(*, refresh: bool = False, quick: bool = False, threads: Optional[int] = None,
                    log: Optional[Log] = None) -> dict:
    """The profile of this machine and build: from the cache, or measured (and cached) when there is
    none, when it is unreadable, or with ``refresh``. ``cached`` and ``path`` say which and where."""
    threads = _threads(threads)
    key, parts = profile_key(threads, quick)
    path = _machine_dir() / f"profile-{parts['size']}-{key}.json"
    if not refresh and path.exists():
        try:
            prof = json.loads(path.read_text())
            if prof.get("key") == key and prof.get("version") == PROFILE_VERSION:
                prof.setdefault("fastest_by_batch_alone", fastest_by_batch(prof.get("residual", [])))  # older caches
                prof.update(cached=True, path=str(path))
                return prof
        except (OSError, ValueError):
            pass
        _say(log, f"machine profile {path} is unreadable or stale: measuring again")
    prof = measure(threads=threads, quick=quick, log=log)
    prof["key"] = key
    prof["key_parts"] = parts
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_text(json.dumps(prof, indent=1))
        os.replace(tmp, path)
    except OSError as exc:
        _say(log, f"could not cache the machine profile in {path.parent}: {exc.strerror or exc}")
    prof.update(cached=False, path=str(path))
    return prof


# -- the synthetic split --------------------------------------------------------------------------

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
    out = _machine_dir() / tag
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
        shutil.rmtree(_machine_dir() / f"synthetic-v{FORMAT_VERSION}-{size.tensors}x{size.ne0}x{size.ne1}",
                      ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


# -- measurements ---------------------------------------------------------------------------------

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
            "bandwidth_use": round(gbs * 1e9 / bandwidth, 4) if bandwidth > 0 else None, **extra}


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
                     reference_q8_bytes: int = 0) -> tuple[list[dict], list[dict], list[dict], list[dict]]:
    """R . x per family and batch (``residual``), stock ggml's product on the same Q6_K bytes at
    GGML_BATCHES (``reference``: make(rows) -> one pass, from :func:`_ggml_pass`; rows in the third
    list), and (W2 + R) . x with the policy's family (``with_base``), each a pass over every tensor
    of the split in turn (so that, the split being larger than the caches, every pass reads the
    weights from memory). At each batch the families and ggml are timed pass by pass in turn
    (:func:`interleaved`); a family's row there holds ``vs_ggml``, the median over the rounds of
    ggml's time over the family's (above 1: faster than ggml on the same bytes). Likewise each
    (W2 + R) . x pass with ggml's product of the same weights as Q8_0 (``reference_q8``; rows in the
    fourth list): its row's ``vs_ggml_q8_0`` is the verifier's pass against a stock Q8_0 model's."""
    from ..native import policy
    from ..native.residual import Residual

    rng = np.random.default_rng(1)
    xs = {b: rng.standard_normal((b, size.ne0), dtype=np.float32) for b in set(BATCHES) | set(WITH_BASE_BATCHES)}
    residual: list[dict] = []
    with_base: list[dict] = []
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
    return residual, with_base, ggml, ggml_q8


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


def _loaded_lib(stem: str) -> Path:
    """The file of llama-cpp-python's ``stem`` (libggml, libggml-cpu) mapped in this process."""
    from ..formats._ggml import llama_cpp_lib_dir

    lib_dir = llama_cpp_lib_dir()
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as f:
            for line in f:
                p = line.rsplit(None, 1)[-1]
                if os.path.basename(p).split(".so")[0] == stem and ".so" in p:
                    return Path(p)
    except OSError:
        pass
    for name in (f"{stem}.so.0", f"{stem}.so", f"{stem}.dylib"):
        if (lib_dir / name).exists():
            return lib_dir / name
    raise FileNotFoundError(f"{stem} of llama-cpp-python not found in {lib_dir}")


class _InitParams(ctypes.Structure):
    # struct ggml_init_params { size_t mem_size; void * mem_buffer; bool no_alloc; };
    _fields_ = [("mem_size", ctypes.c_size_t), ("mem_buffer", ctypes.c_void_p), ("no_alloc", ctypes.c_bool)]


class _CPlan(ctypes.Structure):
    # struct ggml_cplan (ggml-cpu.h of the pinned llama-cpp-python): the work buffer is ours, sized
    # by ggml_graph_plan (a guess of it fell short on a 16-thread Xeon: ggml aborted)
    _fields_ = [("work_size", ctypes.c_size_t), ("work_data", ctypes.c_void_p), ("n_threads", ctypes.c_int),
                ("threadpool", ctypes.c_void_p), ("abort_callback", ctypes.c_void_p),
                ("abort_callback_data", ctypes.c_void_p), ("use_ref", ctypes.c_bool)]


def _ggml_libs() -> tuple[ctypes.CDLL, ctypes.CDLL]:
    from ..formats._ggml import loaded_ggml_base_path

    base = ctypes.CDLL(str(loaded_ggml_base_path()))  # own handles: argtypes here do not touch _ggml's
    cpu = ctypes.CDLL(str(_loaded_lib("libggml-cpu")))
    vp, i64 = ctypes.c_void_p, ctypes.c_int64
    for name, args, res in (
        ("ggml_init", [_InitParams], vp), ("ggml_free", [vp], None),
        ("ggml_new_tensor_2d", [vp, ctypes.c_int, i64, i64], vp), ("ggml_mul_mat", [vp, vp, vp], vp),
        ("ggml_new_graph", [vp], vp), ("ggml_build_forward_expand", [vp, vp], None),
        ("ggml_get_data", [vp], vp), ("ggml_nbytes", [vp], ctypes.c_size_t),
        ("ggml_tensor_overhead", [], ctypes.c_size_t), ("ggml_graph_overhead", [], ctypes.c_size_t),
    ):
        f = getattr(base, name)
        f.argtypes, f.restype = args, res
    cpu.ggml_cpu_init.argtypes, cpu.ggml_cpu_init.restype = [], None
    # struct ggml_cplan ggml_graph_plan(const struct ggml_cgraph *, int n_threads, struct ggml_threadpool *)
    cpu.ggml_graph_plan.argtypes, cpu.ggml_graph_plan.restype = [vp, ctypes.c_int, vp], _CPlan
    # enum ggml_status ggml_graph_compute(struct ggml_cgraph *, struct ggml_cplan *)
    cpu.ggml_graph_compute.argtypes, cpu.ggml_graph_compute.restype = [vp, ctypes.POINTER(_CPlan)], ctypes.c_int
    return base, cpu


def open_ggml(split: Path, size: Size, threads: int, which: str = "residual") -> tuple[Callable, int]:
    """Stock ggml's products on the split's synthetic weights: the residual's Q6_K bytes, the base's
    Q2_K bytes (``which="base"``, what a drafter pass reads), or the whole weights as Q8_0
    (``which="q8_0"``, what a stock Q8_0 model reads for them). Returns (make, bytes a pass
    reads), make as :func:`_ggml_pass`'s (call ``make.free()`` after)."""
    from ..formats.gguf_file import GGUFFile
    from ..formats.split import BASE_NAME, RESIDUAL_NAME

    fname = {"base": BASE_NAME, "residual": RESIDUAL_NAME, "q8_0": Q8_0_NAME}[which]
    with GGUFFile(split / fname, role="Q8_0 reference" if which == "q8_0" else which) as g:
        # the synthetic weights (the base file holds nothing else, but only these are the measured pass)
        infos = [t for t in g.tensors if len(t.shape) == 2 and t.shape[0] == size.ne0]
        return _ggml_pass(infos, g, threads), sum(t.nbytes for t in infos)


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


def _ggml_pass(infos: list, g, threads: int) -> Callable[[int], Callable[[], None]]:
    """ggml's own products (ggml_mul_mat on the CPU, standard layout: what llama.cpp computes for a
    split's drafter) over ``infos``, tensors of the open GGUF ``g``, copied into one ggml context;
    returns make(rows) -> one_pass (a graph of one product per tensor). The caller keeps the
    returned function (it owns the weights) while timing, and drops it after."""
    base, cpu = _ggml_libs()
    cpu.ggml_cpu_init()
    total = sum(t.nbytes for t in infos)
    wctx = base.ggml_init(_InitParams(total + len(infos) * (base.ggml_tensor_overhead() + 4096) + 2**20, None, False))
    if not wctx:
        raise MemoryError("ggml_init failed for the weights")
    ws = []
    for t in infos:
        w = base.ggml_new_tensor_2d(wctx, t.ggml_type, t.shape[0], t.shape[1])
        if base.ggml_nbytes(w) != t.nbytes:
            base.ggml_free(wctx)
            raise ValueError(f"ggml sizes '{t.name}' at {base.ggml_nbytes(w)} bytes, the file at {t.nbytes}")
        raw = g.read_rows(t, 0, t.n_rows)
        ctypes.memmove(base.ggml_get_data(w), raw.ctypes.data, t.nbytes)
        del raw
        ws.append((t, w))
    keep: list = []

    def make(rows: int) -> Callable[[], None]:
        mem = (sum(rows * (t.shape[0] + t.shape[1]) * 4 for t, _ in ws) + (3 * len(ws) + 2) * base.ggml_tensor_overhead()
               + base.ggml_graph_overhead() + 2**22)
        cctx = base.ggml_init(_InitParams(mem, None, False))
        if not cctx:
            raise MemoryError("ggml_init failed for the products")
        keep.append(cctx)
        rng = np.random.default_rng(4)
        gf = base.ggml_new_graph(cctx)
        for t, w in ws:
            x = base.ggml_new_tensor_2d(cctx, 0, t.shape[0], rows)  # GGML_TYPE_F32
            xv = rng.standard_normal((rows, t.shape[0]), dtype=np.float32)
            ctypes.memmove(base.ggml_get_data(x), xv.ctypes.data, xv.nbytes)
            base.ggml_build_forward_expand(gf, base.ggml_mul_mat(cctx, w, x))
        plan = cpu.ggml_graph_plan(gf, threads, None)
        work = np.empty(max(int(plan.work_size), 1) + 64, dtype=np.uint8)  # ggml's own size
        plan.work_data = (work.ctypes.data + 63) & ~63

        def one_pass() -> None:
            _ = work  # the work buffer lives as long as the pass
            st = cpu.ggml_graph_compute(gf, ctypes.byref(plan))
            if st != 0:
                raise RuntimeError(f"ggml_graph_compute returned status {st}")
        return one_pass

    def free() -> None:
        for c in keep:
            base.ggml_free(c)
        keep.clear()
        base.ggml_free(wctx)

    make.free = free  # type: ignore[attr-defined]
    return make


def bandwidth_now(threads: Optional[int] = None) -> float:
    """RAM bytes/s now: the median of 5 threaded numpy reductions over 1 GiB (on a shared machine a
    burst is not the rate)."""
    from .bench import memory_bandwidth

    threads = _threads(threads)
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

    threads = _threads(threads)
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
        make = _ggml_pass([shapes[n] for n in ggml_names], g, threads)
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


def devices() -> list[dict]:
    """The devices llama.cpp's ggml backend registry lists (CPU, GPUs, accelerators)."""
    lib = ctypes.CDLL(str(_loaded_lib("libggml")))
    vp = ctypes.c_void_p
    lib.ggml_backend_dev_count.argtypes, lib.ggml_backend_dev_count.restype = [], ctypes.c_size_t
    lib.ggml_backend_dev_get.argtypes, lib.ggml_backend_dev_get.restype = [ctypes.c_size_t], vp
    for name in ("ggml_backend_dev_name", "ggml_backend_dev_description"):
        getattr(lib, name).argtypes, getattr(lib, name).restype = [vp], ctypes.c_char_p
    lib.ggml_backend_dev_type.argtypes, lib.ggml_backend_dev_type.restype = [vp], ctypes.c_int
    lib.ggml_backend_dev_memory.argtypes = [vp, ctypes.POINTER(ctypes.c_size_t), ctypes.POINTER(ctypes.c_size_t)]
    lib.ggml_backend_dev_memory.restype = None
    kinds = {0: "cpu", 1: "gpu", 2: "igpu", 3: "accel", 4: "meta"}
    out = []
    for i in range(lib.ggml_backend_dev_count()):
        d = lib.ggml_backend_dev_get(i)
        free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
        lib.ggml_backend_dev_memory(d, ctypes.byref(free), ctypes.byref(total))
        out.append({"name": (lib.ggml_backend_dev_name(d) or b"").decode(errors="replace"),
                    "description": (lib.ggml_backend_dev_description(d) or b"").decode(errors="replace"),
                    "type": kinds.get(lib.ggml_backend_dev_type(d), "other"), "memory_total_bytes": int(total.value)})
    return out


def measure(*, threads: Optional[int] = None, quick: bool = False, log: Optional[Log] = None) -> dict:
    """Measure the profile now (no cache). See the module's docstring for what it holds."""
    import llama_cpp  # noqa: F401  (loads libggml*: the one ggml of the process)

    from ..native import policy
    from ..native.build import build_key
    from .bench import memory_bandwidth

    cap = os.environ.get("BITSPLIT_MAX_ISA", "")
    if cap and cap not in policy.ISA_LEVELS:  # refused before a minute of measuring, not after
        from ..errors import InvalidOptionError

        raise InvalidOptionError(f"BITSPLIT_MAX_ISA='{cap}': expected one of {', '.join(policy.ISA_LEVELS)}")
    hr = os.environ.get("BITSPLIT_HALF_RATE_512", "")
    if hr not in ("", "0", "1"):
        from ..errors import InvalidOptionError

        raise InvalidOptionError(f"BITSPLIT_HALF_RATE_512='{hr}': expected 1, 0 or unset")
    t_start = time.perf_counter()
    size = QUICK if quick else full_size()
    threads = _threads(threads)
    cpu = cpu_info()
    fams = policy.families()
    _say(log, f"machine profile ({size.name}): {cpu['model']}, {threads} threads, families {', '.join(fams)}")
    _say(log, "  memory bandwidth ...")
    bw = statistics.median(memory_bandwidth(threads, size.bandwidth_gib, 1) for _ in range(3))
    _say(log, f"  memory bandwidth {bw / 1e9:.1f} GB/s")
    split = synthetic_split(size, log)
    refs: dict = {}
    for which in ("residual", "q8_0"):  # stock ggml on the same bytes, timed in turn with the families
        try:
            refs[which] = open_ggml(split, size, threads, which)
        except Exception as exc:  # the references are comparisons, not what the profile is for
            refs[which] = (None, 0)
            _say(log, f"  ggml reference ({which}) not measured: {type(exc).__name__}: {exc}")
    try:
        residual, with_base, ggml, ggml_q8 = measure_residual(
            split, size, threads, bw, fams, log, reference=refs["residual"][0], reference_bytes=refs["residual"][1],
            reference_q8=refs["q8_0"][0], reference_q8_bytes=refs["q8_0"][1])
    finally:
        for make, _ in refs.values():
            if make is not None:
                make.free()
    try:  # the drafter's rate: llama.cpp's kernels on the base's bytes (plan --gpu none)
        ggml_base = measure_ggml(split, size, threads, bw, log, which="base", batches=GGML_BASE_BATCHES)
    except Exception as exc:
        ggml_base = []
        _say(log, f"  ggml on the base not measured: {type(exc).__name__}: {exc}")
    try:  # the native drafter's rate (CPU-only runs draft with it from its smallest batch)
        native_draft = measure_native_draft(split, size, threads, bw, log)
    except Exception as exc:
        native_draft = []
        _say(log, f"  native drafter not measured: {type(exc).__name__}: {exc}")
    try:
        devs = devices()
    except Exception as exc:
        devs = []
        _say(log, f"  devices not listed: {type(exc).__name__}: {exc}")
    from ..native.residual import Residual

    with Residual(split) as r:  # the verifier's activations the (W2+R).x rows ran with (--act-bits auto)
        act_bits = r.act_bits
    res_bytes = residual[0]["bytes"] if residual else 0
    base_bytes = (with_base[0]["bytes"] - res_bytes) if with_base and residual else 0
    return {
        "version": PROFILE_VERSION,
        "size": size.name,
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "cpu": cpu["model"],
        "arch": cpu["arch"],
        "isa": cpu["isa"],
        "threads": threads,
        "physical_memory_bytes": physical_memory(),
        "native_build": build_key()[0],
        "families": fams,
        "max_isa": policy.max_isa(),
        "half_rate_512": policy.half_rate_512(),
        "kernel_by_batch": {str(b): policy.kernel_for_batch(b) for b in POLICY_BATCHES},
        "kernel_by_batch_alone": {str(b): policy.kernel_for_batch(b, residual_alone=True) for b in POLICY_BATCHES},
        "fastest_by_batch_alone": fastest_by_batch(residual),
        "draft_kernel": policy.draft_kernel(),
        "act_bits": act_bits,
        "memory_bandwidth_gb_s": round(bw / 1e9, 3),
        "synthetic": {"tensors": size.tensors, "ne0": size.ne0, "ne1": size.ne1, "residual_type": "q6_k",
                      "base_type": "q2_k", "residual_bytes": res_bytes, "base_bytes": base_bytes},
        "residual": residual,
        "with_base": with_base,
        "ggml_reference": ggml,
        "ggml_q8_0": ggml_q8,
        "ggml_base": ggml_base,
        "native_draft": native_draft,
        "devices": devs,
        "seconds": round(time.perf_counter() - t_start, 2),
    }


def fastest_by_batch(rows: list[dict]) -> dict[str, str]:
    """Per measured batch, the family with the highest throughput among ``rows`` (one kind of product,
    e.g. the profile's ``residual``): what this machine measured, where ``kernel_by_batch`` is the
    built-in policy's pick (tuned on a few CPUs; ``--tree-nodes auto`` times the families on the
    model itself and pins its own fastest)."""
    best: dict[int, dict] = {}
    for r in rows:
        b = int(r["batch"])
        if b not in best or float(r["gb_per_s"]) > float(best[b]["gb_per_s"]):
            best[b] = r
    return {str(b): best[b]["family"] for b in sorted(best)}


def rate_at(rows: list[dict], batch: int, key: str = "weights_per_s_per_core") -> tuple[float, str]:
    """A rate (weights/s per core) at ``batch`` columns from measured rows of one family: the time
    per weight interpolated linearly in the batch between the measured batches around it (a
    product's cost grows about linearly with its columns once it is compute-bound), extrapolated
    past the largest from the last two (never falling), the smallest one's rate below it. Returns
    (rate, which measurements it comes from)."""
    pts = sorted({int(r["batch"]): 1.0 / float(r[key]) for r in rows}.items())
    if batch <= pts[0][0] or len(pts) == 1:
        b, s = pts[0] if batch <= pts[0][0] else pts[-1]
        return 1.0 / s, f"batch {b}"
    for (b0, s0), (b1, s1) in zip(pts, pts[1:]):
        if batch == b1:
            return 1.0 / s1, f"batch {b1}"
        if b0 < batch < b1:
            return 1.0 / (s0 + (batch - b0) * (s1 - s0) / (b1 - b0)), f"batch {batch} interpolated from {b0} and {b1}"
    (b0, s0), (b1, s1) = pts[-2], pts[-1]
    slope = max(0.0, (s1 - s0) / (b1 - b0))
    return 1.0 / (s1 + (batch - b1) * slope), f"batch {batch} extrapolated from {b0} and {b1}"


def residual_rate_per_core(profile: dict, batch: int) -> tuple[float, str]:
    """Residual weights/s one core computes at ``batch`` columns with the family the policy picks
    for that batch, from the profile's measured batches (:func:`rate_at`). Returns (weights/s per
    core, where the figure comes from)."""
    fam = profile["kernel_by_batch_alone"].get(str(batch))
    if fam is None:
        from ..native import policy

        fam = policy.kernel_for_batch(batch, residual_alone=True)
    rows = [r for r in profile["residual"] if r["family"] == fam] or list(profile["residual"])
    rate, where = rate_at(rows, batch)
    return (rate, f"machine profile ({rows[0]['family']}, {where}, {profile['threads']} threads, "
                  f"{profile['size']} size{', cached' if profile.get('cached') else ''})")
