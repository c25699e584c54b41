"""Does a token's result depend on the rest of its batch? Row 0 of a verify pass (the prompt's last
token) decoded in batches of several sizes, the other rows siblings in their own sequences, compared
bit for bit with the first size listed; for the verifier in batch-invariant mode (the default), the
verifier without it, and the drafter (llama.cpp's own kernels, residual off):

    python bench/batch_invariance.py SPLIT_DIR [--rows 1,2,17,64,65,256] [--kernel avx2-int16,avx2-f32]
                                               [--nodes] [--prompt] [--time N] [--text FILE --context N]

``--nodes``: every node of the graph is observed (an eval callback in front of the library's own,
which it calls first) and the first ``ne[0]`` values of each F32 node in host memory (row 0: the
first token's, for nodes whose second dimension is the batch) are kept; the first node, in graph
order, whose row 0 differs from the reference batch is printed with its op and shape, then the
differing nodes by op. That is where a token's result starts to depend on its batch.

``--prompt``: the verifier's logits at every prompt position, the prompt decoded in one batch
against one token at a time as generation's steps decode them (two rows, the second a throw-away
copy; what ``eval`` computes against what generation computes), and against single-row passes.

``--text FILE --context N``: the prompt is the first N tokens of FILE (repeated if shorter) instead
of a 29-token snippet, so that attention reads N cached positions (llama.cpp's CPU flash attention
changes path for one row from 512).

``--time N``: the verify pass's time per batch size, batch-invariant against not, interleaved,
median of N (the cost of the invariance, measured in one run).
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import time
from collections import Counter
from pathlib import Path

import numpy as np

from bitsplit_llama.runtime.verifier import SplitModel

PROMPT = "def quicksort(arr):\n    if len(arr) <= 1:\n        return arr\n    pivot = arr[len(arr) // 2]\n"
MODES = ("verifier", "verifier-no-invariance", "drafter")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("split")
    ap.add_argument("--rows", default="1,2,3,5,8,16,17,32,33,63,64,65,128,256",
                    help="batch sizes, comma-separated; the first is the reference (default: %(default)s)")
    ap.add_argument("--kernel", default=None,
                    help="kernel families to pin for the verifier, comma-separated (default: the policy's for a "
                         "16-node tree)")
    ap.add_argument("--modes", default=",".join(MODES), help="of: " + ", ".join(MODES))
    ap.add_argument("--nodes", action="store_true", help="find the first graph node whose row 0 depends on the batch")
    ap.add_argument("--prompt", action="store_true", help="compare prompt logits: one batch against one at a time")
    ap.add_argument("--flash-attn", choices=("auto", "on", "off"), default="off",
                    help="llama.cpp's flash attention for the batch-invariant verifier (default: off, as the engine "
                         "sets it on the CPU); the other modes run with llama.cpp's default (auto)")
    ap.add_argument("--time", type=int, default=0, metavar="N", help="time each pass N times, interleaved")
    ap.add_argument("--text", default=None, metavar="FILE", help="take the prompt from this text file")
    ap.add_argument("--context", type=int, default=0, metavar="N",
                    help="prompt length in tokens with --text (default: the whole text, at most 4000)")
    a = ap.parse_args()
    try:
        rows = [int(r) for r in a.rows.split(",")]
    except ValueError:
        ap.error(f"--rows: '{a.rows}' is not a comma-separated list of integers")
    if not rows or any(not 1 <= r <= 256 for r in rows):
        ap.error(f"--rows: {a.rows}: every batch size must be in 1..256")
    modes = a.modes.split(",")
    if any(m not in MODES for m in modes):
        ap.error(f"--modes: '{a.modes}': expected some of {', '.join(MODES)}")
    if a.time < 0:
        ap.error(f"--time: {a.time} is negative")
    if a.context < 0 or (a.context and a.text is None):
        ap.error(f"--context {a.context}: give a positive length, with --text FILE")
    text = None
    if a.text is not None:
        try:
            text = Path(a.text).read_text(errors="replace")
        except OSError as exc:
            ap.error(f"--text: {a.text}: {exc.strerror}")
        if not text.strip():
            ap.error(f"--text: {a.text} is empty")
    max_rows = max(rows)
    fa = {"auto": None, "on": True, "off": False}[a.flash_attn]
    n_prompt = (a.context or 4000) if text is not None else 64
    n_ctx = max(1024, n_prompt + max_rows + 16)
    n_batch = max(max_rows, 64, n_prompt if text is not None else 0)
    sm = SplitModel(a.split, n_ctx=n_ctx, n_batch=n_batch, n_seq_max=max(max_rows, 2), fast_drafter=False,
                    flash_attn=fa)
    probe = Probe(sm, max_rows, fa, n_ctx=n_ctx, n_batch=n_batch)
    if text is not None:
        toks = sm.model.tokenize(text)
        while len(toks) < n_prompt:
            toks = toks + toks
        probe.prompt = toks[:n_prompt]
    print(f"batch-invariant verifier: flash attention {a.flash_attn}; without invariance and drafter: llama.cpp's "
          "default")
    try:
        for fam in (a.kernel.split(",") if a.kernel else [None]):
            fam = sm.residual.choose_decode_kernel(17, fam)
            print(f"== kernel family {fam} (pinned), {len(probe.prompt)}-token prompt")
            for mode in modes:
                compare_rows(probe, mode, rows, a.nodes)
            if a.prompt:
                compare_prompt(probe)
            if a.time:
                time_passes(probe, rows, a.time)
    finally:
        probe.close()
        sm.close()


class _Tensor(ctypes.Structure):
    """The head of ggml.h's struct ggml_tensor (ggml 0.9.x, as vendored by llama-cpp-python 0.3.36)."""

    _fields_ = [("type", ctypes.c_int), ("buffer", ctypes.c_void_p), ("ne", ctypes.c_int64 * 4),
                ("nb", ctypes.c_size_t * 4), ("op", ctypes.c_int), ("op_params", ctypes.c_int32 * 16),
                ("flags", ctypes.c_int32), ("src", ctypes.c_void_p * 10), ("view_src", ctypes.c_void_p),
                ("view_offs", ctypes.c_size_t), ("data", ctypes.c_void_p), ("name", ctypes.c_char * 64)]


class Probe:
    """A context of its own over the split model whose eval callback calls the library's and, while
    recording, keeps row 0 of every F32 host node."""

    def __init__(self, sm: SplitModel, max_rows: int, flash_attn: bool | None = None, n_ctx: int = 1024,
                 n_batch: int = 64):
        import llama_cpp

        from bitsplit_llama import native
        from bitsplit_llama.runtime.llamacpp import Context

        ll = llama_cpp
        self.sm = sm
        base = ctypes.CDLL(str(Path(ll.__file__).parent / "lib" / "libggml-base.so"))
        base.ggml_backend_buffer_is_host.restype = ctypes.c_bool
        base.ggml_backend_buffer_is_host.argtypes = [ctypes.c_void_p]
        base.ggml_op_desc.restype = ctypes.c_char_p
        base.ggml_op_desc.argtypes = [ctypes.c_void_p]
        ours = ctypes.cast(ctypes.c_void_p(native.callback_address()), ll.ggml_backend_sched_eval_callback)
        ud = ctypes.c_void_p(sm.residual.address)
        self.seen: list[tuple[str, str, tuple, np.ndarray]] = []
        self.record = False

        def cb(t, ask, _user):
            r = ours(t, ask, ud)  # the library decides first (replace: it mutated the node)
            if ask:
                return True if self.record else r
            if self.record:
                x = ctypes.cast(t, ctypes.POINTER(_Tensor)).contents
                if x.type == 0 and x.data and x.buffer and base.ggml_backend_buffer_is_host(x.buffer) and x.nb[0] == 4:
                    n0 = int(x.ne[0])
                    row = np.ctypeslib.as_array(ctypes.cast(x.data, ctypes.POINTER(ctypes.c_float)), shape=(n0,)).copy()
                    self.seen.append((x.name.decode(errors="replace"), base.ggml_op_desc(t).decode(), tuple(x.ne), row))
            return r

        self._cfun = ll.ggml_backend_sched_eval_callback(cb)
        addr = ctypes.cast(self._cfun, ctypes.c_void_p).value
        kw = dict(n_ctx=n_ctx, n_batch=max(max_rows, n_batch), n_seq_max=max(max_rows, 2), cb_eval=addr,
                  cb_eval_user_data=0)
        # the batch-invariant verifier's context, and one with llama.cpp's default attention
        self.ctx_inv = Context(sm.model, flash_attn=flash_attn, **kw)
        self.ctx_default = Context(sm.model, **kw)
        self.ctx = self.ctx_inv
        self.prompt = sm.model.tokenize(PROMPT)

    def set_mode(self, mode: str) -> None:
        self.sm.residual.enabled = mode != "drafter"
        self.sm.residual.batch_invariant = mode == "verifier"
        self.ctx = self.ctx_inv if mode == "verifier" else self.ctx_default

    def row0(self, mode: str, rows: int, nodes: bool = False, all_logits: bool = False) -> tuple[np.ndarray, float]:
        """Logits of row 0 of a pass of ``rows`` rows (and its time; ``all_logits``: every row's
        logits computed, as in a verify pass); with ``nodes``, self.seen holds the pass's nodes."""
        self.set_mode(mode)
        ctx, prompt = self.ctx, self.prompt
        n = len(prompt)
        ctx.clear()
        ctx.decode(prompt, range(n), logits=False)
        for s in range(1, rows):
            ctx.seq_cp(0, s, 0, n)
        self.seen.clear()
        self.record = nodes
        self.sm.residual.reset_counters()  # the pass's own counters (the prompt's are not in them)
        t0 = time.perf_counter()
        nv = self.sm.model.n_vocab
        ctx.decode([prompt[-1]] + [(100 + i) % nv for i in range(rows - 1)], [n] * rows, seq_ids=[[s] for s in range(rows)],
                   logits=[True] + [all_logits] * (rows - 1))
        dt = time.perf_counter() - t0
        self.record = False
        out = ctx.logits_ith(0).copy()
        self.sm.residual.raise_pending_error()
        return out, dt

    def close(self) -> None:
        self.sm.residual.enabled = False
        self.sm.residual.batch_invariant = True
        self.ctx_inv.close()
        self.ctx_default.close()


def _keyed(nodes):
    """names repeat ("norm-0" before attention and FFN): key by name and occurrence"""
    k: Counter = Counter()
    out = {}
    for name, op, ne, row in nodes:
        out[(name, k[name])] = (op, ne, row)
        k[name] += 1
    return out


def compare_rows(probe: Probe, mode: str, rows: list[int], nodes: bool) -> None:
    ref_rows = rows[0]
    ref, _ = probe.row0(mode, ref_rows, nodes)
    ref_nodes = _keyed(probe.seen)
    same, parts = [], []
    for r in rows[1:]:
        got, _ = probe.row0(mode, r, nodes)
        if np.array_equal(ref, got):
            same.append(r)
            continue
        msg = f"{r} rows: max |logit difference| {float(np.abs(ref - got).max()):.3g}"
        if nodes:
            diffs = []
            for key, (op, ne, row) in _keyed(probe.seen).items():
                other = ref_nodes.get(key)
                if other is not None and other[2].shape == row.shape and not np.array_equal(row, other[2]):
                    diffs.append((key[0], op, ne, float(np.abs(row - other[2]).max())))
            if diffs:
                name, op, ne, d = diffs[0]
                msg += (f", first differing node '{name}' ({op}, ne {list(ne)}, {d:.3g}); by op: "
                        + ", ".join(f"{k} {v}" for k, v in Counter(o for _, o, _, _ in diffs).most_common()))
        parts.append(msg)
    print(f"{mode}: row 0 identical to {ref_rows} rows at " + (",".join(map(str, same)) or "none")
          + ("" if not parts else "; differs at " + "; ".join(parts)), flush=True)


def compare_prompt(probe: Probe) -> None:
    """The prompt in one batch (as ``eval`` and a prompt are processed) against token by token as
    generation's plain steps decode them (two rows, the second a throw-away copy in its own lane),
    and against single-row passes."""
    probe.set_mode("verifier")
    ctx, prompt = probe.ctx, probe.prompt
    n = len(prompt)
    ctx.clear()
    ctx.decode(prompt, range(n), logits=True)
    whole = np.stack([ctx.logits_ith(i).copy() for i in range(n)])
    for rows in (2, 1):
        ctx.clear()
        single = []
        for i, t in enumerate(prompt):
            ctx.decode([t] * rows, [i] * rows, seq_ids=[[s] for s in range(rows)], logits=[True] + [False] * (rows - 1))
            single.append(ctx.logits_ith(0).copy())
            if rows > 1:
                ctx.seq_rm(1, -1, -1)
        single = np.stack(single)
        eq = sum(np.array_equal(a, b) for a, b in zip(whole, single))
        what = "generation's steps (2 rows)" if rows == 2 else "single-row passes"
        print(f"prompt ({n} tokens): logits identical, one batch against {what}, at {eq} of {n} positions; "
              f"max |difference| {float(np.abs(whole - single).max()):.3g}", flush=True)
    probe.sm.residual.raise_pending_error()


def time_passes(probe: Probe, rows: list[int], repeat: int) -> None:
    modes = ("verifier", "verifier-no-invariance")
    res = probe.sm.residual
    print(f"verify pass time (logits of every row), median of {repeat}, interleaved (ms): rows, batch-invariant "
          "(of which attention's two products in the library), without (llama.cpp's attention and output "
          "head), ratio")
    for r in rows:
        t = {m: [] for m in modes}
        attn = []
        for _ in range(repeat):
            for m in modes:
                t[m].append(probe.row0(m, r, all_logits=True)[1])
                if m == "verifier":
                    attn.append(res.counters().seconds_attn)
        a, b = statistics.median(t[modes[0]]), statistics.median(t[modes[1]])
        print(f"  {r:4d} {a * 1e3:9.1f} ({statistics.median(attn) * 1e3:7.1f}) {b * 1e3:9.1f} {a / b:6.3f}", flush=True)


if __name__ == "__main__":
    main()
