"""The user's preferences kept in a QSettings, announced on every save.

`PreferencesStore` reads and writes `Preferences` (app/state/preferences.py) under the
"preferences/" group of a QSettings (the app's default, or an INI file in tests) and emits
`changed` after every save, so the main window can re-theme or reload without polling. Values
that cannot be read back (a hand-edited file, a setting from an older version) fall back to
their defaults one field at a time; loading never fails.
"""

from __future__ import annotations

import json
import logging
from dataclasses import fields, replace
from typing import Any

from PySide6.QtCore import QObject, QSettings, Signal

from app.state.preferences import Preferences, decode_value, encode_value
from engine import paths

log = logging.getLogger(__name__)

_GROUP = "preferences"


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
                    values[f.name] = decode_value(f.name, raw, default)
                except (ValueError, TypeError, json.JSONDecodeError) as exc:
                    log.warning("preference %s unreadable (%s); using the default", f.name, exc)
        finally:
            self._settings.endGroup()
        return replace(defaults, **values)

    def save(self, prefs: Preferences) -> None:
        self._settings.beginGroup(_GROUP)
        try:
            for f in fields(Preferences):
                self._settings.setValue(f.name, encode_value(getattr(prefs, f.name)))
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
