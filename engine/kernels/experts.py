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
Experts stored transposed (transformers' gpt-oss module, (E, in, out)) or with a norm after each
expert are not handled here: they stay the dense module they were (`supports`); a gpt-oss GGUF
or MXFP4 checkpoint is held rows first for this module (engine.model.gpt_oss_experts). The bias
of a projection is added to its whole output, in transformers' order, and cached experts keep
theirs beside them.

Each call counts the tokens routed to each expert (`hits`) and the experts a pass woke
(`last_union`, and over calls of 2+ tokens `union_log`): the routing statistics a placement
(hot experts) and the tree's price (the union u(N) of the experts N tokens wake:
engine.kernels.expert_unions, engine.planning.moe.fit_sharing) are measured from.

On a GPU machine (`--experts cpu`, engine.loading.layer_plan.experts_on_cpu) the model's other
parts run on the GPU and call this module with states on the GPU: the states (a few KB a token)
and routing come to the CPU, the sum goes back (engine.kernels.handoff: pinned buffers, one wait
a call). Some experts may be cached on the GPU (`cache`:
de-quantised there from the packed bytes, in the model's dtype): their products are queued on the
GPU first, so they compute while the CPU runs the token's other experts; a decode step's cached
experts take a fixed handful of GPU operations read from the router's tensors there
(`_one_token_hot`), nothing waiting for the GPU. The two sums (each in fp32) are added on the GPU.

What this module does not do: read files (engine.loading.cpu_packed builds the weights), or
decide which experts are cached (engine.kernels.expert_cache).
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Iterable, Sequence
from typing import cast

import torch
from torch import nn
from torch.nn import functional as F
from transformers.activations import SiLUActivation
from transformers.integrations import moe as moe_integration

from engine.kernels import handoff
from engine.kernels.build import kernels
from engine.kernels.governor import governor
from engine.kernels.expert_parts import Part, gelu_tanh, merged, on_device, supports
from engine.kernels.linear import QmGate, QmLinear, dequantize, qlinear
from engine.model.gpt_oss_experts import RowExperts


# one expert's (gate_up, down) matrices where they run, and their biases (None: none)
Matrices = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]


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

        def on_cpu(b: torch.Tensor | None) -> torch.Tensor | None:  # where the kernel's sums are (fp32)
            return None if b is None else b.detach().to("cpu", torch.float32).contiguous()

        self.gate_up_bias = on_cpu(getattr(original, f"{first}_bias", None)) if bias else None
        self.down_bias = on_cpu(getattr(original, "down_proj_bias", None)) if bias else None
        self._fused = self._one_token_call(original)
        # tokens routed to each expert, all calls (the fused decode step adds to it in place: never replaced)
        self.hits = torch.zeros(self.num_experts, dtype=torch.int64)
        self.calls = 0
        self.last_union = 0  # experts the last call woke
        self.last_tokens = 0
        # calls of 2+ tokens by log2 of their tokens: (calls, tokens, experts woken), summed
        self.union_log: dict[int, tuple[int, int, int]] = {}
        # experts cached on the GPU (cache): their gate_up and down stacked by slot, the expert in
        # each slot, each expert's slot (-1: on the CPU), and the routed pairs they ran
        self._hot: tuple[torch.Tensor, torch.Tensor] | None = None
        self._hot_bias: tuple[torch.Tensor, torch.Tensor] | None = None  # their biases (gpt-oss), by slot
        self.hot_ids: list[int] = []
        self._slot: torch.Tensor | None = None
        self._slot_there: torch.Tensor | None = None  # _slot where the cache is
        self.hot_hits = 0
        # passes of many tokens run on the GPU (stream): (device, dtype, from how many tokens)
        self._stream: tuple[torch.device, torch.dtype, int] | None = None
        self.streamed_passes = 0

    def _one_token_call(self, original: nn.Module) -> tuple[ctypes.Array, ctypes.Array, QmGate | None] | None:
        """qmatmul.c's qm_experts_one, for one token at a time, where its arithmetic is this
        module's: SiLU(gate) * up (the default gate of a SiLU module; Gemma 4's GELU) without biases,
        or gpt-oss's gate with its biases (RowExperts); each projection one packed part. Its
        arguments: each expert's gate_up and down as the C structs, and the gate (None: SiLU)."""
        lib = kernels()
        if (lib is None or not self.has_gate or len(self.gate_up) != 1 or len(self.down) != 1
                or self.gate_up[0].packed is None or self.down[0].packed is None):
            return None
        gate = None
        if isinstance(original, RowExperts):  # (its biases: fp32 on the CPU, kept as long as the module)
            if self.gate_up_bias is None or self.down_bias is None:
                return None
            gate = QmGate(self.gate_up_bias.data_ptr(), self.down_bias.data_ptr(), original.alpha, original.limit,
                          int(original.interleaved))
        elif (getattr(type(original), "_apply_gate", None) is not moe_integration._default_apply_gate
              or self.gate_up_bias is not None or self.down_bias is not None
              or not isinstance(self.act_fn, (SiLUActivation, nn.SiLU)) and not gelu_tanh(self.act_fn)):
            return None
        elif gelu_tanh(self.act_fn):  # Gemma 4's experts
            gate = QmGate(None, None, 0.0, 0.0, 0, 1)
        gate_up, down = (QmLinear * self.num_experts)(), (QmLinear * self.num_experts)()
        for e in range(self.num_experts):
            gate_up[e].point_at(self.gate_up[0].packed[e])
            down[e].point_at(self.down[0].packed[e])
        return gate_up, down, gate

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

    @property
    def expert_nbytes(self) -> int:
        """Bytes of one expert de-quantised to fp32 (its gate/up and down matrices): what a
        cached expert takes in VRAM is this times its dtype's size / 4."""
        return 4 * (self.gate_up_rows * self.hidden + self.hidden * self.width)

    @property
    def width(self) -> int:
        """The down projection's input width (the expert's intermediate size)."""
        p = self.down[0]
        return p.packed[0].in_features if p.packed is not None else int(cast(torch.Tensor, p.dense).shape[-1])

    def cache(self, ids: Iterable[int], device: torch.device | str, dtype: torch.dtype) -> int:
        """Keep experts `ids` de-quantised on `device` in `dtype` (the values transformers holds
        for the file on that device), run there (beside the CPU's experts) for the tokens routed
        to them. Replaces the experts cached before; with as many ids as slots already held,
        only the experts new to the set are de-quantised and copied. Returns how many were."""
        wanted = sorted(set(int(e) for e in ids))
        if any(not 0 <= e < self.num_experts for e in wanted):
            raise ValueError(f"expert ids must be in [0, {self.num_experts})")
        dev = torch.device(device)
        if not wanted:
            self.uncache()
            return 0
        held = self._hot
        if held is None or held[0].shape[0] != len(wanted) or held[0].device != dev or held[0].dtype != dtype:
            self.uncache()  # the old buffers go before the new ones are taken
            gate_up = torch.empty((len(wanted), self.gate_up_rows, self.hidden), dtype=dtype, device=dev)
            down = torch.empty((len(wanted), self.hidden, self.width), dtype=dtype, device=dev)
            self._hot, self.hot_ids = (gate_up, down), [-1] * len(wanted)
            if self.gate_up_bias is not None or self.down_bias is not None:
                self._hot_bias = (torch.zeros((len(wanted), self.gate_up_rows), dtype=dtype, device=dev),
                                  torch.zeros((len(wanted), self.hidden), dtype=dtype, device=dev))
        gate_up, down = cast(tuple[torch.Tensor, torch.Tensor], self._hot)
        keep = {e: j for j, e in enumerate(self.hot_ids) if e in set(wanted)}
        free = iter(j for j in range(len(wanted)) if j not in set(keep.values()))
        copied = 0
        try:
            for e in wanted:
                if e in keep:
                    continue
                j = next(free)
                # both matrices made before either slot is written: running out of memory here leaves
                # every slot whole, holding the expert hot_ids names
                gu, dn = self.expert_matrix(self.gate_up, e, dev), self.expert_matrix(self.down, e, dev)
                gate_up[j].copy_(gu)
                down[j].copy_(dn)
                if self._hot_bias is not None:
                    for held_bias, bias in zip(self._hot_bias, (self.gate_up_bias, self.down_bias), strict=True):
                        if bias is not None:
                            held_bias[j].copy_(bias[e])
                self.hot_ids[j] = e
                copied += 1
        finally:
            self._slot = torch.full((self.num_experts,), -1, dtype=torch.int64)
            for j, e in enumerate(self.hot_ids):
                if e >= 0:
                    self._slot[e] = j
            self._slot_there = self._slot.to(dev)
        return copied

    def uncache(self) -> None:
        """Drop the experts cached on the GPU: every expert runs on the CPU again."""
        self._hot, self._hot_bias, self.hot_ids, self._slot, self._slot_there = None, None, [], None, None

    @property
    def cached_nbytes(self) -> int:
        """Bytes the cached experts take where they are cached."""
        if self._hot is None:
            return 0
        return sum(t.numel() * t.element_size() for t in (*self._hot, *(self._hot_bias or ())))

    @staticmethod
    def expert_matrix(parts: Sequence[Part], e: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """Expert e's matrix of one projection in fp32 on `device` (the kernel's values of its
        packed parts, de-quantised there from the packed bytes: fp32 products and sums, the same
        values on any device)."""
        rows = [dequantize(on_device(p.packed[e], device)) if p.packed is not None
                else cast(torch.Tensor, p.dense)[e].to(device, torch.float32) for p in parts]
        return rows[0] if len(rows) == 1 else torch.cat(rows)

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        """The routed experts' weighted sum for each token: the experts cached on the GPU
        (`cache`) run there, queued first so they compute while the CPU runs the rest."""
        x = hidden_states.reshape(-1, hidden_states.shape[-1])
        home = hidden_states.device
        routed = top_k_index, top_k_weights  # where the router left them (the cache reads them there)
        if home.type != "cpu":  # a model on a GPU whose experts stay here: the states come over, the sum goes back
            x, top_k_index, top_k_weights = handoff.to_host(x, top_k_index, top_k_weights)
        k = top_k_index.shape[-1]
        flat = top_k_index.reshape(-1)
        weights = top_k_weights.reshape(-1)
        counts = torch.bincount(flat, minlength=self.num_experts)[: self.num_experts]
        self._count(counts, x.shape[0])
        if self._stream is not None and x.shape[0] >= self._stream[2] and self._stream[0] == home:
            streamed = self._run_streamed(hidden_states.reshape(x.shape), flat, weights, k)
            return streamed.to(hidden_states.dtype).view(hidden_states.shape)
        hot_sum = None
        cold = torch.ones_like(flat, dtype=torch.bool)
        if self._slot is not None:
            slots = self._slot[flat]
            cold = slots < 0
            if not bool(cold.all()):
                if x.shape[0] == 1 and self._slot_there is not None and self._slot_there.device == home:
                    hot_sum = self._one_token_hot(hidden_states.reshape(x.shape), *routed)
                else:
                    hot_sum = self._run_hot(hidden_states.reshape(x.shape), flat, weights, cold, k)
                self.hot_hits += int((~cold).sum())
        if self._fused is not None and x.shape[0] == 1 and x.dtype is torch.float32:
            out = self._one_token(x, flat[cold], weights[cold])
        else:
            out = self._loop(x, flat, weights, cold, k)
        if home.type != "cpu":
            out = handoff.to_device(out, home)
        if hot_sum is not None:
            out = out.to(hot_sum.device) + hot_sum
        return out.to(hidden_states.dtype).view(hidden_states.shape)

    def _count(self, counts: torch.Tensor, tokens: int) -> None:
        self.hits += counts.to(self.hits.device)
        self.logged(counts, tokens)

    def logged(self, counts: torch.Tensor, tokens: int) -> None:
        """A call of `tokens` tokens that routed `counts` to each expert, already in `hits` (the
        fused pass counts them there itself): the call, its union and the union log."""
        self.calls += 1
        self.last_union, self.last_tokens = int((counts > 0).sum()), tokens
        if tokens > 1:
            bucket = tokens.bit_length()
            calls, seen, union = self.union_log.get(bucket, (0, 0, 0))
            self.union_log[bucket] = (calls + 1, seen + tokens, union + self.last_union)

    def _one_token_hot(self, x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """A decode step's cached experts in a fixed number of operations, all on the cache's
        device from the router's own tensors there (nothing waits for the GPU): the token's k
        routed experts' slots gathered (an expert not cached reads slot 0 and gets weight 0), two
        batched products and the gate, the weighted sum in fp32."""
        assert self._hot is not None and self._slot_there is not None
        gate_up, down = self._hot
        slots = self._slot_there[index.reshape(-1)]
        cached = slots >= 0
        k = slots.shape[0]
        x = x.to(gate_up.dtype).reshape(1, 1, -1).expand(k, 1, -1)
        at = slots.clamp(min=0)
        h = torch.bmm(x, gate_up.index_select(0, at).transpose(1, 2))
        if self._hot_bias is not None:
            h = h + self._hot_bias[0].index_select(0, at)[:, None, :]
        h = self._gate(h) if self._gate is not None else self.act_fn(h)
        y = torch.bmm(h, down.index_select(0, at).transpose(1, 2))
        if self._hot_bias is not None:
            y = y + self._hot_bias[1].index_select(0, at)[:, None, :]
        y = y.reshape(k, -1).float()
        w = weights.reshape(-1).to(torch.float32)
        return torch.where(cached[:, None], y * w[:, None], 0.0).sum(0, keepdim=True)

    def _run_hot(self, x: torch.Tensor, flat: torch.Tensor, weights: torch.Tensor, cold: torch.Tensor,
                 k: int) -> torch.Tensor:
        """The cached experts' weighted sum (fp32, on their device) for the pairs routed to them,
        each expert's products in the model's dtype on the GPU, as transformers computes them
        there. Queued on the device's stream without waiting for it."""
        assert self._hot is not None
        by_expert = _by_expert(flat.tolist(), (~cold).tolist())
        return self._run_on(x, by_expert, weights, k, self._cached, self._hot[0].device, self._hot[0].dtype)

    def _cached(self, e: int) -> Matrices:
        """Expert e's (gate_up, down, their biases or None) in the cache (it is cached)."""
        assert self._hot is not None and self._slot is not None
        j = int(self._slot[e])
        if self._hot_bias is None:
            return self._hot[0][j], self._hot[1][j], None, None
        return self._hot[0][j], self._hot[1][j], self._hot_bias[0][j], self._hot_bias[1][j]

    def stream(self, device: torch.device | str, dtype: torch.dtype, from_tokens: int) -> None:
        """Passes of `from_tokens` tokens or more (a prompt's chunks) run all their experts on
        `device`: each expert they wake de-quantised there from its packed bytes (the bytes
        cross the link once a pass, engine.planning.planner.stream_pays_from), in `dtype`; the
        cached ones from the cache. Fewer tokens keep the CPU."""
        self._stream = (torch.empty(0, device=device).device, dtype, max(1, int(from_tokens)))  # cuda -> cuda:0

    def _run_streamed(self, x: torch.Tensor, flat: torch.Tensor, weights: torch.Tensor, k: int) -> torch.Tensor:
        """Every routed pair of a pass on the streaming device (fp32 sum there)."""
        assert self._stream is not None
        dev, dtype, _ = self._stream
        by_expert = _by_expert(flat.tolist())

        def matrices(e: int) -> Matrices:
            if self._slot is not None and int(self._slot[e]) >= 0:
                return self._cached(e)
            gate_up_bias, down_bias = (None if b is None else b[e].to(dev, dtype)
                                       for b in (self.gate_up_bias, self.down_bias))
            return (self.expert_matrix(self.gate_up, e, dev).to(dtype), self.expert_matrix(self.down, e, dev).to(dtype),
                    gate_up_bias, down_bias)

        self.streamed_passes += 1
        return self._run_on(x, by_expert, weights, k, matrices, dev, dtype)

    def _run_on(self, x: torch.Tensor, by_expert: dict[int, list[int]], weights: torch.Tensor, k: int,
                matrices: Callable[[int], Matrices], dev: torch.device, dtype: torch.dtype) -> torch.Tensor:
        """The weighted sum (fp32, on `dev`) of the experts in `by_expert` (expert -> its routed
        pairs, token * k + j) over x, in ascending expert order, each expert's (gate_up, down) from
        `matrices`, its products in `dtype`."""
        x = x.to(dev, dtype)
        out = torch.zeros(x.shape, dtype=torch.float32, device=dev)
        for e in sorted(by_expert):
            idx = by_expert[e]
            gate_up, down, gate_up_bias, down_bias = matrices(e)
            if x.shape[0] == 1:  # a decode step: no index tensors to send
                h = F.linear(x, gate_up, gate_up_bias)
                h = self._gate(h) if self._gate is not None else self.act_fn(h)
                out += F.linear(h, down, down_bias).float() * float(weights[idx[0]])
                continue
            tokens = torch.tensor([i // k for i in idx], dtype=torch.int64).to(dev, non_blocking=True)
            w = weights[idx].to(dev, torch.float32, non_blocking=True)
            h = F.linear(x[tokens], gate_up, gate_up_bias)
            h = self._gate(h) if self._gate is not None else self.act_fn(h)
            out.index_add_(0, tokens, F.linear(h, down, down_bias).float() * w[:, None])
        return out

    def _loop(self, x: torch.Tensor, flat: torch.Tensor, weights: torch.Tensor, keep: torch.Tensor,
              k: int) -> torch.Tensor:
        """The pairs `keep` selects, one expert at a time in ascending order (fp32, on the CPU)."""
        pairs = keep.nonzero().reshape(-1)
        ids = flat[pairs]
        order = torch.argsort(ids, stable=True)
        token_of = pairs[order] // k
        weight_of = weights[pairs[order]]
        counts = torch.bincount(ids, minlength=self.num_experts)[: self.num_experts]
        out = torch.zeros_like(x)
        start = 0
        for e, n in enumerate(counts.tolist()):
            if not n:
                continue
            tokens = token_of[start : start + n]
            w = weight_of[start : start + n]
            start += n
            h = self._project(self.gate_up, e, x[tokens], self.gate_up_bias)
            h = self._gate(h) if self._gate is not None else self.act_fn(h)
            y = self._project(self.down, e, h, self.down_bias)
            if x.shape[0] == 1:  # a decode step: its one row, no index
                out.add_((y * w[:, None]).to(out.dtype))
            else:
                out.index_add_(0, tokens, (y * w[:, None]).to(out.dtype))
        return out

    def _one_token(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """One token through its experts in one C call (a decode step), in ascending expert
        order as the loop over experts sums them."""
        assert self._fused is not None
        lib = kernels()
        assert lib is not None
        out = torch.empty_like(x)
        if not len(ids):
            return out.zero_()
        pairs = sorted(zip(ids.tolist(), weights.tolist(), strict=True))
        ids = torch.tensor([e for e, _ in pairs], dtype=torch.int64)
        weights = torch.tensor([w for _, w in pairs], dtype=torch.float32)
        x = x.contiguous()
        gate = self._fused[2]
        rc = lib.qm_experts_one(ctypes.addressof(self._fused[0]), ctypes.addressof(self._fused[1]), ids.data_ptr(),
                                weights.data_ptr(), len(pairs), x.data_ptr(), out.data_ptr(), governor().threads(),
                                ctypes.addressof(gate) if gate is not None else None)
        if rc != 0:
            raise torch.OutOfMemoryError("The packed CPU kernel could not allocate its scratch memory.")
        return out

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


def _by_expert(experts: list[int], keep: list[bool] | None = None) -> dict[int, list[int]]:
    """The routed pairs (token * k + j) of each expert among `experts` (flat routing), those
    `keep` selects."""
    out: dict[int, list[int]] = {}
    for i, e in enumerate(experts):
        if keep is None or keep[i]:
            out.setdefault(e, []).append(i)
    return out
