"""Finding a Gemma 4 assistant (`gemma4_assistant`) beside its target, and checking that it fits
the target: config.json files only, and decoder layers built on the meta device from the configs
(transformers' own classes), never a weight read, never code run.

An assistant reads, by layer type, the keys and values of the target's last full-attention and
last sliding-window layer before the target's K/V-sharing layers (`producers`): its layers'
K/V heads and widths must be those layers', its backbone_hidden_size the target's width, its
vocabulary the target's (engine.model.assistant loads and runs it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from huggingface_hub.errors import StrictDataclassError
from torch import nn

from engine.errors import MalformedInput
from engine.untrusted import read_json_file

ASSISTANT_TYPE = "gemma4_assistant"
TARGET_TYPES = ("gemma4_text", "gemma4")
CONFIG_LIMIT = 1 << 20  # a config.json larger than this is not an assistant's
# what a config.json that transformers refuses (or that holds the wrong kinds of values) raises
CONFIG_ERRORS = (TypeError, ValueError, KeyError, AttributeError, RuntimeError, StrictDataclassError)


@dataclass(frozen=True)
class AssistantSpec:
    """An assistant folder found beside a target (plain data): what load_assistant reads."""

    kind: str  # "assistant"
    folder: Path
    label: str
    layers: int
    params: int
    problem: str = ""  # why it cannot draft for this target ("" = it can)


def config_json(folder: Path) -> dict[str, Any] | None:
    """The folder's config.json as an object, or None: none, larger than CONFIG_LIMIT,
    unreadable, not JSON, nested too deep, not an object (a draft head's folder is looked at
    among whatever sits beside a model)."""
    path = Path(folder) / "config.json"
    try:
        if not path.is_file() or path.stat().st_size > CONFIG_LIMIT:
            return None
        data = read_json_file(path, what="a draft head's config.json", max_bytes=CONFIG_LIMIT)
    except (OSError, MalformedInput):
        return None
    return data if isinstance(data, dict) else None


def read_config(folder: Path) -> dict[str, Any] | None:
    """The folder's config.json when it describes a gemma4_assistant, else None."""
    data = config_json(folder)
    return data if data is not None and data.get("model_type") == ASSISTANT_TYPE else None


def is_assistant_folder(folder: Path) -> bool:
    return read_config(folder) is not None


def text_config(config: dict[str, Any]) -> Any:
    """The assistant's text config, with no K/V sharing (see the module docstring)."""
    from transformers import Gemma4TextConfig

    text = dict(config.get("text_config") or {})
    text.pop("model_type", None)
    text["num_kv_shared_layers"] = 0
    return Gemma4TextConfig(**text)


def layer_class() -> type[nn.Module]:
    from transformers.models.gemma4.modeling_gemma4 import Gemma4TextDecoderLayer

    cls: type[nn.Module] = Gemma4TextDecoderLayer
    return cls


def text_of(config: Any) -> Any:
    """A Gemma 4 checkpoint's text config (the multimodal wrapper's, or the config itself)."""
    get = getattr(config, "get_text_config", None)
    return get() if callable(get) else config


def producers(config: Any) -> dict[str, int]:
    """The target's layer whose K/V the assistant reads, by layer type: the last layer of that
    type before the K/V-sharing layers (Gemma4TextConfig.kv_sharing_modes' "store" layers)."""
    config = text_of(config)
    types = list(config.layer_types)
    first_shared = len(types) - int(getattr(config, "num_kv_shared_layers", 0) or 0)
    return {t: max(i for i in range(first_shared) if types[i] == t) for t in set(types[:first_shared])}


def _kv_shape(layer: nn.Module, heads: int) -> tuple[int, int]:
    attn: Any = layer.get_submodule("self_attn")
    return heads // int(attn.num_key_value_groups), int(attn.head_dim)


def problem_of(config: dict[str, Any], target_config: Any) -> str:
    """Why an assistant of `config` (its config.json) cannot draft for a target of
    `target_config` ("" = it can). Builds layers on the meta device only."""
    if getattr(target_config, "model_type", None) not in TARGET_TYPES:
        return f"it drafts for Gemma 4 models, not for a {getattr(target_config, 'model_type', '?')} model"
    target_config = text_of(target_config)
    text = config.get("text_config") or {}
    for key in ("hidden_size_per_layer_input", "vocab_size_per_layer_input"):
        if text.get(key):
            return f"its {key} is {text[key]}, and an assistant has none"
    if text.get("enable_moe_block"):
        return "it has routed experts, and an assistant has none"
    width = int(target_config.hidden_size)
    if int(config.get("backbone_hidden_size", 1536)) != width:
        return (f"it was trained for a model {config.get('backbone_hidden_size', 1536)} wide (backbone_hidden_size), "
                f"and this model is {width} wide")
    if int(text.get("vocab_size", 262_144)) != int(target_config.vocab_size):
        return f"its vocabulary has {text.get('vocab_size', 262_144)} tokens and the model's {target_config.vocab_size}"
    try:
        cfg = text_config(config)
    except (TypeError, ValueError) as exc:
        return f"its text_config cannot be read ({exc})"
    if config.get("use_ordered_embeddings") and cfg.vocab_size % int(config.get("num_centroids", 2048)):
        return "its num_centroids does not divide the vocabulary"
    wanted = producers(target_config)
    cls = layer_class()
    with torch.device("meta"):
        for i, t in enumerate(cfg.layer_types):
            if t not in wanted:
                return f"its layer {i} reads {t} keys and values, which the model does not have"
            mine = _kv_shape(cls(cfg, i), int(cfg.num_attention_heads))
            theirs = _kv_shape(cls(target_config, wanted[t]), int(target_config.num_attention_heads))
            if mine != theirs:
                return (f"its {t} layers read {mine[0]} key/value heads of width {mine[1]}, and the model's "
                        f"layer {wanted[t]} has {theirs[0]} of width {theirs[1]}")
    return ""


def _spec(folder: Path, config: dict[str, Any], target_config: Any) -> AssistantSpec:
    try:
        text = dict(config.get("text_config") or {})
        layers = int(text.get("num_hidden_layers", 0) or 0)
        h, b = int(text.get("hidden_size", 0) or 0), int(config.get("backbone_hidden_size", 1536))
        params = 2 * b * h + b * h + layers * (4 * h * h + 3 * h * int(text.get("intermediate_size", 0) or 0))
        problem = problem_of(config, target_config)
    except CONFIG_ERRORS as exc:
        layers, params, problem = 0, 0, f"its config.json cannot be read ({exc})"
    return AssistantSpec("assistant", Path(folder), f"Gemma 4 assistant ({layers} layers, {Path(folder).name})",
                         layers, params, problem)


def head_places(target: Path, named: Callable[[Path, str], bool]) -> list[Path]:
    """Folders a draft head shipped with `target` (a model folder or file) may sit in: the
    target folder's subfolders, the folders beside it whose name `named(target, name)` accepts,
    and in the Hugging Face cache's layout the snapshots of the repos beside the target's repo
    whose name it accepts (`named(repo folder, name)`). [] when the folders cannot be listed."""
    places: list[Path] = []

    def beside(home: Path) -> list[Path]:
        return sorted(p for p in home.parent.iterdir() if p.is_dir() and p != home and named(home, p.name))

    try:
        if target.is_dir():
            places += sorted(p for p in target.iterdir() if p.is_dir())
        if target.parent != target and target.parent.is_dir():
            places += beside(target)
        repo = target.parent.parent
        if target.parent.name == "snapshots" and repo.name.startswith("models--"):
            for other in beside(repo):
                places += sorted(p for p in (other / "snapshots").glob("*") if p.is_dir())
    except OSError:
        return []
    return places


def find_assistants(target_folder: Path, target_config: Any) -> list[AssistantSpec]:
    """Assistant folders shipped beside a Gemma 4 target: its subfolders, and its siblings whose
    name extends the target folder's (Google publishes google/gemma-4-E2B-it-assistant for
    google/gemma-4-E2B-it), in a plain folder or the Hugging Face cache's layout
    (models--google--gemma-4-E2B-it-assistant/snapshots/*). Reads config.json files only. Ones
    that do not fit the target are listed with their `problem`, after the ones that do."""
    if getattr(target_config, "model_type", None) not in TARGET_TYPES:
        return []
    places = head_places(Path(target_folder), lambda home, name: name.startswith(home.name))
    found = []
    for place in places:
        config = read_config(place)
        if config is not None:
            found.append(_spec(place, config, target_config))
    return sorted(found, key=lambda s: bool(s.problem))  # the usable ones first
