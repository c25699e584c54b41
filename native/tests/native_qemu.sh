#!/usr/bin/env bash
# The whole native library on AArch64 without ARM hardware: builds native/ and its C test
# (native/tests/test_native.c) for AArch64 with UndefinedBehaviorSanitizer, against a libggml-base
# cross-compiled from the llama-cpp-python sdist of the installed version, makes tiny split models
# with the project's own code, and runs the test under qemu-aarch64-static (user-mode emulation,
# whose default CPU has the dot product): the loader and its refusal of corrupt files, the thread
# pool, the kernel policy and every ARM family (neon-int16, neon-f32, generic) against ggml's own
# dequantisation. native/tests/neon_qemu.sh checks the two ARM families' arithmetic case by case.
#
#   native/tests/native_qemu.sh            (from anywhere)
#
# Needs aarch64-linux-gnu-gcc and -g++ (Debian: gcc-aarch64-linux-gnu, g++-aarch64-linux-gnu) and
# qemu-aarch64-static (qemu-user-static), installed with apt-get when missing and running as root,
# and the llama-cpp-python sdist from PyPI (pip download) on the first run. libggml-base is cached
# under $BITSPLIT_CACHE|$XDG_CACHE_HOME/bitsplit-llama|~/.cache/bitsplit-llama/ggml-aarch64/ (about a
# minute to build on 2 cores). Exit status: 0 PASS, 1 FAIL (or a build error), 77 a tool is missing
# and cannot be installed here. Environment: PYTHON (default: the repository's .venv, else python3),
# BITSPLIT_QEMU_FLIPS (random mutations of each model's files, default 20: each is slow under qemu).
set -euo pipefail
T0=$(date +%s)
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
TOOL=native_qemu
# shellcheck source=native/tests/qemu_tools.sh
. "$ROOT/native/tests/qemu_tools.sh" # PYTHON, skip, need
CROSS_CC=aarch64-linux-gnu-gcc
CROSS_CXX=aarch64-linux-gnu-g++
QEMU=qemu-aarch64-static
SYSROOT=/usr/aarch64-linux-gnu
FLIPS=${BITSPLIT_QEMU_FLIPS:-20}

say() { echo "native_qemu: $*"; }
die() { echo "native_qemu: FAIL: $*" >&2; exit 1; }
[[ "$(uname -m)" == x86_64 ]] || skip "runs on x86-64 hosts (on AArch64, run native/tests/run_sanitizers.sh)"
need "$CROSS_CC" gcc-aarch64-linux-gnu
need "$CROSS_CXX" g++-aarch64-linux-gnu
need "$QEMU" qemu-user-static
[[ -d "$SYSROOT/lib" ]] || skip "$SYSROOT/lib not found (the AArch64 C library: libc6-dev-arm64-cross)"

INC=$("$PYTHON" -c 'from bitsplit_llama.native.build import _llama_paths; print(_llama_paths()[0])') ||
    die "ggml headers of llama-cpp-python not found (is bitsplit-llama installed for $PYTHON?)"
VERSION=$("$PYTHON" -c 'import importlib.metadata as m; print(m.version("llama-cpp-python"))') ||
    die "llama-cpp-python is not installed for $PYTHON"

WORK=$(mktemp -d "${TMPDIR:-/tmp}/bitsplit-native-qemu.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
cd "$ROOT"

# --- libggml-base for AArch64, from the installed version's sdist (cached) -------------------------
CACHE=$BS_CACHE/ggml-aarch64
KEY=$( { echo "$VERSION"; "$CROSS_CC" --version; "$CROSS_CXX" --version; } | sha256sum | cut -c1-16)
GGML="$CACHE/$VERSION-$KEY"
if [[ ! -f "$GGML/libggml-base.so.0" ]]; then
    say "building libggml-base $VERSION for AArch64 (llama-cpp-python's sdist, once)"
    "$PYTHON" -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$WORK/sdist" \
        >"$WORK/pip.log" 2>&1 || { tail -5 "$WORK/pip.log" >&2; die "could not download the llama-cpp-python $VERSION sdist"; }
    tarball=$(ls "$WORK"/sdist/llama_cpp_python-*.tar.gz)
    top=$(basename "$tarball" .tar.gz)
    tar -xzf "$tarball" -C "$WORK" --wildcards "$top/vendor/llama.cpp/ggml/include/*" "$top/vendor/llama.cpp/ggml/src/*.[ch]" \
        "$top/vendor/llama.cpp/ggml/src/*.cpp" || die "$tarball: no vendored ggml sources"
    SRC="$WORK/$top/vendor/llama.cpp/ggml/src"
    printf '#pragma once\n#define GGML_VERSION "%s"\n#define GGML_COMMIT "llama-cpp-python-%s"\n' "$VERSION" "$VERSION" \
        >"$SRC/ggml-version.h"
    DEFS=(-DGGML_BUILD -DGGML_SCHED_MAX_COPIES=4 -DGGML_SHARED -D_GNU_SOURCE -D_XOPEN_SOURCE=600 -I"$SRC" -I"$SRC/../include" -O2 -fPIC)
    # the sources of ggml's own ggml-base target (ggml/src/CMakeLists.txt), two compilers at a time
    objs=()
    for f in ggml.c ggml-alloc.c ggml-quants.c ggml.cpp ggml-backend.cpp ggml-backend-meta.cpp ggml-opt.cpp \
             ggml-threading.cpp gguf.cpp; do
        [[ -f "$SRC/$f" ]] || continue # (a file another version does not have)
        if [[ "$f" == *.c ]]; then cc=("$CROSS_CC" -std=gnu11); else cc=("$CROSS_CXX" -std=gnu++17); fi
        "${cc[@]}" "${DEFS[@]}" -c "$SRC/$f" -o "$WORK/$f.o" 2>"$WORK/$f.log" &
        objs+=("$WORK/$f.o")
        while (( $(jobs -rp | wc -l) >= 2 )); do wait -n || true; done
    done
    wait
    for o in "${objs[@]}"; do
        [[ -f "$o" ]] || { cat "${o%.o}.log" >&2; die "compiling ggml failed ($(basename "${o%.o}"))"; }
    done
    "$CROSS_CXX" -shared -Wl,-soname,libggml-base.so.0 -o "$WORK/libggml-base.so.0" "${objs[@]}" -lm ||
        die "linking libggml-base failed"
    mkdir -p "$GGML" && cp "$WORK/libggml-base.so.0" "$GGML/libggml-base.so.0.$$" && mv -f "$GGML/libggml-base.so.0.$$" "$GGML/libggml-base.so.0"
fi

# --- the library and its test for AArch64, with UBSan ---------------------------------------------
say "building native/ and test_native.c for AArch64 ($CROSS_CC, -fsanitize=undefined)"
"$CROSS_CC" -std=c11 -O1 -g -fsanitize=undefined -fno-sanitize-recover=all -Wall -Wno-unused-function -DBS_TEST_HOOKS \
    -Inative -I"$INC" native/tests/test_native.c native/*.c native/arch/arm/*.c -o "$WORK/test_native" \
    -L"$GGML" -l:libggml-base.so.0 -Wl,--wrap=mmap,--wrap=munmap,--wrap=ggml_get_type_traits,--wrap=posix_memalign -lpthread -lm ||
    die "build failed"

# --- tiny split models (the files are the same on every architecture) ------------------------------
say "making tiny split models"
"$PYTHON" native/tests/make_split_models.py "$WORK" q6k moe-q8 f16 || die "could not make the tiny split models"

# --- run under qemu ----------------------------------------------------------------------------------
export QEMU_LD_PREFIX=$SYSROOT LD_LIBRARY_PATH=$GGML UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1"
status=0
run() { # name, args...
    local name=$1
    shift
    local t=$(date +%s) rc=0
    "$QEMU" "$WORK/test_native" "$@" >"$WORK/$name.out" 2>"$WORK/$name.log" || rc=$?
    local summary
    summary=$(grep -m1 '^test_native:' "$WORK/$name.out" || true)
    local reports
    reports=$(grep -c 'runtime error:' "$WORK/$name.log" || true)
    if [[ $rc -ne 0 || "$reports" != 0 || "$summary" != "test_native: PASS"* ]]; then
        status=1
        echo "native_qemu: $name: exit $rc, $reports UBSan report(s)" >&2
        [[ -n "$summary" ]] && echo "  $summary" >&2
        tail -n 40 "$WORK/$name.log" >&2
        return
    fi
    # qemu's default CPU has the dot product: both ARM families must have run
    if [[ "$summary" != *"neon-int16"* || "$summary" != *"neon-f32"* ]]; then
        status=1
        echo "native_qemu: $name: not every ARM family ran: $summary" >&2
        return
    fi
    say "$name ($(( $(date +%s) - t ))s): ${summary#test_native: }"
}
run q6k "$WORK/q6k" --flips "$FLIPS" --bad "$WORK/moe-q8/residual.gguf" --any "$WORK/f16/residual.gguf"
run moe-q8 "$WORK/moe-q8" --flips "$FLIPS" --quick --bad "$WORK/q6k/residual.gguf"
[[ $status -eq 0 ]] || die "after $(( $(date +%s) - T0 ))s"
say "PASS: the AArch64 library under $QEMU, 2 models, 0 UBSan reports, $(( $(date +%s) - T0 ))s"
