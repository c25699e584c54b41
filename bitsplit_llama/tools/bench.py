"""``bitsplit bench``: stock llama.cpp (one GGUF, plain decoding) against bitsplit, side by side.

Each side runs in its own worker process (so each has its own peak RSS and neither disturbs the
other's memory), with the same thread count; the parent sends them the same prompts interleaved
A/B/A/B, one generation at a time, so machine drift cancels. Rates are generation rates: tokens
after the first divided by the time after the first token (prompt processing is excluded on both
sides). The machine's memory bandwidth is measured in the same run (a threaded numpy max-reduce
over 1 GiB) to judge the residual pass.

The stock side is ``llama_cpp.Llama`` as an app would use it (:func:`~bitsplit_llama.runtime.stock.stock_llama`,
prompts fed one token per batch for the reason given there).
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import numpy as np

from ..errors import BitsplitError, InputError, InvalidOptionError, NativeError, OutputError

if TYPE_CHECKING:
    from ..speculative.options import GenerationOptions, SamplingParams

DEFAULT_PROMPTS = [
    "def quicksort(arr):",
    "import numpy as np\n\ndef softmax(x):",
    "class LinkedList:\n    def __init__(self):",
    "# Read a CSV file and print the average of the second column\nimport csv\n",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"",
    "from dataclasses import dataclass\n\n@dataclass\nclass Point:",
    "def is_prime(n: int) -> bool:",
    "The three most important ideas in computer science are",
    "Write a short story about a lighthouse keeper who",
    "Photosynthesis is the process by which",
    "The main differences between TCP and UDP are",
    "Once upon a time, in a village at the edge of the forest,",
]


def memory_bandwidth(threads: int, gib: float = 1.0, repeat: int = 3) -> float:
    """Bytes/s streamed by a threaded numpy max-reduce over an array much larger than the caches."""
    a = np.ones(int(gib * 2**30) // 4, dtype=np.float32)
    parts = np.array_split(a, threads)
    times = []
    with cf.ThreadPoolExecutor(threads) as pool:
        for _ in range(repeat):
            t0 = time.perf_counter()
            list(pool.map(lambda p: float(np.maximum.reduce(p)), parts))
            times.append(time.perf_counter() - t0)
    del a, parts
    return (int(gib * 2**30) // 4 * 4) / min(times)


# -- workers ----------------------------------------------------------------------------------

def _peak_rss() -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    from .._platform import peak_rss

    return peak_rss() or 0  # 0: not measured on this platform


def _worker(cfg: dict) -> None:
    """Serve generation requests (JSON lines on stdin) for one side; answers on stdout. A model that
    cannot be loaded is answered as ``{"ready": false, "error", "type"}`` (the parent raises it)."""
    from ..errors import BitsplitError

    try:
        generate = _load_side(cfg)
    except BitsplitError as exc:
        print(json.dumps({"ready": False, "error": str(exc), "type": type(exc).__name__,
                          "usage": isinstance(exc, InvalidOptionError)}), flush=True)
        return
    print(json.dumps({"ready": True, "rss": _peak_rss()}), flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        if req.get("quit"):
            break
        try:
            n, t0, t1, extra = generate(req)
            rate = (n - 1) / (t1 - t0) if n > 1 and t1 > t0 else 0.0
            out = {"n": n, "seconds": (t1 - t0) if n > 1 else 0.0, "rate": rate, "extra": extra, "rss": _peak_rss()}
        except Exception as exc:  # reported to the parent, which raises it with context
            out = {"error": f"{type(exc).__name__}: {exc}"}
        print(json.dumps(out), flush=True)


def _load_side(cfg: dict) -> Callable[[dict], tuple]:
    """Load one side's model; returns generate(request) -> (tokens, first token time, last token
    time, statistics)."""
    if cfg.get("parent"):
        from .._platform import die_with_parent

        die_with_parent(int(cfg["parent"]))  # no orphan worker if the bench is killed while it loads
    if cfg["side"] == "stock":
        from ..runtime.stock import stock_llama

        n_ctx, threads = int(cfg["n_ctx"]), int(cfg["threads"])
        llm = stock_llama(cfg["path"], n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads)

        def generate(req):
            t_first = t_last = None
            n = 0
            sp = req["sampling"]
            for chunk in llm.create_completion(req["prompt"], max_tokens=req["n"], temperature=sp["temperature"],
                                               top_k=sp["top_k"], top_p=sp["top_p"], min_p=sp["min_p"],
                                               seed=req["seed"], stream=True):
                now = time.perf_counter()
                if chunk["choices"][0]["text"] or chunk["choices"][0]["finish_reason"] is None:
                    n += 1
                    if t_first is None:
                        t_first = now
                    t_last = now
            return n, t_first, t_last, {}
    else:
        from ..speculative.generate import Generator
        from ..speculative.options import GenerationOptions, SamplingParams

        gen = Generator(cfg["path"], GenerationOptions.from_json(cfg["options"]))

        def generate(req):
            sp = SamplingParams(**{**req["sampling"], "seed": req["seed"]})
            t_first = t_last = None
            n = 0
            res = []
            c0, p0 = gen.sm.residual.counters(), gen.sm.n_verify_passes
            d0 = c0.n_draft_products  # this request's own (not calibration's)
            for _, toks in gen.stream(req["prompt"], max_tokens=req["n"], sampling=sp, on_finish=res.append,
                                      speculative=req.get("speculative", True)):
                now = time.perf_counter()
                if toks:
                    n += len(toks)
                    if t_first is None:
                        t_first = now
                    t_last = now
            st = res[0].stats if res else None
            extra = st.to_json() if st else {}
            extra["kernel"] = gen.kernel
            extra["kernel_policy"] = gen.sm.policy["policy"]  # "measured" (doctor's profile) or "built-in"
            extra["act_bits"] = gen.sm.residual.act_bits  # as "auto" resolved here
            extra["draft_vocab"] = gen.sm.draft_vocab.rows  # as resolved (0: the whole head)
            # what actually ran: a native family only if it took some drafting product (it takes
            # passes from its family's smallest batch on; narrower ones stay with llama.cpp)
            n_draft = gen.sm.residual.counters().n_draft_products - d0
            extra["drafter"] = gen.sm.drafter if n_draft > 0 else "llama.cpp"
            extra["draft_products"] = n_draft
            extra["shape"] = [gen.shape.nodes, gen.shape.width, gen.shape.rounds]
            extra["compensation"] = gen.sm.compensation  # the rule in use with the base on a device, or "off"
            if gen.sm.n_gpu_layers > 0:  # the add mode's cost, per verifier pass of this request
                c1 = gen.sm.residual.counters()
                passes = max(1, gen.sm.n_verify_passes - p0)  # the prompt's passes included
                extra["add_mode"] = {
                    "passes": passes,
                    "products_per_pass": (c1.n_add_products - c0.n_add_products) / passes,
                    "overlapped_per_pass": (c1.n_overlapped - c0.n_overlapped) / passes,
                    "syncs_per_pass": (c1.n_stops - c0.n_stops) / passes,
                    "bytes_from_device_per_pass": (c1.bytes_from_device - c0.bytes_from_device) / passes,
                    "bytes_to_device_per_pass": (c1.bytes_to_device - c0.bytes_to_device) / passes,
                    "transfer_ms_per_pass": 1e3 * (c1.seconds_transfer - c0.seconds_transfer) / passes,
                    "residual_ms_per_pass": 1e3 * (c1.seconds_inside - c0.seconds_inside) / passes,
                    "wait_ms_per_pass": 1e3 * (c1.seconds_wait - c0.seconds_wait) / passes,
                    # the device's rounding corrected by second products on it (native/compensate.c)
                    "compensated_per_pass": (c1.n_compensated - c0.n_compensated) / passes,
                    "compensate_ms_per_pass": 1e3 * (c1.seconds_compensate - c0.seconds_compensate) / passes,
                }
            return n, t_first, t_last, extra
    return generate


class _Side:
    def __init__(self, cfg: dict):
        env = dict(os.environ)
        pkg_root = str(Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = pkg_root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        env.setdefault("OPENBLAS_NUM_THREADS", "1")  # numpy's BLAS threads must not compete
        self.name = cfg["side"]
        cfg = {**cfg, "parent": os.getpid()}
        self.proc = subprocess.Popen([sys.executable, "-m", "bitsplit_llama.tools.bench", "worker", json.dumps(cfg)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, env=env)
        first = self._read()
        if not first.get("ready"):
            self.proc.wait()
            if "error" in first:  # the model could not be loaded: the error it met, as it met it
                cls = InvalidOptionError if first.get("usage") else InputError if first.get("type", "").endswith(
                    ("InputError", "FormatError", "MismatchError", "UnsupportedModelError")) else BitsplitError
                raise cls(first["error"])
            raise NativeError(f"{self.name} worker did not start: {first}")

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            err = self.proc.stderr.read()[-2000:] if self.proc.stderr else ""
            last = [l for l in err.strip().splitlines() if l.strip()][-1:] or ["exited"]
            raise NativeError(f"the {self.name} benchmark worker died: {last[0]}")
        return json.loads(line)

    def run(self, req: dict) -> dict:
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        out = self._read()
        if "error" in out:
            raise NativeError(f"{self.name} side failed: {out['error']}")
        return out

    def close(self) -> None:
        try:
            self.proc.stdin.write(json.dumps({"quit": True}) + "\n")
            self.proc.stdin.flush()
            self.proc.wait(timeout=30)
        except Exception:
            self.proc.kill()
            self.proc.wait()


# -- the comparison ---------------------------------------------------------------------------

@dataclass
class BenchReport:
    model_dir: str
    vs: str
    threads: int
    n_predict: int
    temp: float
    tree_nodes: int | str
    prompts: list[str]
    rates: list[float] = field(default_factory=list)        # bitsplit, per run
    vs_rates: list[float] = field(default_factory=list)     # stock, per run
    per_prompt_ratio: list[float] = field(default_factory=list)
    stats: list[dict] = field(default_factory=list)
    no_spec_rates: list[float] = field(default_factory=list)  # bitsplit's verifier alone, per run (--with-no-spec)
    rss: int = 0
    vs_rss: int = 0
    bandwidth: float = 0.0
    seconds: float = 0.0
    rpc: str | None = None
    overlap: bool = True
    overlap_at: str = "inputs"
    draft_stop: str | float | None = None

    def summary(self) -> dict:
        med = statistics.median(self.rates) if self.rates else 0.0
        vmed = statistics.median(self.vs_rates) if self.vs_rates else 0.0
        tot = {k: sum(s.get(k, 0) for s in self.stats) for k in
               ("n_tokens", "n_verify", "n_draft_passes", "draft_seconds", "verify_seconds", "residual_seconds", "residual_bytes",
                "total_seconds", "prompt_seconds", "draft_decode_seconds", "verify_decode_seconds", "draft_early_stops",
                "n_drafted", "kv_rebuilt_tokens")}
        gen = max(1e-9, tot["total_seconds"] - tot["prompt_seconds"])
        other = gen - tot["draft_seconds"] - tot["verify_seconds"]
        res_bps = tot["residual_bytes"] / tot["residual_seconds"] if tot["residual_seconds"] else 0.0
        last = self.stats[-1] if self.stats else {}
        return {
            "model_dir": self.model_dir, "vs": self.vs, "threads": self.threads, "n_predict": self.n_predict,
            "temp": self.temp, "prompts": len(self.prompts), "runs": len(self.rates),
            "tokens_per_second": round(med, 3), "vs_tokens_per_second": round(vmed, 3),
            "speedup_vs": round(med / vmed, 4) if vmed else 0.0,
            "median_pair_ratio": round(statistics.median(self.per_prompt_ratio), 4) if self.per_prompt_ratio else 0.0,
            "accepted_per_verify": round(tot["n_tokens"] / tot["n_verify"], 4) if tot["n_verify"] else 0.0,
            "draft_passes_per_verify": round(tot["n_draft_passes"] / tot["n_verify"], 4) if tot["n_verify"] else 0.0,
            "drafted_per_verify": round(tot["n_drafted"] / tot["n_verify"], 4) if tot["n_verify"] else 0.0,
            "draft_stop": self.draft_stop, "draft_early_stops": tot["draft_early_stops"],
            "kv_rebuilt_tokens": tot["kv_rebuilt_tokens"],
            "tree_nodes": self.tree_nodes, "tree_shape": last.get("shape"), "kernel": last.get("kernel"),
            "kernel_policy": last.get("kernel_policy"),
            "act_bits": last.get("act_bits"), "drafter": last.get("drafter"),
            "draft_vocab": last.get("draft_vocab"),
            "draft_products": last.get("draft_products", 0),
            "time_split": {"draft": round(tot["draft_seconds"] / gen, 4), "verify": round(tot["verify_seconds"] / gen, 4),
                           "residual": round(tot["residual_seconds"] / gen, 4),
                           "draft_python": round((tot["draft_seconds"] - tot["draft_decode_seconds"]) / gen, 4),
                           "verify_python": round((tot["verify_seconds"] - tot["verify_decode_seconds"]) / gen, 4),
                           "other_python": round(other / gen, 4)},
            "peak_rss_bytes": self.rss, "vs_peak_rss_bytes": self.vs_rss,
            "residual_bytes_per_second": round(res_bps), "memory_bandwidth_bytes_per_second": round(self.bandwidth),
            "residual_bandwidth_use": round(res_bps / self.bandwidth, 4) if self.bandwidth else 0.0,
            "seconds": round(self.seconds, 1),
            **self._no_spec_summary(med, vmed),
            **self._add_mode_summary(),
        }

    def _add_mode_summary(self) -> dict:
        """With --rpc: the base's device and the add mode's cost per verifier pass, medians over runs."""
        runs = [s["add_mode"] for s in self.stats if "add_mode" in s]
        if not runs:
            return {"base_device": "cpu (this process)"}
        return {"base_device": f"rpc {self.rpc}" if self.rpc else "gpu", "overlap": self.overlap,
                "overlap_at": self.overlap_at,
                "compensation": self.stats[-1].get("compensation"),
                "vs_device": "cpu (this process)",
                "add_mode_per_pass": {k: round(statistics.median(r[k] for r in runs), 3) for k in runs[0]}}

    def _no_spec_summary(self, med: float, vmed: float) -> dict:
        if not self.no_spec_rates:
            return {}
        nmed = statistics.median(self.no_spec_rates)
        return {"no_spec_tokens_per_second": round(nmed, 3),
                "speedup_vs_no_spec": round(med / nmed, 4) if nmed else 0.0,
                "no_spec_vs_stock": round(nmed / vmed, 4) if vmed else 0.0}


def load_prompts(path: str | os.PathLike[str] | None) -> list[str]:
    if path is None:
        return list(DEFAULT_PROMPTS)
    p = Path(path)
    if not p.is_file():
        raise InputError(f"{p}: prompts file not found")
    text = p.read_text(encoding="utf-8")
    try:
        data = json.loads(text)
        prompts = [str(x) for x in data] if isinstance(data, list) else None
    except json.JSONDecodeError:
        prompts = None
    if prompts is None:
        prompts = [line for line in text.splitlines() if line.strip()]
    if not prompts:
        raise InputError(f"{p}: no prompts (one per line, or a JSON list of strings)")
    return prompts


def run_bench(model_dir: str | os.PathLike[str], vs: str | os.PathLike[str], options: "GenerationOptions | None" = None,
              *, sampling: "SamplingParams | None" = None, prompts: list[str] | None = None, n_predict: int = 128,
              repeat: int = 1, with_no_spec: bool = False, log: Callable[[str], None] | None = None,
              **overrides) -> BenchReport:
    """Stock llama.cpp and bitsplit (loaded with ``options``, or its fields as keywords) on the same
    prompts, interleaved per prompt (stock, bitsplit, and with ``with_no_spec`` bitsplit's verifier
    alone in the same worker), the same threads, context and ``sampling`` (default: greedy)."""
    from ..formats.gguf_file import check_readable_file
    from ..formats.modeldir import validate_split
    from ..runtime.llamacpp import default_threads
    from ..speculative.options import GenerationOptions, SamplingParams

    opts = GenerationOptions.of(options, **overrides)  # refused before any worker starts
    sampling = sampling if sampling is not None else SamplingParams()
    validate_split(model_dir)
    check_readable_file(Path(vs), "--vs model")
    if n_predict < 2:
        raise InvalidOptionError(f"-n: {n_predict} is too small to measure a rate (at least 2)")
    if repeat < 1:
        raise InvalidOptionError(f"--repeat: {repeat} is not a positive integer")
    if opts.rpc:
        from ..runtime import rpc as rpc_mod

        rpc_mod.require()
    threads = opts.n_threads or default_threads()
    opts = opts.replace(n_threads=threads)
    prompts = prompts or list(DEFAULT_PROMPTS)
    say = log or (lambda s: None)
    t_start = time.monotonic()
    temp = sampling.temperature
    rep = BenchReport(str(model_dir), str(vs), threads, n_predict, temp, opts.tree_nodes, prompts, rpc=opts.rpc,
                      overlap=opts.overlap, overlap_at=opts.overlap_at, draft_stop=opts.draft_stop)
    say(f"starting workers ({threads} threads each): stock {Path(vs).name}, bitsplit {model_dir}")
    stock = _Side({"side": "stock", "path": str(vs), "n_ctx": opts.n_ctx, "threads": threads})
    try:
        bit = _Side({"side": "bitsplit", "path": str(model_dir), "options": opts.to_json()})
        samp = dataclasses.asdict(sampling)
        try:
            warm = {"prompt": prompts[0], "n": 8, "sampling": samp, "seed": 1}
            stock.run(warm)
            bit.run(warm)
            rep.bandwidth = memory_bandwidth(threads)
            for r in range(repeat):
                for i, prompt in enumerate(prompts):
                    # the run's seed, else one per request (the same for both sides)
                    seed = sampling.seed if sampling.seed is not None else 1000 * r + i
                    req = {"prompt": prompt, "n": n_predict, "sampling": samp, "seed": seed}
                    a = stock.run(req)
                    b = bit.run(req)
                    rep.vs_rates.append(a["rate"])
                    rep.rates.append(b["rate"])
                    rep.stats.append(b["extra"])
                    if a["rate"]:
                        rep.per_prompt_ratio.append(b["rate"] / a["rate"])
                    rep.vs_rss, rep.rss = a["rss"], b["rss"]
                    plain = ""
                    if with_no_spec:
                        c = bit.run({**req, "speculative": False})
                        rep.no_spec_rates.append(c["rate"])
                        rep.rss = c["rss"]
                        plain = f", no-spec {c['rate']:.2f} tok/s"
                    say(f"[{r * len(prompts) + i + 1}/{repeat * len(prompts)}] stock {a['rate']:.2f} tok/s, "
                        f"bitsplit {b['rate']:.2f} tok/s ({b['extra'].get('accepted_per_verify', 0):.2f} tokens/verify)"
                        + plain)
            rep.bandwidth = (rep.bandwidth + memory_bandwidth(threads)) / 2
        finally:
            bit.close()
    finally:
        stock.close()
    rep.seconds = time.monotonic() - t_start
    return rep


def check_plot_path(path: str | os.PathLike[str]) -> None:
    """Refuse --plot before a long run rather than after it: matplotlib installed, a writable .png."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise InputError("--plot needs matplotlib (pip install 'bitsplit-llama[plot]')") from None
    p = Path(path)
    if p.suffix.lower() != ".png":
        raise InvalidOptionError(f"--plot: {p} is not a .png file name")
    if not p.parent.is_dir() or not os.access(p.parent, os.W_OK):
        raise OutputError(f"--plot: cannot write {p}: {p.parent} is not a writable directory")


def plot(rep: BenchReport, path: str | os.PathLike[str]) -> None:
    check_plot_path(path)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    s = rep.summary()
    n = len(rep.rates)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4), gridspec_kw={"width_ratios": [3, 1]})
    x = np.arange(n)
    three = bool(rep.no_spec_rates)
    w = 0.27 if three else 0.4
    ax1.bar(x - (w if three else w / 2), rep.vs_rates, w, label=f"stock llama.cpp ({Path(rep.vs).name})")
    ax1.bar(x + (0 if three else w / 2), rep.rates, w, label=f"bitsplit (tree {s['tree_shape']}, {s['kernel']})")
    if three:
        ax1.bar(x + w, rep.no_spec_rates, w, color="C2", label="bitsplit --no-spec (verifier alone)")
    ax1.set_xlabel("run (prompt)")
    ax1.set_ylabel("tokens/s")
    ax1.set_title(f"{Path(rep.model_dir).name}: {rep.n_predict} tokens, temp {rep.temp}, {rep.threads} threads")
    ax1.legend(fontsize=8)
    names, vals = ["stock", "bitsplit"], [s["vs_tokens_per_second"], s["tokens_per_second"]]
    if three:
        names.append("no-spec")
        vals.append(s["no_spec_tokens_per_second"])
    ax2.bar(names, vals, color=["C0", "C1", "C2"][:len(names)])
    ax2.set_title(f"median: {s['speedup_vs']:.2f}x")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "worker":
        _worker(json.loads(sys.argv[2]))
    else:
        print("internal: python -m bitsplit_llama.tools.bench worker CONFIG", file=sys.stderr)
        sys.exit(2)
