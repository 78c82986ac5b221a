"""`specchat chat --remote URL --model NAME`: a conversation in the terminal with a model on
another OpenAI-compatible server (vLLM, llama.cpp's server, another `specchat serve`).

The same loop as `chat` (/reset, /exit, Ctrl+D; Ctrl+C stops an answer and keeps what came),
but nothing is loaded here and torch is never imported: it starts at once. A server that goes
away mid-answer prints one `error:` line; the partial answer stays in the conversation and the
next message tries again.
"""

from __future__ import annotations

import argparse
from dataclasses import replace

from engine.cli.conversation import Turns, converse
from engine.cli.streaming import status_printer
from engine.errors import RemoteModelGone, UsageError
from engine.serving.remote import RemoteEngine, list_models, normalise_url
from engine.types import (
    Completion,
    GenerationRequest,
    Message,
    RemoteModel,
    SamplingSettings,
)

HELP = "/reset clears the conversation, /exit (or Ctrl+D) quits, Ctrl+C stops an answer."


def run_remote_chat(args: argparse.Namespace) -> int:
    if args.target or args.draft not in (None, "auto"):  # auto: the default, nothing asked for
        raise UsageError("--remote chats with a model on another server: leave out --target and --draft.")
    url = normalise_url(args.remote)
    key = args.api_key or ""
    model = pick_model(url, key, args.model)
    engine = RemoteEngine(RemoteModel(url, model, key))
    sampling = SamplingSettings(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                                repetition_penalty=args.repetition_penalty, seed=args.seed)
    system = (Message("system", args.system),) if args.system else ()
    status = status_printer()
    status(f"chatting with {model} at {url}. {HELP}")

    def request(messages: list[Message], seed: int | None, session: str) -> tuple[GenerationRequest, int]:
        return GenerationRequest(messages=system + tuple(messages), max_new_tokens=args.max_new_tokens,
                                 stop=tuple(args.stop), sampling=replace(sampling, seed=seed)), 0

    return converse(engine, Turns(request, stats_line, HELP), status, args.seed)


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


def stats_line(completion: Completion) -> str:
    s = completion.stats
    parts = [f"{s.new_tokens} tokens", f"{s.tokens_per_second:.1f} tok/s", f"ttft {s.ttft_seconds:.2f} s"]
    if s.target_passes:  # another SpecChat says how its speculation went
        parts.append(f"{s.tokens_per_pass:.2f} tokens/pass")
    if s.prompt_tokens:
        parts.append(f"prompt {s.prompt_tokens} tokens")
    parts.append(completion.finish_reason)
    return "[" + " · ".join(parts) + "]"
