#!/usr/bin/env bash
# Cross-compile the native library for AArch64 (native/*.c + native/arch/arm/*.c) against
# llama-cpp-python's ggml headers, with warnings as errors: proves that the library builds on ARM
# (the portable family, the neon-f32 and neon-int16 families, no x86 code reaching an ARM compiler). The result is
# not run here (it needs an AArch64 libggml-base); its symbols are listed as a check.
#
#   native/tests/cross_build.sh            (from anywhere; needs aarch64-linux-gnu-gcc:
#                                           Debian's gcc-aarch64-linux-gnu)
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
PY=${PYTHON:-$(command -v python3 || command -v python)}
CC=${CROSS_CC:-aarch64-linux-gnu-gcc}
command -v "$CC" >/dev/null || { echo "cross_build: $CC not found (apt-get install gcc-aarch64-linux-gnu)" >&2; exit 1; }
# the headers the library is built against: the same lookup as bitsplit_llama.native.build
INC=$("$PY" -c 'from bitsplit_llama.native.build import _llama_paths; print(_llama_paths()[0])') ||
    { echo "cross_build: ggml headers of llama-cpp-python not found (is bitsplit-llama installed for $PY?)" >&2; exit 1; }
OUT=$(mktemp -d "${TMPDIR:-/tmp}/bitsplit-cross.XXXXXX")
trap 'rm -rf "$OUT"' EXIT
cd "$ROOT"
"$CC" -std=c11 -O3 -fPIC -Wall -Werror -shared -Inative -I"$INC" native/*.c native/arch/arm/*.c \
    -o "$OUT/libbitsplit.so" -Wl,--unresolved-symbols=ignore-all
file "$OUT/libbitsplit.so" | grep -q "ARM aarch64" || { echo "cross_build: not an AArch64 object" >&2; exit 1; }
syms=$(aarch64-linux-gnu-nm -D --defined-only "$OUT/libbitsplit.so" 2>/dev/null || nm -D --defined-only "$OUT/libbitsplit.so")
for s in bitsplit_ctx_load bitsplit_eval_callback bitsplit_kernel_families bs_family_neon_f32 bs_family_neon_int16; do
    grep -q " $s\$" <<<"$syms" || { echo "cross_build: $s missing from the AArch64 build" >&2; exit 1; }
done
grep -q "bs_family_avx2_f32\|bs_family_vnni" <<<"$syms" && { echo "cross_build: x86 code in the AArch64 build" >&2; exit 1; }
echo "cross_build: PASS: native/ builds for AArch64 with $("$CC" --version | head -1) ($(stat -c %s "$OUT/libbitsplit.so") bytes; generic + neon-f32 + neon-int16)"
