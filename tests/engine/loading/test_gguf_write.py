"""The GGUF writer behind the synthetic GGUF models: its encoders produce blocks gguf-py decodes
back to the input (within each type's precision), and tiny_gguf() writes a file transformers
reads as the random model it was built from."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import quants as gq

from engine.loading.gguf import isolated
from engine.testing.gguf_write import quantize
from engine.testing.synthetic import _random_model, tiny_gguf

# mean relative error of a Gaussian row: bits per weight decide it
PRECISION = {"Q2_K": 0.4, "Q3_K": 0.25, "Q4_K": 0.1, "Q5_K": 0.05, "Q6_K": 0.025, "IQ4_NL": 0.1, "IQ4_XS": 0.1}


@pytest.mark.parametrize("name", sorted(PRECISION))
def test_encoders_round_trip_through_gguf_py(name: str) -> None:
    x = (np.random.default_rng(0).standard_normal((8, 512)) * 0.1).astype(np.float32)
    blocks = quantize(x, Q[name])
    back = gq.dequantize(blocks, Q[name])  # the reference decoder
    assert back.shape == x.shape
    assert np.abs(back - x).mean() / np.abs(x).mean() < PRECISION[name]


def test_rows_must_be_whole_blocks() -> None:
    with pytest.raises(ValueError, match="Q4_K"):
        quantize(np.zeros((2, 64), np.float32), Q.Q4_K)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_tiny_gguf_is_the_model_transformers_reads(arch: str, model_cache: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = tiny_gguf(arch, layers=2, layer_types=("Q8_0", "Q4_K/Q6_K"), cache_dir=model_cache)
    assert [p.name for p in path.parent.iterdir()] == ["model.gguf"]  # alone in its folder
    assert tiny_gguf(arch, layers=2, layer_types=("Q8_0", "Q4_K/Q6_K"), cache_dir=model_cache) == path
    with isolated(path) as src:
        tok = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
        model = AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name, dtype=torch.float32)
    assert model.config.model_type == arch and model.config.num_hidden_layers == 2
    assert model.config.hidden_size == 256 and not model.config.tie_word_embeddings
    assert tok.decode(tok("Paris is the capital of")["input_ids"]) == "Paris is the capital of"
    assert "<|im_start|>assistant" in tok.apply_chat_template([{"role": "user", "content": "hi"}],
                                                              tokenize=False, add_generation_prompt=True)
    # the random model it came from: every tensor within its type's precision (Q8_0 layer 0
    # shows that llama's q/k row permutation round-trips)
    built = _random_model(arch, tok, 0, 0.0, len(tok), 2, 256, std=0.15 * (64 / 256) ** 0.5).state_dict()
    got = model.state_dict()
    assert set(got) == set(built)
    for name, value in got.items():
        tol = 0.01 if name.startswith("model.layers.0.") or "embed" in name else 0.1
        assert (value - built[name]).abs().max() <= tol * built[name].abs().max(), name


def test_unknown_types_are_refused(model_cache: Path) -> None:
    with pytest.raises(ValueError, match="Q9_9"):
        tiny_gguf(layer_types=("Q9_9",), cache_dir=model_cache)
