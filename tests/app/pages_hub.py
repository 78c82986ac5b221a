"""The store tests' fake hub (tests/engine/store/hub_server.py) for the app tests, plus the
starter's repo id. Plain imports for test modules; the fixtures live in pages_fixtures.py."""

from __future__ import annotations

from pathlib import Path

from engine.testing.by_path import module_at


hub_server = module_at("hub_server", Path(__file__).resolve().parents[1] / "engine" / "store" / "hub_server.py")
HubServer = hub_server.HubServer
FakeRepo = hub_server.FakeRepo

STARTER_REPO = "HuggingFaceTB/SmolLM2-135M-Instruct"
