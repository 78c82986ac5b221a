"""Finding an EAGLE-3 head beside its target, and checking that it fits: config.json files and
safetensors headers only, never a weight read, never code run (eagle.py loads and runs one).

An EAGLE-3 head (Li et al., "EAGLE-3", 2025) is one Llama-style decoder layer trained to draft
for one target model. It reads three of the target's hidden states per token (a low, a middle
and a high layer's input, fused to its width by `fc`), the embedding of the next token, and
predicts the token after, over a reduced vocabulary whose ids map to the target's (`d2t`). It
is published as a folder of its own (yuhuili/EAGLE3-LLaMA3.1-Instruct-8B, lmsys's SpecForge
heads, nvidia/gpt-oss-120b-Eagle3, RedHatAI's "speculator.eagle3" folders), in one of two
config layouts, both read here:

- EAGLE / SpecForge: `architectures: ["LlamaForCausalLMEagle3"]`, the layer's fields at the top
  (hidden_size, num_attention_heads, ...), `draft_vocab_size`, optionally `target_hidden_size`
  and `eagle_config: {eagle_aux_hidden_state_layer_ids: [...]}`;
- vLLM speculators: `speculators_model_type: "eagle3"`, the layer's fields in
  `transformer_layer_config`, the rest (`draft_vocab_size`, `target_hidden_size`,
  `norm_before_residual`, `eagle_aux_hidden_state_layer_ids`) at the top.

The target's layers it reads use vLLM's numbering: j is the input of target layer j (0 the
embedding), the ids the config names, else vLLM's default (2, L // 2, L - 3). Tensors: `fc`,
the layer under `midlayer.` or `layers.0.` (q/k/v read 2 x hidden: the normed embedding and the
normed hidden state side by side; `hidden_norm` beside the usual norms), `norm`, `lm_head`
(draft vocabulary x hidden), `d2t` (draft id -> target id - draft id) unless the vocabularies
are equal, and `embed_tokens` when the head's width is not the target's (else it reads the
target's embedding, as it was trained to).

Where: the target folder's subfolders, and folders beside it whose name says "eagle" (a plain
models folder, or the Hugging Face cache's `models--org--name/snapshots/*`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.loading.checkpoint import Checkpoint
from engine.model.assistant_spec import CONFIG_ERRORS, config_json, head_places

KIND = "assistant"  # what engine.decoding.draft_choice prices it as: "an assistant or EAGLE head"
LAYER_PREFIXES = ("midlayer.", "layers.0.", "model.layers.0.")
TOP_PREFIXES = ("", "model.")
LAYER_PARTS = ("input_layernorm.weight", "hidden_norm.weight", "post_attention_layernorm.weight",
               "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
               "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")
BIASES = ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias", "self_attn.o_proj.bias")


@dataclass(frozen=True)
class EagleSpec:
    """An EAGLE-3 head found beside a target (plain data): what eagle.load_eagle reads."""

    kind: str  # KIND
    folder: Path
    label: str
    layers: int
    params: int
    aux: tuple[int, ...] = ()  # the target layers whose inputs it reads (vLLM's numbering)
    names: tuple[tuple[str, str], ...] = ()  # role (the layer's own names, "fc", "norm", ...) -> stored name
    problem: str = ""  # why it cannot draft for this target ("" = it can)

    def stored(self, role: str) -> str | None:
        return dict(self.names).get(role)


def read_config(folder: Path) -> dict[str, Any] | None:
    """The head's config as one flat dict (both layouts), or None when `folder` holds none."""
    data = config_json(folder)
    if data is None:
        return None
    archs = data.get("architectures")
    named = isinstance(archs, list) and any(isinstance(a, str) and "eagle3" in a.lower() for a in archs)
    speculators = data.get("speculators_model_type") == "eagle3"
    if not (named or speculators):
        return None
    layer = data.get("transformer_layer_config")
    flat: dict[str, Any] = dict(layer) if speculators and isinstance(layer, dict) else {}
    for key, value in data.items():
        flat.setdefault(key, value)
    eagle = data.get("eagle_config")
    if isinstance(eagle, dict):
        for key in ("eagle_aux_hidden_state_layer_ids", "use_aux_hidden_state"):
            if key in eagle:
                flat.setdefault(key, eagle[key])
    return flat


def is_eagle_folder(folder: Path) -> bool:
    return read_config(folder) is not None


def aux_layers(config: dict[str, Any], target_layers: int) -> tuple[int, ...]:
    """The target layers whose inputs the head reads: the config's, else vLLM's default."""
    ids = config.get("eagle_aux_hidden_state_layer_ids") or config.get("aux_hidden_state_layer_ids")
    if ids is None:
        return (2, target_layers // 2, target_layers - 3)
    if not isinstance(ids, list) or not ids or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise ValueError(f"eagle_aux_hidden_state_layer_ids is {ids!r}, not a list of layer numbers")
    return tuple(ids)


def _widths(config: dict[str, Any]) -> dict[str, int]:
    def whole(key: str, default: int | None = None) -> int:
        value = config.get(key, default)
        if value is None:
            raise ValueError(f"it has no {key}")
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"its {key} is {value!r}, not a positive whole number")
        return value

    h = whole("hidden_size")
    heads = whole("num_attention_heads")
    head_dim = config.get("head_dim") or h // heads
    if isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim <= 0:
        raise ValueError(f"its head_dim is {head_dim!r}")
    vocab = whole("vocab_size")
    return {"h": h, "heads": heads, "kv": whole("num_key_value_heads", heads), "d": head_dim,
            "inter": whole("intermediate_size"), "vocab": vocab, "draft_vocab": whole("draft_vocab_size", vocab),
            "target_h": whole("target_hidden_size", h), "layers": whole("num_hidden_layers", 1)}


def _problem(config: dict[str, Any], target_config: Any, w: dict[str, int], aux: tuple[int, ...]) -> str:
    if config.get("use_aux_hidden_state") is False:
        return "it reads only the target's last hidden state (use_aux_hidden_state false), which SpecChat does not run"
    if w["layers"] != 1:
        return f"it has {w['layers']} layers; SpecChat runs one-layer EAGLE-3 heads"
    if str(config.get("hidden_act", "silu")) != "silu":
        return f"its activation is {config.get('hidden_act')!r}, not silu"
    width, vocab, n = int(target_config.hidden_size), int(target_config.vocab_size), int(target_config.num_hidden_layers)
    if w["target_h"] != width:
        return f"it was trained for a model {w['target_h']} wide, and this model is {width} wide"
    if w["vocab"] != vocab:
        return f"its vocabulary has {w['vocab']} tokens and the model's {vocab}"
    if any(not 0 <= j < n for j in aux):
        return f"it reads the model's layers {list(aux)}, and the model has {n}"
    if w["draft_vocab"] > vocab:
        return f"its draft vocabulary ({w['draft_vocab']}) is larger than the model's ({vocab})"
    return ""


def _shapes(w: dict[str, int], k: int) -> dict[str, tuple[int, ...]]:
    h, q, kv, inter = w["h"], w["heads"] * w["d"], w["kv"] * w["d"], w["inter"]
    layer = {"input_layernorm.weight": (h,), "hidden_norm.weight": (h,), "post_attention_layernorm.weight": (h,),
             "self_attn.q_proj.weight": (q, 2 * h), "self_attn.k_proj.weight": (kv, 2 * h),
             "self_attn.v_proj.weight": (kv, 2 * h), "self_attn.o_proj.weight": (h, q),
             "mlp.gate_proj.weight": (inter, h), "mlp.up_proj.weight": (inter, h), "mlp.down_proj.weight": (h, inter),
             "self_attn.q_proj.bias": (q,), "self_attn.k_proj.bias": (kv,), "self_attn.v_proj.bias": (kv,), "self_attn.o_proj.bias": (h,)}
    return {**layer, "fc.weight": (h, k * w["target_h"]), "norm.weight": (h,), "lm_head.weight": (w["draft_vocab"], h),
            "d2t": (w["draft_vocab"],), "embed_tokens.weight": (w["vocab"], h)}


def _find_names(ckpt: Checkpoint, w: dict[str, int], k: int, bias: bool) -> tuple[dict[str, str], str]:
    """Role -> stored name for every tensor the head needs, and the first problem ("" = none)."""
    stored = ckpt.names
    prefix = next((p for p in LAYER_PREFIXES if p + LAYER_PARTS[0] in stored), None)
    if prefix is None:
        return {}, "its files hold no decoder layer under midlayer. or layers.0."
    wanted = _shapes(w, k)
    names: dict[str, str] = {}
    roles = [*LAYER_PARTS, *(BIASES if bias else ())]
    for role in roles:
        names[role] = prefix + role
    for role in ("fc.weight", "norm.weight", "lm_head.weight", "d2t", "embed_tokens.weight"):
        found = next((p + role for p in TOP_PREFIXES if p + role in stored), None)
        if found is not None:
            names[role] = found
    if "d2t" not in names and w["draft_vocab"] != w["vocab"]:
        return names, f"its draft vocabulary ({w['draft_vocab']}) differs from the model's and it has no d2t map"
    if "embed_tokens.weight" not in names and w["h"] != w["target_h"]:
        return names, "it is narrower than the model and has no embedding of its own"
    for role in [*roles, "fc.weight", "norm.weight", "lm_head.weight"]:
        if role not in names or names[role] not in stored:
            return names, f"its files have no tensor {names.get(role, role)}"
    for role, name in names.items():
        if tuple(ckpt.shape(name)) != wanted[role]:
            return names, (f"its tensor {name} is {list(ckpt.shape(name))}, not {list(wanted[role])} as its "
                           "config.json says")
    return names, ""


def eagle_spec(folder: Path, target_config: Any) -> EagleSpec | None:
    """The EAGLE-3 head in `folder` checked against a target of `target_config` (None: `folder`
    holds no EAGLE-3 head). Headers only."""
    config = read_config(folder)
    if config is None:
        return None
    folder = Path(folder)
    label = f"EAGLE-3 head (1 layer, {folder.name})"
    try:
        w = _widths(config)
        aux = aux_layers(config, int(target_config.num_hidden_layers))
        params = (len(aux) * w["target_h"] * w["h"] + 2 * w["h"] * (w["heads"] + 2 * w["kv"]) * w["d"]
                  + w["heads"] * w["d"] * w["h"] + 3 * w["h"] * w["inter"] + w["draft_vocab"] * w["h"])
        problem = _problem(config, target_config, w, aux)
    except CONFIG_ERRORS as exc:
        return EagleSpec(KIND, folder, label, 1, 0, problem=f"its config.json cannot be read ({exc})")
    names: dict[str, str] = {}
    if not problem:
        if not any(folder.glob("*.safetensors")):
            problem = "it has no .safetensors file (SpecChat never reads pickled .bin weights)"
        else:
            ckpt = Checkpoint(folder, {})
            try:
                names, problem = _find_names(ckpt, w, len(aux), bool(config.get("attention_bias")))
            finally:
                ckpt.close()
    if "embed_tokens.weight" in names:
        params += w["vocab"] * w["h"]
    return EagleSpec(KIND, folder, label, 1, params, aux, tuple(sorted(names.items())), problem)


def find_eagles(target_folder: Path, target_config: Any) -> list[EagleSpec]:
    """EAGLE-3 heads beside a target (see the module docstring), the ones that fit first."""
    places = head_places(Path(target_folder), lambda _home, name: "eagle" in name.lower())
    found = []
    for place in places:
        try:
            spec = eagle_spec(place, target_config)
        except (OSError, ValueError) as exc:  # an unreadable or damaged safetensors header
            spec = EagleSpec(KIND, place, f"EAGLE-3 head (1 layer, {place.name})", 1, 0,
                             problem=f"its files cannot be read ({exc})") if is_eagle_folder(place) else None
        if spec is not None:
            found.append(spec)
    return sorted(found, key=lambda s: bool(s.problem))
