"""Build a model from a safetensors folder without a full-precision copy in RAM.

The transformers model is constructed on the meta device (no memory). Then, tensor by tensor
from the memory-mapped shards (checkpoint.py): the embeddings, final norm and head go to the
device; each decoder layer goes to its home in the placement (planning.placement):
a resident transformers module on the device, a packed NF4 buffer on the device, a buffer in
the host store's RAM arenas, or the host store's disk file (packed into one reused scratch
buffer, then written). NF4 is quantised on the way (bitsandbytes, blocksize 64), on the GPU
when there is one; bitsandbytes 4-bit checkpoints are stored as they are. NF4 layers are also
written to a prepared-layer cache (prepared.py) that the next start reads instead.

Peak RAM is therefore the final host footprint plus about one layer (the scratch buffer and
the tensor being converted). What this module does not do: tokenizers, GGUF (load.py, gguf.py).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import psutil
import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

from engine import paths
from engine.errors import OutOfMemory
from engine.loading.checkpoint import Checkpoint
from engine.model.causal_lm import CausalLM
from engine.offload.host_store import HostStore
from engine.offload.layout import (
    LayerLayout,
    pack_entry,
    pack_prequantized,
    set_parameter,
)
from engine.offload.prepared import PreparedLayers
from engine.offload.streamer import LayerHome, LayerStreamer
from engine.planning.placement import (
    RING_SLOTS,
    MemoryNeeds,
    activation_bytes,
    kv_bytes_per_token,
    plan_placement,
)
from engine.types import Offload, Placement, Quant
from engine.units import GIB

log = logging.getLogger(__name__)

LAYERS = "model.layers."
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


def host_budget(ram_limit_bytes: int | None) -> int:
    """RAM the host store may use: the setting, else what is available less a margin for the
    OS and the app (2 GiB or 10 % of RAM, whichever is larger)."""
    if ram_limit_bytes is not None:
        return ram_limit_bytes
    vm = psutil.virtual_memory()
    return max(0, vm.available - max(2 * GIB, vm.total // 10))


def resident_bytes(path: Path, dtype: torch.dtype) -> int:
    """Device bytes a folder's model takes fully resident in `dtype` (from shard headers only)."""
    if not path.is_dir():
        return path.stat().st_size if path.exists() else 0
    ckpt = Checkpoint(path, {})
    try:
        esize = torch.empty((), dtype=dtype).element_size()
        total = 0
        for shard in ckpt._shards:
            for st_dtype, shape, _, _ in shard.entries.values():
                n = 1
                for s in shape:
                    n *= s
                total += n * (esize if st_dtype.is_floating_point else 1)
        return total
    finally:
        ckpt.close()


def materialise(path: Path, config_dict: dict, settings: MaterialiseSettings,
                report: Callable[[float, str], None] | None = None) -> CausalLM:
    device = torch.device(settings.device)
    dtype = settings.dtype
    ckpt = Checkpoint(path, config_dict)
    try:
        quant: Quant = "nf4" if ckpt.bnb_4bit else settings.quant
        if ckpt.bnb_4bit and settings.quant != "nf4":
            log.info("%s is a bitsandbytes 4-bit checkpoint: its layers load as NF4", path.name)
        config = AutoConfig.from_pretrained(path, trust_remote_code=False)
        if hasattr(config, "quantization_config"):
            del config.quantization_config  # we place the 4-bit weights ourselves
        with torch.device("meta"):
            hf = AutoModelForCausalLM.from_config(config, dtype=dtype, trust_remote_code=False)
        if (path / "generation_config.json").is_file():
            hf.generation_config = GenerationConfig.from_pretrained(path)
        inner = hf.model
        _place_outer(hf, ckpt, device, dtype)
        layer0 = inner.layers[0]
        layout = LayerLayout.of(layer0, dtype, quant)
        placement = plan_layers(hf, layout, settings, quant)
        log.info("placement of %s: %s", path.name, placement.describe())
        prepared = PreparedLayers(paths.cache_dir() / "prepared", path, layout, placement.num_layers) \
            if quant == "nf4" else None
        homes, store = _place_layers(hf, ckpt, layout, placement, device, dtype, report, prepared)
    finally:
        ckpt.close()
    streamer = None
    if any(h.module is None for h in homes):
        streamer = LayerStreamer(homes, layout, store, layer_template(hf), device, RING_SLOTS)
    return CausalLM(hf, streamer=streamer, placement=placement)


def layer_template(hf: nn.Module) -> Callable[[], nn.Module]:
    """A factory of empty (meta) decoder layers of `hf`'s kind: the streamer binds their
    parameters to its ring slots or its dense buffer."""
    cls, cfg = type(hf.model.layers[0]), hf.config

    def make_template() -> nn.Module:
        with torch.device("meta"):
            template = cls(cfg, 0)
        assert not list(template.buffers()), "decoder layers with buffers cannot be streamed"
        return template.eval()

    return make_template


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


def _place_outer(hf: nn.Module, ckpt: Checkpoint, device: torch.device, dtype: torch.dtype) -> None:
    """Embeddings, final norm, head (and anything else outside the decoder layers) -> device."""
    names = [n for n, _ in hf.named_parameters(remove_duplicate=False) if not n.startswith(LAYERS)]
    tied = bool(getattr(hf.config, "tie_word_embeddings", False))
    for name in names:
        if name == "lm_head.weight" and (tied or not ckpt.has(name)):
            continue
        set_parameter(hf, name, ckpt.load(name, dtype, device))
    if tied or not ckpt.has("lm_head.weight"):
        hf.lm_head.weight = hf.model.embed_tokens.weight
    inner = hf.model
    with torch.device(device):  # rotary tables are computed, not stored
        inner.rotary_emb = type(inner.rotary_emb)(config=hf.config)
    left = [n for n, t in list(hf.named_parameters()) + list(hf.named_buffers())
            if t.is_meta and not n.startswith(LAYERS)]
    assert not left, f"not materialised: {left}"


def plan_layers(hf: nn.Module, layout: LayerLayout, settings: MaterialiseSettings, quant: Quant) -> Placement:
    """Where `hf`'s decoder layers go: the device memory free now (under any allocator cap),
    less the KV cache for the context and the activations of the largest tree."""
    cfg = hf.config
    device = settings.device
    num_layers = cfg.num_hidden_layers
    esize = torch.empty((), dtype=settings.dtype).element_size()
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    context = settings.context_length or min(int(getattr(cfg, "max_position_embeddings", DEFAULT_CONTEXT)),
                                             DEFAULT_CONTEXT)
    needs = MemoryNeeds(
        fixed=settings.reserve_bytes,  # the outer weights are already on the device
        kv_per_token=kv_bytes_per_token(num_layers, cfg.num_key_value_heads, head_dim, esize),
        activations=activation_bytes(settings.max_budget, context, cfg.hidden_size, cfg.intermediate_size,
                                     cfg.num_attention_heads, cfg.vocab_size, esize),
    )
    device_free = device_free_bytes(device) if device.startswith("cuda") else 0
    placement = plan_placement(
        num_layers=num_layers, layer_bytes=layout.nbytes, dense_layer_bytes=layout.dense_nbytes, quant=quant,
        offload=settings.offload, device=device, device_free=device_free, needs=needs, context_length=context,
        host_free=host_budget(settings.ram_limit_bytes))
    if device.startswith("cuda") and settings.offload == "none":
        need = num_layers * layout.nbytes + needs.kv_per_token * context + needs.activations + settings.reserve_bytes
        if need > device_free:
            raise OutOfMemory(f"The model's layers need about {need / GIB:.1f} GiB of GPU memory with its KV "
                              f"cache but {device_free / GIB:.1f} GiB is free. Use --offload auto (stream "
                              "layers from RAM) or --quant nf4.")
    return placement


def _place_layers(hf: nn.Module, ckpt: Checkpoint, layout: LayerLayout, placement: Placement,
                  device: torch.device, dtype: torch.dtype, report: Callable[[float, str], None] | None,
                  prepared: PreparedLayers | None) -> tuple[list[LayerHome], HostStore | None]:
    num_layers = placement.num_layers
    offloaded = num_layers - placement.gpu_layers
    reuse = prepared is not None and prepared.ready
    writing = prepared is not None and not reuse and prepared.start_writing()
    # with a prepared-layer file, the disk tier maps it in place (no second copy on disk)
    in_prepared = reuse or writing
    store = None
    if offloaded:
        disk_file = (prepared.path, placement.gpu_layers + placement.ram_layers) if in_prepared else None  # type: ignore[union-attr]
        store = HostStore(layout.nbytes, placement.ram_layers, placement.disk_layers, pin=device.type == "cuda",
                          disk_dir=paths.cache_dir() / "offload", disk_file=disk_file)
    scratch = torch.empty(layout.nbytes, dtype=torch.uint8) if placement.disk_layers else None
    # quantise where it is fast: on the GPU when there is one
    work = device if device.type == "cuda" else torch.device("cpu")
    if reuse:
        log.info("packed layers from the prepared cache %s", prepared.path.name)  # type: ignore[union-attr]
    homes: list[LayerHome] = []
    where_name = "GPU" if device.type == "cuda" else "memory"
    try:
        for i in range(num_layers):
            prefix = f"{LAYERS}{i}."
            if i < placement.gpu_layers and layout.quant == "none":
                layer = hf.model.layers[i]
                for e in layout.entries:
                    set_parameter(layer, e.name, ckpt.load(prefix + e.name, dtype, device))
                homes.append(LayerHome(module=layer))
                where = where_name
            else:
                if i < placement.gpu_layers:  # NF4, resident: packed on the device
                    buf = torch.empty(layout.nbytes, dtype=torch.uint8, device=device)
                    home, where = LayerHome(packed=buf), where_name
                else:
                    j = i - placement.gpu_layers
                    assert store is not None
                    if store.tier(j) == "ram":
                        buf, where = store.ram_buffer(j), "RAM"
                    else:
                        assert scratch is not None
                        buf, where = scratch, "disk"
                    home = LayerHome(store_index=j)
                if where == "disk" and reuse:
                    pass  # already in the prepared file, which the store maps
                elif reuse:
                    prepared.read_into(i, buf)  # type: ignore[union-attr]
                else:
                    _pack_layer(layout, buf, ckpt, prefix, dtype, work)
                    if writing:
                        prepared.write(i, buf)  # type: ignore[union-attr]
                    elif where == "disk":
                        assert store is not None and home.store_index is not None
                        store.write_disk(home.store_index, buf)
                homes.append(home)
            if report is not None:
                report((i + 1) / num_layers, f"layer {i + 1} of {num_layers} -> {where}")
        if writing:
            prepared.finish()  # type: ignore[union-attr]
    except BaseException:
        if writing:
            prepared.discard()  # type: ignore[union-attr]
        raise
    finally:
        if prepared is not None:
            prepared.close()
    if store is not None:
        store.seal()
    return homes, store


def _pack_layer(layout: LayerLayout, buf: torch.Tensor, ckpt: Checkpoint, prefix: str,
                dtype: torch.dtype, work: torch.device) -> None:
    for e in layout.entries:
        if e.kind == "absmax":
            continue
        full = prefix + e.name
        if e.kind == "nf4" and ckpt.is_nf4(full):
            pre = ckpt.nf4(full)
            if pre is not None:
                pack_prequantized(layout, buf, e.name, *pre)
                continue
        if e.kind == "dense":  # straight from the mapping into the packed buffer
            ckpt.copy_to(full, layout.view(buf, e))
        else:
            pack_entry(layout, buf, e.name, ckpt.load(full, dtype, work))


