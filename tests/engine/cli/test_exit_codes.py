"""Every `error:` the command line prints for what it was given, against the README's
convention (issue 26.2, 26.3, 26.5; issue 33.4): 2 for a usage error (an unknown option, a bad
value or combination, also one only the loaded model can tell: an empty prompt, more text or
messages than its context holds), 1 for a runtime failure (a model that cannot load, memory).
One `error:` line, nothing on stdout, no traceback, and never a hang: a FIFO, a folder or
/dev/zero where a file belongs is refused without reading it."""

from __future__ import annotations

import json
import os
import shutil
import signal
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from engine.cli.main import main

Args = Callable[[Path, Path], list[object]]  # (tmp folder, tiny model) -> argv


class Blocked(BaseException):
    """Raised by the timer: not an OSError (TimeoutError is one), so no `except OSError` in the
    code under test can swallow it."""


@pytest.fixture(autouse=True)
def _no_hang() -> Iterator[None]:
    """A read that blocks (a FIFO opened for reading) fails the test instead of hanging it."""

    def expire(signum: int, frame: object) -> None:
        raise Blocked("the command blocked for 60 s")

    old = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, 60, 60)  # again and again: each blocked read fails
    yield
    signal.setitimer(signal.ITIMER_REAL, 0)
    signal.signal(signal.SIGALRM, old)


def fifo(root: Path) -> Path:
    path = root / "pipe.json"
    os.mkfifo(path)
    return path


def folder(root: Path) -> Path:
    path = root / "chat.json"
    path.mkdir()
    return path


def written(root: Path, text: str | bytes, name: str = "chat.json") -> Path:
    path = root / name
    path.write_bytes(text.encode("utf-8", "surrogatepass") if isinstance(text, str) else text)
    return path


def model_with_a_fifo(root: Path, model: Path, name: str) -> Path:
    """The tiny model's folder with one of its files replaced by a FIFO."""
    copy = root / "model"
    shutil.copytree(model, copy)
    (copy / name).unlink()
    os.mkfifo(copy / name)
    return copy


def model_with_config(root: Path, model: Path, text: str) -> Path:
    """The tiny model's folder with `text` as its config.json."""
    copy = root / "model"
    shutil.copytree(model, copy)
    (copy / "config.json").write_text(text)
    return copy


def long_file(root: Path, size: int) -> Path:
    path = root / "big.json"
    with open(path, "wb") as f:
        f.truncate(size)  # sparse: no disk needed
    return path


def messages(n: int, text: str = "hi") -> str:
    return json.dumps([{"role": "user", "content": text}] * n)


def copied(root: Path, model: Path, name: str, extra: str | None = None) -> Path:
    """The tiny model's folder copied to `name` (a name with a lone surrogate is made of bytes
    that are not UTF-8, as Linux allows), with an `extra` empty file beside its files."""
    copy = root / name
    shutil.copytree(model, copy)
    if extra is not None:
        (copy / extra).touch()
    return copy


GEN = ["generate", "--max-new-tokens", 2]
NOT_UTF8 = b"\xff[]"
HI = ["--prompt", "hi"]

# name: (argv after `specchat`, exit code, a fragment of the error line)
CASES: dict[str, tuple[Args, int, str]] = {
    # values argparse checks
    "unknown option": (lambda r, t: [*GEN, "--target", t, *HI, "--bogus"], 2, "unrecognized arguments"),
    "budget not a number": (lambda r, t: [*GEN, "--target", t, *HI, "--budget", "lots"], 2, "--budget"),
    "budget past any machine": (lambda r, t: [*GEN, "--target", t, *HI, "--budget", 10**30], 2, "--budget"),
    "samples 0": (lambda r, t: [*GEN, "--target", t, *HI, "--samples", 0], 2, "--samples"),
    "ram limit NaN": (lambda r, t: [*GEN, "--target", t, *HI, "--ram-limit", "nan"], 2, "--ram-limit"),
    "device tpu": (lambda r, t: [*GEN, "--target", t, *HI, "--device", "tpu"], 2, "--device"),
    "no prompt at all": (lambda r, t: [*GEN, "--target", t], 2, "one of the arguments"),
    "prompt and messages": (lambda r, t: [*GEN, "--target", t, *HI, "--messages", messages(1)], 2, "not allowed"),
    # values the settings check before loading
    "no target": (lambda r, t: [*GEN, *HI], 2, "--target"),
    "budget 0": (lambda r, t: [*GEN, "--target", t, *HI, "--budget", 0], 2, "--budget: must be at least 1"),
    "max new tokens 0": (lambda r, t: ["generate", "--target", t, *HI, "--max-new-tokens", 0], 2, "new tokens"),
    "temperature -1": (lambda r, t: [*GEN, "--target", t, *HI, "--temperature", -1], 2, "temperature"),
    "temperature inf": (lambda r, t: [*GEN, "--target", t, *HI, "--temperature", "inf"], 2, "temperature"),
    "top-p 0": (lambda r, t: [*GEN, "--target", t, *HI, "--top-p", 0], 2, "top-p"),
    "top-k -1": (lambda r, t: [*GEN, "--target", t, *HI, "--top-k", -1], 2, "top-k"),
    "min-p 2": (lambda r, t: [*GEN, "--target", t, *HI, "--min-p", 2], 2, "min-p"),
    "repetition penalty 0": (lambda r, t: [*GEN, "--target", t, *HI, "--repetition-penalty", 0], 2, "penalty"),
    "max depth 0": (lambda r, t: [*GEN, "--target", t, *HI, "--max-depth", 0], 2, "depth"),
    "seed past 64 bits": (lambda r, t: [*GEN, "--target", t, *HI, "--seed", 2**64], 2, "seed"),
    "seeds of the samples past 64 bits": (lambda r, t: [*GEN, "--target", t, *HI, "--seed", 2**64 - 2,
                                                        "--samples", 3], 2, "--seed"),
    "undecodable prompt": (lambda r, t: [*GEN, "--target", t, "--prompt", "caf\udce9"], 2, "UTF-8"),
    "undecodable stop": (lambda r, t: [*GEN, "--target", t, *HI, "--stop", "\udc80"], 2, "UTF-8"),
    "system with raw prompt": (lambda r, t: [*GEN, "--target", t, "--system", "x", "--raw-prompt", "y"], 2, "--system"),
    "system with messages": (lambda r, t: [*GEN, "--target", t, "--system", "x", "--messages", messages(1)], 2,
                             "--system"),
    "empty raw prompt": (lambda r, t: [*GEN, "--target", t, "--raw-prompt", ""], 2, "--raw-prompt is empty"),
    # --messages: the value, inline or @FILE
    "messages not JSON": (lambda r, t: [*GEN, "--target", t, "--messages", "{not json"], 2, "not valid JSON"),
    "messages empty list": (lambda r, t: [*GEN, "--target", t, "--messages", "[]"], 2, "non-empty JSON list"),
    "messages an object": (lambda r, t: [*GEN, "--target", t, "--messages", '{"role": "user"}'], 2, "JSON list"),
    "messages unknown role": (lambda r, t: [*GEN, "--target", t, "--messages",
                                            '[{"role": "robot", "content": "hi"}]'], 2, "message 1"),
    "messages NaN": (lambda r, t: [*GEN, "--target", t, "--messages", "[NaN]"], 2, "NaN"),
    "messages 5,000-digit number": (lambda r, t: [*GEN, "--target", t, "--messages", "[" + "1" * 5000 + "]"], 2,
                                    "digits"),
    "messages nested 100,000 deep": (lambda r, t: [*GEN, "--target", t, "--messages",
                                                   "[" * 100_000 + "]" * 100_000], 2, "levels deep"),
    "messages file nested 100,000 deep": (lambda r, t: [*GEN, "--target", t, "--messages",
                                                        f"@{written(r, '[' * 100_000 + ']' * 100_000)}"], 2,
                                          "levels deep"),
    "messages with a lone surrogate": (lambda r, t: [*GEN, "--target", t, "--messages",
                                                     '[{"role": "user", "content": "\\udc80"}]'], 2, "lone surrogate"),
    "messages file missing": (lambda r, t: [*GEN, "--target", t, "--messages", f"@{r / 'missing.json'}"], 2,
                              "No such file"),
    "messages file a folder": (lambda r, t: [*GEN, "--target", t, "--messages", f"@{folder(r)}"], 2, "a folder"),
    "messages file a FIFO": (lambda r, t: [*GEN, "--target", t, "--messages", f"@{fifo(r)}"], 2, "FIFO"),
    "messages file /dev/zero": (lambda r, t: [*GEN, "--target", t, "--messages", "@/dev/zero"], 2, "a device"),
    "messages file too large": (lambda r, t: [*GEN, "--target", t, "--messages", f"@{long_file(r, 1 << 30)}"], 2,
                                "larger than"),
    "messages file not UTF-8": (lambda r, t: [*GEN, "--target", t, "--messages", "@" + str(written(r, NOT_UTF8))], 2,
                                "not UTF-8"),
    # what only the loaded model can tell: still the command line's fault
    "100,000 messages": (lambda r, t: [*GEN, "--target", t, "--messages", f"@{written(r, messages(100_000))}"], 2,
                         "100000 messages"),
    "messages longer than the context": (lambda r, t: [*GEN, "--target", t, "--messages",
                                                       messages(3, "word " * 2000)], 2, "reads at most"),
    "prompt longer than the context": (lambda r, t: [*GEN, "--target", t, "--prompt", "word " * 5000], 2,
                                       "reads at most"),
    "raw prompt longer than the context": (lambda r, t: [*GEN, "--target", t, "--raw-prompt", "word " * 5000], 2,
                                           "reads at most"),
    # runtime failures: the model, memory
    "target missing": (lambda r, t: [*GEN, "--target", r / "nowhere", *HI], 1, "No model at"),
    "target a folder without config.json": (lambda r, t: [*GEN, "--target", r, *HI], 1, "config.json"),
    "target a FIFO": (lambda r, t: [*GEN, "--target", fifo(r), *HI], 1, "not a regular file"),
    "weights a FIFO": (lambda r, t: [*GEN, "--target", model_with_a_fifo(r, t, "model.safetensors"), *HI], 1,
                       "not a file"),
    "chat template a FIFO": (lambda r, t: [*GEN, "--target", model_with_a_fifo(r, t, "chat_template.jinja"), *HI],
                             1, "not a file"),
    "budget past memory": (lambda r, t: [*GEN, "--target", t, *HI, "--budget", 10**9], 1, "tree budget of at most"),
    "draft-free budget past memory": (lambda r, t: [*GEN, "--target", t, *HI, "--budget", 2**31 - 1], 1,
                                      "tree budget of at most"),
    # the other commands
    "chat: undecodable system": (lambda r, t: ["chat", "--target", t, "--system", "\udc80"], 2, "UTF-8"),
    "bench: prompts file missing": (lambda r, t: ["bench", "speculation", "--target", t, "--prompts",
                                                  r / "missing.txt"], 2, "prompts file"),
    "bench: prompts file a FIFO": (lambda r, t: ["bench", "speculation", "--target", t, "--prompts", fifo(r)], 2,
                                   "FIFO"),
    "bench: prompts file empty": (lambda r, t: ["bench", "speculation", "--target", t, "--prompts",
                                                written(r, "\n\n", "p.txt")], 2, "no prompts"),
    "bench: budgets 0": (lambda r, t: ["bench", "speculation", "--target", t, "--budgets", "0"], 2, "budget"),
    "bench: temperatures -1": (lambda r, t: ["bench", "speculation", "--target", t, "--temperatures", "-1"], 2,
                               "temperature"),
    "bench: unknown method": (lambda r, t: ["bench", "speculation", "--target", t, "--methods", "magic"], 2,
                              "Unknown bench methods"),
    "bench plan: unknown catalog id": (lambda r, t: ["bench", "plan", "--target", "no-such-model", "--gpu",
                                                     "rtx3090"], 1, "not in the catalog"),  # as a missing --target
    "models import: a folder named in bytes that are not UTF-8": (
        lambda r, t: ["models", "import", copied(r, t, "m\udcff"), "--models-dir", r / "md"], 1, "not UTF-8 text"),
    "models import: a file in the folder named in bytes that are not UTF-8": (
        lambda r, t: ["models", "import", copied(r, t, "m", "notes\udcfe.txt"), "--models-dir", r / "md"], 1,
        "not UTF-8 text"),
    "target named in bytes that are not UTF-8": (lambda r, t: [*GEN, "--target", copied(r, t, "m\udcff"), *HI], 1,
                                                 "not UTF-8 text"),
    "chat --remote: a URL with a line break": (lambda r, t: ["chat", "--remote", "http://gpu-box\n:8000/v1"], 1,
                                              "not an http(s) URL"),
    "chat --remote: a key outside ASCII": (lambda r, t: ["chat", "--remote", "http://127.0.0.1:9/v1", "--api-key",
                                                         "ключ"], 1, "API key"),
    "config.json nested 100,000 deep": (lambda r, t: [*GEN, "--target", model_with_config(
        r, t, '{"a": ' + "[" * 100_000 + "]" * 100_000 + "}"), *HI], 1, "levels deep"),
    "config.json a list": (lambda r, t: [*GEN, "--target", model_with_config(r, t, "[1, 2]"), *HI], 1,
                           "not a JSON object"),
    "config.json a FIFO": (lambda r, t: [*GEN, "--target", model_with_a_fifo(r, t, "config.json"), *HI], 1,
                           "named pipe"),
    "bench plan: --profile a FIFO": (lambda r, t: ["bench", "plan", "--target", "llama-3.1-70b-instruct",
                                                   "--profile", fifo(r)], 2, "--profile"),
    "bench plan: --profile missing": (lambda r, t: ["bench", "plan", "--target", "llama-3.1-70b-instruct",
                                                    "--profile", r / "none.json"], 2, "No hardware profile at"),
    "bench plan: --profile nested": (lambda r, t: ["bench", "plan", "--target", "llama-3.1-70b-instruct", "--profile",
                                                   written(r, "[" * 5000 + "]" * 5000)], 2, "levels deep"),
    "bench: --profile not a profile": (lambda r, t: ["bench", "speculation", "--target", t, "--profile",
                                                     written(r, '{"version": 1}')], 2, "--profile"),
    "models remove: no such model": (lambda r, t: ["models", "remove", "x", "--models-dir", r], 1, "No local model"),
    "models download stall timeout 0": (lambda r, t: ["models", "download", "a/b", "--stall-timeout", 0,
                                                      "--models-dir", r], 2, "--stall-timeout"),
}


@pytest.mark.parametrize("case", CASES)
def test_each_error_line_has_the_exit_code_of_the_convention(
        case: str, capsys: pytest.CaptureFixture[str], tmp_path: Path, tiny_target_path: Path) -> None:
    make_args, code, fragment = CASES[case]
    rc = main([str(a) for a in make_args(tmp_path, tiny_target_path)])
    out, err = capsys.readouterr()
    assert "Traceback" not in err and "This is a bug" not in err, err
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, err
    assert (rc, out) == (code, ""), err
    assert fragment in errors[0], errors[0]
