"""A packed MoE layer's routed experts de-quantised per pass: only those its tokens route to.

The streamer (streamer.py) de-quantises a packed layer into the dense buffer its template layer
runs from before every pass. For an MoE layer in GGUF blocks that was every expert: a 24 GB card
holding Qwen3-30B-A3B's Q4_K_M resident in its blocks de-quantised all 128 experts of a layer for
the 8 a token uses (the planner priced that pass at 8.1 tok/s on an RTX 4090, below an 8 GB
card's experts on the CPU). Here the experts' parameters are left out of that (`eager`), and a
forward pre-hook on the template's experts module de-quantises, once the router has chosen, the
union of experts the pass's tokens route to, from the packed bytes of the layer being run (the
streamer names them before each call: `RoutedExperts.current`), into the same dense tensors.
The experts module then reads only those experts (transformers' loop over the experts hit, its
batched and grouped products, and RowExperts all take the routed experts' matrices alone), so its
arithmetic is unchanged: each routed expert holds exactly what de-quantising the whole layer gave
it.

Which layers: GGUF-block expert tensors (E, rows, cols) stored as the file's rows (no row
permutation), whose experts module is called with the routed ids as its second argument or as
`top_k_index` / `router_indices` (transformers' experts modules and RowExperts). Anything else
keeps the whole-layer de-quantisation.

What this module does not do: move bytes between tiers (streamer.py), or run experts on the CPU
beside a GPU (engine.kernels.experts).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from engine.offload import gguf_blocks
from engine.offload.layout import Entry, LayerLayout


class RoutedExperts:
    """The hook of one template's experts module (see the module docstring)."""

    def __init__(self, module: nn.Module, prefix: str, params: dict[str, torch.Tensor]) -> None:
        self.prefix = prefix
        self.params = params  # the template's dense parameter views, by name
        self.current: tuple[LayerLayout, torch.Tensor] | None = None  # the layer being run, its packed bytes
        self.woken = 0  # experts de-quantised, all passes (a test and benchmark figure)
        self.handle = module.register_forward_pre_hook(self._hook, with_kwargs=True)

    def _hook(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        assert self.current is not None, "the streamer names the layer before running it"
        layout, packed = self.current
        index = args[1] if len(args) > 1 else kwargs.get("top_k_index", kwargs.get("router_indices"))
        entries = [e for e in layout.entries if expert_entry(e) and e.param.startswith(self.prefix)]
        if not isinstance(index, torch.Tensor):  # an unknown call: every expert, as before
            ids = None
        else:
            ids = torch.unique(index.reshape(-1))
            ids = ids[(ids >= 0) & (ids < entries[0].shape[0])] if entries else ids
        for e in entries:
            self.woken += fill(layout, packed, e, self.params[e.param], ids)


def expert_entry(e: Entry) -> bool:
    """A GGUF-block tensor of stacked expert matrices, rows as stored."""
    return e.kind == "gguf" and len(e.shape) == 3 and not e.side and e.row_order is None


def fill(layout: LayerLayout, packed: torch.Tensor, e: Entry, out: torch.Tensor, ids: torch.Tensor | None) -> int:
    """De-quantise experts `ids` (None: all) of entry `e` (all its matrices' rows, or its part's)
    into the dense parameter `out` (E, rows, cols); returns how many."""
    experts, _, cols = e.shape
    a, b = e.part if e.part is not None else (0, e.shape[1])
    target = out.narrow(-2, a, b - a) if e.part is not None else out
    data = layout.view(packed, e)
    if ids is None:
        gguf_blocks.dequantize_into(data, e.qtype, target)
        return experts
    if not len(ids):
        return 0
    stored = data.view(experts, -1).index_select(0, ids)  # (u, its rows' bytes)
    values = torch.empty((len(ids), b - a, cols), dtype=out.dtype, device=out.device)
    gguf_blocks.dequantize_into(stored.reshape(-1), e.qtype, values)
    target.index_copy_(0, ids, values)
    return len(ids)


def attach(template: nn.Module, layout: LayerLayout, params: dict[str, torch.Tensor]) -> RoutedExperts | None:
    """The routed de-quantisation of `template`'s experts (its dense parameter views `params`),
    where `layout` (one layer of its kind) holds them in GGUF blocks; None otherwise."""
    names = {e.param for e in layout.entries if len(e.shape) == 3 and not e.side}
    if not names or not all(expert_entry(e) for e in layout.entries if e.param in names and not e.side):
        return None
    prefixes = {n.rpartition(".")[0] for n in names}
    if len(prefixes) != 1:
        return None
    prefix = prefixes.pop()
    try:
        module = template.get_submodule(prefix)
    except AttributeError:
        return None
    return RoutedExperts(module, prefix + ".", params)


def eager(layout: LayerLayout, routed: RoutedExperts | None) -> set[str] | None:
    """The parameters the streamer de-quantises before a pass: all (None) without routed experts,
    else all but theirs."""
    if routed is None:
        return None
    return {e.param for e in layout.entries if not e.side and not (expert_entry(e) and e.param.startswith(routed.prefix))}
