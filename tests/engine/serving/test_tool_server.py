"""`specchat serve` with tools, end to end: the tiny model given Qwen's tool template (a copy of its
folder with that template), driven by the official `openai` client. Tools, tool calls, tool
results and reasoning_effort reach the model's prompt exactly as transformers' own
apply_chat_template renders them; hostile tools are 400s; the tiny ChatML model, whose template
has no tools, says so. (Tool calls in answers are tested on scripted answers: test_tools.py.)"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from serve_process import API_KEY, ServeProcess
from templates import QWEN
from transformers import AutoTokenizer

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
SYSTEM = {"role": "system", "content": "You help with the weather."}
USER = {"role": "user", "content": "Weather in Paris?"}


@pytest.fixture(scope="module")
def qwen_model(tiny_target_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("qwen-tools") / "tiny-qwen-tools"
    shutil.copytree(tiny_target_path, folder)
    (folder / "chat_template.jinja").write_text(QWEN)
    return folder


@pytest.fixture(scope="module")
def server(qwen_model: Path) -> Iterator[ServeProcess]:
    served = ServeProcess(["--target", qwen_model, "--device", "cpu", "--budget", 8, "--max-depth", 4,
                           "--max-new-tokens", 6, "--api-key", API_KEY])
    served.wait_for(lambda line: line.startswith("ready:"))
    yield served
    assert served.stop() == 0, "\n".join(served.lines)


@pytest.fixture(scope="module")
def client(server: ServeProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url, api_key=API_KEY, max_retries=0, timeout=120)


def prompt_tokens(model: Path, messages: list[dict], **options: object) -> int:
    """The reference: transformers' own rendering of the conversation, as templates read it."""
    tokenizer = AutoTokenizer.from_pretrained(model)
    return len(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                             **options)["input_ids"])


def test_tools_and_a_tool_round_trip_reach_the_prompt_as_the_template_renders_them(client: openai.OpenAI,
                                                                                    qwen_model: Path) -> None:
    plain = client.chat.completions.create(model=qwen_model.name, messages=[SYSTEM, USER], max_tokens=2)
    with_tools = client.chat.completions.create(model=qwen_model.name, messages=[SYSTEM, USER], max_tokens=2,
                                                tools=[WEATHER])  # type: ignore[list-item]
    assert plain.usage and with_tools.usage
    assert plain.usage.prompt_tokens == prompt_tokens(qwen_model, [SYSTEM, USER])
    assert with_tools.usage.prompt_tokens == prompt_tokens(qwen_model, [SYSTEM, USER], tools=[WEATHER])
    assert with_tools.usage.prompt_tokens > plain.usage.prompt_tokens + 50  # the schema is in the prompt

    call = {"id": "call_abc", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    history = [SYSTEM, USER, {"role": "assistant", "content": None, "tool_calls": [call]},
               {"role": "tool", "tool_call_id": "call_abc", "content": "18 C and sunny"}]
    answer = client.chat.completions.create(model=qwen_model.name, messages=history, max_tokens=2,  # type: ignore[arg-type]
                                            tools=[WEATHER], reasoning_effort="low")  # type: ignore[list-item]
    as_read = [SYSTEM, USER, {"role": "assistant", "tool_calls": [
        {**call, "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "tool_call_id": "call_abc", "name": "get_weather", "content": "18 C and sunny"}]
    assert answer.usage and answer.usage.prompt_tokens == prompt_tokens(qwen_model, as_read, tools=[WEATHER],
                                                                        reasoning_effort="low")
    assert answer.choices[0].finish_reason in ("stop", "length")  # a random tiny model makes no calls


def test_streamed_and_whole_answers_with_tools_agree(client: openai.OpenAI, qwen_model: Path) -> None:
    whole = client.chat.completions.create(model=qwen_model.name, messages=[USER], tools=[WEATHER])  # type: ignore[list-item]
    chunks = list(client.chat.completions.create(model=qwen_model.name, messages=[USER], tools=[WEATHER],  # type: ignore[list-item]
                                                 stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == (whole.choices[0].message.content or "")
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [
        whole.choices[0].finish_reason]


def test_hostile_tools_are_400_and_the_server_goes_on(client: openai.OpenAI, server: ServeProcess,
                                                      qwen_model: Path) -> None:
    start = len(server.lines)
    deep: dict = {"type": "string"}
    for _ in range(40):
        deep = {"type": "object", "properties": {"x": deep}}
    for body in ({"tools": [{"type": "function", "function": {"name": "rm -rf /"}}]},
                 {"tools": [{"type": "function", "function": {"name": "f", "parameters": deep}}]},
                 {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_time"}}},
                 {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/x"}}}},
                 {"messages": [USER, {"role": "tool", "tool_call_id": "call_nothing", "content": "x"}]}):
        with pytest.raises(openai.BadRequestError) as exc:
            client.chat.completions.create(**{"model": qwen_model.name, "messages": [USER], **body})  # type: ignore[call-overload]
        error = exc.value.response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    assert client.chat.completions.create(model=qwen_model.name, messages=[USER], max_tokens=1).choices
    assert not any("Traceback" in line for line in server.lines[start:]), server.lines


def test_a_model_whose_template_has_no_tools_says_so(tiny_server: ServeProcess) -> None:
    client = openai.OpenAI(base_url=tiny_server.url, api_key=API_KEY, max_retries=0, timeout=120)
    [card] = client.models.list().data
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model=card.id, messages=[USER], tools=[WEATHER])  # type: ignore[list-item]
    error = exc.value.response.json()["error"]
    assert error["param"] == "tools" and "no tool support" in error["message"], json.dumps(error)
