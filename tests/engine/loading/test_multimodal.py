"""Vision-language checkpoints (Gemma 3, Qwen3.5, Qwen3.5-MoE) load as their text model: a tiny
wrapper built with transformers' own classes and saved by its save_pretrained (its vision tower
included) gives the greedy text of the wrapper itself decoding the same text in transformers,
and, where transformers maps the folder to the text model (Qwen3.5), of that model too."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, AutoTokenizer, PreTrainedModel

from engine.decoding.generation import Engine
from engine.errors import UnsupportedModel
from engine.loading.load import load_model
from engine.loading.multimodal import VISION_SKIPPED, text_config
from engine.types import Completion, GenerationRequest, Offload, SpeculationSettings
from wrapper_helpers import KINDS, tiny_wrapper

PROMPT = ("Speculative decoding lets a small draft model propose tokens that a large target model verifies. "
          "def add(a, b):")
NEW = 20


def greedy(path: Path, offload: Offload = "none") -> tuple[list[int], list[int]]:
    """(prompt ids, generated ids) of our engine's plain greedy decoding of the folder."""
    loaded = load_model(path, offload=offload)
    engine = Engine(loaded.model, loaded.tokenizer)
    req = GenerationRequest(raw_prompt=PROMPT, max_new_tokens=NEW,
                            speculation=SpeculationSettings(mode="autoregressive"))
    final = list(engine.generate(req))[-1]
    assert isinstance(final, Completion)
    assert final.finish_reason in ("eos", "length")
    return engine.encode(req), list(final.token_ids)


def reference(model: PreTrainedModel, ids: list[int], pad: int | None) -> list[int]:
    """transformers' own greedy `generate` (its masks, caches and, for a wrapper, its
    multimodal forward given text only)."""
    x = torch.tensor([ids])
    out = model.eval().generate(x, attention_mask=torch.ones_like(x), max_new_tokens=NEW,
                                do_sample=False, pad_token_id=pad)
    return out[0, len(ids):].tolist()


@pytest.mark.parametrize("kind", KINDS)
def test_a_wrapper_runs_its_text_model_as_transformers_does(kind: str, tmp_path: Path,
                                                            caplog: pytest.LogCaptureFixture) -> None:
    path = tiny_wrapper(tmp_path / kind, kind)
    with caplog.at_level(logging.INFO, logger="engine.loading.multimodal"):
        ids, got = greedy(path)
    assert [r.getMessage() for r in caplog.records].count(VISION_SKIPPED) == 1
    pad = AutoTokenizer.from_pretrained(path).pad_token_id
    wrapper = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32)
    want = reference(wrapper, ids, pad)
    assert len(set(want)) > 3, "the reference should say something"
    assert got == want[: len(got)] and len(got) > NEW // 2  # shorter only when it reached EOS
    assert greedy(path, offload="all") == (ids, got), "every layer streamed from the host store"
    if kind != "gemma3":  # transformers maps a Qwen3.5 wrapper folder to its text model
        text = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        assert type(text).__name__.endswith("ForCausalLM")
        assert reference(text, ids, pad) == want


def test_the_wrappers_head_tying_carries_over(tmp_path: Path) -> None:
    """A Qwen3.5 wrapper whose own tie_word_embeddings is true (its text_config says false)
    ties its head, as the wrapper class does, even beside a stray stored lm_head."""
    path = tiny_wrapper(tmp_path / "tied", "qwen3_5", tie=True)
    tok = AutoTokenizer.from_pretrained(path)
    ids = tok(PROMPT)["input_ids"]
    want = reference(AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32), ids, tok.pad_token_id)
    state = load_file(path / "model.safetensors")
    assert "lm_head.weight" not in state
    state["lm_head.weight"] = torch.randn_like(state["model.language_model.embed_tokens.weight"])
    save_file(state, path / "model.safetensors", metadata={"format": "pt"})
    loaded = load_model(path)
    assert loaded.model.head.weight is loaded.model.embed.weight
    got_ids, got = greedy(path)
    assert got_ids == ids and got == want[: len(got)]


def test_the_outer_fields_carry_into_the_text_config() -> None:
    outer = {"model_type": "gemma3", "tie_word_embeddings": False, "final_logit_softcapping": 30.0,
             "eos_token_id": [1, 106], "quantization_config": {"quant_method": "fp8"},
             "text_config": {"model_type": "gemma3_text", "num_hidden_layers": 2, "eos_token_id": 1,
                             "tie_word_embeddings": True}}
    text = text_config(outer, "m")
    assert text is not None and text["model_type"] == "gemma3_text" and text["num_hidden_layers"] == 2
    assert (text["tie_word_embeddings"], text["final_logit_softcapping"], text["eos_token_id"]) == \
        (False, 30.0, [1, 106])
    assert text["quantization_config"] == {"quant_method": "fp8"}
    # no outer tie_word_embeddings: the wrapper class's default (Gemma 3 ties, Qwen3.5 does not)
    gemma = text_config({"model_type": "gemma3", "text_config": {"model_type": "gemma3_text"}}, "m")
    assert gemma is not None and gemma["tie_word_embeddings"] is True
    assert text_config({"model_type": "qwen3_5", "text_config": {}}, "m") == {  # its default text model
        "model_type": "qwen3_5_text", "tie_word_embeddings": False}
    assert text_config({"model_type": "llama", "text_config": {"model_type": "llama"}}, "m") is None
    assert text_config({"model_type": "gemma3", "text_config": {"model_type": "siglip"}}, "m") is None


@pytest.mark.parametrize(("text", "message"), [
    ("a string", "text_config is not an object"),
    ({"num_hidden_layers": 10**9}, "num_hidden_layers is '1000000000'"),
    ({"layer_types": ["linear_attention"] * 3}, "layer_types has 3 entries for 4 layers"),
])
def test_a_damaged_text_config_gets_one_clear_message(tmp_path: Path, text: object, message: str) -> None:
    path = tiny_wrapper(tmp_path / "damaged", "qwen3_5")
    config = json.loads((path / "config.json").read_text())
    config["text_config"] = {**config["text_config"], **text} if isinstance(text, dict) else text
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModel) as caught:
        load_model(path)
    assert message in caught.value.user_message, caught.value.user_message
