"""Does a token's result depend on the rest of its batch? Row 0 of a pass decoded in a batch of 2
and in a batch of N (default 17, a 16-node tree plus its root), the other rows siblings in their own
sequences, with the residual on (the verifier: our products) and off (the drafter: llama.cpp's own
kernels); prints whether the logits are bit-identical and the largest difference.

    python bench/batch_invariance.py SPLIT_DIR [--rows 17] [--kernel amx-bf16] [--nodes]

With ``--nodes``, every node of the graph is observed (an eval callback in front of the library's
own, which it calls first) and the first ``ne[0]`` values of each F32 node in host memory (row 0:
the first token's, for nodes whose second dimension is the batch) are kept; the first node, in
graph order, whose row 0 differs between the two batch sizes is printed with its op and shape,
then the differing nodes by op. That is where a token's result starts to depend on its batch.
"""

from __future__ import annotations

import argparse
import ctypes
from collections import Counter

import numpy as np

from bitsplit_llama.speculative.engine import TreeShape, n_seq_max_for
from bitsplit_llama.runtime.verifier import SplitModel

PROMPT = "def quicksort(arr):\n    if len(arr) <= 1:\n        return arr\n    pivot = arr[len(arr) // 2]\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("split")
    ap.add_argument("--rows", type=int, default=17)
    ap.add_argument("--kernel", default=None, help="kernel family for the verifier (default: as a tree of rows-1 nodes)")
    ap.add_argument("--nodes", action="store_true", help="find the first graph node whose row 0 depends on the batch")
    a = ap.parse_args()
    if not 2 < a.rows <= 64:
        ap.error(f"--rows: {a.rows} must be in 3..64")
    sm = SplitModel(a.split, n_ctx=1024, n_batch=64, n_seq_max=max(a.rows, n_seq_max_for(TreeShape(16, 4, 7))),
                    fast_drafter=False)
    try:
        sm.residual.choose_decode_kernel(a.rows, a.kernel)
        prompt = sm.model.tokenize(PROMPT)
        n = len(prompt)

        def row0(rows: int, verify: bool) -> np.ndarray:
            sm.ctx.clear()
            with (sm.verifying() if verify else sm.drafting()) as ctx:
                ctx.decode(prompt, range(n), logits=False)
                for s in range(1, rows):
                    sm.ctx.seq_cp(0, s, 0, n)
                toks = [prompt[-1]] + [100 + i for i in range(rows - 1)]
                ctx.decode(toks, [n] * rows, seq_ids=[[s] for s in range(rows)], logits=True)
                return ctx.logits_ith(0).copy()

        if a.nodes:
            first_node(sm, prompt, a.rows)
            return
        for verify in (True, False):
            two, big, again = row0(2, verify), row0(a.rows, verify), row0(2, verify)
            name = f"verifier ({sm.residual.kernel})" if verify else "drafter (llama.cpp's kernels)"
            print(f"{name}: 2 rows twice identical: {np.array_equal(two, again)}; 2 vs {a.rows} rows identical: "
                  f"{np.array_equal(two, big)}, max |logit difference| {float(np.abs(two - big).max()):.3g}")
    finally:
        sm.close()


class _Tensor(ctypes.Structure):
    """The head of ggml.h's struct ggml_tensor (ggml 0.9.x, as vendored by llama-cpp-python 0.3.36)."""

    _fields_ = [("type", ctypes.c_int), ("buffer", ctypes.c_void_p), ("ne", ctypes.c_int64 * 4),
                ("nb", ctypes.c_size_t * 4), ("op", ctypes.c_int), ("op_params", ctypes.c_int32 * 16),
                ("flags", ctypes.c_int32), ("src", ctypes.c_void_p * 10), ("view_src", ctypes.c_void_p),
                ("view_offs", ctypes.c_size_t), ("data", ctypes.c_void_p), ("name", ctypes.c_char * 64)]


def first_node(sm: SplitModel, prompt: list[int], rows: int) -> None:
    import llama_cpp

    from bitsplit_llama import native
    from bitsplit_llama.runtime.llamacpp import Context

    ll = llama_cpp
    base = ctypes.CDLL(str(__import__("pathlib").Path(ll.__file__).parent / "lib" / "libggml-base.so"))
    base.ggml_backend_buffer_is_host.restype = ctypes.c_bool
    base.ggml_backend_buffer_is_host.argtypes = [ctypes.c_void_p]
    base.ggml_op_desc.restype = ctypes.c_char_p
    base.ggml_op_desc.argtypes = [ctypes.c_void_p]
    ours = ctypes.cast(ctypes.c_void_p(native.callback_address()), ll.ggml_backend_sched_eval_callback)
    ud = ctypes.c_void_p(sm.residual.address)
    seen: list[tuple[str, str, tuple, np.ndarray]] = []
    record = [False]

    def cb(t, ask, _user):
        r = ours(t, ask, ud)  # the library decides first (replace: it mutated the node)
        if ask:
            return True  # observe every node
        if record[0]:
            x = ctypes.cast(t, ctypes.POINTER(_Tensor)).contents
            if x.type == 0 and x.data and x.buffer and base.ggml_backend_buffer_is_host(x.buffer) and x.nb[0] == 4:
                n0 = int(x.ne[0])
                row = np.ctypeslib.as_array(ctypes.cast(x.data, ctypes.POINTER(ctypes.c_float)), shape=(n0,)).copy()
                seen.append((x.name.decode(errors="replace"), base.ggml_op_desc(t).decode(), tuple(x.ne), row))
        return r if not ask else True

    cfun = ll.ggml_backend_sched_eval_callback(cb)
    addr = ctypes.cast(cfun, ctypes.c_void_p).value
    ctx = Context(sm.model, n_ctx=1024, n_batch=64, n_seq_max=max(rows, 2), cb_eval=addr, cb_eval_user_data=0)
    n = len(prompt)
    try:
        runs = {}
        for verify in (True, False):
            for r in (2, rows):
                sm.residual.enabled = verify
                ctx.clear()
                record[0] = False
                ctx.decode(prompt, range(n), logits=False)
                for s in range(1, r):
                    ctx.seq_cp(0, s, 0, n)
                seen.clear()
                record[0] = True
                ctx.decode([prompt[-1]] + [100 + i for i in range(r - 1)], [n] * r, seq_ids=[[s] for s in range(r)],
                           logits=True)
                record[0] = False
                runs[(verify, r)] = list(seen)
            sm.residual.enabled = False
            a_, b_ = runs[(verify, 2)], runs[(verify, rows)]

            def keyed(nodes):  # names repeat ("norm-0" before attention and FFN): name + occurrence
                k: Counter = Counter()
                out = {}
                for name, op, ne, row in nodes:
                    out[(name, k[name])] = (op, ne, row)
                    k[name] += 1
                return out

            ka, kb = keyed(a_), keyed(b_)
            diffs = []
            for key, (op, ne, row) in ka.items():
                name = key[0]
                other = kb.get(key)
                if other is None or other[2].shape != row.shape:
                    continue
                if not np.array_equal(row, other[2]):
                    diffs.append((name, op, ne, float(np.abs(row - other[2]).max())))
            who = f"verifier ({sm.residual.kernel})" if verify else "drafter (llama.cpp's kernels)"
            if not diffs:
                print(f"{who}: {len(a_)} nodes compared, row 0 identical in every one at 2 and {rows} rows")
                continue
            name, op, ne, d = diffs[0]
            print(f"{who}: {len(a_)} nodes compared; first differing at 2 vs {rows} rows: '{name}' ({op}, ne "
                  f"{list(ne)}), max |difference| {d:.3g}; differing nodes by op: "
                  + ", ".join(f"{k} {v}" for k, v in Counter(o for _, o, _, _ in diffs).most_common()))
    finally:
        sm.residual.enabled = False
        ctx.close()


if __name__ == "__main__":
    main()
