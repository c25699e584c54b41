"""Logit processing and token draws, shared by the drafter (to shape trees) and the verifier.

Order as in llama.cpp's default chain: top-k, top-p, min-p, then temperature. Temperature 0 is
greedy: the argmax, no randomness used. Otherwise each draw uses exactly one uniform number from
the generator, so plain and speculative decoding consume the same random stream.
"""

from __future__ import annotations

import numpy as np

from .options import SamplingParams  # noqa: F401 (defined with the other options; drawn from here)


def top_candidates(scores: np.ndarray, m: int) -> tuple[np.ndarray, np.ndarray]:
    """The m highest-scoring tokens of a logit or log-probability vector, best first."""
    m = min(m, scores.shape[-1])
    # the m smallest of -scores: numpy's introselect for the m largest (kth = n - m) slows ~20x when
    # most values are equal, as a draft vocabulary's -inf rows are (24 ms against 1 for 151,936)
    idx = np.argpartition(-scores, m - 1)[:m]
    idx = idx[np.argsort(-scores[idx], kind="stable")]
    return idx, scores[idx]


def processed(logits: np.ndarray, sp: SamplingParams) -> tuple[np.ndarray, np.ndarray]:
    """(token ids, probabilities) of the processed distribution, most probable first.

    Greedy: the argmax with probability 1.
    """
    logits = np.asarray(logits, dtype=np.float32)
    if sp.greedy:
        t = int(np.argmax(logits))
        return np.array([t]), np.array([1.0])
    n = logits.shape[-1]
    if 0 < sp.top_k < n:
        ids = np.argpartition(logits, -sp.top_k)[-sp.top_k:]
    else:
        ids = np.arange(n)
    l = logits[ids].astype(np.float64)
    order = np.argsort(-l, kind="stable")
    ids, l = ids[order], l[order]
    p = np.exp(l - l[0])
    p /= p.sum()
    keep = len(p)
    if sp.top_p < 1.0:
        keep = min(keep, int(np.searchsorted(np.cumsum(p), sp.top_p) + 1))
    if sp.min_p > 0.0:
        keep = min(keep, max(1, int((p >= sp.min_p * p[0]).sum())))
    ids, l = ids[:keep], l[:keep]
    q = np.exp((l - l[0]) / sp.temperature)
    return ids, q / q.sum()


def draw(logits: np.ndarray, sp: SamplingParams, rng: np.random.Generator | None) -> int:
    ids, p = processed(logits, sp)
    if sp.greedy or len(ids) == 1:
        if not sp.greedy and rng is not None:
            rng.random()  # keep one draw per token whatever the distribution's size
        return int(ids[0])
    u = rng.random()
    i = int(np.searchsorted(np.cumsum(p), u * p.sum(), side="right"))
    return int(ids[min(i, len(ids) - 1)])


def draft_candidates(logits: np.ndarray, sp: SamplingParams, m: int) -> tuple[np.ndarray, np.ndarray]:
    """The drafter's m best next tokens and their log-probabilities under the same processing
    (greedy runs rank by the plain softmax, which orders tokens as the argmax would)."""
    logits = np.asarray(logits, dtype=np.float32)
    if sp.greedy:
        idx, top = top_candidates(logits, m)
        mx = float(logits.max())
        lse = mx + float(np.log(np.exp(logits - mx).sum()))
        return idx, top.astype(np.float64) - lse
    ids, p = processed(logits, sp)
    return ids[:m], np.log(p[:m])
