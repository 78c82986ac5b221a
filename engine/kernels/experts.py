"""An MoE layer's routed experts kept packed on the CPU: `PackedExperts` replaces transformers'
experts module (the one its sparse-MoE block calls as `experts(hidden, top_k_index,
top_k_weights)`) and runs only the experts a pass routes to, each with the packed kernel
(linear.py), straight from the file's blocks.

Before it, a GGUF MoE model on a CPU had its experts de-quantised to fp32 at load: a 30B-A3B
model in Q4_K_M (17 GB) would take 120 GB of RAM, and a model too large for that ran its layers
de-quantised on every pass, all 128 experts for the 8 a token uses. Packed, the experts take the
file's bytes in RAM and a token reads only its experts' bytes.

The arithmetic is transformers' own for every family whose experts carry its
`use_experts_implementation` flags (Mixtral, Qwen2/3-MoE, Qwen3-Next, Qwen3.5-MoE, GLM-4.5,
Gemma 4): per routed expert, gate_up = x W_gu^T (+ bias), the module's own gate (its
`_apply_gate`: act(gate) * up, or gpt-oss' clamped variant), down = h W_d^T (+ bias), scaled by
the routing weight and added into the token's row. Only the order of the products' sums
differs from a dense product (the kernel's), so greedy text is the file's model's.

A projection may be packed for some parts and dense for others: the fused gate_up of a GGUF is
two tensors (llama.cpp's ffn_gate_exps and ffn_up_exps) that may differ in type; parts of one
kernel kind are merged into one matrix per expert (one kernel call), others run one call each.
Experts stored transposed (gpt-oss' (E, in, out)) or with a norm after each expert are not
handled here: they stay the dense module they were (`supports`). The bias of a projection is
added to its whole output, in transformers' order.

Each call counts the tokens routed to each expert (`hits`) and the experts a pass woke
(`last_union`, and over calls of 2+ tokens `union_log`): the routing statistics a placement
(hot experts) and the tree's price (the union u(N) of the experts N tokens wake:
`measured_unions`, engine.planning.moe.fit_sharing) are measured from.

On a GPU machine (`--experts cpu`, engine.loading.layer_plan.experts_on_cpu) the model's other
parts run on the GPU and call this module with states on the GPU: the states (a few KB a token)
and routing come to the CPU, the sum goes back. The experts of a layer run after its attention,
not beside it (no overlap yet).

What this module does not do: read files (engine.loading.cpu_packed builds the weights), decide
where experts live, or run experts on a GPU.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import cast

import torch
from torch import nn
from torch.nn import functional as F
from transformers.activations import SiLUActivation
from transformers.integrations import moe as moe_integration

from engine.kernels.build import kernels
from engine.kernels.governor import governor
from engine.kernels.linear import QmLinear, QuantWeight, qlinear


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
            and a.scales.dtype == b.scales.dtype and (a.mins is None) == (b.mins is None))


def _stack(a: QuantWeight, b: QuantWeight) -> QuantWeight:
    return QuantWeight(a.kind, torch.cat([a.codes, b.codes]), torch.cat([a.scales, b.scales]),
                       torch.cat([a.mins, b.mins]) if a.mins is not None and b.mins is not None else None,
                       a.group, a.out_features + b.out_features, a.in_features)


class PackedExperts(nn.Module):
    """Routed experts, each projection a list of parts (see Part). Built by
    `engine.loading.cpu_packed` from an experts module whose other attributes (activation, gate,
    biases, flags) it keeps."""

    def __init__(self, original: nn.Module, gate_up: Sequence[Part], down: Sequence[Part]) -> None:
        super().__init__()
        if not supports(original):
            raise ValueError(f"{type(original).__name__} is not an experts module PackedExperts runs")
        self.num_experts = int(cast(int, original.num_experts))
        self.has_gate = bool(getattr(original, "has_gate", True))
        first = "gate_up_proj" if self.has_gate else "up_proj"
        self.gate_up_rows = int(getattr(original, first).shape[1])
        self.hidden = int(cast(torch.Tensor, original.down_proj).shape[1])
        self.gate_up = merged(gate_up, self.gate_up_rows)
        self.down = merged(down, self.hidden)
        for i, p in enumerate((*self.gate_up, *self.down)):  # dense parts are the module's tensors
            if p.dense is not None:
                self.register_buffer(f"dense_part{i}", p.dense, persistent=False)
        self.act_fn: Callable[[torch.Tensor], torch.Tensor] = cast(Callable[[torch.Tensor], torch.Tensor], original.act_fn)
        # bound to the original: gpt-oss-style gates read their alpha and limit from it
        self._gate = cast(Callable[[torch.Tensor], torch.Tensor], original._apply_gate) if self.has_gate else None
        self._source = type(original).__name__
        bias = getattr(original, "has_bias", False)
        self.gate_up_bias = getattr(original, f"{first}_bias", None) if bias else None
        self.down_bias = getattr(original, "down_proj_bias", None) if bias else None
        self._fused = self._one_token_call(original)
        self.hits = torch.zeros(self.num_experts, dtype=torch.int64)  # tokens routed to each expert, all calls
        self.calls = 0
        self.last_union = 0  # experts the last call woke
        self.last_tokens = 0
        # calls of 2+ tokens by log2 of their tokens: (calls, tokens, experts woken), summed
        self.union_log: dict[int, tuple[int, int, int]] = {}

    def _one_token_call(self, original: nn.Module) -> tuple[ctypes.Array, ctypes.Array] | None:
        """qmatmul.c's qm_experts_one, for one token at a time, where its arithmetic is this
        module's: SiLU(gate) * up (the default gate of a SiLU module), no biases, each projection
        one packed part. Its arguments: each expert's gate_up and down as the C structs."""
        lib = kernels()
        if (lib is None or not self.has_gate or not isinstance(self.act_fn, (SiLUActivation, nn.SiLU))
                or getattr(type(original), "_apply_gate", None) is not moe_integration._default_apply_gate
                or self.gate_up_bias is not None or self.down_bias is not None
                or len(self.gate_up) != 1 or len(self.down) != 1
                or self.gate_up[0].packed is None or self.down[0].packed is None):
            return None
        gate_up, down = (QmLinear * self.num_experts)(), (QmLinear * self.num_experts)()
        for e in range(self.num_experts):
            gate_up[e].point_at(self.gate_up[0].packed[e])
            down[e].point_at(self.down[0].packed[e])
        return gate_up, down

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in (*self.gate_up, *self.down))

    @property
    def packed_nbytes(self) -> int:
        """The packed parts' bytes (the dense ones are the module's buffers)."""
        return sum(p.nbytes for p in (*self.gate_up, *self.down) if p.packed is not None)

    def extra_repr(self) -> str:
        kinds = "+".join(p.packed[0].kind if p.packed else "dense" for p in (*self.gate_up, *self.down))
        return f"{self._source}, experts={self.num_experts}, parts={kinds}"

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        x = hidden_states.reshape(-1, hidden_states.shape[-1])
        home = hidden_states.device
        if home.type != "cpu":  # a model on a GPU whose experts stay here: the states come over, the sum goes back
            x = x.to("cpu", torch.float32)
            top_k_index, top_k_weights = top_k_index.cpu(), top_k_weights.to("cpu", torch.float32)
        k = top_k_index.shape[-1]
        if self._fused is not None and x.shape[0] == 1 and x.dtype is torch.float32:
            return self._one_token(x, top_k_index, top_k_weights, home, hidden_states)
        flat = top_k_index.reshape(-1)
        counts = torch.bincount(flat, minlength=self.num_experts)[: self.num_experts]
        self.hits += counts.to(self.hits.device)
        order = torch.argsort(flat, stable=True)
        token_of = order // k
        weight_of = top_k_weights.reshape(-1)[order]
        out = torch.zeros_like(x)
        start = 0
        woke = 0
        for e, n in enumerate(counts.tolist()):
            if not n:
                continue
            woke += 1
            tokens = token_of[start : start + n]
            w = weight_of[start : start + n]
            start += n
            h = self._project(self.gate_up, e, x[tokens], self.gate_up_bias)
            h = self._gate(h) if self._gate is not None else self.act_fn(h)
            y = self._project(self.down, e, h, self.down_bias)
            out.index_add_(0, tokens, (y * w[:, None]).to(out.dtype))
        self.calls += 1
        self.last_union, self.last_tokens = woke, x.shape[0]
        if self.last_tokens > 1:
            bucket = self.last_tokens.bit_length()
            calls, seen, union = self.union_log.get(bucket, (0, 0, 0))
            self.union_log[bucket] = (calls + 1, seen + self.last_tokens, union + woke)
        if home.type != "cpu":
            out = out.to(home, hidden_states.dtype, non_blocking=False)
        return out.view(hidden_states.shape)

    def _one_token(self, x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                   home: torch.device, hidden_states: torch.Tensor) -> torch.Tensor:
        """One token through its experts in one C call (a decode step), in ascending expert
        order as the loop over experts sums them."""
        assert self._fused is not None
        lib = kernels()
        assert lib is not None
        pairs = sorted(zip(top_k_index.reshape(-1).tolist(), top_k_weights.reshape(-1).tolist(), strict=True))
        ids = torch.tensor([e for e, _ in pairs], dtype=torch.int64)
        weights = torch.tensor([w for _, w in pairs], dtype=torch.float32)
        x = x.contiguous()
        out = torch.empty_like(x)
        rc = lib.qm_experts_one(ctypes.addressof(self._fused[0]), ctypes.addressof(self._fused[1]), ids.data_ptr(),
                                weights.data_ptr(), len(pairs), x.data_ptr(), out.data_ptr(), governor().threads())
        if rc != 0:
            raise torch.OutOfMemoryError("The packed CPU kernel could not allocate its scratch memory.")
        self.hits.index_add_(0, ids, torch.ones_like(ids))
        self.calls += 1
        self.last_union, self.last_tokens = len(set(ids.tolist())), 1
        if home.type != "cpu":
            out = out.to(home, hidden_states.dtype)
        return out.view(hidden_states.shape)

    @staticmethod
    def _project(parts: Sequence[Part], e: int, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        outs = []
        for p in parts:
            if p.packed is not None:
                outs.append(qlinear(x, p.packed[e]).to(x.dtype))
            else:
                assert p.dense is not None
                w = p.dense[e]
                outs.append(F.linear(x.to(w.device, w.dtype), w).to(x.device, x.dtype))
        y = outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)
        return y + bias[e] if bias is not None else y


UnionTotals = dict[int, tuple[int, int, int]]  # log2 bucket of tokens -> (calls, tokens, experts woken), summed


def union_totals(modules: Iterable[nn.Module], seed: UnionTotals | None = None) -> UnionTotals:
    """The union logs of the PackedExperts among `modules` (a model's), summed over its MoE
    layers and added to `seed` (what earlier processes measured: engine.decoding.learned)."""
    totals = {b: list(t) for b, t in (seed or {}).items()}
    for m in modules:
        if isinstance(m, PackedExperts):
            for bucket, (calls, tokens, union) in m.union_log.items():
                t = totals.setdefault(bucket, [0, 0, 0])
                t[0], t[1], t[2] = t[0] + calls, t[1] + tokens, t[2] + union
    return {b: (t[0], t[1], t[2]) for b, t in totals.items()}


def measured_unions(modules: Iterable[nn.Module], seed: UnionTotals | None = None) -> dict[int, tuple[int, float]]:
    """What the PackedExperts among `modules` (and `seed`) measured of passes of 2+ tokens: mean
    tokens per pass (by powers of two) -> (observations, mean experts woken per MoE layer), the
    input of engine.planning.moe.fit_sharing; {} before any such pass."""
    return {round(tokens / calls): (calls, union / calls)
            for calls, tokens, union in union_totals(modules, seed).values() if calls}
