"""The Engine: a loaded target (and optional draft), its tokenizer, and the decode loop.

`Engine.generate(request, cancel)` is a Python generator: it yields a TokenEvent for every step
that adds text and ends with one Completion (text, token ids, finish reason, stats). It checks
`cancel` (a threading.Event) once per step, so a GUI thread can stop it between passes.

One step, as in the SpecExec paper (Svirschevski et al., 2024, Alg. 1):
1. grow a tree: the draft's best-first expansion (drafting.grow_tree; a static Sequoia shape
   with spec.tree_mode "sequoia") seeded with context candidates, or the candidates alone
   (draft-free: priced, built and labelled in plain Python, context_tree.py), cut to the size
   that pays on this machine (costs.best_size);
2. verify it: one target pass over every tree token (verification.run_tree);
3. accept: the walk from the root keeps 1..depth+1 tokens, exactly the target's choices
   (verification.accept), and both caches are pruned to that path (prune_to_accepted states
   the invariant between steps).
Autoregressive decoding is the same loop with one target pass per token. After each step the
engine learns from it in one place (`_learn`): pass costs, the acceptance model, the
conversation's draft switch. The loop itself never decides from them: the costs cut trees and
the switch turns the draft off, both between steps.

Around the loop: prefix_cache (a conversation's K/V across turns), prefill (what is not
cached), memory (the fit check, the out-of-memory fallback), stats. A draft head from the checkpoint
(engine.model.head_draft: MTP / NextN) drafts from the target's hidden states: every target pass
hands over those of the tokens it commits (`hidden_sink`); a step whose root follows text the
target has not read yet (a new turn's tail) goes without it. The engine does not load
models (engine.loading) or choose budgets (engine.planning): it takes both as given.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from dataclasses import replace

import torch

from engine.decoding.acceptance import AcceptanceModel, AcceptanceModels
from engine.decoding.context import MAX_MATCH, ContextIndex, Continuation, trie
from engine.decoding.context_tree import context_tree, seed_gains, seed_siblings, teach_context
from engine.decoding.costs import DraftSwitch, DraftSwitches, PassCosts, SwitchSettings
from engine.decoding.draft_rates import DraftRates
from engine.decoding.learned import LearnedFile
from engine.decoding.logprobs import LogprobRecorder, TokenBytes
from engine.decoding.drafting import (
    copy_of_target,
    grow,
    grow_tree,
    share_context,
    teach,
    top_nodes,
)
from engine.decoding.grammar import Grammar, GrammarCompiler
from engine.decoding.memory import check_fits, shrink_after_oom
from engine.decoding.prefill import prefill
from engine.decoding.prefix_cache import PrefixPool
from engine.decoding.run_state import Choose, Decoding, DraftUse, Step
from engine.decoding.sampling import choose_token, make_generator, restrict
from engine.decoding.sequoia import StaticTree
from engine.decoding.stats import StepTimers, generation_stats
from engine.decoding.text import Detokenizer, encode_prompt, eos_ids
from engine.decoding.verification import Sink, accept, committed_states, prune_to_accepted, read_committed, run_tree
from engine.errors import ContextTooLong, InvalidRequest, OutOfMemory
from engine.kernels.expert_cache import RoutingCounts
from engine.kernels.expert_unions import UnionTotals, union_totals
from engine.model.cache import KVCache
from engine.model.cache_files import CacheFiles
from engine.model.causal_lm import CausalLM
from engine.model.head_draft import HeadCache, HeadDraft, hidden_sink
from engine.shapes import Placement
from engine.types import (
    CacheSettings,
    Completion,
    GenerationRequest,
    GenerationStats,
    PassTotals,
    TokenEvent,
    Tokenizer,
)

log = logging.getLogger(__name__)

class Engine:
    """Owns the models and the KV caches of recent conversations (not thread-safe: one
    generate() at a time, which the app's single worker thread guarantees). Each request reuses
    the longest cached token prefix of its prompt (prefix_cache.PrefixPool) and reads the rest:
    prefilled in chunks, the last part read by the first decoding pass itself."""

    def __init__(self, target: CausalLM, tokenizer: Tokenizer, draft: CausalLM | None = None,
                 cache: CacheSettings | None = None, files: CacheFiles | None = None,
                 switch: SwitchSettings = SwitchSettings(), learned: LearnedFile | None = None,
                 rates: DraftRates | None = None) -> None:
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
        # what the engine learns as it decodes: acceptance per temperature regime, pass costs,
        # per conversation whether the draft pays
        self.acceptance = AcceptanceModels()
        self.costs = PassCosts()
        self.learned = learned  # where they are kept between processes (learned.py); None: not kept
        if learned is not None:
            learned.restore(self.costs, self.acceptance)
        # an MoE target's routing measured by earlier processes (the experts its passes woke)
        self.routing_seed: UnionTotals = learned.routing if learned is not None else {}
        # with experts cached on the GPU: the routing counts that pick them, kept and rebalanced per answer
        self.expert_counts = RoutingCounts(target.hf_model, target.fingerprint)
        self.rates = rates  # where each answer's draft trees' passes are kept for the draft choice (draft_rates.py)
        self.switches = DraftSwitches(switch)
        self.copied_draft = draft is not None and copy_of_target(target, draft)  # it may read the target's K/V
        self.head = isinstance(draft, HeadDraft)  # it drafts from the target's hidden states (head_draft.py)
        if self.copied_draft:
            log.info("the draft is a compressed copy of the target: it reads the target's K/V of the text")
        self.cache_settings = cache or CacheSettings()
        self.prefixes = PrefixPool(self.cache_settings, files, target.device, draft.device if draft else None)
        self.prefixes.expect(target.new_cache(1), draft.new_cache(1) if draft else None)
        # constrained requests' grammars (its token table is built on the first one)
        self.grammars = GrammarCompiler(tokenizer, target.shape.vocab_size, self.eos_ids)
        self.token_bytes = TokenBytes(tokenizer)  # for requests that ask for log-probabilities

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

    # ---- the loop ---------------------------------------------------------------------------
    def generate(self, request: GenerationRequest,
                 cancel: threading.Event | None = None) -> Iterator[TokenEvent | Completion]:
        """Validate and encode now (errors raise here, before the first step), decode lazily."""
        prompt, context = self.encode(request), self.context_length
        if len(prompt) >= context:
            raise ContextTooLong(f"The conversation is {len(prompt)} tokens long but the model reads at most "
                                 f"{context}. Start a new conversation or shorten the messages.")
        if request.speculation.budget < 1:
            raise InvalidRequest("Budget 0 (automatic) is resolved by engine.decoding.auto_budget.AutoBudget, "
                                 "which the CLI, the server and the app decode through; give the Engine a budget.")
        if len(prompt) + request.max_new_tokens > context:  # the answer stops at the context's end
            request = replace(request, max_new_tokens=context - len(prompt))
        spec, use_draft = request.speculation, self._wants_draft(request)
        tree = spec.budget if use_draft or (spec.mode == "specexec" and spec.context) else 1  # as _start sizes it
        check_fits(self.target, self.draft if use_draft else None, len(prompt), request, tree)
        grammar = self.grammars.compile(request.constraint) if request.constraint is not None else None
        return self._decode(request, prompt, cancel or threading.Event(), grammar)

    def _decode(self, request: GenerationRequest, prompt: list[int], cancel: threading.Event,
                grammar: Grammar | None = None) -> Iterator[TokenEvent | Completion]:
        t_start = time.perf_counter()
        run = self._start(request, prompt, cancel, grammar)
        consistent = True  # the caches hold a prefix of run.seq: they may be reused
        try:
            while len(run.new) < run.request.max_new_tokens:
                if cancel.is_set():
                    run.finish = "cancelled"
                    break
                if run.draft.switch is not None and run.ttft is not None:
                    self._switch_draft(run)
                consistent = False  # a step that raises may leave the caches half-written
                t_step, with_draft = time.perf_counter(), run.draft.on
                step = self._step(run)
                consistent = True
                self._learn(run, step, with_draft, time.perf_counter() - t_step)
                if run.ttft is None:
                    run.ttft = time.perf_counter() - t_start
                tokens, text, done = self._commit(run, step.tokens)
                if text:
                    yield run.event(tokens, text)
                if done:
                    break
        finally:  # also when the consumer stops iterating (GeneratorExit at a yield)
            if consistent:
                run.prefix.tokens = list(run.seq)
                self.prefixes.give_back(run.prefix)
            if self.learned is not None:
                routing = union_totals(self.target.hf_model.modules(), self.routing_seed) \
                    if self.target.shape.experts is not None else None
                self.learned.save(self.costs, self.acceptance, routing)
            if self.expert_counts.active:
                self.expert_counts.after_answer()
        if run.finish in ("length", "cancelled"):
            text, _ = run.detok.push(run.new, final=True)
            if text:
                yield run.event([], text)
        yield Completion(text=run.detok.text, token_ids=tuple(run.new), finish_reason=run.finish,
                         stats=self._finish(run, time.perf_counter() - t_start),
                         logprobs=tuple(run.logprobs.answer) if run.logprobs else ())

    def _step(self, run: Decoding) -> Step:
        """One decoding step. A device out-of-memory rolls both caches back; a tree step is
        retried with half the budget (autoregressive below budget 1), a first pass that read the
        prompt's tail too is retried after prefilling that tail in smaller chunks."""
        limit = run.request.max_new_tokens - len(run.new)
        while True:
            t_len, d_len = run.tcache.length, run.dcache.length if run.dcache is not None else 0
            try:
                if run.use_spec:
                    return self._spec_step(run, limit)
                return self._ar_step(run.seq, run.tcache, run.choose, hidden_sink(run.dcache, run.tcache))
            except torch.OutOfMemoryError:
                run.tcache.truncate(t_len)
                if run.dcache is not None:
                    run.dcache.truncate(d_len)
                run.oom_retries += 1
                if run.use_spec:
                    run.request, run.use_spec = shrink_after_oom(run.request, self.target.device)
                    run.draft.on &= run.use_spec
                elif len(run.seq) - 1 > t_len:  # the pass also read the prompt's tail: read it apart
                    run.timers.prefill_passes += prefill(self.target, run.tcache, run.seq[:-1], 1,
                                                         max(1, (len(run.seq) - 1 - t_len) // 2), sink=hidden_sink(run.dcache, run.tcache))
                else:
                    raise OutOfMemory("The device ran out of memory for a single token. Close other programs "
                                      "that use the GPU, or load the model with a shorter context.") from None

    def _ar_step(self, seq: list[int], tcache: KVCache, choose: Choose, sink: Sink | None) -> Step:
        """One target pass over the committed tokens it lacks (the root; on a new turn the
        prompt's uncached tail before it); the token after the last. `sink`: a draft head's."""
        t0, past = time.perf_counter(), tcache.length
        hidden = read_committed(self.target, tcache, seq, sink)
        token = choose(self.target.logits(hidden[-1:])[0], [])
        return Step([token], len(seq) - past, time.perf_counter() - t0)

    def _spec_step(self, run: Decoding, limit: int) -> Step:
        """Grow a tree (draft and/or context candidates), verify it in one target pass and keep
        the accepted path."""
        request, spec, seq, tcache, dcache = run.request, run.request.speculation, run.seq, run.tcache, run.dcache
        candidates = run.index.continuations(spec.max_depth, spec.context_candidates) if run.index else []
        if run.grammar is not None and not run.draft.on:
            # draft-free, text the grammar forces next (a JSON key, a call's opening) is a candidate too: 1.1 -> 1.8
            # tokens a pass on the starter's JSON answers; a draft's masked distribution finds it by itself
            forced = run.grammar.forced()[: spec.max_depth]
            if forced:
                candidates = [Continuation(tuple(forced), MAX_MATCH), *candidates]
        seeds = trie(candidates)
        # a head's root reads the target's hidden state before it (a new turn's tail is unread): the
        # step goes without the draft, and a tree of the root alone still snapshots a hybrid's states
        waits = isinstance(dcache, HeadCache) and not dcache.knows(len(seq) - 2)
        drafting = run.draft.on and not waits
        if drafting:
            assert self.draft is not None and dcache is not None
            if isinstance(dcache, HeadCache) and len(seq) - dcache.length > 64:  # much text since it last read
                run.timers.draft_passes += prefill(self.draft, dcache, seq[:-1], 1)
            if run.draft.share:
                run.draft.synced = share_context(dcache, tcache, run.draft.synced)
            pending = torch.tensor(seq[dcache.length :])  # (p,) committed tokens the draft has not read
            trace = grow(self.draft, dcache, pending, request, self.draft_vocab_limit, self.acceptance[request.sampling],
                         seeds, self.costs.stop_ratio(), run.grammar, self._static_trees)
        else:  # context candidates alone, cut to the size that pays on this machine
            if not seeds[0] and not waits:  # nothing repeats: a plain pass, without a tree's bookkeeping
                return self._ar_step(seq, tcache, run.choose, hidden_sink(run.dcache, tcache))
            unread = len(seq) - 1 - tcache.length
            model = self.acceptance[request.sampling]
            if run.grammar is None and not waits:  # in plain Python (context_tree.py): most chat steps stop at the price
                shared = seed_siblings(seeds)
                chances = model.context_chances(seeds[2], shared)
                size = self.costs.best_size(seed_gains(seeds, chances, spec.max_depth, spec.budget), unread + 1)
                if size == 0:
                    step = self._ar_step(seq, tcache, run.choose, hidden_sink(run.dcache, tcache))
                    roots = [i for i, parent in enumerate(seeds[1]) if parent == 0]  # labelled as _learn's teach would
                    model.observe_context([seeds[2][i] for i in roots], [shared[i] for i in roots],
                                          [seeds[0][i] == step.tokens[0] for i in roots])
                    return step
                trace = context_tree(seq[-1], seeds, shared, chances, spec.max_depth, size)
            else:
                trace = grow_tree(None, None, torch.tensor(seq[-1:]), spec, request.sampling, self.draft_vocab_limit,
                                  model, seeds, grammar=run.grammar)
                gains = torch.sort(trace.tree.logp[1:], descending=True, stable=True).values.exp().tolist()
                size = self.costs.best_size(gains, unread + 1)
                if size == 0 and not waits:  # a plain pass; its token still labels the root's candidates (see _learn)
                    return replace(self._ar_step(seq, tcache, run.choose, hidden_sink(run.dcache, tcache)),
                                   trace=trace, path=[0])
                trace = top_nodes(trace, size)
        t0, start, sink = time.perf_counter(), tcache.length, hidden_sink(dcache, tcache)
        unread_t = torch.tensor(seq[start:-1])  # committed tokens the target lacks, root excluded
        past = start + unread_t.shape[0]
        if sink is None:
            hidden = run_tree(self.target, tcache, trace.tree, unread_t)
        else:  # a draft head: the target's hidden states of the pending chain too
            hidden = run_tree(self.target, tcache, trace.tree, unread_t, with_pending=True)
        nodes = hidden[past - start :] if sink is not None else hidden
        result = accept(trace.tree, nodes, self.target.logits, run.choose, limit, self.eos_ids)
        t1 = time.perf_counter()
        if sink is not None:  # what the head reads of this pass (an EAGLE-3 head: the target's layer inputs)
            sink(start, committed_states(self.target.head_states(hidden), past - start, result.path))
        t2 = time.perf_counter()
        prune_to_accepted(tcache, past, dcache if drafting else None, trace.slots, result.path, not self.head)
        # the pass's price includes cutting the caches to the path: a hybrid's linear layers replay it
        # (HybridCache.keep), which a plain step never pays
        seconds = (t1 - t0) + (time.perf_counter() - t2)
        if drafting and run.draft.share:  # between steps a copied draft's cache is the target's
            assert dcache is not None
            run.draft.synced = share_context(dcache, tcache, run.draft.synced)
        return Step(result.tokens, len(trace.tree) + past - start, seconds, trace, result.path, verified=True)

    def _learn(self, run: Decoding, step: Step, with_draft: bool, seconds: float) -> None:
        """All the engine learns from a step: pass costs, the acceptance of the tree's candidates
        (a step cut to a plain pass labels the root's children: else a candidate estimated too
        low is never verified, never corrected), the draft switch (not on the first step, which
        also reads the prompt's tail)."""
        timers = run.timers
        self.costs.observe_target(step.target_tokens, step.target_seconds)
        timers.target += step.target_seconds
        timers.target_passes += 1
        if step.trace is not None:
            (teach if step.trace.shared is None else teach_context)(self.acceptance[run.request.sampling], step.trace,
                                                                   step.path, step.tokens)
            if step.verified:
                self.costs.observe_step(step.trace.seconds, step.trace.passes, step.target_seconds)
                timers.draft += step.trace.seconds
                timers.draft_passes += step.trace.passes
        if run.draft.switch is not None and run.ttft is not None:
            run.draft.switch.observe(with_draft, len(step.tokens), seconds)

    def _commit(self, run: Decoding, step: list[int]) -> tuple[list[int], str, bool]:
        """Add a step's tokens to the answer, cut after an EOS; returns the tokens kept, the
        text they add and whether the answer is done (EOS or a stop string)."""
        eos_at = next((i for i, t in enumerate(step) if t in self.eos_ids), None)
        if eos_at is not None:
            step = step[: eos_at + 1]
            run.finish = "eos"
        if run.grammar is not None:
            run.grammar.commit(step)
        if run.logprobs is not None:
            run.logprobs.commit(len(step))
        run.seq.extend(step)
        run.new.extend(step)
        if run.index is not None:
            run.index.extend(step)
        text, stopped = run.detok.push(run.new, final=eos_at is not None)
        if stopped:
            run.finish = "stop"
        return step, text, stopped or eos_at is not None

    # ---- around the loop --------------------------------------------------------------------
    def _wants_draft(self, request: GenerationRequest) -> bool:
        spec = request.speculation
        return spec.mode == "specexec" and spec.draft and self.draft is not None

    def _start(self, request: GenerationRequest, prompt: list[int], cancel: threading.Event | None = None,
               grammar: Grammar | None = None) -> Decoding:
        """Caches holding as much of the prompt as was cached, plus what does not fit the first
        decoding pass (prefilled in chunks as large as the device's memory allows). A `cancel`
        set meanwhile stops the prefill between chunks, or between runs of a CPU pass's layers
        (prefill.py; the decode loop then ends at once).
        Under a `grammar`, `choose` sees only the tokens it allows after the step's tokens so
        far (grammar.py: the constrained target's distribution)."""
        sampling, spec = request.sampling, request.speculation
        wants_draft = self._wants_draft(request)
        use_spec = wants_draft or (spec.mode == "specexec" and spec.context)
        gen = None if sampling.greedy else make_generator(sampling.seed)
        t0 = time.perf_counter()
        tree = spec.budget if use_spec else 1  # autoregressive: one token per pass, whatever the budget
        spare = request.max_new_tokens + tree + 8
        prefix, cached = self.prefixes.open(prompt, request.conversation, self._new_caches, spare)
        timers = StepTimers()
        first_pass = (spec.budget + 1) if use_spec else 1  # tokens the first step reads besides the prompt's tail
        timers.prefill_passes = prefill(self.target, prefix.target, prompt[:-1], first_pass, cancel=cancel,
                                        sink=hidden_sink(prefix.draft, prefix.target))
        draft = DraftUse(on=bool(wants_draft))
        if wants_draft:
            assert self.draft is not None and prefix.draft is not None
            draft.share = spec.share_context and self.copied_draft
            draft.switch = self.switches.for_conversation(request.conversation) if spec.switch_draft else None
            prefix.draft.reserve(len(prompt) - prefix.draft.length + spare + 3 * spec.budget)
            draft.on = draft.switch is None or draft.switch.decide(self.costs)  # off: it catches up when back on
            if draft.on and not draft.share and not self.head:  # sharing: its first step copies the target's K/V
                prefill(self.draft, prefix.draft, prompt[:-1], 1, cancel=cancel)  # its pass 0 reads the rest
        seq = list(prompt)
        window, eos = sampling.repetition_window, self.eos_ids
        state = grammar.start() if grammar is not None else None

        def choose(logits: torch.Tensor, step_tokens: list[int]) -> int:
            if state is not None:
                logits = restrict(logits, torch.from_numpy(state.mask(step_tokens)))
            history = None
            if sampling.repetition_penalty != 1.0:
                recent = (seq[-window:] + step_tokens)[-window:] if window else seq + step_tokens
                history = torch.tensor([t for t in recent if t not in eos], dtype=torch.long)
            return choose_token(logits, sampling, gen, history)

        index = ContextIndex(seq) if use_spec and spec.context else None
        # asked for: every token's entry from the row `choose` picked it from (logprobs.py)
        recorder = None if request.logprobs is None else LogprobRecorder(choose, request.logprobs, self.token_bytes)
        run = Decoding(request, prompt, use_spec, draft, index, prefix, cached, recorder.choose if recorder else choose,
                        Detokenizer(self.tokenizer, request.stop), seq, timers=timers, grammar=state,
                        logprobs=recorder)
        timers.prefill = time.perf_counter() - t0
        return run

    def _switch_draft(self, run: Decoding) -> None:
        """Whether the next step uses the draft (spec.switch_draft): off while the conversation's
        draft steps are measured slower than steps without it. The draft's cache simply falls
        behind meanwhile; its first pass back reads the tokens it missed."""
        draft = run.draft
        assert draft.switch is not None
        was_on = draft.switch.on
        on = run.use_spec and draft.switch.decide(self.costs)
        if was_on and not on:
            without = draft.switch.rate(False)
            log.info("the draft's trees decode %.2f tokens/s and decoding without them %s: the draft is off for "
                     "this conversation, measured again in %d tokens or more", draft.switch.rate(True) or 0.0,
                     f"{without:.2f}" if without else f"{1.0 / self.costs.target(1):.2f} (predicted)",
                     draft.switch.settings.retry_tokens)
        if on and not draft.on and not draft.share and not self.head:  # back on: it reads what it missed
            assert self.draft is not None and run.dcache is not None
            t0 = time.perf_counter()
            prefill(self.draft, run.dcache, run.seq[:-1], 1)
            run.timers.draft += time.perf_counter() - t0
        draft.switched |= on != draft.on
        draft.on = on

    def _new_caches(self) -> tuple[KVCache, KVCache | None]:
        return self.target.new_cache(), self.draft.new_cache() if self.draft is not None else None

    def _finish(self, run: Decoding, seconds: float) -> GenerationStats:
        """The stats of a generation; its passes join the engine's record (one tree kind's
        passes only: a generation whose draft switched mixes two)."""
        timers, spec = run.timers, run.request.speculation  # after any out-of-memory shrink
        if run.use_spec and timers.target_passes and not run.draft.switched:
            key = (spec.tree_mode if run.draft.on else "context", spec.budget)
            totals = PassTotals(timers.target_passes, len(run.new), timers.draft_passes, timers.draft, timers.target)
            self.pass_record[key] = self.pass_record.get(key, PassTotals()) + totals
            if self.rates is not None and key[0] == "specexec":
                self.rates.add(spec.budget, totals)
        return generation_stats(
            prompt_tokens=len(run.prompt), new_tokens=len(run.new), timers=timers, seconds=seconds, ttft=run.ttft,
            budget=spec.budget if run.use_spec else 0,
            mode="specexec" if run.draft.on else "context" if run.use_spec else "autoregressive",
            placement=self.target.placement, oom_retries=run.oom_retries, cached_tokens=run.cached_tokens)
