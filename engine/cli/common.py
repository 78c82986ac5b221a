"""What `generate`, `chat` and the benchmarks share at run time: options -> settings (refused
before any model loads where they can be), loading a pair, `--budget auto`, running one
generation with a clean Ctrl+C, and the stats line and JSON of an answer.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import queue
import sys
import threading
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TextIO

from transformers.utils import logging as hf_logging

from engine.cli.parser import AUTO_BUDGET
from engine.decoding.generation import Engine
from engine.decoding.pair import load_engine
from engine.errors import EngineError, InvalidRequest
from engine.loading.load import resolve_device
from engine.planning.planner import plan_for_pair
from engine.planning.profile import load_profile
from engine.types import (
    Completion,
    DecodeMode,
    GenerationRequest,
    GenerationStats,
    LoadSettings,
    Message,
    SamplingSettings,
    SpeculationSettings,
    TokenEvent,
)
from engine.units import GB

log = logging.getLogger(__name__)

JSON_STATS_FIELDS = ("prompt_tokens", "new_tokens", "target_passes", "tokens_per_pass", "draft_passes",
                     "budget", "seconds", "ttft_seconds", "tokens_per_second", "peak_rss_bytes", "cached_tokens",
                     "prefill_passes")


class UsageError(EngineError):
    """A bad combination of options, found before anything is loaded."""


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
        raise InvalidRequest(f"--{what} must be a comma-separated list of numbers, got '{text}'.")
    return values


def read_prompts(path: Path | None, default: tuple[str, ...]) -> tuple[str, ...]:
    """One chat prompt per non-empty line of `path`; `default` without a file."""
    if path is None:
        return default
    try:
        prompts = tuple(line.strip() for line in path.read_text(encoding="utf-8").splitlines() if line.strip())
    except OSError as exc:
        raise InvalidRequest(f"Cannot read the prompts file '{path}': {exc.strerror}.") from exc
    if not prompts:
        raise InvalidRequest(f"The prompts file '{path}' has no prompts (one per line).")
    return prompts


# ---- settings from options ----------------------------------------------------------------------
@dataclass(frozen=True)
class Setup:
    device: str
    budget: int
    auto: bool = False  # --budget auto: the planner may change budget, depth and mode after loading
    mode: DecodeMode | None = None  # the planner's mode (None: --mode)
    max_depth: int | None = None  # the planner's depth (None: --max-depth)


def setup(args: argparse.Namespace) -> Setup:
    """Everything that can be refused without loading a model."""
    if getattr(args, "raw_prompt", None) is not None and args.system is not None:
        raise UsageError("--system applies to --prompt (the chat template), not to --raw-prompt.")
    if getattr(args, "messages", None) is not None and args.system is not None:
        raise UsageError("--system applies to --prompt; with --messages, put the system message in the list.")
    try:
        device, _ = resolve_device(args.device)
    except InvalidRequest as exc:
        raise UsageError(f"--device {args.device}: {exc.user_message}") from exc
    budget = AUTO_BUDGET if args.budget == "auto" else int(args.budget)
    result = Setup(device=device, budget=budget, auto=args.budget == "auto")
    request(args, result)  # the settings validate themselves: before the (slow) load
    load_settings(args, result)
    return result


def read_messages(text: str) -> tuple[Message, ...]:
    """--messages: a JSON list of {"role", "content"} objects, or @FILE holding one."""
    where = "--messages"
    if text.startswith("@"):
        where = text[1:]
        try:
            text = Path(where).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise UsageError(f"Cannot read the messages file '{where}': {exc}.") from exc
    try:
        raw = json.loads(text)
    except ValueError as exc:
        raise UsageError(f"{where} is not valid JSON ({exc}).") from exc
    if not isinstance(raw, list) or not raw:
        raise UsageError(f'{where} must be a non-empty JSON list of {{"role", "content"}} objects.')
    out = []
    for i, m in enumerate(raw):
        if (not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant")
                or not isinstance(m.get("content"), str)):
            raise UsageError(f'{where}: message {i + 1} must be {{"role": "system"|"user"|"assistant", '
                             '"content": TEXT}.')
        out.append(Message(m["role"], m["content"]))
    return tuple(out)


def request(args: argparse.Namespace, setup: Setup, messages: tuple[Message, ...] = (),
            raw_prompt: str | None = None, seed: int | None = None,
            conversation: str | None = None) -> GenerationRequest:
    sampling = SamplingSettings(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                                min_p=args.min_p, repetition_penalty=args.repetition_penalty, seed=seed)
    speculation = replace(SpeculationSettings(), mode=setup.mode or args.mode, budget=setup.budget,
                          max_depth=setup.max_depth or args.max_depth, tree_mode=args.tree)
    return GenerationRequest(messages=messages, raw_prompt=raw_prompt, max_new_tokens=args.max_new_tokens,
                             stop=tuple(args.stop), sampling=sampling, speculation=speculation,
                             conversation=conversation)


def load(target: str, draft: str | None, args: argparse.Namespace, setup: Setup,
         status: Callable[[str], None]) -> Engine:
    quiet_libraries(args.verbose)
    if draft is not None and args.mode != "specexec":
        log.info("--mode autoregressive: the draft %s is not loaded", draft)
        draft = None
    return load_engine(target, draft, load_settings(args, setup),
                       progress=lambda p: status(p.message) if p.stage != "ready" else None)


def load_settings(args: argparse.Namespace, setup: Setup) -> LoadSettings:
    ram_limit = None if args.ram_limit is None else int(args.ram_limit * GB)
    return LoadSettings(device=setup.device, quant=args.quant, offload=args.offload, ram_limit_bytes=ram_limit)


def plan(engine: Engine, setup: Setup, status: Callable[[str], None],
         notice: Callable[[str], None] | None = None) -> Setup:
    """--budget auto: the planner's budget and depth for this pair on the saved hardware
    profile, or autoregressive when speculation does not pay (always said, through `notice`,
    default `status`). Without a profile the fixed AUTO_BUDGET stays, with a hint."""
    if not setup.auto or engine.draft is None:
        return setup
    profile = load_profile()
    chosen = None if profile is None else plan_for_pair(
        profile, engine.target.shape, engine.draft.shape, engine.placement, engine.pass_record)
    if chosen is None:
        status(f"budget {AUTO_BUDGET} (no hardware profile for this device; `specchat bench hardware` "
               "measures one so --budget auto can plan)")
        return setup
    if chosen.mode == "autoregressive":
        (notice or status)(f"planner: autoregressive decoding, the draft is not used ({chosen.reason})")
        return replace(setup, mode="autoregressive")
    status(f"planner: budget {chosen.budget}, depth {chosen.max_depth}, "
           f"~{chosen.tokens_per_second:.1f} tok/s predicted")
    return replace(setup, budget=chosen.budget, max_depth=chosen.max_depth, mode=None)


# ---- running one generation ------------------------------------------------------------------
_DONE = object()


def stream(engine: Engine, request: GenerationRequest, on_text: Callable[[str], None]) -> tuple[Completion, bool]:
    """Run one generation in a worker thread, pass each text delta to `on_text`, return the
    Completion and whether Ctrl+C stopped it.

    The worker is what makes Ctrl+C a clean cancel: the main thread receives KeyboardInterrupt
    while it waits on the queue, sets the Event, and keeps reading until the engine's own
    Completion (finish_reason "cancelled", real stats) arrives after the current step. A second
    Ctrl+C stops waiting.
    """
    cancel = threading.Event()
    events: queue.Queue[object] = queue.Queue()

    def work() -> None:
        try:
            for event in engine.generate(request, cancel):
                events.put(event)
        except BaseException as exc:  # handed to the main thread, which re-raises it
            events.put(exc)
        finally:
            events.put(_DONE)

    worker = threading.Thread(target=work, name="specchat-generate", daemon=True)
    worker.start()
    completion: Completion | None = None
    interrupted = False
    while True:
        try:
            try:
                event = events.get(timeout=0.2)  # a timeout keeps Ctrl+C responsive on every platform
            except queue.Empty:
                continue
            if event is _DONE:
                break
            if isinstance(event, BaseException):
                raise event
            if isinstance(event, TokenEvent):
                if event.text:
                    on_text(event.text)
            elif isinstance(event, Completion):
                completion = event
        except KeyboardInterrupt:  # only the main thread gets signals, so this is the user
            if interrupted:
                raise
            interrupted = True
            cancel.set()
    worker.join()
    assert completion is not None, "generate() ended without a Completion"
    return completion, interrupted


def completion_json(completion: Completion) -> str:
    """The --json line of the CLI contract (exactly these keys)."""
    stats = asdict(completion.stats)
    return json.dumps({
        "text": completion.text,
        "token_ids": list(completion.token_ids),
        "finish_reason": completion.finish_reason,
        "stats": {k: stats[k] for k in JSON_STATS_FIELDS},
    }, ensure_ascii=False)


def stats_line(stats: GenerationStats, finish_reason: str, seed: int | None = None) -> str:
    parts = [f"{stats.new_tokens} tokens", f"{stats.tokens_per_second:.1f} tok/s",
             f"{stats.tokens_per_pass:.2f} tokens/pass"]
    if stats.mode == "specexec":
        parts.append(f"budget {stats.budget}")
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


def dim(text: str, out: TextIO) -> str:
    if out.isatty() and not os.environ.get("NO_COLOR"):
        return f"\x1b[2m{text}\x1b[0m"
    return text


def writer(out: TextIO) -> Callable[[str], None]:
    def write(text: str) -> None:
        out.write(text)
        out.flush()

    return write


def status_printer() -> Callable[[str], None]:
    def status(message: str) -> None:
        print(dim(f"specchat: {message}", sys.stderr), file=sys.stderr, flush=True)

    return status
