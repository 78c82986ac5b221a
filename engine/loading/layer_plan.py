"""Where and how a model's decoder layers will live, decided before any weight is read: the
device memory free (under any allocator cap), the RAM the host store may use, and which form
a packed model's resident layers take on a CPU (packed-kernel weights or de-quantised at load)
or on a GPU whose MoE experts stay on the CPU, and how many of those experts the VRAM left
over caches (cache_experts).

What this module does not do: read weights or build modules (materialise.py), or the placement
arithmetic itself (engine.planning.placement).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import psutil
import torch
from torch import nn

from engine.errors import OutOfMemory, UnsupportedModel
from engine.kernels.expert_cache import CacheState, CountsFile, fill, packed_experts
from engine.loading import cpu_packed
from engine.offload.layout import LayerLayout
from engine.planning.placement import MemoryNeeds, activation_bytes, kv_bytes_per_token, plan_placement
from engine.shapes import ModelShape, Packing, Placement
from engine.types import Experts, Offload, Quant
from engine.units import GIB

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from engine.model.causal_lm import CausalLM

log = logging.getLogger(__name__)

MAX_TREE_BUDGET = 1024  # the largest budget the placement reserves activations for
DEFAULT_CONTEXT = 8192


@dataclass(frozen=True)
class MaterialiseSettings:
    device: str = "cpu"
    dtype: torch.dtype = torch.float32
    quant: Quant = "none"
    offload: Offload = "none"
    ram_limit_bytes: int | None = None
    context_length: int | None = None
    reserve_bytes: int = 0  # device memory to leave for something loaded later (the draft)
    max_budget: int = MAX_TREE_BUDGET
    experts: Experts = "auto"  # an MoE GGUF on a GPU: where its routed experts run (experts_on_cpu)
    # with the routed experts on the CPU beside a GPU: VRAM for a cache of the most used experts
    # (engine.kernels.expert_cache): None = what the placement leaves spare, 0 = none
    expert_cache: int | None = None


def host_budget(ram_limit_bytes: int | None) -> int:
    """RAM the host store may use: the setting, else what is available less a margin for the
    OS and the app (2 GiB or 10 % of RAM, whichever is larger)."""
    if ram_limit_bytes is not None:
        return ram_limit_bytes
    vm = psutil.virtual_memory()
    return max(0, vm.available - max(2 * GIB, vm.total // 10))


def unpack_at_load(layouts: list[LayerLayout], settings: MaterialiseSettings, layers: list[nn.Module]) -> int | None:
    """The RAM packed layers (GGUF blocks, AWQ, GPTQ) take made resident at load on a CPU, or
    None when they stay packed and are de-quantised as each pass runs them.

    On a CPU the device memory is the RAM the packed layers already sit in: nothing crosses a
    link, so de-quantising every layer on every pass buys nothing and costs most of the pass
    (the starter's Q4_1 GGUF decoded 4x slower than its fp32 folder on 2 cores). So at load,
    a GGUF's Linear weights in linear block types become packed-kernel weights (cpu_packed.py,
    half a byte or a byte per weight) and everything else is de-quantised once, with the same
    code the streamer runs; without a kernel (or for AWQ/GPTQ) everything is de-quantised.
    PyTorch's own weight-only int4/int8 CPU kernels are no alternative on an AVX2 CPU: 6-15x
    slower than an fp32 product at the starter's and a 1B model's shapes (2026-11-24).
    A model whose resident layers would not fit the RAM budget stays packed, as does NF4 asked
    for with --quant (the user chose the smaller footprint)."""
    if settings.device != "cpu" or settings.offload == "all" or layouts[0].quant not in ("gguf", "awq", "gptq"):
        return None
    if kernel_layers(layouts[0].quant):
        need = sum(cpu_packed.kernel_bytes(layout, layer) for layout, layer in zip(layouts, layers, strict=True))
    else:
        need = sum(layout.dense_nbytes for layout in layouts)
    return need if need <= host_budget(settings.ram_limit_bytes) else None


def experts_on_cpu(hf: PreTrainedModel, layouts: list[LayerLayout], settings: MaterialiseSettings) -> bool:
    """Whether an MoE GGUF on a GPU keeps its routed experts packed in RAM, run by the CPU kernel,
    with everything else resident on the GPU (de-quantised at load): `--experts cpu` (or `stream`:
    then every pass's experts go to the GPU, stream_experts), or "auto"
    when its packed layers with the KV cache and a tree's activations would not all fit the free
    GPU memory (streaming whole MoE layers would move every expert over the link each pass for
    the few a token uses). Needs a GGUF, the kernel, and experts it runs in every MoE layer."""
    if (not settings.device.startswith("cuda") or settings.experts == "gpu" or settings.offload == "all"
            or layouts[0].quant != "gguf" or not cpu_packed.kernels_on()):
        return False
    layers = list(hf.model.layers)
    moe = [(layer, layout) for layer, layout in zip(layers, layouts, strict=True)
           if any(len(e.shape) == 3 and not e.side for e in layout.entries)]
    packable = [cpu_packed.packs_experts(layer, layout) for layer, layout in moe]
    if settings.experts in ("cpu", "stream"):  # the layers whose experts the kernel cannot run keep theirs on the GPU
        if not all(packable):
            log.info("--experts cpu: %d of %d MoE layers have experts in types the CPU kernel does not run; "
                     "theirs stay on the GPU", packable.count(False), len(packable))
        return any(packable)
    if not moe or not all(packable):
        return False
    try:
        plan_layers(hf, layouts, replace(settings, offload="none"), "gguf")
    except OutOfMemory:
        return True
    return False


def kernel_layers(packing: Packing) -> bool:
    return packing == "gguf" and cpu_packed.kernels_on()


def device_free_bytes(device: torch.device | str) -> int:
    """Device memory a placement may still use: what the driver reports free, and no more than
    the caching allocator may still take under a per-process cap
    (`torch.cuda.set_per_process_memory_fraction`, which mem_get_info does not see). Blocks the
    allocator holds in its cache count as used in both figures."""
    dev = torch.device(device)
    index = dev.index if dev.index is not None else torch.cuda.current_device()  # the fraction API wants one
    free, total = torch.cuda.mem_get_info(index)
    fraction = getattr(torch.cuda, "get_per_process_memory_fraction", None)  # torch >= 2.9
    if fraction is None:
        return int(free)
    limit = int(total * fraction(index))
    return int(max(0, min(free, limit - torch.cuda.memory_reserved(index))))


def device_needs(hf: PreTrainedModel, settings: MaterialiseSettings) -> MemoryNeeds:
    """What a placement leaves free on the device beside the layers: the KV cache for the
    context and the activations of the largest tree (and `reserve_bytes`)."""
    cfg = hf.config
    num_layers = cfg.num_hidden_layers
    esize = torch.empty((), dtype=settings.dtype).element_size()
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    context = context_of(hf, settings)
    kv_per_token = kv_bytes_per_token(num_layers, cfg.num_key_value_heads, head_dim, esize)
    try:  # each layer's cache by its kind (windows, linear states, shared K/V: engine.shapes)
        shape = ModelShape.from_config(cfg)
        kv, width = shape.kv_bytes(context, settings.max_budget, esize), shape.activation_width
    except (UnsupportedModel, TypeError, ValueError):  # a config the table does not describe: every layer full
        kv, width = kv_per_token * context, int(getattr(cfg, "intermediate_size", 0) or 4 * cfg.hidden_size)
    return MemoryNeeds(
        fixed=settings.reserve_bytes,  # the outer weights are already on the device
        kv_per_token=kv_per_token,
        kv_bytes=kv,
        activations=activation_bytes(settings.max_budget, context, cfg.hidden_size, width,
                                     cfg.num_attention_heads, cfg.vocab_size, esize),
    )


def context_of(hf: PreTrainedModel, settings: MaterialiseSettings) -> int:
    return settings.context_length or min(int(getattr(hf.config, "max_position_embeddings", DEFAULT_CONTEXT)),
                                          DEFAULT_CONTEXT)


def spare_device_bytes(hf: PreTrainedModel, settings: MaterialiseSettings) -> int:
    """Device memory still free once everything placed on it is there, less what a pass needs
    (device_needs at the context) and a margin (10 % of it, at least 512 MiB) for the allocator's
    blocks, the draft's passes and a long prompt's experts streamed to the GPU: what a cache of
    experts may take."""
    free = device_free_bytes(settings.device)
    needs = device_needs(hf, settings)
    return max(0, free - needs.kv_at(context_of(hf, settings)) - needs.activations - settings.reserve_bytes
               - max(512 * 1024 * 1024, free // 10))


def plan_layers(hf: PreTrainedModel, layouts: LayerLayout | list[LayerLayout], settings: MaterialiseSettings,
                quant: Packing) -> Placement:
    """Where `hf`'s decoder layers go: the device memory free now (under any allocator cap),
    less the KV cache for the context and the activations of the largest tree. One layout
    stands for every layer."""
    if isinstance(layouts, LayerLayout):
        layouts = [layouts] * hf.config.num_hidden_layers
    cfg = hf.config
    device = settings.device
    num_layers = cfg.num_hidden_layers
    layer_bytes = max(layout.nbytes for layout in layouts)
    context = context_of(hf, settings)
    needs = device_needs(hf, settings)
    device_free = device_free_bytes(device) if device.startswith("cuda") else 0
    placement = plan_placement(
        num_layers=num_layers, layer_bytes=layer_bytes, dense_layer_bytes=layouts[0].dense_nbytes, quant=quant,
        offload=settings.offload, device=device, device_free=device_free, needs=needs, context_length=context,
        host_free=host_budget(settings.ram_limit_bytes))
    if device.startswith("cuda") and settings.offload == "none":
        need = sum(layout.nbytes for layout in layouts) + needs.kv_at(context) + needs.activations + settings.reserve_bytes
        if need > device_free:
            raise OutOfMemory(f"The model's layers need about {need / GIB:.1f} GiB of GPU memory with its KV "
                              f"cache but {device_free / GIB:.1f} GiB is free. Use --offload auto (stream "
                              "layers from RAM) or --quant nf4.")
    return placement


def cache_experts(model: CausalLM, settings: MaterialiseSettings) -> CacheState | None:
    """With the routed experts on the CPU beside a GPU (placement "experts-cpu"), fill the VRAM
    left spare (spare_device_bytes; at most settings.expert_cache) with the experts the saved
    routing counts of this model use most (engine.kernels.expert_cache), evenly spread without
    them; the placement then says what share is cached. Called once both models are loaded, so
    the draft's memory is already taken. None where there is nothing to cache."""
    placement = model.placement
    if (placement is None or placement.resident_form != "experts-cpu" or not settings.device.startswith("cuda")
            or settings.expert_cache == 0):
        return None
    hf = model.hf_model
    modules = packed_experts(hf)
    if not modules:
        return None
    budget = spare_device_bytes(hf, settings)
    if settings.expert_cache is not None:
        budget = min(budget, settings.expert_cache)
    counts_file = CountsFile.of(model.fingerprint)
    counts = counts_file.load(len(modules), modules[0].num_experts) if counts_file is not None else None
    try:
        state = fill(hf, budget, settings.device, settings.dtype, counts)
    except torch.OutOfMemoryError:  # the estimate of what was free was wrong: no cache, nothing lost
        for m in modules:
            m.uncache()
        torch.cuda.empty_cache()
        log.warning("expert cache: out of GPU memory filling %.2f GiB; every expert runs on the CPU", budget / GIB)
        return None
    model.placement = replace(placement, cached_experts=state.fraction)
    log.info("expert cache: %d of %d routed experts in VRAM (%.2f GiB, %s)", state.cached, state.experts,
             state.nbytes / GIB, "chosen by the saved routing counts" if counts is not None else "spread evenly")
    return state


STREAM_FROM_TOKENS = 256  # without a hardware profile: the projection's machines pay from 215-286 tokens


def stream_experts(model: CausalLM, settings: MaterialiseSettings, from_tokens: int | None) -> int:
    """With the routed experts on the CPU beside a GPU, passes of `from_tokens` tokens or more (a
    long prompt's chunks: engine.planning.planner.stream_pays_from) run their experts on the GPU,
    de-quantised there from the packed bytes, rather than on the CPU (PackedExperts.stream).
    Returns the layers that stream (0: none, or `from_tokens` None)."""
    placement = model.placement
    if (from_tokens is None or placement is None or placement.resident_form != "experts-cpu"
            or not settings.device.startswith("cuda")):
        return 0
    modules = packed_experts(model.hf_model)
    for m in modules:
        m.stream(settings.device, settings.dtype, from_tokens)
    if modules:
        log.info("experts of passes of %d tokens or more run on the GPU (streamed from RAM)", from_tokens)
        if from_tokens <= 1:
            model.placement = replace(placement, experts_streamed=True)
    return len(modules)
