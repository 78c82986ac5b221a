"""The state of one generation between the Engine's steps (generation.py): how it uses the
draft, its caches and text so far, and what one step did."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from engine.decoding.context import ContextIndex
from engine.decoding.costs import DraftSwitch
from engine.decoding.drafting import DraftTrace
from engine.decoding.grammar import GrammarState
from engine.decoding.logprobs import LogprobRecorder
from engine.decoding.prefix_cache import Prefix
from engine.decoding.stats import StepTimers
from engine.decoding.text import Detokenizer
from engine.model.cache import KVCache
from engine.types import FinishReason, GenerationRequest, TokenEvent

Choose = Callable[[torch.Tensor, list[int]], int]  # ((V,) logits, tokens of this step so far) -> token


@dataclass
class DraftUse:
    """How one generation uses the draft (all off without one)."""

    on: bool  # the draft grows the next step's tree (else context candidates alone)
    share: bool = False  # it reads the target's K/V of committed tokens (drafting.share_context)
    switch: DraftSwitch | None = None  # the conversation's verdict, when the engine may switch the draft
    synced: int = 0  # the draft cache's entries before this are the target's
    switched: bool = False  # the draft went off or on during this generation


@dataclass
class Decoding:
    """The state of one generation between steps."""

    request: GenerationRequest  # its budget halves after an out-of-memory step
    prompt: list[int]
    use_spec: bool  # trees (from the draft and/or context candidates), else one token per pass
    draft: DraftUse
    index: ContextIndex | None  # the text so far, for context candidates
    prefix: Prefix  # its caches: tcache, dcache below
    cached_tokens: int
    choose: Choose
    detok: Detokenizer
    seq: list[int]  # prompt + committed answer tokens
    new: list[int] = field(default_factory=list)
    timers: StepTimers = field(default_factory=StepTimers)
    finish: FinishReason = "length"
    ttft: float | None = None
    oom_retries: int = 0
    grammar: GrammarState | None = None  # the request's constraint, after the committed tokens
    logprobs: LogprobRecorder | None = None  # the written tokens' log-probabilities, when asked for

    @property
    def tcache(self) -> KVCache:
        return self.prefix.target

    @property
    def dcache(self) -> KVCache | None:
        return self.prefix.draft

    def event(self, tokens: list[int], text: str) -> TokenEvent:
        return TokenEvent(tuple(tokens), text, self.logprobs.take() if self.logprobs is not None else ())


@dataclass(frozen=True)
class Step:
    """What one step did, for `_learn`: the tokens it commits and the passes that chose them."""

    tokens: list[int]
    target_tokens: int  # tokens the target pass read (the tree, or the root, plus uncached text)
    target_seconds: float
    trace: DraftTrace | None = None  # the tree the step grew, if any
    path: list[int] = field(default_factory=list)  # its nodes the target accepted ([0]: cut to a plain pass)
    verified: bool = False  # the target read the tree (else it was cut to a plain pass)
