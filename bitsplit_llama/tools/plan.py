"""``bitsplit plan``: what fits where, and a projection of tokens/s for bitsplit vs stock Q8_0 with
partial offload. A projection from a stated cost model, not a measurement.

The cost model (per generated token, one GPU, weights streamed from memory once per pass):

stock Q8_0, ``-ngl`` as large as fits:
    t_q8 = bytes_gpu / B_gpu + bytes_cpu / (B_ram * e_ram)
bitsplit, base on the GPU (as much as fits, the rest on the CPU), residual in system RAM:
    t_draft  = base_gpu / B_gpu + base_cpu / (B_ram * e_ram) + launch
    t_verify = base_gpu / B_gpu + base_cpu / (B_ram * e_ram) + t_residual + t_pcie
    t_residual = max(residual / (B_ram * e_ram),  residual_weights / (cores * w_core))
    t_pcie   = hooked products * (2 * latency + activation bytes / B_pcie)
    tokens/s = a / (rounds * t_draft + t_verify)
where B_* are bandwidths, e_ram the fraction of RAM bandwidth a streaming pass reaches (0.8, as
stock Q8_0 reaches here), w_core the residual weights per second one core of this machine computes
at the verification batch (the native kernels, from this machine's profile: :mod:`.machine`), ``a`` the tokens per verification
and ``rounds`` the drafter passes per cycle (given, or 4 and 5 by default: about what a 16-node
tree reaches on code with a small model here; the big model's own acceptance is not measured). The residual and the GPU halves run one after the other
(the eval callback synchronises at every product).
"""

from __future__ import annotations

import math
import os
from pathlib import Path

from ..errors import InputError, InvalidOptionError

#: dense models without a file at hand: (layers, embedding, feed-forward, heads, kv heads, vocab)
PRESETS = {
    "llama-3-70b": (80, 8192, 28672, 64, 8, 128256),
    "qwen2.5-32b": (64, 5120, 27648, 40, 8, 152064),
    "gemma-2-27b": (46, 4608, 36864, 32, 16, 256000),
    "qwen2.5-coder-1.5b": (28, 1536, 8960, 12, 2, 151936),
}
#: bits per weight seen on real splits (Qwen2.5-Coder-1.5B: base 3.36; residual q6_k 5.68, q8_0 7.41)
BASE_BPW = 3.4
RESIDUAL_BPW = {"q6_k": 5.7, "q8_0": 7.5}
Q8_BPW = 8.5
E_RAM = 0.8
GPU_OVERHEAD = 1.0e9       # CUDA context, compute buffers
LAUNCH_S = 0.002           # per-pass fixed cost on a GPU (kernel launches, sync)
PCIE_LATENCY_S = 10e-6


def _shape_from(model: str) -> tuple[str, tuple[int, int, int, int, int, int], float]:
    """(name, dims, parameter count) from a GGUF file or a preset name."""
    p = Path(model)
    if p.exists():
        from ..formats.gguf_file import GGUFFile

        with GGUFFile(p, role="model") as g:
            arch = g.architecture
            kv = g.kv

            def get(key, default=None):
                v = kv.get(f"{arch}.{key}", default)
                if v is None:
                    raise InputError(f"{p}: metadata key '{arch}.{key}' missing: cannot plan for this model")
                return int(v)

            n_params = float(sum(t.n_elements for t in g.tensors))
            dims = (get("block_count"), get("embedding_length"), get("feed_forward_length", 0),
                    get("attention.head_count"), get("attention.head_count_kv", get("attention.head_count")),
                    len(kv.get("tokenizer.ggml.tokens", [])) or 32000)
            return p.name, dims, n_params
    if model not in PRESETS:
        raise InputError(f"{model}: neither a GGUF file nor a known model (presets: {', '.join(PRESETS)})")
    L, E, F, H, KV, V = PRESETS[model]
    hd = E // H
    n_params = float(L * (E * E * 2 + 2 * E * KV * hd + 3 * E * F) + 2 * V * E)
    return model, PRESETS[model], n_params


def _machine(log=None) -> tuple[dict | None, str]:
    """(this machine's profile, ""): :mod:`.machine`, measured once per machine and native build and
    cached; (None, why) where it cannot be measured (no native library, no compiler)."""
    try:
        from .machine import machine_profile

        return machine_profile(log=log), ""
    except Exception as exc:  # the plan then says it assumed a rate, and why
        return None, f"{type(exc).__name__}: {exc}"


def _residual_rate_per_core(profile: dict | None, batch: int, why: str = "") -> tuple[float, str]:
    """Residual weights/s one core computes here at this batch (native kernels, the policy's family),
    from the machine profile; a conservative constant where there is none."""
    if profile is None:
        return 2.0e9, f"assumed 2e9 weights/s/core (could not measure: {why})"
    from .machine import residual_rate_per_core

    rate, src = residual_rate_per_core(profile, batch)
    return rate, f"measured here: {src}"


def make_plan(model: str | os.PathLike[str], *, vram_gb: float, gpu_bw: float = 1000.0, pcie: float = 25.0,
              ram_bw: float | None = None, residual: str = "q6_k", n_ctx: int = 8192,
              tokens_per_verify: float | None = None, rounds: int | None = None, cores: int | None = None,
              verify_rows: int = 17, log=None) -> dict:
    for name, v in (("--vram", vram_gb), ("--gpu-bandwidth", gpu_bw), ("--pcie", pcie)):
        if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
            raise InvalidOptionError(f"{name}: {v} must be a positive number")
    if ram_bw is not None and not ram_bw > 0:
        raise InvalidOptionError(f"--ram-bandwidth: {ram_bw} must be a positive number")
    if residual not in RESIDUAL_BPW:
        raise InvalidOptionError(f"--residual: '{residual}' unknown (expected one of: {', '.join(RESIDUAL_BPW)})")
    if n_ctx < 1:
        raise InvalidOptionError(f"--n-ctx: {n_ctx} is not positive")
    name, (L, E, F, H, KV, V), n_params = _shape_from(str(model))
    cores = cores or os.cpu_count() or 1
    profile, why = _machine(log)
    ram_src = "given"
    if ram_bw is None:
        if profile is not None:
            ram_bw = float(profile["memory_bandwidth_gb_s"])
        else:
            from .bench import memory_bandwidth
            from ..runtime.llamacpp import default_threads

            ram_bw = memory_bandwidth(default_threads()) / 1e9
        ram_src = "measured here"
    GB = 1e9
    hd = E // max(1, H)
    kv_bytes = 2 * L * n_ctx * KV * hd * 2  # K and V, f16
    vram = vram_gb * GB - GPU_OVERHEAD
    # stock Q8_0: as many layers on the GPU as fit beside their KV cache
    q8 = n_params * Q8_BPW / 8
    per_layer_q8 = q8 / L + kv_bytes / L
    ngl = max(0, min(L, int(vram // per_layer_q8)))
    q8_gpu = q8 * ngl / L
    q8_cpu = q8 - q8_gpu
    t_q8 = q8_gpu / (gpu_bw * GB) + q8_cpu / (ram_bw * GB * E_RAM)
    # bitsplit
    base = n_params * BASE_BPW / 8
    res = n_params * RESIDUAL_BPW[residual] / 8
    per_layer_base = base / L + kv_bytes / L
    ngl_b = max(0, min(L, int(vram // per_layer_base)))
    base_gpu = base * ngl_b / L
    base_cpu = base - base_gpu
    t_base = base_gpu / (gpu_bw * GB) + base_cpu / (ram_bw * GB * E_RAM)
    w_core, w_src = _residual_rate_per_core(profile, verify_rows, why)
    t_res = max(res / (ram_bw * GB * E_RAM), n_params / (cores * w_core))
    hooks = L * 7 + 1
    act_bytes = sum((E + E) for _ in range(4)) + (E + F) * 2 + (F + E)  # q,k,v,o + gate,up + down, per row
    t_pcie = hooks * 2 * PCIE_LATENCY_S + L * act_bytes * 4 * verify_rows * 2 / (pcie * GB)
    a_src = "given"
    if tokens_per_verify is None:
        tokens_per_verify, a_src = 4.0, "default (about what a 16-node tree reaches on code with a small model here)"
    rounds = rounds or 5
    t_draft = t_base + LAUNCH_S
    t_verify = t_base + t_res + t_pcie + LAUNCH_S
    t_cycle = rounds * t_draft + t_verify
    tps = tokens_per_verify / t_cycle
    tps_q8 = 1 / t_q8
    out = {
        "model": name, "n_params": n_params, "vram_gb": vram_gb, "gpu_bandwidth_gb_s": gpu_bw, "pcie_gb_s": pcie,
        "ram_bandwidth_gb_s": round(ram_bw, 1), "ram_bandwidth_source": ram_src, "residual": residual,
        "n_ctx": n_ctx, "kv_cache_gb": round(kv_bytes / GB, 2),
        "q8_0": {"size_gb": round(q8 / GB, 1), "gpu_layers": ngl, "layers": L, "gpu_gb": round(q8_gpu / GB, 1),
                 "cpu_gb": round(q8_cpu / GB, 1), "seconds_per_token": round(t_q8, 4), "tokens_per_second": round(tps_q8, 2)},
        "bitsplit": {"base_gb": round(base / GB, 1), "base_gpu_layers": ngl_b, "base_cpu_gb": round(base_cpu / GB, 1),
                     "residual_ram_gb": round(res / GB, 1), "draft_pass_s": round(t_draft, 4),
                     "verify_pass_s": round(t_verify, 4), "residual_s": round(t_res, 4), "pcie_s": round(t_pcie, 4),
                     "rounds": rounds, "tokens_per_verify": tokens_per_verify, "tokens_per_verify_source": a_src,
                     "residual_rate_per_core": w_core, "residual_rate_source": w_src, "cores": cores,
                     "tokens_per_second": round(tps, 2)},
        "projected_speedup": round(tps / tps_q8, 2),
        "projection": True,
    }
    fits = "fits" if ngl_b == L else f"does not fit: {ngl_b}/{L} base layers on the GPU, {base_cpu / GB:.1f} GB on the CPU"
    out["text"] = "\n".join([
        f"PROJECTION (a cost model, not a measurement) for {name}, {n_params / 1e9:.1f} B parameters, n_ctx {n_ctx}:",
        f"  GPU {vram_gb:g} GB at {gpu_bw:g} GB/s, PCIe {pcie:g} GB/s, RAM {ram_bw:.1f} GB/s ({ram_src}), {cores} CPU cores",
        f"  stock Q8_0: {q8 / GB:.1f} GB; -ngl {ngl}/{L} ({q8_gpu / GB:.1f} GB on the GPU, {q8_cpu / GB:.1f} GB in RAM)"
        f" -> {tps_q8:.2f} tokens/s",
        f"  bitsplit: base {base / GB:.1f} GB on the GPU ({fits}) + KV {kv_bytes / GB:.1f} GB; residual "
        f"{res / GB:.1f} GB ({residual}) in RAM",
        f"    draft pass {1000 * t_draft:.1f} ms, verify pass {1000 * t_verify:.1f} ms (residual {1000 * t_res:.1f} ms, "
        f"PCIe {1000 * t_pcie:.1f} ms), {rounds} drafter passes per cycle, {tokens_per_verify:g} tokens/verify ({a_src})",
        f"    -> {tps:.2f} tokens/s, {tps / tps_q8:.2f}x stock Q8_0",
        f"  residual compute: {w_core / 1e9:.2f} G weights/s per core, {w_src}",
    ])
    return out
