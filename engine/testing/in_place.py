"""Models built in place, for benchmarks and tests at real sizes: a transformers Llama of a
given shape on the meta device, its weights drawn at random where they will live, its decoder
layers packed into a host store and streamed (no checkpoint on disk, no full-precision copy of
a layer). synthetic.py builds the small models saved as folders and GGUF files."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedModel

from engine.loading.materialise import layer_template
from engine.model.causal_lm import CausalLM
from engine.offload.host_store import HostStore
from engine.offload.layout import LayerLayout, set_parameter
from engine.offload.streamer import LayerHome, LayerStreamer
from engine.planning.placement import RING_SLOTS
from engine.shapes import ModelShape, Placement

INIT_STD = 0.02  # Llama's initializer range


def llama_config(shape: ModelShape, tie_embeddings: bool = False) -> LlamaConfig:
    """A Llama config of `shape` (e.g. a catalog model's shape()). The rotary base and scaling
    stay at their defaults: they change no cost."""
    layer = shape.layer
    return LlamaConfig(vocab_size=shape.vocab_size, hidden_size=layer.hidden_size,
                       intermediate_size=layer.intermediate_size, num_hidden_layers=shape.num_layers,
                       num_attention_heads=layer.num_attention_heads, num_key_value_heads=layer.num_kv_heads,
                       head_dim=layer.head_dim, max_position_embeddings=131072, rms_norm_eps=1e-5,
                       tie_word_embeddings=tie_embeddings, bos_token_id=0, eos_token_id=1)


def meta_model(config: LlamaConfig, dtype: torch.dtype) -> PreTrainedModel:
    """The transformers model on the meta device (no memory), as the loader builds it."""
    with torch.device("meta"):
        # transformers wraps PreTrainedModel.to with functools.wraps, whose stub drops the bound self
        return LlamaForCausalLM(config).to(dtype)  # type: ignore[arg-type]


@torch.no_grad()
def _fill_random(p: torch.Tensor, g: torch.Generator) -> None:
    if p.ndim >= 2:
        p.normal_(0.0, INIT_STD, generator=g)
    else:  # norm weights
        p.fill_(1.0)


def _rotary_on(hf: PreTrainedModel, device: torch.device) -> None:
    with torch.device(device):  # rotary tables are computed, not stored
        hf.model.rotary_emb = type(hf.model.rotary_emb)(config=hf.config)


def random_model(config: LlamaConfig, device: torch.device | str, dtype: torch.dtype, seed: int = 0) -> CausalLM:
    """A resident model with random weights, allocated on `device` in `dtype` and filled there."""
    dev = torch.device(device)
    hf = meta_model(config, dtype).to_empty(device=dev)
    if config.tie_word_embeddings:
        hf.lm_head.weight = hf.model.embed_tokens.weight
    g = torch.Generator(device=dev).manual_seed(seed)
    for p in hf.parameters():
        p.requires_grad_(False)
        _fill_random(p, g)
    _rotary_on(hf, dev)
    return CausalLM(hf)


def random_outer(hf: PreTrainedModel, device: torch.device | str, seed: int = 0) -> None:
    """Give a meta model its embeddings, final norm and head, random on `device` (its decoder
    layers stay on the meta device, for the streamer to run)."""
    dev = torch.device(device)
    g = torch.Generator(device=dev).manual_seed(seed)
    for name, p in list(hf.named_parameters()):
        if name.startswith("model.layers."):
            continue
        value = torch.empty(p.shape, dtype=p.dtype, device=dev)
        _fill_random(value, g)
        set_parameter(hf, name, value)
    if hf.config.tie_word_embeddings:
        hf.lm_head.weight = hf.model.embed_tokens.weight
    _rotary_on(hf, dev)


@torch.no_grad()
def random_packed_store(layout: LayerLayout, layers: int, pin: bool, device: torch.device | str,
                        seed: int = 0) -> HostStore:
    """A host store (pinned when `pin`) holding `layers` packed layers with random contents:
    NF4 codes uniform over the 16 levels, block scales in [0.01, 0.03], other weights as in
    `random_model`. Each layer is filled in one scratch buffer on `device` (fast on a GPU) and
    copied into its arena: no layer ever exists in full precision."""
    dev = torch.device(device)
    store = HostStore([layout.nbytes] * layers, ram_layers=layers, pin=pin)
    g = torch.Generator(device=dev).manual_seed(seed)
    scratch = torch.empty(layout.nbytes, dtype=torch.uint8, device=dev)
    for j in range(layers):
        scratch.random_(0, 256, generator=g)
        for e in layout.entries:
            view = layout.view(scratch, e)
            if e.kind == "absmax":
                view.uniform_(0.01, 0.03, generator=g)
            elif e.kind == "dense":
                _fill_random(view, g)
        store.ram_buffer(j).copy_(scratch)
    store.seal()
    return store


def streamed_target(hf: PreTrainedModel, layout: LayerLayout, store: HostStore, placement: Placement,
                    device: torch.device | str) -> CausalLM:
    """A CausalLM over packed layers in `store` (store index = layer index): the
    `placement.gpu_layers` that Placement.tiers puts on the device copied there and run from
    there, the rest streamed through the ring, as the loader would set it up. Close its streamer with `close_store=False` to
    place the same store again."""
    assert layout.quant == "nf4", "resident layers are kept packed, which only NF4 layers run from"
    dev = torch.device(device)
    homes = []
    for i, tier in enumerate(placement.tiers()):
        if tier == "device":
            homes.append(LayerHome(packed=store.ram_buffer(i).to(dev)))
        else:
            homes.append(LayerHome(store_index=i))
    streamer = LayerStreamer(homes, layout, store, layer_template(hf), dev, RING_SLOTS)
    return CausalLM(hf, streamer=streamer, placement=placement)
