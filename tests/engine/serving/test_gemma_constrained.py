"""Gemma 4's forced tool calls (engine.serving.gemma_grammar): the tool's JSON Schema written as a
grammar over Gemma's own value syntax, `<|tool_call>call:NAME{key:<|"|>text<|"|>,...}<tool_call|>`.
A real tiny model (its vocabulary padded with rows for Gemma's three special tokens) decodes
under it, and the calls the parser reads back validate against the tool's schema; what the
grammar cannot enforce is a 400 naming it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jsonschema
import pytest
from templates import GEMMA4
from test_constrained import SCHEMAS, TOOLS, constraint_for
from transformers import AutoTokenizer

from engine.decoding.generation import Engine
from engine.loading.load import LoadedModel, load_model
from engine.serving.formats import OutputSettings, chat_format
from engine.serving.protocol import ApiError, RequestDefaults, parse_request
from engine.testing.synthetic import tiny_model
from engine.types import GenerationRequest, SamplingSettings

SPECIALS = ["<|tool_call>", "<tool_call|>", '<|"|>']


@pytest.fixture(scope="module")
def gemma(model_cache: Path, tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    folder = tmp_path_factory.mktemp("gemma") / "model"
    shutil.copytree(tiny_model("llama", seed=0, vocab_pad=3, cache_dir=model_cache), folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.add_special_tokens({"additional_special_tokens": SPECIALS})
    tokenizer.chat_template = GEMMA4  # the answer's text keeps the markers its template writes
    tokenizer.save_pretrained(folder)
    return load_model(folder)


def test_forced_calls_decode_in_gemmas_syntax(gemma: LoadedModel) -> None:
    fmt = chat_format(GEMMA4)
    assert fmt.tools == "gemma4"
    engine = Engine(gemma.model, gemma.tokenizer)
    named = {"type": "function", "function": {"name": "get_weather"}}
    for body in ({"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False},
                 {"tools": TOOLS, "tool_choice": named}):
        constraint = constraint_for(GEMMA4, body)
        for seed in range(3):
            final = list(engine.generate(GenerationRequest(
                raw_prompt="Call a tool:", max_new_tokens=200, constraint=constraint,
                sampling=SamplingSettings(temperature=1.0, seed=seed))))[-1]
            assert final.finish_reason == "eos", final  # type: ignore[union-attr]
            text = final.text  # type: ignore[union-attr]
            assert text.startswith("<|tool_call>call:") and text.endswith("<tool_call|>"), text
            [call] = OutputSettings(fmt, True).parse(text).calls
            jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
            if "function" in body["tool_choice"]:
                assert call.name == "get_weather"


@pytest.mark.parametrize("params, named", [
    ({"type": "object", "properties": {"code": {"type": "string", "pattern": "^[0-9]+$"}}, "required": ["code"]},
     "pattern"),
    ({"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string"}, "minItems": 1}},
      "required": ["tags"]}, "minItems"),
    ({"type": "object", "properties": {"any": {}}, "required": ["any"]}, "any type"),
])
def test_what_the_grammar_cannot_enforce_is_a_400_naming_it(params: dict, named: str) -> None:
    tools = [{"type": "function", "function": {"name": "f", "parameters": params}}]
    body = {"messages": [{"role": "user", "content": "hi"}], "tools": tools, "tool_choice": "required"}
    with pytest.raises(ApiError) as err:
        parse_request("chat", body, RequestDefaults(), 2048, GEMMA4)
    assert named in str(err.value.body) and "Gemma 4" in str(err.value.body)
