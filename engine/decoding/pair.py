"""A target/draft pair loaded into a ready Engine: the one way the CLI, the app and the server
load models. Loads the target (leaving room on the GPU for the draft), the draft, checks that
they share a tokenizer, and gives the Engine the files its KV caches are saved to.

What this module does not do: decode (generation.py) or read weight files (engine.loading).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

from engine import paths
from engine.decoding.generation import Engine
from engine.decoding.learned import learned_file
from engine.errors import Cancelled
from engine.loading.load import check_pair, load_model, resolve_device, resolve_path
from engine.loading.materialise import resident_bytes
from engine.model.cache_files import CacheFiles, install_key
from engine.model.causal_lm import CausalLM
from engine.types import CacheSettings, LoadProgress, LoadSettings, LoadStage


def load_engine(
    target: str | Path,
    draft: str | Path | None = None,
    settings: LoadSettings = LoadSettings(),
    progress: Callable[[LoadProgress], None] | None = None,
    cancel: threading.Event | None = None,
) -> Engine:
    """Load a target (and optional draft) and return a ready Engine: the one entry point the
    CLI and the app share. `progress` is called from the calling thread; `cancel` is checked
    between loading steps and raises Cancelled."""

    def report(stage: LoadStage, fraction: float, message: str) -> None:
        if cancel is not None and cancel.is_set():
            raise Cancelled("Loading was cancelled.")
        if progress is not None:
            progress(LoadProgress(stage, fraction, message))

    device, dtype = resolve_device(settings.device)
    report("target", 0.0, f"loading {target} on {device}")
    # the draft is loaded after the target, fully on the GPU: the target's placement leaves room
    reserve = resident_bytes(resolve_path(str(draft)), dtype) if draft is not None and device == "cuda" else 0
    loaded_target = load_model(
        target, device=device, dtype=dtype, quant=settings.quant, offload=settings.offload,
        ram_limit_bytes=settings.ram_limit_bytes, context_length=settings.context_length,
        reserve_bytes=reserve, report=lambda f, m: report("target", 0.8 * f, m))
    loaded_draft = None
    if draft is not None:
        report("draft", 0.8, f"loading draft {draft}")
        loaded_draft = load_model(draft, device=device, dtype=dtype)
        check_pair(loaded_target, loaded_draft)
    report("ready", 1.0, "ready")
    draft_model = loaded_draft.model if loaded_draft else None
    return Engine(loaded_target.model, loaded_target.tokenizer, draft_model, settings.cache,
                  cache_files(settings.cache, loaded_target.model, draft_model),
                  learned=learned_file(loaded_target.model, draft_model))


def cache_files(settings: CacheSettings, target: CausalLM, draft: CausalLM | None) -> CacheFiles | None:
    """Where this pair's KV caches are saved (None when saving is off or a model has no
    fingerprint)."""
    if settings.disk_budget_bytes <= 0 or not target.fingerprint or (draft is not None and not draft.fingerprint):
        return None
    pair = f"{target.fingerprint}+{draft.fingerprint if draft is not None else 'none'}"
    root = Path(settings.disk_dir) if settings.disk_dir else paths.cache_dir() / "kv"
    return CacheFiles(root, pair, install_key(paths.data_dir() / "kv-cache.key"), settings.disk_budget_bytes)
