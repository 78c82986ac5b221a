"""How likely the target is to accept a tree node, learned from the engine's own verified passes.

A node is accepted when its parent is on the accepted path and the target's token at the parent
(its argmax when greedy, its sampled token otherwise) is the node's token. Tree growth ranks
nodes by the product of these chances along their path (the expected number of accepted
tokens is 1 + the sum of those products), stops when the next draft pass cannot add enough
of them, and the planner prices budgets with them. Two kinds of evidence:

- draft nodes: the draft's distribution at the node's parent, tempered: the chance is
  q_tau(token) = q^(1/tau) / sum over the vocabulary of q^(1/tau), with tau learned online by
  likelihood from a grid (TAUS). Under sampling the draft imitates the target's processed
  distribution and tau comes out near 1; under greedy decoding acceptance is steeper than q
  (a token the draft gives 0.6 is the target's argmax more often than 60 % of the time, and a
  first choice far more often than a second at the same q), which a tau below 1 expresses
  while keeping every node's place in the draft's own order. One parameter learned from
  hundreds of labels a minute is a low-variance estimate; an earlier per-bin (isotonic) fit of
  f(q) predicted the mean acceptance as well but ranked nodes worse (ties within a bin, noise
  between bins): at budget 256 on the 4 tuning prompts (greedy, one engine) it gave 6.25
  tokens per pass, the hand-set tau = 0.7 of earlier versions 6.90, the learned tau 6.67 (it
  learns tau = 0.7 there; the first prompt runs at the starting tau = 1 until labels arrive).
- context nodes (a continuation copied from earlier text, context.py) the draft has not read:
  a function g(L) of the length L of the match that proposed them, learned the same way from
  a weak prior. Once the draft has scored one, its own calibration by log q takes over (a
  separate f for context-backed tokens: on text that repeats, the target takes the copied
  token more often than the draft's q says; on open chat, a short match adds little). Taking
  the larger of the two estimates instead let short matches crowd the draft's better
  branches out of the tree (5.39 vs 5.67 tokens per pass, budget 64, 4 open chat prompts).
  Context nodes with a sibling (the same n-gram was followed by different tokens) have a table
  of their own: on the starter, greedy, their one-token matches were accepted 4 % (chat) and
  11 % (edit prompts) of the time against 23 % and 16 % for an only child, and two-token matches
  0-50 % against 67-70 %; one table for both priced three siblings at ~0.35 each, and default
  decoding paid 2.5x-cost tree passes for them on open chat (0.87x of plain decoding).

Every verified pass labels each child of each node on the accepted path (accepted or not), so
thousands of labels arrive per minute; counts decay by DECAY per pass, so the estimates follow
the conversation. Estimates are kept monotone (pool adjacent violators). One model per
temperature regime: greedy, and sampling at T <= 0.5, <= 1.0, above.

What this module does not do: grow trees (drafting.py) or decide budgets (engine.planning).
"""

from __future__ import annotations

import bisect
import math

import torch

from engine.types import SamplingSettings

# bins of log q (draft nodes): edges between them, from likely to unlikely
LOGQ_EDGES = (-0.05, -0.15, -0.3, -0.5, -0.75, -1.0, -1.5, -2.0, -3.0, -4.5)
# bins of match length (context nodes): 1, 2, 3, 4-5, 6-8, 9-15, 16+
MATCH_EDGES = (2, 3, 4, 6, 9, 16)
TAUS = (0.3, 0.4, 0.5, 0.6, 0.7, 0.85, 1.0, 1.25)  # draft temperatures the likelihood chooses among
PRIOR_WEIGHT = 2.0  # pseudo-observations behind each bin's prior
DECAY = 0.995  # per verified pass: the last few hundred passes count
FLOOR = 1e-4  # no node is ever certain to be rejected (keeps log finite)
RESTORED_SEEN = 16.0  # labels a bin of a saved table weighs as when a new process takes it back


class Calibrator:
    """P(accept) per bin of one feature: counts with a prior, kept monotone (non-increasing
    from the first bin to the last). Plain Python floats: a dozen bins, decayed and read on
    every step of a draft-free answer, where torch's per-call cost on tensors this small made
    the bookkeeping ~0.5 ms a step (5 % of the starter's step on two CPU cores)."""

    def __init__(self, prior: list[float]) -> None:
        self.prior = [float(p) for p in prior]
        self.hits = [0.0] * len(self.prior)
        self.seen = [0.0] * len(self.prior)
        self._table: list[float] | None = None
        self._tensor: torch.Tensor | None = None

    def observe(self, bins: torch.Tensor, accepted: torch.Tensor) -> None:
        """Decay the old counts and add labels (bins: (n,) long, accepted: (n,) bool)."""
        self.observe_list(bins.tolist(), accepted.tolist())

    def observe_list(self, bins: list[int], accepted: list[bool]) -> None:
        """`observe` with plain lists."""
        self.hits = [h * DECAY for h in self.hits]
        self.seen = [n * DECAY for n in self.seen]
        for b, a in zip(bins, accepted):
            self.seen[b] += 1.0
            if a:
                self.hits[b] += 1.0
        self._table = self._tensor = None

    def chances(self) -> list[float]:
        """(bins,) acceptance chances, non-increasing, in [FLOOR, 1]."""
        if self._table is None:
            weights = [n + PRIOR_WEIGHT for n in self.seen]
            raw = [(h + PRIOR_WEIGHT * p) / w for h, p, w in zip(self.hits, self.prior, weights)]
            self._table = [min(max(v, FLOOR), 1.0) for v in _non_increasing(raw, weights)]
        return self._table

    def table(self) -> torch.Tensor:
        """`chances` as a float64 tensor."""
        if self._tensor is None:
            self._tensor = torch.tensor(self.chances(), dtype=torch.float64)
        return self._tensor

    @property
    def observations(self) -> float:
        return float(sum(self.seen))

    def state(self) -> dict[str, list[float]]:
        return {"hits": list(self.hits), "seen": list(self.seen)}

    def restore(self, state: dict[str, list[float]]) -> None:
        """Take back a `state()`; the caller has checked it (lengths, finite, 0 <= hits <= seen).
        Its rates, at most RESTORED_SEEN labels a bin: the last process's answers may have been
        of another kind (edits that copy their prompt, then open chat), and a table weighing a
        few hundred passes took as many to learn that trees stopped paying (measured on the
        starter, chat after edits, fresh processes: draft-free trees 0.88x / 0.76x of plain
        decoding with the whole weight kept)."""
        keep = [min(RESTORED_SEEN / max(float(n), RESTORED_SEEN), 1.0) for n in state["seen"]]
        self.hits = [float(h) * k for h, k in zip(state["hits"], keep)]
        self.seen = [float(n) * k for n, k in zip(state["seen"], keep)]
        self._table = self._tensor = None


def _non_increasing(values: list[float], weights: list[float]) -> list[float]:
    """Weighted isotonic (non-increasing) fit by pooling adjacent violators."""
    blocks: list[tuple[float, float, int]] = []  # (value, weight, count)
    for v, w in zip(values, weights):
        blocks.append((v, w, 1))
        while len(blocks) > 1 and blocks[-2][0] < blocks[-1][0]:
            v2, w2, n2 = blocks.pop()
            v1, w1, n1 = blocks.pop()
            blocks.append(((v1 * w1 + v2 * w2) / (w1 + w2), w1 + w2, n1 + n2))
    return [v for v, _, n in blocks for _ in range(n)]


def _logq_centres() -> list[float]:
    """log q at the centre of each bin (the last, open bin: 1 below its edge)."""
    edges = (0.0, *LOGQ_EDGES, LOGQ_EDGES[-1] - 2.0)
    return [(hi + lo) / 2 for hi, lo in zip(edges[:-1], edges[1:])]


def _logq_prior() -> list[float]:
    """f(q) = q at each bin's centre."""
    return [math.exp(c) for c in _logq_centres()]


def _interpolate(x: torch.Tensor, centres: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Piecewise-linear interpolation of `values` (at descending `centres`), flat beyond the
    ends: monotone values stay monotone, and nodes in one bin still rank by their q."""
    xs, vs = centres.flip(0), values.flip(0)  # ascending
    x = x.clamp(float(xs[0]), float(xs[-1]))
    hi = torch.searchsorted(xs, x).clamp(1, len(xs) - 1)
    lo = hi - 1
    w = (x - xs[lo]) / (xs[hi] - xs[lo])
    return vs[lo] + w * (vs[hi] - vs[lo])


CONTEXT_PRIOR = [0.1, 0.2, 0.3, 0.4, 0.5, 0.55, 0.6]  # a weak start, learned away within a few passes
SHARED_PRIOR = [0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.55]  # the same for context nodes with a sibling


def log_z(q: torch.Tensor) -> torch.Tensor:
    """(m, V) draft log-probabilities -> (m, len(TAUS)): the log normaliser of q^(1/tau)."""
    return torch.stack([torch.logsumexp(q.float() / t, dim=-1) for t in TAUS], dim=-1)


def tempered(logq: torch.Tensor, parent_log_z: torch.Tensor) -> torch.Tensor:
    """(n,) log q of nodes and (n, len(TAUS)) log normalisers at their parents -> (n, len(TAUS))
    log q_tau of each node at each tau."""
    taus = torch.tensor(TAUS, dtype=torch.float32, device=logq.device)
    return logq.float()[:, None] / taus - parent_log_z.float()


class AcceptanceModel:
    """One regime's estimates: the draft's temperature, context-backed draft nodes by log q,
    context nodes by match length."""

    def __init__(self) -> None:
        # decayed log-likelihood of the labels under each tau; a faint start at tau = 1
        self.tau_ll = torch.tensor([1e-3 if t == 1.0 else 0.0 for t in TAUS], dtype=torch.float64)
        self.backed = Calibrator(_logq_prior())  # draft-scored nodes that are also context candidates
        self.context = Calibrator(list(CONTEXT_PRIOR))
        self.shared = Calibrator(list(SHARED_PRIOR))  # context nodes with a sibling
        self._logq_edges = torch.tensor(LOGQ_EDGES)
        self._centres = torch.tensor(_logq_centres(), dtype=torch.float64)
        self._match_edges = torch.tensor(MATCH_EDGES)

    @property
    def tau(self) -> float:
        return TAUS[int(torch.argmax(self.tau_ll))]

    def state(self) -> dict[str, object]:
        return {"tau_ll": self.tau_ll.tolist(), "backed": self.backed.state(), "context": self.context.state(),
                "shared": self.shared.state()}

    def restore(self, state: dict) -> None:
        self.tau_ll = torch.tensor(state["tau_ll"], dtype=torch.float64)
        self.backed.restore(state["backed"])
        self.context.restore(state["context"])
        if "shared" in state:  # files before it have none: its prior
            self.shared.restore(state["shared"])

    def draft_bins(self, logq: torch.Tensor) -> torch.Tensor:
        return torch.bucketize(-logq.float().cpu(), -self._logq_edges)

    def match_bins(self, match: torch.Tensor) -> torch.Tensor:
        return torch.bucketize(match.cpu(), self._match_edges, right=True)

    def log_accept(self, logq: torch.Tensor, match: torch.Tensor, logq_t: torch.Tensor | None = None,
                   shared: torch.Tensor | None = None) -> torch.Tensor:
        """(n,) log chance that each node is accepted given its parent is: a draft node's q at
        the learned tau (`logq_t`, (n, len(TAUS)) from `tempered`; None: tau = 1, q itself)
        when the draft has scored it (NaN: not scored), calibrated apart by log q when it is
        also a context candidate (match > 0), else from its context match length (0: not a
        context node), in a table of its own where the node has a sibling (`shared`, from
        `has_sibling`; None: none has)."""
        logq_c, match_c = logq.cpu(), match.cpu()
        out = torch.full(logq.shape, math.log(FLOOR), dtype=torch.float64)
        has_q = ~torch.isnan(logq_c)
        plain = has_q & (match_c == 0)
        if bool(plain.any()):
            own = logq_c if logq_t is None else logq_t.cpu()[:, TAUS.index(self.tau)]
            out[plain] = own[plain].double().clamp(math.log(FLOOR), 0.0)
        backed = has_q & (match_c > 0)
        if bool(backed.any()):
            x = logq_c[backed].double().clamp(min=-60.0)
            out[backed] = _interpolate(x, self._centres, self.backed.table().log())
        only_m = ~has_q & (match_c > 0)
        if bool(only_m.any()):
            both = torch.stack([self.context.table(), self.shared.table()])  # (2, bins)
            side = shared.cpu()[only_m].long() if shared is not None else torch.zeros(int(only_m.sum()), dtype=torch.long)
            out[only_m] = both[side, self.match_bins(match_c[only_m])].log()
        return out.to(torch.float32).to(logq.device)

    def context_chances(self, match: list[int], shared: list[bool]) -> list[float]:
        """log_accept of context nodes the draft has not scored, in plain Python: a draft-free
        step prices its candidates with these before it decides to grow a tree at all."""
        tables = self.context.chances(), self.shared.chances()
        return [math.log(tables[s][bisect.bisect_right(MATCH_EDGES, m)]) if m > 0 else math.log(FLOOR)
                for m, s in zip(match, shared)]

    def observe_context(self, match: list[int], shared: list[bool], accepted: list[bool]) -> None:
        """`observe` for context nodes alone (the root's children of a step cut to a plain
        pass): the same decay of every estimate, the labels to the match-length tables."""
        self.tau_ll = self.tau_ll * DECAY
        self.backed.observe_list([], [])
        for table, side in ((self.context, False), (self.shared, True)):
            kept = [(m, a) for m, s, a in zip(match, shared, accepted) if m > 0 and s == side]
            table.observe_list([bisect.bisect_right(MATCH_EDGES, m) for m, _ in kept], [a for _, a in kept])

    def observe(self, logq: torch.Tensor, match: torch.Tensor, logq_t: torch.Tensor, accepted: torch.Tensor,
                shared: torch.Tensor | None = None) -> None:
        """Labels of nodes whose parent was on the accepted path (`logq_t`, `shared` as in
        log_accept)."""
        logq, match, accepted = logq.cpu(), match.cpu(), accepted.cpu()
        has_q, has_m = ~torch.isnan(logq), match > 0
        plain = has_q & ~has_m
        p = logq_t.cpu()[plain].double().exp().clamp(FLOOR, 1.0 - FLOOR)  # (n, len(TAUS))
        hit = accepted[plain].double()[:, None]
        self.tau_ll = self.tau_ll * DECAY + (hit * p.log() + (1.0 - hit) * (-p).log1p()).sum(0)
        self.backed.observe(self.draft_bins(logq[has_q & has_m]), accepted[has_q & has_m])
        side = shared.cpu() if shared is not None else torch.zeros_like(has_m)
        self.context.observe(self.match_bins(match[has_m & ~side]), accepted[has_m & ~side])
        self.shared.observe(self.match_bins(match[has_m & side]), accepted[has_m & side])


def has_sibling(parents: torch.Tensor) -> torch.Tensor:
    """(n,) whether each node of a tree (parents: (n,), the root's -1) shares its parent with
    another node."""
    counts = torch.bincount(parents.clamp(min=0).cpu(), minlength=parents.shape[0])
    counts[0] -= int((parents < 0).sum())  # the root is nobody's child
    return (counts[parents.clamp(min=0).cpu()] > 1) & (parents.cpu() >= 0)


def regime(sampling: SamplingSettings) -> str:
    """Which model a request's passes teach and use."""
    if sampling.greedy:
        return "greedy"
    return "t<=0.5" if sampling.temperature <= 0.5 else "t<=1" if sampling.temperature <= 1.0 else "t>1"


class AcceptanceModels:
    """One AcceptanceModel per temperature regime, for an engine's life."""

    def __init__(self) -> None:
        self._models: dict[str, AcceptanceModel] = {}

    def __getitem__(self, sampling: SamplingSettings) -> AcceptanceModel:
        key = regime(sampling)
        model = self._models.get(key)
        if model is None:  # not setdefault: that builds a model on every call
            model = self._models[key] = AcceptanceModel()
        return model

    def state(self) -> dict[str, dict[str, object]]:
        return {name: model.state() for name, model in self._models.items()}

    def restore(self, state: dict[str, dict]) -> None:
        for name, model_state in state.items():
            model = AcceptanceModel()
            model.restore(model_state)
            self._models[name] = model
