"""How engine.model.lean_step warms up, captures and replays its CUDA graphs: the one place that
calls torch.cuda's graph API, so the CPU tests can stand a fake in for it (only the GPU faked).

What this module does not do: decide what to capture or when (lean_step), or run on a CPU.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


class CudaGraphs:
    """How a LeanStep warms up, captures and replays on a CUDA device: one stream of its own for
    the warm-ups and every capture (libraries make handles and workspaces per stream on first
    use, which must not happen inside a capture; a pool shared by captures wants the same stream
    each time). The tests stand a fake in for it (a replay that runs the segment again): only
    the GPU is faked, the bookkeeping around it is the real one."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device=device)

    def warm(self, run: Callable[[], object]) -> None:
        here = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(here)
        with torch.cuda.stream(self.stream):
            run()
        here.wait_stream(self.stream)

    def pool(self) -> Any:
        return torch.cuda.graph_pool_handle()

    def capture(self, run: Callable[[], object], pool: Any) -> Any:
        """A torch.cuda.CUDAGraph of `run` (its replay() repeats it)."""
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool, stream=self.stream, capture_error_mode="thread_local"):
            run()
        return graph

    def settle(self) -> None:
        torch.cuda.current_stream(self.device).wait_stream(self.stream)
