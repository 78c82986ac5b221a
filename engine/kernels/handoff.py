"""An MoE layer's states and routing carried from a GPU to the CPU's experts, and their sum back
(PackedExperts.forward on a GPU machine whose routed experts stay packed in RAM: `--experts cpu`).

Before, each call brought the states, the routed ids and the routing weights over with three
synchronous copies (each waits for the GPU, and goes through the driver's own staging memory
because the destination is pageable) and sent the sum back with a fourth, which the CPU waited
for too. A decode step does that in each of its 40-48 MoE layers. Here the three go as
asynchronous copies into pinned buffers and the CPU waits once, for the last of them; the sum is
copied into a pinned buffer and sent without waiting, so the CPU returns at once and queues the
next layer's work while it crosses (all on the current stream, where the next layer's kernels, or
the lean step's graph replays, run after it).

Buffers: one set per device, shared by every experts module on it (one call runs at a time on a
model: engine.serving.scheduler), grown to the largest call (a prompt chunk's states). The
states, ids and weights a `to_host` call hands back are views of those buffers, valid until the
next `to_host` on the device: the caller reads them within its call. A sum's buffer is written
again only once the copy that read it has finished (its event).

On a device other than CUDA (and on the CPU) nothing is staged: `to_host` and `to_device` are
plain copies.

What this module does not do: run experts (engine.kernels.experts), or decide where they run
(engine.loading.layer_plan).
"""

from __future__ import annotations

import torch


class HostHandoff:
    """The pinned buffers and the pending copy back of one CUDA device (module docstring)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._buffers: dict[str, torch.Tensor] = {}
        self._back: torch.cuda.Event | None = None  # recorded after each sum's copy to the device

    def _buffer(self, name: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
        buf = self._buffers.get(name)
        if buf is None or buf.numel() < numel:
            size = max(numel, 2 * buf.numel() if buf is not None else 0)
            buf = self._buffers[name] = torch.empty(size, dtype=dtype, pin_memory=True)
        return buf[:numel]

    def to_host(self, x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x (tokens, hidden) as fp32, the routed ids (int64) and their weights (fp32), on the
        CPU, in their shapes: three copies queued, one wait."""
        hx = self._buffer("states", x.numel(), torch.float32).view(x.shape)
        hi = self._buffer("ids", index.numel(), torch.int64).view(index.shape)
        hw = self._buffer("weights", weights.numel(), torch.float32).view(weights.shape)
        hx.copy_(x.to(torch.float32), non_blocking=True)  # (converted where they are: one small kernel)
        hi.copy_(index.to(torch.int64), non_blocking=True)
        hw.copy_(weights.to(torch.float32), non_blocking=True)
        torch.cuda.current_stream(self.device).synchronize()
        return hx, hi, hw

    def to_device(self, out: torch.Tensor) -> torch.Tensor:
        """`out` (fp32, on the CPU) on the device, its copy queued, not waited for."""
        if self._back is not None:
            self._back.synchronize()  # the previous sum's copy has read the buffer
        staged = self._buffer("sum", out.numel(), torch.float32).view(out.shape)
        staged.copy_(out)
        there = torch.empty(out.shape, dtype=torch.float32, device=self.device)
        there.copy_(staged, non_blocking=True)
        if self._back is None:
            self._back = torch.cuda.Event()
        self._back.record(torch.cuda.current_stream(self.device))
        return there


_handoffs: dict[torch.device, HostHandoff] = {}


def to_host(x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A call's states, routed ids and weights on the CPU (fp32, int64, fp32), staged where they
    are on a CUDA device (HostHandoff.to_host: views valid until the next call on that device)."""
    if x.device.type == "cuda":
        return handoff(x.device).to_host(x, index, weights)
    return x.to("cpu", torch.float32), index.to("cpu", torch.int64), weights.to("cpu", torch.float32)


def to_device(out: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The experts' sum (fp32, on the CPU) on `device`: queued, not waited for, on a CUDA device."""
    if device.type == "cuda":
        return handoff(device).to_device(out)
    return out.to(device)


def handoff(device: torch.device) -> HostHandoff:
    if device.index is None:
        device = torch.device(device.type, torch.cuda.current_device())
    found = _handoffs.get(device)
    if found is None:
        found = _handoffs[device] = HostHandoff(device)
    return found
