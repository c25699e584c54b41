"""``bitsplit plan``: what fits where, and a projection of tokens/s for bitsplit vs stock Q8_0 with
partial offload. A projection from a stated cost model, not a measurement.

The cost model (per generated token, one GPU, weights streamed from memory once per pass):

stock Q8_0, ``-ngl`` as large as fits:
    t_q8 = bytes_gpu / B_gpu + bytes_cpu / (B_ram * e_ram)
bitsplit, base on the GPU (as much as fits, the rest on the CPU), residual in system RAM:
    t_draft  = base_gpu / B_gpu + base_cpu / (B_ram * e_ram) + launch
    t_verify = base_gpu / B_gpu + base_cpu / (B_ram * e_ram) + t_residual + t_pcie
    t_residual = max(residual / (B_ram * e_ram),  residual_weights / (cores * w_core))
    t_pcie   = hooked products * overhead + activation bytes / B_pcie
    (compensation, on by default: t_verify += base_gpu / B_gpu + activation bytes of the GPU's
     layers / B_pcie, and whole layers' products are hooked too)
    tokens/s = a / (rounds * t_draft + t_verify)
With ``--gpu none`` (everything on this CPU, the case a measurement here can check):
    t_q8     = q8 / (B_ram * e_ram)
    t_draft  = base / (B_ram * e_ram)
    t_verify = max((base + residual) / (B_ram * e_ram),  weights / (cores * w_core_wb))
where w_core_wb is the (W2 + R) product's weights/s per core at the verification batch (machine
profile). For a split directory, base and residual are its files' tensor bytes.

where B_* are bandwidths, e_ram the fraction of RAM bandwidth a streaming pass reaches (0.8, as
stock Q8_0 reaches here), w_core the residual weights per second one core of this machine computes
at the verification batch (the native kernels, from this machine's profile: :mod:`.machine`), ``a`` the tokens per verification
and ``rounds`` the drafter passes per cycle (given, or 4 and 5 by default: a conservative figure,
:data:`DEFAULT_TREE_SOURCE`; the big model's own acceptance is not measured;
with ``--gpu none`` and nothing given, chains of 1-4 nodes are compared with that tree:
:func:`default_profile`). The residual and the GPU halves run one after the other
(the eval callback synchronises at every product). ``overhead`` is each hooked product's fixed cost
per verify pass beyond its bytes (``--product-overhead-us``: given, else the last GPU measurement
found, else 2 PCIe transfers of 10 us: :func:`product_overhead`); the hooked products are 7 per split
layer and the output head (:func:`hooked_products`), and the chosen plan is also projected at 10 us,
100 us and 1 ms per product (``overhead_sensitivity``).
"""

from __future__ import annotations

import math
import os
from functools import partial
from pathlib import Path

from ..errors import InputError, InvalidOptionError

#: dense models without a file at hand: (layers, embedding, feed-forward, heads, kv heads, vocab)
PRESETS = {
    "llama-3-70b": (80, 8192, 28672, 64, 8, 128256),
    "qwen2.5-32b": (64, 5120, 27648, 40, 8, 152064),
    "gemma-2-27b": (46, 4608, 36864, 32, 16, 256000),
    "qwen2.5-coder-1.5b": (28, 1536, 8960, 12, 2, 151936),
}
#: where the default acceptance of a 16-node tree (4 tokens per verify in 5 drafter passes) comes from:
#: Qwen2.5-Coder-1.5B q6_k on code prompts, greedy, reached 5.5 in 4.6 passes before trees were valued
#: by measured acceptance and 7.4 in 6.5 after (2026-12-06, Zen 5); a big model's is not measured
DEFAULT_TREE_SOURCE = ("default (a 16-node tree reached 5.5-7.4 tokens per verify on code with a small model "
                       "here; 4 keeps the projection conservative)")
#: rows of a verification pass when none are given: a 16-node tree's (the default tree of 4 tokens
#: per verification in 5 drafter passes)
DEFAULT_VERIFY_ROWS = 17
#: bits per weight: the base's Q2_K mix as seen on real splits (Qwen2.5-Coder-1.5B: 3.36 over all
#: weights); a residual at its type's own rate over every weight (a big model's weights nearly all
#: have one; on that 1.5B model, whose embeddings are 13% of it, q6_k came to 5.68 over all weights)
BASE_BPW = 3.4
#: the other bases `split --base` makes: their types' own rates (not measured on a split: llama.cpp's
#: mixes keep a few tensors wider, so real files come out somewhat larger)
BASE_TYPE_BPW = {"q2_k": BASE_BPW, "iq2_s": 2.5, "iq2_xs": 2.3125, "iq2_xxs": 2.0625, "iq1_m": 1.75}
RESIDUAL_BPW = {"q4_k": 4.5, "q5_k": 5.5, "q6_k": 6.5625, "q8_0": 8.5}
#: the verifier's mean KL against the source as a multiple of stock Q8_0's in the same run, per
#: (base, residual), measured: `bitsplit eval`, 4,096 tokens, Qwen2.5-Coder-1.5B split from its Q4_K_M
#: file (the reference, dequantized), README "Residual choices". Where two texts were measured (code:
#: argparse.py + textwrap.py; English: the GPL-3), the worse: q4_k 0.90x on code but 1.94x on
#: English, q5_k 0.32x / 0.59x, q6_k 0.088x / 0.19x. A pair not listed was not measured; `--residual
#: auto` only chooses measured pairs.
FIDELITY_VS_Q8 = {
    ("q2_k", "q4_k"): 1.94, ("q2_k", "q5_k"): 0.59, ("q2_k", "q6_k"): 0.19, ("q2_k", "q8_0"): 0.054,
    ("iq2_xxs", "q4_k"): 2.19, ("iq2_xxs", "q6_k"): 0.21, ("iq2_s", "q6_k"): 0.19, ("iq1_m", "q6_k"): 0.24,
}
FIDELITY_SOURCE = ("measured by bitsplit eval on Qwen2.5-Coder-1.5B split from its Q4_K_M file, 4,096 tokens of "
                   "code and (Q2_K base, q4_k-q6_k) of English, the worse kept; not on this model, and a 16-bit "
                   "source may need a larger residual")


def residuals_within(base_type: str, max_kl: float) -> list[str]:
    """The residual types measured within ``max_kl`` times stock Q8_0's KL with this base, smallest first."""
    return [r for r in RESIDUAL_BPW if FIDELITY_VS_Q8.get((base_type, r), math.inf) <= max_kl]


Q8_BPW = 8.5
E_RAM = 0.8
GPU_OVERHEAD = 1.0e9       # CUDA context, compute buffers
LAUNCH_S = 0.002           # per-pass fixed cost on a GPU (kernel launches, sync)
PCIE_LATENCY_S = 10e-6
#: a hooked product's fixed cost per verify pass (synchronisation, copies, the callback), beyond its
#: activations' bytes over PCIe, where no GPU measurement is found: the model's two PCIe transfers
#: (x to the host, the sum back) at :data:`PCIE_LATENCY_S` each, as every projection before
#: ``--product-overhead-us`` charged. The one real GPU run (an H200, a toy model) measured ~2 ms.
DEFAULT_PRODUCT_OVERHEAD_US = 2 * PCIE_LATENCY_S * 1e6
#: the per-product overheads the chosen plan is also projected at, so that a reader sees how much it
#: depends on that figure (from the constant to the order of the one GPU measurement)
SENSITIVITY_US = (10.0, 100.0, 1000.0)
#: products with a residual per split layer: q, k, v, o, gate, up, down (dense layers: the presets and
#: the GGUF shapes plan reads); the output head is one more per pass (:func:`hooked_products`)
PRODUCTS_PER_LAYER = 7
#: where a GPU measurement of the per-product overhead is looked for (:func:`measured_product_overhead`):
#: this checkout's bench/results (absent from an installed package) and the user cache's results/
REPO_RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results"
MEASUREMENT_GLOB = "gpu_check*.json"
MEASUREMENT_KEY = "overhead_per_product_us"
#: every constant the projection assumes, stated in its output
CONSTANTS = {"e_ram": E_RAM, "gpu_overhead_bytes": GPU_OVERHEAD, "launch_and_sync_s_per_pass": LAUNCH_S,
             "pcie_latency_s_per_transfer": PCIE_LATENCY_S, "default_product_overhead_us": DEFAULT_PRODUCT_OVERHEAD_US,
             "base_bpw": BASE_BPW, "q8_0_bpw": Q8_BPW, "residual_bpw": RESIDUAL_BPW}


def hooked_products(layers: int, kept: int, compensation: bool = False) -> int:
    """Products completed in add mode per verify pass: :data:`PRODUCTS_PER_LAYER` per split layer (a
    layer kept whole has no residual) and the output head's; with ``compensation`` a layer kept whole
    on the GPU too (its products are observed for their second product)."""
    return (layers - kept) * PRODUCTS_PER_LAYER + 1 + (kept * PRODUCTS_PER_LAYER if compensation else 0)


def check_product_overhead(us: float | None) -> float | None:
    """``--product-overhead-us``: None (find one) or a finite number of microseconds, 0 or more."""
    if us is not None and not (isinstance(us, (int, float)) and math.isfinite(us) and us >= 0):
        raise InvalidOptionError(f"--product-overhead-us: {us} must be a finite number of microseconds, 0 or more")
    return us


def measurement_dirs() -> list[Path]:
    """Where :func:`measured_product_overhead` looks: this checkout's ``bench/results`` and
    ``<cache>/results`` (:func:`bitsplit_llama.cache.cache_dir`)."""
    from ..cache import cache_dir

    return [REPO_RESULTS, cache_dir() / "results"]


def _find_key(obj, key: str):
    """The first value of ``key`` in a JSON document, at any depth (gpu_check's JSON nests its parts)."""
    if isinstance(obj, dict):
        if key in obj:
            return obj[key]
        obj = list(obj.values())
    if isinstance(obj, list):
        for v in obj:
            found = _find_key(v, key)
            if found is not None:
                return found
    return None


def measured_product_overhead() -> tuple[float, Path] | None:
    """(µs per hooked product, file) from the newest ``gpu_check*.json`` under :func:`measurement_dirs`
    (by modification time) whose JSON (the whole file, or its last line: gpu_check prints logs
    before it) holds :data:`MEASUREMENT_KEY` as a finite number, 0 or more; None where none does."""
    import json

    files = [f for d in measurement_dirs() if d.is_dir() for f in d.glob(MEASUREMENT_GLOB) if f.is_file()]
    for f in sorted(files, key=lambda f: f.stat().st_mtime, reverse=True):
        try:
            text = f.read_text()
            try:
                doc = json.loads(text)
            except ValueError:
                doc = json.loads(text.strip().splitlines()[-1])
        except (OSError, ValueError, IndexError):  # not a measurement: the next one
            continue
        v = _find_key(doc, MEASUREMENT_KEY)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0:
            return float(v), f
    return None


def product_overhead(us: float | None) -> tuple[float, str]:
    """(µs per hooked product, where it came from): given, else the last GPU measurement found
    (:func:`measured_product_overhead`), else :data:`DEFAULT_PRODUCT_OVERHEAD_US`."""
    if check_product_overhead(us) is not None:
        return float(us), "given"
    found = measured_product_overhead()
    if found is not None:
        return found[0], f"measured: {found[1]}"
    return DEFAULT_PRODUCT_OVERHEAD_US, (f"default: no GPU measurement found; 2 PCIe transfers x "
                                         f"{1e6 * PCIE_LATENCY_S:g} us")


def _constants_text() -> str:
    return (f"a streaming pass reaches {E_RAM:g} of RAM bandwidth; {GPU_OVERHEAD / 1e9:g} GB of VRAM for the runtime "
            f"and compute buffers; {1000 * LAUNCH_S:g} ms launch and sync per GPU pass; a hooked product's overhead "
            f"as above; base q2_k {BASE_BPW:g} bpw (others at their types' "
            f"rates), Q8_0 {Q8_BPW:g} bpw, residual "
            + ", ".join(f"{k} {v:g}" for k, v in RESIDUAL_BPW.items()) + " bpw (the base as on real splits, residuals at their types' rates)")


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


LOOKUP = "token_embd.weight"


def _lookup_weights(model: str) -> float:
    """Weights of the token embedding where it is only looked up (a row per token: the model has an
    output head of its own), which a pass does not read; 0 where it is also the output head."""
    p = Path(model)
    if p.is_file():
        from ..formats.gguf_file import GGUFFile

        with GGUFFile(p, role="model") as g:
            names = {t.name: t for t in g.tensors}
        return float(names[LOOKUP].n_elements) if LOOKUP in names and "output.weight" in names else 0.0
    if model in PRESETS:  # the presets count an embedding and an output head
        L, E, F, H, KV, V = PRESETS[model]
        return float(V * E)
    return 0.0


def _split_bytes(model: str) -> tuple[str, float, float] | None:
    """(base.gguf path, base tensor bytes, residual tensor bytes) of a split directory, else None;
    without the token embedding where it is only looked up (:func:`_lookup_weights`)."""
    p = Path(model)
    if not p.is_dir():
        return None
    from ..formats.gguf_file import GGUFFile
    from ..formats.modeldir import split_paths

    base_p, res_p = split_paths(p)
    with GGUFFile(base_p, role="base") as b, GGUFFile(res_p, role="residual") as r:
        skip = LOOKUP if any(t.name == "output.weight" for t in b.tensors) else None
        return (str(base_p), float(sum(t.nbytes for t in b.tensors if t.name != skip)),
                float(sum(t.nbytes for t in r.tensors if t.name != skip)))


def _with_base_rate_per_core(profile: dict | None, batch: int, why: str = "") -> tuple[float, str]:
    """(W2 + R) weights/s one core computes here at ``batch`` columns (the machine profile's
    measured batches, :func:`.machine.rate_at`); the residual-only rate where the profile has none."""
    rows = (profile or {}).get("with_base") or []
    if not rows:
        return _residual_rate_per_core(profile, batch, why)
    from .machine import rate_at

    rate, where = rate_at(rows, batch)
    fams = "/".join(sorted({r["family"] for r in rows}))
    return rate, f"measured here: machine profile, W2 + R ({fams}, {where}, {profile['threads']} threads)"


def _draft_rate_per_core(profile: dict | None, rows: int) -> tuple[float | None, str]:
    """Weights/s one core drafts at ``rows`` columns, from the machine profile: the native drafter's
    rate where a CPU-only run drafts with it (its family measured at that many columns or fewer),
    else llama.cpp's kernel on the Q2_K base; (None, why) where neither was measured."""
    from .machine import rate_at

    native = (profile or {}).get("native_draft") or []
    if any(r["batch"] <= rows for r in native):
        rate, where = rate_at(native, rows)
        return rate, (f"measured here: machine profile, native drafter {native[0]['family']} on Q2_K ({where}, "
                      f"{profile['threads']} threads)")
    d_rows = (profile or {}).get("ggml_base") or []
    if d_rows:
        rate, where = rate_at(d_rows, rows)
        return rate, f"measured here: machine profile, ggml on Q2_K ({where}, {profile['threads']} threads)"
    return None, "not measured (the base's bytes at the streaming rate)"


def make_cpu_plan(model: str | os.PathLike[str], *, ram_bw: float | None = None, residual: str = "q6_k",
                  tokens_per_verify: float | None = None, rounds: float | None = None, cores: int | None = None,
                  verify_rows: int = DEFAULT_VERIFY_ROWS, acceptance_source: str = "given", measure: bool = True,
                  bandwidth_now: float | None = None, log=None) -> dict:
    """The cost model with no GPU: every pass streams its weights from RAM on this CPU (``--gpu
    none``). A split directory gives the real base and residual bytes and, with ``measure``, the
    products of a drafter and a verify pass timed on its own tensors (:func:`.measure.measure_split`:
    their shapes and types, which the machine profile's synthetic tensors do not have), with the RAM
    bandwidth measured beside them (``bandwidth_now``, bytes/s: one measured already, so that every
    tree size of a plan is projected against the same figure)."""
    if ram_bw is not None and not ram_bw > 0:
        raise InvalidOptionError(f"--ram-bandwidth: {ram_bw} must be a positive number")
    a_src = r_src = acceptance_source
    if residual == "auto":  # a split directory's own files decide; else the smallest type measured within Q8_0's KL
        residual = next(iter(residuals_within("q2_k", 1.0)), "q6_k")
    if residual not in RESIDUAL_BPW:
        raise InvalidOptionError(f"--residual: '{residual}' unknown (expected auto or one of: {', '.join(RESIDUAL_BPW)})")
    split = _split_bytes(str(model))
    name, (L, E, F, H, KV, V), n_params = _shape_from(split[0] if split else str(model))
    # what a pass multiplies (and stock Q8_0 reads per token): not the embedding's rows looked up
    n_params -= _lookup_weights(split[0] if split else str(model))
    if split:
        name = Path(model).name
    cores = cores or os.cpu_count() or 1
    profile, why = _machine(log)
    if rounds is None:
        rounds, r_src = 5, "default"
    # a drafter pass: the rows it drafts (the tree's nodes over its passes)
    draft_rows = max(1, round((verify_rows - 1) / max(rounds, 1.0)))
    measured = None
    if split and measure:
        from .measure import measure_split

        measured = measure_split(Path(model), draft_rows=draft_rows, verify_rows=verify_rows, bandwidth=bandwidth_now,
                                 log=log)
    if ram_bw is None and measured is not None:  # the same moment as the products (a shared machine's load)
        ram_bw, ram_src = measured["memory_bandwidth_gb_s"], "measured now, with this split's products"
    else:
        ram_bw, ram_src = _ram_bandwidth(ram_bw, profile)
    GB = 1e9
    q8 = n_params * Q8_BPW / 8
    if split:
        base, res, size_src = split[1], split[2], "the split's files"
    else:
        base, res, size_src = n_params * BASE_BPW / 8, n_params * RESIDUAL_BPW[residual] / 8, "bits per weight assumed"
    stream = ram_bw * GB * E_RAM
    t_q8 = q8 / stream
    # a drafter pass: the base's bytes, or the drafter's products if slower; a verify pass likewise
    if measured is not None:  # this split's own products, timed on its threads, scaled to the cores planned
        scale = measured["threads"] / cores
        t_draft = max(base / stream, measured["draft_s"] * scale)
        d_core = n_params / (cores * measured["draft_s"] * scale)
        d_src = (f"measured now on this split's tensors: {measured['draft_products']}, {1000 * measured['draft_s']:.1f} ms "
                 f"on {measured['threads']} threads")
        t_verify = max((base + res) / stream, measured["verify_s"] * scale)
        w_core = n_params / (cores * measured["verify_s"] * scale)
        w_src = f"measured now on this split's tensors: {1000 * measured['verify_s']:.1f} ms on {measured['threads']} threads"
    else:
        d_core, d_src = _draft_rate_per_core(profile, draft_rows)
        t_draft = max(base / stream, n_params / (cores * d_core)) if d_core else base / stream
        w_core, w_src = _with_base_rate_per_core(profile, verify_rows, why)
        t_verify = max((base + res) / stream, n_params / (cores * w_core))
    if tokens_per_verify is None:
        tokens_per_verify, a_src = 4.0, DEFAULT_TREE_SOURCE
    tps = tokens_per_verify / (rounds * t_draft + t_verify)
    out = {
        "model": name, "gpu": "none", "n_params": n_params, "n_params_counts": "the weights a pass multiplies (not "
        "an embedding only looked up)", "ram_bandwidth_gb_s": round(ram_bw, 1),
        "ram_bandwidth_source": ram_src, "e_ram": E_RAM, "cores": cores, "sizes_from": size_src,
        "q8_0": {"size_gb": round(q8 / GB, 2), "seconds_per_token": round(t_q8, 4), "tokens_per_second": round(1 / t_q8, 2)},
        "bitsplit": {"base_gb": round(base / GB, 2), "residual_ram_gb": round(res / GB, 2),
                     "draft_pass_s": round(t_draft, 4), "draft_rows": draft_rows, "draft_rate_per_core": d_core,
                     "draft_rate_source": d_src, "verify_pass_s": round(t_verify, 4), "rounds": rounds,
                     "measured_products": measured,
                     "rounds_source": r_src, "tokens_per_verify": tokens_per_verify, "tokens_per_verify_source": a_src,
                     "verify_rate_per_core": w_core, "verify_rate_source": w_src, "verify_rows": verify_rows,
                     "tokens_per_second": round(tps, 2)},
        "projected_speedup": round(tps * t_q8, 2),
        "projection": True,
    }
    out["text"] = "\n".join([
        f"PROJECTION (a cost model, not a measurement) for {name}, {n_params / 1e9:.2f} B parameters multiplied per "
        "token (the embedding is looked up), no GPU:",
        f"  RAM {ram_bw:.1f} GB/s ({ram_src}), a streaming pass reaching {E_RAM:g} of it, {cores} CPU cores",
        f"  stock Q8_0: {q8 / GB:.2f} GB per token -> {1 / t_q8:.2f} tokens/s",
        f"  bitsplit: base {base / GB:.2f} GB + residual {res / GB:.2f} GB ({size_src}); draft pass {1000 * t_draft:.1f} ms "
        f"({draft_rows} rows; " + (f"{d_core / 1e9:.2f} G weights/s per core, " if d_core else "") + f"{d_src}), "
        f"verify pass {1000 * t_verify:.1f} ms ({verify_rows} rows; {w_core / 1e9:.2f} G weights/s per core, {w_src})",
        f"    {rounds:g} drafter passes per cycle ({r_src}), {tokens_per_verify:g} tokens/verify ({a_src})",
        f"    -> {tps:.2f} tokens/s, {tps * t_q8:.2f}x stock Q8_0",
        f"  assumed: a streaming pass reaches {E_RAM:g} of RAM bandwidth",
    ])
    out["constants"] = {"e_ram": E_RAM}
    return out


def _ram_bandwidth(ram_bw: float | None, profile: dict | None) -> tuple[float, str]:
    if ram_bw is not None:
        return ram_bw, "given"
    if profile is not None:
        return float(profile["memory_bandwidth_gb_s"]), "measured here"
    from .bench import memory_bandwidth
    from ..runtime.llamacpp import default_threads

    return memory_bandwidth(default_threads()) / 1e9, "measured here"


def make_plan(model: str | os.PathLike[str], *, vram_gb: float, gpu_bw: float = 1000.0, pcie: float = 25.0,
              ram_bw: float | None = None, residual: str = "q6_k", n_ctx: int = 8192,
              tokens_per_verify: float | None = None, rounds: int | None = None, cores: int | None = None,
              verify_rows: int = DEFAULT_VERIFY_ROWS, keep_layers: int | None = None, base_type: str = "q2_k",
              acceptance_source: str = "given", ram_gb: float | None = None,
              product_overhead_us: float | None = None, compensation: bool = True, log=None) -> dict:
    """``compensation`` (``run``'s default with the base on a device): the device computes each of its
    verify products twice (the second with the rounding's error, native/compensate.c), so a verify
    pass reads the GPU's weights twice, moves each product's activations twice more over PCIe, and
    hooks the products of whole layers too.
    ``keep_layers``: at most this many whole layers (None: as many as fit, 0: none); ``base_type``:
    the base's type (``split --base``); ``product_overhead_us``: each hooked product's fixed cost per
    verify pass beyond its bytes over PCIe (None: the last GPU measurement found, else the default:
    :func:`product_overhead`). The JSON adds ``overhead_sensitivity``: the chosen placement projected
    at each of :data:`SENSITIVITY_US` instead."""
    if base_type not in BASE_TYPE_BPW:
        raise InvalidOptionError(f"--base: '{base_type}' unknown (expected one of: {', '.join(BASE_TYPE_BPW)})")
    if keep_layers is not None and keep_layers < 0:
        raise InvalidOptionError(f"--keep-layers: {keep_layers} is negative")
    for name, v in (("--vram", vram_gb), ("--gpu-bandwidth", gpu_bw), ("--pcie", pcie)):
        if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
            raise InvalidOptionError(f"{name}: {v} must be a positive number")
    if ram_bw is not None and not ram_bw > 0:
        raise InvalidOptionError(f"--ram-bandwidth: {ram_bw} must be a positive number")
    if residual not in RESIDUAL_BPW:
        raise InvalidOptionError(f"--residual: '{residual}' unknown (expected one of: {', '.join(RESIDUAL_BPW)})")
    if n_ctx < 1:
        raise InvalidOptionError(f"--n-ctx: {n_ctx} is not positive")
    if ram_gb is not None and not (math.isfinite(ram_gb) and ram_gb > 0):
        raise InvalidOptionError(f"--ram: {ram_gb} must be a positive number")
    overhead_us, overhead_src = product_overhead(product_overhead_us)
    name, (L, E, F, H, KV, V), n_params = _shape_from(str(model))
    cores = cores or os.cpu_count() or 1
    profile, why = _machine(log)
    ram_bw, ram_src = _ram_bandwidth(ram_bw, profile)
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
    # bitsplit: the base on the GPU (as much as fits); then, if it all fits, whole layers (Q8_0, no
    # residual) in the memory left, each costing what it adds over its base form (as split --vram).
    # A whole layer saves residual and PCIe time per verification but makes every draft pass read
    # more: the number kept is the one (up to what fits, or --keep-layers) with the best tokens/s.
    base = n_params * BASE_TYPE_BPW[base_type] / 8
    res_all = n_params * RESIDUAL_BPW[residual] / 8
    per_layer_base = base / L + kv_bytes / L
    ngl_b = max(0, min(L, int(vram // per_layer_base)))
    fit = 0
    if ngl_b == L:
        spare = vram - base - kv_bytes
        step = (q8 - base) / L
        fit = max(0, min(L, int(spare // step))) if step > 0 else L
    if keep_layers is not None:
        fit = min(fit, keep_layers)
    w_core, w_src = _residual_rate_per_core(profile, verify_rows, why)
    act_bytes = sum((E + E) for _ in range(4)) + (E + F) * 2 + (F + E)  # q,k,v,o + gate,up + down, per row
    a_src = acceptance_source
    if tokens_per_verify is None:
        tokens_per_verify, a_src = 4.0, DEFAULT_TREE_SOURCE
    rounds = rounds or 5

    def project(kept: int, overhead_us: float = overhead_us) -> dict:
        split_share = (L - kept) / L
        gpu_bytes = base + kept * (q8 - base) / L
        base_gpu = gpu_bytes * ngl_b / L
        base_cpu = gpu_bytes - base_gpu
        t_base = base_gpu / (gpu_bw * GB) + base_cpu / (ram_bw * GB * E_RAM)
        res = res_all * split_share
        t_res = max(res / (ram_bw * GB * E_RAM), n_params * split_share / (cores * w_core))
        # the callback synchronises at every hooked product: its fixed cost, then the activations'
        # bytes (f32, to the host and back) over PCIe; drafter passes hook nothing
        hooks = hooked_products(L, kept, compensation)
        # compensation: the layers on the GPU (whole ones too) computed twice, e up and W2 . e down
        dev_layers = (ngl_b if kept == 0 else L) if compensation else 0
        t_comp = base_gpu / (gpu_bw * GB) + dev_layers * act_bytes * 4 * verify_rows * 2 / (pcie * GB)
        t_comp = t_comp if compensation else 0.0
        t_sync = hooks * overhead_us * 1e-6
        t_pcie = t_sync + (L - kept) * act_bytes * 4 * verify_rows * 2 / (pcie * GB)
        t_draft = t_base + LAUNCH_S
        t_verify = t_base + t_res + t_pcie + t_comp + LAUNCH_S
        return dict(kept=kept, gpu_bytes=gpu_bytes, base_cpu=base_cpu, res=res, t_res=t_res, t_pcie=t_pcie,
                    hooks=hooks, t_sync=t_sync, t_draft=t_draft, t_verify=t_verify, t_comp=t_comp,
                    tps=tokens_per_verify / (rounds * t_draft + t_verify))

    # what stays in RAM: the residual and the base's layers the GPU does not hold (with --ram, a
    # placement that needs more than it is not chosen while one that fits exists)
    placements = [project(k) for k in range(fit + 1)]
    fitting = [p for p in placements if ram_gb is None or (p["res"] + p["base_cpu"]) <= ram_gb * GB]
    best = max(fitting or placements, key=lambda p: p["tps"])
    kept, gpu_bytes, base_cpu, res = best["kept"], best["gpu_bytes"], best["base_cpu"], best["res"]
    t_res, t_pcie, t_draft, t_verify, tps = (best[k] for k in ("t_res", "t_pcie", "t_draft", "t_verify", "tps"))
    hooks, t_sync = best["hooks"], best["t_sync"]
    tps_q8 = 1 / t_q8
    # this placement (not re-chosen) at other per-product overheads: how much the projection rests on it
    sensitivity = []
    for us in SENSITIVITY_US:
        o = project(kept, us)
        sensitivity.append({"product_overhead_us": us, "hooked_products": hooks,
                            "overhead_per_pass_ms": round(1000 * o["t_sync"], 3),
                            "tokens_per_second": round(o["tps"], 2), "speedup": round(o["tps"] / tps_q8, 2)})
    out = {
        "model": name, "n_params": n_params, "vram_gb": vram_gb, "gpu_bandwidth_gb_s": gpu_bw, "pcie_gb_s": pcie,
        "ram_bandwidth_gb_s": round(ram_bw, 1), "ram_bandwidth_source": ram_src, "residual": residual,
        "n_ctx": n_ctx, "kv_cache_gb": round(kv_bytes / GB, 2),
        "q8_0": {"size_gb": round(q8 / GB, 1), "gpu_layers": ngl, "layers": L, "gpu_gb": round(q8_gpu / GB, 1),
                 "cpu_gb": round(q8_cpu / GB, 1), "seconds_per_token": round(t_q8, 4), "tokens_per_second": round(tps_q8, 2)},
        "placement": {"layers": L, "kept_whole": kept, "split": L - kept},
        "base_type": base_type,
        "split_command": (f"bitsplit split SRC.gguf -o SPLIT --residual {residual}"
                          + (f" --base {base_type} --imatrix auto" if base_type != "q2_k" else "")
                          + (f" --vram {vram_gb:g} --n-ctx {n_ctx}" if kept else "")),
        "bitsplit": {"base_gb": round(gpu_bytes / GB, 1), "base_gpu_layers": ngl_b, "base_cpu_gb": round(base_cpu / GB, 1),
                     "residual_ram_gb": round(res / GB, 1), "draft_pass_s": round(t_draft, 4),
                     "verify_pass_s": round(t_verify, 4), "residual_s": round(t_res, 4), "pcie_s": round(t_pcie, 4),
                     "hooked_products": hooks, "product_overhead_s": round(t_sync, 4),
                     "compensation": compensation, "compensation_s": round(best["t_comp"], 4),
                     "rounds": rounds, "tokens_per_verify": tokens_per_verify, "tokens_per_verify_source": a_src,
                     "verify_rows": verify_rows, "residual_rate_per_core": w_core, "residual_rate_source": w_src, "cores": cores,
                     "tokens_per_second": round(tps, 2)},
        "projected_speedup": round(tps / tps_q8, 2),
        "product_overhead_us": overhead_us, "product_overhead_source": overhead_src,
        "overhead_sensitivity": sensitivity,
        "projection": True,
    }
    ram_need = res + base_cpu
    out["ram"] = {"needed_gb": round(ram_need / GB, 1), "q8_0_needed_gb": round(q8_cpu / GB, 1),
                  "given_gb": ram_gb, "fits": None if ram_gb is None else ram_need <= ram_gb * GB}
    fits = "fits" if ngl_b == L else f"does not fit: {ngl_b}/{L} base layers on the GPU, {base_cpu / GB:.1f} GB on the CPU"
    if kept:
        fits += f"; {kept} of {L} layers whole (Q8_0, no residual) in the memory left"
    out["text"] = "\n".join([
        f"PROJECTION (a cost model, not a measurement) for {name}, {n_params / 1e9:.1f} B parameters, n_ctx {n_ctx}:",
        f"  GPU {vram_gb:g} GB at {gpu_bw:g} GB/s, PCIe {pcie:g} GB/s, RAM {ram_bw:.1f} GB/s ({ram_src}), {cores} CPU cores",
        f"  stock Q8_0: {q8 / GB:.1f} GB; -ngl {ngl}/{L} ({q8_gpu / GB:.1f} GB on the GPU, {q8_cpu / GB:.1f} GB in RAM)"
        f" -> {tps_q8:.2f} tokens/s",
        f"  bitsplit: base ({base_type}) {gpu_bytes / GB:.1f} GB on the GPU ({fits}) + KV {kv_bytes / GB:.1f} GB; residual "
        f"{res / GB:.1f} GB ({residual}) in RAM",
        f"    draft pass {1000 * t_draft:.1f} ms, verify pass {1000 * t_verify:.1f} ms (residual {1000 * t_res:.1f} ms, "
        f"PCIe and sync {1000 * t_pcie:.1f} ms), {rounds} drafter passes per cycle, {tokens_per_verify:g} tokens/verify ({a_src})",
        f"    overhead per hooked product: {overhead_us:g} us ({overhead_src}); {hooks} hooked products per verify "
        f"pass: {1000 * t_sync:.1f} ms",
        (f"    the GPU's rounding compensated (second products on it, their activations over PCIe): "
         f"{1000 * best['t_comp']:.1f} ms per verify pass" if compensation else
         "    the GPU's rounding not compensated (--no-compensation)"),
        f"    -> {tps:.2f} tokens/s, {tps / tps_q8:.2f}x stock Q8_0",
        f"  RAM: bitsplit holds {ram_need / GB:.1f} GB there (residual and base layers off the GPU), stock Q8_0 "
        f"{q8_cpu / GB:.1f} GB, besides the OS: " + ("not checked (give --ram GB)" if ram_gb is None else
                                                    f"{'fits' if ram_need <= ram_gb * GB else 'DOES NOT FIT'} "
                                                    f"--ram {ram_gb:g}"),
        f"  residual compute: {w_core / 1e9:.2f} G weights/s per core, {w_src}",
        f"  make it: {out['split_command']}",
        "  assumed: " + _constants_text(),
    ])
    out["constants"] = CONSTANTS
    return out


#: ``--gpu none`` with no acceptance given: chains of 1-4 nodes at this per-node acceptance, and the
#: 16-node tree's default figures (4 tokens per verification in 5 drafter passes). Qwen2.5-Coder-1.5B's
#: drafter had its first candidate taken at 84-86% of verified nodes in the auto tree's calibrations
#: on the 2-core machines here, where a 1- or 2-node chain is what runs (the auto tree's choice; a
#: 16-node tree alone projected 0.30x stock Q8_0 where bench measured 1.0x with the chain).
DEFAULT_ACCEPT = 0.85
DEFAULT_SIZES_SOURCE = (f"assumed: {DEFAULT_ACCEPT:g} per chain node, 4 per verify at 16 nodes; "
                        "`bitsplit profile` measures them")


def default_profile() -> dict:
    """The tree sizes a plan with no acceptance given compares (:data:`DEFAULT_ACCEPT`), in the
    form of an acceptance profile (``bitsplit profile``'s rows)."""
    rows = [{"nodes": n, "width": 1, "rounds": n, "draft_passes_per_cycle": float(n),
             "tokens_per_verify": round(sum(DEFAULT_ACCEPT ** k for k in range(n + 1)), 4)} for n in (1, 2, 3, 4)]
    rows.append({"nodes": 16, "width": 4, "rounds": 7, "draft_passes_per_cycle": 5.0, "tokens_per_verify": 4.0})
    return {"profile": rows}


def plan_with_profile(make, prof: dict, source: str, *, measured: bool = True, **kw) -> dict:
    """``make`` (:func:`make_plan` or :func:`make_cpu_plan`) for every tree size of an acceptance
    profile (``bitsplit profile``): its measured tokens per verification and drafter passes per
    cycle, a verification of nodes + 1 rows; the size with the best projected speedup is the plan,
    and the JSON lists them all (``tree_sizes``). ``measured=False``: the figures are assumptions
    (:func:`default_profile`), ``source`` says which."""
    from ..formats.profile import profile_rows

    rows = [r for r in prof["profile"] if int(r["nodes"]) > 0]
    if not rows:
        raise InputError(f"{source}: the profile has no tree size above 0 nodes")
    what = "acceptance profile " if measured else ""
    plans = []
    for r in rows:
        p = make(tokens_per_verify=float(r["tokens_per_verify"]), rounds=max(float(r["draft_passes_per_cycle"]), 1.0),
                 verify_rows=profile_rows(r), acceptance_source=f"{what}{source}, {r['nodes']} nodes", **kw)
        p["bitsplit"]["text_nodes"] = int(r.get("text", 0))
        plans.append((int(r["nodes"]), p))
    nodes, best = max(plans, key=lambda np_: np_[1]["projected_speedup"])
    src = (f"{what}{source} ({nodes}-node tree, the best of {len(plans)} sizes"
           + (" measured)" if measured else ")"))
    best["bitsplit"]["tokens_per_verify_source"] = src
    best["bitsplit"]["rounds_source"] = src
    best["tree_nodes"] = nodes
    best["tree_sizes"] = [{"nodes": n, "text_nodes": p["bitsplit"]["text_nodes"],
                           "tokens_per_verify": p["bitsplit"]["tokens_per_verify"], "rounds": p["bitsplit"]["rounds"],
                           "verify_rows": p["bitsplit"]["verify_rows"],
                           "projected_speedup": p["projected_speedup"]} for n, p in plans]
    text = best["bitsplit"]["text_nodes"]
    best["text"] = (best["text"].replace(f"{what}{source}, {nodes} nodes", src) + "\n  tree sizes"
                    + (f" (each with up to {text} nodes from the text)" if text else "") + ": "
                    + ", ".join(f"{n}: {p['projected_speedup']:.2f}x" for n, p in plans))
    return best


def _profile_plans(make, prof: dict | None, source: str | None, tokens_per_verify, rounds, verify_rows) -> dict:
    if prof is not None:
        return plan_with_profile(make, prof, source)
    return make(tokens_per_verify=tokens_per_verify, rounds=rounds, verify_rows=verify_rows)


def choose_plan(model: str | os.PathLike[str], *, base_type: str = "auto", residual: str = "auto",
                profiles: list[tuple[dict, str, str | None]] = (), max_kl: float = 1.0,
                tokens_per_verify: float | None = None, rounds: float | None = None, verify_rows: int = DEFAULT_VERIFY_ROWS,
                **kw) -> dict:
    """:func:`make_plan` for every base and residual type in play, the best projection kept.

    Residuals: the one given, or with ``auto`` each type whose verifier KL was measured within
    ``max_kl`` times stock Q8_0's with that base (:data:`FIDELITY_VS_Q8`). Bases: the one given, or
    with ``auto`` the base type of each acceptance profile given (each planned with its own
    profile: a base's acceptance is measured, not assumed), q2_k where none is given. ``profiles``:
    (profile, where it came from, its base type or None). The JSON adds ``choices`` (every pair
    planned, with its fidelity) and ``fidelity`` (the chosen pair's)."""
    if not (isinstance(max_kl, (int, float)) and math.isfinite(max_kl) and max_kl > 0):
        raise InvalidOptionError(f"--max-kl: {max_kl} must be a positive number")
    if base_type != "auto" and base_type not in BASE_TYPE_BPW:
        raise InvalidOptionError(f"--base: '{base_type}' unknown (expected auto or one of: {', '.join(BASE_TYPE_BPW)})")
    if residual != "auto" and residual not in RESIDUAL_BPW:
        raise InvalidOptionError(f"--residual: '{residual}' unknown (expected auto or one of: {', '.join(RESIDUAL_BPW)})")
    typed = [(p, src, bt or "q2_k", bt is None) for p, src, bt in profiles]
    if base_type == "auto":
        bases = sorted({bt for _, _, bt, _ in typed}, key=list(BASE_TYPE_BPW).index) or ["q2_k"]
    else:
        bases = [base_type]
    plans, skipped = [], []
    for b in bases:
        mine = [t for t in typed if t[2] == b]
        if not mine and base_type != "auto" and len(typed) == 1:
            mine = typed  # one profile given for an explicit base: it stands in (the text says so)
        prof, src = (mine[0][0], mine[0][1]) if mine else (None, None)
        if prof is not None and mine[0][2] != b:
            src = f"{src} (measured with a {mine[0][2]} base, standing in for {b})"
        elif prof is not None and mine[0][3]:
            src = f"{src} (its base type not recorded: taken as q2_k)"
        if residual == "auto":
            res = residuals_within(b, max_kl)
            if not res:
                skipped.append(b)
                continue
        else:
            res = [residual]
        for r in res:
            make = partial(make_plan, model, base_type=b, residual=r, **kw)
            p = _profile_plans(make, prof, src, tokens_per_verify, rounds, verify_rows)
            kl = FIDELITY_VS_Q8.get((b, r))
            p["fidelity"] = {"kl_vs_q8_0": kl, "max_kl_vs_q8_0": max_kl, "within": kl is not None and kl <= max_kl,
                             "source": FIDELITY_SOURCE if kl is not None else "not measured"}
            plans.append(p)
    if plans and kw.get("ram_gb") is not None:
        fitting = [p for p in plans if p["ram"]["fits"]]
        if not fitting:
            least = min(plans, key=lambda p: p["ram"]["needed_gb"])
            raise InputError(f"--ram {kw['ram_gb']:g}: no plan fits; the smallest needs {least['ram']['needed_gb']:g} GB "
                             f"of RAM (base {least['base_type']}, residual {least['residual']})")
        plans = fitting
    if not plans:
        raise InvalidOptionError(f"--residual auto: no residual type was measured within {max_kl:g}x stock Q8_0's KL "
                                 f"with base {', '.join(skipped)} (measured: "
                                 + ", ".join(f"{b}+{r} {v:g}x" for (b, r), v in FIDELITY_VS_Q8.items()) + ")")
    best = max(plans, key=lambda p: (p["bitsplit"]["tokens_per_second"], -RESIDUAL_BPW[p["residual"]]))
    best["choices"] = [{"base_type": p["base_type"], "residual": p["residual"],
                        "kl_vs_q8_0": p["fidelity"]["kl_vs_q8_0"], "tree_nodes": p.get("tree_nodes"),
                        "kept_whole": p["placement"]["kept_whole"], "ram_needed_gb": p["ram"]["needed_gb"],
                        "tokens_per_second": p["bitsplit"]["tokens_per_second"],
                        "projected_speedup": p["projected_speedup"]} for p in plans]
    lines, chosen = [], plans.index(best)
    for i, c in enumerate(best["choices"]):
        kl = "KL not measured" if c["kl_vs_q8_0"] is None else f"KL {c['kl_vs_q8_0']:g}x stock Q8_0's"
        tree = f", {c['tree_nodes']} nodes" if c["tree_nodes"] is not None else ""
        lines.append(f"    base {c['base_type']}, residual {c['residual']} ({kl}){tree}, {c['kept_whole']} layers whole: "
                     f"{c['projected_speedup']:.2f}x" + ("  <- chosen" if i == chosen else ""))
    fid = best["fidelity"]
    warn = ""
    if not fid["within"]:
        warn = ("\n  WARNING: " + (f"residual {best['residual']} with base {best['base_type']} measured at "
                                   f"{fid['kl_vs_q8_0']:g}x stock Q8_0's KL, above {max_kl:g}x"
                                   if fid["kl_vs_q8_0"] is not None else
                                   f"the fidelity of residual {best['residual']} with base {best['base_type']} was not measured"))
    best["text"] += ("\n  choices (" + ("residual: each measured within " + f"{max_kl:g}x stock Q8_0's KL"
                                        if residual == "auto" else f"residual {residual}")
                     + "; bases: " + ("those with a measured acceptance profile" if base_type == "auto" and typed
                                      else "q2_k (no acceptance profile of another base given)" if base_type == "auto"
                                      else base_type) + "):\n" + "\n".join(lines)
                     + "\n" + sensitivity_text(best)
                     + f"\n  fidelity: {FIDELITY_SOURCE}" + warn)
    return best


def sensitivity_text(p: dict) -> str:
    """The table of a GPU plan's ``overhead_sensitivity``: its choice at other per-product overheads."""
    rows = [("overhead per product", "products per verify pass", "overhead per pass", "tokens/s", "vs stock Q8_0")]
    for r in p["overhead_sensitivity"]:
        us = r["product_overhead_us"]
        rows.append((f"{us / 1000:g} ms" if us >= 1000 else f"{us:g} us", str(r["hooked_products"]),
                     f"{r['overhead_per_pass_ms']:.1f} ms", f"{r['tokens_per_second']:.2f}", f"{r['speedup']:.2f}x"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["    " + "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths)))
             for row in rows]
    return (f"  the choice at other overheads per hooked product (this plan: {p['product_overhead_us']:g} us, "
            f"{p['product_overhead_source']}):\n" + "\n".join(lines))
