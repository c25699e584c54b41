"""How often the verifier takes what the drafter proposes, as measured, per drafter probability.

The drafter's own probability of a candidate is a poor estimate of the chance the verifier takes it:
a 2-bit base is unsure where the verifier is sure. Measured on Qwen2.5-Coder-1.5B (q6_k split, code
prompts, greedy, 16-node trees): of the candidates whose parent the verifier reached, 13 of 14 the
drafter gave 0.5-0.6 were taken, 31 of 31 at 0.9-0.95, 3 of 240 under 0.1. A tree grown by the drafter's
own probabilities spends its nodes on siblings it should have spent on depth.

:class:`DraftCalibration` keeps, per bucket of the drafter's probability, the share of such
candidates the verifier took (a running average over about the last :data:`WINDOW` candidates of
the bucket that the verifier reached, starting from the drafter's own probability), and turns a
candidate's drafter probability into that share. The engine grows and prunes its trees by these
shares (a node's value: the product of the shares along its path, the expected chance the verifier
reaches and takes it), so drafter nodes and text branches (whose values are measured the same way:
:mod:`.lookup`) compete for one node budget on one scale. The acceptance rule does not read them:
the output is the verifier's whatever the tree.
"""

from __future__ import annotations

import bisect
import math
from typing import Sequence

from .tree import DRAFTER, ROOT, DraftTree

# upper edges of the drafter-probability buckets (the last bucket is [0.99, 1]): finer near 1, where
# chains live and a share of 0.98 against 0.995 decides how deep a tree grows
EDGES = (0.02, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.98, 0.99)
# the prior's weight (candidates) and the running average's: about the last WINDOW candidates count
PRIOR_WEIGHT = 2.0
WINDOW = 200
DECAY = 1.0 - 1.0 / WINDOW
# no share is taken as certain: a measured 1.0 would make every chain of sure nodes free
MAX_SHARE = 0.995
MIN_SHARE = 1e-4


# each bucket's (low, high) drafter probability
BOUNDS = tuple(zip((0.0,) + EDGES, EDGES + (1.0,)))


class DraftCalibration:
    """The verifier's acceptance of drafter candidates per bucket of their drafter probability."""

    def __init__(self) -> None:
        self._acc = [[(lo + hi) / 2 * PRIOR_WEIGHT, PRIOR_WEIGHT] for lo, hi in BOUNDS]

    @staticmethod
    def bucket(q: float) -> int:
        return min(bisect.bisect_right(EDGES, q), len(EDGES))

    def share(self, q: float) -> float:
        """The measured chance that the verifier takes a candidate the drafter gave probability ``q``
        (given that it reached the candidate's parent)."""
        h, t = self._acc[self.bucket(q)]
        return min(max(h / t, MIN_SHARE), MAX_SHARE)

    def logp(self, draft_logp: float) -> float:
        """:meth:`share` of a candidate given by its drafter log-probability, as a log-probability:
        what :class:`~bitsplit_llama.speculative.tree.TreeBuilder` adds along a path."""
        return math.log(self.share(math.exp(draft_logp)))

    def record(self, tree: DraftTree, accepted: Sequence[int]) -> None:
        """Fold one verified tree in: every node the drafter proposed (alone or with the text) whose
        parent the verifier reached counts once, taken or not, in its probability's bucket."""
        taken = set(accepted)
        for i, nd in enumerate(tree.nodes):
            if not nd.source & DRAFTER or nd.q <= 0.0:
                continue
            if nd.parent != ROOT and nd.parent not in taken:
                continue
            cell = self._acc[self.bucket(nd.q)]
            cell[0] = DECAY * cell[0] + (1.0 if i in taken else 0.0)
            cell[1] = DECAY * cell[1] + 1.0

    def table(self) -> list[dict]:
        """Per bucket: its drafter-probability range, the measured share, and the weight behind it."""
        return [{"draft_p": [lo, hi], "share": round(h / t, 4), "weight": round(t, 1)}
                for (lo, hi), (h, t) in zip(BOUNDS, self._acc)]
