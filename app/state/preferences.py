"""The user's preferences: one frozen dataclass, plain data the whole app passes around.

`Preferences` turns itself into the engine's settings (`sampling()`, `speculation()`,
`load_settings()`); `decode_value` / `encode_value` turn one field to and from what a settings
file holds (app/state/preferences_store.py keeps them in a QSettings). Qt-free.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from engine import paths
from engine.types import (
    CacheSettings,
    DecodeMode,
    Device,
    LoadSettings,
    Offload,
    Quant,
    SamplingSettings,
    SpeculationSettings,
)
from engine.units import GB

DEFAULT_SYSTEM_PRESETS: tuple[tuple[str, str], ...] = (
    ("Default", "You are a helpful assistant."),
    ("Concise", "You are a helpful assistant. Answer briefly and to the point."),
    ("Coder", "You are an expert programmer. Answer with correct, idiomatic code and short explanations."),
    ("Tutor", "You are a patient tutor. Explain step by step and check understanding."),
)

# Allowed values of the string fields; anything else read back falls to the default.
CHOICES: dict[str, tuple[str, ...]] = {
    "device": ("auto", "cpu", "cuda"),
    "quant": ("none", "nf4"),
    "offload": ("auto", "none", "all"),
    "tree_mode": ("specexec", "autoregressive"),
    "theme": ("system", "light", "dark"),
}



@dataclass(frozen=True)
class Preferences:
    """Everything the user can set. Change with `dataclasses.replace`.

    budget 0 = automatic (engine.decoding.auto_budget chooses per request, for this machine and
    pair). models_dir "" = the engine's default folder. target/draft: a catalog id, a repo id or a local path ("" = none);
    draft also "auto" (the engine picks: engine.decoding.draft_choice, the default) or "self" (a self-draft).
    """

    # Sampling
    temperature: float = 0.7
    top_p: float = 0.9
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.1  # as LM Studio and Ollama: the small starter loops without it
    max_new_tokens: int = 1024
    context_length: int = 4096
    # Engine
    device: Device = "auto"
    quant: Quant = "none"
    offload: Offload = "auto"
    budget: int = 0
    max_depth: int = 16
    tree_mode: DecodeMode = "specexec"
    keep_draft: bool = False  # keep the draft on where it is measured slower than decoding without it
    models_dir: str = ""
    # KV caches of conversations (engine.types.CacheSettings): kept in RAM, saved on disk
    kv_ram_gb: float = 2.0
    kv_disk_gb: float = 8.0
    # Appearance
    theme: str = "system"
    font_size: int = 11
    # Active pair and first run
    target: str = ""
    draft: str = "auto"
    first_run_done: bool = False
    system_presets: tuple[tuple[str, str], ...] = DEFAULT_SYSTEM_PRESETS
    # API server (Settings > Server, app/workers/api_server.py): port 0 = any free port (tests)
    server_enabled: bool = False
    server_port: int = 8765
    server_api_key: str = ""
    server_lan: bool = False  # listen on every network (needs the key), not only this computer
    server_allowed_hosts: str = ""  # Host names let in beside this computer's own (engine.serving.guard)
    server_allowed_origins: str = ""  # web pages whose scripts may use the API (CORS)
    # Remote engines (Settings > Engines): JSON, read by app/remote_engines.parse_engines
    remote_engines: str = ""

    def sampling(self, seed: int | None = None) -> SamplingSettings:
        return SamplingSettings(
            temperature=self.temperature,
            top_k=self.top_k,
            top_p=self.top_p,
            min_p=self.min_p,
            repetition_penalty=self.repetition_penalty,
            seed=seed,
        )

    def speculation(self, switch_draft: bool = True) -> SpeculationSettings:
        """The tree shape every request of the app carries: the user's budget, or budget 0 when
        it is automatic, which engine.decoding.auto_budget.AutoBudget (the workers decode
        through it) turns into the planner's choice for this pair and machine, per request.
        The engine turns the draft off for a conversation where it is measured not to pay,
        unless the user keeps it on (`keep_draft`) or the caller measures the trees
        (`switch_draft=False`: the wizard's calibration)."""
        return replace(SpeculationSettings(), mode=self.tree_mode, budget=max(0, self.budget),
                       max_depth=self.max_depth, switch_draft=switch_draft and not self.keep_draft)

    def load_settings(self) -> LoadSettings:
        return LoadSettings(
            device=self.device,
            quant=self.quant,
            offload=self.offload,
            context_length=self.context_length,
            cache=CacheSettings(ram_budget_bytes=int(self.kv_ram_gb * GB), disk_budget_bytes=int(self.kv_disk_gb * GB)),
        )

    def models_path(self) -> Path:
        """The models folder to use: the user's choice, else the engine's default (which reads
        the choice back from the settings file shared with the CLI)."""
        return Path(self.models_dir).expanduser() if self.models_dir else paths.models_dir()

    @property
    def has_pair(self) -> bool:
        return bool(self.target)


def decode_value(name: str, raw: Any, default: Any) -> Any:
    """One stored value back to the field's type; raises ValueError/TypeError when it can't."""
    if isinstance(default, bool):  # before int: bool is an int
        if isinstance(raw, bool):
            return raw
        text = str(raw).strip().lower()
        if text in ("true", "1", "yes"):
            return True
        if text in ("false", "0", "no"):
            return False
        raise ValueError(f"not a bool: {raw!r}")
    if isinstance(default, int):
        return int(str(raw).strip())
    if isinstance(default, float):
        return float(str(raw).strip())
    if isinstance(default, tuple):  # system_presets, stored as JSON
        items = json.loads(raw) if isinstance(raw, str) else raw
        presets = tuple((str(title), str(text)) for title, text in items)
        if not presets:
            raise ValueError("no presets")
        return presets
    value = "" if raw is None else str(raw)
    if name in CHOICES and value not in CHOICES[name]:
        raise ValueError(f"{name} must be one of {CHOICES[name]}, not {value!r}")
    return value


def encode_value(value: Any) -> Any:
    if isinstance(value, tuple):
        return json.dumps([list(item) for item in value])
    if isinstance(value, bool):
        return "true" if value else "false"
    return value
