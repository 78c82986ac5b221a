"""Mistral's tool calls under a grammar (engine.serving.constraints): `[TOOL_CALLS]` is a special
token, named in the grammar as `<%[TOOL_CALLS]%>` and resolved to its id for the model's tokenizer
(engine.decoding.grammar). Both ways Mistral's templates write calls: a JSON list after one
[TOOL_CALLS], and `[TOOL_CALLS]NAME[ARGS]{...}` per call. A real tiny model (its vocabulary
padded with rows for the two special tokens) decodes under each grammar, and the parser reads
calls whose arguments validate."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jsonschema
import pytest
from templates import MISTRAL
from test_constrained import SCHEMAS, TOOLS, constraint_for
from transformers import AutoTokenizer

from engine.decoding.generation import Engine
from engine.loading.load import LoadedModel, load_model
from engine.serving.formats import OutputSettings, chat_format
from engine.testing.synthetic import tiny_model
from engine.types import GenerationRequest, SamplingSettings

BY_NAME = MISTRAL + "{%- if message.tool_calls %}[TOOL_CALLS]{{ name }}[ARGS]{{ args }}{%- endif %}"


@pytest.fixture(scope="module")
def mistral(model_cache: Path, tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    """The tiny Llama with 2 spare embedding rows, its tokenizer given [TOOL_CALLS] and [ARGS]."""
    folder = tmp_path_factory.mktemp("mistral") / "model"
    shutil.copytree(tiny_model("llama", seed=0, vocab_pad=2, cache_dir=model_cache), folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.add_special_tokens({"additional_special_tokens": ["[TOOL_CALLS]", "[ARGS]"]})
    tokenizer.save_pretrained(folder)
    return load_model(folder)


@pytest.mark.parametrize("template", [MISTRAL, BY_NAME], ids=["json-list", "by-name"])
def test_forced_calls_decode_in_mistrals_format(mistral: LoadedModel, template: str) -> None:
    fmt = chat_format(template)
    assert fmt.tools == "mistral" and fmt.calls_by_name == (template == BY_NAME)
    mistral.tokenizer.chat_template = template  # the answer's text keeps the markers its template writes
    engine = Engine(mistral.model, mistral.tokenizer)
    named = {"type": "function", "function": {"name": "get_time"}}
    for body in ({"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False},
                 {"tools": TOOLS, "tool_choice": named}):
        constraint = constraint_for(template, body)
        assert "<%[TOOL_CALLS]%>" in constraint.source
        for seed in range(2):
            final = list(engine.generate(GenerationRequest(
                raw_prompt="Call a tool:", max_new_tokens=200, constraint=constraint,
                sampling=SamplingSettings(temperature=1.0, seed=seed))))[-1]
            assert final.finish_reason == "eos", final  # type: ignore[union-attr]
            text = final.text  # type: ignore[union-attr]
            assert text.startswith("[TOOL_CALLS]") and (("[ARGS]" in text) == fmt.calls_by_name), text
            [call] = OutputSettings(fmt, True).parse(text).calls
            jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
            if "function" in body["tool_choice"]:
                assert call.name == "get_time"


def test_a_tokenizer_without_the_marker_is_told_so(tiny_target_path: Path) -> None:
    plain = load_model(tiny_target_path)
    engine = Engine(plain.model, plain.tokenizer)
    constraint = constraint_for(MISTRAL, {"tools": TOOLS, "tool_choice": "required"})
    with pytest.raises(Exception) as err:
        list(engine.generate(GenerationRequest(raw_prompt="Call a tool:", max_new_tokens=20, constraint=constraint)))
    assert "[TOOL_CALLS]" in str(getattr(err.value, "user_message", err.value))
