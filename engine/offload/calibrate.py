"""Activation-aware scaling of a self-draft's low-bit weights (the AWQ idea: Lin et al., MLSys
2024, written here from the paper's description).

A weight's input channels are not equally important: a channel whose input is large (and small
models have a few inputs tens of times the others) carries its rounding error into the output
magnified. So before quantising, each input channel j of a weight W is scaled by
c_j = mean|x_j|^alpha (x: that matrix's inputs on a short built-in text), W * c is quantised
group-wise (engine.offload.lowbit), and the de-quantiser divides the columns by c again: the
important channels get finer steps, paid for by the unimportant ones. alpha is chosen per matrix
from a small grid by the output error ||x W^T - x Wq^T|| on the same inputs (alpha = 0 is the
plain quantiser, so a matrix is never worse on those inputs). What the text decides is coarse
(c from one alpha per matrix, and each group's (s, m) through its inputs' second moments, below), so
a few hundred tokens do not overfit, unlike an error-compensating fit (GPTQ), which was tried
twice and generalised worse than no compensation: on the starter's 3-bit draft, GPTQ's codes
over fixed (s, m) with the Hessian damped by 10 % of its mean diagonal took the held-out KL from
0.39 to 0.47 (the calibration's 512 tokens span too little of a 576- or 1536-wide input).

Measured on the starter (scripts/lowbit_kl.py, KL to the target on held-out chat answers): the
3-bit draft goes from 2.30 to 1.02 nats a token with c alone, at the same 3.5 bits a weight
(+0.02 for c). The group fit itself is output-aware too (lowbit.quantize's `importance` and
`clips`): each column's error weighed by h_j = mean(x_j^2) (the diagonal of the layer's Hessian;
only the groups' (s, m) and the choice among starts follow it, the codes stay the nearest
levels), with starts from the range shrunk to 0.9 and 0.8. With both, the 3-bit self-draft (then
groups of 64 with fp16 (s, m), k/v at 4 bits) went from 0.74 to 0.42 nats a token on chat.txt;
groups of 32 with byte (s, m) (lowbit.py) then took it to 0.29 (v at 4 bits). Most matrices pick
alpha 0.25, a quarter pick 0 (0.75 was picked by one matrix in 210, so the grid stops at 0.5).
The alphas are compared on a quick fit (the range's start, two rounds) and only the chosen one
gets all starts: on the starter that loses about 1 % of the output error against fitting every
alpha fully, at a third of the time. (Refitting each group's (s, m) on its block of the Hessian,
codes fixed, gained 1-3 % of KL and fitted the calibration text twice as much as held-out text:
removed.)

What this module does not do: store or lay out the weights (lowbit.py, self_draft.py) or run
the target (self_draft.py collects the inputs).
"""

from __future__ import annotations

import torch
from torch import nn

from engine.model.causal_lm import CausalLM
from engine.offload import lowbit

ALPHAS = (0.0, 0.25, 0.5)
CLIPS = (1.0, 0.9, 0.8)  # the group fit's starts: its range shrunk by these ratios (lowbit.fit_groups)
SEARCH_ROUNDS = 2  # the alphas are compared on fits of this many rounds from the range
MAX_ROWS = 256  # calibration inputs kept per matrix (the error sums over them)

# A short text, rendered in the target's chat template: questions and answers of several kinds
# (prose, lists, code, numbers), none of them from the prompts the drafts are measured on.
CONVERSATIONS: tuple[tuple[str, str], ...] = (
    ("How does a refrigerator keep food cold?",
     "A refrigerator moves heat from the inside to the outside. A liquid called the refrigerant flows through "
     "coils inside the fridge, where it evaporates and absorbs heat. A compressor then squeezes the vapour, "
     "which makes it hot, and the coils at the back release that heat into the kitchen. The refrigerant "
     "condenses back into a liquid and the cycle starts again, about every few minutes."),
    ("Write a Python function that counts the words in a file.",
     "Here is a simple version:\n\n```python\ndef count_words(path: str) -> int:\n    \"\"\"Return the number of "
     "words in the text file at `path`.\"\"\"\n    total = 0\n    with open(path, encoding=\"utf-8\") as f:\n"
     "        for line in f:\n            total += len(line.split())\n    return total\n```\n\nIt reads the file "
     "line by line, so even a large file does not need to fit in memory."),
    ("Give me four tips for a job interview.",
     "1. Research the company: know what it does and why you want to work there.\n2. Prepare short stories "
     "that show your skills, with a result you can measure.\n3. Arrive ten minutes early and bring a copy of "
     "your CV.\n4. Ask two or three questions at the end, for example about the team or the first months."),
    ("Tell me a short story about a lighthouse keeper.",
     "Every night for forty years, Mara climbed the hundred and twelve steps of the lighthouse and lit the "
     "lamp. One stormy evening the power failed. She took the old oil lantern from the cupboard, polished "
     "the glass, and kept it burning until dawn. In the morning a fishing boat came into the harbour, and "
     "the captain walked up the hill to thank her."),
    ("Convert 3.5 kilometres to miles and explain the calculation.",
     "One kilometre is about 0.621 miles, so 3.5 km x 0.621 = 2.17 miles. To check: 2.17 miles divided by "
     "0.621 gives back roughly 3.5 km."),
)


def calibration_ids(tokenizer) -> list[int]:  # type: ignore[no-untyped-def]
    """The calibration text's token ids: the conversations in the tokenizer's chat template
    (plain text when it has none)."""
    turns = [m for q, a in CONVERSATIONS for m in ({"role": "user", "content": q}, {"role": "assistant", "content": a})]
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(turns, tokenize=False)
    else:
        text = "\n\n".join(f"{m['role']}: {m['content']}" for m in turns)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def column_scale(mean_abs: torch.Tensor, alpha: float) -> torch.Tensor:
    """c = mean|x|^alpha, normalised to a geometric mean of 1 (the weight's range is kept), fp16
    (what is stored)."""
    s = mean_abs.float().clamp(min=1e-6).pow(alpha)
    s = s / s.log().mean().exp()
    return s.clamp(1e-3, 1e3).half()


@torch.inference_mode()
def quantise_aware(w: torch.Tensor, x: torch.Tensor, bits: int, group: int,
                   alphas: tuple[float, ...] = ALPHAS, uniform: bool = False, weighted: bool = True,
                   clips: tuple[float, ...] = CLIPS, search_rounds: int | None = SEARCH_ROUNDS
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A Linear weight (out, in) and its inputs (tokens, in) -> lowbit.quantize's (codes, s8,
    m8, row factors) of w * c, and c (in,) fp16: the alpha whose de-quantised weight gives the
    least output error on x. `weighted`: each group's fit weighs column j's error by
    mean(x_j^2); `clips`: the fit's starts (lowbit.fit_groups); `search_rounds`: the alphas are
    compared on a quick fit (the range's start, that many rounds) and only the chosen one is
    fitted with all starts (None: each alpha gets the full fit)."""
    x = x.to(w.device, torch.float32).reshape(-1, x.shape[-1])
    if x.shape[0] > MAX_ROWS:
        x = x[torch.linspace(0, x.shape[0] - 1, MAX_ROWS, device=x.device).long()]
    w32 = w.float()
    ref = x @ w32.T  # (tokens, out)
    mean_abs = x.abs().mean(dim=0)
    h = x.square().mean(dim=0) if weighted else None  # (in,): the diagonal of the layer's Hessian x^T x / n
    quick = ((1.0,), search_rounds) if search_rounds is not None else (clips, lowbit.FIT_ROUNDS)
    out = torch.empty_like(w32)
    best: tuple[float, tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] | None = None
    for alpha in alphas:
        c = column_scale(mean_abs, alpha)
        codes = lowbit.quantize(w32, bits, group, c, uniform, h, *quick)
        lowbit.dequantize_into(*codes, bits, out, c, uniform)
        err = float((x @ out.T - ref).square().mean())
        if best is None or err < best[0]:
            best = (err, codes, c)
    assert best is not None
    codes = best[1]
    if search_rounds is not None:
        codes = lowbit.quantize(w32, bits, group, best[2], uniform, h, clips)
    return (*codes, best[2])


def fused_experts(module: nn.Module) -> bool:
    """An MoE's fused experts (transformers' `*Experts`: gate_up_proj (E, 2I, H) and down_proj),
    called with every token's hidden state (tokens, H) and the routing: each expert's gate/up
    rows take (a subset of) those tokens, so their column scales come from all of them."""
    gate_up = getattr(module, "gate_up_proj", None)
    return isinstance(gate_up, torch.Tensor) and gate_up.dim() == 3


@torch.inference_mode()
def collect_inputs(target: CausalLM, ids: list[int], layers: list[int]) -> dict[int, dict[str, torch.Tensor]]:
    """Run the target over `ids` (one pass) and keep, for each of `layers`, each Linear's inputs
    (MAX_ROWS rows, fp32, on the CPU) by its weight's name in the layer ("mlp.down_proj.weight"),
    and an MoE's fused experts' inputs by their gate/up weight's ("mlp.experts.gate_up_proj").
    The streamer runs one layer module at a time and reports its index after it (after_layer):
    the Linear calls since the last report are that layer's, named from the last module that
    ran (the layer itself)."""
    streamer = target.streamer
    assert streamer is not None
    wanted = set(layers)
    rows = torch.linspace(0, len(ids) - 1, min(MAX_ROWS, len(ids))).long()
    pending: list[tuple[nn.Module, torch.Tensor]] = []
    last: list[nn.Module] = []
    out: dict[int, dict[str, torch.Tensor]] = {}

    def hook(module: nn.Module, args: tuple, output: object) -> None:
        if (isinstance(module, nn.Linear) or fused_experts(module)) and args and isinstance(args[0], torch.Tensor):
            x = args[0].detach().reshape(-1, args[0].shape[-1])
            if x.shape[0] == len(ids):
                pending.append((module, x[rows.to(x.device)].float().cpu()))
        last[:] = [module]

    saved = streamer.after_layer

    def after(i: int) -> None:
        if i in wanted and last:
            names = {id(m): n for n, m in last[0].named_modules()}
            out[i] = {names[id(m)] + (".gate_up_proj" if fused_experts(m) else ".weight"): x
                      for m, x in pending if id(m) in names}
        pending.clear()
        if saved is not None:
            saved(i)

    handle = torch.nn.modules.module.register_module_forward_hook(hook)
    streamer.after_layer = after
    try:
        target.forward(torch.tensor(ids), torch.arange(len(ids)), target.new_cache(), None)
    finally:
        handle.remove()
        streamer.after_layer = saved
    return out

