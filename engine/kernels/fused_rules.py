"""Which models the fused CPU decoding step takes (engine/kernels/fused_layer.py), and how their
modules read as qmatmul.c's qm_layer: the families and their class names, routers, norms
(Gemma's and Qwen3.5's 1 + w), activations, rotary widths, which Linears a layer hands over, and
Qwen3.5's Gated DeltaNet layers (`linear_refusal`).

`refusal(model)` is the one question fused_layer asks at load: why a model cannot take the step,
or None. Everything here reads modules and configs; nothing runs a pass.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from engine.kernels.experts import PackedExperts
from engine.kernels.linear import PackedLinear, dequantize

if TYPE_CHECKING:
    from engine.model.causal_lm import CausalLM

# dense families: model type -> the class name prefix of their modules
FAMILIES = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2", "qwen3": "Qwen3", "gemma3_text": "Gemma3",
            "qwen3_5_text": "Qwen3_5"}
# the MLP gates the step runs (qm_layer.act), by the config's activation name
ACTS = {"silu": 0, "gelu_pytorch_tanh": 1}
# MoE families whose routed layers the step runs too (their routers: ROUTERS): model type -> class prefix
MOE_FAMILIES = {"qwen3_moe": "Qwen3Moe", "mixtral": "Mixtral", "gpt_oss": "GptOss", "glm4_moe": "Glm4Moe",
                "qwen3_5_moe_text": "Qwen3_5Moe"}
# hybrids (the step only: a tree pass keeps the general path): Gated DeltaNet layers (TreeGatedDeltaNet,
# qwen3_5's layout) beside gated attention; the MoE's shared expert scaled by its own sigmoid gate
HYBRIDS = frozenset({"qwen3_5_text", "qwen3_5_moe_text"})
# families whose RMSNorms scale by 1 + weight
PLUS_ONE = frozenset({"gemma3_text", *HYBRIDS})
# an MoE layer's shared expert (GLM-4.5), a dense MLP beside the routed experts: qm_layer's gate/up/down
SHARED = (("gate", "mlp.shared_experts.gate_proj"), ("up", "mlp.shared_experts.up_proj"),
          ("down", "mlp.shared_experts.down_proj"))
SHARED_GATED = tuple((f, p.replace("shared_experts", "shared_expert")) for f, p in SHARED)  # Qwen3.5-MoE's
# a Gated DeltaNet layer's packed Linears (b's and a's rows are read as fp32: qm_layer.lin_ba)
LINEAR_ATTN = (("lin_qkv", "linear_attn.in_proj_qkv"), ("lin_z", "linear_attn.in_proj_z"), ("o", "linear_attn.out_proj"))
LINEARS = (("q", "self_attn.q_proj"), ("k", "self_attn.k_proj"), ("v", "self_attn.v_proj"),
           ("o", "self_attn.o_proj"), ("gate", "mlp.gate_proj"), ("up", "mlp.up_proj"), ("down", "mlp.down_proj"))


def disabled() -> bool:
    """SPECCHAT_NO_FUSED=1 (anything but empty or 0): every model keeps the general path."""
    return os.environ.get("SPECCHAT_NO_FUSED", "").strip() not in ("", "0")


def norms_of(layer: nn.Module) -> dict[str, nn.Module | None]:
    """A decoder layer's RMSNorms by qm_layer's names: attn before attention, mlp before the MLP,
    Gemma 3's post_attn / post_mlp on their outputs (None where the layer has none)."""
    sa = getattr(layer, "self_attn", None)
    gemma = hasattr(layer, "pre_feedforward_layernorm")
    return {"attn": getattr(layer, "input_layernorm", None),
            "mlp": getattr(layer, "pre_feedforward_layernorm" if gemma else "post_attention_layernorm", None),
            "post_attn": getattr(layer, "post_attention_layernorm", None) if gemma else None,
            "post_mlp": getattr(layer, "post_feedforward_layernorm", None) if gemma else None,
            "q": getattr(sa, "q_norm", None), "k": getattr(sa, "k_norm", None)}


def plus_one(norm: nn.Module) -> bool:
    """Whether an RMSNorm scales by 1 + weight (Gemma's, Qwen3.5's but its gated one) rather than by weight."""
    name = type(norm).__name__  # (Gemma 4's scales by its weight)
    return name.startswith("Gemma") and not name.startswith("Gemma4") or name.startswith("Qwen3_5") and name.endswith("RMSNorm")


def norm_weight(norm: nn.Module) -> torch.Tensor:
    """The fp32 factor the C norm multiplies by: the weight, or 1 + weight for Gemma's and
    Qwen3.5's (computed in fp32 as their RMSNorms compute it)."""
    weight = cast(torch.Tensor, norm.weight).detach()
    return (1.0 + weight.float()).contiguous() if plus_one(norm) else weight


def norm_eps(norm: nn.Module) -> float:
    return float(getattr(norm, "variance_epsilon", getattr(norm, "eps", 0.0)))


def activation(cfg: Any) -> str:
    """The MLP's activation name (Gemma's config says hidden_activation)."""
    return str(getattr(cfg, "hidden_activation", None) or getattr(cfg, "hidden_act", None))


def router_of(block: nn.Module) -> Any:
    """An MoE block's router: gpt-oss's `router`, the others' `gate`."""
    return getattr(block, "router", None) or getattr(block, "gate", None)


# router class -> the block's modules beside it, and whether it is gpt-oss's (biased logits, top-k,
# softmax of those; its experts' own gate and biases)
ROUTERS = {"Qwen3MoeTopKRouter": ({"experts", "gate"}, "softmax"), "MixtralTopKRouter": ({"experts", "gate"}, "softmax"),
           "GptOssTopKRouter": ({"experts", "router"}, "gpt_oss"),
           "Glm4MoeTopkRouter": ({"experts", "gate", "shared_experts"}, "sigmoid"),
           "Qwen3_5MoeTopKRouter": ({"experts", "gate", "shared_expert", "shared_expert_gate"}, "softmax")}


def routed_refusal(block: nn.Module, hidden: int) -> str | None:
    """Why an MoE block cannot run in the step (its router and experts as the C code reads them),
    or None."""
    experts, router = getattr(block, "experts", None), router_of(block)
    known = ROUTERS.get(type(router).__name__)
    if known is None or set(vars(block).get("_modules", {})) != known[0]:
        return "a router or block other than softmax top-k"
    if (not isinstance(experts, PackedExperts) or experts._fused is None
            or (experts._fused[2] is not None) != (known[1] == "gpt_oss")):
        return "routed experts the one-call kernel does not run"
    weight = getattr(router, "weight", None)
    if (not isinstance(weight, torch.Tensor) or weight.dtype != torch.float32 or not weight.is_contiguous()
            or tuple(weight.shape) != (experts.num_experts, hidden) or weight.device.type != "cpu"):
        return "router weight"
    bias = getattr(router, "bias", None)
    if known[1] == "gpt_oss" and not is_vector(bias, experts.num_experts):
        return "router bias"
    if known[1] == "sigmoid" and (not is_vector(getattr(router, "e_score_correction_bias", None), experts.num_experts)
                                  or int(getattr(router, "num_group", 0)) != int(getattr(router, "topk_group", -1))):
        return "router score bias, or expert groups left out"  # (groups all kept: the choice is over every expert)
    if not 0 < int(getattr(router, "top_k", 0)) <= experts.num_experts:
        return "router top_k"
    return None


def refusal(model: CausalLM) -> str | None:
    """Why `model` cannot take the fused step, or None when it can."""
    if disabled():
        return "SPECCHAT_NO_FUSED"
    cfg = model.config
    prefix = FAMILIES.get(cfg.model_type) or MOE_FAMILIES.get(cfg.model_type)
    if prefix is None and cfg.model_type != "gemma4_text":
        return f"model type {cfg.model_type}"
    routed, hybrid = cfg.model_type in MOE_FAMILIES, cfg.model_type in HYBRIDS
    if model.streamer is not None or model.device.type != "cpu" or model.dtype != torch.float32:
        return "not resident on the CPU in fp32"
    if not model.layers:
        return "no decoder layers"
    if cfg.model_type == "gemma4_text":  # its own rules (per-layer shapes, its MoE block)
        from engine.kernels.fused_gemma4 import refusal as gemma4_refusal  # noqa: PLC0415

        return gemma4_refusal(model)
    if any(k.mixer != "attention" and not (hybrid and k.mixer == "linear") or k.gated and not hybrid
           or k.shared_experts and cfg.model_type not in ("glm4_moe", "qwen3_5_moe_text")
           or k.ffn != "dense" and not routed for k in model.kinds) \
            or any(s is not None for s in model.linear) and not hybrid:
        return "a layer other than attention (full or windowed) and a dense or routed MLP"
    if model.per_layer_inputs or model.family.layer_inputs or model.kv_shapes:
        return "per-layer inputs or shapes"
    if cfg.model_type != "gpt_oss" and activation(cfg) not in ACTS:
        return f"activation {activation(cfg)}"
    if getattr(cfg, "attn_logit_softcapping", None) is not None:
        return "attention logits soft-capped"
    heads, kv_heads = int(cfg.num_attention_heads), int(cfg.num_key_value_heads)
    layer: Any
    for layer, kind in zip(model.layers, model.kinds):
        attn: Any = getattr(layer, "self_attn", None)
        mlp = type(getattr(layer, "mlp", None)).__name__
        linear = kind.mixer == "linear"
        mixer = "TreeGatedDeltaNet" if linear else f"{prefix}Attention"
        if type(layer).__name__ != f"{prefix}DecoderLayer" or \
                type(getattr(layer, "linear_attn" if linear else "self_attn", None)).__name__ != mixer \
                or mlp not in (f"{prefix}MLP", f"{prefix}SparseMoeBlock", f"{prefix}MoE"):
            return f"layer modules {type(layer).__name__}"
        moe = mlp.endswith(("SparseMoeBlock", "MoE")) or cfg.model_type == "gpt_oss"
        if moe:
            why = routed_refusal(layer.mlp, cfg.hidden_size)
            if why is not None:
                return why
        want: dict[str, tuple[int, int]] = {}
        if linear:
            why = linear_refusal(layer.linear_attn, cfg.hidden_size)
            if why is not None:
                return why
            la = layer.linear_attn
            want.update(lin_qkv=(la.conv_dim, cfg.hidden_size), lin_z=(la.value_dim, cfg.hidden_size),
                        o=(cfg.hidden_size, la.value_dim))
        else:
            why = attention_refusal(layer, kind, heads, kv_heads)
            if why is not None:
                return why
            d = attn.head_dim
            want.update(q=(heads * d * (2 if kind.gated else 1), cfg.hidden_size), k=(kv_heads * d, cfg.hidden_size),
                        v=(kv_heads * d, cfg.hidden_size), o=(cfg.hidden_size, heads * d))
        named = norms_of(layer)
        norms = [n for n in named.values() if n is not None]
        if named["attn"] is None or named["mlp"] is None or any(
                not type(n).__name__.endswith("RMSNorm") or not (hasattr(n, "variance_epsilon") or hasattr(n, "eps"))
                or n.weight.dtype != torch.float32 or plus_one(n) != (cfg.model_type in PLUS_ONE) for n in norms):
            return "norm modules"
        if moe and (named["post_attn"] is not None or named["post_mlp"] is not None):
            return "post-norms around routed experts"
        inter = int(getattr(cfg, "intermediate_size", 0) or 0)  # (an MoE's config may name none)
        want.update(gate=(inter, cfg.hidden_size), up=(inter, cfg.hidden_size), down=(cfg.hidden_size, inter))
        shared = getattr(layer.mlp, "shared_experts", None) or getattr(layer.mlp, "shared_expert", None)
        if shared is not None:
            width = int(getattr(shared, "intermediate_size", 0))
            want.update(gate=(width, cfg.hidden_size), up=(width, cfg.hidden_size), down=(cfg.hidden_size, width))
        gate = getattr(layer.mlp, "shared_expert_gate", None)
        rows = dense_rows(gate) if gate is not None else None
        if gate is not None and (rows is None or tuple(rows.shape) != (1, cfg.hidden_size)):
            return "shared expert gate"
        for field, path in linears_of(layer):
            lin = layer.get_submodule(path)
            if not isinstance(lin, PackedLinear):
                return f"{path} is not packed"
            w = lin.qweight
            if (w.out_features, w.in_features) != want[field]:
                return f"{path} shape"
            if w.mins is not None and w.group not in (16, 32) or w.group % 8:
                return f"{path} groups of {w.group}"
            if lin.bias is not None and lin.bias.dtype != torch.float32:
                return f"{path} bias dtype"
    probe = torch.zeros(1, 1, cfg.hidden_size)
    at = torch.zeros(1, 1, dtype=torch.long)
    d = int(getattr(next(layer.self_attn for layer in model.layers if hasattr(layer, "self_attn")), "head_dim"))
    # the tables' width: a head's (gpt-oss's: half, see __init__), or GLM-4.5's and Qwen3.5's partial rotary
    widths = {d // 2} if cfg.model_type == "gpt_oss" else \
        set(range(2, d + 1, 2)) if cfg.model_type == "glm4_moe" or hybrid else {d}
    seen = set()
    for t in (sorted(set(model.layer_types)) if model.family.rotary_per_type else [None]):
        cos, sin = model.rotary(probe, at, t) if t is not None else model.rotary(probe, position_ids=at)
        seen.add(cos.shape[-1])
        if cos.shape[-1] not in widths or sin.shape != cos.shape:
            return "a partial rotary embedding"
    if len(seen) != 1:
        return "rotary tables of different widths"
    return None


def attention_refusal(layer: nn.Module, kind: Any, heads: int, kv_heads: int) -> str | None:
    """Why an attention layer's module cannot run in the step (its window, sinks, head sizes), or None."""
    attn: Any = getattr(layer, "self_attn")
    # the window the module applies: its own, or (Mistral's) its config's for every layer
    own = getattr(attn, "sliding_window", None) if hasattr(attn, "sliding_window") \
        else getattr(getattr(attn, "config", None), "sliding_window", None)
    if (own or None) != kind.window or not isinstance(getattr(attn, "head_dim", None), int):
        return "a sliding window other than the layer's, or an unknown head size"
    sinks = getattr(attn, "sinks", None)
    if kind.sinks != (sinks is not None) or sinks is not None and (
            sinks.dtype != torch.float32 or tuple(sinks.shape) != (heads,) or not sinks.is_contiguous()):
        return "attention sinks"
    if attn.head_dim % 2 or heads % kv_heads:
        return "head sizes"
    return None


def linear_refusal(la: Any, hidden: int) -> str | None:
    """Why a Gated DeltaNet layer (TreeGatedDeltaNet) cannot run in the step, or None: Qwen3.5's
    layout (one projection each), SiLU conv, fp32 parameters of their shapes, b's and a's rows
    readable as fp32 (dense_rows), a gated SiLU RMSNorm."""
    if la.fused or la.activation != "silu" or la.kernel < 2 or la.num_v_heads % la.num_k_heads:
        return "a Gated DeltaNet layer other than Qwen3.5's"
    if la.conv_dim != 2 * la.key_dim + la.value_dim or la.key_dim != la.num_k_heads * la.head_k_dim \
            or la.value_dim != la.num_v_heads * la.head_v_dim:
        return "Gated DeltaNet widths"
    conv = la.conv1d
    if conv.weight.dtype != torch.float32 or tuple(conv.weight.shape) != (la.conv_dim, 1, la.kernel) \
            or conv.bias is not None and not is_vector(conv.bias, la.conv_dim):
        return "Gated DeltaNet conv"
    if not is_vector(la.A_log, la.num_v_heads) or not is_vector(la.dt_bias, la.num_v_heads):
        return "Gated DeltaNet decay parameters"
    norm = la.norm
    if not type(norm).__name__.endswith("RMSNormGated") or getattr(norm, "activation", "silu") != "silu" \
            or not is_vector(norm.weight, la.head_v_dim):
        return "Gated DeltaNet norm"
    for proj in (la.in_proj_b, la.in_proj_a):
        rows = dense_rows(proj)
        if rows is None or tuple(rows.shape) != (la.num_v_heads, hidden):
            return "Gated DeltaNet b and a projections"
    return None


def experts_of(layer: nn.Module) -> nn.Module | None:
    """A layer's routed experts: its MoE block's (mlp.experts), or Gemma 4's beside its MLP."""
    return getattr(layer.get_submodule("mlp"), "experts", None) or getattr(layer, "experts", None)


def fill_linear(struct: Any, module: nn.Module) -> tuple[object, ...]:
    """Point a qm_linear `struct` at a PackedLinear's weight and bias; returns what it points into."""
    assert isinstance(module, PackedLinear)
    struct.point_at(module.qweight, module.bias)
    return module.qweight, module.bias


def fill_delta(struct: Any, la: Any) -> list[torch.Tensor]:
    """A Gated DeltaNet layer's fields of its qm_layer `struct` (linear_refusal said it
    qualifies); returns the tensors they point into."""
    b, a = dense_rows(la.in_proj_b), dense_rows(la.in_proj_a)
    assert b is not None and a is not None
    parts = {"lin_ba": torch.cat([b, a]).contiguous(),  # (2 H_v, hidden): b's rows, then a's
             "conv_w": la.conv1d.weight.detach().reshape(la.conv_dim, la.kernel).contiguous(),
             "conv_b": la.conv1d.bias.detach() if la.conv1d.bias is not None else None,
             "neg_a": -la.A_log.detach().float().exp(),  # as transformers' g: -exp(A_log) * softplus(...)
             "dt_bias": la.dt_bias.detach(), "gnorm": la.norm.weight.detach()}
    held = []
    for name, t in parts.items():
        if t is not None:
            held.append(t)
            setattr(struct, name, t.data_ptr())
    struct.gnorm_eps = norm_eps(la.norm)
    struct.lin_kh, struct.lin_vh = la.num_k_heads, la.num_v_heads
    struct.lin_dk, struct.lin_dv, struct.kernel = la.head_k_dim, la.head_v_dim, la.kernel
    struct.lin_tiled = int(la.tiled)
    return held


def rows_shape(module: object) -> tuple[int, int] | None:
    """(out, in) of what dense_rows would give, without de-quantising it: a refusal's check."""
    if isinstance(module, PackedLinear) and module.bias is None:
        return module.qweight.out_features, module.qweight.in_features
    if type(module) is nn.Linear and module.bias is None and module.weight.device.type == "cpu":
        return int(module.weight.shape[0]), int(module.weight.shape[1])
    return None


def dense_rows(module: nn.Module) -> torch.Tensor | None:
    """A bias-free Linear's weight as fp32 rows (a PackedLinear's de-quantised), or None for
    anything else."""
    if isinstance(module, PackedLinear) and module.bias is None:
        return dequantize(module.qweight).float().contiguous()
    if type(module) is nn.Linear and module.bias is None and module.weight.device.type == "cpu":
        return module.weight.detach().float().contiguous()
    return None


def rotary_width(model: CausalLM) -> int:
    """The width of the model's rotary tables (one for all layer types: refusal)."""
    t = sorted(set(model.layer_types))[0] if model.family.rotary_per_type else None
    probe, at = torch.zeros(1, 1, int(model.config.hidden_size)), torch.zeros(1, 1, dtype=torch.long)
    cos, _ = model.rotary(probe, at, t) if t is not None else model.rotary(probe, position_ids=at)
    return int(cos.shape[-1])


def linears_of(layer: nn.Module) -> tuple[tuple[str, str], ...]:
    """A layer's packed Linears by qm_layer's fields: attention's (or a Gated DeltaNet's), then the
    dense MLP's, an MoE layer's shared expert's (GLM-4.5's, Qwen3.5's), or none beside routed
    experts."""
    mlp = getattr(layer, "mlp", None)
    mixer: tuple[tuple[str, str], ...] = LINEAR_ATTN if hasattr(layer, "linear_attn") else LINEARS[:4]
    # Gemma 4's keys as values (no v), and its layers reusing another's K/V (no k or v)
    mixer = tuple(m for m in mixer if _present(layer, m[1]))
    if isinstance(getattr(mlp, "experts", None), PackedExperts) or type(getattr(mlp, "router", None)).__name__ in ROUTERS:
        shared = SHARED if getattr(mlp, "shared_experts", None) is not None else \
            SHARED_GATED if getattr(mlp, "shared_expert", None) is not None else ()
        return mixer + shared
    return mixer + LINEARS[4:]


def _present(module: nn.Module, path: str) -> bool:
    """Whether `module` has a submodule at dotted `path` (not missing, not None)."""
    for name in path.split("."):
        module = getattr(module, name, None)  # type: ignore[assignment]
        if module is None:
            return False
    return True


def is_vector(t: object, n: int) -> bool:
    """Whether t is an fp32 (n,) tensor on the CPU, laid out plainly."""
    return (isinstance(t, torch.Tensor) and t.dtype == torch.float32 and tuple(t.shape) == (n,)
            and t.is_contiguous() and t.device.type == "cpu")
