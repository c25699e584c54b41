"""Tiny synthetic GGUF models (random weights) that llama.cpp loads: fast, exact test fixtures.

``write_tiny_llama`` makes a llama-architecture model with widths that are multiples of 256 (so
llama.cpp's Q2_K applies for real) and a small SentencePiece-style vocabulary with byte fallback.
Weight tensors are written in the requested type (F32 by default); any ggml-quantizable type can
be used for the source, to test splitting quantized sources.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
from gguf.constants import GGMLQuantizationType as QT

N_EMBD = 256
N_FF = 512
N_HEAD = 4
N_HEAD_KV = 2
N_LAYER = 2
WORDS = ["the", "a", "of", "and", "to", "in", "is", "it", "that", "was", "for", "on", "are", "with",
         "as", "be", "at", "by", "this", "from", "or", "one", "had", "not", "but", "what", "all",
         "were", "when", "we", "there", "can", "an", "your", "which", "their", "said", "if", "do",
         "will", "each", "about", "how", "up", "out", "them", "then", "she", "many", "some"]


def vocab() -> tuple[list[str], list[float], list[int]]:
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)]
    types = [2, 3, 3] + [6] * 256
    scores = [0.0, 0.0, 0.0] + [0.0] * 256
    pieces = ["\u2581"] + [chr(c) for c in range(ord("a"), ord("z") + 1)] + ["\u2581" + w for w in WORDS]
    for i, p in enumerate(pieces):
        tokens.append(p)
        types.append(1)
        scores.append(-float(i + 1) if len(p) > 2 else -100.0 - i)
    return tokens, scores, types


def _store(w: gguf.GGUFWriter, name: str, arr: np.ndarray, qtype: int) -> None:
    """Add ``arr`` (numpy order: rows x width) stored as ``qtype``."""
    arr = np.ascontiguousarray(arr, dtype=np.float32)
    if qtype == int(QT.F32) or arr.ndim == 1 or name.endswith("ffn_gate_inp.weight"):
        w.add_tensor(name, arr)
    elif qtype == int(QT.F16):
        w.add_tensor(name, arr.astype(np.float16))
    elif qtype == int(QT.BF16):
        from gguf.quants import quantize

        w.add_tensor(name, quantize(arr, QT.BF16), raw_dtype=QT.BF16)
    else:
        from bitsplit_llama.formats import _ggml

        raw = _ggml.quantize_rows(arr.reshape(-1, arr.shape[-1]), qtype)
        w.add_tensor(name, raw.reshape(*arr.shape[:-1], raw.shape[-1]), raw_dtype=QT(qtype))


def tiny_llama_weights(seed: int = 0, n_vocab: int | None = None, n_layer: int = N_LAYER,
                       n_embd: int = N_EMBD, n_ff: int = N_FF, n_expert: int = 0) -> dict[str, np.ndarray]:
    """Weights in numpy order (rows, width); with ``n_expert`` the FFN is a mixture of experts
    (3-D tensors: experts, rows, width) as in Mixtral-style llama models."""
    rng = np.random.default_rng(seed)
    nv = n_vocab or len(vocab()[0])
    hd = n_embd // N_HEAD

    def mat(rows: int, cols: int, scale: float) -> np.ndarray:
        m = rng.standard_normal((rows, cols)).astype(np.float32) * scale
        # a few heavy columns, as real weights have: makes quantization error non-uniform
        m[:, rng.integers(0, cols, 3)] *= 4.0
        return m

    t: dict[str, np.ndarray] = {
        "token_embd.weight": mat(nv, n_embd, 0.5),
        "output_norm.weight": (1.0 + 0.1 * rng.standard_normal(n_embd)).astype(np.float32),
        "output.weight": mat(nv, n_embd, 0.08),
    }
    for i in range(n_layer):
        p = f"blk.{i}."
        t[p + "attn_norm.weight"] = (1.0 + 0.1 * rng.standard_normal(n_embd)).astype(np.float32)
        t[p + "attn_q.weight"] = mat(n_embd, n_embd, 0.06)
        t[p + "attn_k.weight"] = mat(N_HEAD_KV * hd, n_embd, 0.06)
        t[p + "attn_v.weight"] = mat(N_HEAD_KV * hd, n_embd, 0.06)
        t[p + "attn_output.weight"] = mat(n_embd, n_embd, 0.06)
        t[p + "ffn_norm.weight"] = (1.0 + 0.1 * rng.standard_normal(n_embd)).astype(np.float32)
        if n_expert:
            t[p + "ffn_gate_inp.weight"] = mat(n_expert, n_embd, 0.5)
            t[p + "ffn_gate_exps.weight"] = np.stack([mat(n_ff, n_embd, 0.06) for _ in range(n_expert)])
            t[p + "ffn_up_exps.weight"] = np.stack([mat(n_ff, n_embd, 0.06) for _ in range(n_expert)])
            t[p + "ffn_down_exps.weight"] = np.stack([mat(n_embd, n_ff, 0.04) for _ in range(n_expert)])
        else:
            t[p + "ffn_gate.weight"] = mat(n_ff, n_embd, 0.06)
            t[p + "ffn_up.weight"] = mat(n_ff, n_embd, 0.06)
            t[p + "ffn_down.weight"] = mat(n_embd, n_ff, 0.04)
    return t


def write_llama_gguf(path: Path, weights: dict[str, np.ndarray], qtype: int = int(QT.F32),
                     arch: str = "llama", n_layer: int = N_LAYER, name: str = "tiny-llama",
                     types: dict[str, int] | None = None) -> Path:
    """Write ``weights`` as a llama-architecture GGUF; 2-D tensors stored as ``qtype`` unless
    ``types`` names another type for a tensor."""
    tokens, scores, ttypes = vocab()
    nv, n_embd = weights["token_embd.weight"].shape
    moe = "blk.0.ffn_up_exps.weight" in weights
    n_ff = weights["blk.0.ffn_up_exps.weight" if moe else "blk.0.ffn_up.weight"].shape[-2]
    while len(tokens) < nv:  # pad the vocabulary with unused pieces
        tokens.append(f"\u2581x{len(tokens)}")
        scores.append(-1000.0 - len(tokens))
        ttypes.append(1)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(name)
    w.add_context_length(256)
    w.add_embedding_length(n_embd)
    w.add_block_count(n_layer)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(N_HEAD)
    w.add_head_count_kv(N_HEAD_KV)
    w.add_rope_dimension_count(n_embd // N_HEAD)
    w.add_layer_norm_rms_eps(1e-5)
    if moe:
        w.add_expert_count(weights["blk.0.ffn_up_exps.weight"].shape[0])
        w.add_expert_used_count(2)
    w.add_file_type(0)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(ttypes)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_add_bos_token(True)
    for name_, arr in weights.items():
        _store(w, name_, arr, (types or {}).get(name_, qtype))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def write_tiny_llama(path: Path, qtype: int = int(QT.F32), seed: int = 0, **kw) -> Path:
    return write_llama_gguf(path, tiny_llama_weights(seed), qtype, **kw)
