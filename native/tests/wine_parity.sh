#!/usr/bin/env bash
# The x86 kernel families built for Windows compute what they compute on Linux, bit for bit, on this
# CPU, without a Windows machine:
#
#   1. builds native/tests/kernel_parity.c with every x86 family (-DPARITY_X86_ALL: kernels_avx2.c,
#      kernels_avx2_int.c and its VNNI builds, kernels_int.c, kernels_tiles.c, with scratch.c, os.c and
#      cpu_feats.c) twice, at -O3 as the library is built: natively, and for x86-64 Windows with
#      Debian's MinGW-w64 gcc (-static: wine needs no MinGW runtime); both cached (see below);
#   2. writes test vectors with native/tests/make_parity_vectors.py (ggml's own quantizer and
#      dequantizers, float64 reference products);
#   3. runs each family this CPU runs, the Linux harness natively and the Windows one under wine
#      (the CPU executes the Windows code itself: wine translates the system calls, not the
#      instructions); each harness checks its results against the float64 products, across batches
#      1-16, row splits and accumulation;
#   4. requires each family's Windows results to be bit-identical to its Linux results.
#
#   native/tests/wine_parity.sh            (from anywhere)
#
# amx-bf16 is not run under wine: Linux grants a process the AMX tile state only when it asks
# (arch_prctl), which a Windows program does not do (Windows enables it for every process).
# Needs x86_64-w64-mingw32-gcc (Debian: gcc-mingw-w64-x86-64) and wine (Debian: wine, wine64);
# installs them with apt-get when missing and running as root. Exit status: 0 PASS, 1 a FAIL (or a
# build error), 77 a tool is missing and cannot be installed here, or this is not an x86-64 machine.
# Environment: PYTHON, CC (native compiler, default cc), WIN_CC (default x86_64-w64-mingw32-gcc),
# WINE (default wine), WINE_PARITY_NO_CACHE=1 (rebuild even where a cached build of the same sources
# exists), WINE_PARITY_FAMILIES (space-separated names: only these).
set -euo pipefail
T0=$(date +%s.%N)
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
TOOL=wine_parity
# shellcheck source=native/tests/qemu_tools.sh
. "$ROOT/native/tests/qemu_tools.sh" # PYTHON, skip, need
CC=${CC:-cc}
WIN_CC=${WIN_CC:-x86_64-w64-mingw32-gcc}
WINE=${WINE:-wine}
[[ "$(uname -m)" == x86_64 ]] || skip "the x86 families need an x86-64 machine (this is $(uname -m))"
command -v "$CC" >/dev/null || skip "native C compiler $CC not found"
need "$WIN_CC" gcc-mingw-w64-x86-64 --no-install-recommends
need "$WINE" wine --no-install-recommends # and wine64, its first dependency
# Debian's wine runs 64-bit programs with wine64 (a separate package)
[[ -e /usr/lib/wine/wine64 || -n "$(command -v wine64 || true)" ]] || need /usr/lib/wine/wine64 wine64

INC=$("$PYTHON" -c 'from bitsplit_llama.native.build import _llama_paths; print(_llama_paths()[0])') ||
    { echo "wine_parity: ggml headers of llama-cpp-python not found (is bitsplit-llama installed for $PYTHON?)" >&2; exit 1; }

OUT=$(mktemp -d "${TMPDIR:-/tmp}/bitsplit-wine-parity.XXXXXX")
trap 'rm -rf "$OUT"' EXIT
cd "$ROOT"
FLAGS=(-std=c11 -O3 -Wall -Werror -DPARITY_X86_ALL -Inative -Inative/arch/x86 -I"$INC")
SRCS=(native/tests/kernel_parity.c native/scratch.c native/os.c native/arch/x86/cpu_feats.c
      native/arch/x86/kernels_avx2.c native/arch/x86/kernels_avx2_int.c native/arch/x86/kernels_avxvnni_int.c
      native/arch/x86/kernels_avx512vnni_int.c native/arch/x86/kernels_int.c native/arch/x86/kernels_tiles.c)

# 1. builds, cached under $BITSPLIT_CACHE|$XDG_CACHE_HOME/bitsplit-llama|~/.cache/bitsplit-llama/
# parity/<hash of sources, headers, compiler and flags>: each build takes ~2 minutes on 2 cores
build() { # build OUTPUT COMPILER [FLAGS...]: a cached binary linked to OUTPUT
    local out=$1 cc=$2
    shift 2
    local key
    key=$( { cat "${SRCS[@]}" native/*.h native/arch/x86/*.h "$INC/ggml.h"; "$cc" --version; echo "$* ${FLAGS[*]}"; } |
           sha256sum | cut -c1-16)
    cached_build "$key" "$out" "${WINE_PARITY_NO_CACHE:-}" "$cc" "${FLAGS[@]}" "$@" "${SRCS[@]}" -o "$out.tmp" -lm
}
build "$OUT/parity_linux" "$CC" & p1=$!
build "$OUT/parity_windows.exe" "$WIN_CC" -static & p2=$!

# 2. vectors (while the harnesses build)
"$PYTHON" native/tests/make_parity_vectors.py "$OUT/vectors.bin"
wait "$p1" || { echo "wine_parity: FAIL: the Linux harness did not build" >&2; exit 1; }
wait "$p2" || { echo "wine_parity: FAIL: the Windows harness did not build with $WIN_CC" >&2; exit 1; }
if command -v file >/dev/null; then
    file -L "$OUT/parity_windows.exe" | grep -q "PE32+ executable.*x86-64" ||
        { echo "wine_parity: $OUT/parity_windows.exe is not an x86-64 Windows executable" >&2; exit 1; }
fi

wine_env

# 3 and 4: each family on both builds, results compared bit for bit
FAMILIES=${WINE_PARITY_FAMILIES:-avx2-f32 avx2-int16 avxvnni-int16 avx512vnni-int16 vnni-int24 avx512-bf16}
status=0 n_same=0
T1=$(date +%s.%N)
cd "$OUT" # wine resolves the relative paths against its Z: drive, the Unix root
for fam in $FAMILIES; do
    set +e
    ./parity_linux vectors.bin --family "$fam" --dump "linux_$fam.out" >"linux_$fam.log" 2>&1
    rc_l=$?
    "$WINE" parity_windows.exe vectors.bin --family "$fam" --dump "windows_$fam.out" >"windows_$fam.log" 2>&1
    rc_w=$?
    set -e
    line_l=$(grep "^kernel_parity:" "linux_$fam.log" | tail -1 || true)
    line_w=$(grep "^kernel_parity:" "windows_$fam.log" | tr -d '\r' | tail -1 || true)
    if [[ $rc_l -eq 77 ]]; then
        echo "wine_parity: $fam: not run (this CPU lacks its instructions): $line_l"
        continue
    fi
    [[ -n "$line_l" ]] || line_l="kernel_parity: FAIL: $fam (Linux) exited $rc_l without a summary: $(tail -3 "linux_$fam.log")"
    [[ -n "$line_w" ]] || line_w="kernel_parity: FAIL: $fam (Windows, wine) exited $rc_w without a summary: $(tail -3 "windows_$fam.log" | tr -d '\r')"
    echo "Linux x86-64 (native):  $line_l"
    echo "Windows x86-64 (wine):  $line_w"
    if [[ $rc_l -ne 0 || $rc_w -ne 0 ]] || grep -q "^kernel_parity: FAIL" <<<"$line_l"$'\n'"$line_w"; then
        status=1
        continue
    fi
    n=$(( $(stat -c %s "linux_$fam.out") / 4 ))
    if [[ $n -gt 0 ]] && cmp -s "linux_$fam.out" "windows_$fam.out"; then
        echo "wine_parity: $fam: Windows and Linux results bit-identical ($n values, batches of 16)"
        n_same=$((n_same + 1))
    else
        echo "wine_parity: FAIL: $fam: Windows and Linux results are not bit-identical ($n values)"
        status=1
    fi
done
T2=$(date +%s.%N)
[[ $n_same -gt 0 ]] || { echo "wine_parity: FAIL: no family ran" >&2; status=1; }
verdict=PASS
[[ $status -eq 0 ]] || verdict=FAIL
awk -v v="$verdict" -v n="$n_same" -v t0="$T0" -v t1="$T1" -v t2="$T2" -v t3="$(date +%s.%N)" -v w="$("$WIN_CC" --version | head -1)" \
    'BEGIN { printf "wine_parity: %s: %d families bit-identical on Windows (%s, under wine) and Linux, in %.1f s (runs %.1f s)\n", v, n, w, t3 - t0, t2 - t1 }'
exit $status
