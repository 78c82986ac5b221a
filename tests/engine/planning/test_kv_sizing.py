"""The caches' size by layer kind (ModelShape.kv_bytes, engine.planning.kv_sizing) against real
caches of tiny models built from transformers' own config classes, and what it changes for the
planner: a long context on a sliding-window model is priced at its windows, not as if every
layer kept every token.

References are independent of the sizing code: the bytes a real cache allocated after a long
prompt read one token a pass (full-attention, shared and linear layers), and for windowed layers
each attention module's own head count, width and window, with the entries the real cache
holds (engine.model.window_cache) at or under the priced bound."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, Gemma3TextConfig

from engine.decoding.memory import generation_bytes
from engine.errors import UnsupportedModel
from engine.loading.load import load_model
from engine.model.cache import KVCache
from engine.model.causal_lm import CausalLM
from engine.model import window_cache
from engine.model.hybrid_cache import SNAPSHOTS, HybridCache
from engine.model.window_cache import WindowedCache, _slack
from engine.planning.kv_sizing import cache_layers_of
from engine.planning.planner import estimate_placement
from engine.planning.reference import reference_profile
from engine.shapes import STATE_COPIES, WINDOW_SLACK_MIN, ModelShape
from engine.testing.synthetic import TINY_WINDOW, tiny_model

ARCHS = ["llama", "gemma3_text", "gemma4_text", "qwen3_5_text", "gpt_oss"]
PROMPT = 5 * TINY_WINDOW + 3  # far past every window


@pytest.fixture(scope="module", params=ARCHS)
def model(request: pytest.FixtureRequest, model_cache: Path) -> CausalLM:
    return load_model(tiny_model(request.param, seed=0, layers=4, cache_dir=model_cache)).model


def module_kv(model: CausalLM, i: int) -> tuple[int, int, int | None] | None:
    """Layer i's (kv heads, head dim, window) as its transformers attention module has them;
    head dim 0 for a layer reusing another's K/V; None for a linear layer."""
    attn = getattr(model.layers[i], "self_attn", None)
    if attn is None:
        return None
    heads = model.config.num_attention_heads // attn.num_key_value_groups
    width = 0 if getattr(attn, "is_kv_shared_layer", False) else attn.head_dim
    return heads, width, getattr(attn, "sliding_window", None)


def prompt_cache(model: CausalLM, n: int = PROMPT) -> KVCache:
    """n tokens read one a pass, as plain decoding reads them (windowed layers drop as they go)."""
    cache = model.new_cache(n)  # capacity n: n tokens fill it exactly
    for i in range(n):
        model.forward(torch.tensor([i % 50 + 3]), torch.tensor([i]), cache, None)
    return cache


def test_each_layer_is_sized_as_its_cache_holds_it(model: CausalLM) -> None:
    esize = model.dtype.itemsize
    shape = model.shape
    assert len(shape.caches) == shape.num_layers
    cache = prompt_cache(model)
    got = shape.kv_layer_bytes(PROMPT, 0, esize, state_copies=1)
    kinds_seen = set()
    for i, (k, v) in enumerate(zip(cache.keys, cache.values)):
        own = module_kv(model, i)
        if own is None:  # Gated DeltaNet: no K/V, one fixed state
            assert isinstance(cache, HybridCache)
            assert k.numel() == v.numel() == 0
            assert got[i] == cache.states[i].nbytes()
            kinds_seen.add("linear")
            continue
        heads, width, window = own
        if window is not None:
            assert window == TINY_WINDOW < PROMPT and isinstance(cache, WindowedCache)
            most = TINY_WINDOW - 1 + _slack(TINY_WINDOW)
            assert got[i] == 2 * heads * width * esize * most
            held = cache.length - cache.held_from(window)
            assert 0 < held <= most
            kinds_seen.add("sliding")
        else:
            assert got[i] == k.numel() * k.element_size() + v.numel() * v.element_size()
            assert got[i] == 2 * heads * width * esize * PROMPT
            kinds_seen.add("full" if width else "shared")
    assert "full" in kinds_seen
    arch = model.config.model_type
    assert kinds_seen >= {"gemma3_text": {"sliding"}, "gpt_oss": {"sliding"}, "gemma4_text": {"sliding", "shared"},
                          "qwen3_5_text": {"linear"}}.get(arch, set())


def test_gemma4_full_layers_are_wider_and_reused_layers_keep_nothing(model_cache: Path) -> None:
    model = load_model(tiny_model("gemma4_text", seed=0, layers=4, cache_dir=model_cache)).model
    layers = [(c.kv_heads, c.head_dim, c.window) for c in model.shape.caches]
    # windowed 2 x 16, full 1 x 32 (keys as values), the last two reuse the K/V of those
    assert layers == [(2, 16, TINY_WINDOW), (1, 32, None), (2, 0, TINY_WINDOW), (1, 0, None)]
    # the config.json as transformers writes it gives the same
    assert cache_layers_of(model.config.to_dict()) == model.shape.caches


def test_linear_states_count_their_snapshots_and_pending_tree(model_cache: Path) -> None:
    model = load_model(tiny_model("qwen3_5_text", seed=0, layers=4, cache_dir=model_cache)).model
    assert STATE_COPIES == 1 + SNAPSHOTS == 1 + window_cache.SNAPSHOTS
    assert WINDOW_SLACK_MIN == window_cache.SLACK_MIN
    esize = model.dtype.itemsize
    cache = prompt_cache(model)
    assert isinstance(cache, HybridCache)
    cache.mark(PROMPT)  # the prompt's end: a snapshot of every linear state
    assert cache.nbytes() == model.shape.kv_bytes(PROMPT, 0, esize, state_copies=2)
    # a tree of 3 pending tokens (two siblings and a child): each linear layer keeps their inputs
    tree = 3
    allowed = torch.zeros(tree, PROMPT + tree, dtype=torch.bool)
    allowed[:, :PROMPT] = True
    allowed[0, PROMPT] = allowed[1, PROMPT + 1] = True
    allowed[2, [PROMPT, PROMPT + 2]] = True
    model.forward(torch.tensor([5, 6, 7]), torch.tensor([PROMPT, PROMPT, PROMPT + 1]), cache, allowed)
    pending = sum(t.numel() * t.element_size() for p in cache.prior.values() if p is not None
                  for t in (p.x, p.k, p.v, p.beta, p.g))
    linear = [c for c in model.shape.caches if c.state_elements]
    no_tree = sum(c.nbytes(PROMPT, 0, esize) for c in linear)
    assert pending == sum(c.nbytes(PROMPT, tree, esize) for c in linear) - no_tree > 0


def test_the_sum_grows_only_with_the_full_layers_past_the_windows(model: CausalLM) -> None:
    shape, esize = model.shape, model.dtype.itemsize
    full = sum(2 * c.kv_heads * c.head_dim * esize for c in shape.caches if c.window is None)
    grow = shape.kv_bytes(10 * PROMPT + 1, 4, esize) - shape.kv_bytes(10 * PROMPT, 4, esize)
    assert grow == full
    # a tree adds one entry to every layer that keeps K/V, windowed or not
    assert shape.kv_bytes(PROMPT, 5, esize, 1) - shape.kv_bytes(PROMPT, 4, esize, 1) >= \
        sum(2 * c.kv_heads * c.head_dim * esize for c in shape.caches)


def gemma3_27b() -> ModelShape:
    """Gemma-3-27B's published text config (62 layers, 5 windowed of 1024 to 1 full)."""
    config = Gemma3TextConfig(hidden_size=5376, intermediate_size=21504, num_hidden_layers=62,
                              num_attention_heads=32, num_key_value_heads=16, head_dim=128, sliding_window=1024,
                              vocab_size=262208, query_pre_attn_scalar=168)
    return ModelShape.from_config(config, "gemma-3-27b")


def test_a_128k_context_on_gemma3_27b_is_priced_at_its_windows() -> None:
    shape = gemma3_27b()
    windows = [c.window for c in shape.caches]
    assert windows.count(None) == 10 and windows.count(1024) == 52
    context, tree, bf16 = 131072, 512, 2
    every_token = shape.kv_bytes_per_token(bf16) * (context + tree)  # every layer keeps every token
    priced = shape.kv_bytes(context, tree, bf16)
    per_token = 2 * 16 * 128 * bf16
    # a windowed layer: up to 1023 + 256 dead entries gathered, the tree, the windows of 2 turn ends
    assert priced == per_token * (10 * (context + tree) + 52 * (1023 + 256 + tree + 2 * 1023))
    assert priced < every_token / 4  # 12.4 GB against 67 GB
    # on a 48 GB GPU the NF4 layers (14 GB) fit beside 12.4 GB of caches, not beside 67 GB
    profile = reference_profile("l40")
    uniform = ModelShape(shape.name, shape.num_layers, shape.layer, shape.vocab_size)
    by_kind = estimate_placement(profile, shape, "nf4", context_length=context)
    flat = estimate_placement(profile, uniform, "nf4", context_length=context)
    assert (flat.gpu_layers, by_kind.gpu_layers) == (0, shape.num_layers)
    # a request's memory check prices the same caches: they are all it saves against the flat figure
    prompt, answer = 120_000, 1000
    saved = generation_bytes(uniform, None, bf16, prompt, answer, tree) - generation_bytes(shape, None, bf16, prompt,
                                                                                          answer, tree)
    context = prompt + answer + 8
    assert saved == uniform.kv_bytes(context, tree, bf16) - shape.kv_bytes(context, tree, bf16) > 40 * 10**9


def test_a_hybrid_keeps_k_v_in_its_attention_layers_only() -> None:
    config = AutoConfig.for_model("qwen3_5_text", num_hidden_layers=64, hidden_size=5120, num_attention_heads=24,
                                  num_key_value_heads=4, head_dim=256, linear_num_value_heads=48,
                                  linear_num_key_heads=16, linear_key_head_dim=128, linear_value_head_dim=128)
    shape = ModelShape.from_config(config, "qwen3.6-27b-shaped")
    assert sum(c.window is None and c.head_dim > 0 for c in shape.caches) == 16
    state = 48 * 128 * 128 * 4 + (2 * 16 * 128 + 48 * 128) * 3 * 2  # recurrent fp32 + conv bf16, one layer
    assert shape.kv_bytes(0, 0, 2) == 48 * STATE_COPIES * state
    assert shape.kv_bytes(1000, 0, 2) - shape.kv_bytes(0, 0, 2) == 16 * 2 * 4 * 256 * 2 * 1000


def test_a_hybrid_config_without_its_state_shape_is_refused_by_name() -> None:
    config = AutoConfig.for_model("qwen3_5_text", num_hidden_layers=4).to_dict()
    del config["linear_value_head_dim"]
    with pytest.raises(UnsupportedModel, match="linear_value_head_dim"):
        ModelShape.from_config(config, "broken-qwen")
