"""The user's preferences: one frozen dataclass and a QSettings-backed store.

`Preferences` is plain data the whole app passes around; it turns itself into the engine's
settings (`sampling()`, `speculation()`, `load_settings()`). `PreferencesStore` reads and writes
it under the "preferences/" group of a QSettings (the app's default, or an INI file in tests) and
announces every save, so the main window can re-theme or reload without polling.

Values that cannot be read back (a hand-edited file, a setting from an older version) fall back
to their defaults one field at a time; loading never fails.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

from PySide6.QtCore import QObject, QSettings, Signal

from engine import paths
from engine.types import (
    CacheSettings,
    LoadSettings,
    SamplingSettings,
    SpeculationSettings,
)
from engine.units import GB

log = logging.getLogger(__name__)

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

_GROUP = "preferences"


@dataclass(frozen=True)
class Preferences:
    """Everything the user can set. Change with `dataclasses.replace`.

    budget 0 = automatic (the planner's choice for this machine and pair). models_dir "" = the
    engine's default folder. target/draft: a catalog id, a repo id or a local path ("" = none).
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
    device: str = "auto"
    quant: str = "none"
    offload: str = "auto"
    budget: int = 0
    max_depth: int = 16
    tree_mode: str = "specexec"
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
    draft: str = ""
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

    def speculation(self, auto_budget: int | None = None, switch_draft: bool = True) -> SpeculationSettings:
        """The tree shape. With budget 0 (automatic) the caller may pass the planner's budget
        as `auto_budget`; without one the engine's default budget is used. The engine turns the
        draft off for a conversation where it is measured not to pay, unless the user keeps it
        on (`keep_draft`) or the caller measures the trees (`switch_draft=False`: the wizard's
        calibration)."""
        default = SpeculationSettings()
        budget = self.budget if self.budget > 0 else (auto_budget or default.budget)
        return replace(default, mode=self.tree_mode, budget=budget, max_depth=self.max_depth,  # type: ignore[arg-type]
                       switch_draft=switch_draft and not self.keep_draft)

    def speculation_for(self, plan: object | None) -> SpeculationSettings:
        """The tree shape a chat or API request uses: the user's budget, or with budget 0 (auto)
        the planner's budget, depth and mode (the engine's default budget without a plan)."""
        spec = self.speculation()
        if self.budget > 0 or plan is None:
            return spec
        if getattr(plan, "mode", "") == "autoregressive":
            return replace(spec, mode="autoregressive")
        return replace(spec, budget=int(plan.budget), max_depth=int(plan.max_depth))  # type: ignore[attr-defined]

    def load_settings(self) -> LoadSettings:
        return LoadSettings(
            device=self.device,  # type: ignore[arg-type]
            quant=self.quant,  # type: ignore[arg-type]
            offload=self.offload,  # type: ignore[arg-type]
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


def _decode(name: str, raw: Any, default: Any) -> Any:
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


def _encode(value: Any) -> Any:
    if isinstance(value, tuple):
        return json.dumps([list(item) for item in value])
    if isinstance(value, bool):
        return "true" if value else "false"
    return value


class PreferencesStore(QObject):
    """Reads and writes `Preferences` in a QSettings.

    Signals:
        changed(object): a `Preferences` was saved (the new value).
    """

    changed = Signal(object)

    def __init__(self, settings: QSettings | None = None, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self._settings = settings if settings is not None else QSettings("SpecChat", "SpecChat")

    @property
    def settings(self) -> QSettings:
        return self._settings

    def load(self) -> Preferences:
        defaults = Preferences()
        values: dict[str, Any] = {}
        self._settings.beginGroup(_GROUP)
        try:
            for f in fields(Preferences):
                if not self._settings.contains(f.name):
                    continue
                default = getattr(defaults, f.name)
                raw = self._settings.value(f.name)
                try:
                    values[f.name] = _decode(f.name, raw, default)
                except (ValueError, TypeError, json.JSONDecodeError) as exc:
                    log.warning("preference %s unreadable (%s); using the default", f.name, exc)
        finally:
            self._settings.endGroup()
        return replace(defaults, **values)

    def save(self, prefs: Preferences) -> None:
        self._settings.beginGroup(_GROUP)
        try:
            for f in fields(Preferences):
                self._settings.setValue(f.name, _encode(getattr(prefs, f.name)))
        finally:
            self._settings.endGroup()
        self._settings.sync()
        try:  # the CLI reads the models folder from the shared settings file (engine.paths)
            paths.set_shared_setting("models_dir", prefs.models_dir)
        except OSError as exc:
            log.warning("could not write %s: %s", paths.settings_file(), exc)
        self.changed.emit(prefs)

    def update(self, **changes: Any) -> Preferences:
        """Load, replace the given fields, save; returns the saved value."""
        prefs = replace(self.load(), **changes)
        self.save(prefs)
        return prefs
