"""The curated catalog (resources/catalog.json): target/draft pairs that share a tokenizer.

Loads and validates the JSON into frozen dataclasses. The catalog only *describes* models;
it is never written by the app. Sizes in it are for display and planning; the downloader
takes exact sizes and checksums from the hub at download time.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.errors import UnsupportedModel
from engine.paths import resource
from engine.types import LayerShape, ModelShape

log = logging.getLogger(__name__)

SCHEMA_VERSION = 1
_SHAPE_KEYS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_kv_heads", "head_dim")
DEFAULT_CATALOG_PATH = resource("catalog.json")


@dataclass(frozen=True)
class MemoryNeed:
    """Estimated memory for one quantisation, in GB (10**9 bytes)."""

    quantisation: str
    ram_gb: float
    vram_min_gb: float
    vram_full_gb: float


@dataclass(frozen=True)
class FallbackSource:
    """A second source for a model when the hub cannot be reached (a GGUF inside a PyPI wheel)."""

    kind: str
    package: str
    version: str
    file: str
    download_bytes: int


@dataclass(frozen=True)
class CatalogModel:
    id: str
    repo_id: str
    revision: str
    role: str
    files: tuple[str, ...]
    shards: int
    download_bytes: int
    parameters: int
    layers: int
    vocab_rows: int
    dtype: str
    prequantised: str | None
    memory: tuple[MemoryNeed, ...]
    license: str
    gated: bool
    template: str
    description: str
    fallback: FallbackSource | None = None
    # decoder-layer shape from the model's published config.json (the planner's cost model)
    hidden_size: int | None = None
    intermediate_size: int | None = None
    num_attention_heads: int | None = None
    num_kv_heads: int | None = None
    head_dim: int | None = None

    @property
    def licence_url(self) -> str:
        return f"https://huggingface.co/{self.repo_id}"

    def shape(self) -> ModelShape:
        """The model's shape for the cost model: from the entry's shape fields; without them, a
        layer sized from the parameter count (hidden size from the usual aspect ratio)."""
        if self.hidden_size and self.intermediate_size and self.num_attention_heads and self.num_kv_heads \
                and self.head_dim:
            layer = LayerShape(self.id, self.hidden_size, self.intermediate_size, self.num_attention_heads,
                               self.num_kv_heads, self.head_dim)
        else:
            hidden = 128 * max(1, round(math.sqrt(self.parameters / self.layers / 12) / 128))
            layer = LayerShape(self.id, hidden, int(3.5 * hidden), hidden // 128, max(1, hidden // 1024), 128)
        return ModelShape(self.id, self.layers, layer, self.vocab_rows)


@dataclass(frozen=True)
class CatalogPair:
    id: str
    target: str
    draft: str
    description: str
    note: str


@dataclass(frozen=True)
class Catalog:
    schema_version: int
    checked_on: str
    starter: str
    models: tuple[CatalogModel, ...]
    pairs: tuple[CatalogPair, ...]

    def find(self, spec: str) -> CatalogModel | None:
        """A model by catalog id or by repo id (repo ids compare case-insensitively, as on the hub)."""
        lowered = spec.lower()
        for model in self.models:
            if model.id == spec or model.repo_id.lower() == lowered:
                return model
        return None

    def pair(self, pair_id: str) -> CatalogPair | None:
        return next((p for p in self.pairs if p.id == pair_id), None)


def load_catalog(path: Path | None = None) -> Catalog:
    """Read and validate the catalog; a malformed file raises UnsupportedModel naming the entry."""
    source = path or DEFAULT_CATALOG_PATH
    try:
        raw = json.loads(source.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise UnsupportedModel(
            f"The model catalog {source} cannot be read ({exc}). Reinstall SpecChat to restore it."
        ) from exc
    if not isinstance(raw, dict) or not isinstance(raw.get("models"), list):
        raise UnsupportedModel(
            f"The model catalog {source} is damaged (not an object with a list of models). Reinstall SpecChat "
            "to restore it."
        )
    if raw.get("schema_version") != SCHEMA_VERSION:
        raise UnsupportedModel(
            f"The model catalog {source} has schema version {raw.get('schema_version')!r}; this "
            f"SpecChat reads version {SCHEMA_VERSION}. Update SpecChat."
        )
    models = tuple(_parse_model(entry, source) for entry in raw["models"])
    ids = {m.id for m in models}
    if len(ids) != len(models):
        raise UnsupportedModel(f"The model catalog {source} lists a model id twice.")
    try:
        pairs = tuple(
            CatalogPair(p["id"], p["target"], p["draft"], p["description"], p.get("note", ""))
            for p in raw.get("pairs", [])
        )
        starter, checked_on = raw["starter"], str(raw["checked_on"])
    except (KeyError, TypeError, AttributeError) as exc:
        raise UnsupportedModel(f"The model catalog {source} is damaged ({exc!r}). Reinstall SpecChat.") from exc
    for pair in pairs:
        if pair.target not in ids or pair.draft not in ids:
            raise UnsupportedModel(f"Catalog pair {pair.id!r} names a model that is not in the catalog.")
    if starter not in ids:
        raise UnsupportedModel(f"The catalog's starter {starter!r} is not one of its models.")
    return Catalog(raw["schema_version"], checked_on, starter, models, pairs)


def usable_catalog(path: Path | None = None) -> Catalog:
    """The catalog, or an empty one (with one warning) when the file is damaged: models in the
    models folder, imports and `owner/name` repo ids work without it."""
    try:
        return load_catalog(path)
    except UnsupportedModel as exc:
        log.warning("%s Until then catalog ids are unknown; local models and owner/name repo ids still work.",
                    exc.user_message)
        return Catalog(SCHEMA_VERSION, "unavailable", "", (), ())


def _parse_model(entry: dict[str, Any], source: Path) -> CatalogModel:
    if not isinstance(entry, dict):
        raise UnsupportedModel(f"The model catalog {source} has an entry that is not an object ({entry!r:.60}). "
                               "Reinstall SpecChat to restore the catalog.")
    try:
        fallback = entry.get("fallback")
        return CatalogModel(
            id=entry["id"],
            repo_id=entry["repo_id"],
            revision=entry.get("revision", "main"),
            role=entry["role"],
            files=tuple(entry["files"]),
            shards=int(entry["shards"]),
            download_bytes=int(entry["download_bytes"]),
            parameters=int(entry["parameters"]),
            layers=int(entry["layers"]),
            vocab_rows=int(entry["vocab_rows"]),
            dtype=entry["dtype"],
            prequantised=entry.get("prequantised"),
            memory=tuple(
                MemoryNeed(q, float(m["ram_gb"]), float(m["vram_min_gb"]), float(m["vram_full_gb"]))
                for q, m in entry["memory"].items()
            ),
            license=entry["license"],
            gated=bool(entry["gated"]),
            template=entry["template"],
            description=entry["description"],
            fallback=FallbackSource(
                fallback["kind"], fallback["package"], fallback["version"], fallback["file"],
                int(fallback["download_bytes"]),
            )
            if fallback
            else None,
            **{k: int(v) for k, v in entry.get("shape", {}).items() if k in _SHAPE_KEYS},
        )
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise UnsupportedModel(
            f"Catalog entry {entry.get('id', '?')!r} in {source} is malformed ({exc!r}). "
            "Reinstall SpecChat to restore the catalog."
        ) from exc
