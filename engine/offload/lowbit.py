"""Low-bit group-wise weights (2, 3 or 4 bits): the self-draft's substitutes for the target's
offloaded layers (engine.loading.self_draft).

A weight is cut into groups of `group` consecutive values along its input dimension (its last:
a Linear's (out, in), an MoE's fused experts (E, out, in)); a row is one output's `in` values.
Each value keeps a code q in [0, 2^bits - 1] and each group a scale s and an offset m: w ~ L[q]
* s + m. At 2 and 4 bits L[q] = q (a uniform grid); at 3 bits L is 8 normal quantiles spread
onto [0, 7] (levels(): finer steps near the middle, where most of a group's weights are), which
on the starter takes the 3-bit draft's KL to its target a further few to 18 % lower than the
uniform grid. Eight codes are stored in `bits` bytes, lowest first (value k at bits [bits*k,
bits*(k+1)) of a little-endian word), so 2, 3 and 4 bits share one packing and one
de-quantiser, in plain torch ops that run the same on a CPU and a GPU.

(s, m) are stored in a byte each under two fp16 factors per row (llama.cpp's K-quants keep 6-bit
group scales under a per-block factor the same way): s = s8 x sd (s8 in 1..255, sd = the row's
largest s / 255), m = m8 x md (m8 in -127..127, md = the row's largest |m| / 127), so a group
of 32 costs what a group of 64 cost with fp16 (s, m): 0.5 bits a weight, plus 32 bits a row.
On the starter's 3-bit self-draft the smaller groups took the KL to the target on held-out chat
answers from 0.42 to 0.27 nats a token, and the target's next token is the draft's first from
69 % to 73 % of the time (scripts/lowbit_kl.py; the FP4 proxy: 0.49 and 68 %). The fit runs on
float (s, m); then they are rounded to their bytes and the codes to the nearest level of the
rounded pair (the rounding of s and m costs about a tenth of what groups of 32 gain).

Optionally the columns are scaled first: with a column scale c (one fp16 per input channel),
the codes are those of W * c and the de-quantiser divides each column by c again (calibrate.py
picks c from the layer's inputs: the activation-aware scaling that takes the 3-bit starter
draft's KL to its target from 2.3 to about 1.0 nats a token on held-out chat text). c = 1 is the
plain quantiser; c changes only which weights get the finer steps, never the stored form.

Codes start from the group's range; then (s, m) and the codes are fitted alternately: for
fixed codes the least-squares (s, m) is a line fit, for fixed (s, m) the nearest code is a
rounding to the nearest level. Each group keeps its best round: at 3 bits a fifth less squared
error than rounding the range on Gaussian weights (tests/engine/loading/test_self_draft.py
checks it is lower at every width). Two options make the fit output-aware without storing
anything more (calibrate.py sets them): `importance` weighs each input column's squared error
(h_j = mean(x_j^2) of the matrix's inputs, the diagonal of the layer's Hessian: the output error
of a column's rounding grows with its input's size), in the line fit and in the choice of the
best round; `clips` adds starts from the range shrunk about its middle (AWQ's clipping, here
chosen per group by the same weighted error: an outlier that sets the range costs the other
values their steps). Bytes per weight: bits / 8 + 2 / group, plus 4 per row for the factors and
2 per input channel for c (3.5 bits a weight at 3 bits and about 0.08 more on the starter; a
bitsandbytes FP4 or NF4 weight with an fp32 absmax per 64 takes 4.5).

What this module does not do: choose the bits, the layers or c (self_draft.py, calibrate.py),
or lay layers out (layout.py: entries of kind "lowbit", with `#scale`, `#min`, `#rows` and
`#cscale` side entries).
"""

from __future__ import annotations

import torch

BITS = (2, 3, 4)
GROUPS = (32,)  # the first that divides the input dimension
FIT_ROUNDS = 4
CHUNK = 1 << 22  # values quantised per step (bounds the work memory on a 70B's experts)


NF_BITS = (3,)  # widths whose codes index normal-quantile levels (levels()); the others: a uniform grid
_LEVELS: dict[tuple[int, str], torch.Tensor] = {}


def levels(bits: int, device: torch.device, uniform: bool = False) -> torch.Tensor | None:
    """The levels a `bits` code stands for, in steps of the group's scale above its offset:
    2^bits normal quantiles at (k + 1/2) / 2^bits, spread onto [0, 2^bits - 1] (denser near the
    middle, where a group's Gaussian-like weights are); None for the uniform grid (code k = k)."""
    if uniform or bits not in NF_BITS:
        return None
    key = (bits, str(device))
    if key not in _LEVELS:
        n = 2**bits
        z = torch.distributions.Normal(0.0, 1.0).icdf((torch.arange(n, dtype=torch.float64) + 0.5) / n)
        _LEVELS[key] = ((z - z[0]) / (z[-1] - z[0]) * (n - 1)).float().to(device)
    return _LEVELS[key]


def group_of(shape: tuple[int, ...]) -> int | None:
    """The group size for a weight of this shape, or None: it stays dense (a vector, or an
    input dimension no group divides)."""
    if len(shape) < 2:
        return None
    return next((g for g in GROUPS if shape[-1] % g == 0), None)


def packed_nbytes(numel: int, bits: int) -> int:
    """Bytes of the codes of `numel` values (a multiple of 8)."""
    return numel // 8 * bits


def fit_groups(w: torch.Tensor, bits: int, levels: torch.Tensor | None = None,
               weight: torch.Tensor | None = None, clips: tuple[float, ...] = (1.0,), rounds: int = FIT_ROUNDS
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(groups, G) fp32 -> (codes (groups, G) uint8, scale (groups,) fp16, offset (groups,) fp16).
    `weight` (groups, G), positive: each value's squared error counts that much (the fit and the
    choice of round); `clips`: each a start from the group's range shrunk about its middle by
    that ratio, the best of all rounds of all starts kept."""
    top = float(2**bits - 1)
    lo, hi = w.amin(dim=1), w.amax(dim=1)
    mid, half = (hi + lo) / 2, (hi - lo) / 2
    best_err = torch.full_like(lo, float("inf"))
    best_s, best_m = lo.clone(), lo.clone()
    if weight is None:
        def mean(t: torch.Tensor) -> torch.Tensor:
            return t.mean(dim=1)
    else:
        norm = weight / weight.sum(dim=1, keepdim=True).clamp(min=1e-30)

        def mean(t: torch.Tensor) -> torch.Tensor:
            return (t * norm).sum(dim=1)
    mean_w = mean(w)

    def codes(s16: torch.Tensor, m16: torch.Tensor) -> torch.Tensor:
        return nearest(w, s16, m16, bits, levels)

    def value(q: torch.Tensor) -> torch.Tensor:
        return q if levels is None else levels[q.long()]

    for ratio in clips:
        s = (2 * half * ratio / top).clamp(min=1e-8)
        m = mid - half * ratio
        for _ in range(rounds):
            s16, m16 = s.half().float().clamp(min=6e-8), m.half().float()
            q = value(codes(s16, m16))
            err = mean((q * s16[:, None] + m16[:, None] - w).square_())
            better = err < best_err
            best_err = torch.where(better, err, best_err)
            best_s, best_m = torch.where(better, s16, best_s), torch.where(better, m16, best_m)
            # (weighted) least-squares line through (q, w) per group
            mean_q = mean(q)
            dq = q - mean_q[:, None]
            var = mean(dq.square())
            cov = mean(dq * (w - mean_w[:, None]))
            flat = var < 1e-12
            s = torch.where(flat, s, cov / var.clamp(min=1e-12)).clamp(min=1e-8)
            m = torch.where(flat, m, mean_w - s * mean_q)
    q = codes(best_s, best_m)
    return q.to(torch.uint8), best_s.half(), best_m.half()


def nearest(w: torch.Tensor, s: torch.Tensor, m: torch.Tensor, bits: int, levels: torch.Tensor | None
            ) -> torch.Tensor:
    """(groups, G) values and each group's (s, m) -> the nearest level's code of each value:
    float on the uniform grid, uint8 on `levels`."""
    t = (w - m[:, None]) / s[:, None]
    if levels is None:
        return t.round_().clamp_(0, float(2**bits - 1))
    q = torch.zeros(t.shape, dtype=torch.uint8, device=t.device)
    for edge in ((levels[1:] + levels[:-1]) / 2).tolist():  # the midpoints below t (twice bucketize's speed on a CPU)
        q += t > edge
    return q


def to_bytes(s: torch.Tensor, m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(rows, groups) float scales and offsets -> s8 (uint8), m8 (int8) and the rows' factors
    (rows, 2) fp16 [sd, md]: s ~ s8 x sd, m ~ m8 x md (module docstring)."""
    sd = (s.amax(dim=1) / 255).half().float().clamp(min=6e-8)
    md = (m.abs().amax(dim=1) / 127).half().float().clamp(min=6e-8)
    s8 = (s / sd[:, None]).round().clamp(1, 255).to(torch.uint8)
    m8 = (m / md[:, None]).round().clamp(-127, 127).to(torch.int8)
    return s8, m8, torch.stack([sd, md], dim=1).half()


def from_bytes(s8: torch.Tensor, m8: torch.Tensor, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """to_bytes' inverse: (rows, groups) s8 and m8 and (rows, 2) factors -> float (s, m)."""
    f = rows.float()
    return s8.float() * f[:, :1], m8.float() * f[:, 1:]


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """(n,) uint8 codes, n a multiple of 8 -> (n / 8 * bits,) uint8."""
    q = codes.view(-1, 8).to(torch.int32)
    shifts = torch.arange(0, 8 * bits, bits, dtype=torch.int32, device=q.device)
    word = (q << shifts).sum(dim=1, dtype=torch.int32)  # 8 * bits <= 32 bits
    byte_shifts = torch.arange(0, 8 * bits, 8, dtype=torch.int32, device=q.device)
    return ((word[:, None] >> byte_shifts) & 255).to(torch.uint8).reshape(-1)


def unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """(n / 8 * bits,) uint8 -> (n,) int32 codes."""
    b = packed.view(-1, bits).to(torch.int32)
    byte_shifts = torch.arange(0, 8 * bits, 8, dtype=torch.int32, device=b.device)
    word = (b << byte_shifts).sum(dim=1, dtype=torch.int32)
    shifts = torch.arange(0, 8 * bits, bits, dtype=torch.int32, device=b.device)
    return ((word[:, None] >> shifts) & (2**bits - 1)).reshape(-1)


@torch.inference_mode()
def quantize(weight: torch.Tensor, bits: int, group: int, cscale: torch.Tensor | None = None,
             uniform: bool = False, importance: torch.Tensor | None = None, clips: tuple[float, ...] = (1.0,),
             rounds: int = FIT_ROUNDS) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A weight (any shape, groups along its last dimension, which `group` divides) -> (codes
    packed (numel / 8 * bits,) uint8, s8 (numel / group,) uint8, m8 (numel / group,) int8, the
    rows' factors (numel / last, 2) fp16), on the weight's device. With `cscale` (the last
    dimension's size, fp16), the codes are those of weight * cscale (see dequantize_into)."""
    if bits not in BITS:
        raise ValueError(f"low-bit weights take {BITS} bits, not {bits}")
    cols = weight.shape[-1]
    if cols % group or group % 8:
        raise ValueError(f"groups of {group} do not divide rows of {cols}")
    hv = None
    if importance is not None:  # (cols,): the error of column j counts h_j; in the scaled columns h_j / c_j^2
        if tuple(importance.shape) != (cols,):
            raise ValueError(f"an importance per input column ({cols}) is needed, not {tuple(importance.shape)}")
        h = importance.float().to(weight.device)
        if cscale is not None:
            h = h / cscale.float().square()
        hv = (h / h.mean()).clamp(min=1e-6).view(cols // group, group)
    if cscale is not None:
        weight = weight.float() * cscale.float()
    flat = weight.reshape(-1)
    grid = levels(bits, weight.device, uniform)
    n, per_row = flat.numel(), cols // group
    packed = torch.empty(packed_nbytes(n, bits), dtype=torch.uint8, device=weight.device)
    scale = torch.empty(n // group, dtype=torch.uint8, device=weight.device)
    offset = torch.empty(n // group, dtype=torch.int8, device=weight.device)
    rows = torch.empty(n // cols, 2, dtype=torch.float16, device=weight.device)
    step = max(1, CHUNK // cols) * cols  # whole rows: a row's factors see all its groups
    for a in range(0, n, step):
        b = min(n, a + step)
        w = flat[a:b].float().view(-1, group)
        wt = None if hv is None else hv.repeat((b - a) // cols, 1)
        _, s, m = fit_groups(w, bits, grid, wt, clips, rounds)
        s8, m8, f = to_bytes(s.float().view(-1, per_row), m.float().view(-1, per_row))
        sq, mq = from_bytes(s8, m8, f)
        codes = nearest(w, sq.reshape(-1), mq.reshape(-1), bits, grid)
        packed[a // 8 * bits : b // 8 * bits] = pack(codes.to(torch.uint8).reshape(-1), bits)
        scale[a // group : b // group] = s8.reshape(-1)
        offset[a // group : b // group] = m8.reshape(-1)
        rows[a // cols : b // cols] = f
    return packed, scale, offset, rows


@torch.inference_mode()
def dequantize_into(packed: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, rows: torch.Tensor, bits: int,
                    out: torch.Tensor, cscale: torch.Tensor | None = None, uniform: bool = False) -> None:
    """Write the weight into `out` (contiguous, its shape and dtype, on packed's device) from
    quantize's codes, s8, m8 and row factors; with `cscale`, each column (last-dimension index)
    divided by its entry. `uniform`: the codes were made with quantize(uniform=True)."""
    grid = levels(bits, packed.device, uniform)
    flat = out.view(-1)
    n = flat.numel()
    factors = rows.view(-1, 2)
    cols, group = n // factors.shape[0], n // scale.numel()
    step = max(1, CHUNK // cols) * cols
    for a in range(0, n, step):
        b = min(n, a + step)
        q = unpack(packed[a // 8 * bits : b // 8 * bits], bits).view(-1, group)
        qf = q.to(torch.float32) if grid is None else grid[q]
        s, m = from_bytes(scale[a // group : b // group].view(-1, cols // group),
                          offset[a // group : b // group].view(torch.int8).view(-1, cols // group),  # (a raw buffer's bytes too)
                          factors[a // cols : b // cols])
        w = qf * s.reshape(-1, 1) + m.reshape(-1, 1)
        flat[a:b].copy_(w.reshape(-1))
    if cscale is not None:
        out.div_(cscale.to(out.dtype))


def roundtrip(weight: torch.Tensor, bits: int, group: int = 32, cscale: torch.Tensor | None = None,
              uniform: bool = False, importance: torch.Tensor | None = None, clips: tuple[float, ...] = (1.0,)
              ) -> torch.Tensor:
    """The weight as its low-bit codes give it back (fp32): quantize, then dequantize_into."""
    codes = quantize(weight, bits, group, cscale, uniform, importance, clips)
    out = torch.empty(weight.shape, dtype=torch.float32, device=weight.device)
    dequantize_into(*codes, bits, out, cscale, uniform)
    return out
