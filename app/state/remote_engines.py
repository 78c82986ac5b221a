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

import json
import logging
from dataclasses import dataclass, field

from engine.errors import RemoteError
from engine.types import RemoteModel

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
