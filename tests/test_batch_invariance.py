"""Batch invariance of the verifier: a row's logits do not depend on the rest of its batch, so that
speculative greedy output is plain decoding's at any tree size, and a prompt decoded in one batch
gives the logits generation's steps give."""

from __future__ import annotations

import numpy as np
import pytest

from bitsplit_llama.runtime.verifier import SplitModel
from bitsplit_llama.speculative.generate import Generator

PROMPT = [1] + list(range(260, 290))
PROMPTS = [[1] + list(range(280 + 5 * p, 294 + 5 * p)) for p in range(4)]


def _row0(sm: SplitModel, rows: int, prompt: list[int] = PROMPT) -> np.ndarray:
    """Row 0's logits in a verify pass of ``rows`` rows (siblings in their own sequences)."""
    n = len(prompt)
    sm.ctx.clear()
    with sm.verifying() as ctx:
        for i in range(0, n, ctx.n_batch):
            ctx.decode(prompt[i:i + ctx.n_batch], range(i, min(n, i + ctx.n_batch)), logits=False)
        for s in range(1, rows):
            ctx.seq_cp(0, s, 0, n)
        ctx.decode([prompt[-1]] + [3 + (i * 7) % 330 for i in range(rows - 1)], [n] * rows, seq_ids=[[s] for s in range(rows)])
        return ctx.logits_ith(0).copy()


def test_exact_weights_are_in_the_split(exact_split):
    from bitsplit_llama.native.residual import Residual

    with Residual(exact_split) as r:
        names = {t[0] for t in r.tensors()}
        assert r.exact_tensors() == ["output.weight"]
    assert "output.weight" not in names and "blk.0.attn_q.weight" in names


def test_row0_does_not_depend_on_the_batch(exact_split):
    rows = [1, 2, 3, 4, 5, 8, 16, 17, 33, 63, 64, 65, 100, 130]
    with SplitModel(exact_split, n_ctx=256, n_batch=max(rows), n_seq_max=max(rows)) as sm:
        sm.residual.choose_decode_kernel(17)
        sm.residual.reset_counters()
        ref = _row0(sm, 1)
        c = sm.residual.counters()
        assert c.n_exact_products > 0  # the output head ran in the library
        assert c.n_attn_products > 0  # and attention's products (one row: ggml's dot product, not its GEMM)
        for r in rows[1:]:
            got = _row0(sm, r)
            assert np.array_equal(got, ref), (r, float(np.abs(got - ref).max()))


def test_row0_does_not_depend_on_the_batch_past_512_cached_positions(exact_split):
    """llama.cpp's CPU flash attention splits the cache for a single row from 512 cached positions."""
    prompt = [1] + [3 + (i * 11) % 330 for i in range(599)]
    with SplitModel(exact_split, n_ctx=768, n_batch=256, n_seq_max=8) as sm:
        sm.residual.choose_decode_kernel(17)
        ref = _row0(sm, 1, prompt)
        for r in (2, 3, 8):
            got = _row0(sm, r, prompt)
            assert np.array_equal(got, ref), (r, float(np.abs(got - ref).max()))


def test_invariance_off_leaves_attention_and_the_output_head_to_ggml(exact_split):
    """Off: nothing without residual is computed here; the logits differ from the invariant
    verifier's only by rounding (the library's product of the exact head is right)."""
    with SplitModel(exact_split, n_ctx=256, n_batch=32, n_seq_max=4) as sm:
        sm.residual.choose_decode_kernel(17)
        inv = _row0(sm, 2)
        sm.residual.batch_invariant = False
        sm.residual.reset_counters()
        off = _row0(sm, 2)
        c = sm.residual.counters()
        assert c.n_exact_products == 0 and c.n_attn_products == 0
        assert c.n_products > 0
    assert np.abs(inv - off).max() < 2e-2 * np.abs(off).max()
    assert int(np.argmax(inv)) == int(np.argmax(off))


@pytest.mark.parametrize("n_prompt", [31, 600])
def test_prompt_in_one_batch_equals_generation_steps(exact_split, n_prompt):
    """eval decodes a prompt in one batch, generation one token at a time (two-row steps); single
    rows too. 600 tokens: past 512 cached positions and 64-row batches."""
    prompt = PROMPT if n_prompt == len(PROMPT) else [1] + [3 + (i * 11) % 330 for i in range(n_prompt - 1)]
    n = len(prompt)
    with SplitModel(exact_split, n_ctx=768, n_batch=n, n_seq_max=4) as sm:
        sm.residual.choose_decode_kernel(17)
        with sm.verifying() as ctx:
            ctx.decode(prompt, range(n), logits=True)
            whole = np.stack([ctx.logits_ith(i).copy() for i in range(n)])
            for rows in (2, 1):
                ctx.clear()
                for i, t in enumerate(prompt):
                    ctx.decode([t] * rows, [i] * rows, seq_ids=[[s] for s in range(rows)],
                               logits=[True] + [False] * (rows - 1))
                    assert np.array_equal(ctx.logits_ith(0), whole[i]), (rows, i)
                    ctx.seq_rm(1, -1, -1)


@pytest.mark.parametrize("nodes", [1, 4, 16, 64, 256])
def test_greedy_speculative_equals_verifier_alone_at_any_tree_size(exact_split, nodes):
    n = 48 if nodes <= 16 else nodes + 32  # room for whole trees (a cycle drafts at most what is left to emit)
    # full trees: no early stop (its threshold is measured, so the trees' sizes would depend on timing);
    # the drafter's alone, so that the rows are the tree's (text branches: tests/test_engine.py)
    with Generator(exact_split, n_ctx=768, tree_nodes=nodes, text_nodes=0, draft_stop="off") as g:
        rows = []
        decode = g.sm.ctx.decode

        def spy(tokens, positions, seq_ids=None, logits=True):
            rows.append(len(tokens))
            return decode(tokens, positions, seq_ids=seq_ids, logits=logits)

        g.sm.ctx.decode = spy
        for p in PROMPTS:
            plain = g.generate(p, max_tokens=n, speculative=False)
            spec = g.generate(p, max_tokens=n, speculative=True)
            assert spec.tokens == plain.tokens, (nodes, p)
        # the trees were as large as asked (one lane per leaf: 256 nodes fit llama.cpp's 256 sequences)
        assert nodes + 1 in rows and max(rows) <= max(nodes + 1, max(map(len, PROMPTS))), sorted(set(rows))


def test_prompts_run_in_prompt_mode_and_generation_on_the_pinned_family(exact_split):
    """The engine decodes a prompt in prompt mode (the kernel policy's family for a 64-row batch,
    whatever each pass's size: the family pinned for a generation's passes of a few rows can be
    several times slower on 64-row prompt batches), every pass after it outside; greedy
    speculative output stays plain decoding's, and a cached prompt gives the same output."""
    prompt = [1] + [3 + (i * 11) % 330 for i in range(99)]
    with Generator(exact_split, n_ctx=256, tree_nodes=4, draft_stop="off") as g:
        seen = []
        decode = g.sm.ctx.decode

        def spy(tokens, positions, seq_ids=None, logits=True):
            seen.append((len(tokens), g.sm.residual.prompt_mode))
            return decode(tokens, positions, seq_ids=seq_ids, logits=logits)

        g.sm.ctx.decode = spy
        plain = g.generate(prompt, max_tokens=24, speculative=False)
        assert sum(n for n, on in seen if on) == len(prompt)  # the whole prompt, in prompt mode
        assert any(not on for _, on in seen)  # the generation's passes outside it
        seen.clear()
        spec = g.generate(prompt, max_tokens=24, speculative=True)  # reuses all but the last token
        assert [n for n, on in seen if on] == [1]
        assert spec.tokens == plain.tokens
        g.engine.reset()
        assert g.generate(prompt, max_tokens=24, speculative=True).tokens == plain.tokens
        assert not g.sm.residual.prompt_mode


def test_parked_rows_freed_in_order_keep_greedy_identity(exact_split):
    """A context too small to keep every parked rejected row: the engine frees them by decoding the
    text after the first one again (cells stay in position order); output stays the verifier's."""
    with Generator(exact_split, n_ctx=160, tree_nodes=64, draft_stop="off") as g:
        rebuilt = 0
        for p in PROMPTS:
            plain = g.generate(p, max_tokens=140, speculative=False)
            spec = g.generate(p, max_tokens=140, speculative=True)
            assert spec.tokens == plain.tokens, p
            rebuilt += spec.stats.n_rebuilt
        assert rebuilt > 0  # the case was exercised
