"""An embedding table kept in its file's blocks on the CPU: `PackedEmbedding` stands in for a
model's `embed_tokens` and de-quantises only the rows a pass looks up.

A GGUF's token embedding is a vocabulary-sized matrix: de-quantised to fp32 for look-ups it
took 1.2 GB for a 151,936 x 2048 table (Qwen3), 2.0 GB for Qwen3.5's 248,320 rows and 4.2 GB
for a 70B Llama's 128,256 x 8192, against 0.2-0.8 GB as the packed kernel holds it. A pass reads
one row per token, so the rows are de-quantised when they are read (linear.dequantize_rows: the
values the kernel multiplies by, the file's), and multiplied by the module's own embed_scale
where it has one (Gemma's scaled embeddings), as its forward would.

What this module does not do: read files (engine.loading.materialise builds it from the blocks,
engine.loading.cpu_packed.quant_weight), or run on a GPU (a GPU keeps its table de-quantised).
"""

from __future__ import annotations

from typing import cast

import torch
from torch import nn

from engine.kernels.linear import QuantWeight, dequantize, dequantize_rows


class PackedEmbedding(nn.Module):
    """nn.Embedding's look-up over a QuantWeight (vocab x hidden), fp32 out."""

    def __init__(self, weight: QuantWeight, original: nn.Module) -> None:
        super().__init__()
        self.packed = weight
        self.num_embeddings, self.embedding_dim = weight.out_features, weight.in_features
        scale = getattr(original, "embed_scale", None)
        self._scaled = isinstance(scale, torch.Tensor)
        if isinstance(scale, torch.Tensor):
            self.register_buffer("embed_scale", scale.detach().to("cpu", torch.float32).clone(), persistent=False)
        self.dtype = torch.float32
        self.device = torch.device("cpu")

    @property
    def nbytes(self) -> int:
        return self.packed.nbytes

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        rows = dequantize_rows(self.packed, input_ids.to("cpu")).view(*input_ids.shape, self.embedding_dim)
        return rows * cast(torch.Tensor, self.embed_scale) if self._scaled else rows

    @property
    def weight(self) -> torch.Tensor:
        """The whole table de-quantised (vocab x hidden fp32, allocated on each read): for the
        rare reader of every row; a look-up reads only its rows."""
        return dequantize(self.packed)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, {self.packed.kind}, {self.nbytes / 2**20:.0f} MiB"


def leading_rows(embed: nn.Module, n: int) -> torch.Tensor:
    """The first `n` rows of an embedding table (unscaled), without de-quantising the rest."""
    if isinstance(embed, PackedEmbedding):
        return dequantize_rows(embed.packed, torch.arange(min(n, embed.num_embeddings)))
    weight = cast(torch.Tensor, embed.weight)
    return weight[:n]
