"""Frozen dataclasses that cross the engine's API (to the CLI, the app and the planner).

Plain data only: no tensors, no models, no Qt. Change settings with `dataclasses.replace`.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from engine.errors import InvalidRequest
from engine.shapes import Placement

FinishReason = Literal["eos", "length", "stop", "cancelled"]
DecodeMode = Literal["specexec", "autoregressive"]
StepMode = Literal["specexec", "context", "autoregressive"]  # how an answer was decoded: draft trees, draft-free
Device = Literal["auto", "cpu", "cuda"]
Quant = Literal["none", "nf4"]
Offload = Literal["auto", "none", "all"]
Experts = Literal["auto", "cpu", "gpu", "stream"]  # where an MoE target's routed experts run (LoadSettings)
TreeMode = Literal["specexec", "sequoia"]
Fit = Literal["fits", "slow", "too big"]
LoadStage = Literal["starter", "target", "draft", "ready"]
DownloadState = Literal["checking", "downloading", "verifying", "retrying", "paused", "done", "failed", "cancelled"]
DEFAULT_RANK_ACCEPTANCE = (0.73, 0.12, 0.05, 0.025, 0.015, 0.01, 0.007, 0.005)


class Tokenizer(Protocol):
    """The part of a Hugging Face tokenizer the engine uses (PreTrainedTokenizerFast has it)."""

    chat_template: str | None
    eos_token_id: int | None

    def __len__(self) -> int: ...

    def __call__(self, text: str, add_special_tokens: bool = ...) -> Mapping[str, Any]: ...

    # other keywords: `tools` and the template's own variables (reasoning_effort, ...)
    def apply_chat_template(self, conversation: list[dict[str, str]], *, add_generation_prompt: bool = ...,
                            continue_final_message: bool = ..., tokenize: bool = ..., **kwargs: Any) -> Any: ...

    # transformers types decode of a batch (list[str]) and of one sequence (str) alike
    def decode(self, token_ids: list[int], skip_special_tokens: bool = ...) -> str | list[str]: ...

    def get_vocab(self) -> dict[str, int]: ...


@dataclass(frozen=True)
class PassTotals:
    """Decode passes of one (tree mode, budget), summed over generations: what the planner
    calibrates its tokens-per-pass curve and pass times from."""

    passes: int = 0
    tokens: int = 0
    draft_passes: int = 0
    draft_seconds: float = 0.0
    target_seconds: float = 0.0

    @property
    def tokens_per_pass(self) -> float:
        return self.tokens / self.passes if self.passes else 0.0

    def __add__(self, other: PassTotals) -> PassTotals:
        return PassTotals(self.passes + other.passes, self.tokens + other.tokens,
                          self.draft_passes + other.draft_passes, self.draft_seconds + other.draft_seconds,
                          self.target_seconds + other.target_seconds)


PassRecord = Mapping[tuple[str, int], PassTotals]  # (tree mode, budget) -> totals


@dataclass(frozen=True)
class SamplingSettings:
    """How a token is chosen from logits. temperature 0 means greedy (argmax).

    top_k 0 and top_p 1.0 and min_p 0.0 and repetition_penalty 1.0 each mean "off".
    repetition_window: how many of the latest tokens (prompt and answer) the penalty looks at,
    as llama.cpp's repeat_last_n (64) and Ollama do; 0 = all of them. End-of-turn tokens are
    never penalised (every earlier turn of a chat holds one).
    `seed` None draws a fresh seed per request.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    repetition_window: int = 64
    seed: int | None = None

    def __post_init__(self) -> None:
        # `not (a <= x <= b)` also refuses NaN
        if not 0.0 <= self.temperature <= 100.0:
            raise InvalidRequest(f"The temperature must be between 0 and 100 (got {self.temperature}).")
        if self.top_k < 0:
            raise InvalidRequest(f"top-k must be 0 (off) or more (got {self.top_k}).")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequest(f"top-p must be above 0 and at most 1 (got {self.top_p}).")
        if not 0.0 <= self.min_p <= 1.0:
            raise InvalidRequest(f"min-p must be between 0 and 1 (got {self.min_p}).")
        if not 0.0 < self.repetition_penalty <= 100.0:
            raise InvalidRequest(f"The repetition penalty must be above 0 and at most 100 (got {self.repetition_penalty}).")
        if self.repetition_window < 0:
            raise InvalidRequest(f"The repetition window must be 0 (everything) or more tokens (got {self.repetition_window}).")
        if self.seed is not None and not 0 <= self.seed < 2**64:
            raise InvalidRequest(f"The seed must be a whole number from 0 to 2^64 - 1 (got {self.seed}).")

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


MAX_TOP_LOGPROBS = 20  # most alternatives a token's log-probability comes with (OpenAI's limit)
AUTO_FALLBACK_BUDGET = 64  # budget "auto" without a plan (engine.decoding.auto_budget)


@dataclass(frozen=True)
class SpeculationSettings:
    """Shape of the speculation tree.

    mode: "specexec" grows a tree each step (from the draft and from context candidates, or
        from context candidates alone when there is no draft model); "autoregressive" decodes
        one token per target pass.
    budget: most tree tokens verified by one target pass (B in the paper); 0 = automatic:
        engine.decoding.auto_budget resolves it per request before the Engine sees it.
    max_depth: most tokens on one root-to-leaf path of the tree.
    branching: most children per expanded node (top-k of the draft distribution).
    expand_per_pass: most nodes expanded by one batched draft pass; None = derived from budget.
    min_pass_gain: stop growing when the nodes the next draft pass would read hold less than
        this much estimated acceptance in total (their children can add at most that many
        expected tokens). None (the default): the threshold follows the measured costs, a pass
        pays while its gain exceeds the expected tokens so far times its share of a step's time.
    draft: grow trees with the loaded draft model (False: context candidates alone; the
        planner turns the draft off where it does not pay).
    switch_draft: the engine measures its steps with the draft's trees against steps without
        them and turns the draft off for the conversation while it is the slower, measuring it
        again every few hundred tokens (engine.decoding.costs.DraftSwitch). Off by default for
        callers that measure trees (benchmarks, tests); the app, the CLI and the API server
        turn it on.
    share_context: when the draft is a compressed copy of the target (same shapes, embeddings
        pointing the same way: drafting.copy_of_target), it reads the target's K/V for the
        committed tokens instead of its own (SubSpec); it then prefills nothing.
    context: continuations copied from earlier in the text enter the tree (engine.decoding.context).
    context_candidates: how many distinct continuations enter at most.
    tree_mode: "specexec" grows the dynamic tree above; "sequoia" fills a static tree shape
        built once per (budget, depth) by sequoia.build_tree from `rank_acceptance`.
    rank_acceptance: chance that the target's token is the draft's 1st, 2nd, ... likeliest
        token (Sequoia trees only). The default is a prior near the starter pair's measured
        top-1 agreement 0.73, top-4 0.93; `specchat bench speculation` measures the pair's own.
    """

    mode: DecodeMode = "specexec"
    budget: int = 64
    max_depth: int = 16
    branching: int = 32
    expand_per_pass: int | None = None
    min_pass_gain: float | None = None
    draft: bool = True
    switch_draft: bool = False
    share_context: bool = True
    context: bool = True
    context_candidates: int = 8
    tree_mode: TreeMode = "specexec"
    rank_acceptance: tuple[float, ...] = DEFAULT_RANK_ACCEPTANCE

    def __post_init__(self) -> None:
        if self.mode not in ("specexec", "autoregressive"):
            raise InvalidRequest(f"The decoding mode must be 'specexec' or 'autoregressive' (got {self.mode!r}).")
        if self.budget < 0:
            raise InvalidRequest(f"The tree budget must be at least 1, or 0 for automatic (got {self.budget}).")
        if self.max_depth < 1:
            raise InvalidRequest(f"The tree depth must be at least 1 (got {self.max_depth}).")
        if self.branching < 1:
            raise InvalidRequest(f"The tree branching must be at least 1 (got {self.branching}).")
        if self.expand_per_pass is not None and self.expand_per_pass < 1:
            raise InvalidRequest(f"Nodes per draft pass must be at least 1 (got {self.expand_per_pass}).")
        if self.min_pass_gain is not None and not self.min_pass_gain >= 0:
            raise InvalidRequest(f"The minimum pass gain must be 0 or more (got {self.min_pass_gain}).")
        if self.context_candidates < 0:
            raise InvalidRequest(f"Context candidates must be 0 or more (got {self.context_candidates}).")
        if self.tree_mode not in ("specexec", "sequoia") or not self.rank_acceptance:
            raise InvalidRequest("The tree mode must be 'specexec' or 'sequoia' (with an acceptance-by-rank vector).")

    @property
    def nodes_per_draft_pass(self) -> int:
        return self.expand_per_pass or default_expand_per_pass(self.budget)


def default_expand_per_pass(budget: int) -> int:
    """Nodes one batched draft pass reads: enough that a budget fills in ~8 passes (fewer,
    larger passes amortise per-pass overhead), at least 1. The drafter and the cost model
    both use it."""
    return max(1, math.ceil(budget / 8))


@dataclass(frozen=True)
class CacheSettings:
    """KV caches kept between turns (engine.decoding.prefix_cache) and saved to disk
    (engine.model.cache_files).

    ram_budget_bytes: most host memory the caches of conversations not being answered may hold
        (the least recently used leave first: to disk when long enough, else dropped); 0 keeps
        only the conversation being answered.
    disk_budget_bytes: most disk the saved caches may take (oldest first out); 0 saves nothing.
    min_saved_tokens: shorter prefixes are not saved: reading them again costs less than
        loading a file (see the README's conversation benchmark).
    disk_dir: where saved caches live (None: <cache dir>/kv).
    enabled: False starts every request from empty caches (a benchmark's baseline).
    max_parked: most prefixes kept in memory: every request scans them, and stateless API
        requests sharing a prompt would otherwise each leave a copy behind (within the RAM budget).
    """

    enabled: bool = True
    ram_budget_bytes: int = 2 * 10**9  # decimal GB, as Settings shows it
    disk_budget_bytes: int = 8 * 10**9
    min_saved_tokens: int = 512
    disk_dir: str | None = None
    max_parked: int = 32

    def __post_init__(self) -> None:
        if self.max_parked < 1:
            raise InvalidRequest("At least one conversation's cache must be kept (max_parked >= 1).")
        if self.ram_budget_bytes < 0 or self.disk_budget_bytes < 0 or self.min_saved_tokens < 0:
            raise InvalidRequest("Cache budgets and the shortest saved prefix must be 0 or more.")


@dataclass(frozen=True)
class LoadSettings:
    """Where and how a target/draft pair is loaded (the CLI's --device/--quant/--offload).

    device "auto" = CUDA when PyTorch sees a GPU, else CPU. quant applies to the target's
    decoder layers (the draft stays 16-bit). offload: "none" keeps every target layer on the
    device, "all" streams every decoder layer from host memory each pass, "auto" keeps as many
    as fit (engine.planning.placement). ram_limit_bytes caps the host store (None = measured
    available RAM less a margin); layers past it go to the disk tier. context_length is the
    KV cache the placement reserves room for (None = the model's maximum, capped at 8192).
    experts: where an MoE GGUF's routed experts run on a GPU machine: "cpu" keeps them packed in
    RAM, run by the CPU kernel, and everything else on the GPU; "gpu" places them with their
    layers; "stream" keeps them in RAM and copies every pass's to the GPU to run there (a
    benchmark's mode: nothing cached); "auto" is "cpu" when the layers would not all fit on the
    GPU, with the passes long enough (prompt chunks) streaming theirs. expert_cache: with the
    experts on the CPU, the most used of them kept in the VRAM left once both models are loaded
    (bytes at most; None = all of it, 0 = none; engine.kernels.expert_cache).
    cache: the KV caches kept between turns and saved to disk.
    """

    device: Device = "auto"
    quant: Quant = "none"
    offload: Offload = "auto"
    ram_limit_bytes: int | None = None
    experts: Experts = "auto"
    expert_cache: int | None = None
    context_length: int | None = None
    cache: CacheSettings = field(default_factory=CacheSettings)

    def __post_init__(self) -> None:
        if self.ram_limit_bytes is not None and not self.ram_limit_bytes >= 0:
            raise InvalidRequest(f"The RAM limit must be 0 or more (got {self.ram_limit_bytes / 1e9:g} GB).")
        if self.context_length is not None and self.context_length < 1:
            raise InvalidRequest(f"The context length must be at least 1 token (got {self.context_length}).")


@dataclass(frozen=True)
class LoadProgress:
    """Progress of loading a pair: stage is "target" | "draft" | "ready"; fraction in 0..1 of
    the whole load; message is one line a user can read ("layer 12 of 80 -> RAM")."""

    stage: LoadStage
    fraction: float
    message: str = ""


@dataclass(frozen=True)
class ToolCall:
    """A function call the assistant made: `arguments` is a JSON object as text (as OpenAI's API
    carries it); `id` is what the tool's answer names in its `tool_call_id`."""

    id: str
    name: str
    arguments: str


@dataclass(frozen=True)
class ToolSpec:
    """A function the model may call: `parameters` is its JSON Schema as JSON text (text keeps a
    request hashable and frozen; the chat template reads it parsed)."""

    name: str
    description: str = ""
    parameters: str = '{"type": "object", "properties": {}}'


@dataclass(frozen=True)
class OutputConstraint:
    """The answer's text must match a grammar (engine.decoding.grammar decodes under it,
    losslessly: the output is what the target would write with every token the grammar forbids
    taken out of its distribution). kind "json_schema": `source` is a JSON Schema as JSON text
    (the answer is one JSON value it accepts; "{}" any value); kind "lark": `source` is a
    grammar in llguidance's Lark dialect, which may embed JSON Schemas as `%json {...}` (tool
    calls in a model's own format). The answer ends with an end-of-turn token only where the
    grammar is complete. `what` names the constraint in errors ("response_format", "tool_choice")."""

    kind: Literal["json_schema", "lark"]
    source: str
    what: str = "the output grammar"

    def __post_init__(self) -> None:
        if self.kind not in ("json_schema", "lark"):
            raise InvalidRequest(f"An output constraint is a 'json_schema' or a 'lark' grammar (got {self.kind!r}).")


@dataclass(frozen=True)
class Message:
    """One turn of a chat. An assistant turn may carry `tool_calls` (its content may then be
    empty) and the `reasoning` it showed; a "tool" turn is a call's result, naming the call by
    `tool_call_id` (and the function by `name`)."""

    role: Literal["system", "user", "assistant", "tool"]
    content: str
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str | None = None
    name: str | None = None
    reasoning: str | None = None


@dataclass(frozen=True)
class GenerationRequest:
    """One completion. Exactly one of `messages` (chat-templated) or `raw_prompt` (plain text).
    `continue_final`: write on from the last message (an assistant answer cut by the token
    limit) instead of opening a new assistant turn."""

    messages: tuple[Message, ...] = ()
    raw_prompt: str | None = None
    max_new_tokens: int = 256
    # an opaque key of the conversation (the app's conversation id, a CLI chat session): its KV
    # cache is reused in place on the next turn, regenerate or edit; other requests reuse a copy
    # of the longest matching cached prefix (engine.decoding.prefix_cache)
    conversation: str | None = None
    stop: tuple[str, ...] = ()
    sampling: SamplingSettings = field(default_factory=SamplingSettings)
    speculation: SpeculationSettings = field(default_factory=SpeculationSettings)
    continue_final: bool = False
    # functions the chat template shows the model (its own tool format); none: no tools shown
    tools: tuple[ToolSpec, ...] = ()
    # a template variable for models that take it (gpt-oss: "low" / "medium" / "high")
    reasoning_effort: str | None = None
    # the answer must match this grammar (structured output, forced tool calls); None: free text
    constraint: OutputConstraint | None = None
    # per answer token, its log-probability and this many top alternatives (0..MAX_TOP_LOGPROBS);
    # None: none are computed (engine.decoding.logprobs says which distribution)
    logprobs: int | None = None

    def __post_init__(self) -> None:
        if self.raw_prompt is not None and self.messages:
            raise InvalidRequest("Give either chat messages or a raw prompt, not both.")
        if self.continue_final and (not self.messages or self.messages[-1].role != "assistant"):
            raise InvalidRequest("Only an answer can be continued: the last message must be the assistant's.")
        if self.max_new_tokens < 1:
            raise InvalidRequest(f"max new tokens must be at least 1 (got {self.max_new_tokens}).")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise InvalidRequest(f"Top log-probabilities: from 0 to {MAX_TOP_LOGPROBS} a token (got {self.logprobs}).")
        if self.tools and self.raw_prompt is not None:
            raise InvalidRequest("Tools are shown to the model through its chat template: give chat messages, "
                                 "not a raw prompt.")
        texts = [("The prompt", self.raw_prompt or "")] + [(f"A {m.role} message", m.content) for m in self.messages]
        for what, text in texts + [("A stop string", stop) for stop in self.stop]:
            check_text(text, what)


def check_text(text: str, what: str) -> None:
    """InvalidRequest when `text` cannot be UTF-8 encoded: lone surrogates, which is how Python
    carries the bytes of a non-UTF-8 command-line argument (surrogateescape). The tokenizer
    would fail on them with a TypeError."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidRequest(
            f"{what} is not valid UTF-8 text (an undecodable byte at character {exc.start + 1}). "
            "Pass the text in UTF-8; a terminal or file in another encoding can cause this."
        ) from None


@dataclass(frozen=True)
class TokenAlternative:
    """A token the model could have written at a position, with its log-probability. `text`
    is its bytes decoded (a piece of a multi-byte character shows as U+FFFD)."""

    token_id: int
    text: str
    data: bytes
    logprob: float


@dataclass(frozen=True)
class TokenLogprob:
    """One written token's log-probability and the `top` most likely tokens at its position
    (sorted, most likely first), when the request asked for them (GenerationRequest.logprobs)."""

    token: TokenAlternative
    top: tuple[TokenAlternative, ...] = ()


@dataclass(frozen=True)
class TokenEvent:
    """Tokens accepted by one decoding step and the text they add (may be empty while a
    multi-byte character is incomplete, or held back while it could start a stop string).
    `logprobs` (only when asked for): one per token written since the previous event, in order
    (this event's tokens and those of steps whose text was held back)."""

    token_ids: tuple[int, ...]
    text: str
    logprobs: tuple[TokenLogprob, ...] = ()


@dataclass(frozen=True)
class GenerationStats:
    prompt_tokens: int
    new_tokens: int
    target_passes: int
    tokens_per_pass: float
    draft_passes: int
    budget: int
    seconds: float
    ttft_seconds: float
    tokens_per_second: float
    peak_rss_bytes: int
    draft_seconds: float = 0.0
    target_seconds: float = 0.0
    prefill_seconds: float = 0.0
    mode: StepMode = "specexec"
    placement: Placement | None = None
    oom_retries: int = 0  # steps re-run with a smaller budget after a device out-of-memory
    cached_tokens: int = 0  # prompt tokens whose KV was reused from an earlier turn (not read again)
    prefill_passes: int = 0  # target passes that read the prompt before the first decoding step

    @property
    def overhead_seconds(self) -> float:
        """Everything in the decode loop but model passes (tree bookkeeping, sampling, ...)."""
        return max(0.0, self.seconds - self.prefill_seconds - self.draft_seconds - self.target_seconds)


@dataclass(frozen=True)
class Completion:
    """The final event of a generation."""

    text: str
    token_ids: tuple[int, ...]
    finish_reason: FinishReason
    stats: GenerationStats
    logprobs: tuple[TokenLogprob, ...] = ()  # one per token id, when the request asked for them


@dataclass(frozen=True)
class DownloadProgress:
    """Progress of one model download, safe to send across threads.

    state: "checking" | "downloading" | "verifying" | "retrying" | "paused" | "done" |
    "failed" | "cancelled". Speeds are rolling averages in bytes/s; eta None when unknown.
    """

    model_id: str
    state: DownloadState
    file_name: str = ""
    file_bytes_done: int = 0
    file_bytes_total: int = 0
    bytes_done: int = 0
    bytes_total: int = 0
    bytes_per_second: float = 0.0
    eta_seconds: float | None = None
    message: str = ""


class GenerationBackend(Protocol):
    """What runs a GenerationRequest: the local Engine, a remote server's client
    (engine.serving.remote), or the app's engine thread seen from the API server. generate()
    validates at once (errors raise from the call) and then yields TokenEvents and one final
    Completion; `cancel` ends it early with finish_reason "cancelled"."""

    def generate(self, request: GenerationRequest,
                 cancel: threading.Event | None = None) -> Iterator[TokenEvent | Completion]: ...


@dataclass(frozen=True)
class RemoteModel:
    """A model on an OpenAI-compatible server (vLLM, llama.cpp's server, another SpecChat).

    url: the API's base URL, usually ending in /v1 ("http://gpu-box:8000/v1"); api_key: sent as
    a bearer token ("" = none; never printed in a repr); model: the model's id on that server;
    name: what the user called the server in Settings (shown in the app)."""

    url: str
    model: str
    api_key: str = field(default="", repr=False)
    name: str = ""
