"""The drafts a user can choose by hand for a model on disk, as the app's Draft box lists them:
the heads the model brings (MTP / NextN layers in its checkpoint; Gemma 4 assistants and EAGLE-3
heads in folders beside it, engine.model.heads) and the self-draft at each width. Config files and
safetensors headers only: nothing is loaded, so listing is fast enough for a combo box.

Each entry is the draft spec engine.decoding.pair.load_engine takes ("mtp", a head's folder,
"self", "self:BITS"), a label, and, for a head that is found but cannot draft for this model, the
reason (the app lists it, disabled, with that reason, so a user who expected it learns why).

What this module does not do: price or pick drafts (draft_choice.py; "auto" does that at load).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from engine.errors import EngineError

log = logging.getLogger(__name__)

SELF_ENTRIES = (("self", "Self-draft (bits sized to the memory left)"), ("self:4", "Self-draft, 4-bit"),
                ("self:3", "Self-draft, 3-bit"), ("self:2", "Self-draft, 2-bit"))


@dataclass(frozen=True)
class DraftEntry:
    spec: str  # what load_engine takes as the draft
    label: str
    problem: str = ""  # why it cannot draft for this model ("" = it can)


def head_entries(target: Path) -> list[DraftEntry]:
    """The heads found for the model folder `target` (none for a GGUF file, which keeps no draft
    layers, or for a folder that is not a loadable model: its load says why)."""
    from engine.loading.load import check_folder  # noqa: PLC0415 -- transformers' import is slow
    from engine.loading.multimodal import config_object, text_config
    from engine.model.heads import find_heads

    if not target.is_dir():
        return []
    try:
        config_dict = check_folder(target)
        text = text_config(config_dict, target.name)
        config = config_object(text if text is not None else config_dict)
        found = find_heads(target, config)
    except (EngineError, OSError, ValueError) as exc:
        log.info("no draft heads listed for %s: %s", target, exc)
        return []
    entries = []
    for spec in found:
        kind = str(getattr(spec, "kind", ""))
        problem = str(getattr(spec, "problem", "") or "")
        spec_text = "mtp" if kind == "mtp" else str(getattr(spec, "folder"))
        entries.append(DraftEntry(spec_text, str(spec.label), problem))
    return entries


def self_entries() -> list[DraftEntry]:
    return [DraftEntry(spec, label) for spec, label in SELF_ENTRIES]
