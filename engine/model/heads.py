"""Draft heads a checkpoint ships beside its decoder: finding them, and loading one as a draft.

Two namings exist, both dropped by transformers at load:

- "mtp" (Qwen3-Next, Qwen3.5 / 3.6, dense and MoE): `mtp.fc.weight` (H, 2H),
  `mtp.pre_fc_norm_embedding.weight`, `mtp.pre_fc_norm_hidden.weight`, `mtp.norm.weight` (H,)
  and one decoder layer `mtp.layers.0.*`, named like the model's own layers (routed experts in
  an MoE model);
- "nextn" (GLM-4.5 / glm4_moe; DeepSeek-V3 names it the same way, but SpecChat does not run
  deepseek_v3 models): the layer `model.layers.{num_hidden_layers}.*` with `eh_proj.weight`
  (H, 2H), `enorm.weight`, `hnorm.weight`, `shared_head.norm.weight` beside its decoder layer
  (its optional `shared_head.head` and `embed_tokens` copies equal the target's and are not read).

`find_heads(folder, config)` reads the safetensors headers only (never a tensor, never pickle,
never code) and checks every name and shape against the layer the family's own transformers
class would build from the target's config; a head whose tensors do not fit is still listed,
with `problem` saying which tensor, so a caller can tell the user. `load_head` reads its tensors
and returns a HeadDraft (head_draft.py) that the Engine takes as its `draft`.

Gemma 4 ships its drafter as a separate model instead, an assistant folder beside the target's
(engine.model.assistant): find_heads lists those for a Gemma 4 target, and load_head loads one.
EAGLE-3 heads are folders of their own too, for any family (engine.model.eagle_spec, eagle):
find_heads lists the ones beside the target after the checkpoint's own head.

Only the first head layer is used (a checkpoint with several applies layer 0 at every depth,
as vLLM does with one); its weights load dense in the target's dtype on the target's device.
"""

from __future__ import annotations

import copy
import hashlib
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn

from engine.errors import UnsupportedModel
from engine.loading.checkpoint import Checkpoint
from engine.loading.weights import expert_parts
from engine.model.assistant import load_assistant
from engine.model.assistant_spec import TARGET_TYPES, AssistantSpec, find_assistants, text_of
from engine.model.causal_lm import CausalLM
from engine.model.eagle import load_eagle
from engine.model.eagle_spec import EagleSpec, eagle_spec, find_eagles
from engine.model.head_draft import HeadDraft

log = logging.getLogger(__name__)

Naming = Literal["mtp", "nextn"]
# the families SpecChat runs whose checkpoints carry a head, and how they name it
HEAD_NAMING: dict[str, Naming] = {"qwen3_next": "mtp", "qwen3_5_text": "mtp", "qwen3_5_moe_text": "mtp",
                                  "glm4_moe": "nextn"}


@dataclass(frozen=True)
class HeadSpec:
    """A head found in a checkpoint (plain data): what load_head reads."""

    kind: str  # "mtp": it drafts from the target's hidden states
    naming: Naming
    label: str  # "MTP (1 layer, from the checkpoint)"
    layer_prefix: str  # its decoder layer's tensors: "mtp.layers.0." or "model.layers.46."
    fc: str  # (H, 2H): cat([normed embedding, normed hidden]) -> H
    norm_embedding: str
    norm_hidden: str
    norm: str  # the final norm before the target's lm_head
    experts: bool  # its layer has routed experts
    tensors: tuple[str, ...]  # every tensor it reads (routed experts under transformers' fused names)
    params: int = 0  # its own weights (embedding and lm_head are the target's): the memory it needs
    problem: str = ""  # why it cannot be loaded ("" = it can)


def _names(naming: Naming, config: Any) -> tuple[str, str, str, str, str]:
    if naming == "mtp":
        return ("mtp.layers.0.", "mtp.fc.weight", "mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight",
                "mtp.norm.weight")
    p = f"model.layers.{int(config.num_hidden_layers)}."
    return p, p + "eh_proj.weight", p + "enorm.weight", p + "hnorm.weight", p + "shared_head.norm.weight"


def head_config(config: Any, experts: bool) -> Any:
    """The target's config for one full-attention layer at index 0 (its own cache slot), with
    routed experts or a dense MLP as the head's tensors have."""
    cfg = copy.deepcopy(config)
    cfg.num_hidden_layers = 1
    if getattr(cfg, "layer_types", None) is not None:
        cfg.layer_types = ["full_attention"]
    if hasattr(cfg, "mlp_only_layers"):
        cfg.mlp_only_layers = [] if experts else [0]
    if hasattr(cfg, "first_k_dense_replace"):
        cfg.first_k_dense_replace = 0 if experts else 1
    if hasattr(cfg, "decoder_sparse_step"):
        cfg.decoder_sparse_step = 1
    return cfg


def layer_class(target_layers: list[nn.Module], layer_types: list[str]) -> type[nn.Module]:
    """The family's decoder layer class: the type of the target's full-attention layers."""
    for layer, kind in zip(target_layers, layer_types):
        if kind == "full_attention":
            return type(layer)
    raise UnsupportedModel("The model has no full-attention layer to build its draft head from.")


def _build_layer(cls: type[nn.Module], config: Any, device: torch.device | str) -> nn.Module:
    with torch.device(device):
        return cls(config, 0)


def find_heads(folder: Path, config: Any,
               layer_cls: type[nn.Module] | None = None) -> list[HeadSpec | AssistantSpec | EagleSpec]:
    """The heads stored in `folder`'s safetensors shards for a target of `config` (a transformers
    config object; a wrapper's text config for vision-language checkpoints). Headers only.
    `layer_cls`: the family's decoder layer class (found from transformers' modeling module of
    the model type when not given). For a Gemma 4 target: the assistant folders beside it. For
    any target: the EAGLE-3 heads beside it (eagle_spec.py), after the checkpoint's own head."""
    eagles: list[HeadSpec | AssistantSpec | EagleSpec] = list(find_eagles(folder, text_of(config)))
    if getattr(config, "model_type", None) in TARGET_TYPES:
        return [*find_assistants(folder, config), *eagles]
    naming = HEAD_NAMING.get(getattr(config, "model_type", None) or "")
    if naming is None or not any(Path(folder).glob("*.safetensors")):
        return eagles
    ckpt = Checkpoint(Path(folder), config.to_dict())
    try:
        prefix, fc, norm_e, norm_h, norm = _names(naming, config)
        stored = ckpt.names
        if not any(name.startswith(prefix) for name in stored) and fc not in stored:
            return eagles
        experts = any(name.startswith(prefix + "mlp.experts.") or name == prefix + "mlp.gate.weight"
                      for name in stored)
        cls = layer_cls or family_layer_class(config)
        layer = _build_layer(cls, head_config(config, experts), "meta")
        h = int(config.hidden_size)
        wanted: dict[str, tuple[int, ...]] = {fc: (h, 2 * h), norm_e: (h,), norm_h: (h,), norm: (h,)}
        for name, t in [*layer.named_parameters(), *layer.named_buffers()]:
            wanted[prefix + name] = tuple(t.shape)
        problem, tensors, params = "", [], 0
        for name, shape in wanted.items():
            params += int(torch.Size(shape).numel())
            if not ckpt.has(name):
                expert_parts(ckpt, name, shape[0] if len(shape) == 3 else 0)
            if not ckpt.has(name):
                problem = problem or f"the checkpoint's draft head has no tensor {name}"
                continue
            if tuple(ckpt.shape(name)) != shape:
                problem = problem or (f"the checkpoint's draft head tensor {name} is {list(ckpt.shape(name))}, "
                                      f"not {list(shape)} as the model's config says")
            tensors.append(name)
        label = f"{'MTP' if naming == 'mtp' else 'NextN'} (1 layer, from the checkpoint)"
        if problem:
            log.warning("%s: %s", label, problem)
        return [HeadSpec("mtp", naming, label, prefix, fc, norm_e, norm_h, norm, experts, tuple(tensors), params,
                         problem), *eagles]
    finally:
        ckpt.close()


def family_layer_class(config: Any) -> type[nn.Module]:
    """transformers' decoder layer class of the config's model type."""
    import importlib

    module_of = {"qwen3_next": ("qwen3_next", "Qwen3NextDecoderLayer"), "qwen3_5_text": ("qwen3_5", "Qwen3_5DecoderLayer"),
                 "qwen3_5_moe_text": ("qwen3_5_moe", "Qwen3_5MoeDecoderLayer"),
                 "glm4_moe": ("glm4_moe", "Glm4MoeDecoderLayer")}
    module, name = module_of[config.model_type]
    cls: type[nn.Module] = getattr(importlib.import_module(f"transformers.models.{module}.modeling_{module}"), name)
    return cls


def load_head(target_folder: Path, target: CausalLM, spec: HeadSpec | AssistantSpec | EagleSpec) -> HeadDraft:
    """The head `spec` (from find_heads(target_folder, target.config)) as a draft for the loaded
    `target`: Engine(target, tokenizer, draft=load_head(...)). UnsupportedModel when the spec
    has a problem or the folder changed since."""
    if isinstance(spec, EagleSpec):
        if eagle_spec(spec.folder, text_of(target.config)) != spec:
            raise UnsupportedModel("The EAGLE-3 head's files changed since it was found; load the model again.")
        return load_eagle(spec.folder, target)
    if isinstance(spec, AssistantSpec):
        if spec.problem:
            raise UnsupportedModel(f"The assistant in {spec.folder} cannot be used: {spec.problem}. Load the model "
                                   "without it or pick another draft.")
        return load_assistant(spec.folder, target)
    if spec.problem:
        raise UnsupportedModel(f"The model's draft head cannot be used: {spec.problem}. Load the model without it "
                               "or pick another draft.")
    config = target.config
    cls = layer_class(target.layers, target.layer_types)
    found = find_heads(target_folder, config, cls)
    if not found or found[0] != spec:
        raise UnsupportedModel("The model's files changed since its draft head was found; load it again.")
    cfg = head_config(config, spec.experts)
    device, dtype = target.device, target.dtype
    ckpt = Checkpoint(Path(target_folder), config.to_dict())
    try:
        layer = _build_layer(cls, cfg, "meta")
        layer.to_empty(device=device)
        with torch.inference_mode():
            for name, t in [*layer.named_parameters(), *layer.named_buffers()]:
                full = spec.layer_prefix + name
                if not ckpt.has(full):
                    expert_parts(ckpt, full, t.shape[0] if t.ndim == 3 else 0)
                t.data = ckpt.load(full, t.dtype if not t.is_floating_point() else dtype, device)
            h = int(config.hidden_size)
            fc = nn.Linear(2 * h, h, bias=False, device=device, dtype=dtype)
            fc.weight.data = ckpt.load(spec.fc, dtype, device)
            norm_cls = type(target.norm)
            eps = float(getattr(config, "rms_norm_eps", 1e-6))
            norms = []
            for name in (spec.norm_embedding, spec.norm_hidden, spec.norm):
                norm = norm_cls(h, eps=eps).to(device=device, dtype=dtype)
                norm.weight.data = ckpt.load(name, dtype, device)
                norms.append(norm)
        digest = hashlib.sha256(repr([(n, ckpt.shape(n), str(ckpt.dtype(n))) for n in spec.tensors]).encode())
    finally:
        ckpt.close()
    fingerprint = f"{target.fingerprint}+{spec.naming}-{digest.hexdigest()[:16]}" if target.fingerprint else ""
    log.info("draft: the checkpoint's %s", spec.label)
    return HeadDraft(target, layer.eval(), fc, norms[0], norms[1], norms[2], cfg,
                     recurse_normed=spec.naming == "mtp", zero_first_embedding=spec.naming == "nextn",
                     label=spec.label, fingerprint=fingerprint)
