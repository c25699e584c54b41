#!/usr/bin/env bash
# An AVX2-only llama.cpp on a bigger x86 CPU, for the comparison an AVX2 desktop would give:
#   bench/avx2_venv.sh [VENV]            (from the repository root; default VENV .avx2-venv; ~8 min on 2 cores)
# builds the pinned llama-cpp-python with ggml's CPU kernels for AVX2 + FMA + F16C + BMI2 only (no
# AVX-512, no AVX-VNNI), bypassing pip's wheel cache (which ignores CMAKE_ARGS and would hand back the
# machine's usual wheel), installs this checkout into the same environment, and checks what ggml
# reports. Then cap bitsplit's own kernels the same way and compare, e.g.:
#   BITSPLIT_MAX_ISA=avx2 VENV/bin/bitsplit bench SPLIT --vs MODEL-Q8_0.gguf -n 32
# Stock llama.cpp and bitsplit then both run AVX2 code; the memory, caches and clock stay this machine's.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${1:-.avx2-venv}
. bench/pin.sh
PIN=$(llama_cpp_pin avx2_venv.sh)
[[ "$(uname -m)" == x86_64 ]] || { echo "avx2_venv.sh: an x86-64 machine is needed (this is $(uname -m))" >&2; exit 1; }
grep -qw avx2 /proc/cpuinfo || { echo "avx2_venv.sh: this CPU has no AVX2" >&2; exit 1; }

[[ -e "$VENV" ]] && { echo "avx2_venv.sh: $VENV exists; remove it or name another folder" >&2; exit 1; }
# a build or check that fails leaves no environment behind (it would look ready)
trap 'rc=$?; if [[ $rc != 0 ]]; then rm -rf "$VENV"; echo "avx2_venv.sh: failed; $VENV removed" >&2; fi' EXIT
python3 -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
echo "== building $PIN for AVX2 only into $VENV (no wheel cache)"
CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON \
-DGGML_AVX512=OFF -DGGML_AVX512_VBMI=OFF -DGGML_AVX512_VNNI=OFF -DGGML_AVX512_BF16=OFF -DGGML_AVX_VNNI=OFF" \
    "$VENV/bin/python" -m pip install -q --no-cache-dir "$PIN"
"$VENV/bin/python" -m pip install -q -e .
info=$("$VENV/bin/python" -c "import llama_cpp; print(llama_cpp.llama_print_system_info().decode())")
echo "ggml: $info"
if ! grep -q 'AVX2 = 1' <<<"$info" || grep -Eq '(AVX512[A-Z0-9_]*|AVX_VNNI|AMX[A-Z0-9_]*) = 1' <<<"$info"; then
    echo "avx2_venv.sh: the build is not AVX2-only (ggml reports: $info)" >&2
    exit 1
fi
echo "ready: BITSPLIT_MAX_ISA=avx2 $VENV/bin/bitsplit ..."
