"""How an MoE layer's routed experts are held for `PackedExperts` (experts.py): each projection
as parts over row ranges of every expert's matrix, packed (one kernel weight per expert) or
dense; parts of one kernel kind merged into one matrix per expert (one kernel call); which
experts modules can be stood in for.

What this module does not do: run experts (experts.py) or read files (engine.loading.cpu_packed).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from engine.kernels.linear import QuantWeight


@dataclass(frozen=True)
class Part:
    """Rows [start, stop) of every expert's matrix of one projection: packed (one QuantWeight per
    expert) or dense ((E, rows, in) in the compute dtype)."""

    start: int
    stop: int
    packed: tuple[QuantWeight, ...] | None = None
    dense: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        if self.packed is not None:
            return sum(w.nbytes for w in self.packed)
        assert self.dense is not None
        return self.dense.numel() * self.dense.element_size()


def supports(module: nn.Module) -> bool:
    """Whether `module` is an experts module PackedExperts can stand in for."""
    return (hasattr(module, "is_transposed") and not module.is_transposed
            and not getattr(module, "has_post_expert_norm", False)
            and hasattr(module, "num_experts") and hasattr(module, "down_proj"))


def merged(parts: Sequence[Part], rows: int) -> list[Part]:
    """Adjacent packed parts of one kernel kind, group and scale type -> one part (their rows
    stacked per expert), so a gate_up of two tensors of one type is one kernel call."""
    out: list[Part] = []
    for p in sorted(parts, key=lambda p: p.start):
        last = out[-1] if out else None
        if (last is not None and last.packed is not None and p.packed is not None and last.stop == p.start
                and same_kind(last.packed[0], p.packed[0])):
            out[-1] = Part(last.start, p.stop, packed=tuple(_stack(a, b) for a, b in zip(last.packed, p.packed, strict=True)))
        else:
            out.append(p)
    if not out or out[0].start != 0 or out[-1].stop != rows or any(a.stop != b.start for a, b in zip(out, out[1:])):
        raise ValueError(f"the parts do not tile the {rows} rows of the projection")
    return out


def same_kind(a: QuantWeight, b: QuantWeight) -> bool:
    """Whether two weights' rows can stack into one weight (one kernel call)."""
    return (a.kind == b.kind and a.group == b.group and a.in_features == b.in_features
            and a.scales.dtype == b.scales.dtype and (a.mins is None) == (b.mins is None) and a.offset == b.offset
            and a.table == b.table)


def _stack(a: QuantWeight, b: QuantWeight) -> QuantWeight:
    return a.like(torch.cat([a.codes, b.codes]), torch.cat([a.scales, b.scales]),
                  torch.cat([a.mins, b.mins]) if a.mins is not None and b.mins is not None else None,
                  a.out_features + b.out_features)



def on_device(w: QuantWeight, device: torch.device | str) -> QuantWeight:
    """`w` with its tensors on `device` (to de-quantise it there)."""
    if w.codes.device == torch.device(device):
        return w
    return w.like(w.codes.to(device), w.scales.to(device), w.mins.to(device) if w.mins is not None else None,
                  w.out_features)


def gelu_tanh(act: object) -> bool:
    """Whether an activation module is GELU with the tanh approximation (gelu_pytorch_tanh),
    which qmatmul.c's gated() computes: transformers' GELUTanh / PytorchGELUTanh, or nn.GELU("tanh")."""
    name = type(act).__name__
    return name in ("GELUTanh", "PytorchGELUTanh") or isinstance(act, nn.GELU) and act.approximate == "tanh"
