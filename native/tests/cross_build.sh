#!/usr/bin/env bash
# Cross-compiles the native library for another platform against llama-cpp-python's ggml headers,
# with warnings as errors, and checks what was built (nothing of it needs that platform's hardware):
#
#   native/tests/cross_build.sh [--target aarch64]   Linux AArch64 (native/*.c + native/arch/arm/*.c):
#       the portable family, neon-f32 and neon-int16, no x86 code reaching an ARM compiler; the result
#       is not run here (it needs an AArch64 libggml-base; native_qemu.sh does that); its symbols are
#       listed as a check. Needs aarch64-linux-gnu-gcc (Debian's gcc-aarch64-linux-gnu).
#   native/tests/cross_build.sh --target windows     Windows x86-64 (native/*.c + native/arch/x86/*.c)
#       with MinGW-w64 gcc, compiled with the flags and linked by the command bitsplit_llama.native.build
#       uses on Windows (link_command, export_def) against a stand-in ggml-base.dll that exports the
#       ggml functions the objects import; checks that bitsplit.dll exports the API and nothing else,
#       imports only ggml-base.dll and Windows' own DLLs (no libgcc or winpthread DLL to ship), and,
#       under wine, loads, detects the CPU and lists its kernel families. Needs
#       x86_64-w64-mingw32-gcc (Debian: gcc-mingw-w64-x86-64) and, for the load, wine (both installed
#       with apt-get when missing and running as root; without wine the load is skipped, said so).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
PY=${PYTHON:-$(command -v python3 || command -v python)}
TARGET=aarch64
case "${1:-}" in
    "") ;;
    --target) TARGET=${2:-}; [[ "$TARGET" == aarch64 || "$TARGET" == windows ]] ||
        { echo "cross_build: --target ${2:-}: expected aarch64 or windows" >&2; exit 2; } ;;
    *) echo "cross_build: unknown argument $1 (usage: cross_build.sh [--target aarch64|windows])" >&2; exit 2 ;;
esac
if [[ "$TARGET" == windows ]]; then
    exec bash "$ROOT/native/tests/cross_build_windows.sh"
fi
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
