"""Remote engines in the app: the OpenAI-compatible servers the user added (Settings > Engines),
the engine choice a conversation stores, and the worker thread that talks to those servers.

The servers live in `Preferences.remote_engines` as a JSON list of {"name", "url", "api_key",
"models"} (read defensively: a hand-edited or older value gives what can be read, never an
error). A conversation's choice is '' (the local model) or {"engine": name, "model": id}.

`RemoteWorker` is an EngineWorker whose engine is an engine.serving.remote.RemoteEngine, so a
remote answer streams through the very code and signals a local one does (coalesced
`tokens_generated`, `generation_finished`, `generation_failed` with the text kept). It has its
own thread (`RemoteHost`): a remote conversation never waits behind a local model's load or
answer, and the local engine's API requests never wait behind a remote answer.
"""

from __future__ import annotations

import itertools
import json
import logging
import threading
from dataclasses import dataclass, field

from PySide6.QtCore import QObject, Signal, Slot

from app.engine_worker import EngineWorker
from app.worker_host import WorkerHost
from engine.errors import EngineError, RemoteError
from engine.types import GenerationRequest, RemoteModel

log = logging.getLogger(__name__)

LOCAL = ""  # the choice of a conversation on the local model


@dataclass(frozen=True)
class RemoteEngineEntry:
    """One server in Settings > Engines. models: the ids its last listing returned."""

    name: str
    url: str
    api_key: str = field(default="", repr=False)
    models: tuple[str, ...] = ()


def parse_engines(text: str) -> tuple[RemoteEngineEntry, ...]:
    """The saved servers; entries that cannot be read are skipped (and logged)."""
    if not text.strip():
        return ()
    try:
        items = json.loads(text)
    except json.JSONDecodeError:
        log.warning("the remote engines setting is not JSON; ignoring it")
        return ()
    entries = []
    for item in items if isinstance(items, list) else []:
        try:
            name, url = str(item["name"]).strip(), str(item["url"]).strip()
            models = tuple(str(m) for m in item.get("models") or ())
            if name and url:
                entries.append(RemoteEngineEntry(name, url, str(item.get("api_key") or ""), models))
        except (KeyError, TypeError, AttributeError):
            log.warning("skipping an unreadable remote engine entry")
    return tuple(entries)


def dump_engines(entries: tuple[RemoteEngineEntry, ...]) -> str:
    if not entries:
        return ""  # the default: a dialog saved without servers changes nothing
    return json.dumps([{"name": e.name, "url": e.url, "api_key": e.api_key, "models": list(e.models)}
                       for e in entries])


def encode_choice(engine: str, model: str) -> str:
    return json.dumps({"engine": engine, "model": model})


def decode_choice(choice: str) -> tuple[str, str] | None:
    """(engine name, model id) of a remote choice; None for the local model (or an unreadable one)."""
    if not choice:
        return None
    try:
        data = json.loads(choice)
        return str(data["engine"]), str(data["model"])
    except (json.JSONDecodeError, KeyError, TypeError):
        return None


def resolve(choice: str, entries: tuple[RemoteEngineEntry, ...]) -> RemoteModel | None:
    """The RemoteModel a conversation's choice names (None: the local model); RemoteError when
    its server was removed from the settings."""
    picked = decode_choice(choice)
    if picked is None:
        return None
    name, model = picked
    entry = next((e for e in entries if e.name == name), None)
    if entry is None:
        raise RemoteError(f"This conversation ran on the server '{name}', which is no longer in Settings > "
                          "Engines. Add it again, or pick another engine above the chat.")
    return RemoteModel(entry.url, model, entry.api_key, entry.name)


class RemoteWorker(EngineWorker):
    """An EngineWorker for remote models (see the module docstring); lives in RemoteHost's thread.

    Signals (besides EngineWorker's):
        models_listed(int, object): request id and the server's model ids (a tuple of str).
        models_failed(int, str): request id and a user message.
    """

    models_listed = Signal(int, object)
    models_failed = Signal(int, str)

    @Slot(int, object, object, object)
    def generate_remote(self, request_id: int, request: GenerationRequest, cancel: threading.Event,
                        remote: RemoteModel) -> None:
        from engine.serving.remote import (
            RemoteEngine,  # httpx2: imported in this thread, when first used
        )

        self._engine = RemoteEngine(remote)
        self.generate(request_id, request, cancel)

    @Slot(int, str, str)
    def list_models(self, request_id: int, url: str, api_key: str) -> None:
        from engine.serving.remote import list_models

        try:
            self.models_listed.emit(request_id, list_models(url, api_key))
        except EngineError as exc:
            self.models_failed.emit(request_id, exc.user_message)
        except Exception as exc:  # noqa: BLE001 - a banner, never a crash
            log.exception("listing the models of %s failed", url)
            self.models_failed.emit(request_id, f"Listing the models failed: {type(exc).__name__}: {exc}")

    def _plan(self) -> None:
        """A remote server plans its own decoding."""


class RemoteHost(WorkerHost):
    """The GUI thread's handle on the RemoteWorker (the same pattern as EngineHost)."""

    worker: RemoteWorker

    _generate_requested = Signal(int, object, object, object)
    _list_requested = Signal(int, str, str)

    def __init__(self, parent: QObject | None = None) -> None:
        super().__init__(RemoteWorker(), "remote", parent)
        self._ids = itertools.count(1 << 30)  # far from EngineHost's (Qt ints are 32-bit): a page hears both
        self._cancel_event = threading.Event()
        self._generate_requested.connect(self.worker.generate_remote)
        self._list_requested.connect(self.worker.list_models)
        self._start()

    def generate(self, request: GenerationRequest, remote: RemoteModel) -> int:
        request_id = next(self._ids)
        self._cancel_event.set()
        self._cancel_event = threading.Event()
        self._generate_requested.emit(request_id, request, self._cancel_event, remote)
        return request_id

    def cancel_generation(self) -> None:
        self._cancel_event.set()

    def list_models(self, url: str, api_key: str) -> int:
        request_id = next(self._ids)
        self._list_requested.emit(request_id, url, api_key)
        return request_id

    def _cancel(self) -> None:
        self._cancel_event.set()
