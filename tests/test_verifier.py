"""The native residual library inside llama.cpp: exactness, switching, reuse, refusal of bad input."""

from __future__ import annotations

import shutil
import struct
from pathlib import Path

import numpy as np
import pytest
from gguf.constants import GGMLQuantizationType as QT

from bitsplit_llama.errors import GGUFFormatError, InputError, InvalidOptionError, MismatchError, UnsupportedModelError
from bitsplit_llama.formats import _ggml
from bitsplit_llama.formats.gguf_file import GGUFFile
from bitsplit_llama.formats.split import make_residual, split_model
from bitsplit_llama.native.residual import Residual
from bitsplit_llama.runtime.llamacpp import Context, Model
from bitsplit_llama.runtime.verifier import SplitModel
from synth import tiny_llama_weights, write_llama_gguf

TOKENS = [1] + list(range(260, 300))
EXACT = dict(n_ctx=128, n_batch=64, kv_type="f32", flash_attn=False)  # llama.cpp's own batch noise off


def _q2(v: np.ndarray) -> np.ndarray:
    sh = v.shape
    flat = v.reshape(-1, sh[-1])
    return _ggml.dequantize_rows(_ggml.quantize_rows(flat, QT.Q2_K), QT.Q2_K, sh[-1]).reshape(sh)


def make_f32_split(d: Path, n_expert: int = 0, seed: int = 3) -> tuple[Path, Path]:
    """source (F32) + split whose base is dequant(Q2_K(W)) stored as F32 and residual F32: the
    verifier must then equal the source model up to float rounding."""
    d.mkdir(parents=True, exist_ok=True)
    w = tiny_llama_weights(seed, n_expert=n_expert)
    src = write_llama_gguf(d / "src.gguf", w)
    w2 = {k: (_q2(v) if v.ndim >= 2 and not k.endswith("gate_inp.weight") else v) for k, v in w.items()}
    (d / "split").mkdir(exist_ok=True)
    write_llama_gguf(d / "split" / "base.gguf", w2)
    make_residual(src, d / "split" / "base.gguf", d / "split" / "residual.gguf", residual="f32")
    return src, d / "split"


def logits_of(path: Path, tokens=TOKENS, **kw) -> np.ndarray:
    m = Model(path)
    c = Context(m, **kw)
    try:
        c.decode(tokens, list(range(len(tokens))))
        return c.logits(len(tokens)).copy()
    finally:
        c.close()
        m.close()


@pytest.mark.parametrize("n_expert", [0, 4], ids=["dense", "moe"])
def test_f32_split_verifier_equals_source(tmp_path, n_expert):
    src, split = make_f32_split(tmp_path, n_expert)
    ref = logits_of(src, **EXACT)
    base = logits_of(split / "base.gguf", **EXACT)
    with SplitModel(split, **EXACT) as sm:
        with sm.verifying() as ctx:
            ctx.decode(TOKENS, list(range(len(TOKENS))))
            ver = ctx.logits(len(TOKENS)).copy()
        c = sm.residual.counters()
    assert np.abs(base - ref).max() > 0.1  # the base alone is far off...
    assert np.abs(ver - ref).max() < 1e-3  # ...base + residual is the source
    # every weight product and the embedding went through the library, nothing refused
    n_layers = 2
    assert c.n_products == n_layers * 7 + 1 and c.n_get_rows == 1 and c.n_errors == 0
    assert c.n_columns > 0 and c.bytes_residual > 0


def test_disabled_hook_leaves_base_bit_identical(tmp_path):
    _, split = make_f32_split(tmp_path)
    # a split context uses llama.cpp's plain attention on the CPU (batch invariance): so does the reference
    plain = logits_of(split / "base.gguf", n_ctx=128, n_batch=64, flash_attn=False)
    # fast_drafter=False: drafting runs llama.cpp's own kernels, so the logits are the base's bit for bit
    with SplitModel(split, n_ctx=128, n_batch=64, fast_drafter=False) as sm:
        for _ in range(2):  # the second pass reuses llama.cpp's graph, which the verifier mutated
            sm.ctx.clear()
            with sm.verifying() as ctx:
                ctx.decode(TOKENS, list(range(len(TOKENS))))
            sm.ctx.clear()
            with sm.drafting() as ctx:
                ctx.decode(TOKENS, list(range(len(TOKENS))))
                draft = ctx.logits(len(TOKENS)).copy()
            assert np.array_equal(draft, plain)
        assert sm.residual.counters().n_errors == 0
    # the native drafter takes only products its integer kernel does faster than ggml (K-quant and
    # Q8_0 bases): an F32 base is left to llama.cpp, bit for bit (where this CPU has a drafting
    # family; elsewhere the default drafter is llama.cpp's and takes nothing either)
    from bitsplit_llama.native import policy

    with SplitModel(split, n_ctx=128, n_batch=64, fast_drafter=policy.draft_kernel() is not None) as sm:
        with sm.drafting() as ctx:
            ctx.decode(TOKENS, list(range(len(TOKENS))))
            draft = ctx.logits(len(TOKENS)).copy()
        assert sm.residual.counters().n_draft_products == 0
    assert np.array_equal(draft, plain)


def test_verifier_is_deterministic_across_graph_reuse(tmp_path):
    _, split = make_f32_split(tmp_path)
    outs = []
    with SplitModel(split, n_ctx=128, n_batch=64) as sm:
        for _ in range(3):
            sm.ctx.clear()
            with sm.verifying() as ctx:
                ctx.decode(TOKENS, list(range(len(TOKENS))))
                outs.append(ctx.logits(len(TOKENS)).copy())
    assert np.array_equal(outs[0], outs[1]) and np.array_equal(outs[1], outs[2])


def test_add_mode_matches_replace_mode(tmp_path):
    """The GPU path (keep the graph's W2.x, add R.x) run on the CPU agrees with the fused product."""
    src, split = make_f32_split(tmp_path)
    with SplitModel(split, **EXACT) as sm:
        with sm.verifying() as ctx:
            ctx.decode(TOKENS, list(range(len(TOKENS))))
            fused = ctx.logits(len(TOKENS)).copy()
        sm.residual.set_mode("add")
        sm.ctx.clear()
        with sm.verifying() as ctx:
            ctx.decode(TOKENS, list(range(len(TOKENS))))
            added = ctx.logits(len(TOKENS)).copy()
        c = sm.residual.counters()
    assert c.n_add_products == 15 and c.n_get_rows == 2
    assert np.abs(fused - added).max() < 1e-3


def test_matmul_matches_numpy(tiny_split, tiny_f32):
    with Residual(tiny_split) as r, GGUFFile(tiny_split / "base.gguf") as b, \
            GGUFFile(tiny_split / "residual.gguf") as rg:
        name = "blk.0.ffn_down.weight"
        bt, rt = b.tensor(name), rg.tensor(name)
        W2 = _ggml.dequantize_rows(b.read_rows(bt, 0, bt.n_rows), bt.ggml_type, bt.n_per_row)
        R = _ggml.dequantize_rows(rg.read_rows(rt, 0, rt.n_rows), rt.ggml_type, rt.n_per_row)
        x = np.random.default_rng(0).standard_normal((5, bt.n_per_row)).astype(np.float32)
        x[:, 3] *= 200.0  # an outlier channel: no block scale may flatten its neighbours
        r.set_precision("f32")
        y = r.matmul(name, x)
        ref = x.astype(np.float64) @ (W2.astype(np.float64) + R).T
        assert np.abs(y - ref).max() / np.abs(ref).max() < 1e-5
        r.set_precision("bf16")
        yb = r.matmul(name, x)
        assert np.abs(yb - ref).max() / np.abs(ref).max() < 1e-2
        yr = r.matmul(name, x, with_base=False)
        assert np.abs(yr - x @ R.T).max() / np.abs(x @ R.T).max() < 1e-2


def test_batch_invariance_of_products(tiny_split):
    """Within a family (a generation pins one), a column's result does not depend on the other
    columns of the batch (bit for bit)."""
    from bitsplit_llama.native import policy

    with Residual(tiny_split) as r:
        x = np.random.default_rng(1).standard_normal((16, 256)).astype(np.float32)
        for fam in policy.families():
            r.set_kernel(fam)
            for prec in ("f32", "bf16"):
                r.set_precision(prec)
                full = r.matmul("blk.1.attn_q.weight", x)
                for n in (1, 3, 7):
                    assert np.array_equal(r.matmul("blk.1.attn_q.weight", x[:n]), full[:n]), (fam, prec, n)


# -- refusal ------------------------------------------------------------------------------------

def test_residual_of_another_model_refused(tmp_path):
    a = write_llama_gguf(tmp_path / "a.gguf", tiny_llama_weights(1))
    b = write_llama_gguf(tmp_path / "b.gguf", tiny_llama_weights(2))
    split_model(a, tmp_path / "A", threads=2)
    split_model(b, tmp_path / "B", threads=2)
    shutil.copy(tmp_path / "B" / "residual.gguf", tmp_path / "A" / "residual.gguf")
    with pytest.raises(MismatchError, match="not made from this base"):
        SplitModel(tmp_path / "A")


def test_native_refuses_shape_mismatch_with_tensor_name(tmp_path):
    """Even past the Python checks, the C library names the first bad tensor."""
    a = write_llama_gguf(tmp_path / "a.gguf", tiny_llama_weights(1))
    b = write_llama_gguf(tmp_path / "b.gguf", tiny_llama_weights(1, n_ff=768))
    split_model(a, tmp_path / "A", threads=2)
    split_model(b, tmp_path / "B", threads=2)
    with pytest.raises(MismatchError, match=r"tensor 'blk\.0\.ffn_(down|gate|up)\.weight' is"):
        Residual(base=tmp_path / "A" / "base.gguf", residual=tmp_path / "B" / "residual.gguf",
                 check_fingerprint=False)


def _corrupt(path: Path, out: Path, mutate) -> Path:
    data = bytearray(path.read_bytes())
    mutate(data)
    out.write_bytes(bytes(data))
    return out


def _tensor_info_offset(path: Path, name: str) -> int:
    data = path.read_bytes()
    i = data.find(name.encode())
    assert i > 0
    return i + len(name)  # n_dims (u32) follows the name


@pytest.mark.parametrize("case", ["truncated", "dims", "type", "offset", "not-gguf", "empty"])
def test_crafted_residual_refused_by_native(tiny_split, tmp_path, case):
    """Corrupt residual.gguf files handed straight to the C loader: a clean error, never a crash."""
    from bitsplit_llama import native

    src = tiny_split / "residual.gguf"
    name = "blk.0.ffn_up.weight"
    off = _tensor_info_offset(src, name)
    bad = tmp_path / "residual.gguf"
    if case == "truncated":
        _corrupt(src, bad, lambda d: d.__delitem__(slice(len(d) - 5000, len(d))))
    elif case == "dims":
        _corrupt(src, bad, lambda d: d.__setitem__(slice(off + 4, off + 12), struct.pack("<Q", 1 << 40)))
    elif case == "type":
        _corrupt(src, bad, lambda d: d.__setitem__(slice(off + 4 + 16, off + 24), struct.pack("<I", 99)))
    elif case == "offset":
        _corrupt(src, bad, lambda d: d.__setitem__(slice(off + 24, off + 32), struct.pack("<Q", 1 << 50)))
    elif case == "not-gguf":
        bad.write_bytes(b"not a gguf at all" * 100)
    else:
        bad.write_bytes(b"")
    ffi, lib = native.load()
    out = ffi.new("bitsplit_ctx **")
    err = ffi.new("char[]", 512)
    st = lib.bitsplit_ctx_load(str(bad).encode(), str(tiny_split / "base.gguf").encode(), out, err, 512)
    assert st != 0 and out[0] == ffi.NULL
    assert ffi.string(err).decode()
    # and the Python entry point refuses it with a message naming the file
    with pytest.raises((GGUFFormatError, InputError, UnsupportedModelError)) as ei:
        Residual(base=tiny_split / "base.gguf", residual=bad)
    assert str(bad) in str(ei.value)


def test_fast_drafter_computes_the_base_products(tiny_split):
    """With the residual off, the native drafting family (where this CPU has one) computes the base's
    products of batches from its measured smallest one (where it beats ggml: 1 token with the
    256-bit integer families, 2 with vnni-int24); its logits are the base's up to activation
    rounding, and a narrower pass is left to ggml."""
    from bitsplit_llama.native import policy

    if policy.draft_kernel() is None:
        pytest.skip(f"no native drafting family on this CPU under BITSPLIT_MAX_ISA={policy.max_isa()} "
                    "(test_stock_drafter_without_a_native_family covers it)")
    toks = TOKENS[:20]
    with SplitModel(tiny_split, n_ctx=128, n_batch=64, fast_drafter=False) as sm:
        with sm.drafting() as ctx:
            ctx.decode(toks, list(range(len(toks))))
            stock = ctx.logits(len(toks)).copy()
        assert sm.residual.counters().n_draft_products == 0
    with SplitModel(tiny_split, n_ctx=128, n_batch=64, fast_drafter=True) as sm:
        with sm.drafting() as ctx:
            ctx.decode(toks, list(range(len(toks))))
            fast = ctx.logits(len(toks)).copy()
            c = sm.residual.counters()
            assert c.n_draft_products == 15 and c.n_products == 0  # 2 layers x 7 + the output head
            ctx.decode(toks[:1], [len(toks)])  # one token: the family's if it drafts from 1 column
            one = sm.residual.counters().n_draft_products - 15
            assert one == (15 if policy.draft_min_cols() <= 1 else 0)
    # both round activations to 8 bits per 256 values, ggml to Q8_K and the native kernel its own way
    assert np.abs(fast - stock).max() < 0.1 * np.abs(stock).max()
    assert np.mean(np.argmax(fast, axis=1) == np.argmax(stock, axis=1)) > 0.9


def test_draft_vocabulary_computes_the_kept_rows_of_the_head(exact_split):
    """A draft vocabulary: drafting passes compute the exact output head for token ids [0, rows) and
    [tail, n_vocab) alone, in this library at any width (one token too, where ggml drafts the rest),
    and give the others -inf; the kept rows are the whole head's up to activation rounding. Verify
    passes keep the whole head."""
    from bitsplit_llama.native import policy

    if policy.draft_kernel() is None:
        pytest.skip(f"no native drafting family on this CPU under BITSPLIT_MAX_ISA={policy.max_isa()}")
    toks = TOKENS[:6]

    def passes(sm):
        out = []
        with sm.drafting() as ctx:
            ctx.clear()
            ctx.decode(toks, list(range(len(toks))))
            out.append(ctx.logits(len(toks)).copy())
            c0 = sm.residual.counters().n_draft_products
            ctx.decode(toks[:1], [len(toks)])  # one token
            out.append(ctx.logits(1).copy())
            out.append(sm.residual.counters().n_draft_products - c0)
        return out

    with SplitModel(exact_split, n_ctx=128, n_batch=64, fast_drafter=True, draft_vocab="all") as sm:
        assert sm.draft_vocab.rows == 0
        whole6, whole1, n1 = passes(sm)
        n_vocab = sm.model.n_vocab
        n_res = sum(t[0] != "token_embd.weight" for t in sm.residual.tensors())  # products with a residual
        with sm.verifying() as ctx:
            ctx.clear()
            ctx.decode(toks, list(range(len(toks))))
            verified = ctx.logits(len(toks)).copy()
    # at one token the base's products where the family drafts from 1 column; the exact head is ggml's
    assert n1 == (n_res if policy.draft_min_cols() <= 1 else 0)
    rows = n_vocab // 4
    for tail in (n_vocab, n_vocab - 7):
        with SplitModel(exact_split, n_ctx=128, n_batch=64, fast_drafter=True, draft_vocab=rows) as sm:
            assert sm.draft_vocab.rows == rows and sm.draft_vocab.active
            sm.residual.set_draft_vocab(rows, tail)
            kept6, kept1, k1 = passes(sm)
            assert k1 == n1 + 1  # the head, at one token too
            with sm.verifying() as ctx:
                ctx.clear()
                ctx.decode(toks, list(range(len(toks))))
                assert np.array_equal(ctx.logits(len(toks)), verified)  # the verifier's head is whole
        for kept, whole in ((kept6, whole6), (kept1, whole1)):
            assert np.all(kept[:, rows:tail] == -np.inf) and np.all(np.isfinite(kept[:, :rows]))
            assert np.all(np.isfinite(kept[:, tail:]))
            keep = np.r_[0:rows, tail:n_vocab]
            # 8-bit activations here and in ggml's Q8_K, each rounded its own way
            assert np.abs(kept[:, keep] - whole[:, keep]).max() < 0.05 * np.abs(whole).max()
    with SplitModel(exact_split, n_ctx=128, n_batch=64, fast_drafter=True) as sm:
        for bad in ((-1, 10), (10, 9)):
            with pytest.raises(InvalidOptionError, match="draft vocabulary"):
                sm.residual.set_draft_vocab(*bad)
    for bad in ("none", 0, -5, "12x"):
        with pytest.raises(InvalidOptionError, match="--draft-vocab"):
            SplitModel(exact_split, n_ctx=128, n_batch=64, draft_vocab=bad)
    # a number needs the native drafter and an exact head; auto then leaves the whole head
    with pytest.raises(InvalidOptionError, match="--draft-vocab 10: needs the native drafter"):
        SplitModel(exact_split, n_ctx=128, n_batch=64, fast_drafter=False, draft_vocab=10)
    with SplitModel(exact_split, n_ctx=128, n_batch=64, fast_drafter=False) as sm:
        assert sm.draft_vocab.rows == 0


def test_draft_vocabulary_watches_the_text(exact_split, tiny_split):
    """The draft vocabulary steps aside while more than 5% of the last 64 tokens fall outside it (a
    language whose tokens have high ids), and comes back when they no longer do; auto leaves a small
    vocabulary and a split (not exact) head whole."""
    from bitsplit_llama.native import policy
    from bitsplit_llama.runtime.verifier import DraftVocab

    if policy.draft_kernel() is None:
        pytest.skip(f"no native drafting family on this CPU under BITSPLIT_MAX_ISA={policy.max_isa()}")
    with SplitModel(exact_split, n_ctx=128, n_batch=64, fast_drafter=True) as sm:
        assert sm.draft_vocab.rows == 0  # auto: this vocabulary is far below twice DRAFT_VOCAB
        n_vocab = sm.model.n_vocab
    rows = n_vocab // 2

    def head(sm):
        with sm.drafting() as ctx:
            ctx.clear()
            ctx.decode(TOKENS[:1], [0])
            return ctx.logits(1).copy()

    with SplitModel(exact_split, n_ctx=128, n_batch=64, fast_drafter=True, draft_vocab=rows) as sm:
        v = sm.draft_vocab
        assert v.active and np.isinf(head(sm)[0, rows:]).all()
        v.note([5] * 60 + [rows] * 3)  # 3 of 63 outside: 4.8%
        assert v.active
        v.note([rows])  # 4 of 64: 6.25%
        assert not v.active and np.isfinite(head(sm)).all()
        v.note([7] * 20)  # the last 64 hold 4 outside until they leave the window
        assert not v.active
        v.note([7] * 44)
        assert v.active and np.isinf(head(sm)[0, rows:]).all()
        assert DraftVocab.WINDOW == 64 and DraftVocab.MAX_OUTSIDE == 0.05
    with pytest.raises(InvalidOptionError, match="head split or tied"):
        SplitModel(tiny_split, n_ctx=128, n_batch=64, fast_drafter=True, draft_vocab=10)


def test_stock_drafter_without_a_native_family(tiny_split):
    """Where no native drafting family runs, the drafter is llama.cpp's own kernels, reported as such,
    and the library takes none of the base's products: the logits are the base's bit for bit."""
    from bitsplit_llama.native import policy

    if policy.draft_kernel() is not None:
        pytest.skip(f"this CPU has the native drafting family {policy.draft_kernel()}")
    toks = TOKENS[:20]
    with SplitModel(tiny_split, n_ctx=128, n_batch=64) as sm:
        assert sm.fast_drafter is False and sm.drafter == "llama.cpp"
        with sm.drafting() as ctx:
            ctx.decode(toks, list(range(len(toks))))
            auto = ctx.logits(len(toks)).copy()
        assert sm.residual.counters().n_draft_products == 0
    with SplitModel(tiny_split, n_ctx=128, n_batch=64, fast_drafter=False) as sm:
        with sm.drafting() as ctx:
            ctx.decode(toks, list(range(len(toks))))
            assert np.array_equal(ctx.logits(len(toks)), auto)


def test_split_contexts_keep_their_layers_off_op_offload(tiny_split):
    """A GPU build of llama.cpp computes the large batches of a layer left in RAM on the GPU, from a
    copy of its weight named "CUDA0#blk...#0" (op offload): a second code path by batch size, and on
    an H200 the residual went missing there (verifier KL = the base alone's). Split contexts, the
    user's and those made for measurements, turn it off."""
    with SplitModel(tiny_split, n_ctx=64, n_batch=64) as sm:
        assert sm.ctx._params.op_offload is False
        with sm.own_context(n_ctx=32, n_batch=32, n_seq_max=1) as view:
            assert view.ctx._params.op_offload is False
