"""The fused C layers against the general path on a starter-shaped packed llama (30 layers,
hidden 576, MLP 1536, 9/3 heads; random Q4 weights, KIND=q8 for Q8): median ms of a pass over
n tokens (n = 1: the decode step; more: a chain under a mask, as a tree pass is), after CTX
tokens of context. `python scripts/bench_fused_pass.py` (LAYERS, KIND, CTX in the environment)."""
import os
import time

import torch
from transformers import LlamaConfig, AutoModelForCausalLM
from engine.kernels.linear import Kind, PackedLinear, from_dense
from engine.kernels.fused_layer import LINEARS
from engine.model.causal_lm import CausalLM, causal_allowed
torch.set_num_threads(2)
layers = int(os.environ.get("LAYERS", "30"))
cfg = LlamaConfig(vocab_size=1000, hidden_size=576, intermediate_size=1536, num_hidden_layers=layers,
                  num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=4096, tie_word_embeddings=False)
torch.manual_seed(0)
hf = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
kind: Kind = "q8" if os.environ.get("KIND") == "q8" else "q4"
for layer in hf.model.layers:
    for _, path in LINEARS:
        parent, _, child = path.rpartition(".")
        lin = layer.get_submodule(path)
        setattr(layer.get_submodule(parent), child, PackedLinear(from_dense(lin.weight.data, kind), None))
model = CausalLM(hf)
print("fused:", model.fused is not None)
ctx = int(os.environ.get("CTX", "200"))
def run(n: int, reps: int, general: bool = False) -> float:
    cache = model.new_cache(ctx + 64)
    model.forward(torch.arange(ctx) % 1000, torch.arange(ctx), cache, None)
    saved = model.fused
    if general: model.fused = None
    ts = []
    for r in range(reps):
        ids = torch.arange(n) + 7
        pos = torch.arange(n) + ctx
        allowed = causal_allowed(ctx, n)
        t = time.perf_counter()
        model.forward(ids, pos, cache, None if n == 1 else allowed)
        ts.append(time.perf_counter() - t)
        cache.truncate(ctx)
    model.fused = saved
    ts.sort()
    return ts[len(ts)//2] * 1e3
for n in (1, 2, 4, 8, 16, 32, 64):
    print(f"n={n:3d} fused/default {run(n, 15):7.2f} ms   general {run(n, 15, True):7.2f} ms")
