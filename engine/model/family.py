"""A decoder is a list of layer kinds; a family is a table row that maps a transformers config
to them.

Each decoder layer is one `LayerKind`: its token mixer (attention, optionally with a sliding
window, sinks or an output gate; or Gated DeltaNet linear attention, a recurrent state plus a
short convolution) and its feed-forward part (a dense MLP, or routed experts with optional
shared experts). What a tree verifier must do differs by kind, not by family: a window is
intersected with the tree mask along each node's own path, a linear layer's state follows each
node's parent, experts route each tree token on its own. So adding a family that reuses known
kinds is adding a row to FAMILIES: how its config names windows and experts.

`layer_kinds(config)` also checks every field it reads, so a damaged or hostile config.json
gets one clear UnsupportedModel message (a window of 0, top-k above the expert count,
layer_types of the wrong length or an unknown kind), never a traceback later in a pass.

What this module does not do: build or run layers (transformers' modules do the arithmetic;
causal_lm drives them), or load weights (engine.loading).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from engine.errors import UnsupportedModel

Mixer = Literal["attention", "linear"]
FeedForward = Literal["dense", "experts"]


@dataclass(frozen=True)
class LayerKind:
    """What one decoder layer is, as far as verifying a token tree is concerned."""

    mixer: Mixer = "attention"
    window: int | None = None  # attention over the last `window` positions only (q - k < window)
    sinks: bool = False  # learned per-head attention sinks (gpt-oss)
    gated: bool = False  # attention output gated by a projection of the input (Qwen3-Next, 3.5)
    ffn: FeedForward = "dense"
    shared_experts: bool = False

    def describe(self) -> str:
        if self.mixer == "linear":
            mixer = "Gated DeltaNet"
        else:
            mixer = f"sliding-window attention ({self.window})" if self.window else "full attention"
            mixer += " with sinks" if self.sinks else ""
            mixer = ("gated " if self.gated else "") + mixer
        ffn = "dense MLP" if self.ffn == "dense" else "routed experts" + (" + shared" if self.shared_experts else "")
        return f"{mixer}, {ffn}"


WindowRule = Literal["none", "all", "layer_types"]
ExpertRule = Callable[[Any, int], bool]


def _all(config: Any, i: int) -> bool:
    return True


def _never(config: Any, i: int) -> bool:
    return False


def _qwen_sparse(config: Any, i: int) -> bool:
    """Qwen2/3-MoE, Qwen3-Next, Qwen3.5-MoE: experts unless listed in mlp_only_layers, every
    `decoder_sparse_step`-th layer."""
    only = getattr(config, "mlp_only_layers", None) or []
    step = getattr(config, "decoder_sparse_step", 1) or 1
    return i not in only and (i + 1) % int(step) == 0


def _moe_block(config: Any, i: int) -> bool:
    """Gemma 4: routed experts beside the dense MLP of every layer when `enable_moe_block`."""
    return bool(_get(config, "enable_moe_block"))


def _after_dense(config: Any, i: int) -> bool:
    """GLM-4.5 / DeepSeek: the first `first_k_dense_replace` layers are dense."""
    return i >= int(getattr(config, "first_k_dense_replace", 0) or 0)


@dataclass(frozen=True)
class Family:
    """One row: how a transformers config of `model_type` names its layer kinds."""

    model_type: str
    label: str
    windows: WindowRule = "none"  # "all": config.sliding_window (when set) on every layer
    sinks: bool = False
    gated_attention: bool = False
    experts: ExpertRule = _never
    shared_experts: bool = False
    rotary_per_type: bool = False  # one rotary table per layer type (Gemma 3)
    linear_attention: bool = False  # layer_types may say "linear_attention"
    top_k_key: str = "num_experts_per_tok"  # the config field naming how many experts a token takes
    # Gemma 4's layer inputs: per-layer token embeddings (when hidden_size_per_layer_input is
    # set) and K/V shared from earlier layers through a dict each pass starts afresh
    layer_inputs: bool = False


FAMILIES: dict[str, Family] = {f.model_type: f for f in (
    Family("llama", "Llama"),
    Family("mistral", "Mistral", windows="all"),
    Family("qwen2", "Qwen2", windows="layer_types"),
    Family("qwen3", "Qwen3", windows="layer_types"),
    Family("mixtral", "Mixtral", windows="all", experts=_all),
    Family("qwen3_moe", "Qwen3-MoE", windows="all", experts=_qwen_sparse),
    Family("glm4_moe", "GLM-4.5", experts=_after_dense, shared_experts=True),
    Family("gpt_oss", "gpt-oss", windows="layer_types", sinks=True, experts=_all),
    Family("gemma3_text", "Gemma 3", windows="layer_types", rotary_per_type=True),
    Family("gemma4_text", "Gemma 4", windows="layer_types", rotary_per_type=True, experts=_moe_block,
           shared_experts=True, top_k_key="top_k_experts", layer_inputs=True),
    Family("qwen3_5_text", "Qwen3.5", windows="layer_types", gated_attention=True, linear_attention=True),
    Family("qwen3_5_moe_text", "Qwen3.5-MoE", windows="layer_types", gated_attention=True, linear_attention=True,
           experts=_all, shared_experts=True),
    Family("qwen3_next", "Qwen3-Next", windows="layer_types", gated_attention=True, linear_attention=True,
           experts=_qwen_sparse, shared_experts=True),
)}

LAYER_TYPES = {"full_attention", "sliding_attention", "linear_attention"}


def supported_types() -> tuple[str, ...]:
    return tuple(FAMILIES)


def family_of(model_type: object, name: str = "the model") -> Family:
    """The row for `model_type`, or UnsupportedModel naming what SpecChat runs."""
    row = FAMILIES.get(model_type) if isinstance(model_type, str) else None
    if row is None:
        raise UnsupportedModel(f"'{name}' is a '{str(model_type)[:60]}' model; SpecChat runs "
                               f"{', '.join(FAMILIES)} models. Pick a model of one of those families.")
    return row


def _get(config: Any, key: str) -> Any:
    return config.get(key) if isinstance(config, Mapping) else getattr(config, key, None)


def _whole(config: Any, key: str, name: str, low: int = 1) -> int:
    """A whole number >= low. A raw config.json (a dict) may leave a field to its default: 1
    stands in for it there (the config object built from it is checked again)."""
    value = _get(config, key)
    if value is None and isinstance(config, Mapping):
        return low
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise UnsupportedModel(f"'{name}' has a config.json whose {key} is {repr(value)[:40]}, which no model "
                               "of its family has; it is damaged. Re-download the model.")
    return value


def num_experts(config: Any) -> int | None:
    for key in ("num_local_experts", "num_experts", "n_routed_experts"):
        value = _get(config, key)
        if value is not None:
            return value if isinstance(value, int) and not isinstance(value, bool) else -1
    return None


def layer_kinds(config: Any, name: str = "the model") -> list[LayerKind]:
    """Each decoder layer's kind, from a transformers config object (or a config.json dict).
    UnsupportedModel for an unknown family or a field no model of the family has."""
    family = family_of(_get(config, "model_type"), name)
    if not isinstance(config, Mapping) and getattr(config, "is_heterogeneous", False):
        # Gemma 4's config refuses to name one head_dim for layers that differ; the engine's
        # sizes (planning, ModelShape) take the global value, the cache each layer's own
        # (causal_lm reads the shapes off the layer modules)
        config.allow_global_per_layer_attribute_access = True
    n = _whole(config, "num_hidden_layers", name)
    # Gemma 4's "vision" makes only image tokens attend both ways: text is read left to right
    if _get(config, "use_bidirectional_attention") not in (None, False, "vision"):
        raise UnsupportedModel(f"'{name}' attends in both directions (an embedding model); SpecChat runs "
                               "chat models, which read left to right.")
    types: list[str] = ["full_attention"] * n
    raw = _get(config, "layer_types")
    if family.windows == "layer_types" or family.linear_attention:
        if raw is not None:
            if not isinstance(raw, list) or len(raw) != n:
                length = len(raw) if isinstance(raw, list) else "no list"
                raise UnsupportedModel(f"'{name}' has a config.json whose layer_types has {length} entries for "
                                       f"{n} layers; it is damaged. Re-download the model.")
            allowed = {"full_attention", "sliding_attention"} | ({"linear_attention"} if family.linear_attention
                                                                 else set())
            bad = next((t for t in raw if t not in allowed), None)
            if bad is not None:
                raise UnsupportedModel(f"'{name}' has a layer of kind {str(bad)[:40]!r}, which SpecChat does not "
                                       f"run in a {family.label} model (it runs {', '.join(sorted(allowed))}).")
            types = list(raw)
    window: int | None = None
    if family.windows == "all" and _get(config, "sliding_window") is not None:
        window = _whole(config, "sliding_window", name)
        types = ["sliding_attention"] * n
    elif "sliding_attention" in types:
        window = _whole(config, "sliding_window", name)
    if family.layer_inputs and _get(config, "num_kv_shared_layers"):
        shared = _whole(config, "num_kv_shared_layers", name)
        if shared >= n or not set(types[n - shared:]) <= set(types[: n - shared]):
            raise UnsupportedModel(f"'{name}' shares the keys and values of its last {shared} layers with earlier "
                                   f"layers that do not compute them (of {n} layers); its config.json is damaged. "
                                   "Re-download the model.")
    ffn = [family.experts(config, i) for i in range(n)]
    if any(ffn):
        total = num_experts(config)
        if total is None and isinstance(config, Mapping):
            total = 1 << 30  # left to its default: checked on the config object
        if total is None or total < 1:
            raise UnsupportedModel(f"'{name}' has a config.json whose expert count is {total!r}; it is damaged. "
                                   "Re-download the model.")
        top_k = _whole(config, family.top_k_key, name)
        if top_k > total:
            raise UnsupportedModel(f"'{name}' routes each token to {top_k} experts but has only {total}; its "
                                   "config.json is damaged. Re-download the model.")
    return [LayerKind(
        mixer="linear" if t == "linear_attention" else "attention",
        window=window if t == "sliding_attention" else None,
        sinks=family.sinks and t != "linear_attention",
        gated=family.gated_attention and t == "full_attention",
        ffn="experts" if e else "dense",
        shared_experts=family.shared_experts and e,
    ) for t, e in zip(types, ffn)]


def describe_kinds(kinds: list[LayerKind]) -> str:
    """"36 layers: 27 Gated DeltaNet, dense MLP; 9 gated full attention, dense MLP"."""
    counts: dict[str, int] = {}
    for kind in kinds:
        counts[kind.describe()] = counts.get(kind.describe(), 0) + 1
    return f"{len(kinds)} layers: " + "; ".join(f"{c} {d}" for d, c in counts.items())
