"""`specchat serve` on 127.0.0.1 with the tiny pair, driven by the official `openai` client:
the model list, chat completions streamed and not (greedy text = `specchat generate`), n with a
seed, stop strings, usage, the documented errors, a client that disconnects mid-stream, the
queue (in order, bounded), and the network guard."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import httpx2
import openai
import pytest
from serve_process import API_KEY, ServeProcess

from engine.cli.main import main

SYSTEM, USER = "Be brief.", "Tell me about the sea"


@pytest.fixture(scope="module")
def client(tiny_server: ServeProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=tiny_server.url, api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model(client: openai.OpenAI) -> str:
    [card] = client.models.list().data
    return card.id


def generate_json(capsys: pytest.CaptureFixture[str], target: Path, draft: Path, *args: object) -> dict:
    """`specchat generate --json` with the server's engine options: the reference."""
    rc = main([str(a) for a in ("generate", "--target", target, "--draft", draft, "--device", "cpu", "--budget", 8,
                                "--max-depth", 4, "--keep-draft", "--json", *args)])
    out, err = capsys.readouterr()
    assert rc == 0, err
    return json.loads(out.splitlines()[0])


def test_models_list(client: openai.OpenAI, tiny_target_path: Path) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == [tiny_target_path.name]
    assert models[0].owned_by == "specchat" and models[0].model_extra["max_model_len"] == 2048
    assert client.models.retrieve(tiny_target_path.name).id == tiny_target_path.name


def test_chat_streamed_and_not_equal_specchat_generate(client: openai.OpenAI, model: str,
                                                       capsys: pytest.CaptureFixture[str], tiny_target_path: Path,
                                                       tiny_draft_path: Path) -> None:
    reference = generate_json(capsys, tiny_target_path, tiny_draft_path, "--system", SYSTEM, "--prompt", USER,
                              "--max-new-tokens", 24)
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": USER}]
    whole = client.chat.completions.create(model=model, messages=messages, max_tokens=24, temperature=0)
    [choice] = whole.choices
    assert choice.message.role == "assistant" and choice.message.content == reference["text"]
    assert choice.finish_reason == "length" and whole.object == "chat.completion" and whole.id.startswith("chatcmpl-")
    usage = whole.usage
    assert usage.prompt_tokens == reference["stats"]["prompt_tokens"]
    assert usage.completion_tokens == len(reference["token_ids"]) == 24
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    # The engine keeps KV caches between requests: the same messages again read only their last tokens.
    again = client.chat.completions.create(model=model, messages=messages, max_tokens=24, temperature=0)
    assert again.choices[0].message.content == reference["text"]
    reused = again.usage.prompt_tokens_details.cached_tokens
    assert 0 < reused < usage.prompt_tokens and reused >= usage.prompt_tokens_details.cached_tokens
    figures = usage.model_extra["specchat"]
    assert figures["budget"] == 8 and figures["mode"] == "specexec"
    assert 0 < figures["target_passes"] < 24  # the close draft is accepted: several tokens per pass
    assert figures["tokens_per_pass"] == pytest.approx(24 / figures["target_passes"], abs=1e-3)

    chunks = list(client.chat.completions.create(model=model, messages=messages, max_completion_tokens=24,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert {c.id for c in chunks} == {chunks[0].id} and all(c.object == "chat.completion.chunk" for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == reference["text"]
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 24
    assert chunks[-1].usage.prompt_tokens == usage.prompt_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_completions_greedy_equals_specchat_generate_raw_prompt(
        client: openai.OpenAI, model: str, capsys: pytest.CaptureFixture[str], tiny_target_path: Path,
        tiny_draft_path: Path) -> None:
    reference = generate_json(capsys, tiny_target_path, tiny_draft_path, "--raw-prompt", "The quick brown",
                              "--max-new-tokens", 12)
    whole = client.completions.create(model=model, prompt="The quick brown", max_tokens=12)
    assert whole.choices[0].text == reference["text"] and whole.object == "text_completion"
    streamed = list(client.completions.create(model=model, prompt="The quick brown", max_tokens=12, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == reference["text"]


def test_n2_with_a_seed_is_reproducible_and_each_choice_is_a_seeded_sample(client: openai.OpenAI, model: str) -> None:
    ask = dict(model=model, messages=[{"role": "user", "content": "hello"}], max_tokens=12, temperature=1.0)
    first = client.chat.completions.create(n=2, seed=7, **ask)
    again = client.chat.completions.create(n=2, seed=7, **ask)
    texts = [c.message.content for c in first.choices]
    assert [c.index for c in first.choices] == [0, 1]
    assert texts == [c.message.content for c in again.choices]
    # choice i samples with seed + i: the same as asking for that one choice alone
    assert texts[1] == client.chat.completions.create(seed=8, **ask).choices[0].message.content
    assert texts[0] != texts[1]  # two samples, not one copied (a random tiny model is far from peaked)
    assert first.usage.completion_tokens == 24 and first.usage.prompt_tokens == again.usage.prompt_tokens


def test_stop_strings_cut_the_answer(client: openai.OpenAI, model: str) -> None:
    ask = dict(model=model, messages=[{"role": "user", "content": USER}], max_tokens=24)
    full = client.chat.completions.create(**ask).choices[0].message.content
    stop = full[6:9]
    assert stop and stop in full
    cut = client.chat.completions.create(stop=[stop, "never appears"], **ask).choices[0]
    assert cut.message.content == full[: full.index(stop)] and cut.finish_reason == "stop"
    streamed = list(client.chat.completions.create(stop=stop, stream=True, **ask))
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == cut.message.content
    assert streamed[-1].choices[0].finish_reason == "stop"


def _error(error: openai.APIStatusError) -> dict:
    body = error.response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["message"]
    return body["error"]


def test_errors_have_the_documented_status_and_body(tiny_server: ServeProcess, client: openai.OpenAI,
                                                    model: str) -> None:
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(openai.NotFoundError) as exc:
        client.chat.completions.create(model="gpt-4o", messages=messages)
    assert _error(exc.value)["code"] == "model_not_found" and exc.value.status_code == 404
    with pytest.raises(openai.APIStatusError) as exc:
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": "sea " * 3000}])
    assert exc.value.status_code == 413 and _error(exc.value)["code"] == "context_length_exceeded"
    assert "2048" in exc.value.response.json()["error"]["message"]
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model=model, messages=messages, temperature=-1)
    assert "temperature" in _error(exc.value)["message"]
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model=model, messages=messages, n=0)
    assert _error(exc.value)["param"] == "n"
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model=model, messages=messages, logprobs=True, top_logprobs=21)
    assert _error(exc.value)["param"] == "top_logprobs"
    bad = openai.OpenAI(base_url=tiny_server.url, api_key="wrong-key", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as exc:
        bad.models.list()
    assert exc.value.status_code == 401 and _error(exc.value)["code"] == "invalid_api_key"
    keyless = httpx2.get(f"{tiny_server.url}/models")
    assert keyless.status_code == 401 and keyless.json()["error"]["code"] == "invalid_api_key"

    raw = httpx2.post(f"{tiny_server.url}/chat/completions", content=b'{"model": "x", "messages": [',
                      headers={"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"})
    assert raw.status_code == 400 and raw.json()["error"]["code"] == "invalid_json"
    health = httpx2.get(tiny_server.url.removesuffix("/v1") + "/health")  # no key needed
    assert health.status_code == 200 and health.json()["status"] == "ok"


def test_disconnect_frees_the_engine_and_queued_clients_are_answered_in_order(
        tiny_server: ServeProcess, client: openai.OpenAI, model: str) -> None:
    """One long streamed answer runs, a second client queues behind it (the queue holds one), a
    third is refused with 429; the first client disconnects: its generation is cancelled within
    a step, the second is answered, and the engine serves the next request."""
    seen, start = len(tiny_server.request_lines()), len(tiny_server.lines)
    long = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "go on"}],
                                          max_tokens=1900, stream=True)
    chunks = iter(long)
    next(chunks), next(chunks)  # it runs
    second: dict[str, object] = {}

    def ask_second() -> None:
        answer = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}],
                                                max_tokens=5, stream=True)
        second["chunks"] = list(answer)
        second["first_at"] = time.monotonic()

    thread = threading.Thread(target=ask_second)
    thread.start()
    health = tiny_server.url.removesuffix("/v1") + "/health"
    deadline = time.monotonic() + 60
    while httpx2.get(health).json()["waiting"] != 1:  # until the server holds the second request
        assert time.monotonic() < deadline and thread.is_alive(), "the second request never queued"
        time.sleep(0.05)
    with pytest.raises(openai.RateLimitError) as exc:
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": "x"}], max_tokens=1)
    assert _error(exc.value)["code"] == "queue_full" and exc.value.response.headers["retry-after"]
    assert "chunks" not in second  # still waiting behind the long answer
    next(chunks)
    long.close()  # the client goes away mid-stream
    closed_at = time.monotonic()
    thread.join(120)
    assert second["first_at"] > closed_at  # served after the first, in arrival order
    assert "".join(c.choices[0].delta.content or "" for c in second["chunks"] if c.choices)
    cancelled = tiny_server.wait_for(lambda line: "cancelled" in line, start=start)
    new_tokens = int(cancelled.split(" + ")[1].split(" tokens")[0])
    assert new_tokens < 1900  # cancelled within a step of the disconnect, not run to the end
    after = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    assert after.usage.completion_tokens == 3
    tiny_server.wait_for(lambda line: line.startswith("request ") and "+ 3 tokens" in line, start=start)
    lines = tiny_server.request_lines()[seen:]
    assert [line.rsplit(" ", 1)[-1] for line in lines] == ["cancelled", "length", "length"]  # long, second, after


def test_a_network_address_needs_an_api_key(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["serve", "--host", "0.0.0.0", "--port", "0"])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("error: Listening on 0.0.0.0") and "--api-key" in err
    assert "--insecure-no-api-key" in err and len(err.strip().splitlines()) == 1


def test_clients_that_give_up_waiting_or_unstreamed_cancel_their_requests(
        tiny_server: ServeProcess, client: openai.OpenAI, model: str) -> None:
    start = len(tiny_server.lines)
    headers = {"Authorization": f"Bearer {API_KEY}"}
    body = {"model": model, "messages": [{"role": "user", "content": "go on"}], "max_tokens": 1900}
    long = client.chat.completions.create(stream=True, **body)
    chunks = iter(long)
    next(chunks)
    with pytest.raises(httpx2.ReadTimeout):  # waits in the queue behind the long answer, then gives up
        httpx2.post(f"{tiny_server.url}/chat/completions", json=body, headers=headers, timeout=1.0)
    long.close()
    with pytest.raises(httpx2.ReadTimeout):  # runs, not streamed; its client gives up before the end
        httpx2.post(f"{tiny_server.url}/chat/completions", json=body, headers=headers, timeout=2.0)
    long_line, waited, unstreamed = tiny_server.wait_requests(3, start)
    assert long_line.endswith("cancelled") and "cancelled while waiting" in waited
    assert float(waited.split("(")[1].split(" s)")[0]) >= 0.9  # its client gave up after 1 s, not at once
    assert unstreamed.endswith("cancelled") and int(unstreamed.split(" + ")[1].split(" tokens")[0]) < 1900
    assert client.completions.create(model=model, prompt="The", max_tokens=2).usage.completion_tokens == 2
