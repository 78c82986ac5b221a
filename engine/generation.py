"""The Engine: a loaded target (and optional draft), the chat template, and the decode loop.

`Engine.generate(request, cancel)` is a Python generator: it yields a TokenEvent for every step
that adds text and ends with one Completion (text, token ids, finish reason, stats). It checks
`cancel` (a threading.Event) once per step, so a GUI thread can stop it between passes.

Decoding modes share everything but the step:
- autoregressive: one target pass per token (the baseline for every comparison);
- specexec: the draft grows a tree (drafting.grow_tree, or a static Sequoia shape filled by
  drafting.grow_static_tree when spec.tree_mode is "sequoia"), the target reads it in one pass
  (verification.run_tree), the acceptance walk emits 1..depth+1 tokens, and both KV caches are
  pruned to the accepted path.

Cache invariant between steps: the target cache holds every committed token but the last (the
"root", fed with the next pass); the draft cache holds a prefix of the committed tokens and
`draft_pending` the rest. The engine does not load models (loading.py) or choose budgets
(engine/planner.py): it takes both as given.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace

import psutil
import torch

from .cache import KVCache
from .causal_lm import CausalLM
from .drafting import grow_static_tree, grow_tree
from .errors import InvalidRequest, OutOfMemory
from .sampling import choose_token, make_generator
from .sequoia import StaticTree, build_tree
from .types import (
    Completion,
    GenerationRequest,
    GenerationStats,
    SpeculationSettings,
    TokenEvent,
)
from .verification import accept, run_tree

log = logging.getLogger(__name__)

PREFILL_CHUNK = 512


@dataclass(frozen=True)
class PassTotals:
    """Decode passes of one (tree mode, budget), summed over generations."""

    passes: int = 0
    tokens: int = 0
    draft_passes: int = 0
    draft_seconds: float = 0.0
    target_seconds: float = 0.0

    @property
    def tokens_per_pass(self) -> float:
        return self.tokens / self.passes if self.passes else 0.0


@dataclass
class _Timers:
    draft: float = 0.0
    target: float = 0.0
    prefill: float = 0.0
    target_passes: int = 0
    draft_passes: int = 0
    accepted_per_pass: list[int] = field(default_factory=list)


class Engine:
    """Owns the models and their caches for one conversation turn at a time (not thread-safe:
    one generate() at a time, which the app's single worker thread guarantees)."""

    def __init__(self, target: CausalLM, tokenizer: object, draft: CausalLM | None = None) -> None:
        self.target = target
        self.draft = draft
        self.tokenizer = tokenizer
        vocab = len(tokenizer)  # type: ignore[arg-type]
        self.draft_vocab_limit = min(vocab, target.shape.vocab_size, draft.shape.vocab_size if draft else vocab)
        self.eos_ids = _eos_ids(tokenizer, target)
        # decode passes per (tree mode, budget) over this engine's life: the planner calibrates
        # its tokens-per-pass curve and draft/target pass times from these
        self.pass_record: dict[tuple[str, int], PassTotals] = {}
        self._static_trees: dict[tuple[tuple[float, ...], int, int], StaticTree] = {}

    # ---- prompts -------------------------------------------------------------------------
    def encode(self, request: GenerationRequest) -> list[int]:
        tok = self.tokenizer
        if request.raw_prompt is not None:
            if request.messages:
                raise InvalidRequest("Give either chat messages or a raw prompt, not both.")
            ids = tok(request.raw_prompt, add_special_tokens=True)["input_ids"]  # type: ignore[operator]
        else:
            if not request.messages:
                raise InvalidRequest("The prompt is empty: type a message first.")
            if not getattr(tok, "chat_template", None):
                raise InvalidRequest(
                    "This model has no chat template; use --raw-prompt to feed plain text."
                )
            msgs = [{"role": m.role, "content": m.content} for m in request.messages]
            ids = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)  # type: ignore[attr-defined]
            if not isinstance(ids, list):
                ids = ids["input_ids"]
        if not ids:
            raise InvalidRequest("The prompt is empty: type a message first.")
        return list(ids)

    # ---- decoding -------------------------------------------------------------------------
    def generate(
        self, request: GenerationRequest, cancel: threading.Event | None = None
    ) -> Iterator[TokenEvent | Completion]:
        spec = request.speculation
        if spec.budget < 1:
            raise InvalidRequest(f"The tree budget must be at least 1 (got {spec.budget}).")
        if spec.max_depth < 1:
            raise InvalidRequest(f"The tree depth must be at least 1 (got {spec.max_depth}).")
        if spec.branching < 1 or spec.min_pass_gain < 0 or spec.greedy_draft_temperature <= 0:
            raise InvalidRequest("The tree branching must be at least 1, the pass gain at least 0 and the draft temperature above 0.")
        if spec.tree_mode not in ("specexec", "sequoia") or not spec.rank_acceptance:
            raise InvalidRequest("The tree mode must be 'specexec' or 'sequoia' (with an acceptance-by-rank vector).")
        if request.max_new_tokens < 1:
            raise InvalidRequest("max new tokens must be at least 1.")
        use_spec = spec.mode == "specexec" and self.draft is not None
        prompt = self.encode(request)
        context = self.context_length
        if len(prompt) >= context:
            raise InvalidRequest(
                f"The conversation is {len(prompt)} tokens long but the model reads at most {context}. "
                "Start a new conversation or shorten the messages."
            )
        if len(prompt) + request.max_new_tokens > context:  # the answer stops at the context's end
            request = replace(request, max_new_tokens=context - len(prompt))
        return self._decode(request, prompt, use_spec, cancel or threading.Event())

    @property
    def context_length(self) -> int:
        """Most tokens (prompt + answer) the target was trained to read."""
        return int(getattr(self.target.config, "max_position_embeddings", None) or 1 << 30)

    def _decode(
        self, request: GenerationRequest, prompt: list[int], use_spec: bool, cancel: threading.Event
    ) -> Iterator[TokenEvent | Completion]:
        t_start = time.perf_counter()
        sampling, spec = request.sampling, request.speculation
        gen = None if sampling.greedy else make_generator(sampling.seed)
        timers = _Timers()
        seq = list(prompt)
        new: list[int] = []
        tcache = self.target.new_cache(len(prompt) + request.max_new_tokens + spec.budget + 8)
        t0 = time.perf_counter()
        self._prefill(self.target, tcache, prompt[:-1])
        dcache: KVCache | None = None
        if use_spec:
            assert self.draft is not None
            dcache = self.draft.new_cache(len(prompt) + request.max_new_tokens + 4 * spec.budget + 8)
            self._prefill(self.draft, dcache, prompt[:-1])
        timers.prefill = time.perf_counter() - t0
        history = torch.tensor(seq) if sampling.repetition_penalty != 1.0 else None
        detok = _Detokenizer(self.tokenizer, request.stop)
        ttft = None
        finish = "length"
        oom_retries = 0

        def choose(logits: torch.Tensor, step_tokens: list[int]) -> int:
            hist = None
            if history is not None:
                hist = torch.tensor(seq + step_tokens)
            return choose_token(logits, sampling, gen, hist)

        while len(new) < request.max_new_tokens:
            if cancel.is_set():
                finish = "cancelled"
                break
            limit = request.max_new_tokens - len(new)
            if use_spec:
                assert dcache is not None
                draft_length = dcache.length
                try:
                    step = self._spec_step(seq, tcache, dcache, request, choose, limit, timers)
                except torch.OutOfMemoryError:
                    # roll both caches back to before the step, free what the pass held, retry smaller
                    tcache.truncate(len(seq) - 1)
                    dcache.truncate(draft_length)
                    request, use_spec = _shrink_after_oom(request, self.target.device)
                    oom_retries += 1
                    continue
            else:
                step = self._ar_step(seq, tcache, choose, timers)
            seq.extend(step)
            new.extend(step)
            timers.accepted_per_pass.append(len(step))
            if ttft is None:
                ttft = time.perf_counter() - t_start
            eos_at = next((i for i, t in enumerate(step) if t in self.eos_ids), None)
            if eos_at is not None:
                cut = len(step) - eos_at - 1
                if cut:
                    del new[-cut:], seq[-cut:]
                finish = "eos"
            text, stopped = detok.push(new, final=eos_at is not None)
            if text:
                yield TokenEvent(token_ids=tuple(step), text=text)
            if stopped:
                finish = "stop"
                break
            if eos_at is not None:
                break
        if finish in ("length", "cancelled"):
            text, _ = detok.push(new, final=True)
            if text:
                yield TokenEvent(token_ids=(), text=text)
        seconds = time.perf_counter() - t_start
        passes = max(timers.target_passes, 1)
        if use_spec and timers.target_passes:
            self._record_passes(request.speculation, len(new), timers)  # the budget after any OOM shrink
        stats = GenerationStats(
            prompt_tokens=len(prompt),
            new_tokens=len(new),
            target_passes=timers.target_passes,
            tokens_per_pass=len(new) / passes,
            draft_passes=timers.draft_passes,
            budget=request.speculation.budget if use_spec else 0,  # after any OOM shrink
            seconds=seconds,
            ttft_seconds=ttft if ttft is not None else seconds,
            tokens_per_second=len(new) / seconds if seconds > 0 else 0.0,
            peak_rss_bytes=_peak_rss(),
            draft_seconds=timers.draft,
            target_seconds=timers.target,
            prefill_seconds=timers.prefill,
            mode="specexec" if use_spec else "autoregressive",
            placement=self.target.placement,
            oom_retries=oom_retries,
        )
        yield Completion(text=detok.text, token_ids=tuple(new), finish_reason=finish, stats=stats)  # type: ignore[arg-type]

    def _static_tree(self, spec: SpeculationSettings) -> StaticTree:
        key = (spec.rank_acceptance, spec.budget, spec.max_depth)
        if key not in self._static_trees:  # the DP takes up to seconds for large budgets: build once
            self._static_trees[key] = build_tree(spec.rank_acceptance, spec.budget, spec.max_depth)
        return self._static_trees[key]

    def _record_passes(self, spec: SpeculationSettings, new_tokens: int, timers: _Timers) -> None:
        """Add this generation's decode passes to `pass_record` (the planner's calibration)."""
        key = (spec.tree_mode, spec.budget)
        old = self.pass_record.get(key, PassTotals())
        self.pass_record[key] = PassTotals(old.passes + timers.target_passes, old.tokens + new_tokens,
                                           old.draft_passes + timers.draft_passes,
                                           old.draft_seconds + timers.draft, old.target_seconds + timers.target)

    def _prefill(self, model: CausalLM, cache: KVCache, ids: list[int]) -> None:
        start, size = 0, PREFILL_CHUNK
        while start < len(ids):
            chunk = torch.tensor(ids[start : start + size])
            try:
                model.forward(chunk, torch.arange(cache.length, cache.length + chunk.shape[0]), cache, None)
            except torch.OutOfMemoryError as exc:  # the cache commits only after a whole pass
                if size == 1:
                    raise OutOfMemory("The device ran out of memory reading the prompt. Start a new "
                                      "conversation, or load the model with a shorter context.") from exc
                if model.device.type == "cuda":
                    torch.cuda.empty_cache()
                size //= 2
                log.warning("out of device memory in the prefill: chunks of %d tokens now", size)
                continue
            start += chunk.shape[0]

    def _ar_step(self, seq: list[int], tcache: KVCache, choose, timers: _Timers) -> list[int]:  # type: ignore[no-untyped-def]
        t0 = time.perf_counter()
        root = torch.tensor(seq[-1:])
        hidden = self.target.forward(root, torch.tensor([len(seq) - 1]), tcache, None)
        token = choose(self.target.logits(hidden)[0], [])
        timers.target += time.perf_counter() - t0
        timers.target_passes += 1
        return [token]

    def _spec_step(self, seq, tcache, dcache, request, choose, limit, timers) -> list[int]:  # type: ignore[no-untyped-def]
        assert self.draft is not None
        pending = torch.tensor(seq[dcache.length :])  # (p,) committed tokens the draft has not read
        spec = request.speculation
        if spec.tree_mode == "sequoia":
            trace = grow_static_tree(self.draft, dcache, pending, self._static_tree(spec), spec,
                                     request.sampling, self.draft_vocab_limit)
        else:
            trace = grow_tree(self.draft, dcache, pending, spec, request.sampling, self.draft_vocab_limit)
        timers.draft += trace.seconds
        timers.draft_passes += trace.passes
        t0 = time.perf_counter()
        past = tcache.length  # == len(seq) - 1
        hidden = run_tree(self.target, tcache, trace.tree)
        result = accept(trace.tree, hidden, self.target.logits, choose, limit, self.eos_ids)
        timers.target += time.perf_counter() - t0
        timers.target_passes += 1
        path = torch.tensor(result.path)
        tcache.keep(torch.cat([torch.arange(past), past + path]))
        # the draft keeps the prefix and root (slots < root slot + 1), then the accepted nodes it read
        read = trace.slots[path[1:]]
        read = read[: int((read >= 0).sum())]  # read nodes form a prefix of the path
        root_slot = int(trace.slots[0])
        dcache.keep(torch.cat([torch.arange(root_slot + 1), read.cpu()]))
        return result.tokens


def _shrink_after_oom(request: GenerationRequest, device: torch.device) -> tuple[GenerationRequest, bool]:
    """After a device out-of-memory in a step: free cached blocks and halve the tree budget for
    the rest of the generation; below 1, decode autoregressively. Returns (request, use_spec)."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
    budget = request.speculation.budget
    if budget <= 1:
        log.warning("out of device memory at tree budget 1: continuing autoregressively")
        return request, False
    log.warning("out of device memory at tree budget %d: retrying the step with %d", budget, budget // 2)
    return replace(request, speculation=replace(request.speculation, budget=budget // 2)), True


class _Detokenizer:
    """Incremental text for streaming: holds back an incomplete UTF-8 character and any tail
    that could be the start of a stop string; cuts the text at the first stop string."""

    def __init__(self, tokenizer: object, stops: tuple[str, ...]) -> None:
        self.tokenizer = tokenizer
        self.stops = tuple(s for s in stops if s)
        self.text = ""  # what has been emitted so far

    def push(self, ids: list[int], final: bool) -> tuple[str, bool]:
        full = self.tokenizer.decode(ids, skip_special_tokens=True)  # type: ignore[attr-defined]
        stopped = False
        for s in self.stops:
            at = full.find(s)
            if at >= 0:
                full, stopped, final = full[:at], True, True
        if not final:
            if full.endswith("\ufffd"):
                full = full.rstrip("\ufffd")
            hold = 0
            for s in self.stops:
                for k in range(min(len(s) - 1, len(full)), 0, -1):
                    if full.endswith(s[:k]):
                        hold = max(hold, k)
                        break
            full = full[: len(full) - hold]
        if not full.startswith(self.text):  # tokenizer re-segmented earlier text; keep what was shown
            full = self.text + full[len(self.text):]
        delta = full[len(self.text) :]
        self.text = full
        return delta, stopped


def _eos_ids(tokenizer: object, target: CausalLM) -> frozenset[int]:
    ids: set[int] = set()
    for source in (getattr(target.hf_model, "generation_config", None), target.config):
        eos = getattr(source, "eos_token_id", None)
        if isinstance(eos, int):
            ids.add(eos)
        elif isinstance(eos, (list, tuple)):
            ids.update(int(e) for e in eos)
    tok_eos = getattr(tokenizer, "eos_token_id", None)
    if isinstance(tok_eos, int):
        ids.add(tok_eos)
    return frozenset(ids)


def _peak_rss() -> int:
    try:
        import resource

        peak = int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
        return peak if sys.platform == "darwin" else peak * 1024  # Linux reports KiB
    except ImportError:  # Windows
        return int(psutil.Process().memory_info().peak_wset)  # type: ignore[attr-defined]
