"""Float weights that are exactly a de-quantised Q4_0, Q4_1 or Q8_0 tensor, packed back for the
CPU kernel, bit for bit.

A folder converted from a GGUF (the starter's fp32 folder, which `specchat chat` and the app
build from its Q4_1 file; any "GGUF to safetensors" conversion) holds every weight as
scale * code + minimum written out in fp32: four bytes a weight that carry half a byte of
information. On a CPU a step's speed is the speed its weights are read, so that folder decoded
3x slower than the GGUF it came from (44 against 15 ms a step on the starter, 2026-11-27).

At load, on a CPU with the packed kernel, each decoder Linear weight (and the head) is tested
per group of 32 values along its rows: is there an fp16 scale d (and minimum m) and codes q
such that the kernel's own de-quantisation (linear.dequantize: q * d + m in fp32) gives every
value back exactly? Candidates come from the group itself:

- Q4_1 (codes 0..15, minimum): m = the group's least value, d = (largest - least) / 15 rounded
  to fp16, or one fp16 step either side;
- Q4_0 (d * (q - 8)): the value of largest magnitude is code 0, so m is that value and d = -m/8;
- Q8_0 (d * q, q in -127..127): d = largest |value| / 127 rounded to fp16, or a step either side.

A matrix is packed only when every one of its groups is reproduced exactly, so the values the
kernel multiplies by are the folder's own; only the order of each product's sums differs from
a dense product, as for the GGUF itself. Anything else (a bf16 or fp16 model's real weights,
a group that fits no candidate) stays as it was, so a folder is never changed in value. The test
reads each weight a few times (the starter's 135M weights: ~2 s on 2 cores) and rejects a
matrix that is none on its first 8 rows.

What this module does not do: read files or choose devices (materialise.py calls it), or pack
formats whose scales are not fp16 per group of 32 (K-quants: their folders stay fp32).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from engine.kernels.linear import PackedLinear, QuantWeight, from_codes

log = logging.getLogger(__name__)

GROUP = 32


def _steps(d: torch.Tensor) -> list[torch.Tensor]:
    """fp16 values d and one fp16 step below and above it (as fp32)."""
    h = d.half()
    bits = h.view(torch.int16)
    return [h.float(), (bits - 1).view(torch.float16).float(), (bits + 1).view(torch.float16).float()]


def _fits(groups: torch.Tensor, scale: torch.Tensor, low: int, high: int,
          minimum: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes of each group under (scale, minimum) and whether they give its values back exactly
    as q * scale (+ minimum) in fp32 (NaN or infinite values never do)."""
    codes = groups - minimum[..., None] if minimum is not None else groups.clone()
    codes.div_(torch.where(scale == 0, torch.ones_like(scale), scale)[..., None]).round_().clamp_(low, high)
    if bool((scale == 0).any()):
        codes.masked_fill_((scale == 0)[..., None], 0.0)
    values = codes * scale[..., None]
    if minimum is not None:
        values.add_(minimum[..., None])
    exact = values.eq_(groups).all(-1) & torch.isfinite(scale) & (scale.half().float() == scale)
    if minimum is not None:
        exact &= minimum.half().float() == minimum
    return codes, exact


def _first_fit(groups: torch.Tensor, candidates: list[tuple[torch.Tensor, torch.Tensor | None]], low: int,
               high: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None:
    """The codes, scales and minimums of the first candidate that fits each group, or None when
    a group fits none."""
    codes = torch.zeros_like(groups)
    scale = torch.zeros(groups.shape[:-1])
    minimum = torch.zeros(groups.shape[:-1]) if candidates[0][1] is not None else None
    done = torch.zeros(groups.shape[:-1], dtype=torch.bool)
    for i, (d, m) in enumerate(candidates):
        q, exact = _fits(groups, d, low, high, m)
        if i == 0 and bool(exact.all()):  # the usual case
            return q, d, m
        new = exact & ~done
        codes[new], scale[new] = q[new], d[new]
        if minimum is not None and m is not None:
            minimum[new] = m[new]
        done |= exact
        if bool(done.all()):
            return codes, scale, minimum
    return None


def _rows(groups: torch.Tensor, form: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None:
    """Codes, scales and minimums of groups (rows, k / 32, 32) in one form, or None."""
    lo, hi = groups.amin(-1), groups.amax(-1)
    peak = torch.where(hi.abs() >= lo.abs(), hi, lo)
    if form == "q4_1":  # the least value is the minimum, exactly
        if not bool((lo.half().float() == lo).all()):
            return None
        return _first_fit(groups, [(d, lo) for d in _steps((hi - lo) / 15)], 0, 15)
    if form == "q4_0":  # the value of largest magnitude is code 0
        return _first_fit(groups, [(-peak / 8, peak)], 0, 15)
    return _first_fit(groups, [(d, None) for d in _steps(peak.abs() / 127)], -127, 127)


FORMS = ("q4_1", "q4_0", "q8_0")
CHUNK = 1 << 20  # values tested at a time (bounds the work memory on a large head)


def exact_weight(weight: torch.Tensor) -> QuantWeight | None:
    """The packed weight whose de-quantisation is `weight` bit for bit, or None. The form is
    chosen on the first rows (a matrix that is none fails there, at the cost of one chunk)."""
    if weight.dtype != torch.float32 or weight.dim() != 2 or weight.shape[1] % GROUP or not weight.numel():
        return None
    n, k = weight.shape
    groups = weight.detach().reshape(n, k // GROUP, GROUP)
    rows = max(8, CHUNK // k)
    starts = [0, *range(min(8, n), n, rows)]  # a few rows first: most matrices that are none fail there
    for form in FORMS:
        parts = []
        for r, end in zip(starts, [*starts[1:], n]):
            found = _rows(groups[r:end], form)
            if found is None:
                break
            parts.append(found)
        else:
            codes = torch.cat([p[0] for p in parts]).reshape(n, k)
            scale = torch.cat([p[1] for p in parts])
            minimum = torch.cat([p[2] for p in parts]) if form != "q8_0" else None  # type: ignore[misc]
            # _fits tested the values q * d + m in fp32 that linear.dequantize (the kernel's
            # reference) computes, with d and m fp16 values: from_codes stores them as they are
            return from_codes(codes, scale, minimum, GROUP, 8 if form == "q8_0" else 4)
    return None


def pack_exact(model: nn.Module, head: bool) -> tuple[int, int]:
    """Replace each decoder-layer nn.Linear of `model` (an HF causal LM) whose weight is exact
    (and, with `head`, the head: a tied head gets a packed copy, the embedding keeps its rows)
    by a PackedLinear. Returns (matrices packed, matrices tested)."""
    packed = tested = 0
    layers = model.get_submodule("model.layers")
    for layer in layers.children():
        for name, module in list(layer.named_modules()):
            if type(module) is not nn.Linear:
                continue
            tested += 1
            found = exact_weight(module.weight)
            if found is None:
                continue
            parent_name, _, child = name.rpartition(".")
            parent = layer.get_submodule(parent_name) if parent_name else layer
            setattr(parent, child, PackedLinear(found, module.bias.detach() if module.bias is not None else None))
            packed += 1
    out = getattr(model, "lm_head", None)
    if head and type(out) is nn.Linear and out.bias is None:
        tested += 1
        found = exact_weight(out.weight)
        if found is not None:
            model.lm_head = PackedLinear(found)
            packed += 1
    return packed, tested
