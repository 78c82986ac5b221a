"""Thinking models end to end, with real models whose answers are known: the two scripted tiny
models (engine/testing/scripted_model.py), one under Qwen 3 Thinking's template (reasoning inside
<think>, opened by the generation prompt), one under gpt-oss's harmony template (an analysis
message, then a final one). Their greedy answer is the script in every decoding mode, checked
against transformers' own generate; behind `specchat serve` with a draft that is often wrong, the
official `openai` client gets the reasoning in `reasoning_content` and the answer in `content`,
whole and streamed."""

from __future__ import annotations

import json
import re
from dataclasses import replace
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import torch
from serve_process import API_KEY, ServeProcess
from openai.types.chat import ChatCompletionMessageParam
from transformers import AutoModelForCausalLM, AutoTokenizer, BatchEncoding, PreTrainedTokenizerBase

from engine.cli.main import main
from engine.testing.scripted_model import Script, scripted_model
from engine.testing.thinking_scripts import ScriptedPair

NAMES = ["qwen3-thinking", "gpt-oss-harmony"]
USER: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hello"}]


def token_id(tokenizer: PreTrainedTokenizerBase, piece: str) -> int:
    found = tokenizer.convert_tokens_to_ids(piece)
    assert isinstance(found, int)
    return found


def script_ids(pair: ScriptedPair) -> list[int]:
    tokenizer = AutoTokenizer.from_pretrained(pair.target)
    return [token_id(tokenizer, piece) for piece in pair.script.pieces]


def hf_greedy(model: Path) -> list[int]:
    """The reference: transformers' own greedy decoding of the probe conversation."""
    tokenizer = AutoTokenizer.from_pretrained(model)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "hello"}], add_generation_prompt=True,
                                           return_tensors="pt", return_dict=True)
    assert isinstance(prompt, BatchEncoding)
    hf_model = AutoModelForCausalLM.from_pretrained(model).eval()
    with torch.no_grad():
        out = hf_model.generate(**prompt, max_new_tokens=40, do_sample=False)
    return [int(t) for t in out[0, prompt["input_ids"].shape[1]:]]


@pytest.mark.parametrize("name", NAMES)
def test_the_greedy_answer_is_the_script_in_every_decoding_mode(
        name: str, thinking_models: dict[str, ScriptedPair], capsys: pytest.CaptureFixture[str]) -> None:
    pair = thinking_models[name]
    ids = script_ids(pair)
    eos = token_id(AutoTokenizer.from_pretrained(pair.target), pair.script.eos)
    assert hf_greedy(pair.target) == [*ids, eos]
    drafted = hf_greedy(pair.draft)
    assert drafted[:len(ids)] != ids  # the draft strays: its trees get rejected on the way

    modes: dict[str, list[object]] = {"plain": ["--mode", "autoregressive"], "draft-free": [],
                                      "draft": ["--draft", pair.draft, "--keep-draft"]}
    for mode, args in modes.items():
        rc = main([str(a) for a in ("generate", "--target", pair.target, "--device", "cpu", "--budget", 8,
                                    "--max-depth", 4, "--max-new-tokens", 60, "--json", "--messages",
                                    json.dumps(USER), *args)])
        out, err = capsys.readouterr()
        assert rc == 0, err
        answer = json.loads(out.splitlines()[0])
        assert answer["token_ids"] in (ids, [*ids, eos]), mode
        assert answer["finish_reason"] in ("eos", "stop"), mode


def test_a_script_the_chain_cannot_follow_is_refused(tmp_path: Path) -> None:
    chatml = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
              "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    base = Script(name="x", pieces=("Yes", ".", " No", "."), reasoning="", answer="Yes. No.", template=chatml,
                  specials=("<|im_start|>", "<|im_end|>"), eos="<|im_end|>")
    with pytest.raises(ValueError, match="a piece repeats"):
        scripted_model(tmp_path / "repeats", base)
    with pytest.raises(ValueError, match=re.escape("the prompt ends with the script piece '\\n'")):
        scripted_model(tmp_path / "mid-script", replace(base, pieces=("Yes", "\n", "No")))
    with pytest.raises(ValueError, match="need hidden > 3"):
        scripted_model(tmp_path / "small", replace(base, pieces=("Yes", ".", "No")), hidden=3)


@pytest.fixture(scope="module", params=NAMES)
def served(request: pytest.FixtureRequest, thinking_models: dict[str, ScriptedPair]
           ) -> Iterator[tuple[ScriptedPair, openai.OpenAI]]:
    """The scripted model behind `specchat serve`, with its noisy draft kept on."""
    pair = thinking_models[request.param]
    server = ServeProcess(["--target", pair.target, "--draft", pair.draft, "--keep-draft", "--device", "cpu",
                           "--budget", 8, "--max-depth", 4, "--max-new-tokens", 60, "--api-key", API_KEY])
    server.wait_for(lambda line: line.startswith("ready:"))
    yield pair, openai.OpenAI(base_url=server.url, api_key=API_KEY, max_retries=0, timeout=120)
    assert server.stop() == 0, "\n".join(server.lines)


def test_reasoning_and_answer_come_back_in_their_own_fields(served: tuple[ScriptedPair, openai.OpenAI]) -> None:
    pair, client = served
    answer = client.chat.completions.create(model=pair.target.name, messages=USER)
    [choice] = answer.choices
    assert choice.finish_reason == "stop"
    assert choice.message.content == pair.script.answer
    assert (choice.message.model_extra or {}).get("reasoning_content") == pair.script.reasoning
    assert answer.usage and answer.usage.completion_tokens == len(pair.script.pieces) + 1  # and the EOS


def test_streamed_deltas_reassemble_to_the_same_fields(served: tuple[ScriptedPair, openai.OpenAI]) -> None:
    pair, client = served
    content, reasoning, finish = [], [], []
    for chunk in client.chat.completions.create(model=pair.target.name, messages=USER, stream=True):
        for choice in chunk.choices:
            content.append(choice.delta.content or "")
            reasoning.append((choice.delta.model_extra or {}).get("reasoning_content") or "")
            finish.append(choice.finish_reason)
    assert "".join(content) == pair.script.answer and "".join(reasoning) == pair.script.reasoning
    assert sum(bool(piece) for piece in reasoning) > 1  # it streamed, not one block at the end
    assert [f for f in finish if f] == ["stop"]
    assert not any(marker in "".join(content + reasoning) for marker in ("<think>", "</think>", "<|", "|>"))
