"""The agent demos of issue 30 against a real `specchat serve`, driven by the official `openai`
client, printed as tables:

1. tool_choice "required" with a tool whose parameters are a JSON Schema, over 20 varied
   prompts: each answer's call must parse and validate against the schema;
2. the round trip: the call (non-streamed, and streamed with its tool_call deltas put back
   together: the same name and arguments), the tool's result, the final answer (streamed and
   not: the same text);
3. response_format json_schema over 20 prompts: each answer must parse and validate.

    python scripts/tool_demo.py                  # the starter pair (SmolLM2-135M-Instruct + its proxy draft)
    python scripts/tool_demo.py --prompts 5 --budget 32 --threads 1

The starter's own chat template has no tools, so the server reads a folder beside it: its
files linked, with Qwen 2.5's tool template (tests/engine/serving/templates.py, the Hermes
`<tool_call>` format). Greedy decoding; the exit code is 1 when any answer fails.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import jsonschema
import openai

REPO = Path(__file__).resolve().parents[1]
FORECAST = {"type": "object", "additionalProperties": False, "required": ["city", "unit", "days"], "properties": {
    "city": {"type": "string", "minLength": 1, "maxLength": 40},
    "unit": {"enum": ["celsius", "fahrenheit"]},
    "days": {"type": "integer", "minimum": 1, "maximum": 7}}}
TOOLS = [{"type": "function", "function": {"name": "get_forecast", "parameters": FORECAST,
                                           "description": "The weather forecast for a city, for 1 to 7 days."}}]
CITY = {"type": "object", "additionalProperties": False, "required": ["name", "country", "population_millions",
                                                                       "landmarks"], "properties": {
    "name": {"type": "string", "minLength": 1, "maxLength": 40},
    "country": {"type": "string", "minLength": 1, "maxLength": 40},
    "population_millions": {"type": "number", "minimum": 0, "maximum": 1000},
    "landmarks": {"type": "array", "maxItems": 3, "items": {"type": "string", "maxLength": 40}}}}
TOOL_PROMPTS = [
    "What's the weather in Paris tomorrow?", "Will it rain in Tokyo this week? Use fahrenheit.",
    "Forecast for Berlin for the next 3 days, please.", "Should I bring an umbrella to London on Friday?",
    "How hot will it get in Cairo over 5 days?", "Is it going to snow in Oslo?",
    "Give me the 7-day forecast for New York in fahrenheit.", "Weather for Sydney this weekend?",
    "I'm flying to Madrid for two days. What should I pack?", "Temperature in Rome today in celsius.",
    "What will the weather be like in Mumbai?", "Can I go hiking near Denver tomorrow?",
    "Tell me a joke.", "What is 2 + 2?", "Forecast Toronto, 4 days, celsius.",
    "Is it windy in Chicago right now?", "Beach weather in Rio de Janeiro this week?",
    "Plan a picnic in Amsterdam on Sunday.", "How cold is Moscow going to be?", "Weather in Nairobi for 6 days.",
]
JSON_PROMPTS = [f"Describe the city of {city} as a JSON object." for city in (
    "Paris", "Tokyo", "Berlin", "London", "Cairo", "Oslo", "New York", "Sydney", "Madrid", "Rome", "Mumbai", "Denver",
    "Toronto", "Chicago", "Rio de Janeiro", "Amsterdam", "Moscow", "Nairobi", "Lima", "Seoul")]


def qwen_template() -> str:
    spec = importlib.util.spec_from_file_location("templates", REPO / "tests/engine/serving/templates.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return str(module.QWEN)


def tool_folder(into: Path) -> Path:
    """The starter's files, linked, with Qwen 2.5's tool template."""
    from engine.loading.starter import starter_folder

    source = starter_folder()
    folder = into / f"{source.name}-tools"
    folder.mkdir()
    for file in source.iterdir():
        if file.name != "chat_template.jinja":
            (folder / file.name).symlink_to(file)
    (folder / "chat_template.jinja").write_text(qwen_template())
    return folder


def start(folder: Path, args: argparse.Namespace) -> tuple[subprocess.Popen[str], str]:
    from engine.loading.starter import proxy_draft_folder

    command = [sys.executable, "-m", "engine", "serve", "--target", str(folder), "--draft", str(proxy_draft_folder()),
               "--keep-draft", "--port", "0", "--device", "cpu", "--budget", str(args.budget), "--max-depth", "6",
               "--temperature", "0"]
    env = {**os.environ, "SPECCHAT_THREADS": str(args.threads)} if args.threads else None
    proc = subprocess.Popen(command, cwd=REPO, env=env, text=True, stderr=subprocess.PIPE)
    assert proc.stderr is not None
    lines, url = [], ""
    for line in proc.stderr:
        lines.append(line.rstrip())
        if match := re.search(r"(http://\S+/v1)", line):
            url = match.group(1)
        if "ready:" in line or line.startswith("error:"):
            break
    if not url or proc.poll() is not None:
        raise SystemExit("the server did not start:\n" + "\n".join(lines))
    return proc, url


def check(arguments: str, schema: dict[str, Any]) -> str:
    """"ok" or why not."""
    try:
        jsonschema.validate(json.loads(arguments), schema)
    except json.JSONDecodeError as exc:
        return f"not JSON ({exc.msg})"
    except jsonschema.ValidationError as exc:
        return f"invalid: {exc.message[:60]}"
    return "ok"


def row(*cells: object) -> None:
    print(" | ".join(str(c) for c in cells))


def required_calls(client: openai.OpenAI, model: str, prompts: list[str]) -> int:
    print(f"\n## tool_choice 'required', {len(prompts)} prompts (tool get_forecast, JSON Schema parameters)\n")
    row("#", "prompt", "finish", "call", "arguments", "schema", "s")
    row(*["---"] * 7)
    good = 0
    for i, prompt in enumerate(prompts, 1):
        t0 = time.perf_counter()
        answer = client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}],
                                                tools=TOOLS, tool_choice="required",
                                                parallel_tool_calls=False, max_tokens=128)
        choice = answer.choices[0]
        calls = choice.message.tool_calls or []
        verdict = check(calls[0].function.arguments, FORECAST) if len(calls) == 1 else f"{len(calls)} calls"
        good += verdict == "ok"
        row(i, prompt[:45], choice.finish_reason, calls[0].function.name if calls else "-",
            calls[0].function.arguments if calls else "-", verdict, f"{time.perf_counter() - t0:.1f}")
    print(f"\n{good}/{len(prompts)} calls parse and validate against the schema")
    return good


def round_trip(client: openai.OpenAI, model: str) -> bool:
    print("\n## round trip: call -> tool result -> final answer\n")
    messages: list[dict[str, Any]] = [{"role": "user", "content": "What's the weather in Paris tomorrow?"}]
    ask: dict[str, Any] = {"model": model, "tools": TOOLS, "max_tokens": 128}
    whole = client.chat.completions.create(messages=messages, tool_choice="required",
                                           parallel_tool_calls=False, **ask)
    call = whole.choices[0].message.tool_calls[0]
    parts: dict[int, dict[str, str]] = {}
    for chunk in client.chat.completions.create(messages=messages, tool_choice="required",
                                                parallel_tool_calls=False, stream=True, **ask):
        for delta in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            part = parts.setdefault(delta.index, {"name": "", "arguments": ""})
            if delta.function is not None:
                part["name"] += delta.function.name or ""
                part["arguments"] += delta.function.arguments or ""
    same = list(parts.values()) == [{"name": call.function.name, "arguments": call.function.arguments}]
    row("call (non-streamed)", call.function.name, call.function.arguments)
    row("call (streamed deltas put together)", *(list(parts.values())[0].values() if parts else ["-", "-"]),
        "same" if same else "DIFFERENT")
    messages += [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                 {"role": "tool", "tool_call_id": call.id, "content": json.dumps(
                     {"city": "Paris", "forecast": "sunny", "high_c": 24, "low_c": 15})}]
    final = client.chat.completions.create(messages=messages, **ask)
    text = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        messages=messages, stream=True, **ask) if c.choices)
    answer = final.choices[0].message.content or ""
    row("final answer (non-streamed)", final.choices[0].finish_reason, repr(answer[:150]))
    row("final answer (streamed)", "same text" if text == answer else f"DIFFERENT: {text[:80]!r}")
    ok = same and bool(answer.strip()) and text == answer and not final.choices[0].message.tool_calls
    print(f"\nround trip {'ok' if ok else 'FAILED'}")
    return ok


def json_answers(client: openai.OpenAI, model: str, prompts: list[str]) -> int:
    print(f"\n## response_format json_schema, {len(prompts)} prompts\n")
    row("#", "prompt", "finish", "answer", "schema", "s")
    row(*["---"] * 6)
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY, "strict": True}}
    good = 0
    for i, prompt in enumerate(prompts, 1):
        t0 = time.perf_counter()
        answer = client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}],
                                                response_format=fmt, max_tokens=200)
        text = answer.choices[0].message.content or ""
        verdict = check(text, CITY)
        good += verdict == "ok"
        row(i, prompt[:40], answer.choices[0].finish_reason, text[:90], verdict, f"{time.perf_counter() - t0:.1f}")
    print(f"\n{good}/{len(prompts)} answers parse and validate against the schema")
    return good


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=20, help="prompts per table (at most 20)")
    parser.add_argument("--budget", type=int, default=16, help="tree budget of the served pair")
    parser.add_argument("--threads", type=int, default=None, help="the server's torch threads (default: its choice; "
                        "1 on a machine other work shares)")
    args = parser.parse_args()
    sys.path.insert(0, str(REPO))
    with tempfile.TemporaryDirectory() as tmp:
        proc, url = start(tool_folder(Path(tmp)), args)
        try:
            client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=600)
            model = client.models.list().data[0].id
            t0 = time.perf_counter()
            calls = required_calls(client, model, TOOL_PROMPTS[: args.prompts])
            trip = round_trip(client, model)
            answers = json_answers(client, model, JSON_PROMPTS[: args.prompts])
            print(f"\n{time.perf_counter() - t0:.0f} s in all")
        finally:
            proc.terminate()
            proc.wait(30)
    return 0 if calls == answers == args.prompts and trip else 1


if __name__ == "__main__":
    sys.exit(main())
