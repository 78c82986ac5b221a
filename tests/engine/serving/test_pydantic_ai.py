"""A second well-known client library drives a tool loop against the server: pydantic-ai's Agent
(its OpenAI chat model, over real HTTP on 127.0.0.1) calls a Python tool the server's model
chose, sends the tool's result back in the next request, and gets a final answer.

The model is the tiny random Llama with Qwen 2.5's tool template, which would never call a tool
of its own accord: the agent forces the call on its first step with pydantic-ai's own per-step
`tool_choice` (a named function, which the server decodes under a grammar), and asks for text on
the next ("none"), the documented way to vary tool_choice between steps. Everything else is the
library's own loop: it parses the call, validates the arguments against the tool's signature,
runs the tool, sends its result as a `tool` message with the call's id, reads the answer."""

from __future__ import annotations

import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import pytest
from pydantic_ai import Agent, RunContext
from pydantic_ai.capabilities import AbstractCapability
from pydantic_ai.messages import ModelRequest, ModelResponse, TextPart, ToolCallPart, ToolReturnPart
from pydantic_ai.models.openai import OpenAIChatModel
from pydantic_ai.providers.openai import OpenAIProvider
from pydantic_ai.settings import ModelSettings
from scripted import MODEL, start_server
from templates import QWEN

from engine.decoding.generation import Engine
from engine.loading.load import load_model
from engine.serving.server import Server


@pytest.fixture(scope="module")
def server(tiny_target_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    folder = tmp_path_factory.mktemp("qwen-agent") / "tiny-qwen-tools"
    shutil.copytree(tiny_target_path, folder)
    (folder / "chat_template.jinja").write_text(QWEN)
    model = load_model(folder)
    served = start_server(Engine(model.model, model.tokenizer), chat_template=QWEN)  # type: ignore[arg-type]
    yield served
    served.stop()


@dataclass
class CallFirst(AbstractCapability[Any]):
    """Step 1: call `tool` (one call); later steps: answer in text, briefly."""

    tool: str

    def get_model_settings(self) -> Callable[[RunContext[Any]], ModelSettings]:
        def settings(ctx: RunContext[Any]) -> ModelSettings:
            if ctx.run_step <= 1:
                return ModelSettings(tool_choice=[self.tool], parallel_tool_calls=False, max_tokens=160)
            return ModelSettings(tool_choice="none", max_tokens=8)

        return settings


def test_pydantic_ai_agent_runs_a_tool_loop(server: Server) -> None:
    model = OpenAIChatModel(MODEL, provider=OpenAIProvider(base_url=server.url, api_key="unused"))
    agent = Agent(model, capabilities=[CallFirst("get_weather")], model_settings=ModelSettings(temperature=0.0))
    asked: list[str] = []

    @agent.tool_plain
    def get_weather(city: Literal["Paris", "Rome", "Oslo"]) -> str:
        """The weather in a city."""
        asked.append(city)
        return f"Sunny in {city}, 21 C."

    result = agent.run_sync("What's the weather in Paris?")
    messages = result.all_messages()
    responses = [m for m in messages if isinstance(m, ModelResponse)]
    assert len(responses) == 2, messages
    calls = [p for p in responses[0].parts if isinstance(p, ToolCallPart)]
    assert [c.tool_name for c in calls] == ["get_weather"] and len(asked) == 1
    assert calls[0].args_as_dict() == {"city": asked[0]}
    assert responses[0].finish_reason == "tool_call"
    returned = [p for m in messages if isinstance(m, ModelRequest) for p in m.parts if isinstance(p, ToolReturnPart)]
    assert [(r.tool_call_id, r.content) for r in returned] == [(calls[0].tool_call_id, f"Sunny in {asked[0]}, 21 C.")]
    assert messages.index(responses[0]) < messages.index(next(m for m in messages if isinstance(m, ModelRequest)
                                                               and m.parts and isinstance(m.parts[0], ToolReturnPart)))
    final = responses[1]
    assert [type(p) for p in final.parts] == [TextPart] and isinstance(result.output, str) and result.output
    assert result.output == final.parts[0].content  # type: ignore[union-attr]
