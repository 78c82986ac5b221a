"""Model store: catalog, local registry, downloads (see DESIGN.md, store/).

Public API: `resolve_model`, `download_model`, `DownloadSettings`, `list_local_models`,
`import_model`, `remove_model`, `load_catalog`.
"""

from __future__ import annotations

from pathlib import Path

from engine.store.catalog import Catalog, CatalogModel, load_catalog
from engine.store.download import download_model
from engine.store.paths import default_models_dir, hf_hub_cache_dir
from engine.store.registry import LocalModel, find_local_model, import_model, list_local_models, remove_model
from engine.store.transfer import DownloadSettings

__all__ = [
    "Catalog", "CatalogModel", "DownloadSettings", "LocalModel", "default_models_dir", "download_model",
    "find_local_model", "hf_hub_cache_dir", "import_model", "list_local_models", "load_catalog",
    "remove_model", "resolve_model",
]


def resolve_model(spec: str, models_dir: Path | None = None) -> Path | None:
    """The local folder or .gguf for a catalog id or `owner/name` repo id, or None if not present.

    Looks in the models folder first, then the standard Hugging Face cache. Never downloads.
    """
    model = find_local_model(spec, models_dir or default_models_dir(), hf_hub_cache_dir(), load_catalog())
    return model.path if model is not None else None
