"""The machine as bitsplit sees it: one profile, measured once per machine and native build, cached.

What it holds: the CPU model and the ISA flags that matter, threads, physical memory, the kernel
families the native library runs here and which one its policy picks for each batch size (asked of
the library: the thresholds live only in C), memory bandwidth (a threaded numpy reduction), the
residual product's throughput per family at batch 1, 2, 4, 8, 16, 32 and 64 on a synthetic split of
at least 83 MB and 4x the last-level cache (up to 1.8 GB), stock ggml's own throughput on the same
bytes (the families and ggml timed pass by pass in turn at each batch, so that their ratio,
``vs_ggml``, is not skewed by drift), and the family measured fastest at each batch
(``fastest_by_batch_alone``); the verifier's product W2 + R . x with the policy's family at batch 1,
2, 4 and 16 against stock ggml's on the same weights as Q8_0 (``with_base``), and for every SIMD family at
batch 1, 2, 4, 8 and 16 (``with_base_by_family``, timed in turn at each batch) with the family
measured fastest at each (``fastest_by_batch_with_base``): the measured kernel policy's input; stock
ggml on the base's Q2_K bytes and the native drafter (the drafter's rates); each family's peak on one
core (its multiply step timed in registers by the native library) and each per-family row's share of
it, and the devices llama.cpp sees.

``bitsplit doctor`` prints it; ``bitsplit plan`` takes its residual rate per core from it. The
profile is cached as JSON under ``<cache>/machine/``, keyed by the CPU model and flags, the native
build key, ``BITSPLIT_MAX_ISA``, ``BITSPLIT_KERNEL``, the thread count and the size (full or quick,
and its tensor count): anything that changes what would be measured gives another file.

Where each part lives: :mod:`.cpuinfo` (the CPU, read from the OS), :mod:`.synthetic` (the split it
is measured on, and its sizes), :mod:`.measure` (the timed passes), :mod:`..formats._ggml` (stock
ggml, called through cffi); here the profile: its cache, the measurement that fills it, and the
rates :mod:`.plan` reads from it.
"""

from __future__ import annotations

import hashlib
import json
import os
import statistics
import time
from pathlib import Path
from typing import Optional

from ..formats import _ggml
from .cpuinfo import cpu_info, physical_memory, threads_or_default
from .measure import (GGML_BASE_BATCHES, PEAK_INSTRUCTIONS, PEAK_SECONDS, family_peaks, measure_ggml,
                      measure_native_draft, measure_residual, open_ggml, with_peak_share)
from .synthetic import QUICK, Log, full_size, machine_dir, synthetic_split

PROFILE_VERSION = 9  # 2: ggml_base (the drafter's rate); 3: small batches of W2 + R and ggml_base, native_draft;
# 4: kernel_by_batch_alone (the policy for R . x alone); 5: R . x timed interleaved with ggml, vs_ggml;
# ggml_q8_0 (the same weights as Q8_0) interleaved with W2 + R, vs_ggml_q8_0; 6: native_draft at batch 1
# (the 256-bit integer families draft from 1 column); 7: R . x at every power of two to 64, the families'
# peaks (peaks, peak_instructions) and each row's weight.columns per second and core and share of its peak;
# 8: (W2+R).x for every SIMD family at 1, 2, 4, 8, 16 (with_base_by_family, fastest_by_batch_with_base): the
# measured policy's input; 9: load (other processes' share of the CPUs while it was measured)

#: batch sizes the policy is asked about
POLICY_BATCHES = (1, 2, 4, 5, 8, 16, 32, 64)

#: the share of the machine's CPU time that other processes (and the hypervisor's steal) may take while
#: the profile is measured before it is marked busy. On a 2-core Zen 5 a cached profile read half the
#: idle rates (avx512-bf16's R . x at 16 columns 39.7 against 72.9 G weight.columns/s per core measured
#: again on the idle machine; plan's 32B projection 1.48x against 2.16x); measured beside a sanitizer
#: build (others took 55% of the CPUs), avx2-int16's R . x at 16 columns read 29.7 against 54.9 idle
BUSY_SHARE = 0.15


def _cpu_seconds() -> Optional[tuple[float, float]]:
    """(busy seconds of every CPU together, of which the hypervisor's steal) since boot, from
    /proc/stat; None where it cannot be read (not Linux)."""
    try:
        with open("/proc/stat") as f:
            parts = f.readline().split()
        v = [int(x) for x in parts[1:9]]
        hz = float(os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, AttributeError):
        return None
    if not parts or parts[0] != "cpu" or len(v) < 7:
        return None
    user, nice, system, _idle, _iowait, irq, softirq = v[:7]
    steal = v[7] if len(v) > 7 else 0
    return (user + nice + system + irq + softirq + steal) / hz, steal / hz


class LoadWatch:
    """How much of the machine other processes took between :meth:`__init__` and :meth:`result`: the
    CPU time of every CPU (/proc/stat) less this process's own (every thread), as a share of the wall
    time times the CPUs. A figure measured on a busy machine is low, and a cached profile would keep
    it: the profile says so (``load``), and doctor and plan print it."""

    def __init__(self) -> None:
        self.t0 = time.perf_counter()
        self.own0 = time.process_time()
        self.cpu0 = _cpu_seconds()

    def result(self) -> Optional[dict]:
        """{"others_share", "steal_share", "busy"}; None where /proc/stat cannot be read."""
        cpu1 = _cpu_seconds()
        if self.cpu0 is None or cpu1 is None:
            return None
        wall = time.perf_counter() - self.t0
        total = wall * (os.cpu_count() or 1)
        if total <= 0:
            return None
        own = time.process_time() - self.own0
        others = max(0.0, (cpu1[0] - self.cpu0[0]) - own) / total
        steal = max(0.0, cpu1[1] - self.cpu0[1]) / total
        return {"others_share": round(min(1.0, others), 3), "steal_share": round(min(1.0, steal), 3),
                "busy": others > BUSY_SHARE}


def load_line(profile: dict) -> str:
    """One line on the load while the profile was measured (doctor's): the warning of :func:`load_note`
    where it was busy, the shares where it was not; "" where it is not known."""
    load = profile.get("load") or {}
    if not load:
        return ""
    shares = (f"other processes took {100 * load['others_share']:.0f}% of the CPUs "
              f"(steal {100 * load['steal_share']:.0f}%)")
    if not load.get("busy"):
        return f"measured while {shares}"
    return (f"measured while {shares}: its rates may be low; measure again on an idle machine "
            f"(bitsplit doctor --refresh)")


def load_note(profile: dict) -> str:
    """The warning on the load while the profile was measured (plan's): "" where it was idle or not known."""
    return load_line(profile) if (profile.get("load") or {}).get("busy") else ""


def _say(log: Optional[Log], msg: str) -> None:
    if log is not None:
        log(msg)


def profile_key(threads: Optional[int] = None, quick: bool = False) -> tuple[str, dict]:
    """(key, what it is made of): the profile is measured again when any part changes."""
    from ..native import policy
    from ..native.build import build_key

    cpu = cpu_info()
    size = QUICK if quick else full_size()
    parts = {
        "version": PROFILE_VERSION,
        "cpu": cpu["model"],
        "arch": cpu["arch"],
        "flags": hashlib.sha256(" ".join(sorted(cpu["flags"])).encode()).hexdigest()[:16],
        "native_build": build_key()[0],
        **policy.settings(),  # BITSPLIT_MAX_ISA, BITSPLIT_HALF_RATE_512, BITSPLIT_KERNEL
        "threads": threads_or_default(threads),
        "size": size.name,
        "tensors": size.tensors,
        "rounds": size.repeat,  # a profile taken with fewer rounds is measured again
    }
    key = hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:20]
    return key, parts


def profile_path(threads: Optional[int] = None, quick: bool = False) -> Path:
    key, parts = profile_key(threads, quick)
    return machine_dir() / f"profile-{parts['size']}-{key}.json"


def machine_profile(*, refresh: bool = False, quick: bool = False, threads: Optional[int] = None,
                    log: Optional[Log] = None) -> dict:
    """The profile of this machine and build: from the cache, or measured (and cached) when there is
    none, when it is unreadable, or with ``refresh``. ``cached`` and ``path`` say which and where."""
    threads = threads_or_default(threads)
    key, parts = profile_key(threads, quick)
    path = machine_dir() / f"profile-{parts['size']}-{key}.json"
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


def measure(*, threads: Optional[int] = None, quick: bool = False, log: Optional[Log] = None) -> dict:
    """Measure the profile now (no cache), under the built-in kernel policy (its picks are what the
    rows flag ``policy``, and what a measured policy must beat). See the module's docstring."""
    from ..native import policy

    with policy.builtin_only():
        return _measure(threads=threads, quick=quick, log=log)


def _measure(*, threads: Optional[int] = None, quick: bool = False, log: Optional[Log] = None) -> dict:
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
    watch = LoadWatch()
    size = QUICK if quick else full_size()
    threads = threads_or_default(threads)
    cpu = cpu_info()
    fams = policy.families()
    _say(log, f"machine profile ({size.name}): {cpu['model']}, {threads} threads, families {', '.join(fams)}")
    # first, on a quiet machine (no pool or OpenMP worker spinning yet); shorter for --quick
    peaks = family_peaks(fams, PEAK_SECONDS / 2.5 if quick else PEAK_SECONDS)
    _say(log, "  peak per core (G weight.column MAC/s): "
              + ", ".join(f"{f} {'-' if v is None else f'{v:.1f}'}" for f, v in peaks.items()))
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
        residual, with_base, ggml, ggml_q8, with_base_by_family = measure_residual(
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
        devs = _ggml.backend_devices()
    except Exception as exc:
        devs = []
        _say(log, f"  devices not listed: {type(exc).__name__}: {exc}")
    from ..native.residual import Residual

    with Residual(split) as r:  # the verifier's activations the (W2+R).x rows ran with (--act-bits auto)
        act_bits = r.act_bits
    res_bytes = residual[0]["bytes"] if residual else 0
    base_bytes = (with_base[0]["bytes"] - res_bytes) if with_base and residual else 0
    load = watch.result()
    if load and load["busy"]:
        _say(log, "  warning: " + load_note({"load": load}))
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
        "fastest_by_batch_with_base": fastest_by_batch(with_base_by_family),
        "draft_kernel": policy.draft_kernel(),
        "act_bits": act_bits,
        "memory_bandwidth_gb_s": round(bw / 1e9, 3),
        "synthetic": {"tensors": size.tensors, "ne0": size.ne0, "ne1": size.ne1, "residual_type": "q6_k",
                      "base_type": "q2_k", "residual_bytes": res_bytes, "base_bytes": base_bytes},
        "peaks": peaks,
        "peak_instructions": {f: PEAK_INSTRUCTIONS.get(f) for f in fams},
        "residual": with_peak_share(residual, peaks),
        "with_base": with_base,
        "with_base_by_family": with_peak_share(with_base_by_family, peaks),
        "ggml_reference": ggml,
        "ggml_q8_0": ggml_q8,
        "ggml_base": ggml_base,
        "native_draft": native_draft,
        "devices": devs,
        "load": load,
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
    for that batch (the measured policy's, :func:`..native.policy.measured_steps`, unless
    ``BITSPLIT_POLICY=builtin``), from the profile's measured batches (:func:`rate_at`). Returns
    (weights/s per core, where the figure comes from)."""
    from ..native import policy

    fam = None
    if policy.measured_wanted():
        fam = next((f for cols, f in policy.measured_steps(profile, True) if batch <= cols), None)
    fam = fam or profile["kernel_by_batch_alone"].get(str(batch))
    if fam is None:
        fam = policy.kernel_for_batch(batch, residual_alone=True)
    rows = [r for r in profile["residual"] if r["family"] == fam] or list(profile["residual"])
    rate, where = rate_at(rows, batch)
    busy = load_note(profile)
    return (rate, f"machine profile ({rows[0]['family']}, {where}, {profile['threads']} threads, "
                  f"{profile['size']} size{', cached' if profile.get('cached') else ''})"
                  + (f"; {busy}" if busy else ""))
