"""A GGUF whose folder also holds configs with an `auto_map` and the Python file they name
(issue 18, item 1): loading the GGUF must never run that file, and never ask whether to.

Checked against the code before the fix (gguf.isolated(), trust_remote_code=False, reverted by
hand): transformers read the tokenizer_config.json beside the file, asked on stdin whether to
run evil.py, took the "y" waiting there and ran it: the in-process test fails on the marker.
(The CLI test alone would not catch a revert: the CLI now loads in a worker thread, where
transformers cannot set its SIGALRM prompt timeout and refuses instead of asking.)"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import gguf as gguf_format
import pytest

from engine.errors import EngineError
from engine.loading.load import load_model

REPO = Path(__file__).resolve().parents[3]
PAYLOAD = """from pathlib import Path
Path({marker!r}).write_text("remote code ran")
from transformers import PreTrainedTokenizerFast as EvilTokenizer  # noqa: E402,F401
from transformers import LlamaConfig as EvilConfig  # noqa: E402,F401
from transformers import LlamaForCausalLM as EvilModel  # noqa: E402,F401
"""


def hostile_gguf_folder(root: Path, marker: Path) -> Path:
    """A folder with a GGUF (a tiny Llama's metadata, enough for transformers to build its
    config, no tensors), configs whose auto_map points at evil.py, and evil.py, which writes
    `marker` when imported."""
    folder = root / "hostile"
    folder.mkdir()
    gguf = folder / "model.gguf"
    writer = gguf_format.GGUFWriter(str(gguf), "llama")
    writer.add_context_length(64)
    writer.add_embedding_length(16)
    writer.add_block_count(1)
    writer.add_feed_forward_length(32)
    writer.add_head_count(2)
    writer.add_head_count_kv(2)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(8)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    (folder / "evil.py").write_text(PAYLOAD.format(marker=str(marker)))
    auto_map = {"AutoConfig": "evil.EvilConfig", "AutoModelForCausalLM": "evil.EvilModel",
                "AutoTokenizer": ["evil.EvilTokenizer", None]}
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "auto_map": auto_map}))
    (folder / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "EvilTokenizer",
                                                              "auto_map": auto_map}))
    return gguf


def test_code_beside_a_gguf_never_runs_even_when_the_user_would_say_yes(tmp_path: Path, model_cache: Path) -> None:
    marker = tmp_path / "marker"
    gguf = hostile_gguf_folder(tmp_path, marker)
    env = {**os.environ, "SPECCHAT_CACHE_DIR": str(model_cache), "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-m", "engine", "generate", "--target", str(gguf), "--prompt", "hi"],
                          cwd=REPO, env=env, input="y\ny\ny\n", capture_output=True, text=True, timeout=120)
    assert not marker.exists(), "code from the model folder ran"
    assert "trust_remote_code" not in done.stderr and "[y/N]" not in done.stdout  # nobody was asked
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr.startswith("error: ") and len(done.stderr.splitlines()) == 1, done.stderr
    assert "Traceback" not in done.stderr


def test_loading_in_process_never_runs_the_code_nor_asks(tmp_path: Path, model_cache: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """On the main thread, where transformers would ask (its prompt needs SIGALRM), with a "y"
    waiting on stdin."""
    marker = tmp_path / "marker"
    gguf = hostile_gguf_folder(tmp_path, marker)
    monkeypatch.setenv("SPECCHAT_CACHE_DIR", str(model_cache))
    monkeypatch.setattr(sys, "stdin", io.StringIO("y\ny\ny\n"))
    with pytest.raises(EngineError) as caught:
        load_model(gguf)
    assert not marker.exists(), "code from the model folder ran"
    assert sys.stdin.read() == "y\ny\ny\n"  # nobody read an answer
    assert "trust_remote_code" not in caught.value.user_message
