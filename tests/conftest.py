"""Fixtures shared by the whole suite. Keep this small: fixtures used by one area live next to it
(e.g. tests/engine/store/conftest.py)."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterator
from pathlib import Path

# pytest-xdist (pyproject's addopts: two workers on the 2-core CI machine) runs each worker with one
# compute thread: two workers with an OpenMP team each would oversubscribe the cores and spin in
# each other's way. Set before torch is imported (below), inherited by the processes tests start;
# a test that sets its own count (torch.set_num_threads, engine.threads.set_threads) keeps it.
XDIST_WORKER = os.environ.get("PYTEST_XDIST_WORKER")
if XDIST_WORKER:
    for _name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ[_name] = "1"

import pytest  # noqa: E402

from engine.testing.synthetic import tiny_model  # noqa: E402
from engine.testing.thinking_scripts import ScriptedPair, scripted_thinking_models  # noqa: E402

SERVING = Path(__file__).resolve().parent / "engine" / "serving"

pytest_plugins = ["pytester"]  # tests/app/test_qt_bindings.py runs the suite's own settings on a sample

# ---- pytest-xdist: two workers for the whole suite (pyproject's addopts) ----------------------------
# The files that use the real starter pair (tests/engine/conftest.py: starter_pair, ~1 GB in RAM):
# one unit of work, so one worker loads it. A file missing here is its own unit: correct, but the
# other worker may load the pair a second time.
STARTER_FILES = frozenset({
    "tests/engine/decoding/test_context.py",
    "tests/engine/decoding/test_prefix_cache.py",
    "tests/engine/decoding/test_starter.py",
    "tests/engine/serving/test_serve_starter.py",
    "tests/engine/serving/test_starter_tools.py",
})
# The units queued first, the longest ones (measured 2026-11-26), so that neither worker is left
# alone with one of them at the end. Scheduling only: a stale entry costs time, never a test.
LONG_FIRST = (
    "starter",  # ~300 s
    "tests/installer/test_install_linux.py",  # ~130 s, mostly pip in subprocesses
    "tests/engine/loading/test_gguf.py",  # the starter's Q4_1 GGUF against transformers
    "tests/engine/loading/test_loading_lowram.py",  # two 1.5 GB files written and loaded
    "tests/engine/decoding/test_lossless_sampling.py",  # 8000 sampled answers
    "tests/engine/decoding/test_grammar.py",
    "tests/engine/model/test_hybrid.py",
    "tests/engine/model/test_families.py",
    "tests/engine/cli/test_cli.py",
)


def work_unit(nodeid: str) -> str:
    """The unit of work a test belongs to under xdist: its file, or "starter"."""
    path = nodeid.split("::", 1)[0]
    return "starter" if path in STARTER_FILES else path


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int | None:
    """`-n auto` (pyproject's addopts): two workers for the whole suite (`python -m pytest`, what CI
    runs); no worker processes when files or tests are named (one area while working on it);
    PYTEST_XDIST_AUTO_NUM_WORKERS, or `-n N` on the command line, decides instead."""
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
        return None  # xdist's own hook reads it
    return 2 if config.args_source == pytest.Config.ArgsSource.TESTPATHS else 0


def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object | None:
    """`--dist loadfile` (addopts), with the STARTER_FILES as one unit: a file's module-scoped
    fixtures (servers, converted models) are built on one worker only. (xdist's `loadgroup` marks
    cannot do this here: xdist 3.8 renames the item's `_nodeid`, which pytest 9 no longer reads, so
    it groups nothing.)"""
    if config.getvalue("dist") != "loadfile":
        return None  # another --dist named on the command line: xdist's own scheduler
    from xdist.scheduler import LoadScopeScheduling

    class Units(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return work_unit(nodeid)

    return Units(config, log)  # type: ignore[arg-type]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under xdist, LONG_FIRST first (the scheduler queues units in collection order:
    `--no-loadscope-reorder`); a stable sort, so each file stays whole and in order."""
    if XDIST_WORKER:
        rank = {unit: i for i, unit in enumerate(LONG_FIRST)}
        items.sort(key=lambda item: rank.get(work_unit(item.nodeid), len(rank)))


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
