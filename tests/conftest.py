"""Fixtures shared by the whole suite. Keep this small: fixtures used by one area live next to it
(e.g. tests/engine/store/conftest.py)."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine.testing.synthetic import tiny_model
from engine.testing.thinking_scripts import ScriptedPair, scripted_thinking_models

SERVING = Path(__file__).resolve().parent / "engine" / "serving"

pytest_plugins = ["pytester"]  # tests/app/test_qt_bindings.py runs the suite's own settings on a sample


@pytest.fixture(scope="session", autouse=True)
def _isolated_user_data(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """No test reads or writes the user's data folder (hardware profile, conversations,
    downloaded models): a saved profile there would change what `--budget auto` picks. Child
    processes inherit the variable. Tests that need their own folder set it again."""
    saved = {name: os.environ.get(name) for name in ("SPECCHAT_DATA_DIR", "SPECCHAT_CONFIG_DIR")}
    os.environ["SPECCHAT_DATA_DIR"] = str(tmp_path_factory.mktemp("specchat-data"))
    os.environ["SPECCHAT_CONFIG_DIR"] = str(tmp_path_factory.mktemp("specchat-config"))  # the shared settings file
    yield
    for name, old in saved.items():
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


@pytest.fixture(scope="session")
def model_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A SPECCHAT_CACHE_DIR for this test session: tests never write the user's cache."""
    return tmp_path_factory.mktemp("specchat-cache")


@pytest.fixture(scope="session")
def tiny_target_path(model_cache: Path) -> Path:
    """Folder of a tiny random Llama (2 layers, hidden 64, byte-level BPE, ChatML template)."""
    return tiny_model("llama", seed=0, cache_dir=model_cache)


@pytest.fixture(scope="session")
def tiny_draft_path(model_cache: Path) -> Path:
    """The tiny target with 5% weight noise: same tokenizer, high agreement, so trees go deep."""
    return tiny_model("llama", seed=0, noise=0.05, cache_dir=model_cache)


@pytest.fixture(scope="session")
def thinking_models(model_cache: Path) -> dict[str, ScriptedPair]:
    """Real tiny models whose greedy answer is a script of reasoning then answer: "qwen3-thinking"
    (Qwen 3 Thinking's template, tests/engine/serving/templates.py) and "gpt-oss-harmony", each
    with a noisy copy as draft (engine/testing/thinking_scripts.py)."""
    spec = importlib.util.spec_from_file_location("_thinking_templates", SERVING / "templates.py")
    assert spec is not None and spec.loader is not None
    templates = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(templates)
    return scripted_thinking_models(model_cache, templates.QWEN_THINKING)
