"""``bitsplit profile``: a split's measured acceptance profile, written next to it.

For each tree size (``TreeShape.for_nodes``; 0 is the verifier alone) the engine generates from a
few prompts and records tokens per verification, the time of a verify pass, the drafting per cycle,
the drafter passes per cycle and the rows a verify pass took. Each size drafts from the text too, with
the text budget a generation has by default (``--text-nodes``, 32): the profile measures the engine as
``run`` uses it, so the auto tree and ``plan`` weigh the drafter's trees with the text's branches
beside them; ``--text-nodes 0`` measures the drafter's trees alone. ``profile.json`` in the split
directory holds the result with the base's fingerprint and this machine's key; ``--tree-nodes
auto`` then picks among the measured sizes (with these times on the machine that measured them,
with its own cost curves elsewhere) and ``bitsplit plan`` reads tokens per verification, drafter
passes and rows per pass from it instead of constants.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Callable, Sequence

from ..errors import InvalidOptionError
from ..formats.profile import PROFILE_FORMAT, split_keys
from ..native import policy

DEFAULT_NODES = (0, 1, 2, 4, 8, 16, 32, 64)


def parse_nodes(text: str) -> list[int]:
    from ..speculative.engine import MAX_TREE_NODES

    try:
        nodes = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise InvalidOptionError(f"--nodes: '{text}' is not a comma-separated list of integers") from None
    if not nodes or nodes[0] < 0 or nodes[-1] > MAX_TREE_NODES:
        raise InvalidOptionError(f"--nodes: '{text}': each size must be 0 to {MAX_TREE_NODES}")
    return nodes


def measure_profile(split: str | os.PathLike[str], *, nodes: Sequence[int] = DEFAULT_NODES,
                    prompts: Sequence[str] | None = None, n_tokens: int = 64, temperature: float = 0.0,
                    threads: int | None = None, text_nodes: int | None = None,
                    log: Callable[[str], None] | None = None) -> dict:
    """Measure the profile (see the module doc); returns the object :func:`~bitsplit_llama.formats.profile.write_profile` stores."""
    from ..runtime.verifier import SplitModel
    from ..speculative import autotree
    from ..speculative.engine import MAX_TREE_NODES, Engine, Stats, TreeShape, n_seq_max_for, reserve_for
    from ..speculative.options import GenerationOptions
    from ..speculative.sampling import SamplingParams

    split = Path(split)
    if n_tokens < 1:
        raise InvalidOptionError(f"-n: {n_tokens} is not a positive integer")
    if not temperature >= 0:
        raise InvalidOptionError(f"--temp: {temperature} is negative")
    text = GenerationOptions.text_nodes if text_nodes is None else text_nodes
    if not 0 <= text <= MAX_TREE_NODES:
        raise InvalidOptionError(f"--text-nodes: {text} is not between 0 and {MAX_TREE_NODES}")
    prompts = list(prompts) if prompts else list(autotree.CALIBRATION_PROMPTS)
    keys = split_keys(split, with_fingerprint=True)
    fp = keys["base_fingerprint"]
    # 0 nodes: the verifier alone (no text either); the others with the text's nodes a pass leaves them
    shapes = [TreeShape(0, 1, 1) if n == 0 else TreeShape.for_nodes(n).with_text(min(text, MAX_TREE_NODES - n))
              for n in nodes]
    room = TreeShape(max(s.nodes for s in shapes), max(s.width for s in shapes), max(s.rounds for s in shapes),
                     max(s.text for s in shapes))
    say = log or (lambda s: None)
    # a batch holds a verify pass (the tree's and the text's nodes + 1 rows) and, with one sequence
    # per row, every lane
    sm = SplitModel(split, n_ctx=max(256, 64 + n_tokens * 2),
                    n_batch=max(64, room.nodes + room.text + 8, n_seq_max_for(room)), n_seq_max=n_seq_max_for(room), reserve=reserve_for(room), n_threads=threads)
    rows = []
    t_start = time.monotonic()
    try:
        toks = [sm.model.tokenize(p) for p in prompts]
        for shape in shapes:
            kernel = sm.residual.choose_decode_kernel(2, policy.generation_family(sm.residual_alone))
            eng = Engine(sm, shape)
            st = Stats()  # the sums over prompts (a generation counts its own tokens in its own Stats)
            for i, t in enumerate(toks):
                sp = SamplingParams(temperature=temperature, seed=1234 + i)
                one = Stats()
                for _ in eng.generate(t, n_tokens, sp, is_stop=sm.model.is_eog, stats=one):
                    pass
                eng.reset()
                for f in ("n_emitted", "n_verify", "n_draft_passes", "verify_seconds", "draft_seconds", "n_drafted",
                          "n_accepted", "n_accepted_text"):
                    setattr(st, f, getattr(st, f) + getattr(one, f))
            cycles = max(st.n_verify, 1)
            row = {"nodes": shape.nodes, "width": shape.width, "rounds": shape.rounds, "text": shape.text,
                   "tokens_per_verify": round(st.n_emitted / cycles, 4),
                   # the rows a verify pass took: the root, the drafter's nodes and the text's verified
                   "rows_per_verify": round(1 + st.n_drafted / cycles, 3),
                   # of the drafted tokens the verifier took, the share only the text proposed
                   "accepted_from_text": round(st.n_accepted_text / st.n_accepted, 4) if st.n_accepted else 0.0,
                   "ms_per_verify": round(1000 * st.verify_seconds / cycles, 2),
                   "ms_drafting_per_cycle": round(1000 * st.draft_seconds / cycles, 2),
                   "draft_passes_per_cycle": round(st.n_draft_passes / cycles, 3),
                   "tokens": st.n_emitted, "kernel": kernel}
            sec = (st.verify_seconds + st.draft_seconds) / cycles
            row["tokens_per_second"] = round(row["tokens_per_verify"] / sec, 3) if sec > 0 else 0.0
            rows.append(row)
            say(f"[{time.monotonic() - t_start:5.0f}s] {shape.nodes:3d} nodes (+{shape.text} text): "
                f"{row['tokens_per_verify']:.2f} tokens/verify, {row['rows_per_verify']:.1f} rows, "
                f"{row['ms_per_verify']:.0f} ms per verify pass, {row['ms_drafting_per_cycle']:.0f} ms drafting, "
                f"{row['tokens_per_second']:.2f} tokens/s")
        setup = autotree.setup_of(sm, keys["residual_fingerprint"])
        machine = autotree.machine_key(sm.ctx.n_threads, setup)
    finally:
        sm.close()
    return {"format": PROFILE_FORMAT, "base_fingerprint": fp, "base_type": keys["base_type"],
            "residual_type": keys["residual_type"], "imatrix": keys["imatrix"], "machine_key": machine, "threads": threads,
            "prompts": prompts, "n_tokens": n_tokens, "temperature": temperature, "text_nodes": text,
            "seconds": round(time.monotonic() - t_start, 1), "profile": rows}


