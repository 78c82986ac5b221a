"""Gemma 4 in the engine beyond greedy equality (test_families.py): layers whose K/V differ in
shape (wide full-attention heads) or that keep none (reuse of an earlier layer's K/V) in one
cache that equals a fresh read after every pruning and survives saving; streamed templates
that serve several layers of one parameter layout but different roles (store or not, windowed
or not); and the multimodal wrapper read as its text model."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from cache_checks import (
    assert_a_chat_continues_from_its_saved_cache,
    assert_same_entries,
    check_every_keep,
    decode_in_both_modes,
)
from test_families import PROMPT
from transformers import AutoModelForImageTextToText, AutoTokenizer, Gemma4Config

from engine.decoding.generation import Engine
from engine.loading.load import load_model
from engine.model.cache import KVCache
from engine.model.cache_files import _rebuild, shape_of
from engine.model.causal_lm import CausalLM
from engine.model.window_cache import WindowedCache
from engine.testing.synthetic import TINY_FAMILIES, tiny_model, tiny_tokenizer_files
from engine.types import Completion, GenerationRequest, SpeculationSettings


def paths(cache: Path, arch: str = "gemma4_text", layers: int = 4) -> tuple[Path, Path]:
    return (tiny_model(arch, seed=0, layers=layers, cache_dir=cache),
            tiny_model(arch, seed=0, noise=0.05, layers=layers, cache_dir=cache))


def test_layers_keep_k_v_of_their_own_shape(model_cache: Path) -> None:
    model = load_model(paths(model_cache)[0]).model
    # windowed: 2 heads of 16; full: 1 head of 32 (keys as values); the last two reuse theirs
    assert model.kv_shapes == [(2, 16), (1, 32), (2, 0), (1, 0)]
    cache = model.new_cache(4)
    model.forward(torch.arange(10), torch.arange(10), cache, None)
    assert [tuple(k.shape) for k, _ in cache.tensors()] == [(1, 2, 10, 16), (1, 1, 10, 32), (1, 2, 10, 0),
                                                            (1, 1, 10, 0)]
    copy = cache.copy_prefix(7, spare=3).to("cpu")
    assert copy.layer_shapes == cache.layer_shapes and copy.length == 7
    rebuilt = KVCache.from_tensors(cache.tensors(), "cpu")
    assert rebuilt.layer_shapes == cache.layer_shapes
    assert all(torch.equal(a, b) for (a, _), (b, _) in zip(rebuilt.tensors(), cache.tensors()))
    # a saved file is checked against each layer's shape; a uniform model's files as before
    saved = {f"target.{i}.{n}": t for i, (k, v) in enumerate(cache.tensors()) for n, t in (("k", k), ("v", v))}
    saved |= {f"target.{name}": t for name, t in cache.state_tensors().items()}  # where each window starts
    assert _rebuild(saved, "target", shape_of(cache), 10, torch.device("cpu")) is not None
    uniform = replace(shape_of(cache), layers=())
    assert _rebuild(saved, "target", uniform, 10, torch.device("cpu")) is None
    plain = KVCache(2, 2, 8, torch.float32, "cpu", 4, [(2, 8), (2, 8)])
    assert plain.layer_shapes is None and shape_of(plain).layers == ()


@pytest.mark.parametrize("mode", ["draft", "draft-free"])
def test_caches_equal_a_fresh_read_after_every_step(mode: str, model_cache: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Every keep() is checked against a new cache that read the kept tokens in one chain."""
    def compare(cache: KVCache, fresh: KVCache) -> None:
        assert cache.layer_shapes == fresh.layer_shapes is not None
        assert_same_entries(cache, fresh, atol=1e-5)

    checked = check_every_keep(monkeypatch, WindowedCache, compare)
    final = decode_in_both_modes(mode, *paths(model_cache), monkeypatch)
    assert final.stats.tokens_per_pass > 1.3
    assert checked["keeps"] >= 5, checked


@pytest.mark.parametrize("arch", ["gemma4_text", "gemma4_text+moe"])
def test_templates_shared_by_layers_of_different_roles_stream_as_they_run_resident(arch: str,
                                                                                   model_cache: Path) -> None:
    """Six layers: windowed layers 0 and 2 share a parameter layout, but layer 2 stores its K/V
    for layer 4 to reuse (so do full layers 1 and 3 for 5); one template serves both."""
    path = tiny_model(arch, seed=0, layers=6, cache_dir=model_cache)
    resident, streamed = load_model(path), load_model(path, offload="all")
    s = streamed.model.streamer
    assert s is not None and s._kind[0] == s._kind[2] and s._kind[1] == s._kind[3]
    ids = torch.tensor(resident.tokenizer(PROMPT)["input_ids"])

    def logits(model: CausalLM) -> torch.Tensor:
        cache = model.new_cache(len(ids))
        return model.logits(model.forward(ids, torch.arange(len(ids)), cache, None))

    assert torch.equal(logits(resident.model), logits(streamed.model))


def test_a_gemma4_chat_continues_from_its_saved_cache(model_cache: Path, tmp_path: Path) -> None:
    """Turn 1's cache saved to disk (no RAM budget); after a restart, turn 2 reads it back (each
    layer's K/V shape checked) and gives a fresh engine's text."""
    assert_a_chat_continues_from_its_saved_cache(*paths(model_cache), tmp_path / "kv")


def test_a_gemma4_wrapper_runs_its_text_model_as_transformers_does(tmp_path: Path) -> None:
    """A `gemma4` image-text wrapper (vision tower included), saved by transformers, loads as
    its `gemma4_text` model and decodes what the wrapper decodes in transformers."""
    folder = tmp_path / "gemma4"
    tiny_tokenizer_files(folder)
    tok = AutoTokenizer.from_pretrained(folder)
    vocab = len(tok) + 8
    text = dict(TINY_FAMILIES["gemma4_text"], hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048, vocab_size=vocab,
                vocab_size_per_layer_input=vocab, layer_types=["sliding_attention", "full_attention"] * 2,
                bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                  num_key_value_heads=2, head_dim=16, patch_size=4, position_embedding_size=64)
    config = Gemma4Config(text_config=text, vision_config=vision, audio_config=None, tie_word_embeddings=True,
                          image_token_id=vocab - 1, boi_token_id=vocab - 2, eoi_token_id=vocab - 3,
                          video_token_id=vocab - 4, boa_token_id=vocab - 5, eoa_token_id=vocab - 6,
                          audio_token_id=vocab - 7)
    torch.manual_seed(0)
    wrapper = AutoModelForImageTextToText.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for p in wrapper.parameters():
            if p.ndim >= 2:
                p.normal_(0.0, 0.02 if p.shape[0] == vocab else 0.15)
    wrapper.save_pretrained(folder)
    loaded = load_model(folder)
    assert loaded.model.config.model_type == "gemma4_text"
    engine = Engine(loaded.model, loaded.tokenizer)
    req = GenerationRequest(raw_prompt=PROMPT, max_new_tokens=16, speculation=SpeculationSettings(mode="autoregressive"))
    final = list(engine.generate(req))[-1]
    assert isinstance(final, Completion)
    ids = torch.tensor([engine.encode(req)])
    want = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32).eval().generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False, pad_token_id=tok.pad_token_id)
    want_ids = want[0, ids.shape[1]:].tolist()
    assert len(set(want_ids)) > 3, "the reference should say something"
    assert list(final.token_ids) == want_ids[: len(final.token_ids)]


@pytest.mark.parametrize("arch", ["gemma4_text", "gemma4_text+moe"])
def test_nf4_layers_stream_as_they_run_resident(arch: str, model_cache: Path) -> None:
    """NF4 packs every layer's Linear weights and experts (the per-layer input gate and
    projection too); streamed NF4 layers give the resident ones' logits exactly."""
    path = tiny_model(arch, seed=0, layers=6, cache_dir=model_cache)
    dense, resident, streamed = load_model(path), load_model(path, quant="nf4"), load_model(path, quant="nf4",
                                                                                          offload="all")
    ids = torch.tensor(dense.tokenizer(PROMPT)["input_ids"])

    def logits(model: CausalLM) -> torch.Tensor:
        cache = model.new_cache(len(ids))
        return model.logits(model.forward(ids, torch.arange(len(ids)), cache, None))

    got = logits(resident.model)
    assert torch.equal(got, logits(streamed.model))
    want = logits(dense.model)
    assert not torch.equal(got, want), "NF4 should change the weights"
