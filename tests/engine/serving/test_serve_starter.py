"""The API server over the real starter pair (SmolLM2-135M-Instruct and its FP4 proxy draft):
what the tiny models cannot show, a real chat template, real words and real speculation. The
served text, streamed or not, equals the engine's own answer to the same messages, a stop
string cuts it at a word, and usage carries the pair's tokens per pass.

The server runs in this process over the session's already loaded starter pair (the CLI's part,
`specchat serve` as a process, is tested with the tiny pair): loading the starter again in a
subprocess would cost more than everything this test checks."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from engine.decoding.generation import Engine
from engine.loading.load import LoadedModel
from engine.serving.protocol import RequestDefaults
from engine.serving.scheduler import GenerationQueue, ModelState
from engine.serving.server import Server, ServeSettings
from engine.types import (
    Completion,
    GenerationRequest,
    Message,
    SamplingSettings,
    SpeculationSettings,
)

pytestmark = pytest.mark.slow

QUESTION = "What is the capital of France?"
SPEC = SpeculationSettings(budget=8, max_depth=4)


@pytest.fixture(scope="module")
def starter_server(starter_pair: tuple[LoadedModel, LoadedModel]) -> Iterator[tuple[Server, Engine]]:
    target, draft = starter_pair
    engine = Engine(target.model, target.tokenizer, draft.model)
    queue = GenerationQueue()
    queue.set_model(ModelState("SmolLM2-135M-Instruct", "ready", context_length=engine.context_length), engine)
    defaults = RequestDefaults(GenerationRequest(sampling=SamplingSettings(temperature=0.0), speculation=SPEC))
    server = Server(ServeSettings(port=0), queue, lambda: defaults)
    server.start()
    yield server, engine
    server.stop()


def test_the_starter_served_equals_the_engine(starter_server: tuple[Server, Engine]) -> None:
    server, engine = starter_server
    reference = list(engine.generate(GenerationRequest(messages=(Message("user", QUESTION),), max_new_tokens=24,
                                                       speculation=SPEC)))[-1]
    assert isinstance(reference, Completion) and "Paris" in reference.text
    client = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=120)
    ask = dict(model="SmolLM2-135M-Instruct", messages=[{"role": "user", "content": QUESTION}], max_tokens=24)
    whole = client.chat.completions.create(**ask)
    assert whole.choices[0].message.content == reference.text
    assert whole.usage.prompt_tokens == reference.stats.prompt_tokens and whole.usage.completion_tokens == len(reference.token_ids)
    assert whole.usage.model_extra["specchat"]["tokens_per_pass"] > 1.5  # the proxy draft is accepted often
    streamed = client.chat.completions.create(stream=True, **ask)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == reference.text
    cut = client.chat.completions.create(stop=["Paris"], **ask).choices[0]
    assert cut.message.content == reference.text[: reference.text.index("Paris")] and cut.finish_reason == "stop"
