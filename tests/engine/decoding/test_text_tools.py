"""Tools, tool calls, tool results and reasoning through a chat template (engine.decoding.text),
with the tiny model's real tokenizer: the template reads them in the shape transformers documents
(a call's arguments parsed, the tool's schema as an object), a template without tools refuses
them, and an answer's text keeps the special tokens that mark calls in the model's format."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from engine.decoding.text import Detokenizer, format_markers, render_chat, template_message
from engine.errors import InvalidRequest
from engine.types import GenerationRequest, Message, ToolCall, ToolSpec

# every field a tool-calling template reads, written where a test can find it
TEMPLATE = (
    "{% if reasoning_effort is defined %}effort={{ reasoning_effort }};{% endif %}"
    "{% for tool in tools or [] %}tool={{ tool.function.name }}:{{ tool.function.parameters.properties | tojson }};"
    "{% endfor %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{% if m.reasoning_content is defined %}[reasoning={{ m.reasoning_content }}]{% endif %}"
    "{% for c in m.tool_calls or [] %}[call {{ c.id }} {{ c.function.name }} {{ c.function.arguments.city }}]"
    "{% endfor %}"
    "{% if m.tool_call_id is defined %}[result of {{ m.tool_call_id }} from {{ m.name }}]{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
WEATHER = ToolSpec("get_weather", "The weather.", json.dumps({"type": "object", "properties": {"city": {"type": "string"}}}))
CALL = ToolCall("call_1", "get_weather", '{"city": "Paris"}')
CHAT = (Message("user", "Weather?"), Message("assistant", "", (CALL,), reasoning="Use the tool."),
        Message("tool", "sunny", tool_call_id="call_1", name="get_weather"))


@pytest.fixture
def tokenizer(tiny_target_path: Path):  # type: ignore[no-untyped-def]
    tok = AutoTokenizer.from_pretrained(tiny_target_path)
    tok.chat_template = TEMPLATE
    return tok


def test_tools_calls_results_and_effort_reach_the_template(tokenizer) -> None:  # type: ignore[no-untyped-def]
    text = render_chat(tokenizer, GenerationRequest(messages=CHAT, tools=(WEATHER,), reasoning_effort="high"))
    assert text.startswith('effort=high;tool=get_weather:{"city": {"type": "string"}};')
    assert "[reasoning=Use the tool.][call call_1 get_weather Paris]" in text  # the arguments parsed for the template
    assert "[result of call_1 from get_weather]" in text and text.endswith("<|im_start|>assistant\n")
    # what the template reads is exactly what transformers' own call with the same dicts renders
    reference = tokenizer.apply_chat_template([template_message(m) for m in CHAT], tokenize=False,
                                              add_generation_prompt=True, reasoning_effort="high",
                                              tools=[{"type": "function", "function": {
                                                  "name": "get_weather", "description": "The weather.",
                                                  "parameters": json.loads(WEATHER.parameters)}}])
    assert text == reference
    assert template_message(Message("user", "x")) == {"role": "user", "content": "x"}  # nothing a template could misread


def test_a_template_without_tools_refuses_them(tokenizer) -> None:  # type: ignore[no-untyped-def]
    tokenizer.chat_template = TEMPLATE.replace("tools or []", "[]")
    with pytest.raises(InvalidRequest) as exc:
        render_chat(tokenizer, GenerationRequest(messages=CHAT[:1], tools=(WEATHER,)))
    assert "no tool support" in exc.value.user_message
    render_chat(tokenizer, GenerationRequest(messages=CHAT[:1]))  # without tools it renders as ever
    with pytest.raises(InvalidRequest):
        GenerationRequest(raw_prompt="x", tools=(WEATHER,))


def test_an_answer_keeps_the_markers_its_format_uses(tokenizer) -> None:  # type: ignore[no-untyped-def]
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|python_tag|>", "<|eom_id|>"]})
    tag, eom = tokenizer.convert_tokens_to_ids(["<|python_tag|>", "<|eom_id|>"])
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    call = '{"name": "f", "parameters": {}}'
    ids = [*tokenizer("Sure.", add_special_tokens=False)["input_ids"], tag,
           *tokenizer(call, add_special_tokens=False)["input_ids"], eom, end]
    tokenizer.chat_template = TEMPLATE + "{{ '<|python_tag|>' }}"
    assert format_markers(tokenizer) == {tag: "<|python_tag|>"}
    detok = Detokenizer(tokenizer, ())
    pieces = [detok.push(ids[:n], final=n == len(ids))[0] for n in range(1, len(ids) + 1)]
    assert "".join(pieces) == detok.text == f"Sure.<|python_tag|>{call}"  # other special tokens still left out
    tokenizer.chat_template = TEMPLATE  # a template that never writes the tag: the text is as it always was
    assert format_markers(tokenizer) == {}
    assert Detokenizer(tokenizer, ()).push(ids, final=True)[0] == f"Sure.{call}"
