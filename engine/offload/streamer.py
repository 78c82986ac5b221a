"""The streaming executor: runs every decoder layer of a pass in order while the next
offloaded layers are copied into a ring of device slots.

A layer's home is the device (a resident transformers module, or a packed device buffer for
NF4), or an index of the host store (RAM or disk). On CUDA, copies run on a side stream ordered
by events: a slot is overwritten only after the layer that last used it has run, and a layer
runs only after its copy landed. On CPU the same executor copies with plain `copy_` on a worker
thread, so the schedule is exercised by tests.

What this module does not do: read checkpoints (engine.loading), decide placement
(engine.planning.placement) or choose budgets.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch
from torch import nn

from engine.offload.host_store import HostStore
from engine.offload import routed
from engine.offload.layout import LayerLayout, bind
from engine.offload.unpack import Unpacker

log = logging.getLogger(__name__)


# ---- the executor ---------------------------------------------------------------------------
LayerCall = Callable[[nn.Module, int, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class LayerHome:
    """Where model layer i lives: a resident module, a packed device buffer (packed layers
    resident) or index `store_index` of the host store."""

    module: nn.Module | None = None
    packed: torch.Tensor | None = None
    store_index: int | None = None


class LayerStreamer:
    """Runs all decoder layers of a pass in order, streaming the offloaded ones through a ring
    of device slots. `call(module, layer_idx, hidden)` runs one layer (causal_lm supplies it).
    `layouts[i]` is model layer i's packed layout (one LayerLayout stands for all: 16-bit or
    NF4 models; GGUF layers each have theirs)."""

    def __init__(self, homes: list[LayerHome], layouts: LayerLayout | Sequence[LayerLayout], store: HostStore | None,
                 make_template: Callable[[int], nn.Module], device: torch.device, ring_slots: int) -> None:
        self.homes = homes
        # one layout stands for every layer
        self.layouts = [layouts] * len(homes) if isinstance(layouts, LayerLayout) else list(layouts)
        self.layout = layout = self.layouts[0]
        self.store = store
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.streamed = [i for i, h in enumerate(homes) if h.store_index is not None]
        m = len(self.streamed)
        self.k = min(ring_slots, m) if m else 0
        slot_bytes = max((self.layouts[i].nbytes for i in self.streamed), default=0)
        self._slots = [torch.empty(slot_bytes, dtype=torch.uint8, device=self.device) for _ in range(self.k)]
        self._unpack = Unpacker(self.device) if layout.quant != "none" else None
        # layers of one kind (the same parameters) share templates: a hybrid model's linear
        # and attention layers, an MoE model's dense and expert layers each have theirs
        kinds: dict[tuple, int] = {}
        self._kind: list[int] = []
        first: list[int] = []
        for i, lay in enumerate(self.layouts):
            key = tuple((e.name, e.shape) for e in lay.entries if not e.side)
            if key not in kinds:
                kinds[key] = len(first)
                first.append(i)
            self._kind.append(kinds[key])
        dense_layouts = [self.layouts[i].dense_layout() for i in first]
        self.dense_layout = dense_layouts[0]
        self._dense_params: list[dict[str, torch.Tensor]] = []
        self._dense_templates: list[nn.Module] = []
        # an MoE kind's experts de-quantised as routed (routed.py): the rest before the pass
        self._routed: list[routed.RoutedExperts | None] = []
        self._templates: list[list[nn.Module]] = []
        if self._unpack is not None:
            # one dense buffer: the compute stream de-quantises into it, then runs the layer
            self._dense = torch.empty(max(d.nbytes for d in dense_layouts), dtype=torch.uint8, device=self.device)
            for i, dense in zip(first, dense_layouts):
                params = dense.params(self._dense)
                template = make_template(i)
                bind(template, params)
                self._dense_params.append(params)
                self._dense_templates.append(template)
                self._routed.append(routed.attach(template, self.layouts[i], params))
        else:
            for i in first:
                templates = []
                for slot in self._slots:
                    t = make_template(i)
                    bind(t, self.layouts[i].params(slot))
                    templates.append(t)
                self._templates.append(templates)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="specchat-offload") if m else None
        self._copy_stream = torch.cuda.Stream(device=self.device) if self.cuda and m else None
        self._loaded = [torch.cuda.Event() for _ in range(self.k)] if self._copy_stream else []
        self._free = [torch.cuda.Event() for _ in range(self.k)] if self._copy_stream else []
        self._staging = ([torch.empty(slot_bytes, dtype=torch.uint8, pin_memory=True) for _ in range(self.k)]
                         if self._copy_stream and store is not None and store.disk_layers else [])
        self._pending: list[Future[None] | None] = [None] * self.k
        self._slot_layer: list[int | None] = [None] * self.k  # store index a slot holds (or is getting)
        self._pos = 0  # position in the cyclic sequence of streamed layers of the next layer to run
        self._primed = False
        # called with the model layer index after each layer has been issued (on CUDA: queued on
        # the compute stream, so a CUDA event recorded here marks the layer's end); benchmarks
        # time layers with it
        self.after_layer: Callable[[int], None] | None = None

    # -- scheduling --
    def _submit(self, pos: int) -> None:
        """Start loading streamed position `pos` into its slot (pos % k)."""
        assert self._pool is not None and self.store is not None
        k = pos % self.k
        j = self.homes[self.streamed[pos % len(self.streamed)]].store_index
        assert j is not None
        if self._slot_layer[k] == j:  # already there (ring as large as the streamed set)
            return
        self._slot_layer[k] = j
        if self.store.tier(j) == "disk":
            self.store.will_need(j)
        self._pending[k] = self._pool.submit(self._load, j, k)

    @torch.inference_mode()
    def _load(self, j: int, k: int) -> None:
        assert self.store is not None
        src = self.store.source(j)
        n = src.numel()
        disk = self.store.tier(j) == "disk"
        if self._copy_stream is None:  # CPU: a plain copy (on this worker thread)
            self._slots[k][:n].copy_(src)
        else:
            if disk:  # page in from the file to pinned staging, then DMA
                staging = self._staging[k][:n]
                self._loaded[k].synchronize()  # the previous DMA out of this staging buffer
                staging.copy_(src)
                src = staging
            with torch.cuda.stream(self._copy_stream):
                self._copy_stream.wait_event(self._free[k])  # the slot's previous layer has run
                self._slots[k][:n].copy_(src, non_blocking=True)
                self._loaded[k].record(self._copy_stream)
        if disk:
            self.store.done_with(j)

    def _acquire(self, pos: int) -> int:
        k = pos % self.k
        fut = self._pending[k]
        if fut is not None:
            fut.result()
            self._pending[k] = None
        if self._copy_stream is not None:
            torch.cuda.current_stream(self.device).wait_event(self._loaded[k])
        return k

    def _release(self, k: int) -> None:
        if self._copy_stream is not None:
            self._free[k].record(torch.cuda.current_stream(self.device))

    def reset(self) -> None:
        """Forget the schedule (after a failed pass): wait for copies in flight; the next pass
        starts from its first layer."""
        for k, fut in enumerate(self._pending):
            if fut is not None:
                try:
                    fut.result()
                except Exception:  # noqa: BLE001 -- the next pass reloads the slot
                    log.debug("a layer copy failed during a failed pass", exc_info=True)
            self._pending[k] = None
        self._slot_layer = [None] * self.k
        self._pos, self._primed = 0, False

    # -- one pass --
    def run(self, hidden: torch.Tensor, call: LayerCall) -> torch.Tensor:
        try:
            return self._run(hidden, call)
        except BaseException:
            self.reset()
            raise

    def _run(self, hidden: torch.Tensor, call: LayerCall) -> torch.Tensor:
        m = len(self.streamed)
        if m and not self._primed:
            for p in range(self.k):
                self._submit(p)
            self._primed = True
        for i, home in enumerate(self.homes):
            if home.module is not None:
                hidden = call(home.module, i, hidden)
            elif home.packed is not None:  # packed, resident on the device
                hidden = self._unpacked(i, home.packed, hidden, call)
            else:
                pos = self._pos
                k = self._acquire(pos)
                kind = self._kind[i]
                if self._unpack is not None:
                    hidden = self._unpacked(i, self._slots[k], hidden, call, slot=k)
                else:
                    hidden = call(self._templates[kind][k], i, hidden)
                    self._release(k)
                self._pos = pos + 1
                # refill this slot with the layer k positions ahead (wrapping into the next pass)
                self._submit(pos + self.k)
            if self.after_layer is not None:
                self.after_layer(i)
        # positions keep counting across passes (each pass consumes exactly m), so a slot
        # prefetched at the end of one pass is found at the start of the next
        return hidden

    def _unpacked(self, i: int, packed: torch.Tensor, hidden: torch.Tensor, call: LayerCall,
                  slot: int | None = None) -> torch.Tensor:
        """Layer i from its packed bytes (in ring slot `slot`, released once read): de-quantised
        into its kind's dense template (an MoE's routed experts as the router picks them, from
        the bytes still in the slot: routed.py), then run."""
        assert self._unpack is not None
        kind, layout = self._kind[i], self.layouts[i]
        hook = self._routed[kind]
        self._unpack(layout, packed, self._dense_params[kind], only=routed.eager(layout, hook))
        if hook is None:
            if slot is not None:
                self._release(slot)  # the slot is free once dequantised
            return call(self._dense_templates[kind], i, hidden)
        hook.current = (layout, packed)
        try:
            return call(self._dense_templates[kind], i, hidden)
        finally:
            hook.current = None
            if slot is not None:
                self._release(slot)

    def close(self, close_store: bool = True) -> None:
        """Wait for copies in flight and stop the copy thread; `close_store=False` keeps the
        host store open for another streamer over the same layers."""
        self.reset()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        if self.store is not None and close_store:
            self.store.close()

