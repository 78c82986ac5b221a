"""What differs between the architectures of GGUF files: llama.cpp's names for them, the config
keys each one needs beyond transformers' table, and the value transforms its converter applied.

gguf.py reads every GGUF the same way (header, tensor table, blocks kept packed); this module
is its table of families:

- architecture names: llama.cpp's name -> transformers' (qwen3moe -> qwen3_moe, gpt-oss ->
  gpt_oss), a model type renamed after reading (a gemma3 file is its text model), a llama file
  with experts is Mixtral;
- config: transformers' GGUF_CONFIG_MAPPING where it has the architecture, with the keys it
  leaves out (EXTRA_KEYS; KEY_TABLES for architectures it does not read at all), and rules for
  what llama.cpp derives rather than stores (`_gemma3_rules`, `_gpt_oss_rules`,
  `_glm4moe_rules`);
- tensors: transformers' tensor processors where they describe llama.cpp's converter
  (`processor_for`, and `conversion`, which finds what a processor does by running it on row
  numbers), and recipes where they do not (`recipes`): a parameter built from one or more of
  the file's tensors by a function of their de-quantised values (gpt-oss's expert biases: gate
  and up biases side by side). gpt-oss's expert matrices are parts (`gpt_oss_parts`): llama.cpp
  stores gate and up as rows of (E, I, H) each (or one fused tensor) and down as (E, H, I), in
  ggml's MXFP4 blocks; transformers' module holds them transposed and interleaved, so the loader
  puts engine.model.gpt_oss_experts.RowExperts in its place, which holds them as stored and so
  keeps them packed (gguf_blocks reads ggml's MXFP4 block: one E8M0 scale and 16 bytes of which
  byte j holds values j and j + 16, not the checkpoint's pairs of engine/loading/mxfp4.py).

The hybrid Gated DeltaNet families (qwen3next, qwen35, qwen35moe) have their keys, rules and
recipes in gguf_hybrid.py; Gemma 4 (gemma4) its keys, rules and names in
gguf_gemma4.py. Architectures gguf-py names that SpecChat runs from safetensors but not yet
from GGUF are refused by name with what is missing (REFUSED).
transformers' GGUF tokenizer conversion is reached through `tokenizer_source` for files whose
metadata transformers cannot read (gpt-oss's rope keys, architectures it does not know).

What this module does not do: read files or tensor data (gguf.py, gguf_header.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import MODEL_ARCH_NAMES, GGUFReader, GGUFValueType, GGUFWriter, get_tensor_name_map
from torch import nn
from transformers.modeling_gguf_pytorch_utils import (
    TENSOR_PROCESSORS,
    LlamaTensorProcessor,
    Qwen2MoeTensorProcessor,
    TensorProcessor,
)

from engine.errors import UnsupportedModel
from engine.loading import gguf_gemma4, gguf_hybrid
from engine.model.gpt_oss_experts import use_row_experts
from engine.store.gguf_archs import REFUSED, RUNNABLE, RUNS
from engine.store.gguf_header import CorruptGGUF, GGUFHeader, TensorInfo

# metadata keys transformers' GGUF reader cannot parse, left out of what its tokenizer reads
TOKENIZER_DROPS = {"gpt-oss": ("gpt-oss.rope.scaling.",), gguf_gemma4.ARCH: gguf_gemma4.TOKENIZER_DROPS}
# architectures transformers reads no GGUF metadata of: their tokenizer read as a plain byte-level
# BPE model's (gpt2: no model-specific tokenizer class; the pre-tokenizer follows `.pre`)
TOKENIZER_AS = {"glm4moe": "gpt2", "qwen3next": "gpt2"}
# llama.cpp's architecture name -> transformers' (load_gguf_checkpoint's `updated_architecture`)
HF_ARCH = {"qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe", "gpt-oss": "gpt_oss", "minimax-m2": "minimax_m2",
           "glm4moe": "glm4_moe", **gguf_hybrid.ARCHS}
# a model type transformers renames after reading the keys: a Gemma 3 GGUF holds its text model
HF_MODEL_TYPE = {"gemma3": "gemma3_text", "gemma4": "gemma4_text"}
# keys transformers' table leaves out that the model cannot do without: an expert's width
# (transformers falls back to Qwen3-30B-A3B's 768, which no other Qwen3-MoE has)
EXTRA_KEYS = {"qwen3_moe": {"expert_feed_forward_length": "moe_intermediate_size"},
              "qwen2_moe": {"expert_feed_forward_length": "moe_intermediate_size"},
              # llama.cpp stores Mixtral as llama with experts; transformers reads no GGUF Mixtral
              "mixtral": {"expert_count": "num_local_experts", "expert_used_count": "num_experts_per_tok"},
              # gpt-oss's heads are narrower than hidden / heads; its experts are intermediate_size wide
              # and llama.cpp writes its window as attention.sliding_window, as for every architecture
              "gpt_oss": {"attention.key_length": "head_dim", "expert_feed_forward_length": "intermediate_size",
                          "attention.sliding_window": "sliding_window"}}
# architectures transformers reads no GGUF of: their whole key table, as llama.cpp writes them
_COMMON = {"context_length": "max_position_embeddings", "block_count": "num_hidden_layers",
           "feed_forward_length": "intermediate_size", "embedding_length": "hidden_size",
           "rope.freq_base": "rope_theta", "attention.head_count": "num_attention_heads",
           "attention.head_count_kv": "num_key_value_heads", "attention.key_length": "head_dim",
           "attention.layer_norm_rms_epsilon": "rms_norm_eps", "vocab_size": "vocab_size"}
KEY_TABLES: dict[str, dict[str, str | None]] = {
    "glm4_moe": {**_COMMON, "expert_count": "n_routed_experts", "expert_used_count": "num_experts_per_tok",
                 "expert_feed_forward_length": "moe_intermediate_size", "expert_shared_count": "n_shared_experts",
                 "leading_dense_block_count": "first_k_dense_replace", "expert_weights_scale": "routed_scaling_factor",
                 "expert_weights_norm": "norm_topk_prob", "expert_group_count": "n_group",
                 "expert_group_used_count": "topk_group", "nextn_predict_layers": "num_nextn_predict_layers"},
    **gguf_hybrid.KEY_TABLES,
    # transformers' own Gemma 4 table reads per-layer arrays as one number and leaves the rope out
    gguf_gemma4.ARCH: gguf_gemma4.KEY_TABLE,
}
LLAMA_CPP_SIGMOID = 2  # llama.cpp's expert_gating_func: 1 softmax, 2 sigmoid


def hf_arch(arch: str) -> str:
    return HF_ARCH.get(arch, arch)


def check_runnable(header: GGUFHeader, known: Sequence[str]) -> None:
    """UnsupportedModel unless SpecChat reads this architecture's GGUF (`known`: the
    architectures whose keys transformers' table or KEY_TABLES hold)."""
    arch = header.architecture or ""
    if arch in REFUSED:
        raise UnsupportedModel(f"'{header.path.name}' is a '{arch}' GGUF; SpecChat runs GGUF files of {RUNS} "
                               f"models, not yet of {arch}: {REFUSED[arch]}. Use its safetensors release.")
    if arch not in RUNNABLE or hf_arch(arch) not in known:
        raise UnsupportedModel(f"'{header.path.name}' is a '{arch or 'unknown'}' GGUF; SpecChat runs GGUF files "
                               f"of {RUNS} models.")


def tokenizer_source(src: Path, arch: str) -> Path:
    """The file transformers' tokenizer conversion reads for GGUF `src`: itself, or for an
    architecture whose metadata transformers' reader fails on (gpt-oss: it reads each
    `rope.scaling.*` value from the wrong part of its field, a TypeError on every file
    llama.cpp writes; Gemma 4: per-layer K/V head counts, which its config refuses) or does not
    read at all (GLM-4.5) a copy of its metadata without those keys and without tensors, beside
    it; for the latter under an architecture transformers reads whose tokenizer is built the same
    way (from `tokenizer.ggml.model` and `.pre` only)."""
    if arch not in TOKENIZER_DROPS and arch not in TOKENIZER_AS:
        return src
    reader = GGUFReader(src)
    out = src.with_name(src.stem + "-metadata.gguf")
    w = GGUFWriter(out, TOKENIZER_AS.get(arch, arch))
    for key, field in reader.fields.items():
        if key.startswith(("GGUF.", "general.architecture", "split.", *TOKENIZER_DROPS.get(arch, ()))):
            continue
        main = field.types[0]
        w.add_key_value(key, field.contents(), main, field.types[-1] if main == GGUFValueType.ARRAY else None)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    w.close()
    return out


def is_mixtral(header: GGUFHeader) -> bool:
    """llama.cpp's Mixtral: a llama GGUF with routed experts."""
    return header.architecture == "llama" and bool(header.metadata.get("llama.expert_count"))


def model_type(header: GGUFHeader) -> str:
    """transformers' model type of a GGUF that check_runnable accepted."""
    arch = hf_arch(header.architecture or "")
    if gguf_hybrid.as_qwen35(header):  # Qwen3-Next-80B-A3B: Qwen3.5-MoE's computation (gguf_hybrid)
        return "qwen3_5_moe_text"
    return "mixtral" if is_mixtral(header) else HF_MODEL_TYPE.get(arch, arch)


def apply_rules(header: GGUFHeader, config: dict[str, Any]) -> None:
    """The config fields llama.cpp derives rather than stores, for this file's family."""
    rule = _RULES.get(header.architecture or "")
    if rule is not None:
        rule(header, config)


def _gemma3_rules(header: GGUFHeader, config: dict[str, Any]) -> None:
    """What llama.cpp runs a Gemma 3 file with that transformers' key table leaves at Gemma-3-4B's
    defaults: the attention scale (1/sqrt(head_dim), but 1/sqrt(hidden / heads) for the 62-layer
    27B: query_pre_attn_scalar 168 there, not 256) and the global layers' rope scaling (linear,
    x8 on 4B-27B) from `rope.scaling.type` / `rope.scaling.factor`."""
    heads, hidden = config.get("num_attention_heads"), config.get("hidden_size")
    if config.get("num_hidden_layers") == 62 and isinstance(heads, int) and isinstance(hidden, int) and heads:
        config["query_pre_attn_scalar"] = hidden // heads
    elif config.get("head_dim"):
        config["query_pre_attn_scalar"] = config["head_dim"]
    kind, factor = header.metadata.get("gemma3.rope.scaling.type"), header.metadata.get("gemma3.rope.scaling.factor")
    if kind not in (None, "none") and factor is not None:
        config["rope_scaling"] = {"rope_type": str(kind), "factor": float(factor)}


def _gpt_oss_rules(header: GGUFHeader, config: dict[str, Any]) -> None:
    """gpt-oss as llama.cpp runs it: sliding windows on even layers, full attention on odd ones
    (its swa pattern 2, transformers' default too, set here so it does not rest on a default);
    YaRN from `rope.scaling.*`, with gpt-oss's own beta_fast 32, beta_slow 1 where the file
    does not name them, and no truncation (as gpt-oss's config); none when the file says none."""
    meta = header.metadata
    n = config.get("num_hidden_layers")
    if isinstance(n, int) and n > 0:
        config["layer_types"] = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)]
    kind = meta.get("gpt-oss.rope.scaling.type")
    if kind in (None, "none"):
        config["rope_scaling"] = {"rope_type": "default"}
        return
    config["rope_scaling"] = {"rope_type": str(kind), "factor": float(meta.get("gpt-oss.rope.scaling.factor", 1.0)),
                              "beta_fast": float(meta.get("gpt-oss.rope.scaling.yarn_beta_fast", 32.0)),
                              "beta_slow": float(meta.get("gpt-oss.rope.scaling.yarn_beta_slow", 1.0)),
                              "truncate": False}
    original = meta.get("gpt-oss.rope.scaling.original_context_length")
    if original is not None:
        config["rope_scaling"]["original_max_position_embeddings"] = int(original)


def _glm4moe_rules(header: GGUFHeader, config: dict[str, Any]) -> None:
    """GLM-4.5 as llama.cpp stores it: `block_count` counts the NextN (MTP) layers after the
    decoder's (their tensors are skipped); rotary on `rope.dimension_count` of each head's
    dims (partial_rotary_factor); biases on q/k/v and q/k norms where the file has them;
    sigmoid routing is the only kind transformers' GLM-4.5 runs."""
    meta = header.metadata
    nextn = config.pop("num_nextn_predict_layers", 0) or 0
    if isinstance(config.get("num_hidden_layers"), int) and isinstance(nextn, int):
        config["num_hidden_layers"] -= nextn
    config["num_nextn_predict_layers"] = 0
    head_dim = config.get("head_dim") or (config.get("hidden_size", 0) // max(config.get("num_attention_heads", 1), 1))
    rope_dim = meta.get("glm4moe.rope.dimension_count")
    if isinstance(rope_dim, (int, np.integer)) and head_dim:
        config["partial_rotary_factor"] = int(rope_dim) / head_dim
    config["head_dim"] = head_dim
    config["attention_bias"] = header.tensor("blk.0.attn_q.bias") is not None
    config["use_qk_norm"] = header.tensor("blk.0.attn_q_norm.weight") is not None
    gating = meta.get("glm4moe.expert_gating_func", LLAMA_CPP_SIGMOID)
    if int(gating) != LLAMA_CPP_SIGMOID:
        raise UnsupportedModel(f"'{header.path.name}' routes its experts by softmax; SpecChat runs GLM-4.5 GGUF "
                               "files with sigmoid routing (as GLM-4.5 itself) only.")


_RULES: dict[str, Callable[[GGUFHeader, dict[str, Any]], None]] = {
    "gemma3": _gemma3_rules, "gpt-oss": _gpt_oss_rules, "glm4moe": _glm4moe_rules, gguf_gemma4.ARCH: gguf_gemma4.rules,
    **dict.fromkeys(gguf_hybrid.ARCHS, gguf_hybrid.rules)}


# ---- tensors ------------------------------------------------------------------------------------
class MixtralTensorProcessor(LlamaTensorProcessor):
    """transformers' Llama processor (q/k rows) with its Qwen-MoE handling of 3-D experts (gate
    and up narrowed into gate_up_proj, down as it is): a Mixtral GGUF is llama.cpp's llama
    architecture with experts, which transformers itself does not load."""

    def __init__(self, config: dict | None = None) -> None:
        super().__init__(config=config)
        self._experts = Qwen2MoeTensorProcessor(config=config)

    def preprocess_name(self, hf_name: str) -> str:
        return self._experts.preprocess_name(hf_name)

    def perform_fallback_tensor_mapping(self, gguf_to_hf_name_map: dict[str, str], suffix: str, qual_name: str,
                                        hf_name: str) -> None:
        self._experts.perform_fallback_tensor_mapping(gguf_to_hf_name_map, suffix, qual_name, hf_name)

    def process(self, weights: Any, name: str, **kwargs: Any) -> Any:
        if "_exps." in name:
            return self._experts.process(weights, name, **kwargs)
        return super().process(weights, name, **kwargs)


def processor_for(header: GGUFHeader, config: dict[str, Any]) -> TensorProcessor:
    """transformers' processor of llama.cpp's tensors for this file (names and transforms of the
    tensors no recipe builds). gpt-oss's own processor in transformers reads another naming than
    llama.cpp's: its experts are recipes here, everything else is as stored."""
    arch = header.architecture or ""
    if is_mixtral(header):
        return MixtralTensorProcessor(config=config)
    if arch in ("glm4moe", "qwen3next", "qwen35moe"):  # gate and up experts narrowed into gate_up_proj
        return Qwen2MoeTensorProcessor(config=config)
    if arch == "gpt-oss":
        return TensorProcessor(config=config)
    kind: type[TensorProcessor] = TENSOR_PROCESSORS.get(arch, TensorProcessor)
    return kind(config=config)


def add_names(header: GGUFHeader, num_layers: int, params: Sequence[str], names: dict[str, str]) -> None:
    """Names get_gguf_hf_weights_map misses: a parameter named `..._bias` that llama.cpp's
    converter renames `....bias` before mapping it (GLM's `mlp.gate.e_score_correction_bias`
    -> `blk.N.exp_probs_b.bias`); separate gate and up experts of the hybrid families."""
    arch = header.architecture or ""
    if arch in gguf_hybrid.ARCHS:
        gguf_hybrid.add_names(header, names, num_layers)
    if arch == gguf_gemma4.ARCH:
        gguf_gemma4.add_names(header, names, num_layers)
    arch_id = next((k for k, v in MODEL_ARCH_NAMES.items() if v == arch), None)
    if arch_id is None:
        return
    table = get_tensor_name_map(arch_id, num_layers)
    mapped = set(names.values())
    for name in params:
        if name.endswith("_bias") and name not in mapped:
            found = table.get_name(name.removesuffix("_bias"))
            if found is not None:
                names[f"{found}.bias"] = name


def tensor_name(names: dict[str, str], t: TensorInfo) -> str | None:
    """The transformers name of GGUF tensor t, from get_gguf_hf_weights_map's table: fused
    experts and sinks (`attn_sinks.weight`) map without their suffix."""
    for key in (t.name, t.name.removesuffix(".weight")):
        if key in names:
            return names[key]
    return None


@dataclass(frozen=True)
class Recipe:
    """A parameter built from tensors of the file: `build` takes their de-quantised fp32 values
    (each in its stored shape, rows first) and returns the parameter's."""

    sources: tuple[str, ...]
    build: Callable[[list[torch.Tensor]], torch.Tensor]


def recipes(header: GGUFHeader, config: Any, params: Sequence[str]) -> dict[str, Recipe]:
    """The parameters of `params` (transformers names) this file's family builds by a recipe."""
    if header.architecture in gguf_hybrid.ARCHS:
        return {name: Recipe(sources, build)
                for name, (sources, build) in gguf_hybrid.recipes(header, config, params).items()}
    if header.architecture != "gpt-oss":
        return {}
    out: dict[str, Recipe] = {}
    for name in params:  # the biases; the experts' matrices are parts (gpt_oss_parts)
        prefix, _, leaf = name.rpartition(".mlp.experts.")
        if not prefix.startswith("model.layers."):
            continue
        blk = "blk." + prefix.removeprefix("model.layers.")
        if leaf == "gate_up_proj_bias":
            if header.tensor(f"{blk}.ffn_gate_up_exps.bias") is not None:  # llama.cpp's --fuse-gate-up-exps
                out[name] = Recipe((f"{blk}.ffn_gate_up_exps.bias",), lambda v: v[0])
            else:
                out[name] = Recipe((f"{blk}.ffn_gate_exps.bias", f"{blk}.ffn_up_exps.bias"), _halves)
        elif leaf == "down_proj_bias":
            out[name] = Recipe((f"{blk}.ffn_down_exps.bias",), lambda v: v[0])
    return out


def hold_as_stored(header: GGUFHeader, model: nn.Module) -> None:
    """Put in `model` (meta) the modules that hold this file's tensors as it stores them: a
    gpt-oss's RowExperts (engine.model.gpt_oss_experts). Other files: nothing."""
    if header.architecture == "gpt-oss":
        use_row_experts(model)


def gpt_oss_parts(header: GGUFHeader, params: Sequence[str]) -> dict[str, list[tuple[str, tuple[int, int] | None]]]:
    """gpt-oss's expert matrices as the file's tensors fill them, in the model's RowExperts
    (engine.model.gpt_oss_experts: rows first, gate rows then up rows): parameter -> its tensors
    with the rows of each expert each fills, None for all of them. Every other file: none."""
    if header.architecture != "gpt-oss":
        return {}
    out: dict[str, list[tuple[str, tuple[int, int] | None]]] = {}
    for name in params:
        prefix, _, leaf = name.rpartition(".mlp.experts.")
        if not prefix.startswith("model.layers."):
            continue
        blk = "blk." + prefix.removeprefix("model.layers.")
        if leaf == "gate_up_proj":
            fused = header.tensor(f"{blk}.ffn_gate_up_exps.weight")
            if fused is not None:
                out[name] = [(fused.name, None)]
            else:
                gate = header.tensor(f"{blk}.ffn_gate_exps.weight")
                rows = gate.shape[-2] if gate is not None else 0
                out[name] = [(f"{blk}.ffn_gate_exps.weight", (0, rows)),
                             (f"{blk}.ffn_up_exps.weight", (rows, 2 * rows))]
        elif leaf == "down_proj":
            out[name] = [(f"{blk}.ffn_down_exps.weight", None)]
    return out


def gpt_oss_tensors(header: GGUFHeader, params: Mapping[str, Any], file: str
                    ) -> list[tuple[str, TensorInfo, tuple[int, int] | None]]:
    """gpt_oss_parts with each tensor looked up: (parameter, tensor, rows or None). CorruptGGUF
    naming the file when one is missing."""
    out = []
    for name, sources in gpt_oss_parts(header, list(params)).items():
        for source, rows in sources:
            t = header.tensor(source)
            if t is None:
                raise CorruptGGUF(f"{file} has no tensor {source} (for {name})")
            out.append((name, t, rows))
    return out


def _halves(values: list[torch.Tensor]) -> torch.Tensor:
    """Gate and up biases (E, I) each -> (E, 2I), gate then up (RowExperts' order)."""
    gate, up = values
    if gate.shape != up.shape:
        raise ValueError(f"gate expert biases {tuple(gate.shape)} and up expert biases {tuple(up.shape)} differ")
    return torch.cat((gate, up), dim=-1)


@dataclass(frozen=True)
class Conversion:
    """What transformers' processor does to one tensor of the file, as it can be kept packed."""

    order: tuple[int, ...] | None = None  # the rows permuted: stored row order[j] becomes row j
    part: tuple[int, int] | None = None  # rows [a, b) of each matrix of a parameter of `rows` rows
    rows: int = 0
    valued: bool = False  # a 1-D tensor whose values it changes (Gemma's norms): run at load


def conversion(processor: TensorProcessor, t: TensorInfo, names: dict[str, str]) -> Conversion:
    """transformers' processing of tensor t, found by running its processor on row numbers (and
    expert numbers: a (E, rows, 1) probe for 3-D experts). A row permutation (Llama's q/k), a
    part of a fused parameter (Qwen-MoE's gate and up experts, narrowed into gate_up_proj) and
    a change of a 1-D tensor's values (Gemma's norms, stored + 1) are kept; any other transform
    cannot be applied to packed blocks: refused."""
    refused = UnsupportedModel(f"The GGUF tensor {t.name} needs a conversion SpecChat cannot apply to packed "
                               "weights; this architecture is not supported.")
    rows = t.shape[-2] if len(t.shape) > 1 else t.shape[0]
    lead = t.shape[:-2] if len(t.shape) > 2 else ()
    cols = [1] if len(t.shape) > 1 else []
    probe = np.arange(1, math.prod(lead) * rows + 1, dtype=np.int64).reshape(*lead, rows, *cols)
    parsed: dict[str, dict[str, Any]] = {"tensors": {}}
    out = processor.process(weights=probe, name=t.name, tensor_key_mapping=names, parsed_parameters=parsed)
    if out.name is None and len(parsed["tensors"]) == 1:  # stored into transformers' own parameter
        got = np.asarray(next(iter(parsed["tensors"].values())))
    elif out.name == t.name and out.weights is not None and not parsed["tensors"]:
        got = np.asarray(out.weights)
    else:
        raise refused
    if len(t.shape) == 1:
        if got.shape != probe.shape:
            raise refused
        return Conversion(valued=not np.array_equal(got, probe))
    if got.ndim == probe.ndim and got.shape[:-2] == probe.shape[:-2] and got.shape[-2] > rows and got.shape[-1] == 1:
        filled = np.flatnonzero((got != 0).reshape(-1, got.shape[-2]).any(0))
        a = int(filled[0]) if filled.size else 0
        if filled.size == rows and int(filled[-1]) == a + rows - 1 and np.array_equal(got[..., a:a + rows, :], probe):
            return Conversion(part=(a, a + rows), rows=int(got.shape[-2]))
        raise refused
    if got.shape != probe.shape:
        raise refused
    if len(t.shape) > 2:
        if not np.array_equal(got, probe):
            raise refused
        return Conversion()
    flat = got.reshape(-1) - 1
    if sorted(flat.tolist()) != list(range(rows)):
        raise refused
    return Conversion(order=None if np.array_equal(flat, np.arange(rows)) else tuple(int(x) for x in flat))
