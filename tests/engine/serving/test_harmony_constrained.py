"""gpt-oss's harmony format under a constraint (engine.serving.constraints._harmony): forced calls
and JSON answers are grammars over the tokenizer's own special tokens (<|channel|>, <|message|>,
<|constrain|>, <|end|>, <|start|>), checked token by token on written answers with the scripted
harmony model's real tokenizer: an analysis message may come first, then exactly one call with
arguments the tool's schema allows (or the final message with the JSON answer); anything else
is refused. What the parser then reads from an allowed answer is the call."""

from __future__ import annotations

import json
import re

import pytest
from test_constrained import TOOLS, constraint_for
from transformers import AutoTokenizer

from engine.decoding.grammar import GrammarCompiler
from engine.serving.formats import OutputSettings, chat_format
from engine.testing.thinking_scripts import HARMONY, ScriptedPair

EOS = "<|return|>"
CALL = '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Oslo", "unit": "celsius"}'
THOUGHT = "<|channel|>analysis<|message|>The user wants the weather.<|end|><|start|>assistant"


@pytest.fixture(scope="module")
def compiler(thinking_models: dict[str, ScriptedPair]) -> GrammarCompiler:
    tokenizer = AutoTokenizer.from_pretrained(thinking_models["gpt-oss-harmony"].target)
    eos = tokenizer.convert_tokens_to_ids(EOS)
    return GrammarCompiler(tokenizer, len(tokenizer), {eos})


def tokens_of(compiler: GrammarCompiler, text: str) -> list[int]:
    """`text` as gpt-oss's tokenizer has it: each marker its special token, the text between
    encoded apart (the scripted tokenizer also holds a merged non-special piece of markers,
    which a whole-string encoding would pick)."""
    tokenizer = compiler.tokenizer
    out: list[int] = []
    for part in re.split(r"(<\|[a-z]+\|>)", text):
        if re.fullmatch(r"<\|[a-z]+\|>", part):
            out.append(tokenizer.convert_tokens_to_ids(part))
        elif part:
            out += tokenizer(part, add_special_tokens=False)["input_ids"]
    return out


def allowed(compiler: GrammarCompiler, body: dict, text: str) -> bool:
    grammar = compiler.compile(constraint_for(HARMONY, body))
    return grammar.start().allows(tokens_of(compiler, text + EOS))


def test_a_forced_call_is_one_call_message_after_an_optional_analysis(compiler: GrammarCompiler) -> None:
    required = {"tools": TOOLS, "tool_choice": "required"}
    named = {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_time"}}}
    time_call = CALL.replace("get_weather", "get_time").replace('"city": "Oslo", "unit": "celsius"',
                                                               '"zone": "UTC", "hour24": true')
    cases = [
        (required, CALL, True),
        (required, THOUGHT + CALL, True),
        (required, time_call, True),
        (required, CALL.replace('"celsius"', '"kelvin"'), False),  # outside the tool's enum
        (required, CALL.replace("get_weather", "get_wetter"), False),  # no such tool
        (required, "<|channel|>final<|message|>It is sunny.", False),  # no call
        (required, CALL + CALL, False),  # one call a turn
        (named, time_call, True),
        (named, CALL, False),  # another function than the named one
    ]
    for body, text, ok in cases:
        assert allowed(compiler, body, text) == ok, text
    calls = OutputSettings(chat_format(HARMONY), True).parse(THOUGHT + CALL).calls
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Oslo", "unit": "celsius"})]


def test_a_json_answer_is_the_final_message(compiler: GrammarCompiler) -> None:
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
              "additionalProperties": False}
    body = {"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}}
    assert allowed(compiler, body, '<|channel|>final<|message|>{"n": 3}')
    assert allowed(compiler, body, THOUGHT + '<|channel|>final<|message|>{"n": 3}')
    assert not allowed(compiler, body, '<|channel|>final<|message|>{"n": "three"}')
    assert not allowed(compiler, body, "<|channel|>final<|message|>Three.")
    auto = {**body, "tools": TOOLS}  # tools offered beside the format: a call or the answer
    assert allowed(compiler, auto, CALL) and allowed(compiler, auto, '<|channel|>final<|message|>{"n": 3}')
