"""What passes cost on this machine, measured by the engine as it decodes: the time of a target
pass as a function of the tokens it reads, and the time of a draft pass within a step. A pass
over one token is priced on its own (a decaying mean); passes over more by a curve through the
decaying mean (tokens, seconds) of the passes in each size bucket (2, 3-4, 5-8, ... tokens),
straight between neighbouring buckets and continued past the outermost by their slope.

Why a curve of buckets and not one line: passes come in two kinds of size. Trees are a few to a
few hundred tokens; an answer's first pass also reads the prompt's tail (often 100-2000). A
line through both (the model until 2026-11-28) took its slope from the prompt passes and priced
small trees from it: on a CPU MoE the learned line said a 2-token pass costs 2.8 one-token passes
where it measured 1.6, and draft-free trees on text that repeated 85-90 % of the time were never
verified. A CPU also prices one token apart (matrix-vector products, more run matrix-matrix: the
first two-token pass ~1.5x a one-token pass, 17 tokens ~2x on the starter), and an MoE's passes
are concave in their size (the union of the experts its tokens wake); a curve follows both.

Tree growth stops when a draft pass is worth less than it costs (drafting.grow_tree's
stop_ratio), a draft-free tree is cut to the size that gives the most tokens per second
(`best_size`), and a conversation's draft goes off while its steps are measured slower than
steps without it (`DraftSwitch`; `DraftSwitches` keeps one per recent conversation).

What this module does not do: predict costs for models that are not loaded (engine.planning).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

DECAY = 0.97  # per observation of a kind (one token, a bucket): the means follow the machine's current load
BUCKETS = 18  # passes of 2, 3-4, 5-8, .. tokens (bucket()); the last takes every larger pass (65,537+)
STOP_RATIO_START = 0.02  # a draft pass's share of a step before anything is measured


class PassCosts:
    """Decaying means of one-token passes, of the passes in each size bucket, and of draft passes."""

    def __init__(self) -> None:
        self._w1 = self._t1 = 0.0  # weighted sums of one-token passes
        self._buckets = [[0.0, 0.0, 0.0] for _ in range(BUCKETS)]  # of 2+ tokens (bucket()): weight, tokens, seconds
        self._draft_pass = 0.0  # EMA seconds per draft pass
        self._step = 0.0  # EMA seconds per speculation step (draft + target)

    SCALARS = ("w1", "t1", "draft_pass", "step")
    FIELDS = (*SCALARS, *(f"b{b}{kind}" for b in range(1, BUCKETS) for kind in "wnt"))

    def state(self) -> dict[str, float]:
        """What has been learned, as numbers (engine.decoding.learned saves it)."""
        out = {name: float(getattr(self, "_" + name)) for name in self.SCALARS}
        for b in range(1, BUCKETS):
            out.update({f"b{b}{kind}": float(v) for kind, v in zip("wnt", self._buckets[b])})
        return out

    def restore(self, state: dict[str, float]) -> None:
        """Take back a `state()`; the caller has checked it (every field, finite, not negative)."""
        for name in self.SCALARS:
            setattr(self, "_" + name, float(state[name]))
        for b in range(1, BUCKETS):
            self._buckets[b] = [float(state[f"b{b}{kind}"]) for kind in "wnt"]

    def observe_target(self, tokens: int, seconds: float) -> None:
        if tokens <= 1:
            self._w1 = self._w1 * DECAY + 1.0
            self._t1 = self._t1 * DECAY + seconds
            return
        w, n, t = self._buckets[bucket(tokens)]
        self._buckets[bucket(tokens)] = [w * DECAY + 1.0, n * DECAY + tokens, t * DECAY + seconds]

    def observe_step(self, draft_seconds: float, draft_passes: int, target_seconds: float) -> None:
        if draft_passes:
            per_pass = draft_seconds / draft_passes
            self._draft_pass = per_pass if not self._draft_pass else 0.8 * self._draft_pass + 0.2 * per_pass
        step = draft_seconds + target_seconds
        self._step = step if not self._step else 0.8 * self._step + 0.2 * step

    def target(self, tokens: int) -> float:
        """Predicted seconds of a target pass over `tokens` tokens. Before passes of 2+ tokens
        are measured, a pass over 1 + k tokens costs (1 + k/64) one-token passes: optimistic, so
        that trees are tried and measured; relative figures before any measurement at all."""
        single = self._t1 / self._w1 if self._w1 > 1e-9 else None
        if tokens <= 1 and single is not None:
            return single
        points = self._points()
        if not points:
            return (single or 1.0 + 1.0 / 64) * (1.0 + (max(tokens, 1) - 1) / 64)
        if single is not None:
            points.insert(0, (1.0, single))
        elif tokens < points[0][0]:  # only larger passes so far: scaled by the prior's shape
            n0, t0 = points[0]
            return t0 * (1.0 + (tokens - 1) / 64) / (1.0 + (n0 - 1) / 64)
        return max(_along(points, float(tokens)), single or 0.0)  # never below one token's cost

    def _points(self) -> list[tuple[float, float]]:
        """(mean tokens, mean seconds) of each measured bucket, by size."""
        return [(n / w, t / w) for w, n, t in self._buckets[1:] if w > 1e-9]

    def stop_ratio(self) -> float:
        """A draft pass's share of a speculation step's time."""
        if not self._draft_pass or not self._step:
            return STOP_RATIO_START
        return self._draft_pass / self._step

    def best_size(self, gains: Sequence[float], overhead: int = 1) -> int:
        """How many of a draft-free tree's nodes to verify: `gains` are their acceptance chances
        along the path, best first (a prefix of them is a tree); the size b maximising
        (1 + sum of the first b) / t(overhead + b): expected tokens per second of the pass."""
        best, best_rate, total = 0, 1.0 / self.target(overhead), 1.0
        for b, g in enumerate(gains, start=1):
            total += g
            rate = total / self.target(overhead + b)
            if rate > best_rate and math.isfinite(rate):
                best, best_rate = b, rate
        return best


def bucket(tokens: int) -> int:
    """The size bucket of a pass over `tokens` >= 2 tokens: ceil(log2(tokens)), at most BUCKETS - 1."""
    return min(max(1, (tokens - 1).bit_length()), BUCKETS - 1)


def _along(points: list[tuple[float, float]], n: float) -> float:
    """The piecewise-linear curve through `points` (by size, the first at or below n) at n:
    straight between the two around it; past the last continued by the last segment's slope
    (not below zero: a noisy pair of buckets never prices a larger pass cheaper), or flat
    through a single point."""
    if len(points) == 1:
        return points[0][1]
    i = 1
    while i < len(points) - 1 and points[i][0] < n:
        i += 1
    (n0, t0), (n1, t1) = points[i - 1], points[i]
    slope = (t1 - t0) / (n1 - n0) if n1 > n0 else 0.0
    if n > n1:
        slope = max(slope, 0.0)
    return t0 + slope * (n - n0)


@dataclass(frozen=True)
class SwitchSettings:
    """When a conversation's draft is judged (DraftSwitch)."""

    decay: float = 0.9  # per step of one kind: the last ~10 steps count
    evidence_s: float = 2.0  # seconds of draft steps measured before they are judged...
    evidence_steps: int = 4  # ...and this many steps
    far_behind: float = 0.5  # draft steps below this share of the alternative's speed go off after one step
    retry_tokens: int = 256  # tokens decoded without the draft before it is measured again...
    retry_factor: float = 10.0  # ...and at least this many times the seconds its last measurement cost


MAX_SWITCHES = 64  # conversations whose draft verdicts the engine remembers


class DraftSwitch:
    """Whether one conversation's draft pays: decaying tokens-per-second of its steps with the
    draft's trees and without them (context trees or single tokens), both measured as it
    decodes. The draft goes off while its steps are slower than the alternative (measured, or
    before any measurement a single-token target pass as the fit predicts it): after one step
    when it is far behind, else after `evidence_steps` steps and `evidence_s` seconds (its
    SwitchSettings). It is measured again after `retry_tokens` tokens without it, and no sooner
    than `retry_factor` times what its last measurement cost, so that measuring a draft that does
    not pay costs at most about a tenth of the time: acceptance changes with the text (code
    being edited accepts deep trees, open chat fewer), and so do the machine's loads."""

    def __init__(self, settings: SwitchSettings = SwitchSettings()) -> None:
        self.settings = settings
        self._tokens = {True: 0.0, False: 0.0}
        self._seconds = {True: 0.0, False: 0.0}
        self.off_tokens: int | None = None  # tokens decoded since the draft went off; None: on
        self._off_seconds = 0.0  # seconds decoded since then
        self._wait_s = 0.0  # the seconds to stay off: retry_factor x the last measurement's
        self._evidence = [0, 0.0]  # draft steps and their seconds since the draft was (re)measured

    @property
    def on(self) -> bool:
        return self.off_tokens is None

    def rate(self, with_draft: bool) -> float | None:
        s = self._seconds[with_draft]
        return self._tokens[with_draft] / s if s > 0 else None

    def observe(self, with_draft: bool, tokens: int, seconds: float) -> None:
        decay = self.settings.decay
        self._tokens[with_draft] = self._tokens[with_draft] * decay + tokens
        self._seconds[with_draft] = self._seconds[with_draft] * decay + seconds
        if with_draft:
            self._evidence = [self._evidence[0] + 1, self._evidence[1] + seconds]
        elif self.off_tokens is not None:
            self.off_tokens += tokens
            self._off_seconds += seconds

    def decide(self, costs: PassCosts) -> bool:
        """Whether the next step uses the draft; turns it off or back on as measured."""
        cfg = self.settings
        if self.on:
            steps, seconds = self._evidence
            if steps < 1:
                return True
            with_draft = self._tokens[True] / max(self._seconds[True], 1e-9)
            without = self.rate(False)
            if without is None:
                without = 1.0 / costs.target(1)
            judged = steps >= cfg.evidence_steps and seconds >= cfg.evidence_s
            if with_draft < cfg.far_behind * without or (judged and with_draft < without):
                self.off_tokens, self._off_seconds = 0, 0.0
                self._wait_s = cfg.retry_factor * seconds
                return False
            return True
        assert self.off_tokens is not None
        if self.off_tokens >= cfg.retry_tokens and self._off_seconds >= self._wait_s:  # measure it afresh
            self._tokens[True] = self._seconds[True] = 0.0
            self._evidence = [0, 0.0]
            self.off_tokens = None
            return True
        return False


class DraftSwitches:
    """The draft verdicts of the most recent conversations (None: requests without one), so a
    conversation's verdict survives between its turns and the table stays bounded."""

    def __init__(self, settings: SwitchSettings = SwitchSettings(), most: int = MAX_SWITCHES) -> None:
        self.settings = settings
        self._most = most
        self._by_conversation: dict[str | None, DraftSwitch] = {}

    def for_conversation(self, conversation: str | None) -> DraftSwitch:
        switch = self._by_conversation.pop(conversation, None) or DraftSwitch(self.settings)
        self._by_conversation[conversation] = switch  # the most recent last
        while len(self._by_conversation) > self._most:
            del self._by_conversation[next(iter(self._by_conversation))]
        return switch

    def __len__(self) -> int:
        return len(self._by_conversation)
