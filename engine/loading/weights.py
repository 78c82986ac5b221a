"""What materialise.py reads a model from: a safetensors folder here, a GGUF file in gguf.py.

Both give tensors by their transformers names, de-quantised into a dtype on a device (`load`),
the packed layout of every decoder layer (`layouts`) and the packing of a layer into a buffer
(`pack_layer`); a GGUF also offers its file for the disk tier to map in place (`mapped`).

A safetensors folder's layers are 16-bit, NF4 (quantised on the way, or stored as they are
when the checkpoint is bitsandbytes 4-bit), or int4 as an AWQ or GPTQ checkpoint stores them
(kept packed: the codes, scales and zeros travel as they are and are de-quantised on the
device, offload/int4.py). FP8 weights and gpt-oss's MXFP4 experts are de-quantised into the
compute dtype as they load (checkpoint.py, mxfp4.py).

What this module does not do: decide where layers go (materialise.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Literal, Protocol

import torch
from gguf import GGMLQuantizationType
from torch import nn

from engine.loading.checkpoint import Checkpoint
from engine.loading.multimodal import add_text_names
from engine.model.gpt_oss_experts import use_row_experts
from engine.offload.layout import Entry, LayerLayout, pack_entry, pack_prequantized
from engine.types import Quant

if TYPE_CHECKING:
    from transformers import PreTrainedModel

LAYERS = "model.layers."
INT4_SIDES = ("scales", "qzeros", "g_idx")


class Weights(Protocol):
    path: Path

    def bind(self, hf: PreTrainedModel) -> None: ...

    def has(self, name: str) -> bool: ...

    def load(self, name: str, dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor: ...

    def layouts(self, hf: PreTrainedModel, dtype: torch.dtype, quant: Quant) -> list[LayerLayout]: ...

    def pack_layer(self, i: int, layout: LayerLayout, buf: torch.Tensor, work: torch.device) -> None: ...

    def mapped(self, layers: Sequence[int], layouts: Sequence[LayerLayout]) -> tuple[Path, list[int]] | None: ...

    def cache_files(self) -> list[Path]: ...

    def close(self) -> None: ...


class SafetensorsWeights:
    """The *.safetensors shards of a Hugging Face folder."""

    def __init__(self, path: Path, config: dict) -> None:
        self.path = path
        self.ckpt = Checkpoint(path, config)
        add_text_names(self.ckpt)  # a vision-language checkpoint's decoder, under the text model's names
        qc = config.get("quantization_config") or {}
        method = qc.get("quant_method")
        self.int4: Literal["awq", "gptq"] | None = method if method in ("awq", "gptq") else None
        self.gptq_v2 = qc.get("checkpoint_format") == "gptq_v2"
        self._rows: set[str] = set()  # parameters held rows first (engine.model.gpt_oss_experts)

    def bind(self, hf: PreTrainedModel) -> None:
        """Most checkpoints use transformers' names; MoE checkpoints store each expert apart
        (and Mixtral names its block `block_sparse_moe`), where transformers' modules hold one
        fused tensor per layer: those are assembled as they load (Checkpoint.add_virtual)."""
        for name, p in hf.named_parameters():
            if not self.ckpt.has(name) and not self.ckpt.add_mxfp4(name):  # gpt-oss's MXFP4 experts
                expert_parts(self.ckpt, name, p.shape[0] if p.ndim == 3 else 0)
        # gpt-oss's MXFP4 experts held rows first, as stored, so they can stay in their blocks
        self._rows = {name for name, _ in hf.named_parameters() if self.ckpt.is_mxfp4(name)}
        if self._rows:
            use_row_experts(hf, interleaved=True)

    def has(self, name: str) -> bool:
        return self.ckpt.has(name)

    def load(self, name: str, dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
        value = self.ckpt.load(name, dtype, device)
        # transformers' (E, in, out) de-quantised -> RowExperts' (E, out, in)
        return value.transpose(-1, -2).contiguous() if name in self._rows else value

    def layouts(self, hf: PreTrainedModel, dtype: torch.dtype, quant: Quant) -> list[LayerLayout]:
        """Each layer's layout; layers of one kind share theirs (a hybrid or MoE model's
        layers differ in kind)."""
        out: list[LayerLayout] = []
        seen: dict[tuple, LayerLayout] = {}
        for layer in hf.model.layers:
            key = tuple((name, tuple(p.shape)) for name, p in layer.named_parameters())
            if key not in seen:
                if self.int4 is not None:
                    seen[key] = self._int4_layout(layer, dtype, self.int4)
                elif self._rows and quant == "none":
                    seen[key] = self._mxfp4_layout(layer, dtype)
                else:
                    seen[key] = LayerLayout.of(layer, dtype, "nf4" if self.ckpt.bnb_4bit else quant)
            out.append(seen[key])
        return out

    def _mxfp4_layout(self, layer: nn.Module, dtype: torch.dtype) -> LayerLayout:
        """gpt-oss's MXFP4 experts kept in blocks (as ggml's MXFP4: the packed CPU kernel and the
        GPU's de-quantiser read them, engine.offload.gguf_blocks), the rest dense."""
        esize = torch.empty((), dtype=dtype).element_size()
        entries = []
        for name, p in layer.named_parameters():
            if f"{LAYERS}0.{name}" in self._rows:
                entries.append(Entry(name, "gguf", tuple(p.shape), torch.uint8, 0, p.numel() // 32 * 17,
                                     int(GGMLQuantizationType.MXFP4)))
            else:
                entries.append(Entry(name, "dense", tuple(p.shape), dtype, 0, p.numel() * esize))
        return LayerLayout.packed(entries, dtype, "gguf")

    def _int4_layout(self, layer: nn.Module, dtype: torch.dtype, int4: Literal["awq", "gptq"]) -> LayerLayout:
        """Linear weights stored as int4 stay packed, with their scales, zeros (and g_idx) as
        side entries; the rest (norms, biases, any Linear left in 16-bit) is dense."""
        esize = torch.empty((), dtype=dtype).element_size()
        entries = []
        for name, p in layer.named_parameters():
            q = f"{LAYERS}0.{_module(name)}.qweight"
            if name.endswith(".weight") and self.ckpt.has(q):
                entries.append(Entry(name, int4, tuple(p.shape), torch.int32, 0, _nbytes(self.ckpt, q),
                                     qtype=2 if self.gptq_v2 else 1))
                for side in INT4_SIDES:
                    s = f"{LAYERS}0.{_module(name)}.{side}"
                    if self.ckpt.has(s):
                        dt = self.ckpt.dtype(s)
                        entries.append(Entry(f"{name}#{side}", side, self.ckpt.shape(s), dt, 0, _nbytes(self.ckpt, s)))
            else:
                entries.append(Entry(name, "dense", tuple(p.shape), dtype, 0, p.numel() * esize))
        return LayerLayout.packed(entries, dtype, int4)

    def pack_layer(self, i: int, layout: LayerLayout, buf: torch.Tensor, work: torch.device) -> None:
        prefix = f"{LAYERS}{i}."
        ckpt = self.ckpt
        for e in layout.entries:
            full = prefix + e.name
            if e.kind in ("awq", "gptq"):
                q = f"{prefix}{_module(e.name)}.qweight"
                ckpt.copy_to(q, layout.view(buf, e).view(torch.int32).view(ckpt.shape(q)))
            elif e.kind in INT4_SIDES:
                weight, _, side = full.partition("#")
                ckpt.copy_to(f"{_module(weight)}.{side}", layout.view(buf, e))
            elif e.kind == "absmax":
                continue
            elif e.kind == "nf4" and ckpt.is_nf4(full) and (pre := ckpt.nf4(full)) is not None:
                pack_prequantized(layout, buf, e.name, *pre)
            elif e.kind == "gguf":  # gpt-oss's MXFP4 experts, rewritten as ggml's blocks
                ckpt.mxfp4_as_ggml(full, layout.view(buf, e))
            elif e.kind == "dense" and full not in self._rows:  # straight from the mapping into the packed buffer
                ckpt.copy_to(full, layout.view(buf, e))
            elif e.kind == "dense":
                layout.view(buf, e).copy_(self.load(full, layout.compute_dtype, work))
            else:
                pack_entry(layout, buf, e.name, self.load(full, layout.compute_dtype, work))

    def mapped(self, layers: Sequence[int], layouts: Sequence[LayerLayout]) -> tuple[Path, list[int]] | None:
        return None

    def cache_files(self) -> list[Path]:
        return sorted(self.path.glob("*.safetensors"))

    def close(self) -> None:
        self.ckpt.close()


# how checkpoints name an expert's matrices: (gate, up, down), Qwen/GLM/DeepSeek and Mixtral
EXPERT_NAMES = (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2"))


def expert_parts(ckpt: Checkpoint, name: str, experts: int) -> bool:
    """Teach `ckpt` the model tensor `name` from the parts a checkpoint stores it in:
    `...mlp.experts.gate_up_proj` (experts, 2 * inter, hidden) from each expert's gate and up
    matrices, `...mlp.experts.down_proj` from each one's down matrix, and Mixtral's
    `block_sparse_moe` for `mlp`. False when no known naming has every part."""
    blocks = [name] + ([name.replace(".mlp.", ".block_sparse_moe.", 1)] if ".mlp." in name else [])
    for stored in blocks:
        if stored != name and ckpt.add_renamed(name, stored):
            return True
        base, _, leaf = stored.rpartition(".experts.")
        if not base or leaf not in ("gate_up_proj", "down_proj") or experts < 1:
            continue
        for gate, up, down in EXPERT_NAMES:
            parts = [gate, up] if leaf == "gate_up_proj" else [down]
            rows = [[f"{base}.experts.{e}.{part}.weight" for part in parts] for e in range(experts)]
            if ckpt.add_virtual(name, rows):
                return True
    return False


def _module(param: str) -> str:
    """"mlp.up_proj.weight" -> "mlp.up_proj"."""
    return param.rpartition(".")[0]


def _nbytes(ckpt: Checkpoint, name: str) -> int:
    n = ckpt.dtype(name).itemsize
    for s in ckpt.shape(name):
        n *= s
    return n
