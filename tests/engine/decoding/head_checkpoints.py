"""Tiny targets with a draft head written into their checkpoint under the real names and shapes
(Qwen's `mtp.*`, GLM's NextN `model.layers.{N}.*`), experts stored one by one as released
checkpoints store them. Random weights: a head that is no good at drafting but exercises every
tensor; `copy_from` puts a known layer's weights in instead."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from engine.model.heads import HEAD_NAMING, family_layer_class, head_config
from engine.testing.synthetic import tiny_model, tiny_tokenizer_files

STD = 0.15


def head_tensors(config: object, seed: int, experts: bool) -> dict[str, torch.Tensor]:
    """The head's tensors by stored name, for a target of `config`."""
    naming = HEAD_NAMING[config.model_type]  # type: ignore[attr-defined]
    h = int(config.hidden_size)  # type: ignore[attr-defined]
    g = torch.Generator().manual_seed(seed)
    layer = family_layer_class(config)(head_config(config, experts), 0)
    if naming == "mtp":
        prefix = "mtp.layers.0."
        out = {"mtp.fc.weight": torch.randn(h, 2 * h, generator=g) * STD,
               "mtp.pre_fc_norm_embedding.weight": torch.randn(h, generator=g) * 0.1,
               "mtp.pre_fc_norm_hidden.weight": torch.randn(h, generator=g) * 0.1,
               "mtp.norm.weight": torch.randn(h, generator=g) * 0.1}
    else:
        prefix = f"model.layers.{config.num_hidden_layers}."  # type: ignore[attr-defined]
        out = {prefix + "eh_proj.weight": torch.randn(h, 2 * h, generator=g) * STD,
               prefix + "enorm.weight": 1 + torch.randn(h, generator=g) * 0.1,
               prefix + "hnorm.weight": 1 + torch.randn(h, generator=g) * 0.1,
               prefix + "shared_head.norm.weight": 1 + torch.randn(h, generator=g) * 0.1}
    for name, t in [*layer.named_parameters(), *layer.named_buffers()]:
        value = torch.randn(t.shape, generator=g) * STD if t.ndim >= 2 else (
            t.detach() + torch.randn(t.shape, generator=g) * 0.1)
        if name.endswith("experts.gate_up_proj"):  # (E, 2I, H) -> each expert's gate and up
            inter = value.shape[1] // 2
            for e in range(value.shape[0]):
                out[f"{prefix}{name[: -len('gate_up_proj')]}{e}.gate_proj.weight"] = value[e, :inter].clone()
                out[f"{prefix}{name[: -len('gate_up_proj')]}{e}.up_proj.weight"] = value[e, inter:].clone()
        elif name.endswith("experts.down_proj"):
            for e in range(value.shape[0]):
                out[f"{prefix}{name[: -len('down_proj')]}{e}.down_proj.weight"] = value[e].clone()
        else:
            out[prefix + name] = value
    return {k: v.contiguous() for k, v in out.items()}


def with_head(source: Path, dest: Path, seed: int = 7, experts: bool | None = None,
              edit: dict[str, torch.Tensor] | None = None, drop: str = "", oracle: bool = False) -> Path:
    """A copy of the tiny model folder `source` whose model.safetensors also holds a head
    (`edit` replaces tensors by name, `drop` leaves one out: damaged checkpoints).

    `oracle`: a bigram target (every layer's attention output and MLP output zeroed, so its
    next token depends on the last token alone: lm_head(norm(embed(x)))) and a head that
    computes exactly that (fc takes the embedding half, its layer adds nothing, unit norms):
    the head drafts the target's own distribution at every depth."""
    if dest.exists():
        shutil.rmtree(dest)
    shutil.copytree(source, dest)
    config = AutoConfig.from_pretrained(dest)
    has_experts = bool(getattr(config, "num_experts", 0) or getattr(config, "n_routed_experts", 0))
    tensors = load_file(dest / "model.safetensors")
    head = head_tensors(config, seed, has_experts if experts is None else experts)
    if oracle:
        zeroed = ("o_proj.weight", "out_proj.weight", "down_proj.weight")
        tensors = {k: torch.zeros_like(v) if k.endswith(zeroed) else v for k, v in tensors.items()}
        h = int(config.hidden_size)
        for name in list(head):
            if name.endswith(zeroed):
                head[name] = torch.zeros_like(head[name])
            elif name.endswith(("fc.weight", "eh_proj.weight")):
                head[name] = torch.cat([torch.eye(h), torch.zeros(h, h)], dim=1)
            elif head[name].ndim == 1 and not name.endswith("bias"):  # norms: unit scale either way
                unit = torch.zeros_like if config.model_type.startswith("qwen") else torch.ones_like  # (1 + w) or w
                head[name] = unit(head[name])
    head.update(edit or {})
    head.pop(drop, None)
    save_file({**tensors, **head}, dest / "model.safetensors", metadata={"format": "pt"})
    return dest


def tiny_qwen35_moe(cache: Path, layers: int = 4) -> Path:
    """A tiny Qwen3.5-MoE text model (not among engine.testing's tiny families)."""
    folder = cache / "tiny-qwen3_5_moe_text"
    if (folder / "config.json").is_file():
        return folder
    folder.mkdir(parents=True)
    tiny_tokenizer_files(folder)
    tok = AutoTokenizer.from_pretrained(folder)
    config = AutoConfig.for_model(
        "qwen3_5_moe_text", vocab_size=len(tok), hidden_size=64, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=2048, linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=8, linear_conv_kernel_dim=4,
        full_attention_interval=2, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
        shared_expert_intermediate_size=48, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim >= 2:
                p.normal_(0.0, 2 * STD if p.shape[0] == config.vocab_size else STD)
    model.save_pretrained(folder)
    return folder


def tiny_with_head(arch: str, cache: Path, layers: int = 4) -> Path:
    """The tiny target of `arch` with a random head, built once per cache folder."""
    dest = cache / f"head-{arch}"
    if (dest / "config.json").is_file():
        return dest
    source = tiny_qwen35_moe(cache, layers) if arch == "qwen3_5_moe_text" else tiny_model(
        arch, seed=0, layers=layers, cache_dir=cache)
    return with_head(source, dest)
