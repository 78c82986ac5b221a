"""The store tests' fake hub (tests/engine/store/hub_server.py) for the app tests, plus the
starter's repo id. Plain imports for test modules; the fixtures live in pages_fixtures.py."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path


def _hub_server_module():  # type: ignore[no-untyped-def]
    """tests/engine/store/hub_server.py, shared with the store's own tests (same module name)."""
    module = sys.modules.get("hub_server")
    if module is None:
        path = Path(__file__).resolve().parents[1] / "engine" / "store" / "hub_server.py"
        spec = importlib.util.spec_from_file_location("hub_server", path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules["hub_server"] = module
        spec.loader.exec_module(module)
    return module


hub_server = _hub_server_module()
HubServer = hub_server.HubServer
FakeRepo = hub_server.FakeRepo

STARTER_REPO = "HuggingFaceTB/SmolLM2-135M-Instruct"
