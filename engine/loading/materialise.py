"""Build a model from its weights (a safetensors folder or a GGUF file, weights.py / gguf.py)
without a full-precision copy in RAM.

The transformers model is constructed on the meta device (no memory). Then, tensor by tensor
from the memory-mapped file(s): the embeddings, final norm and head go to the device; each
decoder layer goes to its home in the placement (planning.placement): a resident transformers
module on the device, a packed buffer on the device (NF4, GGUF blocks, int4), a buffer in the
host store's RAM arenas, or the host store's disk file (packed into one reused scratch buffer,
then written; a GGUF's layers are read from the GGUF itself instead). NF4 is quantised on the
way (bitsandbytes, blocksize 64), on the GPU when there is one; pre-quantised layers (GGUF,
bitsandbytes 4-bit, AWQ, GPTQ) are stored as they are. NF4 layers are also written to a
prepared-layer cache (prepared.py) that the next start reads instead.

Peak RAM is therefore the final host footprint plus about one layer (the scratch buffer and
the tensor being converted). What this module does not do: tokenizers (load.py), or decide where
the layers go and in what form (layer_plan.py).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch import nn
from transformers import AutoModelForCausalLM, GenerationConfig, PretrainedConfig

from engine import paths
from engine.errors import UnsupportedModel
from engine.kernels.embedding import PackedEmbedding
from engine.kernels.linear import PackedLinear, QuantWeight
from engine.loading import cpu_packed, exact_pack
from engine.loading.checkpoint import Checkpoint
from engine.loading.multimodal import is_vision
from engine.loading.weights import Weights
from engine.model.causal_lm import CausalLM
from engine.model.gpt_oss_experts import RowExperts, use_row_experts
from engine.model.linear_attention import install as install_linear
from engine.offload.host_store import HostStore
from engine.offload.layout import LayerLayout, set_parameter
from engine.offload.prepared import PreparedLayers
from engine.offload.streamer import LayerHome, LayerStreamer
from engine.offload.unpack import Unpacker
from engine.loading.layer_plan import MaterialiseSettings, experts_on_cpu, kernel_layers, plan_layers, unpack_at_load
from engine.planning.placement import RING_SLOTS
from engine.store.gguf_header import split_parts
from engine.shapes import Placement
from engine.units import GIB, MIB

if TYPE_CHECKING:
    from transformers import PreTrainedModel

log = logging.getLogger(__name__)

LAYERS = "model.layers."


def resident_bytes(path: Path, dtype: torch.dtype) -> int:
    """Device bytes a folder's model takes fully resident in `dtype` (from shard headers only)."""
    if not path.is_dir():
        return sum(p.stat().st_size for p in split_parts(path) if p.exists())
    ckpt = Checkpoint(path, {})
    try:
        esize = torch.empty((), dtype=dtype).element_size()
        total = 0
        names = set(ckpt.stored_names())
        for shard in ckpt._shards:
            for name, (st_dtype, shape, _, _) in shard.entries.items():
                if is_vision(name):  # a vision tower is skipped (multimodal.py)
                    continue
                n = 1
                for s in shape:
                    n *= s
                if name.endswith("_scales") and name.removesuffix("_scales") + "_blocks" in names:
                    continue  # MXFP4: folded into the values its blocks de-quantise to
                if name.endswith("_blocks") and name.removesuffix("_blocks") + "_scales" in names:
                    n *= 2  # two values a byte
                    st_dtype = torch.bfloat16
                total += n * (esize if st_dtype.is_floating_point else 1)
        return total
    finally:
        ckpt.close()


def materialise(weights: Weights, config: PretrainedConfig, settings: MaterialiseSettings,
                report: Callable[[float, str], None] | None = None,
                generation_config: GenerationConfig | None = None) -> CausalLM:
    """The model of `config` filled from `weights` (closed when done)."""
    device = torch.device(settings.device)
    dtype = settings.dtype
    try:
        if hasattr(config, "quantization_config"):
            del config.quantization_config  # we place pre-quantised weights ourselves
        with torch.device("meta"):
            hf = AutoModelForCausalLM.from_config(config, dtype=dtype, trust_remote_code=False)
        layer_buffers_as_parameters(hf)
        if generation_config is not None:
            hf.generation_config = generation_config
        weights.bind(hf)
        layouts = weights.layouts(hf, dtype, settings.quant)
        # the embedding stays packed where the layers will run resident with the kernel (their
        # RAM counted before any outer weight is read: the packed table is all the outer RAM), and
        # in any CPU load where no head is tied to it (its look-ups are the file's values, bit for
        # bit; a tied head streamed beside de-quantised layers stays the dense table it is)
        resident = kernel_layers(layouts[0].quant) and unpack_at_load(layouts, settings, list(hf.model.layers))
        table = _packed_table(weights, device, dtype) if resident or not _tied(hf, weights) else None
        _place_outer(hf, weights, device, dtype, packed_table=table is not None)
        if table is not None:
            _keep_table_packed(hf, weights, table)
        packing = layouts[0].quant
        if packing != settings.quant and settings.quant == "nf4":
            log.info("%s is stored pre-quantised (%s): its layers load as they are", weights.path.name, packing)
        resident_bytes_cpu = unpack_at_load(layouts, settings, list(hf.model.layers))
        unpack = resident_bytes_cpu is not None
        split = resident_bytes_cpu is None and experts_on_cpu(hf, layouts, settings)
        if split:
            n = len(layouts)
            placement = Placement(n, n, 0, 0, max(layout.nbytes for layout in layouts), packing, settings.device,
                                  resident_form="experts-cpu")
            unpack = True
            log.info("%s: routed experts packed in RAM (CPU kernel), the rest on %s", weights.path.name, device)
        elif resident_bytes_cpu is not None:
            n = len(layouts)
            form: Literal["kernel", "dequantised"] = "kernel" if kernel_layers(packing) else "dequantised"
            placement = Placement(n, n, 0, 0, max(layout.nbytes for layout in layouts), packing, settings.device,
                                  resident_form=form)
            log.info("%s: %s layers made resident at load (%.2f GiB in RAM%s)", weights.path.name, packing,
                     resident_bytes_cpu / GIB, ", packed CPU kernels" if kernel_layers(packing) else "")
            _pack_head(hf, weights, device)
            _pack_projection(hf, weights)
        else:
            placement = plan_layers(hf, layouts, settings, packing)
        log.info("placement of %s: %s", weights.path.name, placement.describe())
        uniform = all(layout == layouts[0] for layout in layouts)
        prepared = PreparedLayers(paths.cache_dir() / "prepared", weights.path, layouts[0], placement.num_layers,
                                  weights.cache_files()) if packing == "nf4" and uniform else None
        homes, store = _place_layers(hf, weights, layouts, placement, device, dtype, report, prepared, unpack)
    finally:
        weights.close()
    streamer = None
    if any(h.module is None for h in homes):
        streamer = LayerStreamer(homes, layouts, store, layer_template(hf), device, RING_SLOTS)
    elif packing == "none" and device.type == "cpu" and dtype == torch.float32 and cpu_packed.kernels_on():
        packed, tested = exact_pack.pack_exact(hf, head=True)  # a folder converted from a GGUF
        if packed:
            log.info("%s: %d of %d matrices are de-quantised Q4/Q8 blocks, run packed by the CPU kernel",
                     weights.path.name, packed, tested)
    return CausalLM(hf, streamer=streamer, placement=placement)


def _packed_table(weights: Weights, device: torch.device, dtype: torch.dtype) -> QuantWeight | None:
    """The embedding table kept in its file's blocks (engine.kernels.embedding), where a model
    runs in fp32 on the CPU with the kernel and the file's table is a type it reads: a
    vocabulary-sized matrix de-quantised only row by row as tokens are looked up."""
    blocks = getattr(weights, "blocks", None)
    if blocks is None or device.type != "cpu" or dtype != torch.float32:
        return None
    found = blocks("model.embed_tokens.weight")
    return cpu_packed.packed_matrix(*found) if found is not None else None


def _keep_table_packed(hf: PreTrainedModel, weights: Weights, table: QuantWeight) -> None:
    """`table` becomes the model's embedding; a head tied to it (or absent from the file) is the
    same packed weight, run by the kernel: one copy of the matrix for both."""
    hf.model.embed_tokens = PackedEmbedding(table, hf.model.embed_tokens)
    if _tied(hf, weights):
        hf.lm_head = PackedLinear(table)
    log.info("%s: embedding table kept packed (%.0f MiB)", weights.path.name, table.nbytes / MIB)


def _tied(hf: PreTrainedModel, weights: Weights) -> bool:
    return bool(getattr(hf.config, "tie_word_embeddings", False)) or not weights.has("lm_head.weight")


def _pack_head(hf: PreTrainedModel, weights: Weights, device: torch.device) -> None:
    """The head as a packed-kernel Linear when its blocks (or the tied embedding's) allow (a
    head already packed with its table is kept)."""
    blocks = getattr(weights, "blocks", None)
    if blocks is None or isinstance(hf.lm_head, PackedLinear):
        return
    tied = bool(getattr(hf.config, "tie_word_embeddings", False)) or not weights.has("lm_head.weight")
    found = blocks("model.embed_tokens.weight" if tied else "lm_head.weight")
    if found is None:
        return
    head = cpu_packed.packed_head(*found)
    if head is not None:
        hf.lm_head = head


def _pack_projection(hf: PreTrainedModel, weights: Weights) -> None:
    """Gemma 4's per-layer inputs' projection (hidden -> layers x width, every token: 19 MB of
    fp32 a token for a small model's) as a packed-kernel Linear, as the head."""
    blocks = getattr(weights, "blocks", None)
    projection: Any = getattr(hf.model, "per_layer_model_projection", None)
    if blocks is None or type(projection) is not nn.Linear or projection.bias is not None:
        return
    found = blocks("model.per_layer_model_projection.weight")
    packed = cpu_packed.packed_head(*found) if found is not None else None
    if packed is not None:
        hf.model.per_layer_model_projection = packed


def layer_template(hf: PreTrainedModel) -> Callable[[int], nn.Module]:
    """A factory of empty (meta) decoder layers like `hf`'s layer i (layers differ in kind: a
    hybrid model's linear and attention layers, an MoE model's dense first layers): the
    streamer binds their parameters to its ring slots or its dense buffer."""
    cls, cfg = type(hf.model.layers[0]), hf.config
    rows = next((m for m in hf.model.layers.modules() if isinstance(m, RowExperts)), None)  # gpt-oss's experts

    def make_template(index: int = 0) -> nn.Module:
        with torch.device("meta"):
            template = cls(cfg, index)
        if rows is not None:
            use_row_experts(template, rows.interleaved)
        layer_buffers_as_parameters(template)
        install_linear([template], cfg)
        assert not list(template.buffers()), "decoder layers with buffers cannot be streamed"
        return template.eval()

    return make_template


def layer_buffers_as_parameters(module: nn.Module) -> None:
    """Persistent buffers inside decoder layers (GLM-4.5's router score correction) become
    frozen parameters of the same name, so they are loaded, packed and streamed as the weights
    are. Non-persistent buffers are computed, not stored, and stay."""
    inner = getattr(module, "model", None)
    layers = list(inner.get_submodule("layers").children()) if isinstance(inner, nn.Module) else [module]
    for layer in layers:
        for name, buf in list(layer.named_buffers()):
            owner_name, _, leaf = name.rpartition(".")
            owner = layer.get_submodule(owner_name) if owner_name else layer
            if leaf in owner._non_persistent_buffers_set:
                continue
            del owner._buffers[leaf]
            owner.register_parameter(leaf, nn.Parameter(buf, requires_grad=False))


def _place_outer(hf: PreTrainedModel, weights: Weights, device: torch.device, dtype: torch.dtype,
                 packed_table: bool = False) -> None:
    """Embeddings, final norm, head (and anything else outside the decoder layers) -> device;
    `packed_table`: the embedding (and a head tied to it) are left for _keep_table_packed."""
    names = [n for n, _ in hf.named_parameters(remove_duplicate=False) if not n.startswith(LAYERS)]
    tied = _tied(hf, weights)
    skipped = {"model.embed_tokens.weight", "lm_head.weight"} if packed_table and tied else \
        {"model.embed_tokens.weight"} if packed_table else set()
    for name in names:
        if (name == "lm_head.weight" and tied) or name in skipped:
            continue
        set_parameter(hf, name, weights.load(name, dtype, device))
    if tied and not packed_table:
        hf.lm_head.weight = hf.model.embed_tokens.weight
    inner = hf.model
    with torch.device(device):  # rotary tables are computed, not stored
        inner.rotary_emb = type(inner.rotary_emb)(config=hf.config)
    for name, buf in list(hf.named_buffers()):
        if buf.is_meta and not name.startswith(LAYERS):
            _computed_buffer(hf, name, device)
    left = [n for n, t in list(hf.named_parameters()) + list(hf.named_buffers())
            if t.is_meta and not n.startswith(LAYERS) and n not in skipped]
    assert not left, f"not materialised: {left}"


def _computed_buffer(hf: PreTrainedModel, name: str, device: torch.device) -> None:
    """A buffer outside the layers that the model computes in __init__ (and so is still on the
    meta device): Gemma's embedding scale, kept beside the module as `scalar_<name>`."""
    owner_name, _, leaf = name.rpartition(".")
    owner = hf.get_submodule(owner_name)
    scalar = getattr(owner, f"scalar_{leaf}", None)
    if not isinstance(scalar, (int, float)):
        raise UnsupportedModel(f"SpecChat cannot compute the {name} of a {hf.config.model_type} model; "
                               "report this model to the SpecChat developers.")
    owner._buffers[leaf] = torch.tensor(float(scalar), device=device)


def _place_layers(hf: PreTrainedModel, weights: Weights, layouts: list[LayerLayout], placement: Placement,
                  device: torch.device, dtype: torch.dtype, report: Callable[[float, str], None] | None,
                  prepared: PreparedLayers | None, unpack: bool = False) -> tuple[list[LayerHome], HostStore | None]:
    """Each decoder layer to its home. With `unpack` (unpack_at_load), every layer is packed
    into one reused buffer and de-quantised from it into a resident module."""
    num_layers = placement.num_layers
    tiers = placement.tiers()
    streamed = [i for i, t in enumerate(tiers) if t != "device"]
    store_index = {layer: j for j, layer in enumerate(streamed)}  # the host store's j holds layer streamed[j]
    on_disk = [i for i, t in enumerate(tiers) if t == "disk"]
    # the prepared-layer cache this load reads its layers from, or else writes them to
    reader = prepared if prepared is not None and prepared.ready else None
    writer = prepared if prepared is not None and reader is None and prepared.start_writing() else None
    cache_file = reader if reader is not None else writer
    # the disk tier maps a file in place when there is one: the prepared-layer file being
    # read or written, or the GGUF the layers come from (no second copy on disk)
    disk_file = None
    if on_disk:
        if cache_file is not None:
            disk_file = (cache_file.path, [i * cache_file.stride for i in on_disk])
        else:
            disk_file = weights.mapped(on_disk, layouts)
    in_place = disk_file is not None
    store = None
    if streamed:
        store = HostStore([layouts[i].nbytes for i in streamed], placement.ram_layers,
                          pin=device.type == "cuda", disk_dir=paths.cache_dir() / "offload", disk_file=disk_file)
    # disk layers are packed into one reused buffer, then written (unless the mapped file has them)
    scratch = (torch.empty(max(layouts[i].nbytes for i in on_disk), dtype=torch.uint8)
               if on_disk and (writer is not None or not in_place) else None)
    # quantise where it is fast: on the GPU when there is one
    work = device if device.type == "cuda" else torch.device("cpu")
    if reader is not None:
        log.info("packed layers from the prepared cache %s", reader.path.name)
    homes: list[LayerHome] = []
    where_name = "GPU" if device.type == "cuda" else "memory"
    unpacker = Unpacker(device) if unpack else None
    packed_scratch = torch.empty(max(layout.nbytes for layout in layouts), dtype=torch.uint8) if unpack else None
    # experts on the CPU, the rest on a GPU (experts_on_cpu): the layer's bytes are de-quantised there
    device_scratch = (torch.empty(max(layout.nbytes for layout in layouts), dtype=torch.uint8, device=device)
                      if unpack and device.type != "cpu" else None)
    buf: torch.Tensor | None  # where layer i is packed (None: a disk layer already in the mapped file)
    try:
        for i in range(num_layers):
            layout = layouts[i]
            resident = tiers[i] == "device"
            if unpacker is not None and packed_scratch is not None:
                layer = hf.model.layers[i]
                weights.pack_layer(i, layout, packed_scratch, torch.device("cpu"))
                if device_scratch is not None:
                    device_scratch[:layout.nbytes].copy_(packed_scratch[:layout.nbytes])
                cpu_packed.place_layer(layer, layout, packed_scratch, unpacker, dtype, device,
                                       kernel_layers(layout.quant), device_packed=device_scratch)
                homes.append(LayerHome(module=layer))
                where = where_name
            elif resident and layout.quant == "none":
                layer = hf.model.layers[i]
                for e in layout.entries:
                    set_parameter(layer, e.name, weights.load(f"{LAYERS}{i}.{e.name}", dtype, device))
                homes.append(LayerHome(module=layer))
                where = where_name
            else:
                if resident:  # packed, resident: on the device
                    buf = torch.empty(layout.nbytes, dtype=torch.uint8, device=device)
                    home, where = LayerHome(packed=buf), where_name
                else:
                    j = store_index[i]
                    assert store is not None
                    if store.tier(j) == "ram":
                        buf, where = store.ram_buffer(j), "RAM"
                    else:
                        buf, where = scratch, "disk"
                    home = LayerHome(store_index=j)
                if where == "disk" and in_place and writer is None:
                    pass  # already in the file the store maps
                else:
                    assert buf is not None, "a disk layer packed here has the scratch buffer"
                    if reader is not None:
                        reader.read_into(i, buf)
                    else:
                        weights.pack_layer(i, layout, buf, work)
                        if writer is not None:
                            writer.write(i, buf)
                        elif where == "disk":
                            assert store is not None and home.store_index is not None
                            store.write_disk(home.store_index, buf)
                homes.append(home)
            if report is not None:
                report((i + 1) / num_layers, f"layer {i + 1} of {num_layers} -> {where}")
        if writer is not None:
            writer.finish()
    except BaseException:
        if writer is not None:
            writer.discard()
        raise
    finally:
        if prepared is not None:
            prepared.close()
    if store is not None:
        store.seal()
    return homes, store
