"""BitsplitLlama behaves like llama_cpp.Llama: the same tests run against both."""

from __future__ import annotations

import pytest

from bitsplit_llama.errors import InvalidOptionError
from bitsplit_llama.runtime.stock import stock_llama


@pytest.fixture(params=["stock", "bitsplit"])
def llm(request, tiny_split):
    if request.param == "stock":
        m = stock_llama(tiny_split / "base.gguf", n_ctx=256)
    else:
        from bitsplit_llama import BitsplitLlama

        m = BitsplitLlama(tiny_split, n_ctx=256, verbose=False, tree_nodes=8)
    yield m
    m.close()


def test_completion_shape_and_usage(llm):
    out = llm("the cat is", max_tokens=12, temperature=0.0)
    assert out["object"] == "text_completion" and out["id"].startswith("cmpl-")
    assert set(out) >= {"id", "object", "created", "model", "choices", "usage"}
    ch = out["choices"][0]
    assert isinstance(ch["text"], str) and ch["index"] == 0 and ch["finish_reason"] in ("stop", "length")
    u = out["usage"]
    assert u["prompt_tokens"] == len(llm.tokenize(b"the cat is"))
    # llama_cpp.Llama may run past max_tokens to finish a multi-byte UTF-8 character (the tiny
    # model emits raw byte tokens): up to 3 more
    assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"] and 1 <= u["completion_tokens"] <= 12 + 3


def test_streaming_equals_non_streaming(llm):
    full = llm("the dog", max_tokens=16, temperature=0.0)["choices"][0]["text"]
    chunks = list(llm("the dog", max_tokens=16, temperature=0.0, stream=True))
    assert all(c["object"] == "text_completion" for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in chunks) == full
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")


def test_stop_strings_and_echo(llm):
    import re

    full = llm("the dog", max_tokens=24, temperature=0.0)["choices"][0]["text"]
    # a stop string of plain letters (the random tiny model also emits raw bytes, which the
    # byte-level stop matching and the decoded text would count differently)
    m = re.search(r"[a-z]{2}", full[2:])
    assert m, f"no plain text to place a stop string in {full!r}"
    stop = m.group(0)
    out = llm("the dog", max_tokens=24, temperature=0.0, stop=[stop])
    assert out["choices"][0]["text"] == full[:full.find(stop)] and out["choices"][0]["finish_reason"] == "stop"
    echo = llm("the dog", max_tokens=4, temperature=0.0, echo=True)["choices"][0]["text"]
    assert echo.startswith("the dog")


def test_tokenize_roundtrip_and_context(llm):
    toks = llm.tokenize(b"the cat is on the mat", add_bos=False)
    assert llm.detokenize(toks).decode().lstrip() == "the cat is on the mat"  # SPM adds a leading space
    assert llm.n_ctx() == 256


def test_sampling_with_seed_is_reproducible(llm):
    a = llm("the", max_tokens=10, temperature=0.9, seed=7)["choices"][0]["text"]
    b = llm("the", max_tokens=10, temperature=0.9, seed=7)["choices"][0]["text"]
    assert a == b


def test_bitsplit_specifics(tiny_split):
    from bitsplit_llama import BitsplitLlama

    with pytest.raises(TypeError):
        BitsplitLlama(tiny_split, n_ctx=128, not_an_option=1)
    with BitsplitLlama(tiny_split, n_ctx=256, verbose=False) as llm:
        import llama_cpp

        assert isinstance(llm, llama_cpp.Llama)
        with pytest.raises(InvalidOptionError, match="repeat_penalty=1.3"):
            llm("the", max_tokens=3, repeat_penalty=1.3)
        llm("the cat", max_tokens=12, temperature=0.0)
        st = llm.last_stats
        assert st is not None and st.n_emitted >= 1 and st.n_verify >= 1 and st.tokens_per_verify >= 1.0
        with pytest.raises(NotImplementedError):
            llm.create_embedding("x")
        # speculative and verifier-alone give the same text
    with BitsplitLlama(tiny_split, n_ctx=256, verbose=False, tree_nodes=0) as plain:
        ref = plain("the cat", max_tokens=12, temperature=0.0)["choices"][0]["text"]
    with BitsplitLlama(tiny_split, n_ctx=256, verbose=False, tree_nodes=16) as spec:
        assert spec("the cat", max_tokens=12, temperature=0.0)["choices"][0]["text"] == ref


@pytest.mark.real_model
def test_chat_uses_the_models_template(smollm2_split_q8):
    """SmolLM2 carries a chat template: both classes format the conversation with it."""
    from bitsplit_llama import BitsplitLlama

    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."}]
    stock = stock_llama(smollm2_split_q8 / "base.gguf", n_ctx=512)
    bit = BitsplitLlama(smollm2_split_q8, n_ctx=512, verbose=False)
    try:
        outs = []
        for m in (stock, bit):
            assert m.chat_format == "chat_template.default" or m.chat_format in ("chatml",)
            r = m.create_chat_completion(messages=messages, max_tokens=16, temperature=0.0)
            assert r["object"] == "chat.completion" and r["choices"][0]["message"]["role"] == "assistant"
            outs.append(r)
            streamed = "".join(c["choices"][0]["delta"].get("content", "") or ""
                               for c in m.create_chat_completion(messages=messages, max_tokens=16, temperature=0.0,
                                                                 stream=True))
            assert streamed == r["choices"][0]["message"]["content"]
        # the same template: the same prompt tokens
        assert outs[0]["usage"]["prompt_tokens"] == outs[1]["usage"]["prompt_tokens"]
        assert "<|im_start|>" in bit.metadata.get("tokenizer.chat_template", "")
    finally:
        stock.close()
        bit.close()
