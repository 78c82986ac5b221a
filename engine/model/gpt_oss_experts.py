"""gpt-oss's routed experts held as llama.cpp's GGUF stores them, so they stay packed.

transformers' GptOssExperts holds each expert transposed, gate_up_proj (E, hidden, 2I) with gate
and up interleaved (gate at even columns, up at odd) and down_proj (E, I, hidden), and computes
x @ W. A GGUF stores them as every other family's experts: gate rows (E, I, hidden), up rows
(E, I, hidden) (or both as one fused tensor, gate rows then up rows) and down rows (E, hidden, I),
rows being outputs. `RowExperts` holds them that way, gate_up_proj (E, 2I, hidden) gate rows then
up rows, down_proj (E, hidden, I), the gate_up bias (E, 2I) in the same order, and computes
x W^T + b with gpt-oss's clamped SwiGLU on the two halves: the arithmetic of transformers' module
on the same values, only its layout differs. So the GGUF's tensors fill it as parts (no
transpose, no interleave at load) and, on a CPU with the packed kernel, its MXFP4 experts stay
packed (engine.loading.cpu_packed: the file's nibbles and a power-of-two scale per 32 values) where
de-quantising them would take 8 times the file's bytes in fp32.

With `interleaved`, gate_up's rows (and its bias) alternate gate, up, gate, up... as gpt-oss's
safetensors checkpoint stores them (its MXFP4 blocks are rows first too: (E, 2I, hidden / 32,
16)): the gate reads the even rows' outputs, transformers' own order.

`use_row_experts(model, interleaved)` puts one in place of each GptOssExperts (meta tensors: the
loader fills them); GGUFWeights.bind and SafetensorsWeights.bind call it for gpt-oss.

What this module does not do: read anything.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RowExperts(nn.Module):
    """gpt-oss's experts, rows first (see the module docstring). Attributes as PackedExperts reads
    an experts module (engine.kernels.expert_parts.supports)."""

    is_transposed = False
    has_gate = True
    has_bias = True

    def __init__(self, num_experts: int, hidden: int, intermediate: int, alpha: float, limit: float,
                 dtype: torch.dtype | None = None, interleaved: bool = False) -> None:
        super().__init__()
        self.interleaved = interleaved
        self.num_experts, self.hidden_size, self.intermediate_size = num_experts, hidden, intermediate
        self.alpha, self.limit = alpha, limit
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden, dtype=dtype))
        self.gate_up_proj_bias = nn.Parameter(torch.empty(num_experts, 2 * intermediate, dtype=dtype))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, intermediate, dtype=dtype))
        self.down_proj_bias = nn.Parameter(torch.empty(num_experts, hidden, dtype=dtype))
        self.act_fn = nn.Identity()  # (the gate is _apply_gate's own)

    def _apply_gate(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gpt-oss's gate on (..., 2I) gate then up values (interleaved: alternating), as transformers'."""
        gate, up = (gate_up[..., ::2], gate_up[..., 1::2]) if self.interleaved else gate_up.chunk(2, dim=-1)
        gate = gate.clamp(min=None, max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))

    def forward(self, hidden_states: torch.Tensor, router_indices: torch.Tensor,
                routing_weights: torch.Tensor) -> torch.Tensor:
        """(tokens, hidden) states, (tokens, k) expert ids and weights -> the weighted sum of each
        token's experts, experts in ascending order as transformers sums them."""
        out = torch.zeros_like(hidden_states)
        for e in torch.unique(router_indices).tolist():
            token_idx, slot = torch.where(router_indices == e)
            h = self._apply_gate(F.linear(hidden_states[token_idx], self.gate_up_proj[e], self.gate_up_proj_bias[e]))
            y = F.linear(h, self.down_proj[e], self.down_proj_bias[e])
            out.index_add_(0, token_idx, (y * routing_weights[token_idx, slot, None]).to(out.dtype))
        return out


def use_row_experts(model: nn.Module, interleaved: bool = False) -> int:
    """Replace each transformers GptOssExperts in `model` by a RowExperts of its shape and dtype
    (its tensors on the meta device: nothing is copied). Returns how many were replaced."""
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts  # noqa: PLC0415

    found = [(name, m) for name, m in model.named_modules() if isinstance(m, GptOssExperts)]
    for name, m in found:
        with torch.device("meta"):
            new = RowExperts(m.num_experts, m.hidden_size, m.intermediate_size, float(m.alpha), float(m.limit),
                             dtype=m.gate_up_proj.dtype, interleaved=interleaved)
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, new)
    return len(found)
