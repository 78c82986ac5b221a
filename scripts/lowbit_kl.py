"""KL divergence of low-bit drafts to the starter target, on held-out chat and edit prompts.

Measures the quantisers of engine.offload.lowbit at the model level: every decoder-layer
Linear of the starter (SmolLM2-135M-Instruct, fp32) is replaced by its de-quantised low-bit
copy (what the self-draft runs: embedding, norms and head stay the target's), and the draft's
next-token distributions are compared with the target's, KL(target || draft) in nats a token.

Text: each prompt of a file, in the model's chat template, followed by the target's own greedy
answer (48 tokens): the KL is averaged over the answer's positions (what a draft predicts while
drafting). The activation-aware variants calibrate on engine.offload.calibrate's built-in text
only; tuning.txt is the tuning set, chat.txt and edit.txt are held out.

A variant names a quantiser and a group size: "plain3g64" (uniform grid, no column scales),
"awq3g64" (uniform grid, activation-aware column scales), "nf3g64" / "nfawq3g64" (3-bit codes
on the normal-quantile levels: what the self-draft stores at 3 bits), and "BASE+k1/k2=OTHER"
for the matrices named k1, k2 quantised as OTHER (e.g. nfawq3g64+v_proj/k_proj=awq4g64: the
3-bit self-draft's format before issue 32's second round). Letters between "awq" and the bits
choose the group fit (engine.offload.calibrate.quantise_aware): "h" weighs each column's error by
mean(x_j^2), "c" adds the clip starts (calibrate.CLIPS), "f" compares the alphas (calibrate.ALPHAS)
on a quick fit and fits only the chosen one fully (without "f": alphas 0, .25, .5, .75, each fitted
fully); "nfawqhcf3g32+v_proj=awqhcf4g32" is the self-draft's 3-bit format now (every variant
stores (s, m) as lowbit.py does now: bytes under the rows' factors). "self3" / "self4" is the engine's own self-draft of that width
(engine.loading.self_draft, calibrated), run through its CausalLM; "proxy" is the starter's
FP4 proxy draft. The bits column counts
codes, scales and offsets (the column scales add 0.02 a weight on the starter). De-quantised
weights are cached in /tmp/lbcache by variant.

    python scripts/lowbit_kl.py --files tuning.txt,chat.txt,edit.txt \
        --variants plain3g64,awq3g64,nfawq3g64+v_proj/k_proj=awq4g64,plain4g64,proxy
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import torch
from bitsandbytes.functional import dequantize_4bit, quantize_4bit
from transformers import AutoModelForCausalLM, AutoTokenizer

from engine.cli.common import read_prompts
from engine.loading.load import load_model
from engine.loading.self_draft import build_self_draft
from engine.loading.starter import proxy_draft_folder, starter_folder
from engine.model.causal_lm import CausalLM
from engine.offload import calibrate, lowbit
from engine.threads import set_threads

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = ROOT / "resources" / "prompts"
ANSWER = 48


def texts(tok: Any, target: Any, path: Path) -> list[tuple[torch.Tensor, int]]:
    """(ids, answer start) for each prompt of `path`, answered greedily by the target."""
    out = []
    for prompt in read_prompts(path, ()):
        ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                      return_tensors="pt", return_dict=True)["input_ids"]
        gen = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=ANSWER, do_sample=False,
                              pad_token_id=tok.pad_token_id)
        out.append((gen[0], ids.shape[1]))
    return out


@torch.inference_mode()
def kl(target_logp: list[torch.Tensor], draft: Any, data: list[tuple[torch.Tensor, int]]
       ) -> tuple[float, float, float]:
    """KL(target || draft) in nats a token, how often the draft's most likely token is the
    target's (what a greedy tree's first branch needs), and how often the target's is among the
    draft's 4 likeliest (what a tree's side branches catch)."""
    total, same, top4, n = 0.0, 0, 0, 0
    for p, (ids, start) in zip(target_logp, data):
        q = torch.log_softmax(draft(ids[None]).logits[0, start - 1 : -1].float(), -1)
        total += float((p.exp() * (p - q)).sum())
        same += int((p.argmax(-1) == q.argmax(-1)).sum())
        top4 += int((q.topk(4, dim=-1).indices == p.argmax(-1)[:, None]).any(-1).sum())
        n += p.shape[0]
    return total / n, same / n, top4 / n


def linears(model: Any) -> dict[str, torch.nn.Linear]:
    return {n: m for n, m in model.model.layers.named_modules() if isinstance(m, torch.nn.Linear)}


@torch.inference_mode()
def calib_inputs(tok: Any, target: Any) -> dict[str, torch.Tensor]:
    """Each decoder Linear's inputs on the built-in calibration text, (tokens, in)."""
    ids = torch.tensor([calibrate.calibration_ids(tok)])
    got: dict[str, torch.Tensor] = {}
    hooks = [m.register_forward_hook(lambda mod, args, out, name=name: got.__setitem__(name, args[0][0].detach()))
             for name, m in linears(target).items()]
    target(ids)
    for h in hooks:
        h.remove()
    return got


CACHE = Path("/tmp/lbcache-bytes")  # (a variant's weights in the byte format of lowbit.py)
OLD_ALPHAS = (0.0, 0.25, 0.5, 0.75)  # the alpha grid before the fast search (the "f" variants take calibrate.ALPHAS)


def chosen_alpha(c: torch.Tensor, x: torch.Tensor, alphas: tuple[float, ...]) -> float:
    """The alpha of `alphas` that column scale `c` was made with from inputs `x`."""
    if x.shape[0] > calibrate.MAX_ROWS:
        x = x[torch.linspace(0, x.shape[0] - 1, calibrate.MAX_ROWS).long()]
    m = x.float().abs().mean(dim=0)
    return min(alphas, key=lambda a: float((calibrate.column_scale(m, a).float() - c.float()).abs().max()))


def weight_set(spec: str, target: Any, x: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every decoder Linear quantised as `spec` ("plain3g64", "awq3g128", "nfawq3g64", ...),
    de-quantised, cached on disk."""
    path = CACHE / f"{spec}.pt"
    if path.is_file():
        return torch.load(path)
    aware, nf = "awq" in spec, spec.startswith("nf")
    bits, group = int(spec.split("g")[0][-1]), int(spec.split("g")[-1])
    head = spec.split("g")[0][:-1]
    weighted = "h" in head.replace("awq", "")
    clips = calibrate.CLIPS if "c" in head else (1.0,)
    search = calibrate.SEARCH_ROUNDS if "f" in head else None
    alphas = calibrate.ALPHAS if "f" in head else OLD_ALPHAS
    out: dict[str, torch.Tensor] = {}
    alphas_chosen: list[float] = []
    for n, m in linears(target).items():
        if aware:
            *codes, c = calibrate.quantise_aware(m.weight, x[n], bits, group, alphas, not nf, weighted, clips, search)
            wq = torch.empty_like(m.weight)
            lowbit.dequantize_into(*codes, bits, wq, c, not nf)
            alphas_chosen.append(chosen_alpha(c, x[n], alphas))
        else:
            wq = lowbit.roundtrip(m.weight, bits, group, None, not nf)
        out[n] = wq.half()
    if alphas_chosen:
        print(f"  {spec}: alphas " + " ".join(f"{a:g}:{alphas_chosen.count(a)}" for a in sorted(set(alphas_chosen))),
              flush=True)
    CACHE.mkdir(exist_ok=True)
    torch.save(out, path)
    return out


def bits_of(spec: str) -> float:
    """Codes, byte scales and offsets (lowbit.py), and the rows' fp16 factors on the starter (32
    bits per row of at least 576 inputs)."""
    bits, group = int(spec.split("g")[0][-1]), int(spec.split("g")[-1])
    return bits + 16 / group + 32 / 576


class _Logits:
    """A CausalLM called like a transformers model (one sequence, all positions' logits)."""

    def __init__(self, model: CausalLM) -> None:
        self.model = model

    def __call__(self, ids: torch.Tensor) -> Any:
        m = self.model
        hidden = m.forward(ids[0], torch.arange(ids.shape[1]), m.new_cache(), None)
        return type("Out", (), {"logits": m.logits(hidden)[None]})


def self_draft(bits: int) -> tuple[_Logits, float]:
    """build_self_draft's `bits` draft of the starter (every layer offloaded, calibrated with its
    tokenizer), and its bits a weight (codes, scales, offsets and column scales)."""
    loaded = load_model(starter_folder(), offload="all")
    draft = build_self_draft(loaded.model, bits, cache_dir=None, tokenizer=loaded.tokenizer)
    info = draft.self_draft  # type: ignore[attr-defined]
    assert draft.streamer is not None
    weights = loaded.model.shape.layer_params * loaded.model.shape.num_layers
    return _Logits(draft), (info.nbytes - draft.streamer.dense_layout.nbytes) * 8 / weights


@torch.inference_mode()
def jitter(model: Any, ratio: float) -> None:
    """Noise of `ratio` x each row's standard deviation on every decoder Linear (seeded)."""
    g = torch.Generator().manual_seed(0)
    for m in linears(model).values():
        w = m.weight
        w.add_(torch.randn(w.shape, generator=g) * w.std(dim=1, keepdim=True) * ratio)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variants", default="plain3g64,awq3g64,nfawq3g64+v_proj/k_proj=awq4g64,plain4g64,proxy")
    parser.add_argument("--files", default="tuning.txt,chat.txt,edit.txt")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--jitter", type=float, default=0.0,
                        help="add Gaussian noise of this many times each row's standard deviation to the target's "
                        "decoder weights first (the starter's weights are de-quantised Q4_1: every 32 of a row lie "
                        "on a 16-level grid, which flatters groups of 32; the noise takes them off it)")
    args = parser.parse_args()
    set_threads(args.threads)
    global CACHE
    if args.jitter:
        CACHE = CACHE.with_name(f"{CACHE.name}-jitter{args.jitter:g}")
    folder = starter_folder()
    tok = AutoTokenizer.from_pretrained(folder)
    target = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    if args.jitter:
        jitter(target, args.jitter)
    files = args.files.split(",")
    CACHE.mkdir(exist_ok=True)
    data = {}
    for f in files:
        path = CACHE / f"texts-{f}.pt"
        if not path.is_file():
            torch.save(texts(tok, target, PROMPTS / f), path)
        data[f] = torch.load(path)
    with torch.inference_mode():
        logp = {f: [torch.log_softmax(target(ids[None]).logits[0, s - 1 : -1].float(), -1) for ids, s in d]
                for f, d in data.items()}
    x = calib_inputs(tok, target)
    print(f"calibration: {next(iter(x.values())).shape[0]} tokens; held out: "
          + ", ".join(f"{f} {len(d)} answers" for f, d in data.items()))
    print(f"{'draft':44} {'bits':>5}" + "".join(f" {f + ' KL/top1/top4':>26}" for f in files), flush=True)
    for name in args.variants.split(","):
        t0 = time.perf_counter()
        if name == "proxy" and args.jitter:  # the FP4 proxy of the jittered target, made as starter.py makes it
            draft = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
            with torch.inference_mode():
                for (n, m), (_, t) in zip(linears(draft).items(), linears(target).items()):
                    q, state = quantize_4bit(t.weight.float(), blocksize=64, quant_type="fp4")
                    m.weight.copy_(dequantize_4bit(q, state))
            bpw = 4.5
        elif name == "proxy":
            draft = AutoModelForCausalLM.from_pretrained(proxy_draft_folder(), dtype=torch.float32).eval()
            bpw = 4.5
        elif name.startswith("self") and args.jitter:
            raise SystemExit("the engine's own self-draft reads the starter from its folder: not with --jitter")
        elif name.startswith("self"):  # the library's self-draft, built as the engine builds it
            draft, bpw = self_draft(int(name[4:]))
        else:  # "base", "base+kind1/kind2=other", more "+kinds=other" after: the last that names a matrix wins
            draft = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
            base, *overs = name.split("+")
            rules = [(kinds.split("/"), other) for kinds, _, other in (o.partition("=") for o in overs)]
            sets = {spec: weight_set(spec, target, x) for spec in {base, *(o for _, o in rules)}}
            total = nbits = 0.0
            with torch.inference_mode():
                for n, m in linears(draft).items():
                    spec = base
                    for kinds, other in rules:
                        if any(k in n.split(".") or f"layers.{k}" in n for k in kinds):
                            spec = other
                    m.weight.copy_(sets[spec][n].float())
                    total += m.weight.numel()
                    nbits += m.weight.numel() * bits_of(spec)
            bpw = nbits / total
        cells = [kl(logp[f], draft, data[f]) for f in files]
        took = time.perf_counter() - t0
        print(f"{name:44} {bpw:5.3f}" + "".join(f" {c[0]:10.3f} / {c[1]:5.3f} / {c[2]:5.3f}" for c in cells) + f"   ({took:.0f} s)",
              flush=True)


if __name__ == "__main__":
    main()
