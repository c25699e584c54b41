#!/usr/bin/env bash
# Runs the ARM kernel families without ARM hardware and checks that they compute the same products
# as ggml's dequantisation and as their x86 counterparts: neon-f32 (native/arch/arm/kernels_neon.c)
# against avx2-f32, neon-int16 (kernels_neon_int.c, the dot product: qemu emulates it) against
# avx2-int16:
#
#   1. builds native/tests/kernel_parity.c four times: natively with kernels_avx2.c and
#      kernels_avx2_int.c (-O1, see below), for AArch64 with kernels_neon.c and kernels_neon_int.c
#      (aarch64-linux-gnu-gcc, -O3 as the library is built, -static: qemu needs no AArch64 sysroot);
#      the integer pair with -DPARITY_INT16; all cached (see below);
#   2. writes test vectors with native/tests/make_parity_vectors.py (ggml's own quantizer and
#      dequantizers, float64 reference products);
#   3. runs each x86 harness, then its AArch64 one under qemu-aarch64-static (user-mode emulation);
#   4. compares each pair's results bit for bit: information for the f32 pair (they use the same
#      operations in the same order today, but only the tolerance is their contract), required for
#      the integer pair (neon-int16 computes avx2-int16's integers and floats in its order).
#
#   native/tests/neon_qemu.sh            (from anywhere)
#
# Needs aarch64-linux-gnu-gcc (Debian: gcc-aarch64-linux-gnu) and qemu-aarch64-static (Debian:
# qemu-user-static); installs them with apt-get when missing and running as root. Exit status: 0 both
# PASS, 1 a FAIL (or a build error), 77 a tool is missing and cannot be installed here.
# Environment: PYTHON (default: the repository's .venv, else python3), CC (native compiler, default
# cc), CROSS_CC (default aarch64-linux-gnu-gcc), QEMU (default qemu-aarch64-static),
# NEON_QEMU_NO_CACHE=1 (rebuild the harnesses even where a cached build of the same sources exists),
# NEON_QEMU_X86_OPT (optimisation of the x86 reference harness, default -O1).
set -euo pipefail
T0=$(date +%s.%N)
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
TOOL=neon_qemu
# shellcheck source=native/tests/qemu_tools.sh
. "$ROOT/native/tests/qemu_tools.sh" # PYTHON, skip, need
CC=${CC:-cc}
CROSS_CC=${CROSS_CC:-aarch64-linux-gnu-gcc}
QEMU=${QEMU:-qemu-aarch64-static}
HOST=$(uname -m)


if [[ "$HOST" == "aarch64" ]]; then
    CROSS_CC=$CC # the AArch64 harness runs natively; there is no x86 family to compare with
else
    need "$CROSS_CC" gcc-aarch64-linux-gnu
    need "$QEMU" qemu-user-static
fi
command -v "$CC" >/dev/null || skip "native C compiler $CC not found"

# the headers the library is built against: the same lookup as bitsplit_llama.native.build
INC=$("$PYTHON" -c 'from bitsplit_llama.native.build import _llama_paths; print(_llama_paths()[0])') ||
    { echo "neon_qemu: ggml headers of llama-cpp-python not found (is bitsplit-llama installed for $PYTHON?)" >&2; exit 1; }

OUT=$(mktemp -d "${TMPDIR:-/tmp}/bitsplit-neon-qemu.XXXXXX")
trap 'rm -rf "$OUT"' EXIT
cd "$ROOT"
FLAGS=(-std=c11 -O3 -Wall -Werror -Inative -I"$INC")

# 1. builds, cached under $BITSPLIT_CACHE|$XDG_CACHE_HOME/bitsplit-llama|~/.cache/bitsplit-llama/
# parity/<hash of sources, headers, compiler and flags>: kernels_avx2.c alone takes 25 s (-O1) to
# 45 s (-O3) to compile on 2 cores (one unrolled body per type pair), the rest of the script ~10 s
build() { # build OUTPUT COMPILER FAMILY_FILE [FLAGS...]: a cached binary linked to OUTPUT
    local out=$1 cc=$2 fam=$3
    shift 3
    local key feats
    feats="$(dirname "$fam")/cpu_feats.c" # what the family's `available` asks (linked with it)
    # (the family's directory's headers too: avx2_quants.h)
    key=$( { cat native/tests/kernel_parity.c native/scratch.c native/os.c "$feats" "$fam" native/bs_internal.h \
                 native/bs_os.h native/bitsplit.h native/cpu_feats.h "$INC/ggml.h"
             find "$(dirname "$fam")" -maxdepth 1 -name '*.h' | sort | xargs -r cat
             "$cc" --version; echo "$* ${FLAGS[*]}"; } | sha256sum | cut -c1-16)
    cached_build "$key" "$out" "${NEON_QEMU_NO_CACHE:-}" \
        "$cc" "${FLAGS[@]}" "$@" native/tests/kernel_parity.c native/scratch.c native/os.c "$feats" "$fam" -o "$out.tmp" -lm
}
# two pairs: the f32 families (avx2-f32 / neon-f32) and the integer ones (avx2-int16 / neon-int16,
# -DPARITY_INT16), each ARM family against its x86 counterpart
PAIRS=("f32 native/arch/x86/kernels_avx2.c native/arch/arm/kernels_neon.c avx2-f32 neon-f32"
       "int16 native/arch/x86/kernels_avx2_int.c native/arch/arm/kernels_neon_int.c avx2-int16 neon-int16")
pids=()
for pair in "${PAIRS[@]}"; do
    read -r tag x86_src arm_src _ _ <<<"$pair"
    extra=()
    [[ "$tag" == int16 ]] && extra=(-DPARITY_INT16)
    if [[ "$HOST" == "x86_64" ]]; then
        # the x86 reference at -O1 (the same results, intrinsics throughout and no FP contraction under
        # -std=c11; -O3 takes twice as long to build it): the library's own -O3 build of the x86
        # families is checked by tests/test_kernels.py; NEON_QEMU_X86_OPT=-O3 to build it so here too
        build "$OUT/parity_x86_$tag" "$CC" "$x86_src" "${NEON_QEMU_X86_OPT:--O1}" "${extra[@]}" &
        pids+=($!)
    fi
    build "$OUT/parity_arm_$tag" "$CROSS_CC" "$arm_src" -static "${extra[@]}" &
    pids+=($!)
done

# 2. vectors (while the harnesses build)
"$PYTHON" native/tests/make_parity_vectors.py "$OUT/vectors.bin"
for p in "${pids[@]}"; do
    wait "$p" || { echo "neon_qemu: FAIL: a harness did not build" >&2; exit 1; }
done

# 3. runs, and 4. the two families' results compared bit for bit: information for the f32 pair
# (they use the same operations in the same order today, but only the tolerance is their
# contract), required for the integer pair (neon-int16 is avx2-int16's arithmetic, and
# tests/test_kernels.py holds avx2-int16 to its own rounding's product)
status=0
T1=$(date +%s.%N)
for pair in "${PAIRS[@]}"; do
    read -r tag _ _ x86_name arm_name <<<"$pair"
    if command -v file >/dev/null && [[ "$HOST" != "aarch64" ]]; then
        file -L "$OUT/parity_arm_$tag" | grep -q "ARM aarch64" ||
            { echo "neon_qemu: $OUT/parity_arm_$tag is not an AArch64 executable" >&2; exit 1; }
    fi
    x86_line="(no x86 run on $HOST)"
    if [[ "$HOST" == "x86_64" ]]; then
        set +e
        "$OUT/parity_x86_$tag" "$OUT/vectors.bin" --dump "$OUT/x86_$tag.out" >"$OUT/x86_$tag.log"
        rc=$?
        set -e
        x86_line=$(grep "^kernel_parity:" "$OUT/x86_$tag.log" | tail -1 || true)
        [[ -n "$x86_line" ]] || x86_line="kernel_parity: FAIL: $x86_name harness exited $rc without a summary"
        [[ $rc -eq 0 || $rc -eq 77 ]] || status=1
    fi
    set +e
    if [[ "$HOST" == "aarch64" ]]; then
        "$OUT/parity_arm_$tag" "$OUT/vectors.bin" --dump "$OUT/arm_$tag.out" >"$OUT/arm_$tag.log"
    else
        "$QEMU" "$OUT/parity_arm_$tag" "$OUT/vectors.bin" --dump "$OUT/arm_$tag.out" >"$OUT/arm_$tag.log"
    fi
    rc=$?
    set -e
    arm_line=$(grep "^kernel_parity:" "$OUT/arm_$tag.log" | tail -1 || true)
    [[ -n "$arm_line" ]] || arm_line="kernel_parity: FAIL: $arm_name harness exited $rc without a summary"
    # 77: the family does not run on this CPU (neon-int16 without the dot product)
    [[ $rc -eq 0 || $rc -eq 77 ]] || status=1

    echo "x86-64 (native):           $x86_line"
    echo "AArch64 (qemu user-mode):  $arm_line"
    grep -q "^kernel_parity: FAIL" <<<"$x86_line"$'\n'"$arm_line" && status=1
    if [[ -s "$OUT/x86_$tag.out" && -s "$OUT/arm_$tag.out" ]]; then
        n=$(( $(stat -c %s "$OUT/arm_$tag.out") / 4 ))
        if cmp -s "$OUT/x86_$tag.out" "$OUT/arm_$tag.out"; then
            echo "neon_qemu: $arm_name and $x86_name results bit-identical ($n values, batches of 16)"
        elif [[ "$tag" == int16 ]]; then
            echo "neon_qemu: FAIL: $arm_name and $x86_name results are not bit-identical ($n values; they must be)"
            status=1
        else
            echo "neon_qemu: note: $arm_name and $x86_name results are not bit-identical (information only: the tolerance is the contract)"
        fi
    fi
done
T2=$(date +%s.%N)
verdict=PASS
[[ $status -eq 0 ]] || verdict=FAIL
awk -v v="$verdict" -v t0="$T0" -v t1="$T1" -v t2="$T2" -v t3="$(date +%s.%N)" \
    'BEGIN { printf "neon_qemu: %s in %.1f s (runs %.1f s)\n", v, t3 - t0, t2 - t1 }'
exit $status
