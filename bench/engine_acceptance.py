"""Acceptance of the speculative engine on a real model: tokens per verification for trees and
chains, against a separate-KV drafter baseline, greedy and sampled; and whether speculative greedy
output equals verifier-alone output (with the top-2 margin at any first divergence).

    python bench/engine_acceptance.py SPLIT_DIR [--n 128] [--prompts FILE] [--temps 0,0.7]
        [--configs tree16,chain4,chain8,separate_kv_tree16] [--json OUT] [--threads N]
        [--lookup-vs Q8_0.gguf] [--row-price P]

Configurations: tree of 16 (width 4, 7 rounds), of 32, 64, 128 and 256 nodes (TreeShape.for_nodes: 10
to 24 rounds, width 5 to 16; ``treeN`` any N the same way), chains of 1, 4 and 8, and the tree of 16 drafted by
a separate context over the same base.gguf with its own KV cache (how a separate draft model works
in stock llama.cpp); both draft with llama.cpp's own kernels. ``+textN`` after a configuration adds up
to N nodes from the text itself (prompt lookup: speculative/lookup.py) to its trees; ``textN`` alone
drafts from the text only. Tokens per verify = emitted tokens / verifier passes (the prompt's pass
counts). Per configuration also: drafter passes per verify, and the shares of accepted tokens the
drafter alone, the text alone and both proposed.

``--lookup-vs MODEL.gguf`` adds a row for llama-cpp-python's own drafting without a model
(``LlamaPromptLookupDecoding``, greedy, on MODEL, e.g. the stock Q8_0): its tokens per verify, counted
as generated tokens over its ``eval`` calls after the prompt's, plus the prompt's pass.

``--row-price P`` pins the path probability a node beyond the drafter's own ``nodes`` (a text node, or
a drafter node in the text's unused share) needs, instead of this machine's measured cost of a row
over a token's (``Engine.text_min_p``): 0.05, the floor, stands for a device whose rows are nearly free.

Prompt sets for the workloads: bench/prompts/code.json (code completion), english.json (English),
edit.json (a 42-57-line Python function and an instruction to rename a variable, add type hints or a
docstring: the answer is the function again).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

from bitsplit_llama.native import policy
from bitsplit_llama.tools.bench import DEFAULT_PROMPTS, load_prompts
from bitsplit_llama.speculative.engine import Engine, Stats, TreeShape, n_seq_max_for, reserve_for
from bitsplit_llama.runtime.llamacpp import Context
from bitsplit_llama.speculative.sampling import SamplingParams
from bitsplit_llama.runtime.verifier import SplitModel

CONFIGS = {
    "tree16": TreeShape(16, 4, 7),
    "chain1": TreeShape(1, 1, 1),
    "chain4": TreeShape(4, 1, 4),
    "chain8": TreeShape(8, 1, 8),
    "tree32": TreeShape.for_nodes(32),
    "tree64": TreeShape.for_nodes(64),
    "tree128": TreeShape.for_nodes(128),
    "tree256": TreeShape.for_nodes(256),
}


def shape_of(name: str) -> TreeShape:
    """A configuration's shape: ``tree16``, ``chain4``, ... (``treeN``: any N, as ``run --tree-nodes N``) with
    ``+textN`` for N text nodes, or ``textN``."""
    base, _, text = name.partition("+")
    if base.startswith("text") and not text:
        base, text = "", base
    n_text = int(text[4:]) if text.startswith("text") and text[4:].isdigit() else None
    if text and n_text is None:
        raise ValueError(name)
    if base.startswith("tree") and base[4:].isdigit() and base not in CONFIGS:
        shape = TreeShape.for_nodes(int(base[4:]))  # any size, as run's --tree-nodes N
    else:
        shape = CONFIGS[base] if base else TreeShape(0, 1, 1)
    return shape.with_text(n_text or 0)  # as run gives a tree its text nodes


def lookup_row(model: Path, prompts: list[str], n: int, threads: int | None) -> dict:
    """llama-cpp-python's prompt-lookup drafting on ``model``, greedy: tokens per verify (its generate
    loop calls ``eval`` once per pass: the prompt's, then one per verification of its drafts)."""
    from llama_cpp import Llama
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    # logits_all=True: with a draft model llama-cpp-python 0.3.36 keeps every row's logits but sizes its
    # score buffer for them only when logits_all is asked for (a prompt longer than n_batch fails otherwise)
    llm = Llama(str(model), n_ctx=2048, n_threads=threads, verbose=False, logits_all=True,
                draft_model=LlamaPromptLookupDecoding(num_pred_tokens=10, max_ngram_size=2))
    calls = [0]
    inner = llm.eval

    def counting_eval(tokens):
        calls[0] += 1
        return inner(tokens)

    llm.eval = counting_eval
    emitted = verifies = 0
    per = []
    for p in prompts:
        llm.reset()
        calls[0] = 0
        toks = llm.tokenize(p.encode())
        out = []
        for t in llm.generate(toks, temp=0.0, top_k=1, reset=True):
            if t == llm.token_eos():
                break
            out.append(t)
            if len(out) >= n:
                break
        v = max(calls[0], 1)  # one eval per pass: the prompt's (its first token), then one per verify
        emitted += len(out)
        verifies += v
        per.append({"tokens": out, "tokens_per_verify": len(out) / v})
    return {"tokens_per_verify": emitted / max(verifies, 1), "per_prompt": per, "model": str(model)}


def margin_at(sm: SplitModel, prefix: list[int]) -> float:
    """Top-2 logit margin of the verifier after ``prefix`` (a fresh prompt pass)."""
    sm.ctx.clear()
    step = sm.ctx.n_batch
    with sm.verifying() as ctx:
        for i in range(0, len(prefix), step):
            part = prefix[i:i + step]
            ctx.decode(part, range(i, i + len(part)), logits=[False] * (len(part) - 1) + [True])
        lg = np.sort(ctx.logits_ith(len(part) - 1).astype(np.float64))
    sm.ctx.clear()
    return float(lg[-1] - lg[-2])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("split", type=Path)
    ap.add_argument("--n", type=int, default=128)
    ap.add_argument("--prompts", type=Path, default=None)
    ap.add_argument("--temps", default="0,0.7")
    ap.add_argument("--configs", default="tree16,chain4,chain8,separate_kv_tree16",
                    help=f"comma-separated, from: {', '.join(CONFIGS)}, separate_kv_tree16; +textN adds N text nodes, "
                         "textN alone drafts from the text only")
    ap.add_argument("--lookup-vs", type=Path, default=None,
                    help="also llama-cpp-python's LlamaPromptLookupDecoding on this GGUF (greedy)")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--row-price", type=float, default=None,
                    help="pin the path probability a node beyond the drafter's own needs (default: measured)")
    ap.add_argument("--threads", type=int, default=None, help="threads (default: all cores); 1 lets two runs share "
                    "a 2-core machine without their thread pools spinning against each other")
    a = ap.parse_args()
    if a.row_price is not None and not 0.0 <= a.row_price <= 1.0:
        ap.error(f"--row-price: {a.row_price} is not a probability in [0, 1]")
    prompts = load_prompts(a.prompts) if a.prompts else DEFAULT_PROMPTS[:10]
    temps = [float(t) for t in a.temps.split(",")]
    configs = a.configs.split(",")
    shapes = []
    for c in configs:
        try:
            shapes.append(CONFIGS["tree16"] if c == "separate_kv_tree16" else shape_of(c))
        except (KeyError, ValueError):
            ap.error(f"--configs: {c!r} is not one of {', '.join(CONFIGS)}, treeN (N up to 256), separate_kv_tree16 "
                     "(with +textN), textN")
    room = TreeShape(max(s.nodes for s in shapes), max(s.width for s in shapes), max(s.rounds for s in shapes),
                     max(s.text for s in shapes))
    n_batch = max(64, room.nodes + room.text + 1, n_seq_max_for(room))
    # llama.cpp's own kernels draft in both set-ups, so that the separate-KV baseline differs only by its KV
    sm = SplitModel(a.split, n_ctx=2048, n_batch=n_batch, n_seq_max=n_seq_max_for(room), reserve=reserve_for(room),
                    n_threads=a.threads,
                    fast_drafter=False)
    # the separate drafter's own context (and its KV cache) only when that baseline is asked for
    dctx = (Context(sm.model, n_ctx=2048, n_batch=max(64, n_seq_max_for(room)), n_seq_max=n_seq_max_for(room),
                    reserve=reserve_for(room), n_threads=a.threads)
            if "separate_kv_tree16" in configs else None)
    results: dict = {"split": str(a.split), "n": a.n, "prompts": prompts, "runs": {}, "row_price": a.row_price}
    t_start = time.time()

    def run(engine: Engine, prompt: str, sp: SamplingParams) -> tuple[list[int], Stats]:
        st = Stats()
        toks = [t for chunk in engine.generate(sm.model.tokenize(prompt), a.n, sp, is_stop=sm.model.is_eog,
                                               stats=st) for t in chunk]
        return toks, st

    for temp in temps:
        for name, shape in zip(configs, shapes):
            # one kernel family for every pass of every run, as a Generator pins it (policy.generation_family)
            sm.residual.choose_decode_kernel(2, policy.generation_family(sm.residual_alone))
            eng = Engine(sm, shape, draft_ctx=dctx if name.startswith("separate") else None)
            if a.row_price is not None:
                eng.text_min_p = lambda: a.row_price
            emitted = verifies = passes = acc = acc_text = acc_both = 0
            t_verify = t_draft = 0.0
            per = []
            for i, p in enumerate(prompts):
                sp = SamplingParams(temperature=temp, seed=1234 + i)
                toks, st = run(eng, p, sp)
                emitted += st.n_emitted
                verifies += st.n_verify
                t_verify += st.verify_seconds
                t_draft += st.draft_seconds
                passes += st.n_draft_passes
                acc, acc_text, acc_both = acc + st.n_accepted, acc_text + st.n_accepted_text, acc_both + st.n_accepted_both
                per.append({"tokens": toks, "tokens_per_verify": st.tokens_per_verify, "seconds": st.total_seconds})
                print(f"[{time.time() - t_start:6.0f}s] temp {temp} {name:20s} prompt {i}: "
                      f"{st.tokens_per_verify:.2f} tokens/verify", file=sys.stderr, flush=True)
            # time per verify pass and per cycle's drafting (the prompt's pass is not in verify_seconds)
            cycles = max(verifies - len(prompts), 1)
            shares = {"drafter": round((acc - acc_text - acc_both) / max(acc, 1), 3),
                      "text": round(acc_text / max(acc, 1), 3), "both": round(acc_both / max(acc, 1), 3)}
            results["runs"][f"{name}@{temp}"] = {"tokens_per_verify": emitted / verifies, "per_prompt": per,
                                                 "draft_passes_per_verify": round(passes / verifies, 3),
                                                 "accepted_share": shares,
                                                 "kernel": sm.residual.kernel,
                                                 "ms_per_verify": round(1000 * t_verify / cycles, 1),
                                                 "ms_drafting_per_cycle": round(1000 * t_draft / cycles, 1)}
            print(f"[{time.time() - t_start:6.0f}s] temp {temp} {name}: {emitted / verifies:.2f} tokens/verify, "
                  f"{passes / verifies:.2f} drafter passes/verify, accepted from {shares}, "
                  f"{1000 * t_verify / cycles:.0f} ms per verify pass, {1000 * t_draft / cycles:.0f} ms drafting",
                  file=sys.stderr, flush=True)
            if a.json:  # after each configuration: a long run stopped early keeps what it measured
                a.json.write_text(json.dumps(results))
            eng.reset()
    # greedy identity: verifier alone (same kernel family as the tree's passes) vs each greedy run
    if 0.0 in temps:
        plain_of: dict[str, list[list[int]]] = {}  # verifier-alone outputs by kernel family
        for fam_of, shape in [(c, s) for c, s in zip(configs, shapes) if not c.startswith("separate")]:
            kernel = sm.residual.choose_decode_kernel(2, policy.generation_family(sm.residual_alone))
            plain = Engine(sm, TreeShape(0, 1, 1))
            if kernel not in plain_of:
                plain_of[kernel] = [run(plain, p, SamplingParams())[0] for p in prompts]
            same, margins = 0, []
            for i, p in enumerate(prompts):
                ref = plain_of[kernel][i]
                got = results["runs"][f"{fam_of}@0.0"]["per_prompt"][i]["tokens"]
                if got == ref:
                    same += 1
                else:
                    j = next((k for k, (x, y) in enumerate(zip(got, ref)) if x != y), min(len(got), len(ref)))
                    margins.append({"prompt": i, "position": j,
                                    "margin": margin_at(sm, sm.model.tokenize(p) + ref[:j])})
            results[f"identity_{fam_of}"] = {"identical": same, "of": len(prompts), "divergences": margins,
                                             "kernel": sm.residual.kernel}
            print(f"identity {fam_of}: {same}/{len(prompts)} {margins}", file=sys.stderr, flush=True)
    summary = {k: {"tokens_per_verify": round(v["tokens_per_verify"], 3), "ms_per_verify": v["ms_per_verify"],
                   "ms_drafting_per_cycle": v["ms_drafting_per_cycle"],
                   "draft_passes_per_verify": v["draft_passes_per_verify"], "accepted_share": v["accepted_share"]}
               for k, v in results["runs"].items()}
    if a.lookup_vs:
        row = lookup_row(a.lookup_vs, prompts, a.n, a.threads)
        results["llama_cpp_prompt_lookup"] = row
        summary["llama_cpp_prompt_lookup@0.0"] = {"tokens_per_verify": round(row["tokens_per_verify"], 3)}
        print(f"llama-cpp-python LlamaPromptLookupDecoding: {row['tokens_per_verify']:.2f} tokens/verify",
              file=sys.stderr, flush=True)
    results["summary"] = summary
    results["seconds"] = round(time.time() - t_start)
    print(json.dumps({"summary": summary, **{k: v for k, v in results.items() if k.startswith("identity")}}))
    if a.json:
        a.json.write_text(json.dumps(results))


if __name__ == "__main__":
    main()
