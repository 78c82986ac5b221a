"""The model store: the curated catalog, the models on this machine, and downloads.

Contract: catalog.py reads resources/catalog.json (pairs that share a tokenizer, or draft-free
ones; a GGUF entry is one .gguf file of its repo, and only that file is fetched or counts as that
model; an entry SpecChat cannot run yet is listed, never paired, and its download is refused
before any request); registry.py
lists local models (the models folder, the Hugging Face cache) and imports or removes them
(names.py: which import names are allowed and when two are the same; integrity.py: whether a
model's files are whole, from gguf_header.py's and safetensors_header.py's bounded header reads);
discover.py finds the GGUFs LM Studio and Ollama keep (gguf_header.py reads their headers);
download.py fetches a repo or a GGUF resumably, verified against the hub's sizes and SHA-256
(transfer.py, the HTTP part; remote.py, the hub's listings; hub_cache.py, the HF cache layout).

Public API: `resolve_model`, `download_model`, `DownloadSettings`, `list_local_models`,
`import_model`, `remove_model`, `load_catalog` (strict), `usable_catalog` (empty, with a warning,
when the catalog file is damaged), `discover_models` (plain data: FoundModel, Discovery).

Everything read from outside (manifests, settings, indexes, refs, state files, the catalog) goes
through engine.untrusted: regular files only, size and nesting bounded; a bad file is one line
(a `!` line in a listing, or a warning) and the rest still works.

What it does not do: load models (engine.loading) or import torch.
"""

from __future__ import annotations

from pathlib import Path

from engine.store.catalog import Catalog, CatalogModel, load_catalog, usable_catalog
from engine.store.discover import (
    Discovery,
    FoundModel,
    HeaderFacts,
    discover_models,
    locate_found,
)
from engine.store.download import download_model
from engine.store.paths import default_models_dir, hf_hub_cache_dir
from engine.store.registry import (
    LocalModel,
    find_local_model,
    import_model,
    list_local_models,
    remove_model,
)
from engine.store.transfer import DownloadSettings

__all__ = [
    "Catalog", "CatalogModel", "Discovery", "DownloadSettings", "FoundModel", "HeaderFacts", "LocalModel",
    "default_models_dir", "discover_models", "download_model", "find_local_model", "hf_hub_cache_dir",
    "import_model", "list_local_models", "load_catalog", "remove_model", "resolve_model", "usable_catalog",
]


def resolve_model(spec: str, models_dir: Path | None = None) -> Path | None:
    """The local folder or .gguf for a catalog id or `owner/name` repo id, or None if not present.

    Looks in the models folder first, then the standard Hugging Face cache, then the GGUFs LM
    Studio and Ollama keep, by the name `specchat models list` shows. Never downloads.
    """
    model = find_local_model(spec, models_dir or default_models_dir(), hf_hub_cache_dir(), usable_catalog())
    return model.path if model is not None else locate_found(spec)
