"""Tiny EAGLE-3 head folders for a tiny target, in the two published layouts (EAGLE / SpecForge's
LlamaForCausalLMEagle3 and vLLM speculators' Eagle3Speculator), with random weights; and the
head's formula written out in plain torch (no transformers module, no cache, no waves) as the
reference the tests hold the engine's head to."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig

STD = 0.15


def write_eagle(dest: Path, target: Path, *, seed: int = 3, layout: str = "eagle", aux: list[int] | None = None,
                draft_vocab: int | None = None, width: int | None = None, oracle: bool = False,
                edit: dict[str, torch.Tensor] | None = None, drop: str = "", config_edit: dict | None = None) -> Path:
    """An EAGLE-3 head folder for the tiny model folder `target`. `aux`: the layer ids its config
    names (None: none, vLLM's default applies). `draft_vocab`: a reduced vocabulary of that many
    tokens (a random subset, mapped by d2t). `width`: the head's own width (then it stores an
    embedding). `oracle`: see `oracle_head`."""
    tc = AutoConfig.from_pretrained(target)
    ht, vocab = int(tc.hidden_size), int(tc.vocab_size)
    h = width or ht
    heads = 1 if oracle else 4
    kv = 1 if oracle else 2
    d, inter = h // heads, 96
    vd = draft_vocab or vocab
    k = 3 if aux is None else len(aux)
    g = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * STD

    prefix = "layers.0." if layout == "speculators" else "midlayer."
    t = {"fc.weight": rand(h, k * ht), "norm.weight": 1 + rand(h) * 0.5, "lm_head.weight": rand(vd, h) * 3}
    layer = {"input_layernorm.weight": 1 + rand(h) * 0.5, "hidden_norm.weight": 1 + rand(h) * 0.5,
             "post_attention_layernorm.weight": 1 + rand(h) * 0.5, "self_attn.q_proj.weight": rand(heads * d, 2 * h),
             "self_attn.k_proj.weight": rand(kv * d, 2 * h), "self_attn.v_proj.weight": rand(kv * d, 2 * h),
             "self_attn.o_proj.weight": rand(h, heads * d), "mlp.gate_proj.weight": rand(inter, h),
             "mlp.up_proj.weight": rand(inter, h), "mlp.down_proj.weight": rand(h, inter)}
    if vd < vocab:
        ids = torch.randperm(vocab, generator=g)[:vd].sort().values
        t["d2t"] = ids - torch.arange(vd)
        t2d = torch.zeros(vocab, dtype=torch.bool)
        t2d[ids] = True
        t["t2d"] = t2d
    if h != ht:
        t["embed_tokens.weight"] = rand(vocab, h) * 3
    if oracle:
        t, layer = oracle_head(target, t, layer, h)
    t.update({prefix + name: value for name, value in layer.items()})
    t.update(edit or {})
    t.pop(drop, None)
    body = {"model_type": "llama", "hidden_size": h, "intermediate_size": inter, "num_attention_heads": heads,
            "num_key_value_heads": kv, "head_dim": d, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
            "max_position_embeddings": 2048, "num_hidden_layers": 1, "vocab_size": vocab, "hidden_act": "silu"}
    if layout == "speculators":
        config: dict = {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
                        "transformer_layer_config": body, "draft_vocab_size": vd, "target_hidden_size": ht,
                        "norm_before_residual": True,
                        "speculators_config": {"algorithm": "eagle3", "verifier": {"name_or_path": target.name}}}
        if aux is not None:
            config["eagle_aux_hidden_state_layer_ids"] = aux
    else:
        config = {"architectures": ["LlamaForCausalLMEagle3"], **body, "draft_vocab_size": vd}
        if h != ht:
            config["target_hidden_size"] = ht
        if aux is not None:
            config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": aux, "use_aux_hidden_state": True}
    if oracle:
        config["norm_before_residual"] = True  # the residual is the normed (zero) hidden state
    config.update(config_edit or {})
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    (dest / "config.json").write_text(json.dumps(config))
    save_file({name: v.contiguous() for name, v in t.items()}, dest / "model.safetensors", metadata={"format": "pt"})
    return dest


def oracle_head(target: Path, t: dict[str, torch.Tensor], layer: dict[str, torch.Tensor],
                h: int) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """A head that drafts a bigram target's exact distribution (the target: every layer's
    attention and MLP output zeroed, so its next token is lm_head(norm(embed(x)))). The hidden
    state is normed to zero and the residual is that normed state (norm_before_residual):
    nothing of the previous position passes. One attention head as wide as the model, q = k =
    30 x the normed embedding: every row's vector has the same length (RMS 1) and rotary keeps
    it, so a row scores itself highest (another row only as high if it holds the same token,
    whose value is the same), by a margin that makes the softmax one-hot; the value is the
    normed embedding, the MLP adds nothing, the final norm and lm_head are the target's."""
    weights = load_file(target / "model.safetensors")
    eye, zero = torch.eye(h), torch.zeros(h, h)
    layer = {**layer, "hidden_norm.weight": torch.zeros(h), "input_layernorm.weight": torch.ones(h),
             "self_attn.q_proj.weight": 30 * torch.cat([eye, zero], 1), "self_attn.k_proj.weight": 30 * torch.cat([eye, zero], 1),
             "self_attn.v_proj.weight": torch.cat([eye, zero], 1), "self_attn.o_proj.weight": eye.clone(),
             "mlp.down_proj.weight": torch.zeros_like(layer["mlp.down_proj.weight"])}
    t = {**t, "norm.weight": weights["model.norm.weight"].clone(), "lm_head.weight": weights["lm_head.weight"].clone()}
    return t, layer


def bigram_target(source: Path, dest: Path) -> Path:
    """A copy of a tiny Llama folder with every layer's attention and MLP output zeroed."""
    if dest.exists():
        shutil.rmtree(dest)
    shutil.copytree(source, dest)
    tensors = load_file(dest / "model.safetensors")
    zeroed = ("o_proj.weight", "down_proj.weight")
    save_file({k: torch.zeros_like(v) if k.endswith(zeroed) else v for k, v in tensors.items()},
              dest / "model.safetensors", metadata={"format": "pt"})
    return dest


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return w * (x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary embedding, the half-split convention: x (heads, n, d) at positions pos (n,)."""
    d = x.shape[-1]
    freq = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = pos.double()[:, None] * freq[None]
    cos, sin = torch.cat([ang.cos(), ang.cos()], -1).float(), torch.cat([ang.sin(), ang.sin()], -1).float()
    half = torch.cat([-x[..., d // 2:], x[..., : d // 2]], -1)
    return x * cos + half * sin


def reference(folder: Path, target: Path, tokens: list[int], fused_in: torch.Tensor,
              positions: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The head in `folder` over rows (token, input hidden state f) read causally, each row
    seeing itself and the rows before it (the target's embedding from the folder `target` when
    the head has none): (logits over the target's vocabulary, the output a child reads)."""
    config = json.loads((folder / "config.json").read_text())
    body = config.get("transformer_layer_config", config)
    w = load_file(folder / "model.safetensors")
    p = "layers.0." if "layers.0.input_layernorm.weight" in w else "midlayer."
    heads, kv, d = body["num_attention_heads"], body["num_key_value_heads"], body["head_dim"]
    vocab = body["vocab_size"]
    with torch.no_grad():
        ids = torch.tensor(tokens)
        table = w["embed_tokens.weight"] if "embed_tokens.weight" in w else load_file(
            target / "model.safetensors")["model.embed_tokens.weight"]
        emb = table[ids]
        g = _rms(fused_in, w[p + "hidden_norm.weight"])
        residual = g if config.get("norm_before_residual") else fused_in
        x = torch.cat([_rms(emb, w[p + "input_layernorm.weight"]), g], -1)
        n = x.shape[0]
        pos = torch.tensor(positions)
        q = _rope((x @ w[p + "self_attn.q_proj.weight"].T).view(n, heads, d).transpose(0, 1), pos, body["rope_theta"])
        k = _rope((x @ w[p + "self_attn.k_proj.weight"].T).view(n, kv, d).transpose(0, 1), pos, body["rope_theta"])
        v = (x @ w[p + "self_attn.v_proj.weight"].T).view(n, kv, d).transpose(0, 1)
        k, v = k.repeat_interleave(heads // kv, 0), v.repeat_interleave(heads // kv, 0)
        scores = (q @ k.transpose(1, 2)) / math.sqrt(d) + torch.full((n, n), float("-inf")).triu(1)
        a = (scores.softmax(-1) @ v).transpose(0, 1).reshape(n, heads * d) @ w[p + "self_attn.o_proj.weight"].T
        h = residual + a
        m = _rms(h, w[p + "post_attention_layernorm.weight"])
        h = h + (torch.nn.functional.silu(m @ w[p + "mlp.gate_proj.weight"].T) * (m @ w[p + "mlp.up_proj.weight"].T)) \
            @ w[p + "mlp.down_proj.weight"].T
        z = _rms(h, w["norm.weight"]) @ w["lm_head.weight"].T
        logits = torch.full((n, vocab), float("-inf"))
        ids_d = torch.arange(z.shape[1]) + (w["d2t"] if "d2t" in w else 0)
        logits[:, ids_d] = z
    return logits, h

