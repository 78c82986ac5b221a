"""A layer's routed experts converted for the CPU kernel a few experts at a time
(engine.loading.cpu_packed.expert_weights): the same weight as converting each GGUF tensor whole,
with a GGUF's separate gate and up experts interleaved per expert (gate rows, then up rows),
whatever the chunk size; parts of different types stay apart."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.kernels.linear import dequantize
from engine.loading import cpu_packed
from engine.offload import gguf_blocks
from engine.testing.gguf_write import Q, random_tensor

EXPERTS, ROWS, COLS = 5, 8, 256


def stored(qtype: Q, seed: int) -> torch.Tensor:
    values = random_tensor(qtype, (EXPERTS * ROWS, COLS), np.random.default_rng(seed))
    return torch.from_numpy(np.ascontiguousarray(values).view(np.uint8).reshape(-1))


def values(blocks: torch.Tensor, qtype: Q) -> torch.Tensor:
    return gguf_blocks.dequantize(blocks, int(qtype)).reshape(EXPERTS, ROWS, COLS)


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q8_0, Q.Q6_K])
@pytest.mark.parametrize("chunk", [1, 2 * ROWS * COLS, 1 << 25])  # one expert, two, all at once
def test_gate_and_up_become_one_weight_expert_by_expert(qtype: Q, chunk: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_packed, "CHUNK_WEIGHTS", chunk)
    gate, up = stored(qtype, 1), stored(qtype, 2)
    (a, b, w), = cpu_packed.expert_weights([(ROWS, 2 * ROWS, up, int(qtype)), (0, ROWS, gate, int(qtype))], EXPERTS, COLS)
    assert (a, b, w.out_features) == (0, 2 * ROWS, EXPERTS * 2 * ROWS)
    want = torch.cat([values(gate, qtype), values(up, qtype)], dim=1).reshape(-1, COLS)
    assert torch.equal(dequantize(w), want)
    whole = cpu_packed.quant_weight(gate, int(qtype), (EXPERTS * ROWS, COLS), None)  # the same kind and bytes
    assert w.kind == whole.kind and w.nbytes == 2 * whole.nbytes


def test_parts_of_different_types_stay_apart(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_packed, "CHUNK_WEIGHTS", ROWS * COLS)
    gate, up = stored(Q.Q4_K, 3), stored(Q.Q8_0, 4)
    parts = cpu_packed.expert_weights([(0, ROWS, gate, int(Q.Q4_K)), (ROWS, 2 * ROWS, up, int(Q.Q8_0))], EXPERTS, COLS)
    assert [(a, b) for a, b, _ in parts] == [(0, ROWS), (ROWS, 2 * ROWS)]
    assert torch.equal(dequantize(parts[0][2]), values(gate, Q.Q4_K).reshape(-1, COLS))
    assert torch.equal(dequantize(parts[1][2]), values(up, Q.Q8_0).reshape(-1, COLS))
