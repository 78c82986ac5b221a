"""`specchat chat --remote URL --model NAME`: a conversation in the terminal with a model on
another OpenAI-compatible server (vLLM, llama.cpp's server, another `specchat serve`).

The same loop as `chat` (/reset, /exit, Ctrl+D; Ctrl+C stops an answer and keeps what came),
but nothing is loaded here and torch is never imported: it starts at once. A server that goes
away mid-answer prints one `error:` line; the partial answer stays in the conversation and the
next message tries again.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from typing import TextIO

from engine.cli.typed_input import typed_lines
from engine.errors import RemoteError, RemoteModelGone, UsageError
from engine.serving.remote import RemoteEngine, list_models, normalise_url
from engine.types import (
    Completion,
    GenerationRequest,
    Message,
    RemoteModel,
    SamplingSettings,
    TokenEvent,
)

HELP = "/reset clears the conversation, /exit (or Ctrl+D) quits, Ctrl+C stops an answer."


def run_remote_chat(args: argparse.Namespace) -> int:
    if args.target or args.draft:
        raise UsageError("--remote chats with a model on another server: leave out --target and --draft.")
    url = normalise_url(args.remote)
    key = args.api_key or ""
    model = pick_model(url, key, args.model)
    engine = RemoteEngine(RemoteModel(url, model, key))
    sampling = SamplingSettings(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                                repetition_penalty=args.repetition_penalty, seed=args.seed)
    interactive = sys.stdin.isatty()
    status(f"chatting with {model} at {url}. {HELP}")
    system = (Message("system", args.system),) if args.system else ()
    messages: list[Message] = []
    seed = args.seed
    for text in typed_lines(interactive):
        if text == "/reset":
            messages.clear()
            status("conversation cleared")
            continue
        if text.startswith("/") and " " not in text:
            status(f"unknown command {text}. {HELP}")
            continue
        messages.append(Message("user", text))
        request = GenerationRequest(messages=system + tuple(messages), max_new_tokens=args.max_new_tokens,
                                    stop=tuple(args.stop), sampling=replace(sampling, seed=seed))
        if seed is not None:
            seed += 1
        answer, note = answer_once(engine, request, sys.stdout)
        if answer is None:  # nothing came: the question stays unanswered and out of the history
            messages.pop()
        else:
            messages.append(Message("assistant", answer))
        print(note, file=sys.stderr, flush=True)
    if interactive:
        print(file=sys.stderr)
    return 0


def pick_model(url: str, key: str, wanted: str | None) -> str:
    """The model to chat with: `wanted` if the server has it, or its only model."""
    models = list_models(url, key)
    if wanted is not None and wanted in models:
        return wanted
    offered = ", ".join(models) or "none"
    if wanted is not None:
        raise RemoteModelGone(f"The server at {url} does not serve '{wanted}'. It serves: {offered}.")
    if len(models) != 1:
        raise UsageError(f"The server at {url} serves {len(models)} models: choose one with --model "
                             f"({offered}).")
    return models[0]


def answer_once(engine: RemoteEngine, request: GenerationRequest, out: TextIO) -> tuple[str | None, str]:
    """Stream one answer to `out`; returns its text (None when nothing came) and the line for
    stderr (the stats, or an `error:` line)."""
    shown = ""
    try:
        for event in engine.generate(request):
            if isinstance(event, TokenEvent):
                shown += event.text
                out.write(event.text)
                out.flush()
            elif isinstance(event, Completion):
                out.write("\n")
                return event.text, stats_line(event)
    except KeyboardInterrupt:  # the generator closed its connection on the way out
        out.write("\n")
        return shown, "[stopped]"
    except RemoteError as exc:
        if shown:
            out.write("\n")
        return (shown or None), f"error: {exc.user_message}"
    raise AssertionError("the stream ended without a Completion")


def stats_line(completion: Completion) -> str:
    s = completion.stats
    parts = [f"{s.new_tokens} tokens", f"{s.tokens_per_second:.1f} tok/s", f"ttft {s.ttft_seconds:.2f} s"]
    if s.target_passes:  # another SpecChat says how its speculation went
        parts.append(f"{s.tokens_per_pass:.2f} tokens/pass")
    if s.prompt_tokens:
        parts.append(f"prompt {s.prompt_tokens} tokens")
    parts.append(completion.finish_reason)
    return "[" + " · ".join(parts) + "]"


def status(message: str) -> None:
    print(f"specchat: {message}", file=sys.stderr, flush=True)
