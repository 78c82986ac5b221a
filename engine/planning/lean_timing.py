"""What the lean step costs a decoder layer, for the hardware profile and the planner.

The planner prices a GPU decoder layer as its bytes and FLOPs plus `LayerTiming.overhead_s`: one
tiny transformers layer's time at one token, the launches and Python of the general path (0.86
ms on an H200 host). A model the lean step takes (engine.model.lean_step: steps and passes of up
to MAX_TOKENS replayed as CUDA graphs, one launch a run of layers between routed experts) pays
much less of it, and by that figure the planner predicted such a model at half its speed on an
8 GB card with its experts on the CPU (`bench plan --moe`'s second table).

- `lean_layer_overhead` measures the lean step's figure on the profile's GPU: a tiny llama of
  2 and of 8 layers stepped through the lean step, the difference a layer (so the embedding, the
  head and the forward's own Python drop out), best of two runs. It is what the engine gets
  there: where a capture fails the lean step runs its calls eagerly, and that is what is timed.
- `saving` is what the planner takes off each layer's priced time for a model the lean step
  would take, in a pass of a given size.

What a ModelShape cannot tell, approximated here: the lean step's FAMILIES (a shape has no model
type; a model without windowed or K/V-sharing layers is taken to qualify, as every catalog family
without windows does), and the one more graph launch (~10 us) each MoE layer adds when its
experts run on the CPU (each such layer ends a segment), beside the hand-off the planner prices
as EXPERTS_SYNC_S.

What this module does not do: run a model's steps for the engine (engine.model.lean_step), or
the general path's overhead (engine.planning.measure times one tiny layer for that).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from engine.planning.profile import LayerTiming
from engine.shapes import ModelShape, Placement

if TYPE_CHECKING:  # (the planner imports this module: nothing here may pull in torch or the models at import)
    import torch

    from engine.model.causal_lm import CausalLM
    from engine.model.lean_step import LeanStep

log = logging.getLogger(__name__)

MAX_TOKENS = 256  # engine.model.lean_step.MAX_TOKENS, the longest pass it takes (a test holds the two together)
LAYERS = (2, 8)  # the tiny llamas timed: the difference a layer is the figure
TINY_VOCAB = 384
PROMPT, WARM, STEPS = 16, 8, 64  # (WARM steps: more than the lean step's CAPTURE_AT, so graphs are captured)


def saving(timing: LayerTiming, shape: ModelShape, tokens: int, placement: Placement | None = None,
           levels: bool = False) -> float:
    """Seconds the lean step takes off one decoder layer's priced time in a pass of `tokens`
    tokens of a model of `shape` whose layers all live on the GPU (`placement`, where given: none
    streamed or de-quantised each pass); 0 where the lean step would not take that pass or its
    figure was not measured. `levels`: the pass is a draft's level, reading the earlier levels'
    nodes (a hybrid's: the general path)."""
    if timing.lean_overhead_s is None or not 1 <= tokens <= MAX_TOKENS:
        return 0.0
    if placement is not None and (placement.device == "cpu" or placement.ram_layers or placement.disk_layers
                                  or placement.unpacks_each_pass):
        return 0.0
    kinds = shape.cache_layers
    if any(c.window is not None or (c.head_dim == 0 and c.state_elements == 0) for c in kinds):
        return 0.0  # windows, or layers reading another's K/V: the general path
    if levels and tokens > 1 and any(c.state_elements for c in kinds):
        return 0.0  # a hybrid draft's levels over its pending nodes: the general path
    return max(timing.overhead_s - timing.lean_overhead_s, 0.0)


def step_seconds(model: CausalLM, lean: LeanStep | None, tokens: list[int], prompt: int = PROMPT,
                 warm: int = WARM) -> tuple[float, torch.Tensor]:
    """Seconds a one-token step of `model` takes through the general path (`lean`
    None) or the lean step, over the steps after a prompt of `prompt` tokens and `warm` steps;
    and the last step's output. `tokens`: the prompt's and every step's token."""
    import torch

    device = model.device
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    kept = model.lean
    model.lean = lean
    cache = model.new_cache(len(tokens) + 8)
    out, start = torch.empty(0), 0.0
    try:
        with torch.inference_mode():
            model.forward(torch.tensor(tokens[:prompt]), torch.arange(prompt), cache, None)
            for i, tok in enumerate(tokens[prompt:]):
                if i == warm:
                    sync()
                    start = time.perf_counter()
                out = model.forward(torch.tensor([tok]), torch.tensor([prompt + i]), cache, None)
            sync()
    finally:
        model.lean = kept
    return (time.perf_counter() - start) / max(len(tokens) - prompt - warm, 1), out.float().cpu()


def lean_layer_overhead(device: str, dtype: torch.dtype, anywhere: bool = False) -> float | None:
    """Seconds a decoder layer of a one-token lean step costs on `device` beyond its weights
    (module docstring); None off CUDA (unless `anywhere`: the CPU tests run the same code, the
    lean step forced and eager), or where the lean step does not take the tiny llama."""
    import torch

    from engine.model.lean_step import LeanStep

    if not anywhere and (not device.startswith("cuda") or not torch.cuda.is_available()):
        return None
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(3, TINY_VOCAB, (PROMPT + WARM + STEPS,), generator=g).tolist()
    seconds = []
    for layers in LAYERS:
        model = _tiny_llama(layers, device, dtype)
        lean = model.lean or (LeanStep.of(model, anywhere=True) if anywhere else None)
        if lean is None:
            log.info("the lean step does not take a tiny llama on %s; the planner keeps the general path's cost",
                     device)
            return None
        seconds.append(min(step_seconds(model, lean, tokens)[0] for _ in range(2)))
        del model
    return max(seconds[1] - seconds[0], 0.0) / (LAYERS[1] - LAYERS[0])


def _tiny_llama(layers: int, device: str, dtype: torch.dtype) -> CausalLM:
    """A random llama of `layers` tiny layers on `device` (its arithmetic is what is timed)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from engine.model.cache import steady_attention
    from engine.model.causal_lm import CausalLM

    config = LlamaConfig(hidden_size=64, intermediate_size=172, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=16, num_hidden_layers=layers, vocab_size=TINY_VOCAB,
                         max_position_embeddings=1024)
    config._attn_implementation = "sdpa"
    if device != "cpu":
        steady_attention()  # as load_model does
    torch.manual_seed(0)
    hf = LlamaForCausalLM(config)
    torch.nn.Module.to(hf, device=device, dtype=dtype)  # (in place)
    return CausalLM(hf)
