"""``--tree-nodes auto``: the draft tree that maximises expected tokens per second on this machine.

Two measurements, cached per model (base fingerprint), machine (CPU model, threads) and version:

- costs: the wall time of a drafter pass for 1, 2, 4 tokens and of a verifier pass for 2..25 rows
  with each kernel family this CPU runs (interpolated in between). A generation pins one family for
  all its passes, the same whatever its tree and with ``--no-spec`` (``--kernel``, else
  ``native.policy.generation_family``), so that speculative output is the verifier-alone output:
  that family's times price the candidates. (The others are timed for ``run --json`` and for the
  record: on a Zen 5 ``avx512-bf16`` overtakes the 256-bit integers from 3-4 rows, on a Zen 4 from
  14, so a larger tree pinned to ``--kernel avx512-bf16`` can pay there);
- acceptance: over a short calibration run (greedy, built-in code and English prompts, a wide
  tree), how often the verifier's token is the drafter's best, second, third, fourth candidate.

Both are measured in a llama.cpp context of the calibration's own (:data:`CALIBRATION_N_CTX`
positions, freed after): the profile does not depend on the user's ``--n-ctx``, any size works,
and the user's cache is not touched.

Each candidate shape is then grown exactly as the engine grows trees, with those rank
probabilities standing in for the drafter's, which gives its expected tokens per cycle
(1 + the sum over nodes of the probability of reaching and accepting them) and its cost per cycle
(drafter passes + one verifier pass). The best expected tokens/s wins, plain decoding included
(the idea behind Sequoia's hardware-aware trees). Chains as deep as the calibration's tree are
priced from its cycles instead (:func:`_chain_from_paths`): the drafter's own chain through each
tree, how sure it was along it and how far the verifier followed it, replayed under the engine's
``--draft-stop``, whose early stops the rank model cannot see.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import platform
from dataclasses import asdict, dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Callable

from .engine import CANDIDATES_PER_NODE, Engine, Stats, TreeShape, kernel_pinned_by_env, n_seq_max_for
from .tree import ROOT, TreeBuilder

PROFILE_VERSION = 3  # 2: verify passes timed per kernel family (family_ms); 3: the calibration's chain paths
VERIFY_BATCHES = (2, 3, 4, 5, 7, 9, 13, 17, 25)
DRAFT_BATCHES = (1, 2, 4)
CALIBRATION_PROMPTS = (
    "def merge_sort(items):",
    "import os\n\ndef list_python_files(root):",
    "The water cycle describes how water",
    "A good way to learn a new language is",
)
CALIBRATION_SHAPE = TreeShape(12, 4, 3)  # the wide tree whose acceptance is counted
CALIBRATION_TOKENS = 40                  # tokens generated per calibration prompt
# positions of the calibration's own context: with the cells its tree reserves, 256 KV cells
# (llama.cpp's rounding); prefixes and prompts are cut to fit, so no model is too verbose for it
CALIBRATION_N_CTX = 256 - n_seq_max_for(CALIBRATION_SHAPE)


# a family measured faster than the kernel policy's by less than this share does not displace it
FAMILY_TIE = 0.05

# A drafting pass reads a part of what a verify pass of as many rows reads (the base alone, without
# the residual): one slower than that verify pass by both this factor and BUSY_MS means something
# else had the cores during the calibration (one taken while a compiler ran timed a 1-row drafting
# pass at 2.3 s and chose plain decoding, 0.53x stock Q8_0 against 0.67-0.69x; measured on a Zen 4)
BUSY_FACTOR = 1.25
BUSY_MS = 10.0


@dataclass
class Profile:
    verify_ms: dict[int, float]
    draft_ms: dict[int, float]
    rank_probs: list[float]  # P(verifier token = drafter's i-th candidate), i < CANDIDATES_PER_NODE
    plain_ms: float
    # verify pass times per kernel family ({family: {rows: ms}}); empty: verify_ms, the policy's family
    family_ms: dict[str, dict[int, float]] = field(default_factory=dict)
    # one entry per verify cycle of the calibration: [lead, p1, p2, ...] (engine.chain_record): how
    # far the verifier followed the drafter's own chain, and how sure the drafter was along it
    chains: list[list[float]] = field(default_factory=list)

    def verify(self, rows: int, prefer: Callable[[int], str | None] | None = None,
               pinned_for: int | None = None) -> float:
        """A verify pass of ``rows`` rows with the family :meth:`kernel` pins for passes of
        ``pinned_for`` rows (default ``rows``; a generation pins the family of its tree's full pass
        for all its passes), ``prefer`` giving the policy's family per size, as to :meth:`kernel`;
        without per-family times, the policy's family's."""
        if self.family_ms:
            pin = rows if pinned_for is None else pinned_for
            return _interp(self.family_ms[self.kernel(pin, prefer(pin) if prefer else None)], rows)
        return _interp(self.verify_ms, rows)

    def kernel(self, rows: int, prefer: str | None = None) -> str | None:
        """The family whose verify pass of ``rows`` rows was fastest here (None: not measured per
        family; the kernel policy decides). ``prefer`` (the policy's family) keeps its place unless
        another was more than :data:`FAMILY_TIE` faster: a closer lead is within the calibration's
        noise (a Zen 4's calibration once put ``vnni-int24`` 3% ahead of ``avx2-int16`` at 2 rows,
        where the products alone take 1.25x its time: one bench run with that choice gave 0.65x stock
        Q8_0, four with ``avx2-int16`` 0.78-0.81x)."""
        if not self.family_ms:
            return None
        best = min(self.family_ms, key=lambda f: _interp(self.family_ms[f], rows))
        if prefer in self.family_ms and \
                _interp(self.family_ms[prefer], rows) <= (1 + FAMILY_TIE) * _interp(self.family_ms[best], rows):
            return prefer
        return best

    def plain(self, prefer: Callable[[int], str | None] | None = None) -> float:
        """A plain decoding step: a 2-row verify pass (in the family pinned for 2 rows)."""
        return self.verify(2, prefer) if self.family_ms else self.plain_ms

    def draft(self, batch: int) -> float:
        return _interp(self.draft_ms, batch)


def _interp(table: dict[int, float], x: int) -> float:
    keys = sorted(table)
    if x <= keys[0]:
        return table[keys[0]]
    for a, b in zip(keys, keys[1:]):
        if a <= x <= b:
            return table[a] + (table[b] - table[a]) * (x - a) / (b - a)
    a, b = keys[-2], keys[-1]  # extrapolate from the last segment
    return table[b] + (table[b] - table[a]) * (x - b) / (b - a)


def _machine_key(threads: int, setup: str = "") -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    from .._version import __version__

    key = f"{cpu}|{os.cpu_count()}|{threads}|{__version__}|{PROFILE_VERSION}|{setup}"
    return hashlib.sha256(key.encode()).hexdigest()[:12]


machine_key = _machine_key


def setup_of(sm, residual_fingerprint: str | None = None) -> str:
    """What besides the machine changes a split model's pass times: the native build, GPU layers,
    the drafter, RPC servers, the residual itself (splits of one source share their base: a q5_k
    and a q6_k residual behind the same base.gguf read different bytes per verify pass), and the
    settings that change which kernel families run and which the policy prefers (the cap
    ``BITSPLIT_MAX_ISA``, ``BITSPLIT_HALF_RATE_512``, ``BITSPLIT_KERNEL``: a profile measured
    without the cap pinned a family the cap then refused), and the verifier's activation bits as
    ``--act-bits`` resolved (8 halve a verify pass's multiplies). ``residual_fingerprint`` is
    :func:`~bitsplit_llama.formats.modeldir.residual_keys`'s, read here when the caller has not."""
    from ..native import build_key, policy

    if residual_fingerprint is None:
        from ..formats.modeldir import residual_keys

        residual_fingerprint = residual_keys(sm.residual.residual_path, with_fingerprint=True)["residual_fingerprint"]
    return (f"{build_key()[0]}|ngl={sm.n_gpu_layers}|native_drafter={sm.fast_drafter}|residual={residual_fingerprint}"
            + (f"|rpc={len(sm.rpc)}" if sm.rpc else "")
            + f"|act_bits={sm.residual.act_bits}|draft_vocab={getattr(getattr(sm, 'draft_vocab', None), 'rows', 0)}|isa={policy.max_isa()}|half_rate_512={int(policy.half_rate_512())}|kernel={kernel_pinned_by_env() or ''}")


def choose_measured(split_prof: dict, key: str, prof: "Profile | None" = None,
                    prefer: Callable[[int], str | None] | None = None) -> tuple[TreeShape, float, list]:
    """The tree size of a split's acceptance profile (``bitsplit profile``) with the best tokens/s:
    measured tokens per verification, and the profile's own times when it was measured with this
    machine key, else this machine's cost curves ``prof`` (a verify pass of the rows the profile
    measured, :func:`~bitsplit_llama.formats.profile.profile_rows`, in the family pinned for it,
    ``prefer`` as to :meth:`Profile.kernel`, and the measured drafter passes per cycle at the tree's
    width). Returns (shape, tokens/s, table)."""
    from ..formats.profile import profile_rows  # (here: formats imports numpy, which must follow llama.cpp)

    same = split_prof.get("machine_key") == key
    if not same and prof is None:
        raise ValueError("a profile measured elsewhere needs this machine's cost curves")
    rows = []
    for r in split_prof["profile"]:
        n = int(r["nodes"])
        shape = TreeShape(0, 1, 1) if n == 0 else TreeShape(n, int(r["width"]), int(r["rounds"]))
        if same:
            sec = (float(r["ms_per_verify"]) + float(r["ms_drafting_per_cycle"])) / 1000
        elif n == 0:
            sec = prof.plain(prefer) / 1000
        else:
            sec = (float(r["draft_passes_per_cycle"]) * prof.draft(shape.width) + prof.verify(profile_rows(r), prefer)) / 1000
        tok = float(r["tokens_per_verify"])
        rows.append((shape, tok, sec, tok / sec if sec > 0 else 0.0))
    rows.sort(key=lambda r: -r[3])
    return rows[0][0], rows[0][3], rows


def cache_path(base_fingerprint: str, threads: int, setup: str = "") -> Path:
    """Where a profile is cached: per base, machine, thread count and ``setup`` (anything else that
    changes pass times: the native library's build, GPU layers, the drafter)."""
    from ..cache import cache_dir

    return cache_dir() / "autotree" / f"{base_fingerprint[:16]}-{_machine_key(threads, setup)}.json"


# Chains are priced from the calibration's own cycles (Profile.chains) up to the depth its tree
# drafted, given at least this many cycles; longer chains, trees, and profiles without paths by the
# rank model.
PATH_DEPTH = 3
PATH_MIN_CYCLES = 20


def _chain_from_paths(n: int, prof: Profile, prefer: Callable[[int], str | None] | None,
                      stop: str | float | None) -> tuple[float, float]:
    """(tokens, seconds) per cycle of an ``n``-node chain, averaged over the calibration's cycles as
    such a chain would have run them: the drafter drafts node j + 1 only while the path probability
    of nodes 1..j (its own) is at least the stop mass (``--draft-stop``: a fixed one; "auto" the
    engine's rule, a drafting pass's time over the time per emitted token, solved here by
    iteration; None never stops), a cycle of k drafted nodes costs k drafting passes and a verify
    pass of k + 1 rows, and emits 1 + the verifier's tokens that followed the chain among those k.
    Taken from whole paths, not per node: the drafter is sure and right, or unsure and wrong,
    along a chain together (a Zen 4's 2-node chain got 2.61 tokens per verify with the stops, where
    per-level acceptance multiplied gives 2.55). A probability past a record's end counts as 0 and
    a token past it as missed (the calibration's tree did not keep that node: it was unlikely)."""
    d1 = prof.draft(1)
    verify = [prof.verify(1 + k, prefer, pinned_for=n + 1) for k in range(1, n + 1)]
    recs = []
    for r in prof.chains:
        ps = (list(r[1:]) + [0.0] * n)[:n - 1]
        recs.append((int(r[0]), [math.prod(ps[:j + 1]) for j in range(n - 1)]))

    def cycle(mass: float) -> tuple[float, float]:
        tok = ms = 0.0
        for lead, path in recs:
            k = n
            if mass > 0:
                k = 1 + next((j for j, q in enumerate(path) if q < mass), n - 1)
            tok += 1 + min(lead, k)
            ms += k * d1 + verify[k - 1]
        return tok / len(recs), ms / len(recs)

    if stop == "auto":
        tok, ms = cycle(0.0)
        for _ in range(6):  # the mass depends on the time per token it changes
            tok, ms = cycle(d1 / (ms / tok))
    else:
        tok, ms = cycle(float(stop or 0.0))
    return tok, ms / 1000


def priced_from_paths(shape: TreeShape, prof: Profile) -> bool:
    """Whether :func:`expected` prices ``shape`` from the calibration's paths: chains to its depth
    (a 1-node tree of any width is the 1-node chain: the best root child, one drafting pass)."""
    return (shape.width == 1 or shape.nodes == 1) and 1 <= shape.nodes <= PATH_DEPTH \
        and len(prof.chains) >= PATH_MIN_CYCLES


def expected(shape: TreeShape, prof: Profile,
             prefer: Callable[[int], str | None] | None = None,
             stop: str | float | None = None) -> tuple[float, float]:
    """(expected tokens per cycle, expected seconds per cycle) of a shape under the profile, its
    verify pass in the family :meth:`Profile.kernel` pins for its size (``prefer``: the policy's
    family per size). Chains the calibration drafted as deep are priced from its paths with the
    engine's ``--draft-stop`` ``stop`` (:func:`_chain_from_paths`); other shapes by the rank
    model, every round drafted."""
    if shape.nodes == 0:
        return 1.0, prof.plain(prefer) / 1000
    if priced_from_paths(shape, prof):
        return _chain_from_paths(shape.nodes, prof, prefer, stop)
    lp = [math.log(max(p, 1e-9)) for p in prof.rank_probs]
    # grown as the engine grows trees: every round in full until nothing more can be among the best
    # ``nodes`` (TreeBuilder.settled), then the best ``nodes`` kept
    b = TreeBuilder(0, shape.width, max(shape.nodes, shape.width * shape.rounds))
    cost = prof.draft(1)  # the root
    frontier = [ROOT]
    next_id = 1
    for rnd in range(shape.rounds):
        for node in frontier:
            b.offer(node, range(next_id, next_id + len(lp)), lp)
            next_id += len(lp)
        added = b.next_round()
        if not added or rnd == shape.rounds - 1 or b.settled(shape.nodes, added):
            break
        cost += prof.draft(len(added))
        frontier = added
    b.drain(shape.nodes)
    tree = b.tree.best(shape.nodes)
    tokens = 1.0 + sum(math.exp(n.logp) for n in tree.nodes)
    cost += prof.verify(1 + len(tree), prefer)
    return tokens, cost / 1000


def candidate_shapes(max_nodes: int = 24) -> list[TreeShape]:
    shapes = [TreeShape(0, 1, 1)]
    for nodes in (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24):
        if nodes > max_nodes:
            break
        for width in (1, 2, 3, 4):
            for rounds in range(1, 11):
                if width == 1 and rounds != nodes:
                    continue  # chains: one round per node
                if width * rounds < nodes or rounds > nodes:
                    continue
                shapes.append(TreeShape(nodes, width, rounds))
    return shapes


# Shapes whose expected tokens/s are within this share of the best's count as tied, and the one with
# the fewest nodes is taken: the rank model (the calibration's acceptance multiplied per level, every
# round drafted) overrated the deeper of two near-tied chains. Measured on a 2-core Zen 4
# (Qwen2.5-Coder-1.5B, q5_k residual, 4 code prompts x 32 tokens): a 2-node chain expected 0.5%
# ahead of a 1-node chain got 2.37 tokens per verify against 2.62 expected (a q6_k split's 1-node
# chain 1.80 against 1.85), and ran 0.79x / 0.75x stock Q8_0 against 0.81x / 0.85x with the 1-node chain.
NEAR_TIE = 0.03


def choose(prof: Profile, max_nodes: int = 24, prefer: Callable[[int], str | None] | None = None,
           draft_stop: str | float | None = None
           ) -> tuple[TreeShape, float, list[tuple[TreeShape, float, float, float]]]:
    """The shape to run, its expected tokens/s, and the table of every candidate
    (shape, tokens per cycle, seconds per cycle, tokens/s), best first. The shape is the best one,
    or the one with the fewest nodes among those within NEAR_TIE of it. ``prefer`` (rows -> the
    kernel policy's family) prices each verify pass in the family the generation will pin;
    ``draft_stop`` (the engine's) the early stops of chains priced from paths (:func:`expected`)."""
    rows = []
    for shape in candidate_shapes(max_nodes):
        tok, sec = expected(shape, prof, prefer, draft_stop)
        rows.append((shape, tok, sec, tok / sec))
    rows.sort(key=lambda r: -r[3])
    tied = [r for r in rows if r[3] >= rows[0][3] * (1 - NEAR_TIE)]
    pick = min(tied, key=lambda r: (r[0].nodes, -r[3]))
    return pick[0], pick[3], rows


def measure(engine: Engine, tokenize: Callable[[str], list[int]], is_stop: Callable[[int], bool] | None = None,
            log: Callable[[str], None] | None = None) -> Profile:
    """Measure the cost curves and the acceptance profile of an engine's model on this machine,
    through the engine's measurement API, in a context of the calibration's own (the engine's
    context, whatever its size, and its cache are left as they are)."""
    with engine.own_context(CALIBRATION_N_CTX, CALIBRATION_SHAPE) as cal:
        return _measure(cal, tokenize, is_stop, log or (lambda s: None))


def _measure(engine: Engine, tokenize: Callable[[str], list[int]], is_stop: Callable[[int], bool] | None,
             say: Callable[[str], None]) -> Profile:
    n_ctx = engine.ctx.n_ctx
    prefix = tokenize(CALIBRATION_PROMPTS[0] * 4)[:n_ctx - max(VERIFY_BATCHES + DRAFT_BATCHES) - 1]
    engine.prefill(prefix, Stats())
    family_ms: dict[str, dict[int, float]] = {}
    fams = candidate_families()
    for rows in VERIFY_BATCHES:  # the families in turn at each size: drift spreads over all of them
        for fam in fams:
            with engine.decode_kernel(2, fam):
                family_ms.setdefault(fam, {})[rows] = engine.time_pass(rows, verify=True)
    if family_ms:  # the fastest family's time at each size (the policy's family is among those timed)
        verify_ms = {rows: min(t[rows] for t in family_ms.values()) for rows in VERIFY_BATCHES}
    else:
        verify_ms = {}
        for rows in VERIFY_BATCHES:
            with engine.decode_kernel(rows):  # each size with the kernel family the policy gives it
                verify_ms[rows] = engine.time_pass(rows, verify=True)
    plain_ms = verify_ms[2]  # a plain step is a 2-row verify pass
    draft_ms = {b: engine.time_pass(b, verify=False) for b in DRAFT_BATCHES}
    say("measured pass times: verify " + ", ".join(f"{k}:{v:.0f}" for k, v in verify_ms.items())
        + " ms; draft " + ", ".join(f"{k}:{v:.0f}" for k, v in draft_ms.items()) + " ms")
    if family_ms:
        say("verify pass ms by kernel family at " + "/".join(str(k) for k in VERIFY_BATCHES) + " rows: "
            + "; ".join(f"{f} " + "/".join(f"{t[k]:.0f}" for k in VERIFY_BATCHES) for f, t in family_ms.items()))
    # acceptance: a wide tree over the calibration prompts (each cut to leave room for its tokens)
    prompts = [tokenize(p)[:n_ctx - CALIBRATION_TOKENS - 1] for p in CALIBRATION_PROMPTS]
    counts = engine.rank_profile(prompts, CALIBRATION_TOKENS, CALIBRATION_SHAPE, is_stop)
    total = max(1, sum(counts))
    rank_probs = [c / total for c in counts[:CANDIDATES_PER_NODE]]
    say("acceptance by drafter rank: " + ", ".join(f"{100 * p:.0f}%" for p in rank_probs))
    return Profile(verify_ms, draft_ms, rank_probs, plain_ms, family_ms, list(engine.chain_paths))


def candidate_families() -> list[str]:
    """The kernel families the calibration times for the verifier's passes: every family this CPU
    runs under ``BITSPLIT_MAX_ISA`` but the portable one (where another exists); none with
    ``BITSPLIT_KERNEL`` set, which pins its family for every pass."""
    if kernel_pinned_by_env():
        return []
    from ..native import policy

    fams = policy.families()
    fast = [f for f in fams if f != "generic"]
    return fast if len(fast) > 1 else []


def busy_sign(prof: Profile) -> str:
    """Why ``prof``'s times cannot be this machine's own ('' where they can): a drafting pass of
    ``b`` rows slower than the verify pass of ``max(b, 2)`` rows, which reads more."""
    for b, d in sorted(prof.draft_ms.items()):
        rows = max(b, 2)
        v = prof.verify_ms.get(rows)
        if v is not None and d > BUSY_FACTOR * v and d - v > BUSY_MS:
            return (f"a {b}-row drafting pass took {d:.0f} ms, longer than a {rows}-row verify pass "
                    f"({v:.0f} ms), which reads more")
    return ""


def load_or_measure(engine: Engine, tokenize: Callable[[str], list[int]], is_stop: Callable[[int], bool] | None,
                    fingerprint: str, threads: int, log: Callable[[str], None] | None = None,
                    setup: str = "") -> Profile:
    """The cached profile of this model, machine and setup, else :func:`measure` (and cache it, unless
    :func:`busy_sign` finds the machine was busy)."""
    path = cache_path(fingerprint, threads, setup)
    if path.exists():
        try:
            d = json.loads(path.read_text())
            return Profile({int(k): v for k, v in d["verify_ms"].items()}, {int(k): v for k, v in d["draft_ms"].items()},
                           d["rank_probs"], d["plain_ms"],
                           {f: {int(k): v for k, v in t.items()} for f, t in d.get("family_ms", {}).items()},
                           [[float(x) for x in r] for r in d.get("chains", [])])
        except (OSError, ValueError, KeyError):
            pass
    if log:
        log("--tree-nodes auto: measuring this machine and model once (cached in " + str(path.parent) + ")")
    prof = measure(engine, tokenize, is_stop, log)
    busy = busy_sign(prof)
    if busy:  # used for this run only: cached, it would stand for good
        if log:
            log(f"--tree-nodes auto: the machine was busy during the measurement ({busy}); "
                "not cached, the next run measures again")
        return prof
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(asdict(prof)))
        os.replace(tmp, path)
    except OSError:
        pass
    return prof


# The largest tree the rank model's choice may use (the context and its batch are sized for it
# before the choice is made).
AUTO_ROOM = TreeShape(24, 4, 10)


def room_for(split_prof: dict | None) -> TreeShape:
    """The largest tree an automatic choice may pick: :data:`AUTO_ROOM`, or the split profile's
    largest measured size where that is larger."""
    room = AUTO_ROOM
    if split_prof:
        big = max(int(r["nodes"]) for r in split_prof["profile"])
        if big > room.nodes:
            room = TreeShape.for_nodes(big)
    return room


def choose_for(sm, tokenize: Callable[[str], list[int]], split_prof: dict | None, *, kernel: str | None = None,
               draft_stop: str | float | None = "auto",
               log: Callable[[str], None] | None = None) -> tuple[TreeShape, dict, str | None]:
    """``--tree-nodes auto`` for the loaded split model ``sm`` (a SplitModel sized by
    :func:`room_for`): the shape, what was chosen and from what (``run --json``'s ``"auto"``), and the
    kernel family to pin: ``kernel``, the family the generation pins whatever its tree (None:
    ``BITSPLIT_KERNEL``'s, or the policy's for each size), whose measured times price every
    candidate. Measures this machine once per model and setup (cached); with a split profile its
    measured acceptance decides, else the rank model."""
    from ..formats.modeldir import residual_keys

    keys = residual_keys(sm.residual.residual_path, with_fingerprint=True)
    setup = setup_of(sm, keys["residual_fingerprint"])
    key = machine_key(sm.ctx.n_threads, setup)
    prof = None
    from ..native import policy

    # rows -> the family the run pins: the cost curves price it
    pinned = kernel or kernel_pinned_by_env()
    prefer: Callable[[int], str | None] | None = None
    if pinned is None:
        prefer = partial(policy.kernel_for_batch, residual_alone=sm.residual_alone)
    if split_prof is None or split_prof.get("machine_key") != key:
        prof = load_or_measure(Engine(sm, TreeShape(0, 1, 1)), tokenize, sm.model.is_eog, keys["base_fingerprint"],
                               sm.ctx.n_threads, log, setup)
        if pinned is not None and pinned in prof.family_ms:  # its own times alone, whichever was faster
            prof = replace(prof, family_ms={pinned: prof.family_ms[pinned]})
    if split_prof is not None:
        shape, best_tps, _ = choose_measured(split_prof, key, prof, prefer)
        choice = {"shape": [shape.nodes, shape.width, shape.rounds], "expected_tokens_per_second": round(best_tps, 3),
                  "from": "acceptance profile" + (" (its times)" if prof is None else " (this machine's cost curves)")}
    else:
        shape, best_tps, table = choose(prof, prefer=prefer, draft_stop=draft_stop)
        fixed16 = next((r for r in table if (r[0].nodes, r[0].width, r[0].rounds) == (16, 4, 7)), None)
        choice = {"shape": [shape.nodes, shape.width, shape.rounds], "expected_tokens_per_second": round(best_tps, 3),
                  "expected_tokens_per_second_fixed16": round(fixed16[3], 3) if fixed16 else None,
                  "rank_probs": prof.rank_probs, "from": "rank model",
                  # calibration cycles that priced chains (0: the rank model did)
                  "chain_paths": len(prof.chains) if priced_from_paths(TreeShape(1, 1, 1), prof) else 0}
    if kernel is not None:
        choice["kernel"] = kernel
    return shape, choice, kernel
