#!/usr/bin/env bash
# The device path on a real GPU, in one go: on a machine with an NVIDIA GPU and the CUDA toolkit,
#   bench/gpu_check.sh                      (from the repository root; ~10 min, mostly the build)
# 1. builds llama-cpp-python for CUDA (+ RPC) into its own virtual environment, bypassing pip's
#    wheel cache (which ignores CMAKE_ARGS and may hold a CPU-only wheel), and checks llama.cpp
#    sees the GPU;
# 2. runs the add-mode tests with the base on the GPU (tests/test_rpc.py: the "gpu" cases, and
#    the RPC ones beside them);
# 3. fetches SmolLM2-135M, splits it, and runs `bitsplit eval` (verifier all local vs base on the
#    GPU, KL against the source) and `bitsplit bench` with the base on the GPU (-ngl 99), with and
#    without overlap;
# 4. prints one JSON line: {"gpu", "tests", "eval": {...}, "bench": {...}, "bench_no_overlap": {...}}.
# Environment: GPU_CHECK_VENV (default .gpu-venv), GPU_CHECK_CMAKE (default -DGGML_CUDA=on
# -DGGML_RPC=on; e.g. -DGGML_VULKAN=on for Vulkan), GPU_CHECK_N (tokens per bench run, default 64).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${GPU_CHECK_VENV:-.gpu-venv}
CMAKE=${GPU_CHECK_CMAKE:--DGGML_CUDA=on -DGGML_RPC=on}
N=${GPU_CHECK_N:-64}
OUT=$(mktemp -d "${TMPDIR:-/tmp}/gpu-check.XXXXXX")
say() { echo "gpu_check: $*" >&2; }

python3 -m venv "$VENV"
# shellcheck disable=SC1091
. "$VENV/bin/activate"
python -m pip install --upgrade pip >/dev/null
say "building llama-cpp-python with CMAKE_ARGS='$CMAKE' (no wheel cache)"
CMAKE_ARGS="$CMAKE" python -m pip install --no-cache-dir -e ".[test]" >"$OUT/install.log" 2>&1 ||
    { tail -40 "$OUT/install.log" >&2; exit 1; }
GPUS=$(python -c "from bitsplit_llama.runtime import rpc; print(rpc.gpu_count())")
[[ "$GPUS" -gt 0 ]] || { say "llama.cpp sees no GPU after the build (see $OUT/install.log)"; exit 1; }
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 || echo "GPU")
say "llama.cpp sees $GPUS GPU(s): $GPU"

say "add-mode tests (base on the GPU, and on a loopback RPC server)"
set +e
BITSPLIT_REQUIRE_RPC=1 python -m pytest -q -rs tests/test_rpc.py >"$OUT/tests.log" 2>&1
TESTS_RC=$?
set -e
TESTS=$(tail -1 "$OUT/tests.log")
say "tests: $TESTS"

SRC=$(python -c "from bitsplit_llama.tools.fetch import fetch_model; print(fetch_model('smollm2-135m'))")
SPLIT="$OUT/smollm2-split"
bitsplit split "$SRC" -o "$SPLIT" --residual q8_0 >&2
python - "$OUT/text.txt" <<'EOF'
import sys, argparse, textwrap, inspect
open(sys.argv[1], "w").write(inspect.getsource(argparse) + inspect.getsource(textwrap))
EOF
say "eval: verifier all local vs base on the GPU"
bitsplit eval "$SPLIT" --reference "$SRC" --text "$OUT/text.txt" --chunks 8 --n-gpu-layers 99 --json \
    >"$OUT/eval.json"
say "bench: base on the GPU, with and without overlap"
bitsplit bench "$SPLIT" --vs "$SRC" -n "$N" --n-gpu-layers 99 --tree-nodes 8 --json -q >"$OUT/bench.json"
bitsplit bench "$SPLIT" --vs "$SRC" -n "$N" --n-gpu-layers 99 --tree-nodes 8 --no-overlap --json -q \
    >"$OUT/bench_seq.json"

python - "$OUT" "$GPU" "$TESTS" "$TESTS_RC" <<'EOF'
import json, sys
out, gpu, tests, rc = sys.argv[1:5]
last = lambda f: json.loads(open(f"{out}/{f}").read().strip().splitlines()[-1])  # noqa: E731
ev, b, bs = last("eval.json"), last("bench.json"), last("bench_seq.json")
keep = ("tokens_per_second", "vs_tokens_per_second", "speedup_vs", "accepted_per_verify", "add_mode_per_pass")
print(json.dumps({
    "gpu": gpu, "tests": tests, "tests_ok": rc == "0",
    "eval": {m["name"]: {"kl_mean": m["kl_mean"], "top1": m["top1"]} for m in ev["models"]},
    "bench": {k: b.get(k) for k in keep}, "bench_no_overlap": {k: bs.get(k) for k in keep},
    "logs": out}))
EOF
exit "$TESTS_RC"
