"""`specchat bench gpu`'s "lean" section: what a one-token step costs a layer beyond its weights,
through the general path (transformers' modules, ~70 eager launches a layer) and through the lean
step (engine.model.lean_step: CUDA graphs, one replay a run of layers between routed experts).

Three tiny models, so the times are the launches and Python and not the weights: a llama of 8
layers (one graph a step), a Qwen3-MoE GGUF and a Qwen3.5-MoE GGUF (the projection's architecture:
Gated DeltaNet layers, gated attention, a shared expert) of 8 layers each, whose routed experts run
packed on the CPU (`--experts cpu`: a replay, the states to the CPU and the experts' sum back, a
layer). Each runs
the same tokens through both paths on twin caches: the time a step and a layer, and the largest
difference of their outputs; and a tree pass of 8 tokens both ways, its chain of nodes kept after
it (a hybrid's too: its trees on committed text take the lean step). The planner's
GPU_LAYER_OVERHEAD_S (engine.planning.reference) is the general path's figure; this section
measures what the lean step leaves of it (the hardware profile measures it too, for the planner:
engine.planning.lean_timing).

On the CPU (the dry run) the lean step runs eagerly: the code path is checked, the times are not
the GPU's.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from engine import paths
from engine.loading.load import load_model
from engine.model.causal_lm import CausalLM
from engine.model.lean_step import LeanStep, refusal
from engine.planning.lean_timing import step_seconds
from engine.testing.random_gguf import synthetic_moe_gguf, synthetic_qwen35_gguf
from engine.testing.synthetic import tiny_model

LAYERS = 8
TINY_MOE = dict(hidden=256, layers=LAYERS, vocab=4096, heads=4, kv_heads=2, head_dim=64, experts=32, top_k=4,
                expert_width=256)
TINY_QWEN35 = dict(TINY_MOE, linear_k_heads=2, linear_v_heads=4, linear_head_dim=64)
PROMPT, WARM, STEPS = 16, 8, 64
PASS_TOKENS = 8


def _models(device: torch.device, dtype: torch.dtype) -> list[tuple[str, Callable[[], CausalLM]]]:
    root = paths.cache_dir() / "synthetic"

    def dense() -> CausalLM:
        return load_model(tiny_model("llama", layers=LAYERS), str(device), dtype).model

    def gguf(path: Path) -> CausalLM:
        return load_model(path, str(device), dtype, experts="cpu" if device.type == "cuda" else "auto").model

    return [("tiny llama, 8 layers", dense),
            ("tiny Qwen3-MoE GGUF, 8 layers, experts on the CPU",
             lambda: gguf(synthetic_moe_gguf(root / "lean-bench-moe.gguf", **TINY_MOE))),  # type: ignore[arg-type]
            ("tiny Qwen3.5-MoE GGUF, 8 layers (6 Gated DeltaNet), experts on the CPU",
             lambda: gguf(synthetic_qwen35_gguf(root / "lean-bench-qwen35moe.gguf", **TINY_QWEN35)))]  # type: ignore[arg-type]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _passes(model: CausalLM, lean: LeanStep | None, tokens: list[int], n: int = PASS_TOKENS) -> float:
    """Seconds a pass of n new tokens takes through the general path (`lean` None) or the lean
    step: a tree pass (its mask given) whose nodes make a chain, all kept after it, as a verified
    tree's accepted path is (a hybrid replays it through its Gated DeltaNet states)."""
    device = model.device
    model.lean = lean
    count = STEPS // n
    cache = model.new_cache(PROMPT + (count + 2) * n + 8)
    with torch.inference_mode():
        model.forward(torch.tensor(tokens[:PROMPT]), torch.arange(PROMPT), cache, None)
        for i in range(count + 2):
            if i == 2:
                _sync(device)
                start = time.perf_counter()
            at = PROMPT + i * n
            chunk = [tokens[(at + j) % len(tokens)] for j in range(n)]
            allowed = torch.ones(n, at + n, dtype=torch.bool).tril(at)
            model.forward(torch.tensor(chunk), torch.arange(at, at + n), cache, allowed)
            cache.keep(torch.arange(at + n))
        _sync(device)
    return (time.perf_counter() - start) / count


def lean_section(device: torch.device, dtype: torch.dtype, dry: bool) -> dict[str, Any]:
    rows: list[dict[str, Any]] = []
    g = torch.Generator().manual_seed(0)
    for name, build in _models(device, dtype):
        model = build()
        model.fused = None  # (a CPU model's fused C step comes first: the dry run compares these two paths)
        own = model.lean  # what the engine chose for this model on this device
        lean = own or LeanStep.of(model, anywhere=dry)
        row: dict[str, Any] = {"model": name, "layers": len(model.layers), "engine_takes_it": own is not None}
        if lean is None:
            rows.append({**row, "refused": refusal(model) or "not on a GPU"})
            continue
        tokens = torch.randint(3, model.shape.vocab_size, (PROMPT + WARM + STEPS,), generator=g).tolist()
        general, a = step_seconds(model, None, tokens, PROMPT, WARM)
        fast, b = step_seconds(model, lean, tokens, PROMPT, WARM)
        passes = _passes(model, None, tokens)
        lean_passes = _passes(model, lean, tokens)
        model.lean = own
        rows.append({**row, "general_ms": general * 1e3, "lean_ms": fast * 1e3,
                     "general_layer_ms": general * 1e3 / len(model.layers), "lean_layer_ms": fast * 1e3 / len(model.layers),
                     "segments": len(lean.segments), "graphs": lean.graphed, "why_eager": lean.why_eager,
                     "replays": lean.replays, "captures": lean.captures, "max_diff": float((a - b).abs().max()),
                     "pass_tokens": PASS_TOKENS, "general_pass_layer_ms": passes * 1e3 / len(model.layers),
                     "lean_pass_layer_ms": lean_passes * 1e3 / len(model.layers)})
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return {"rows": rows, "note": "CPU dry run: the lean step ran eagerly" if dry else "CUDA graphs where 'graphs'"}


def lean_lines(result: dict[str, Any] | None) -> list[str]:
    if not result:
        return []
    lines = [f"lean step ({result.get('note', '')}): per step and per layer, general path -> lean step"]
    for r in result.get("rows", []):
        if "refused" in r:
            lines.append(f"  {r['model']}: refused ({r['refused']})")
            continue
        lines.append(f"  {r['model']}: {r['general_ms']:.2f} -> {r['lean_ms']:.2f} ms a step, "
                     f"{r['general_layer_ms']:.3f} -> {r['lean_layer_ms']:.3f} ms a layer "
                     f"({r['segments']} segments, graphs {'on' if r['graphs'] else 'off: ' + str(r['why_eager'])}, "
                     f"outputs within {r['max_diff']:.1e}); a pass of {r['pass_tokens']}: "
                     f"{r['general_pass_layer_ms']:.3f} -> "
                     + f"{r['lean_pass_layer_ms']:.3f} ms a layer")
    return lines
