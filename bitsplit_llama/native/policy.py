"""What the native kernel policy decides, asked of the library (the thresholds live only in C:
``native/kernels.c``): which kernel families this CPU runs under the cap ``BITSPLIT_MAX_ISA``, which
one computes a product of a given batch, and which one (if any) the fast drafter uses."""

from __future__ import annotations

import os

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
