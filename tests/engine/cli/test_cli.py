"""`specchat generate|chat` against DESIGN.md's CLI contract, on tiny random models.

Most cases call `engine.cli.main([...])` in this process (one torch import for all of them);
three run `python -m engine` as a real subprocess for what only a process shows: the exit code
and the whole stderr of a failed load, stdin-driven chat up to EOF, and Ctrl+C (SIGINT).
"""

from __future__ import annotations

import importlib.metadata
import io
import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from engine.cli.common import JSON_STATS_FIELDS
from engine.cli.main import main
from engine.types import AUTO_FALLBACK_BUDGET as AUTO_BUDGET
from engine.testing.synthetic import tiny_tokenizer_files

REPO = Path(__file__).resolve().parents[3]
STATS_TYPES = {"prompt_tokens": int, "new_tokens": int, "target_passes": int, "tokens_per_pass": float,
               "draft_passes": int, "budget": int, "seconds": float, "ttft_seconds": float,
               "tokens_per_second": float, "peak_rss_bytes": int, "cached_tokens": int, "prefill_passes": int}


def cli(capsys: pytest.CaptureFixture[str], *args: object) -> tuple[int, str, str]:
    rc = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return rc, out, err


def spawn(args: list[object], model_cache: Path, **kwargs: object) -> subprocess.Popen[str]:
    env = {**os.environ, "SPECCHAT_CACHE_DIR": str(model_cache),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    env.pop("NO_COLOR", None)
    return subprocess.Popen([sys.executable, "-m", "engine", *map(str, args)], cwd=REPO, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, **kwargs)  # type: ignore[call-overload]


def json_lines(out: str) -> list[dict]:
    return [json.loads(line) for line in out.splitlines()]


def stats_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("[") and "tokens/pass" in line]


def prompt_tokens(line: str) -> int:
    return int(line.split("prompt ")[1].split(" tokens")[0])


# ---- end to end --------------------------------------------------------------------------------
def test_json_greedy_specexec_equals_autoregressive_and_plain_transformers(
    capsys: pytest.CaptureFixture[str], tiny_target_path: Path, tiny_draft_path: Path, model_cache: Path
) -> None:
    common = ["generate", "--target", tiny_target_path, "--draft", tiny_draft_path, "--raw-prompt", "The quick brown",
              "--max-new-tokens", 24, "--keep-draft", "--json"]
    proc = spawn(common, model_cache)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert err == ""  # no progress bars or transformers warnings around the JSON
    [spec] = json_lines(out)
    assert set(spec) == {"text", "token_ids", "finish_reason", "stats", "draft"}
    assert spec["draft"]["kind"] == "catalog" and spec["draft"]["label"] == tiny_draft_path.name  # named by hand
    assert set(spec["stats"]) == set(JSON_STATS_FIELDS)
    for key, kind in STATS_TYPES.items():
        assert isinstance(spec["stats"][key], kind), key
    assert spec["stats"]["budget"] == AUTO_BUDGET
    assert spec["stats"]["new_tokens"] == len(spec["token_ids"])
    assert spec["stats"]["target_passes"] < spec["stats"]["new_tokens"]  # the tiny draft agrees often

    rc, out, _ = cli(capsys, *common, "--mode", "autoregressive")
    assert rc == 0
    [ar] = json_lines(out)
    assert ar["token_ids"] == spec["token_ids"] and ar["text"] == spec["text"]
    assert ar["stats"]["target_passes"] == ar["stats"]["new_tokens"] and ar["stats"]["budget"] == 0
    assert ar["draft"]["kind"] == "none"  # --mode autoregressive loads no draft

    # independent reference: transformers' own greedy decoding of the same text
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_target_path)
    model = AutoModelForCausalLM.from_pretrained(tiny_target_path, dtype=torch.float32)
    ids = tok("The quick brown", return_tensors="pt")["input_ids"]
    ref = model.generate(ids, do_sample=False, max_new_tokens=24, pad_token_id=tok.pad_token_id)
    assert spec["token_ids"] == ref[0, ids.shape[1]:].tolist()


def test_chat_over_stdin_answers_each_turn_and_exits_on_eof(tiny_target_path: Path, tiny_draft_path: Path,
                                                            model_cache: Path) -> None:
    proc = spawn(["chat", "--target", tiny_target_path, "--draft", tiny_draft_path, "--max-new-tokens", 8],
                 model_cache, stdin=subprocess.PIPE)
    out, err = proc.communicate("hello there\nwhat did I say?\n", timeout=120)
    assert proc.returncode == 0, err
    assert "Traceback" not in err
    first, second = stats_lines(err)
    assert prompt_tokens(second) > prompt_tokens(first) + 1  # the second prompt holds the first turn
    assert len(out.splitlines()) >= 2


def test_ctrl_c_cancels_generate_keeps_partial_answer_and_exits_130(tiny_target_path: Path, model_cache: Path) -> None:
    # greedy on this prompt runs to the length limit (no EOS), so the signal lands mid-answer
    proc = spawn(["generate", "--target", tiny_target_path, "--raw-prompt", "Once upon a time",
                  "--max-new-tokens", 1500, "--mode", "autoregressive"], model_cache)
    assert proc.stdout is not None
    first = proc.stdout.read(1)  # the first streamed character: generation is under way
    assert first
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "Traceback" not in err
    [stats] = stats_lines(err)
    assert "cancelled" in stats
    new_tokens = int(stats.strip("[").split(" tokens")[0])
    assert 0 < new_tokens < 1500 and (first + out).strip()


# ---- generate options, in process ------------------------------------------------------------
def test_samples_use_consecutive_seeds(capsys: pytest.CaptureFixture[str], tiny_target_path: Path,
                                       tiny_draft_path: Path) -> None:
    common = ["generate", "--target", tiny_target_path, "--draft", tiny_draft_path, "--prompt", "Tell me a story",
              "--temperature", 1, "--max-new-tokens", 12, "--json"]
    rc, out, _ = cli(capsys, *common, "--seed", 5, "--samples", 3)
    assert rc == 0
    samples = json_lines(out)
    assert len(samples) == 3
    assert len({tuple(s["token_ids"]) for s in samples}) == 3
    rc, out, _ = cli(capsys, *common, "--seed", 7)
    assert rc == 0
    assert json_lines(out)[0]["token_ids"] == samples[2]["token_ids"]  # sample i runs with seed+i


def test_the_starter_id_runs_the_starter_gguf_from_the_cache(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """`--target smollm2-135m-instruct` without a download of it runs the starter's GGUF in the
    cache (what `specchat chat` and the app run): the same tokens as that file named by path."""
    from engine.store import load_catalog
    from engine.store.pypi import STARTER_GGUF_NAME
    from engine.testing.synthetic import tiny_gguf

    built = tiny_gguf("llama", layers=1, layer_types=("Q4_1",), head_type="Q8_0", cache_dir=tmp_path / "built")
    gguf = tmp_path / "cache" / "starter" / STARTER_GGUF_NAME  # as fetched from PyPI: no pip here
    gguf.parent.mkdir(parents=True)
    shutil.copy2(built, gguf)
    monkeypatch.setenv("SPECCHAT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("SPECCHAT_MODELS_DIR", str(tmp_path / "models"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf"))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # no LM Studio or Ollama copies
    common = ["--raw-prompt", "The sky is", "--max-new-tokens", 8, "--temperature", 0, "--device", "cpu", "--json"]
    rc, by_id, err = cli(capsys, "generate", "--target", load_catalog().starter, *common)
    assert rc == 0, err
    rc, by_path, err = cli(capsys, "generate", "--target", gguf, *common)
    assert rc == 0, err
    assert json_lines(by_id)[0]["token_ids"] == json_lines(by_path)[0]["token_ids"]


def test_text_output_streams_the_same_answer_with_one_stats_line(
    capsys: pytest.CaptureFixture[str], tiny_target_path: Path, tiny_draft_path: Path
) -> None:
    common = ["generate", "--target", tiny_target_path, "--draft", tiny_draft_path, "--system", "Be brief.",
              "--prompt", "Where is Paris?", "--max-new-tokens", 16, "--budget", 8, "--keep-draft"]
    rc, out, _ = cli(capsys, *common, "--json")
    assert rc == 0
    [answer] = json_lines(out)
    assert answer["stats"]["budget"] == 8
    rc, out, err = cli(capsys, *common)
    assert rc == 0
    assert out == answer["text"] + ("" if answer["text"].endswith("\n") else "\n")
    [line] = err.splitlines()
    assert line == stats_lines(err)[0] and "budget 8" in line


def test_the_stats_line_names_how_the_answer_was_decoded() -> None:
    from engine.cli.common import stats_line
    from engine.types import GenerationStats

    base = GenerationStats(prompt_tokens=5, new_tokens=8, target_passes=4, tokens_per_pass=2.0, draft_passes=0,
                           budget=8, seconds=1.0, ttft_seconds=0.1, tokens_per_second=8.0, peak_rss_bytes=0)
    kinds = {"budget 8": replace(base, draft_passes=6), "draft-free": replace(base, mode="context"),
             "draft switched off": replace(base, mode="context", draft_passes=3),
             "autoregressive": replace(base, mode="autoregressive", budget=0)}
    for words, stats in kinds.items():
        parts = stats_line(stats, "length").strip("[]").split(" · ")
        assert parts[3] == words and parts[0] == "8 tokens" and parts[-1] == "length", parts


def test_stop_string_cuts_the_answer(capsys: pytest.CaptureFixture[str], tiny_target_path: Path) -> None:
    common = ["generate", "--target", tiny_target_path, "--raw-prompt", "Paris is", "--max-new-tokens", 40, "--json"]
    rc, out, _ = cli(capsys, *common)
    assert rc == 0
    full = json_lines(out)[0]["text"]
    at = next(i for i in range(1, len(full) - 2) if full[i:i + 3].isascii() and full[i:i + 3].isalpha())
    stop = full[at:at + 3]
    rc, out, _ = cli(capsys, *common, "--stop", "never-appears", "--stop", stop)
    assert rc == 0
    [cut] = json_lines(out)
    assert cut["finish_reason"] == "stop"
    assert cut["text"] == full[:full.find(stop)]


def test_chat_reset_forgets_and_exit_quits(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
                                           tiny_target_path: Path) -> None:
    monkeypatch.setattr(sys, "stdin", io.StringIO("hello\nand more\n/reset\nhello\n/exit\nnever read\n"))
    rc, out, err = cli(capsys, "chat", "--target", tiny_target_path, "--max-new-tokens", 6)
    assert rc == 0
    first, second, third = stats_lines(err)  # three answers: "never read" comes after /exit
    assert prompt_tokens(second) > prompt_tokens(first)
    assert prompt_tokens(third) == prompt_tokens(first)
    answers = out.split("\n")
    assert answers[0] == answers[2]  # greedy, same conversation after /reset
    assert "conversation cleared" in err


# ---- bad input: one `error:` line, nothing on stdout, exit 2 (usage) or 1 (runtime) ---------------
def _gpt2_folder(root: Path) -> Path:
    folder = root / "gpt2"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "gpt2", "vocab_size": 10}))
    (folder / "model.safetensors").write_bytes(b"\x00" * 64)
    return folder


def _garbage_gguf(root: Path) -> Path:
    path = root / "x.gguf"
    path.write_bytes(os.urandom(2048))
    return path


def _mismatched_draft(root: Path, tiny_target_path: Path) -> Path:
    folder = root / "other-tokenizer"
    shutil.copytree(tiny_target_path, folder)
    tiny_tokenizer_files(folder, vocab_size=300)  # same weights, a different vocabulary
    return folder


# (arguments, exit code): 2 for the command line itself, 1 for a model that cannot be used
BAD_INPUTS = {
    "missing path": (lambda root, t: ["--target", root / "nowhere"], 1),
    "folder without config.json": (lambda root, t: ["--target", root], 1),
    "unsupported architecture": (lambda root, t: ["--target", _gpt2_folder(root)], 1),
    "corrupt gguf": (lambda root, t: ["--target", _garbage_gguf(root)], 1),
    "vocabulary mismatch": (lambda root, t: ["--target", t, "--draft", _mismatched_draft(root, t)], 1),
    "budget 0": (lambda root, t: ["--target", t, "--budget", 0], 2),
    "budget not a number": (lambda root, t: ["--target", t, "--budget", "lots"], 2),
    "samples 0": (lambda root, t: ["--target", t, "--samples", 0], 2),
    "max-new-tokens 0": (lambda root, t: ["--target", t, "--max-new-tokens", 0], 2),
    "top-p 0": (lambda root, t: ["--target", t, "--top-p", 0], 2),
    "no target": (lambda root, t: [], 2),
    "system with raw prompt": (lambda root, t: ["--target", t, "--system", "x", "--raw-prompt", "y"], 2),
    "prompt and raw prompt": (lambda root, t: ["--target", t, "--prompt", "x", "--raw-prompt", "y"], 2),
}


@pytest.mark.parametrize("case", BAD_INPUTS)
def test_bad_input_is_one_error_line_and_its_exit_code(case: str, capsys: pytest.CaptureFixture[str],
                                                       tmp_path: Path, tiny_target_path: Path) -> None:
    make_args, code = BAD_INPUTS[case]
    args = make_args(tmp_path, tiny_target_path)
    if "--raw-prompt" not in args and "--prompt" not in args:
        args = [*args, "--prompt", "hi"]
    rc, out, err = cli(capsys, "generate", *args)
    assert rc == code
    assert out == ""
    assert len(err.splitlines()) == 1 and err.startswith("error: "), err


def test_truncated_gguf_is_one_error_line(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """A download cut short: a valid GGUF header whose metadata ends early."""
    path = tmp_path / "cut.gguf"
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 5) + struct.pack("<Q", 1000) + b"gen")
    rc, out, err = cli(capsys, "generate", "--target", path, "--prompt", "hi")
    assert rc == 1 and out == "" and len(err.splitlines()) == 1 and err.startswith("error: ")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_device_cuda_without_a_gpu_is_refused(capsys: pytest.CaptureFixture[str], tiny_target_path: Path) -> None:
    rc, out, err = cli(capsys, "generate", "--target", tiny_target_path, "--prompt", "hi", "--device", "cuda")
    assert rc == 2 and out == "" and err.startswith("error: --device cuda") and len(err.splitlines()) == 1


def test_failed_load_in_a_real_process_prints_no_traceback(tmp_path: Path, tiny_target_path: Path,
                                                           model_cache: Path) -> None:
    started = time.perf_counter()
    proc = spawn(["generate", "--target", tiny_target_path, "--draft", _mismatched_draft(tmp_path, tiny_target_path),
                  "--prompt", "hi"], model_cache)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 1
    assert out == ""
    assert err.startswith("error: The draft") and len(err.splitlines()) == 1, err
    assert time.perf_counter() - started < 60


# ---- the rest of the command tree ------------------------------------------------------------
def test_help_documents_budget_auto(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = cli(capsys, "generate", "--help")
    assert rc == 0
    assert "planner" in out and f"{AUTO_BUDGET} without one" in " ".join(out.split())


def test_models_is_delegated_to_the_store(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
                                          tmp_path: Path) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    rc, out, _ = cli(capsys, "models", "list", "--json", "--models-dir", tmp_path / "models")
    assert rc == 0
    assert json.loads(out)["local"] == []


def test_ram_limit_puts_streamed_layers_on_disk_with_the_same_answer(
        capsys: pytest.CaptureFixture[str], tiny_target_path: Path) -> None:
    common = ["generate", "--target", tiny_target_path, "--raw-prompt", "Paris is", "--max-new-tokens", 12]
    rc, plain, _ = cli(capsys, *common)
    assert rc == 0
    rc, out, err = cli(capsys, *common, "--offload", "all", "--ram-limit", "0")
    assert rc == 0 and out == plain
    assert "streamed from disk" in stats_lines(err)[0], err
    rc, _, err = cli(capsys, *common, "--ram-limit", "-1")
    assert rc == 2 and "--ram-limit" in err


def test_version_names_the_pytorch_build(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = cli(capsys, "--version")
    assert rc == 0
    assert out.startswith(f"SpecChat {importlib.metadata.version('specchat')} · PyTorch {torch.__version__}")
    assert "build)" in out and "environment: " in out


def test_messages_decode_the_next_turn_of_a_whole_conversation(
        capsys: pytest.CaptureFixture[str], tmp_path: Path, tiny_target_path: Path) -> None:
    """--messages JSON (or @FILE) decodes the conversation's next assistant turn: the same as the
    equivalent --system/--prompt; the second sample reuses the prompt's KV (cached_tokens)."""
    common = ["generate", "--target", tiny_target_path, "--max-new-tokens", 6, "--json"]
    rc, out, _ = cli(capsys, *common, "--system", "Be brief.", "--prompt", "Paris is")
    assert rc == 0
    conversation = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Paris is"}]
    (tmp_path / "chat.json").write_text(json.dumps(conversation))
    rc, out2, _ = cli(capsys, *common, "--messages", f"@{tmp_path / 'chat.json'}", "--samples", 2)
    assert rc == 0
    first, second = json_lines(out2)
    assert first["token_ids"] == json_lines(out)[0]["token_ids"] == second["token_ids"]
    assert second["stats"]["cached_tokens"] == second["stats"]["prompt_tokens"] - 1
    for bad in ("[]", '[{"role": "robot", "content": "hi"}]', "{not json", f"@{tmp_path / 'missing.json'}"):
        rc, out, err = cli(capsys, *common, "--messages", bad)
        assert rc == 2 and out == "" and len(err.splitlines()) == 1 and err.startswith("error: "), err
