"""Gemma 4's decoder layers as qmatmul.c's qm_layer reads them (kernel v15), for the fused CPU step
and pass (fused_layer.py): which Gemma 4 models qualify (`refusal`) and each layer's fields (`fill`).

What the C layer does beside Gemma 3's (norms before each residual add, a GELU gate, a local and
a global rotary table): each layer its own head width and K/V heads (the full layers' heads are
twice as wide, with fewer K/V heads), keys as values on the full layers of the large models (no
v_proj: a head's values are its keys' projection before k_norm and the rotation), values
RMS-normed without a weight, the full layers' proportional rotary table (its unrotated pairs are
cos 1, sin 0: a full-width table), a factor on the hidden state after each layer (layer_scalar),
and the 26B-A4B's MoE block beside its MLP: a router of its own (the residual normed without a
weight, times a learned scale and hidden^-1/2; softmax, top-k, renormalised, then times each
expert's own scale), the experts' own pre-norm, and the MLP's and the experts' outputs each normed,
summed, normed again before the residual add. Rotary tables of different widths are padded to the
widest (`rope_width`); each layer rotates its own head's width. The small E2B / E4B's per-layer
inputs (`layer_inputs`: the model's own per-token table and projection, computed in PyTorch,
handed to the call) enter each layer after its MLP, through its gate, GELU, projection and norm;
its last layers reuse the K/V of the last earlier layer of their type (kv_reuse: no K/V
products, their views the storing layer's buffers, written earlier in the same call), with MLPs
twice as wide.

What qualifies: Gemma 4's text layers with every Linear packed (the per-layer inputs' projection
packed, or read as fp32 rows where the file holds it in 16 bits), the routed experts packed with
the one-token kernel's GELU gate.

What this module does not do: run anything, or read files.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from engine.kernels.expert_parts import gelu_tanh
from engine.kernels.experts import PackedExperts
from engine.kernels.fused_rules import (ACTS, activation, attention_refusal, dense_rows, is_vector, norm_eps,
                                       rows_shape)
from engine.kernels.linear import PackedLinear

if TYPE_CHECKING:
    from engine.kernels.fused_layer import Layer
    from engine.model.causal_lm import CausalLM

PREFIX = "Gemma4Text"
# the MoE block's norms by qm_layer's field (beside norms_of's)
BLOCK_NORMS = (("pre_experts", "pre_feedforward_layernorm_2"), ("post_experts", "post_feedforward_layernorm_2"),
               ("post_mlp1", "post_feedforward_layernorm_1"))


def shapes(model: CausalLM) -> list[tuple[int, int]]:
    """Each layer's (K/V heads, head width), as its attention module has them."""
    heads = int(model.config.num_attention_heads)
    attns: list[Any] = [layer.self_attn for layer in model.layers]
    return [(heads // int(a.num_key_value_groups), int(a.head_dim)) for a in attns]


def refusal(model: CausalLM) -> str | None:
    """Why a Gemma 4 model (resident on the CPU in fp32: fused_rules.refusal asked) cannot take the
    fused step, or None."""
    cfg = model.config
    if activation(cfg) not in ACTS or getattr(cfg, "attn_logit_softcapping", None) is not None:
        return f"activation {activation(cfg)}, or soft-capped attention"
    heads, hidden = int(cfg.num_attention_heads), int(cfg.hidden_size)
    scales = set()
    layer: Any
    for layer, kind in zip(model.layers, model.kinds):
        attn: Any = getattr(layer, "self_attn", None)
        if type(layer).__name__ != f"{PREFIX}DecoderLayer" or type(attn).__name__ != f"{PREFIX}Attention" \
                or type(getattr(layer, "mlp", None)).__name__ != f"{PREFIX}MLP":
            return f"layer modules {type(layer).__name__}"
        if model.per_layer_inputs:
            why = _inputs_refusal(layer, hidden, int(cfg.hidden_size_per_layer_input))
            if why is not None:
                return why
        groups = getattr(attn, "num_key_value_groups", None)
        if not isinstance(groups, int) or groups < 1 or heads % groups:
            return "head sizes"
        why = attention_refusal(layer, kind, heads, heads // groups)
        if why is not None:
            return why
        scales.add(float(attn.scaling))
        v_norm = getattr(attn, "v_norm", None)
        if not attn.is_kv_shared_layer and (v_norm is None or getattr(v_norm, "with_scale", True)):
            return "values not normed without a weight"
        d, kv = int(attn.head_dim), heads // groups
        want = {"q_proj": (heads * d, hidden), "k_proj": (kv * d, hidden), "v_proj": (kv * d, hidden),
                "o_proj": (hidden, heads * d)}
        inter = int(layer.mlp.intermediate_size)  # (twice the config's where a layer reuses K/V: double-wide)
        want.update(gate_proj=(inter, hidden), up_proj=(inter, hidden), down_proj=(hidden, inter))
        for name, shape in want.items():
            lin = getattr(layer.mlp if name in ("gate_proj", "up_proj", "down_proj") else attn, name, None)
            if lin is None and (name == "v_proj" and attn.use_alternative_attention
                                or name in ("k_proj", "v_proj") and attn.is_kv_shared_layer):
                continue  # keys as values, or another layer's K/V
            if not isinstance(lin, PackedLinear) or (lin.qweight.out_features, lin.qweight.in_features) != shape:
                return f"{name} not packed, or of another shape"
            w = lin.qweight
            if w.mins is not None and w.group not in (16, 32) or w.group % 8 or lin.bias is not None:
                return f"{name} groups of {w.group}, or a bias"
        norms = [getattr(layer, n, None) for n in ("input_layernorm", "post_attention_layernorm",
                                                    "pre_feedforward_layernorm", "post_feedforward_layernorm")]
        norms += [getattr(attn, "q_norm", None)] + ([] if attn.is_kv_shared_layer else [getattr(attn, "k_norm", None)])
        if model.per_layer_inputs:
            norms.append(getattr(layer, "post_per_layer_input_norm", None))
        if getattr(cfg, "enable_moe_block", False):
            why = _block_refusal(layer, hidden)
            if why is not None:
                return why
            norms += [getattr(layer, n) for _, n in BLOCK_NORMS]
        weights = [getattr(n, "weight", None) for n in norms]
        if any(not isinstance(w, torch.Tensor) or w.dtype != torch.float32 or not w.is_contiguous()
               or not hasattr(n, "eps") for n, w in zip(norms, weights)):
            return "norm modules"
        scalar = getattr(layer, "layer_scalar", None)
        if not isinstance(scalar, torch.Tensor) or scalar.numel() != 1:
            return "layer scalar"
    if len(scales) != 1:
        return "attention scales differ between layers"
    probe, at = torch.zeros(1, 1, hidden), torch.zeros(1, 1, dtype=torch.long)
    for t in set(model.layer_types):
        cos, sin = model.rotary(probe, at, t)
        widths = {d for (_, d), lt in zip(shapes(model), model.layer_types) if lt == t}
        if widths != {cos.shape[-1]} or sin.shape != cos.shape:
            return "rotary tables other than each layer type's head width"
    return None


def _inputs_refusal(layer: Any, hidden: int, width: int) -> str | None:
    """Why a layer's per-layer input (gate, projection) cannot run in the step, or None."""
    gate, proj = getattr(layer, "per_layer_input_gate", None), getattr(layer, "per_layer_projection", None)
    if not isinstance(gate, PackedLinear) or (gate.qweight.out_features, gate.qweight.in_features) != (width, hidden) \
            or gate.bias is not None or gate.qweight.mins is not None and gate.qweight.group not in (16, 32):
        return "per-layer input gate not packed, or of another shape"
    if rows_shape(proj) != (hidden, width) or not gelu_tanh(layer.act_fn):
        return "per-layer input projection or activation"
    return None


def _block_refusal(layer: Any, hidden: int) -> str | None:
    """Why a layer's MoE block (router, experts, norms) cannot run in the step, or None."""
    experts: Any = getattr(layer, "experts", None)
    router: Any = getattr(layer, "router", None)
    gate = experts._fused[2] if isinstance(experts, PackedExperts) and experts._fused is not None else None
    if type(router).__name__ != f"{PREFIX}Router" or gate is None or not gate.gelu:  # (its one-token kernel's GELU)
        return "routed experts the one-call kernel does not run"
    e = experts.num_experts
    if rows_shape(router.proj) != (e, hidden):
        return "router weight"
    if not is_vector(router.scale, hidden) or not is_vector(router.per_expert_scale, e):
        return "router scales"
    if getattr(router.norm, "with_scale", True) or not 0 < int(router.config.top_k_experts) <= e:
        return "router norm or top_k"
    return None


def fill(struct: Layer, layer: nn.Module, call: tuple[int, int], rope_width: int, layers: int) -> list[object]:
    """A Gemma 4 layer's own fields of `struct` (fused_layer.FusedDecoder fills the common ones:
    Linears, norms_of's norms, the router and experts of an MoE): its head width and K/V heads
    where they are not the call's (K/V heads, width), keys as values, the values' norm, the
    rotary tables' width, its scale, its MoE block. Returns the tensors the struct points into."""
    attn: Any = layer.self_attn
    held: list[object] = []
    d = int(attn.head_dim)
    kv = int(attn.config.num_attention_heads) // int(attn.num_key_value_groups)
    struct.layer_head_dim = d if d != call[1] else 0
    struct.layer_kv_heads = kv if kv != call[0] else 0
    struct.kv_reuse = int(attn.is_kv_shared_layer)
    struct.kv_same = int(not attn.is_kv_shared_layer and attn.v_proj is None)
    struct.v_norm = int(not attn.is_kv_shared_layer)
    struct.v_eps = norm_eps(attn.v_norm) if struct.v_norm else 0.0
    struct.rotary_dim = 0  # each layer's table is its head's width
    struct.rope_width = rope_width if rope_width != d else 0
    struct.layer_scale = float(layer.layer_scalar)  # type: ignore[arg-type]
    gate: Any = getattr(layer, "per_layer_input_gate", None)
    if gate is not None:  # the per-layer input
        held += [gate.qweight, gate.bias]
        struct.ple_gate.point_at(gate.qweight, gate.bias)
        proj: Any = layer.per_layer_projection
        norm: Any = layer.post_per_layer_input_norm
        if isinstance(proj, PackedLinear) and proj.bias is None:  # read packed, as every Linear
            held.append(proj.qweight)
            struct.ple_out.point_at(proj.qweight)
        else:  # (a 16-bit file tensor: fp32 rows)
            rows = dense_rows(proj)
            assert rows is not None
            held.append(rows)
            struct.ple_proj = rows.data_ptr()
        held.append(norm.weight)
        struct.ple_norm, struct.ple_eps = norm.weight.data_ptr(), norm_eps(norm)
        struct.ple_dim = int(gate.qweight.out_features)
        struct.ple_stride = layers * struct.ple_dim
    router: Any = getattr(layer, "router", None)
    if router is not None:
        rows = dense_rows(router.proj)
        assert rows is not None
        held += [rows, router.scale, router.per_expert_scale]
        struct.router = rows.data_ptr()
        struct.router_scale, struct.expert_scale = router.scale.data_ptr(), router.per_expert_scale.data_ptr()
        struct.router_root, struct.router_eps = float(router.scalar_root_size), norm_eps(router.norm)
        struct.norm_topk = 1
        for field, name in BLOCK_NORMS:
            norm = getattr(layer, name)
            held.append(norm.weight)
            setattr(struct, f"{field}_norm", norm.weight.data_ptr())
            setattr(struct, f"{field}_eps", norm_eps(norm))
    return held


def stores(model: CausalLM) -> list[int]:
    """Each layer's K/V buffers: its own, or (a layer reusing K/V) those of the last layer of its
    type before the reusing layers (transformers' "store" layer)."""
    kinds: Any = [getattr(layer.self_attn, "is_kv_shared_layer", False) for layer in model.layers]
    types = model.layer_types
    first = kinds.index(True) if True in kinds else len(kinds)
    return [max(j for j in range(first) if types[j] == types[i]) if kinds[i] else i for i in range(len(kinds))]


def layer_inputs(inner: Any, ids: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor | None:
    """The per-layer inputs of a pass's tokens (1, n, layers, width) as CausalLM.forward computes
    them, fp32; None without (`inner` None)."""
    if inner is None:
        return None
    ids = ids.to(hidden.device)[None]
    return inner.project_per_layer_inputs(hidden, inner.get_per_layer_inputs(ids, hidden)).float().contiguous()


def at(ple: torch.Tensor | None, layer: int) -> int | None:
    """The address of layer `layer`'s per-layer input of the first token (a run's first layer)."""
    return None if ple is None else ple.data_ptr() + layer * ple.shape[-1] * ple.element_size()


def padded(tables: list[torch.Tensor], width: int) -> torch.Tensor:
    """Rotary tables (1, n, w_t) of each layer type, zero-padded to `width` and stacked (T, n, width)."""
    return torch.cat([torch.nn.functional.pad(t, (0, width - t.shape[-1])) for t in tables])
