"""The embedding table kept packed on the CPU (engine.kernels.embedding): a look-up gives the rows
the de-quantised table holds, bit for bit (Gemma's scaled embedding too); a GGUF loaded resident
with the kernel keeps its table in the file's blocks (a tied head the same weight, one copy), and
a streamed load keeps it packed too unless a head is tied to it. Whole-model logits and text against
transformers with the table packed: tests/engine/loading/test_gguf_families*.py ("kernel", and the
streamed places of untied models, whose logits stay bit for bit)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn
from transformers.models.gemma3.modeling_gemma3 import Gemma3TextScaledWordEmbedding

from engine.kernels import build
from engine.kernels.embedding import PackedEmbedding, leading_rows
from engine.kernels.linear import PackedLinear, dequantize, dequantize_rows, from_dense
from engine.loading.load import load_model
from engine.testing.synthetic import tiny_gguf

VOCAB, HIDDEN = 300, 64


@pytest.mark.parametrize("kind,group", [("q4", 32), ("q8", 16), ("q8", 32)])
def test_a_look_up_gives_the_tables_rows_bit_for_bit(kind: str, group: int) -> None:
    g = torch.Generator().manual_seed(0)
    w = from_dense(torch.randn(VOCAB, HIDDEN, generator=g), kind, group)  # type: ignore[arg-type]
    table = dequantize(w)
    ids = torch.tensor([[5, 0, 299, 5], [17, 18, 1, 2]])
    assert torch.equal(dequantize_rows(w, ids), table[ids.flatten()])
    plain = nn.Embedding(VOCAB, HIDDEN)
    plain.weight.data = table
    packed = PackedEmbedding(w, plain)
    assert torch.equal(packed(ids), plain(ids)) and packed(ids).shape == (2, 4, HIDDEN)
    assert torch.equal(leading_rows(packed, 10), leading_rows(plain, 10))
    assert torch.equal(packed.weight, table)
    assert packed.nbytes < table.numel() * 4 / (3 if kind == "q4" else 1.5)
    # Gemma's scaled embedding: rows times its embed_scale, as its own forward gives them
    scaled = Gemma3TextScaledWordEmbedding(VOCAB, HIDDEN, 0, embed_scale=HIDDEN**0.5)
    scaled.weight.data = table
    assert torch.equal(PackedEmbedding(w, scaled)(ids), scaled(ids))


@pytest.mark.skipif(build.kernels() is None, reason="no C compiler here")
@pytest.mark.parametrize("tied", [False, True])
def test_a_resident_gguf_keeps_its_table_packed_and_a_streamed_one_unless_tied(model_cache: Path, tied: bool) -> None:
    path = tiny_gguf("llama", cache_dir=model_cache, tied=tied)
    resident = load_model(path, "cpu", torch.float32, offload="none").model
    assert isinstance(resident.embed, PackedEmbedding)
    assert resident.dtype == torch.float32 and resident.device.type == "cpu"
    assert isinstance(resident.head, PackedLinear)
    assert (resident.head.qweight is resident.embed.packed) == tied  # tied: one packed copy serves both
    streamed = load_model(path, "cpu", torch.float32, offload="all").model
    # streamed layers: a head tied to the table keeps it dense (the head's product the file's
    # values, bit for bit, as the de-quantised layers'); an untied table is packed all the same
    assert isinstance(streamed.embed, PackedEmbedding) != tied
    assert type(streamed.head) is nn.Linear
    ids = torch.tensor([[3, 1, 4, 1, 5]])
    assert torch.equal(resident.embed(ids), streamed.embed(ids))  # the same values either way
