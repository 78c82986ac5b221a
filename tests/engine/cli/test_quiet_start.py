"""What every start prints besides the answer (issue 26.11): no bitsandbytes "pip install
kernels" notice, and a model's load as one progress line (overwritten in place on a terminal, a
few lines elsewhere), not a line per decoder layer."""

from __future__ import annotations

import io
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from engine.cli.load_progress import LoadProgressLine
from engine.cli.main import main
from engine.testing.synthetic import tiny_model
from engine.notices import BNB_CPU_LOGGER
from engine.types import LoadProgress

REPO = Path(__file__).resolve().parents[3]
NOTICE = ("Failed to load CPU gemm_4bit_forward from kernels-community: %s. Please make sure you already "
          "`pip install kernels` and the kernels >= 0.11.1")


def layer_events(n: int = 30) -> list[LoadProgress]:
    """What load_engine reports for an n-layer target: the start, each layer, ready."""
    return ([LoadProgress("target", 0.0, "loading model on cpu")]
            + [LoadProgress("target", 0.8 * (i + 1) / n, f"layer {i + 1} of {n} -> memory") for i in range(n)]
            + [LoadProgress("ready", 1.0, "ready")])


# ---- the bitsandbytes notice ----------------------------------------------------------------------
def test_importing_the_engine_and_bitsandbytes_prints_no_kernels_notice() -> None:
    """Where bitsandbytes logs it (a CPU with AVX512-BF16, `kernels` not installed), it is gone."""
    done = subprocess.run([sys.executable, "-c", "import engine.offload.layout, engine.loading.starter"],
                          capture_output=True, text=True, cwd=REPO, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "pip install kernels" not in done.stderr and "kernels-community" not in done.stderr


def test_only_the_missing_kernels_notice_is_dropped(caplog: pytest.LogCaptureFixture) -> None:
    import engine  # noqa: F401 - installs the filter

    logger = logging.getLogger(BNB_CPU_LOGGER)
    missing = ModuleNotFoundError("No module named 'kernels'", name="kernels")
    with caplog.at_level(logging.WARNING, logger=BNB_CPU_LOGGER):
        logger.warning(NOTICE, missing)  # the optional package is simply not there: dropped
        logger.warning(NOTICE, RuntimeError("the hub refused the download"))  # it is there and failed: shown
        logger.warning("something else went wrong in bitsandbytes")  # any other warning: shown
    shown = [r.getMessage() for r in caplog.records if r.name == BNB_CPU_LOGGER]
    assert len(shown) == 2 and "hub refused" in shown[0] and "something else" in shown[1]


# ---- the load as one progress line ---------------------------------------------------------------
def test_off_a_terminal_a_30_layer_load_takes_a_few_lines_and_ends_with_the_last() -> None:
    out = io.StringIO()
    line = LoadProgressLine(out)
    for event in layer_events(30):
        line(event)
    line.finish()
    lines = out.getvalue().splitlines()
    assert 3 <= len(lines) <= 7, lines
    assert lines[0] == "specchat: loading model on cpu" and lines[-1] == "specchat: layer 30 of 30 -> memory"
    assert "\r" not in out.getvalue()


def test_on_a_terminal_the_load_is_one_line_overwritten_in_place() -> None:
    master, slave = os.openpty()
    stream = io.TextIOWrapper(os.fdopen(slave, "wb", buffering=0), encoding="utf-8", write_through=True)
    line = LoadProgressLine(stream)
    assert line.tty
    for event in layer_events(30):
        line(event)
    line.finish()
    stream.close()
    drawn = b""
    while True:
        try:
            chunk = os.read(master, 65536)
        except OSError:
            break
        if not chunk:
            break
        drawn += chunk
    os.close(master)
    text = re.sub(r"\x1b\[[0-9;]*[A-Za-z]", "", drawn.decode("utf-8"))
    rows = [row for row in re.split(r"\r?\n", text) if row]  # a tty turns \n into \r\n
    assert len(rows) == 1, rows  # one line on the screen...
    frames = [f for f in rows[0].split("\r") if f]
    assert len(frames) == 31 and frames[-1] == "specchat: layer 30 of 30 -> memory"  # ...redrawn 31 times


@pytest.fixture(scope="module")
def thirty_layers(model_cache: Path) -> Path:
    """A tiny model with the starter's 30 decoder layers."""
    return tiny_model("llama", seed=0, layers=30, hidden=32, cache_dir=model_cache)


def test_chat_says_its_load_in_a_few_lines(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
                                           thirty_layers: Path) -> None:
    monkeypatch.setattr(sys, "stdin", io.StringIO("/exit\n"))
    rc = main(["chat", "--target", str(thirty_layers), "--device", "cpu"])
    _, err = capsys.readouterr()
    assert rc == 0, err
    layers = [line for line in err.splitlines() if re.search(r"layer \d+ of 30", line)]
    assert 1 <= len(layers) <= 6, err
    assert "layer 30 of 30" in layers[-1]
