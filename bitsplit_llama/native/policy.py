"""What the native kernel policy decides, asked of the library (the thresholds live only in C:
``native/kernels.c``): which kernel families this CPU runs under the cap ``BITSPLIT_MAX_ISA``, which
one computes a product of a given batch, and which one (if any) the fast drafter uses.

The built-in order was tuned on a few CPUs. Where ``bitsplit doctor`` has measured this machine (its
profile, cached per native build), :func:`apply_measured` puts the family it measured fastest for
each batch first (:func:`measured_steps`; every split model applies it when it loads, before its
first product), so the policy is this machine's own; ``BITSPLIT_POLICY=builtin`` keeps the built-in
order."""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Iterator, Optional

from .build import load

# Every family the library has, on some architecture (x86-64: the first seven and generic; AArch64:
# neon-int16 where the CPU has the dot product, neon-f32 and generic). What runs here is families().
ALL_FAMILIES = ("vnni-int24", "amx-bf16", "avx512-bf16", "avx512vnni-int16", "avxvnni-int16", "avx2-int16", "avx2-f32",
                "neon-int16", "neon-f32", "generic")
# The families that need AVX-512 or AMX (the cap's avx512 level and above): where one runs,
# --act-bits auto keeps the verifier's 16-bit activations (native/kernels.c bs_act8_auto_here)
AVX512_FAMILIES = frozenset({"vnni-int24", "amx-bf16", "avx512-bf16", "avx512vnni-int16"})
# The values BITSPLIT_MAX_ISA accepts, lowest first (avx2 and neon are the same level).
ISA_LEVELS = ("generic", "avx2", "neon", "avxvnni", "avx512", "amx")


def _s(p) -> str:
    ffi, _ = load()
    return ffi.string(p).decode()


def families() -> list[str]:
    """The families this CPU runs under the cap, the policy's order for one column."""
    ffi, lib = load()
    names = ffi.new("const char *[]", 16)
    n = lib.bitsplit_kernel_families(names, 16)
    return [ffi.string(names[i]).decode() for i in range(min(n, 16))]


def kernel_for_batch(n_cols: int, residual_alone: bool = False) -> str:
    """The family the policy picks for a quantized product of ``n_cols`` columns: W2 + R, or the
    residual alone (``residual_alone``: add mode, the base's layers on a device)."""
    _, lib = load()
    return _s(lib.bitsplit_kernel_for_batch(int(n_cols), bool(residual_alone)))


# The pass size whose family a generation pins for every pass, whatever its tree and with --no-spec:
# one verifier arithmetic per machine and model, so that speculative output is the verifier-alone
# output token for token at any tree size (families round activations differently, so two of them
# part on near ties). W2 + R (CPU verification): the plain step's and the chains' 2 rows, what the
# auto tree picks on every CPU measured so far; the residual alone (the base on a device): a 16-node
# tree's 17 rows, where verification pays by verifying many tokens at once.
GENERATION_ROWS = 2
GENERATION_ROWS_ALONE = 17


def generation_family(residual_alone: bool = False) -> str:
    """The family every pass of every generation uses here (without ``--kernel`` or
    ``BITSPLIT_KERNEL``): the policy's for :data:`GENERATION_ROWS` (W2 + R) or
    :data:`GENERATION_ROWS_ALONE` (``residual_alone``) columns."""
    return kernel_for_batch(GENERATION_ROWS_ALONE if residual_alone else GENERATION_ROWS, residual_alone)


def draft_kernel() -> str | None:
    """The family the fast drafter computes base products with here (None: ggml's kernels draft)."""
    _, lib = load()
    return _s(lib.bitsplit_draft_kernel()) or None


def draft_min_cols() -> int:
    """The smallest batch the fast drafter takes (ggml's kernel is faster below); 0 if none."""
    _, lib = load()
    return int(lib.bitsplit_draft_min_cols())


def max_isa() -> str:
    """The cap in force (``BITSPLIT_MAX_ISA``; unset: amx, i.e. none)."""
    _, lib = load()
    return _s(lib.bitsplit_max_isa())


def where_here() -> str:
    """"on this CPU", with the cap as the library read it where ``BITSPLIT_MAX_ISA`` is set: for
    messages about a family that does not run here."""
    return f"on this CPU under BITSPLIT_MAX_ISA={max_isa()}" if os.environ.get("BITSPLIT_MAX_ISA") else "on this CPU"


def half_rate_512() -> bool:
    """Whether the policy's half-rate order is in force: this CPU runs 512-bit operations at half
    rate (AMD Zen 4; ``BITSPLIT_HALF_RATE_512=0/1`` overrides the CPUID test) and an AVX-512
    family runs here under the cap, so the 256-bit families come first where they measured faster."""
    _, lib = load()
    return bool(lib.bitsplit_half_rate_512())


# --- the policy measured on this machine ---------------------------------------------------------

#: how much faster (throughput ratio) the measured fastest family must be than the built-in pick at a
#: batch to replace it: a family within noise of the built-in one leaves the built-in choice, so that
#: two profiles of the same machine give the same policy
MEASURED_MARGIN = 1.03
POLICY_ENV = "BITSPLIT_POLICY"  # "measured" (default: where a profile exists) or "builtin"
_MEASURED_MAX = 16  # steps per table (BS_MEASURED_MAX)


def _rate(row: dict) -> float:
    return float(row.get("weights_per_s_per_core") or row.get("gb_per_s") or 0.0)


def measured_steps(profile: dict, residual_alone: bool) -> list[tuple[int, str]]:
    """(columns, family) steps, columns ascending, from a ``bitsplit doctor`` profile: per measured
    batch the fastest family (``with_base_by_family`` rows for W2 + R, ``residual`` for R alone), unless
    the built-in pick of that batch (its row flagged ``policy``) is within :data:`MEASURED_MARGIN` of it;
    consecutive batches with the same family merged. A product of n columns takes the family of the
    first step whose columns are >= n; past the last, the built-in order. [] where the profile has no
    such rows (an older profile has no W2 + R row per family)."""
    rows = profile.get("residual" if residual_alone else "with_base_by_family") or []
    by_batch: dict[int, list[dict]] = {}
    for r in rows:
        if r.get("family") and _rate(r) > 0:
            by_batch.setdefault(int(r["batch"]), []).append(r)
    steps: list[tuple[int, str]] = []
    for b in sorted(by_batch):
        best = max(by_batch[b], key=_rate)
        builtin = next((r for r in by_batch[b] if r.get("policy")), None)
        fam = best["family"]
        if builtin is not None and _rate(best) < MEASURED_MARGIN * _rate(builtin):
            fam = builtin["family"]
        if steps and steps[-1][1] == fam:
            steps[-1] = (b, fam)
        else:
            steps.append((b, fam))
    return steps[-_MEASURED_MAX:] if len(steps) > _MEASURED_MAX else steps


def set_measured(residual_alone: bool, steps: list[tuple[int, str]]) -> None:
    """Set the library's measured table for one kind of product ([] clears it)."""
    from ..errors import InvalidOptionError

    ffi, lib = load()
    names = [ffi.new("char[]", f.encode()) for _, f in steps]
    st = lib.bitsplit_set_measured_policy(bool(residual_alone), ffi.new("int64_t[]", [c for c, _ in steps] or [0]),
                                          ffi.new("const char *[]", names or [ffi.NULL]), len(steps))
    if st != 0:
        raise InvalidOptionError(f"measured kernel policy {steps}: refused by the native library (status {st}: "
                                 "columns must ascend, families be this build's)")


def measured_table(residual_alone: bool = False) -> list[tuple[int, str]]:
    """The measured table in force for W2 + R (or R alone): [] = the built-in order alone."""
    ffi, lib = load()
    cols = ffi.new("int64_t[]", _MEASURED_MAX)
    names = ffi.new("const char *[]", _MEASURED_MAX)
    n = lib.bitsplit_measured_policy(bool(residual_alone), cols, names, _MEASURED_MAX)
    return [(int(cols[i]), ffi.string(names[i]).decode()) for i in range(min(n, _MEASURED_MAX))]


def clear_measured() -> None:
    set_measured(False, [])
    set_measured(True, [])


@contextlib.contextmanager
def builtin_only() -> Iterator[None]:
    """The built-in order alone inside the block (``bitsplit doctor`` measures against it), the
    tables in force before restored after."""
    saved = (measured_table(False), measured_table(True))
    clear_measured()
    try:
        yield
    finally:
        set_measured(False, saved[0])
        set_measured(True, saved[1])


def settings() -> dict:
    """The environment's settings that change which families run and which the policy prefers, as a
    machine profile records them (``key_parts``: tools.machine.profile_key) and as a profile must match
    them to be this policy's (:func:`find_profile`)."""
    return {"max_isa": os.environ.get("BITSPLIT_MAX_ISA", ""), "half_rate_512": os.environ.get("BITSPLIT_HALF_RATE_512", ""),
            "kernel": os.environ.get("BITSPLIT_KERNEL", "")}


def measured_wanted() -> bool:
    """Whether a measured policy may be in force: ``BITSPLIT_POLICY`` is ``measured`` (the default) and
    ``BITSPLIT_KERNEL`` pins no family; a bad ``BITSPLIT_POLICY`` is refused with its name."""
    from ..errors import InvalidOptionError

    how = os.environ.get(POLICY_ENV, "") or "measured"
    if how not in ("measured", "builtin"):
        raise InvalidOptionError(f"{POLICY_ENV}='{how}': expected measured (the default) or builtin")
    return how == "measured" and not os.environ.get("BITSPLIT_KERNEL")


def find_profile(cache_root: Optional[Path] = None) -> Optional[Path]:
    """The ``bitsplit doctor`` profile this policy may be measured from: under ``<cache>/machine/``, one
    measured with this native build, under the same ``BITSPLIT_MAX_ISA`` / ``BITSPLIT_HALF_RATE_512`` /
    ``BITSPLIT_KERNEL``, on a CPU with this one's kernel families; a full profile before a quick one,
    then the newest. None if there is none (the built-in order then)."""
    from ..cache import cache_dir
    from .build import build_key

    root = (cache_root or cache_dir()) / "machine"
    if not root.is_dir():
        return None
    build = build_key()[0]
    here = set(families())
    env = settings()
    found = []
    for path in root.glob("profile-*.json"):
        try:
            prof = json.loads(path.read_text())
            parts = prof.get("key_parts") or {}
            if (parts.get("native_build") != build or any(parts.get(k, "") != v for k, v in env.items())
                    or set(prof.get("families") or ()) != here):
                continue
            found.append((prof.get("size") == "full", path.stat().st_mtime, path))
        except (OSError, ValueError, AttributeError, TypeError):
            continue
    return max(found)[2] if found else None


def apply_measured(profile_path: Optional[Path] = None) -> dict:
    """Put this machine's measured policy in force, from ``profile_path`` or :func:`find_profile`'s;
    the built-in order where there is none, where ``BITSPLIT_POLICY=builtin``, or where
    ``BITSPLIT_KERNEL`` pins one family anyway. Returns what is in force: {"policy": "measured" |
    "built-in", "profile": path or None, "with_base": steps, "alone": steps}."""
    from ..errors import InvalidOptionError

    path = (profile_path or find_profile()) if measured_wanted() else None
    steps = {False: [], True: []}
    if path is not None:
        try:
            prof = json.loads(Path(path).read_text())
        except (OSError, ValueError) as exc:
            raise InvalidOptionError(f"{path}: not a readable machine profile ({exc})") from None
        here = set(families())
        for alone in (False, True):
            steps[alone] = [(c, f) for c, f in measured_steps(prof, alone) if f in here]
    for alone in (False, True):
        set_measured(alone, steps[alone])
    measured = any(steps.values())
    return {"policy": "measured" if measured else "built-in", "profile": str(path) if measured else None,
            "with_base": steps[False], "alone": steps[True]}
