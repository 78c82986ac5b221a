"""A vision-language checkpoint read as its text model.

Gemma 3 (27B) and Qwen3.5/3.6 ship as image-text wrappers: config.json is a `gemma3`,
`qwen3_5` or `qwen3_5_moe` config whose `text_config` is the decoder (`gemma3_text`,
`qwen3_5_text`, `qwen3_5_moe_text`), and the weights hold the decoder under a prefix
(`language_model.model.*` in Gemma 3's original layout, `model.language_model.*` in
Qwen3.5's and in what transformers 5 saves) beside a vision tower and its projector. SpecChat
runs the text model: `text_config` becomes the model's config, the decoder's weights are
served under the text model's names (Checkpoint.add_prefix), and the vision tower is skipped
with one log line.

The rule is general, not a list of models: any wrapper transformers knows (its config class
is in CONFIG_MAPPING; no remote code) whose text config is a family SpecChat runs. What the
wrapper's own class reads from the outer config carries over into the text config: the head
tying (the wrapper ties its lm_head by its own `tie_word_embeddings`, whose default is the
wrapper class's), token ids, logit soft-capping, the quantisation of its weights.

What this module does not do: tokenizers (the folder's own, load.py) or images.
"""

from __future__ import annotations

import logging
import re
from typing import Any

from transformers import CONFIG_MAPPING

from engine.errors import UnsupportedModel
from engine.loading.checkpoint import Checkpoint
from engine.model.family import FAMILIES

log = logging.getLogger(__name__)

# how wrappers store their decoder: stored prefix -> the text model's prefix
TEXT_PREFIXES = (
    ("model.language_model.", "model."),  # Qwen3.5/3.6, and every wrapper transformers 5 saves
    ("language_model.model.", "model."),  # Gemma 3, LLaVA and Mistral 3 as released
    ("language_model.lm_head.", "lm_head."),
)
# tensors of the vision side, skipped (a Gemma 3 SigLIP tower, Qwen's `visual`, the projectors)
VISION = re.compile(r"(^|\.)(vision_tower|vision_model|visual|multi_modal_projector|mm_projector)\.")
# fields of the outer config the text model takes over when the outer config.json sets them
CARRIED = ("tie_word_embeddings", "final_logit_softcapping", "attn_logit_softcapping", "bos_token_id",
           "eos_token_id", "pad_token_id", "quantization_config", "dtype", "torch_dtype")
VISION_SKIPPED = "vision tower skipped: SpecChat runs the text model"


def text_config(config: dict, name: str) -> dict | None:
    """The text model's config.json dict of a vision-language wrapper, or None when `config`
    is not one (a text model's own config, or a family SpecChat does not run: left to the
    family check, which names it). UnsupportedModel for a damaged `text_config`."""
    outer = config.get("model_type")
    if outer in FAMILIES or "text_config" not in config or not isinstance(outer, str) or outer not in CONFIG_MAPPING:
        return None
    inner = config["text_config"]
    if not isinstance(inner, dict):
        raise UnsupportedModel(f"'{name}' has a config.json whose text_config is not an object; it is damaged. "
                               "Re-download the model.")
    text = dict(inner)
    wrapper = CONFIG_MAPPING[outer]
    if "model_type" not in text:  # left to the wrapper's default text model
        default = getattr(wrapper, "sub_configs", {}).get("text_config")
        text["model_type"] = getattr(default, "model_type", "")
    if text.get("model_type") not in FAMILIES:
        return None
    for key in CARRIED:
        if config.get(key) is not None:
            text[key] = config[key]
    default_tie = getattr(wrapper, "tie_word_embeddings", None)  # what the wrapper class ties by default
    if config.get("tie_word_embeddings") is None and isinstance(default_tie, bool):
        text["tie_word_embeddings"] = default_tie
    return text


def add_text_names(ckpt: Checkpoint) -> None:
    """Serve a wrapper checkpoint's decoder under the text model's names; log once when a
    vision tower is there (its tensors are never read)."""
    for stored, model in TEXT_PREFIXES:
        ckpt.add_prefix(stored, model)
    if any(VISION.search(n) for n in ckpt.stored_names()):
        log.info(VISION_SKIPPED)


def is_vision(name: str) -> bool:
    return VISION.search(name) is not None


def config_object(text: dict[str, Any]) -> Any:
    """The transformers config object of a text config dict (its model_type's class)."""
    return CONFIG_MAPPING[text["model_type"]].from_dict(text)
