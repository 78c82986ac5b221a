"""What each decoder layer's cache keeps, read from a transformers config (or a config.json
dict): the CacheLayer list ModelShape.from_config attaches, so that the planner and the memory
checks price a model's caches by layer kind rather than as every layer keeping every token.

Why per layer: a Gemma 3 at 128k tokens keeps K/V for all of them in 1 layer of 6 only (the
other 5 hold a window of 1024 plus the tree); a Qwen3.5/3.6 keeps K/V in 1 layer of 4 and a
fixed recurrent state in the others; Gemma 4's full layers have their own head count and width
(`global_head_dim`, and `num_global_key_value_heads` when keys serve as values), and its last
`num_kv_shared_layers` layers read earlier layers' K/V and keep none.

The kinds come from engine.model.family's `layer_kinds` (which also refuses damaged fields);
the shapes here mirror what the caches allocate (engine.model.cache's per-layer shapes,
hybrid_cache's LinearSpec and linear_attention's pending inputs), and a test holds each figure
against a real cache. What this module does not do: decide placement or budgets (placement.py,
planner.py), or allocate anything.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from engine.errors import UnsupportedModel
from engine.model.family import FAMILIES, LayerKind, family_of, layer_kinds
from engine.shapes import CacheLayer


def _get(config: Any, key: str) -> Any:
    return config.get(key) if isinstance(config, Mapping) else getattr(config, key, None)


def _kv_shape(config: Any, i: int, full: bool, kv_heads: int, head_dim: int) -> tuple[int, int]:
    """Layer i's (kv heads, head dim). Gemma 4 names its full layers' own: a config object
    through its per-layer configs, a config.json through `per_layer_config` (as transformers
    writes one) or `global_head_dim` (and `num_global_key_value_heads` when
    `attention_k_eq_v`), as transformers' config class reads them."""
    if not isinstance(config, Mapping):
        if not getattr(config, "is_heterogeneous", False):
            return kv_heads, head_dim
        layer = config.per_layer_config[i]
        return int(getattr(layer, "num_key_value_heads", None) or kv_heads), int(getattr(layer, "head_dim", None)
                                                                                or head_dim)
    per_layer = config.get("per_layer_config")
    if isinstance(per_layer, Mapping) and per_layer:
        own = next((v for k, v in per_layer.items() if str(k).isdigit() and int(k) == i), None)
        own = own if isinstance(own, Mapping) else {}
        return int(own.get("num_key_value_heads") or kv_heads), int(own.get("head_dim") or head_dim)
    if full and config.get("global_head_dim"):
        global_kv = config.get("num_global_key_value_heads") if config.get("attention_k_eq_v") else None
        return int(global_kv or kv_heads), int(config["global_head_dim"])
    return kv_heads, head_dim


def _linear_layer(config: Any, name: str) -> CacheLayer:
    """A Gated DeltaNet layer (engine.model.hybrid_cache.LinearSpec): a convolution state of
    conv_dim x (kernel - 1) in the model's dtype and a recurrent state of H_v x dk x dv in
    fp32; per pending tree token its conv input, keys, values and beta (model dtype) and its
    log-decay (fp32)."""
    def whole(key: str) -> int:
        value = _get(config, key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise UnsupportedModel(f"'{name}' has linear-attention layers but its config.json gives {key} as "
                                   f"{repr(value)[:40]}; it is damaged. Re-download the model.")
        return value

    key_dim = whole("linear_num_key_heads") * whole("linear_key_head_dim")
    value_dim = whole("linear_num_value_heads") * whole("linear_value_head_dim")
    conv_dim = 2 * key_dim + value_dim
    v_heads = whole("linear_num_value_heads")
    return CacheLayer(
        state_elements=conv_dim * (whole("linear_conv_kernel_dim") - 1),
        state_fp32_elements=v_heads * whole("linear_key_head_dim") * whole("linear_value_head_dim"),
        pending_elements=conv_dim + key_dim + value_dim + v_heads,
        pending_fp32_elements=v_heads,
    )


def cache_layers_of(config: Mapping[str, Any] | Any, name: str = "the model") -> tuple[CacheLayer, ...]:
    """Each decoder layer's CacheLayer; () for a model_type SpecChat does not know (taken as
    every layer full attention of the config's one K/V shape). UnsupportedModel (from
    layer_kinds) for a damaged field of a known family."""
    if _get(config, "model_type") not in FAMILIES:
        return ()
    kinds: list[LayerKind] = layer_kinds(config, name)
    family = family_of(_get(config, "model_type"), name)
    heads = int(_get(config, "num_attention_heads"))
    kv_heads = int(_get(config, "num_key_value_heads") or heads)
    head_dim = int(_get(config, "head_dim") or int(_get(config, "hidden_size")) // heads)  # the windowed layers'
    n = len(kinds)
    shared = int(_get(config, "num_kv_shared_layers") or 0) if family.layer_inputs else 0
    linear = _linear_layer(config, name) if any(k.mixer == "linear" for k in kinds) else None
    out: list[CacheLayer] = []
    for i, kind in enumerate(kinds):
        if kind.mixer == "linear":
            assert linear is not None
            out.append(linear)
            continue
        h, d = _kv_shape(config, i, kind.window is None, kv_heads, head_dim)
        out.append(CacheLayer(h, 0 if i >= n - shared else d, kind.window))
    return tuple(out)
