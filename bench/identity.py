"""Greedy identity under the defaults: `bitsplit run` (speculative, at each tree size, text branches
at their default) against `bitsplit run --no-spec`, both through Generator exactly as the CLI builds
it, no environment variable set. Prints a line per prompt and per tree size (stderr) and a JSON
summary.

    python bench/identity.py SPLIT_DIR [--nodes 1,16,64,256] [--n 256] [--prompts FILE] [--max-prompts 10]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from bitsplit_llama import GenerationOptions
from bitsplit_llama.speculative.generate import Generator
from bitsplit_llama.tools.bench import DEFAULT_PROMPTS, load_prompts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("split")
    ap.add_argument("--nodes", default="1,16,64,256")
    ap.add_argument("--n", type=int, default=256)
    ap.add_argument("--prompts", default=None)
    ap.add_argument("--max-prompts", type=int, default=10)
    a = ap.parse_args()
    for var in ("BITSPLIT_KERNEL", "BITSPLIT_MAX_ISA", "BITSPLIT_HALF_RATE_512"):
        if os.environ.get(var):
            sys.exit(f"{var} is set: this measures the defaults; unset it")
    prompts = (load_prompts(a.prompts) if a.prompts else DEFAULT_PROMPTS)[:a.max_prompts]
    t0 = time.time()
    with Generator(a.split, GenerationOptions(tree_nodes=0, text_nodes=0)) as g:
        plain = [g.generate(p, max_tokens=a.n, speculative=False).tokens for p in prompts]
        plain_kernel = g.kernel
    out = {"split": a.split, "n": a.n, "prompts": len(prompts), "no_spec_kernel": plain_kernel, "by_nodes": {}}
    for nodes in [int(x) for x in a.nodes.split(",")]:
        with Generator(a.split, GenerationOptions(tree_nodes=nodes)) as g:
            same, parted, tpv = 0, [], []
            for i, p in enumerate(prompts):
                r = g.generate(p, max_tokens=a.n)
                tpv.append(r.stats.tokens_per_verify)
                ok = r.tokens == plain[i]
                if ok:
                    same += 1
                else:
                    parted.append({"prompt": i, "at": next((k for k, (x, y) in enumerate(zip(r.tokens, plain[i])) if x != y),
                                                            min(len(r.tokens), len(plain[i])))})
                # one line per prompt: a large tree's run takes long enough to want its progress
                print(f"[{time.time() - t0:5.0f}s]   {nodes} nodes, prompt {i + 1}/{len(prompts)}: "
                      f"{'identical' if ok else 'parted at %d' % parted[-1]['at']}, "
                      f"{r.stats.tokens_per_verify:.2f} tokens per verify", file=sys.stderr, flush=True)
            row = {"identical": same, "of": len(prompts), "parted": parted, "kernel": g.kernel,
                   "text_nodes": g.shape.text, "tokens_per_verify": round(sum(tpv) / len(tpv), 2)}
        out["by_nodes"][nodes] = row
        print(f"[{time.time() - t0:5.0f}s] {nodes} nodes (+{row['text_nodes']} text, {row['kernel']}; --no-spec "
              f"{plain_kernel}): {same}/{len(prompts)} identical {parted}", file=sys.stderr, flush=True)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
