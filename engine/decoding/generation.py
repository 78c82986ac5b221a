"""The Engine: a loaded target (and optional draft), its tokenizer, and the decode loop.

`Engine.generate(request, cancel)` is a Python generator: it yields a TokenEvent for every step
that adds text and ends with one Completion (text, token ids, finish reason, stats). It checks
`cancel` (a threading.Event) once per step, so a GUI thread can stop it between passes.

Decoding modes share everything but the step:
- autoregressive: one target pass per token (the baseline for every comparison);
- specexec: the draft grows a tree (drafting.grow_tree, or a static Sequoia shape filled by
  drafting.grow_static_tree when spec.tree_mode is "sequoia"), the target reads it in one pass
  (verification.run_tree), the acceptance walk emits 1..depth+1 tokens, and both KV caches are
  pruned to the accepted path (verification.prune_to_accepted, whose docstring states the cache
  invariant between steps).

The engine does not load models (engine.loading) or choose budgets (engine.planning): it takes
both as given.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace

import psutil
import torch

from engine.decoding.acceptance import AcceptanceModel, AcceptanceModels
from engine.decoding.context import ContextIndex, trie
from engine.decoding.costs import DRAFT_RETRY_TOKENS, DraftSwitch, PassCosts
from engine.decoding.drafting import (
    DraftTrace,
    Seeds,
    copy_of_target,
    grow_static_tree,
    grow_tree,
    share_context,
    top_nodes,
)
from engine.decoding.prefix_cache import Prefix, PrefixPool
from engine.decoding.sampling import choose_token, make_generator
from engine.decoding.sequoia import StaticTree, build_tree
from engine.decoding.text import Detokenizer, encode_prompt, eos_ids
from engine.decoding.verification import accept, prune_to_accepted, run_tree
from engine.errors import ContextTooLong, OutOfMemory
from engine.model.cache import KVCache
from engine.model.cache_files import CacheFiles
from engine.model.causal_lm import CausalLM
from engine.peak_memory import peak_rss_bytes
from engine.planning.placement import generation_bytes, tokens_per_pass
from engine.types import (
    CacheSettings,
    Completion,
    FinishReason,
    GenerationRequest,
    GenerationStats,
    PassTotals,
    Placement,
    SpeculationSettings,
    TokenEvent,
    Tokenizer,
)
from engine.units import format_bytes

log = logging.getLogger(__name__)

PREFILL_FIRST_CHUNK = 32
PREFILL_MIN_CHUNK = 8
PREFILL_STEP_S = 0.3  # the time one CPU prefill chunk aims at: a Stop waits for at most one chunk
MAX_SWITCHES = 64  # conversations whose draft verdicts the engine remembers
PREFILL_ROOM_CPU = 192  # on a CPU, the most tokens the first decoding pass reads (its cost is its tokens)

Choose = Callable[[torch.Tensor, list[int]], int]  # ((V,) logits, tokens of this step so far) -> token


@dataclass
class _Timers:
    draft: float = 0.0
    target: float = 0.0
    prefill: float = 0.0
    target_passes: int = 0
    draft_passes: int = 0
    prefill_passes: int = 0


@dataclass
class _Decoding:
    """The state of one generation between steps."""

    request: GenerationRequest
    prompt: list[int]
    use_spec: bool  # trees (from the draft and/or context candidates), else one token per pass
    use_draft: bool  # the draft grows the trees (else context candidates alone)
    index: ContextIndex | None  # the text so far, for context candidates
    prefix: Prefix  # its caches: tcache, dcache below
    cached_tokens: int
    choose: Choose
    detok: Detokenizer
    seq: list[int]  # prompt + committed answer tokens
    new: list[int] = field(default_factory=list)
    timers: _Timers = field(default_factory=_Timers)
    finish: FinishReason = "length"
    ttft: float | None = None
    oom_retries: int = 0
    share: bool = False  # the draft reads the target's K/V of committed tokens (drafting.share_context)
    synced: int = 0  # the draft cache's entries before this are the target's
    switch: DraftSwitch | None = None  # the conversation's draft verdict, when the engine may switch
    switched: bool = False  # the draft went off or on during this generation

    @property
    def tcache(self) -> KVCache:
        return self.prefix.target

    @property
    def dcache(self) -> KVCache | None:
        return self.prefix.draft


class Engine:
    """Owns the models and the KV caches of recent conversations (not thread-safe: one
    generate() at a time, which the app's single worker thread guarantees).

    Each request reuses the longest cached token prefix of its prompt (prefix_cache.PrefixPool)
    and reads only the rest: what does not fit one pass is prefilled in chunks as large as the
    device's free memory allows; the last part is read by the first decoding pass itself."""

    def __init__(self, target: CausalLM, tokenizer: Tokenizer, draft: CausalLM | None = None,
                 cache: CacheSettings | None = None, files: CacheFiles | None = None) -> None:
        self.target = target
        self.draft = draft
        self.tokenizer = tokenizer
        vocab = len(tokenizer)
        self.draft_vocab_limit = min(vocab, target.shape.vocab_size, draft.shape.vocab_size if draft else vocab)
        self.eos_ids = eos_ids(tokenizer, getattr(target.hf_model, "generation_config", None), target.config)
        # decode passes per (tree mode, budget) over this engine's life: the planner calibrates
        # its tokens-per-pass curve and draft/target pass times from these
        self.pass_record: dict[tuple[str, int], PassTotals] = {}
        self._static_trees: dict[tuple[tuple[float, ...], int, int], StaticTree] = {}
        # what the engine learns as it decodes: acceptance per temperature regime, pass costs
        self.acceptance = AcceptanceModels()
        self.costs = PassCosts()
        self.copied_draft = draft is not None and copy_of_target(target, draft)  # it may read the target's K/V
        if self.copied_draft:
            log.info("the draft is a compressed copy of the target: it reads the target's K/V of the text")
        self._switches: dict[str | None, DraftSwitch] = {}  # per conversation (None: requests without one)
        self.cache_settings = cache or CacheSettings()
        self.prefixes = PrefixPool(self.cache_settings, files, target.device, draft.device if draft else None)
        self.prefixes.expect(target.new_cache(1), draft.new_cache(1) if draft else None)

    @property
    def placement(self) -> Placement:
        """Where the target's decoder layers live."""
        return self.target.placement

    @property
    def context_length(self) -> int:
        """Most tokens (prompt + answer) the target was trained to read."""
        return int(getattr(self.target.config, "max_position_embeddings", None) or 1 << 30)

    def encode(self, request: GenerationRequest) -> list[int]:
        return encode_prompt(self.tokenizer, request)

    def persist_caches(self) -> int:
        """Save the cached conversations long enough to be worth it (the app calls this when it
        closes); the number of files written."""
        return self.prefixes.persist()

    # ---- decoding -------------------------------------------------------------------------
    def generate(
        self, request: GenerationRequest, cancel: threading.Event | None = None
    ) -> Iterator[TokenEvent | Completion]:
        """Validate and encode now (errors raise here, before the first step), decode lazily."""
        prompt = self.encode(request)
        context = self.context_length
        if len(prompt) >= context:
            raise ContextTooLong(
                f"The conversation is {len(prompt)} tokens long but the model reads at most {context}. "
                "Start a new conversation or shorten the messages."
            )
        if len(prompt) + request.max_new_tokens > context:  # the answer stops at the context's end
            request = replace(request, max_new_tokens=context - len(prompt))
        spec = request.speculation
        use_draft = spec.mode == "specexec" and spec.draft and self.draft is not None
        tree = spec.budget if use_draft or (spec.mode == "specexec" and spec.context) else 1  # as _start sizes it
        check_fits(self.target, self.draft if use_draft else None, len(prompt), request, tree)
        return self._decode(request, prompt, cancel or threading.Event())

    def _decode(self, request: GenerationRequest, prompt: list[int],
                cancel: threading.Event) -> Iterator[TokenEvent | Completion]:
        t_start = time.perf_counter()
        run = self._start(request, prompt, cancel)
        consistent = True  # the caches hold a prefix of run.seq: they may be reused
        try:
            while len(run.new) < run.request.max_new_tokens:
                if cancel.is_set():
                    run.finish = "cancelled"
                    break
                if run.switch is not None and run.ttft is not None:
                    run.use_draft = self._switch_draft(run)
                consistent = False  # a step that raises may leave the caches half-written
                t_step, with_draft = time.perf_counter(), run.use_draft
                step = self._step(run)
                consistent = True
                if run.switch is not None and run.ttft is not None:  # the first step also reads the prompt's tail
                    run.switch.observe(with_draft, len(step), time.perf_counter() - t_step)
                if run.ttft is None:
                    run.ttft = time.perf_counter() - t_start
                step, text, done = self._commit(run, step)
                if text:
                    yield TokenEvent(token_ids=tuple(step), text=text)
                if done:
                    break
        finally:  # also when the consumer stops iterating (GeneratorExit at a yield)
            if consistent:
                run.prefix.tokens = list(run.seq)
                self.prefixes.give_back(run.prefix)
        if run.finish in ("length", "cancelled"):
            text, _ = run.detok.push(run.new, final=True)
            if text:
                yield TokenEvent(token_ids=(), text=text)
        stats = self._stats(run, time.perf_counter() - t_start)
        yield Completion(text=run.detok.text, token_ids=tuple(run.new), finish_reason=run.finish, stats=stats)

    def _start(self, request: GenerationRequest, prompt: list[int],
               cancel: threading.Event | None = None) -> _Decoding:
        """Caches holding as much of the prompt as was cached, plus what does not fit the first
        decoding pass (prefilled in chunks as large as the device's memory allows). A `cancel`
        set meanwhile stops the prefill between chunks (the decode loop then ends at once)."""
        sampling, spec = request.sampling, request.speculation
        use_draft = spec.mode == "specexec" and spec.draft and self.draft is not None
        use_spec = use_draft or (spec.mode == "specexec" and spec.context)
        gen = None if sampling.greedy else make_generator(sampling.seed)
        t0 = time.perf_counter()
        tree = spec.budget if use_spec else 1  # autoregressive: one token per pass, whatever the budget
        spare = request.max_new_tokens + tree + 8
        if self.cache_settings.enabled:
            prefix, cached = self.prefixes.take(prompt, request.conversation, self._new_caches)
        else:
            target, draft = self._new_caches()
            prefix, cached = Prefix([], target, draft, request.conversation), 0
        prefix.target.reserve(len(prompt) - prefix.target.length + spare)
        timers = _Timers()
        first_pass = (spec.budget + 1) if use_spec else 1  # tokens the first step reads besides the prompt's tail
        timers.prefill_passes = prefill(self.target, prefix.target, prompt[:-1], first_pass,
                                         cancel=cancel)
        switch = self._switch_for(request.conversation) if use_draft and spec.switch_draft else None
        share = use_draft and spec.share_context and self.copied_draft
        if use_draft:
            assert self.draft is not None and prefix.draft is not None
            prefix.draft.reserve(len(prompt) - prefix.draft.length + spare + 3 * spec.budget)
            use_draft = switch is None or switch.decide(self.costs)  # off: the draft catches up when back on
        if use_draft and not share:  # sharing: its first step copies the target's K/V instead
            assert self.draft is not None and prefix.draft is not None
            prefill(self.draft, prefix.draft, prompt[:-1], 1, cancel=cancel)  # the draft's pass 0 reads the rest and the root
        seq = list(prompt)
        window, eos = sampling.repetition_window, self.eos_ids

        def choose(logits: torch.Tensor, step_tokens: list[int]) -> int:
            history = None
            if sampling.repetition_penalty != 1.0:
                recent = (seq[-window:] + step_tokens)[-window:] if window else seq + step_tokens
                history = torch.tensor([t for t in recent if t not in eos], dtype=torch.long)
            return choose_token(logits, sampling, gen, history)

        index = ContextIndex(seq) if use_spec and spec.context else None
        run = _Decoding(request, prompt, use_spec, use_draft, index, prefix, cached, choose,
                        Detokenizer(self.tokenizer, request.stop), seq, timers=timers,
                        share=share, switch=switch)
        timers.prefill = time.perf_counter() - t0
        return run

    def _switch_for(self, conversation: str | None) -> DraftSwitch:
        switch = self._switches.pop(conversation, None) or DraftSwitch()
        self._switches[conversation] = switch  # the most recent last
        while len(self._switches) > MAX_SWITCHES:
            del self._switches[next(iter(self._switches))]
        return switch

    def _switch_draft(self, run: _Decoding) -> bool:
        """Whether the next step uses the draft (spec.switch_draft): off while the conversation's
        draft steps are measured slower than steps without it. The draft's cache simply falls
        behind meanwhile; its first pass back reads the tokens it missed."""
        assert run.switch is not None
        was_on = run.switch.on
        on = run.use_spec and run.switch.decide(self.costs)
        if was_on and not on:
            without = run.switch.rate(False)
            log.info("the draft's trees decode %.2f tokens/s and decoding without them %s: the draft is off for "
                     "this conversation, measured again in %d tokens or more", run.switch.rate(True) or 0.0,
                     f"{without:.2f}" if without else f"{1.0 / self.costs.target(1):.2f} (predicted)",
                     DRAFT_RETRY_TOKENS)
        if on and not run.use_draft and not run.share:  # back on: the draft reads what it missed, in chunks
            assert self.draft is not None and run.dcache is not None
            t0 = time.perf_counter()
            prefill(self.draft, run.dcache, run.seq[:-1], 1)
            run.timers.draft += time.perf_counter() - t0
        run.switched |= on != run.use_draft
        return on

    def _new_caches(self) -> tuple[KVCache, KVCache | None]:
        return self.target.new_cache(), self.draft.new_cache() if self.draft is not None else None

    def _step(self, run: _Decoding) -> list[int]:
        """One decoding step: the tokens it commits (1 for autoregressive, 1..depth+1 for a
        tree). A device out-of-memory rolls both caches back; a tree step is retried with half
        the budget (autoregressive below budget 1), a first pass that read the prompt's tail
        too is retried after prefilling that tail in smaller chunks."""
        limit = run.request.max_new_tokens - len(run.new)
        while True:
            t_len, d_len = run.tcache.length, run.dcache.length if run.dcache is not None else 0
            try:
                if run.use_spec:
                    return self._spec_step(run, limit)
                return self._ar_step(run.seq, run.tcache, run.choose, run.timers)
            except torch.OutOfMemoryError:
                run.tcache.truncate(t_len)
                if run.dcache is not None:
                    run.dcache.truncate(d_len)
                run.oom_retries += 1
                if run.use_spec:
                    run.request, run.use_spec = _shrink_after_oom(run.request, self.target.device)
                    run.use_draft &= run.use_spec
                elif len(run.seq) - 1 > t_len:  # the pass also read the prompt's tail: read it apart
                    run.timers.prefill_passes += prefill(self.target, run.tcache, run.seq[:-1], 1,
                                                         max(1, (len(run.seq) - 1 - t_len) // 2))
                else:
                    raise OutOfMemory("The device ran out of memory for a single token. Close other programs "
                                      "that use the GPU, or load the model with a shorter context.") from None

    def _commit(self, run: _Decoding, step: list[int]) -> tuple[list[int], str, bool]:
        """Add a step's tokens to the answer, cut after an EOS; returns the tokens kept, the
        text they add and whether the answer is done (EOS or a stop string)."""
        eos_at = next((i for i, t in enumerate(step) if t in self.eos_ids), None)
        if eos_at is not None:
            step = step[: eos_at + 1]
            run.finish = "eos"
        run.seq.extend(step)
        run.new.extend(step)
        if run.index is not None:
            run.index.extend(step)
        text, stopped = run.detok.push(run.new, final=eos_at is not None)
        if stopped:
            run.finish = "stop"
        return step, text, stopped or eos_at is not None

    def _stats(self, run: _Decoding, seconds: float) -> GenerationStats:
        timers = run.timers
        spec = run.request.speculation  # after any out-of-memory shrink
        if run.use_spec and timers.target_passes and not run.switched:  # one tree kind's passes only
            key = (spec.tree_mode if run.use_draft else "context", spec.budget)
            self.pass_record[key] = self.pass_record.get(key, PassTotals()) + PassTotals(
                timers.target_passes, len(run.new), timers.draft_passes, timers.draft, timers.target)
        return GenerationStats(
            prompt_tokens=len(run.prompt),
            new_tokens=len(run.new),
            target_passes=timers.target_passes,
            tokens_per_pass=len(run.new) / max(timers.target_passes, 1),
            draft_passes=timers.draft_passes,
            budget=spec.budget if run.use_spec else 0,
            seconds=seconds,
            ttft_seconds=run.ttft if run.ttft is not None else seconds,
            tokens_per_second=len(run.new) / seconds if seconds > 0 else 0.0,
            peak_rss_bytes=peak_rss_bytes(),
            draft_seconds=timers.draft,
            target_seconds=timers.target,
            prefill_seconds=timers.prefill,
            mode="specexec" if run.use_draft else "context" if run.use_spec else "autoregressive",
            placement=self.target.placement,
            oom_retries=run.oom_retries,
            cached_tokens=run.cached_tokens,
            prefill_passes=timers.prefill_passes,
        )

    def _static_tree(self, spec: SpeculationSettings) -> StaticTree:
        key = (spec.rank_acceptance, spec.budget, spec.max_depth)
        if key not in self._static_trees:  # the DP takes up to seconds for large budgets: build once
            self._static_trees[key] = build_tree(spec.rank_acceptance, spec.budget, spec.max_depth)
        return self._static_trees[key]

    def _ar_step(self, seq: list[int], tcache: KVCache, choose: Choose, timers: _Timers) -> list[int]:
        """One target pass over the committed tokens it lacks (the root; on a new turn the
        prompt's uncached tail before it); the token after the last."""
        t0 = time.perf_counter()
        past = tcache.length
        hidden = self.target.forward(torch.tensor(seq[past:]), torch.arange(past, len(seq)), tcache, None)
        token = choose(self.target.logits(hidden[-1:])[0], [])
        seconds = time.perf_counter() - t0
        self.costs.observe_target(len(seq) - past, seconds)
        timers.target += seconds
        timers.target_passes += 1
        return [token]

    def _spec_step(self, run: _Decoding, limit: int) -> list[int]:
        """Grow a tree (draft and/or context candidates), verify it in one target pass, keep the
        accepted path, and teach the acceptance model what the target chose."""
        request, spec, seq, tcache, dcache = run.request, run.request.speculation, run.seq, run.tcache, run.dcache
        model = self.acceptance[request.sampling]
        seeds = trie(run.index.continuations(spec.max_depth, spec.context_candidates)) if run.index else ([], [], [])
        if run.use_draft:
            assert self.draft is not None and dcache is not None
            if run.share:
                run.synced = share_context(dcache, tcache, run.synced)
            pending = torch.tensor(seq[dcache.length :])  # (p,) committed tokens the draft has not read
            trace = self._grow(dcache, pending, request, model, seeds)
        else:  # context candidates alone, cut to the size that pays on this machine
            if not seeds[0]:  # nothing repeats: a plain pass, without a tree's bookkeeping
                return self._ar_step(seq, tcache, run.choose, run.timers)
            trace = grow_tree(None, None, torch.tensor(seq[-1:]), spec, request.sampling, self.draft_vocab_limit,
                              model, seeds)
            unread = len(seq) - 1 - tcache.length
            gains = torch.sort(trace.tree.logp[1:], descending=True, stable=True).values.exp().tolist()
            size = self.costs.best_size(gains, unread + 1)
            if size == 0:
                step = self._ar_step(seq, tcache, run.choose, run.timers)
                # the plain pass still tells which first candidates the target would have taken:
                # without it the candidates a low estimate cuts would never correct that estimate
                _teach(model, trace, [0], step)
                return step
            trace = top_nodes(trace, size)
        run.timers.draft += trace.seconds
        run.timers.draft_passes += trace.passes
        t0 = time.perf_counter()
        unread_t = torch.tensor(seq[tcache.length : -1])  # committed tokens the target lacks, root excluded
        past = tcache.length + unread_t.shape[0]
        hidden = run_tree(self.target, tcache, trace.tree, unread_t)
        result = accept(trace.tree, hidden, self.target.logits, run.choose, limit, self.eos_ids)
        seconds = time.perf_counter() - t0
        self.costs.observe_target(len(trace.tree) + unread_t.shape[0], seconds)
        self.costs.observe_step(trace.seconds, trace.passes, seconds)
        run.timers.target += seconds
        run.timers.target_passes += 1
        _teach(model, trace, result.path, result.tokens)
        prune_to_accepted(tcache, past, dcache if run.use_draft else None, trace.slots, result.path)
        if run.use_draft and run.share:  # between steps a copied draft's cache is the target's
            assert dcache is not None
            run.synced = share_context(dcache, tcache, run.synced)
        return result.tokens

    def _grow(self, dcache: KVCache, pending: torch.Tensor, request: GenerationRequest, model: AcceptanceModel,
              seeds: Seeds) -> DraftTrace:
        assert self.draft is not None
        spec = request.speculation
        if spec.tree_mode == "sequoia":
            return grow_static_tree(self.draft, dcache, pending, self._static_tree(spec), spec, request.sampling,
                                    self.draft_vocab_limit)
        return grow_tree(self.draft, dcache, pending, spec, request.sampling, self.draft_vocab_limit, model, seeds,
                         self.costs.stop_ratio())


def _teach(model: AcceptanceModel, trace: DraftTrace, path: list[int], chosen: list[int]) -> None:
    """Label every child of a node on the accepted path: accepted when it carries the token the
    target chose there."""
    tree = trace.tree
    known = min(len(path), len(chosen))
    choice = torch.full((len(tree),), -1, dtype=torch.long, device=tree.tokens.device)
    choice[torch.tensor(path[:known], device=choice.device)] = torch.tensor(chosen[:known], device=choice.device)
    kids = (tree.parents >= 0).nonzero()[:, 0]
    kids = kids[choice[tree.parents[kids]] >= 0]
    if kids.numel():
        model.observe(trace.logq[kids], trace.match[kids], trace.logq_t[kids], tree.tokens[kids] == choice[tree.parents[kids]])


def prefill(model: CausalLM, cache: KVCache, ids: list[int], leave_room: int | None = None,
            chunk: int | None = None, cancel: threading.Event | None = None) -> int:
    """Read `ids[cache.length:]` into the cache; with `leave_room`, all but the last part, which
    one pass of the model can read together with `leave_room` more tokens (the first decoding
    step reads it: on a new turn that is the only weight pass before the first token). Chunks
    are as large as the device's free memory allows (engine.planning.placement.tokens_per_pass),
    so an offloaded target streams its weights as few times as it can; `chunk` caps them. A
    device out-of-memory halves the chunk and retries (the cache commits only after a whole
    pass). Returns the number of passes.

    A `cancel` set meanwhile stops it between chunks (the cache then holds the chunks done), so
    a Stop waits for one chunk at most. On a CPU, where a pass costs mostly its tokens' compute
    (~20 s for 512 tokens of the starter on 2 cores), chunks are therefore sized to take about
    PREFILL_STEP_S, and the first decoding pass reads at most PREFILL_ROOM_CPU; on a GPU, where an offloaded pass costs mostly reading the weights, they stay
    as large as memory allows, since a smaller one would only read the weights more often."""
    shape = model.shape
    size = tokens_per_pass(model.free_memory(), cache.length + len(ids), shape.hidden_size,
                           shape.layer.intermediate_size, shape.layer.num_attention_heads, model.dtype.itemsize)
    if chunk is not None:
        size = min(size, chunk)
    most, room, adapt = size, size, model.device.type == "cpu"
    if adapt:
        size, room = min(size, PREFILL_FIRST_CHUNK), min(size, PREFILL_ROOM_CPU)
    last: tuple[int, float] | None = None  # (size, seconds) of the previous chunk
    passes = 0
    while len(ids) - cache.length > (0 if leave_room is None else max(room - leave_room, 0)):
        if cancel is not None and cancel.is_set():
            break
        start = cache.length
        piece = torch.tensor(ids[start : start + size])
        t0 = time.perf_counter()
        try:
            model.forward(piece, torch.arange(start, start + piece.shape[0]), cache, None)
        except torch.OutOfMemoryError as exc:
            if size == 1:
                raise OutOfMemory("The device ran out of memory reading the prompt. Start a new "
                                  "conversation, or load the model with a shorter context.") from exc
            if model.device.type == "cuda":
                torch.cuda.empty_cache()
            size //= 2
            most = room = size
            log.warning("out of device memory in the prefill: chunks of %d tokens now", size)
            continue
        passes += 1
        if adapt:
            seconds = time.perf_counter() - t0
            size, last = _next_prefill_chunk(piece.shape[0], seconds, last, most), (int(piece.shape[0]), seconds)
    return passes


def _next_prefill_chunk(size: int, seconds: float, last: tuple[int, float] | None, most: int) -> int:
    """The next CPU prefill chunk after one of `size` tokens took `seconds` (see prefill)."""
    if last is not None and last[0] < size and seconds < 1.5 * last[1]:
        return most  # twice the tokens cost not much more: reading the weights dominates
    if seconds <= 0:
        return min(most, size * 2)
    fit = int(size * PREFILL_STEP_S / seconds)
    return max(PREFILL_MIN_CHUNK, min(most, fit, size * 2))


def check_fits(target: CausalLM, draft: CausalLM | None, prompt: int, request: GenerationRequest,
               tree: int) -> None:
    """OutOfMemory, naming the largest tree budget and answer length that would fit, when the
    caches and one pass of a `tree`-token tree cannot fit in the memory free where they live (a
    budget of 10^9 would otherwise die in the allocator, asking for 100+ GB)."""
    budget = tree
    esize = target.dtype.itemsize

    def need(max_new: int, tree: int) -> int:
        return generation_bytes(target.shape, draft.shape if draft is not None else None, esize, prompt, max_new,
                                tree)

    free = free_memory(target.device)
    if need(request.max_new_tokens, budget) <= free:
        return
    where = "GPU memory" if target.device.type == "cuda" else "RAM"
    advice = []
    if budget > 1:
        most = _largest(lambda b: need(request.max_new_tokens, b) <= free, budget)
        advice += [f"a tree budget of at most {most}"] if most else []
    most = _largest(lambda m: need(m, budget) <= free, request.max_new_tokens)
    advice += [f"at most {most} new tokens per answer"] if most else []
    raise OutOfMemory(
        f"This request needs about {format_bytes(need(request.max_new_tokens, budget))} of {where} for its KV "
        f"caches and one pass over the tree, but {format_bytes(free)} is free. "
        + (f"Use {' or '.join(advice)}." if advice else "Start a new conversation, or free some memory.")
    )


def free_memory(device: torch.device) -> int:
    """Bytes a new allocation can get on `device`: free GPU memory plus what PyTorch's caching
    allocator holds unused; on the CPU the available RAM."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))
    return int(psutil.virtual_memory().available)


def _largest(fits: Callable[[int], bool], above: int) -> int:
    """The largest n in [0, above) with fits(n), for a monotone `fits` (0 when none)."""
    low, high = 0, above  # fits(low) is assumed (0 means "none"), fits(high) is false
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if fits(mid) else (low, mid)
    return low


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
