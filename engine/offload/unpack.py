"""De-quantisation of a packed layer on the device, the whole layer in one go, into the dense
buffer its template layer runs from.

One `Unpacker` per device keeps what every layer shares there: the NF4 code book and the row
orders of GGUF tensors (llama.cpp's q/k permutation), uploaded once.

What this module does not do: decide layouts (layout.py) or move bytes between tiers (streamer).
"""

from __future__ import annotations

import torch

from engine.offload import gguf_blocks, int4, lowbit
from engine.offload.layout import ABSMAX, Entry, LayerLayout, dequantize_nf4, nf4_code


class Unpacker:
    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        self._code: torch.Tensor | None = None
        # by the identity of a layout's row-order tuple (one per tensor name, shared by layers)
        self._orders: dict[int, tuple[tuple[int, ...], torch.Tensor]] = {}

    def __call__(self, layout: LayerLayout, packed: torch.Tensor, dense: dict[str, torch.Tensor],
                 only: set[str] | None = None) -> None:
        """Fill the dense parameter tensors `dense` (by name) from packed buffer `packed`
        (with `only`: those entries alone)."""
        by_name = {e.name: e for e in layout.entries}
        for e in layout.entries:
            if e.side or (only is not None and e.param not in only):
                continue
            out = dense[e.param]
            if e.part is not None:  # rows [a, b) of each matrix: a strided slice of the parameter
                out = out.narrow(-2, e.part[0], e.part[1] - e.part[0])
            if e.kind == "dense":
                out.copy_(layout.view(packed, e))
            elif e.kind == "gguf":
                gguf_blocks.dequantize_into(layout.view(packed, e), e.qtype, out, self.row_order(e))
            elif e.kind == "nf4":
                if self._code is None:
                    self._code = nf4_code(self.device)
                dequantize_nf4(layout.view(packed, e), layout.view(packed, by_name[e.name + ABSMAX]), out,
                               self._code)
            elif e.kind == "lowbit":
                cscale = by_name.get(e.name + "#cscale")
                lowbit.dequantize_into(layout.view(packed, e), layout.view(packed, by_name[e.name + "#scale"]),
                                       layout.view(packed, by_name[e.name + "#min"]),
                                       layout.view(packed, by_name[e.name + "#rows"]), e.qtype, out,
                                       None if cscale is None else layout.view(packed, cscale))
            else:  # "awq" / "gptq"
                int4.dequantize_into(e.kind, {k: layout.view(packed, s) for k, s in _sides(by_name, e)},
                                     layout.view(packed, e), out, v2=e.qtype == 2)

    def row_order(self, e: Entry) -> torch.Tensor | None:
        """A GGUF entry's row order on this device (None: as stored)."""
        if e.row_order is None:
            return None
        known = self._orders.get(id(e.row_order))
        if known is None or known[0] is not e.row_order:
            known = self._orders[id(e.row_order)] = (e.row_order, torch.tensor(e.row_order, device=self.device))
        return known[1]


def _sides(by_name: dict[str, Entry], e: Entry) -> list[tuple[str, Entry]]:
    return [(k, by_name[e.name + "#" + k]) for k in ("scales", "qzeros", "g_idx") if e.name + "#" + k in by_name]
