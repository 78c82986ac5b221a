"""The serving tests' helpers for the app tests (imported by name, like pages_hub): `specchat
serve` as a subprocess (tests/engine/serving/serve_process.py), the vLLM stand-in
(tests/engine/serving/vllm_standin.py) and the chat templates of the tool formats
(tests/engine/serving/templates.py), loaded under the same module names."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

from engine.testing.by_path import module_at

SERVING = Path(__file__).resolve().parents[1] / "engine" / "serving"


def _module(name: str) -> ModuleType:
    return module_at(name, SERVING / f"{name}.py")


serve_process = _module("serve_process")
templates = _module("templates")  # chat templates in the formats the server reads (Qwen, harmony, ...)
vllm_standin = _module("vllm_standin")
ServeProcess = serve_process.ServeProcess
SERVE_KEY = serve_process.API_KEY
VllmStandIn = vllm_standin.VllmStandIn
VLLM_MODEL = vllm_standin.MODEL
