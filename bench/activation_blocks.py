"""How often real activations let the residual take the high digit alone: the share of blocks of 256
values, in the inputs of every product with a residual, whose largest magnitude is within BS_HI_SPAN
(16) times their mean (the integer families' rule, on the same 16-bit integers), and the share of
pairs of consecutive tokens that both do, per kind of weight. `R·x` alone (add mode) multiplies one
digit in those blocks, and `avx512vnni-int16` runs its register tiles on such pairs of columns
(README: "`R·x` alone in tiles"); `native_ab.py` and `residual_speed.py` feed Gaussian columns,
every block of which qualifies.

    python bench/activation_blocks.py SPLIT_DIR [--prompts FILE.json] [--tokens 256]

The prompts (default: the auto tree's four calibration prompts) are decoded by the verifier
(residual on) in one batch each, and the input of each hooked product is read in an eval callback
placed in front of the library's.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import re
from collections import defaultdict
from pathlib import Path

import numpy as np

from batch_invariance import _Tensor  # the head of struct ggml_tensor, this folder's batch_invariance.py
from bitsplit_llama.errors import BitsplitError
from bitsplit_llama.runtime.verifier import SplitModel

XMAX = 32512  # BS_XMAX2: the verifier's 16-bit integer activations (native/bs_codes.h)
HI_SPAN = 16  # BS_HI_SPAN
QA = 256  # a block: the superblock types' unit


def hi_blocks(x: np.ndarray) -> np.ndarray:
    """x: (rows, K) float32 -> (rows, K // QA) bool: the block takes the high digit alone, by the
    native rule: X = round(x * XMAX / max|x|) (clamped), HI_SPAN * sum |X| >= QA * XMAX."""
    rows, k = x.shape
    b = x.reshape(rows, k // QA, QA).astype(np.float32)
    amax = np.abs(b).max(axis=2, keepdims=True)
    inv = np.where(amax > 0, np.float32(XMAX) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
    X = np.clip(np.rint(b * inv), -XMAX, XMAX).astype(np.int64)
    return HI_SPAN * np.abs(X).sum(axis=2) >= QA * XMAX


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("split", type=Path)
    ap.add_argument("--prompts", type=Path, default=None, help="JSON list of strings (default: the calibration prompts)")
    ap.add_argument("--tokens", type=int, default=256, help="at most this many tokens of each prompt")
    a = ap.parse_args()
    if a.prompts is None:
        from bitsplit_llama.speculative.autotree import CALIBRATION_PROMPTS

        prompts = list(CALIBRATION_PROMPTS)
    else:
        try:
            prompts = json.loads(a.prompts.read_text())
        except (OSError, ValueError) as exc:
            ap.error(f"--prompts: {a.prompts}: {exc}")
        if not isinstance(prompts, list) or not prompts or not all(isinstance(p, str) for p in prompts):
            ap.error(f"--prompts: {a.prompts}: expected a JSON list of strings")
    if a.tokens < 2:
        ap.error(f"--tokens: {a.tokens}: at least 2")

    import llama_cpp

    from bitsplit_llama import native
    from bitsplit_llama.runtime.llamacpp import Context

    try:
        sm = SplitModel(a.split, n_ctx=a.tokens + 16, n_batch=a.tokens, fast_drafter=False)
    except BitsplitError as exc:
        raise SystemExit(f"activation_blocks.py: {exc}") from None
    base = ctypes.CDLL(str(Path(llama_cpp.__file__).parent / "lib" / "libggml-base.so"))
    base.ggml_backend_buffer_is_host.restype = ctypes.c_bool
    base.ggml_backend_buffer_is_host.argtypes = [ctypes.c_void_p]
    ours = ctypes.cast(ctypes.c_void_p(native.callback_address()), llama_cpp.ggml_backend_sched_eval_callback)
    ud = ctypes.c_void_p(sm.residual.address)
    with_res = {n for n, _, _, _ in sm.residual.tensors()}
    blocks: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0, 0])  # hi, blocks, both-hi pairs, pairs

    def cb(t, ask, _user):
        r = ours(t, ask, ud)
        if ask:
            return True
        node = ctypes.cast(t, ctypes.POINTER(_Tensor)).contents
        if not node.src[0] or not node.src[1]:
            return r
        w = ctypes.cast(node.src[0], ctypes.POINTER(_Tensor)).contents
        name = w.name.decode(errors="replace")
        if name not in with_res:
            return r
        x = ctypes.cast(node.src[1], ctypes.POINTER(_Tensor)).contents
        k, rows = int(x.ne[0]), int(x.ne[1])
        if x.type != 0 or not x.data or not base.ggml_backend_buffer_is_host(x.buffer) or k % QA or x.nb[0] != 4:
            return r
        arr = np.ctypeslib.as_array(ctypes.cast(x.data, ctypes.POINTER(ctypes.c_uint8)), shape=(rows * int(x.nb[1]),))
        xs = np.lib.stride_tricks.as_strided(arr.view(np.float32), shape=(rows, k), strides=(int(x.nb[1]), 4)).copy()
        hi = hi_blocks(xs)
        kind = re.sub(r"^blk\.\d+\.", "", name)
        acc = blocks[kind]
        acc[0] += int(hi.sum())
        acc[1] += hi.size
        if rows > 1:
            acc[2] += int((hi[:-1] & hi[1:]).sum())
            acc[3] += (rows - 1) * hi.shape[1]
        return r

    cfun = llama_cpp.ggml_backend_sched_eval_callback(cb)
    ctx = Context(sm.model, n_ctx=a.tokens + 16, n_batch=a.tokens, cb_eval=ctypes.cast(cfun, ctypes.c_void_p).value,
                  cb_eval_user_data=0)
    try:
        sm.residual.enabled = True
        n_tok = 0
        for p in prompts:
            toks = sm.model.tokenize(p)[: a.tokens]
            ctx.clear()
            ctx.decode(toks, range(len(toks)), logits=False)
            sm.residual.raise_pending_error()
            n_tok += len(toks)
    finally:
        ctx.close()
        sm.close()
    if not blocks:
        raise SystemExit(f"{a.split}: no product with a residual had inputs in blocks of {QA} (rows of a multiple of "
                         f"{QA} values, float32, in host memory): nothing to count")
    print(f"{a.split}: {len(prompts)} prompts, {n_tok} tokens; blocks of {QA}, high digit alone where max|x| <= "
          f"{HI_SPAN} x mean|x|")
    print(f"{'weight':<22} {'blocks':>9} {'high digit alone':>17} {'both of a pair':>15}")
    tot = [0, 0, 0, 0]
    for kind in sorted(blocks):
        h, n, ph, pn = blocks[kind]
        tot = [u + v for u, v in zip(tot, blocks[kind])]
        print(f"{kind:<22} {n:>9} {h / n:>16.1%} {ph / pn if pn else float('nan'):>15.1%}")
    print(f"{'all':<22} {tot[1]:>9} {tot[0] / tot[1]:>16.1%} {tot[2] / tot[3] if tot[3] else float('nan'):>15.1%}")


if __name__ == "__main__":
    main()
