#!/usr/bin/env bash
# Build native/tests/test_native.c and the native library with AddressSanitizer + UndefinedBehavior-
# Sanitizer (+ LeakSanitizer where the environment allows it), make tiny split models with the
# project's own code, and run the test program on each. Fails on any test failure or sanitizer report.
#
#   native/tests/run_sanitizers.sh            (from the repository root; tests/test_fuzz.py runs it in every suite run)
#
# Environment: PYTHON (interpreter with bitsplit_llama and llama_cpp; default python3), CC (default
# gcc), BITSPLIT_SANITIZE_FLIPS (random mutations per model, default 1500), BITSPLIT_SANITIZE_KEEP=1
# (keep the work directory). libggml-base itself is not instrumented; in this build the library's
# file maps are heap copies with the bytes past the end of the file poisoned, and ggml's
# dequantizers check their input first (see test_native.c), so ASan sees reads past the end of a
# residual or base file.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$ROOT"
PY=${PYTHON:-$(command -v python3 || command -v python)}
CC=${CC:-gcc}
FLIPS=${BITSPLIT_SANITIZE_FLIPS:-1500}
T0=$(date +%s)

say() { echo "run_sanitizers: $*"; }
die() { echo "run_sanitizers: FAIL: $*" >&2; exit 1; }

WORK=$(mktemp -d "${TMPDIR:-/tmp}/bitsplit-sanitize.XXXXXX")
cleanup() {
    if [[ "${BITSPLIT_SANITIZE_KEEP:-0}" == 1 ]]; then say "work directory kept: $WORK"; else rm -rf "$WORK"; fi
}
trap cleanup EXIT

# --- llama-cpp-python's headers and libggml-base ------------------------------------------------
PKG=$("$PY" -c "import llama_cpp, os; print(os.path.dirname(os.path.abspath(llama_cpp.__file__)))") \
    || die "llama_cpp is not importable with $PY"
SP=$(dirname "$PKG")
INC=""
for cand in "$SP/include" "$PKG/include"; do
    if [[ -f "$cand/ggml.h" && -f "$cand/gguf.h" && -f "$cand/ggml-backend.h" && -f "$cand/ggml-alloc.h" ]]; then
        INC=$cand
        break
    fi
done
[[ -n "$INC" ]] || die "ggml headers not found in $SP/include or $PKG/include"
LIB="$PKG/lib"
[[ -e "$LIB/libggml-base.so.0" ]] || die "$LIB/libggml-base.so.0 not found"
command -v "$CC" >/dev/null || die "no C compiler ($CC)"

case "$(uname -m)" in aarch64|arm64) ARCH=arm ;; *) ARCH=x86 ;; esac
# --- build ------------------------------------------------------------------------------------------
SAN=(-fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer -g -O1)
JOBS=$(nproc 2>/dev/null || echo 2)
say "building with $CC ${SAN[*]} against $INC and $LIB/libggml-base.so.0 ($JOBS compilers at once)"
# one object per source, $JOBS at a time (the three compilations of kernels_avx2_int.c take most of
# the time), then one link
mkdir -p "$WORK/obj"
export CC WORK INC
export SANFLAGS="${SAN[*]}"
printf '%s\n' native/tests/test_native.c native/*.c native/arch/"$ARCH"/*.c |
    xargs -P "$JOBS" -I{} sh -c 'o="$WORK/obj/$(echo "$1" | tr / _).o"; "$CC" -std=c11 $SANFLAGS -Wall \
        -Wno-unused-function -DBS_TEST_HOOKS -Inative -I"$INC" -c "$1" -o "$o"' _ {} \
    || die "build failed"
"$CC" "${SAN[@]}" "$WORK"/obj/*.o -o "$WORK/test_native" \
    -L"$LIB" -l:libggml-base.so.0 -Wl,-rpath,"$LIB" -Wl,--wrap=mmap,--wrap=munmap,--wrap=ggml_get_type_traits,--wrap=posix_memalign -lpthread -lm \
    || die "link failed"

# --- LeakSanitizer available? (it needs ptrace-like access to the process; some sandboxes refuse) ---
LEAKS=1
printf '#include <stdlib.h>\nvoid * volatile keep;\nint main(void) { keep = malloc(33); keep = 0; return 0; }\n' \
    > "$WORK/leak.c"
"$CC" -fsanitize=address -g "$WORK/leak.c" -o "$WORK/leak" || die "cannot build the LeakSanitizer probe"
if ASAN_OPTIONS=detect_leaks=1 "$WORK/leak" >"$WORK/leak.log" 2>&1; then
    LEAKS=0
    say "LeakSanitizer did not report a known leak in this environment: running with detect_leaks=0"
elif ! grep -q "detected memory leaks" "$WORK/leak.log"; then
    LEAKS=0
    say "LeakSanitizer cannot run here ($(grep -m1 -i 'leaksanitizer' "$WORK/leak.log" || echo 'no report')): running with detect_leaks=0"
else
    say "LeakSanitizer works: leaks are errors"
fi

# --- tiny split models ------------------------------------------------------------------------------
say "making tiny split models"
"$PY" native/tests/make_split_models.py "$WORK" || die "could not make the tiny split models"

# --- run ----------------------------------------------------------------------------------------------
# the harness itself: a read one byte past a residual's (heap-copied) map must be an ASan report
if ASAN_OPTIONS=detect_leaks=0 "$WORK/test_native" "$WORK/q6k" --selftest-oob >"$WORK/oob.log" 2>&1 \
    || ! grep -q "ERROR: AddressSanitizer" "$WORK/oob.log"; then
    cat "$WORK/oob.log" >&2
    die "this build does not detect reads past the end of a file map"
fi
say "self-check: a read past the end of a file map is reported ($(grep -m1 -o 'AddressSanitizer: [a-z-]*' "$WORK/oob.log"))"
export ASAN_OPTIONS="detect_leaks=$LEAKS:halt_on_error=1:abort_on_error=0:detect_stack_use_after_return=1:strict_string_checks=1:check_initialization_order=1:detect_invalid_pointer_pairs=1"
export UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1"
status=0
run() { # name, args...
    local name=$1
    shift
    local log="$WORK/$name.log"
    local t=$(date +%s)
    if "$WORK/test_native" "$@" >"$log.out" 2>"$log"; then rc=0; else rc=$?; fi
    local summary
    summary=$(grep -m1 '^test_native:' "$log.out" || true)
    local reports
    reports=$(grep -cE 'ERROR: (AddressSanitizer|LeakSanitizer)|runtime error:|SUMMARY: (AddressSanitizer|UndefinedBehaviorSanitizer|LeakSanitizer)' "$log" || true)
    if [[ $rc -ne 0 || "$reports" != 0 || -z "$summary" ]]; then
        status=1
        echo "run_sanitizers: $name: exit $rc, $reports sanitizer report line(s)" >&2
        [[ -n "$summary" ]] && echo "  $summary" >&2
        tail -n 60 "$log" >&2
    else
        say "$name ($(( $(date +%s) - t ))s): ${summary#test_native: }"
    fi
}
run q6k "$WORK/q6k" --flips "$FLIPS" --bad "$WORK/moe-q8/residual.gguf" --any "$WORK/f16/residual.gguf"
run moe-q8 "$WORK/moe-q8" --flips "$FLIPS" --quick --bad "$WORK/q6k/residual.gguf"
run f16 "$WORK/f16" --flips $((FLIPS / 3)) --quick --any "$WORK/q6k/residual.gguf"
run q4k "$WORK/q4k" --flips $((FLIPS / 3)) --quick
run iq2 "$WORK/iq2" --flips $((FLIPS / 3)) --quick
run iq1m "$WORK/iq1m" --flips $((FLIPS / 3)) --quick

elapsed=$(( $(date +%s) - T0 ))
if [[ $status -ne 0 ]]; then
    BITSPLIT_SANITIZE_KEEP=1
    die "sanitizer run failed after ${elapsed}s (logs in $WORK)"
fi
say "PASS: 6 models, 0 sanitizer reports (ASan+UBSan, detect_leaks=$LEAKS), ${elapsed}s"
