"""A mixture of experts that writes real text: a dense Llama GGUF (the starter) rewritten as a
Mixtral-style GGUF whose experts are slices of the dense model's MLP (`moe_from_dense`).

Random MoE GGUFs (random_gguf) have the bytes and layout of a real one but their text never
repeats, so speculation has nothing to accept there; no real MoE checkpoint can be downloaded on
a machine without the hub. This one reads and writes like the dense model it came from, so
trees are accepted as on that model, while every pass routes through 128 experts as an MoE.

The construction ("fine-grained" upcycling, exact up to rounding): the dense MLP's intermediate
rows are cut into `slices` equal slices (gate and up rows, down columns); expert (c, s) is copy
c of slice s, for `copies` copies (128 experts = 16 x 8 with the defaults, top-8 routed: Qwen3-
30B-A3B's counts, each expert a third of the hidden width wide as there). Every copy's router
row is the same for its slices, so the top-8 are always the eight slices of one copy, their
weights 1/8 each after Mixtral's renormalisation; down's scales are multiplied by 8 (a power of
two: exact in the blocks' fp16 scales), so the layer's output is the dense MLP's whatever copy a
token picks. Which copy it picks is a random router's choice that differs from token to token,
so a pass of N tokens wakes the union of their copies, as a real MoE's tree does. Plainly: the
routing is coarser than a real model's (16 groups of 8, not 8 of 128 independently), so the
union of N tokens' experts grows in steps of eight.

Quantised blocks are copied as they are: the dense file's ffn tensors must be in a 32-wide
block type (the starter's Q4_1 and Q8_0, Q4_0), so a slice of down's columns is whole blocks.

What this module does not do: make a better model (it is the dense model, routed), or write
anything but llama-architecture sources.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf import GGUFReader
from gguf.constants import GGML_QUANT_SIZES

from engine.testing.gguf_write import SCALE_FIELDS, rewriter

COPIES, SLICES = 16, 8  # 128 experts, top-8


def moe_from_dense(src: Path, dest: Path, copies: int = COPIES, slices: int = SLICES, seed: int = 0) -> Path:
    """Write `src` (a dense llama GGUF) as the upcycled MoE at `dest` (the module docstring).
    Written to `dest` + ".part", then renamed; idempotent."""
    if dest.is_file():
        return dest
    reader = GGUFReader(src)
    arch = str(reader.fields["general.architecture"].contents())
    if arch != "llama":
        raise ValueError(f"{src.name} is a {arch} model; only llama GGUFs are upcycled here")
    hidden = int(reader.fields["llama.embedding_length"].contents())
    width = int(reader.fields["llama.feed_forward_length"].contents())
    if width % slices:
        raise ValueError(f"feed-forward width {width} does not split into {slices} slices")
    part_width = width // slices
    experts = copies * slices
    rng = np.random.default_rng(seed)
    writes: list[tuple[str, np.ndarray, Q | None]] = []  # (name, data, raw type or None for floats)
    for t in reader.tensors:
        data, qtype = np.asarray(t.data), Q(t.tensor_type)
        name = t.name
        kind = name.rsplit(".", 2)[-2] if name.startswith("blk.") else ""
        if kind not in ("ffn_gate", "ffn_up", "ffn_down"):
            writes.append((name, data, None if qtype in (Q.F32, Q.F16, Q.BF16) else qtype))
            continue
        block_values, block_bytes = GGML_QUANT_SIZES[qtype]
        if qtype not in SCALE_FIELDS or block_values != 32:
            raise ValueError(f"{name} is {qtype.name}; upcycling copies 32-wide blocks (Q4_0, Q4_1, Q8_0)")
        layer = name.split(".")[1]
        if kind == "ffn_down":  # (hidden, width / 32 * block bytes): a slice is whole blocks of columns
            step = part_width // block_values * block_bytes
            sliced = [_scaled(data[:, s * step:(s + 1) * step], qtype, block_bytes, float(slices))
                      for s in range(slices)]
            writes.append((f"blk.{layer}.ffn_down_exps.weight", np.stack(sliced * copies), qtype))
            router = rng.normal(0.0, 1.0 / np.sqrt(hidden), (copies, hidden)).astype(np.float32)
            writes.append((f"blk.{layer}.ffn_gate_inp.weight", np.repeat(router, slices, axis=0), None))
        else:  # (width, row bytes): a slice is rows
            sliced = [data[s * part_width:(s + 1) * part_width] for s in range(slices)]
            writes.append((f"blk.{layer}.{kind}_exps.weight", np.stack(sliced * copies), qtype))
    part = dest.with_name(dest.name + ".part")
    name = str(reader.fields["general.name"].contents()) if "general.name" in reader.fields else src.stem
    w = rewriter(reader, part, {"llama.feed_forward_length": part_width,  # llama.cpp's llama: its experts' width
                                "general.name": f"{name} as {experts} experts (top-{slices}, upcycled)",
                                "llama.expert_count": experts, "llama.expert_used_count": slices})

    for name, data, raw in writes:
        if raw is None:
            w.add_tensor_info(name, data.shape, data.dtype, int(data.nbytes))
        else:
            w.add_tensor_info(name, data.shape, np.dtype(np.uint8), int(data.nbytes), raw_dtype=raw)
    try:
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        for _, data, _ in writes:
            w.write_tensor_data(np.ascontiguousarray(data))
        w.close()
        os.replace(part, dest)
    except BaseException:
        part.unlink(missing_ok=True)
        raise
    return dest


def _scaled(blocks: np.ndarray, qtype: Q, block_bytes: int, factor: float) -> np.ndarray:
    """Raw blocks (rows x bytes) with every block's fp16 scale fields (d, and m where the type
    has one) multiplied by `factor`: the block's values times it, exactly for a power of two."""
    out = np.ascontiguousarray(blocks).copy()
    grid = out.reshape(out.shape[0], -1, block_bytes)
    for offset in SCALE_FIELDS[qtype]:
        field = np.ascontiguousarray(grid[:, :, offset:offset + 2]).view(np.float16)
        grid[:, :, offset:offset + 2] = (field.astype(np.float32) * factor).astype(np.float16).view(np.uint8)
    return out
