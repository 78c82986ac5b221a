"""GGUF files of Gemma 4, written here as llama.cpp's converter writes them (its Gemma4Model),
load and run what the transformers model they were converted from computes.

Two tiny models from transformers' own Gemma4TextConfig: a dense one with per-layer input
embeddings, sliding windows shorter than the prompt, full layers with wider heads, one K/V head
and keys as values, and its last two layers reusing the K/V of earlier ones (no k/v tensors;
double-wide MLPs); a MoE one (routed experts beside each MLP, as 26B-A4B) with tied embeddings,
no per-layer inputs, and its full layers' keys as values (one K/V head). Both decode in the
fused CPU step and pass (engine/kernels/fused_gemma4.py: per-layer inputs, reused K/V and the
MoE block in C). Each runs resident and with every layer streamed, and as NF4. The converter
follows llama.cpp: norms stored as they are (Gemma 4's norm is x * w), per-layer K/V head
counts and the sliding pattern as arrays, head widths as key_length / key_length_swa, the full
layers' proportional rope as a `rope_freqs` tensor (ones, then 1e30 for unrotated pairs), the
router's scales as `ffn_gate_inp.scale` / `ffn_down_exps.scale`, `layer_scalar` as
`layer_output_scale`. Matrices and the per-layer table in Q8_0, embeddings in F16, the rest in
F32; the reference model holds the file's values, so logits agree to float rounding and greedy
text is identical to transformers' generate."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import GGUFReader
from test_gguf_families import assert_experts_on_cpu_beside_gpu, greedy, logits
from test_gguf_families2 import (
    PROMPTS,
    Stored,
    as_stored,
    assert_logits_and_greedy_text_equal,
    f32,
    randomise,
    vocab,
    write_gguf,
)
from torch import nn
from transformers import AutoModelForCausalLM, Gemma4TextConfig, PreTrainedTokenizerBase

from engine.decoding.generation import Engine
from engine.errors import UnsupportedModel
from engine.loading.gguf import GGUFWeights, gguf_config
from engine.loading.load import load_model
from engine.loading.materialise import layer_buffers_as_parameters
from engine.store.gguf_header import read_header

__all__ = ["vocab"]  # the tokenizer fixture, shared with the other families' tests

WINDOW = 4  # shorter than every prompt
LAYERS = 6
TYPES = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(LAYERS)]


@pytest.fixture(autouse=True)
def _cache_dir(model_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPECCHAT_CACHE_DIR", str(model_cache))


def gemma4_config(tok: PreTrainedTokenizerBase, vocab_size: int, moe: bool) -> Gemma4TextConfig:
    """Dense: per-layer inputs, K=V full layers with one K/V head, the last two layers sharing
    K/V (with MLPs twice as wide). MoE: 4 experts, top 2, beside each MLP, K=V full layers with one
    K/V head; no per-layer inputs, nothing shared."""
    common: dict[str, Any] = dict(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, global_head_dim=32, sliding_window=WINDOW,
        layer_types=TYPES, max_position_embeddings=256, tie_word_embeddings=moe,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    dense: dict[str, Any] = dict(num_global_key_value_heads=1)  # read by __post_init__, not a field
    if moe:
        return Gemma4TextConfig(**common, **dense, attention_k_eq_v=True, hidden_size_per_layer_input=0,
                                enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=64)
    return Gemma4TextConfig(**common, **dense, attention_k_eq_v=True, num_kv_shared_layers=2, use_double_wide_mlp=True,
                            hidden_size_per_layer_input=16, vocab_size_per_layer_input=vocab_size,
                            final_logit_softcapping=30.0)


def convert(model: Any, hf: dict[str, Any], moe: bool) -> tuple[dict[str, Any], Stored]:
    """llama.cpp's keys and tensors for `model` (whose parameters become the file's values);
    `hf` is the config.json the converter reads (global_head_dim etc. as the checkpoint has them)."""
    config = model.config
    config.allow_global_per_layer_attribute_access = True  # the sliding layers' head_dim and K/V heads
    n = config.num_hidden_layers
    shared = config.num_kv_shared_layers
    swa = [t == "sliding_attention" for t in config.layer_types]
    full_rope = config.rope_parameters["full_attention"]
    keys: dict[str, Any] = {
        "block_count": n, "context_length": config.max_position_embeddings, "embedding_length": config.hidden_size,
        "feed_forward_length": config.intermediate_size, "attention.head_count": config.num_attention_heads,
        "attention.head_count_kv": config.num_key_value_heads,
        "rope.freq_base": float(full_rope["rope_theta"]),
        "rope.freq_base_swa": float(config.rope_parameters["sliding_attention"]["rope_theta"]),
        "attention.layer_norm_rms_epsilon": float(config.rms_norm_eps),
        "attention.key_length": hf["global_head_dim"], "attention.value_length": hf["global_head_dim"],
        "attention.key_length_swa": config.head_dim, "attention.value_length_swa": config.head_dim,
        "attention.sliding_window": config.sliding_window, "attention.shared_kv_layers": shared,
        "embedding_length_per_layer_input": config.hidden_size_per_layer_input,
        "attention.sliding_window_pattern": swa,
        "rope.dimension_count": hf["global_head_dim"], "rope.dimension_count_swa": config.head_dim}
    if config.use_double_wide_mlp:  # one width per layer: doubled where the K/V is another layer's
        keys["feed_forward_length"] = [config.intermediate_size * (2 if i >= n - shared else 1) for i in range(n)]
    if config.final_logit_softcapping:
        keys["final_logit_softcapping"] = float(config.final_logit_softcapping)
    if hf.get("num_global_key_value_heads") is not None:  # one count per layer, as llama.cpp writes it
        keys["attention.head_count_kv"] = [config.num_key_value_heads if s else hf["num_global_key_value_heads"]
                                           for s in swa]
    if moe:
        keys.update({"expert_count": config.num_experts, "expert_used_count": config.top_k_experts,
                     "expert_feed_forward_length": config.moe_intermediate_size})
    inner = model.model
    rotated = int(hf["global_head_dim"] * full_rope["partial_rotary_factor"] / 2)
    freqs = np.array([1.0] * rotated + [1e30] * (hf["global_head_dim"] // 2 - rotated), np.float32)
    tensors: Stored = {"rope_freqs.weight": (freqs, Q.F32),
                       "token_embd.weight": as_stored(inner.embed_tokens.weight, Q.F16),
                       "output_norm.weight": as_stored(inner.norm.weight, Q.F32)}
    if not config.tie_word_embeddings:
        tensors["output.weight"] = as_stored(model.lm_head.weight, Q.Q8_0)
    if config.hidden_size_per_layer_input:
        tensors["per_layer_token_embd.weight"] = as_stored(inner.embed_tokens_per_layer.weight, Q.Q8_0)
        tensors["per_layer_model_proj.weight"] = as_stored(inner.per_layer_model_projection.weight, Q.Q8_0)
        tensors["per_layer_proj_norm.weight"] = as_stored(inner.per_layer_projection_norm.weight, Q.F32)
    for i, layer in enumerate(inner.layers):
        tensors.update(block(f"blk.{i}", layer))
    return keys, tensors


def block(blk: str, layer: Any) -> Stored:
    """One decoder layer's tensors: a K/V-sharing layer has no k/v, a K=V layer no v."""
    attn = layer.self_attn
    out: Stored = {f"{blk}.layer_output_scale.weight": as_stored(layer.layer_scalar, Q.F32)}
    for ours, theirs in (("attn_q", "q_proj"), ("attn_k", "k_proj"), ("attn_v", "v_proj"), ("attn_output", "o_proj"),
                         ("attn_q_norm", "q_norm"), ("attn_k_norm", "k_norm")):
        module = getattr(attn, theirs, None)
        if module is not None:
            out[f"{blk}.{ours}.weight"] = as_stored(module.weight, Q.F32 if "norm" in ours else Q.Q8_0)
    for ours, theirs in (("attn_norm", "input_layernorm"), ("post_attention_norm", "post_attention_layernorm"),
                         ("ffn_norm", "pre_feedforward_layernorm"), ("post_ffw_norm", "post_feedforward_layernorm"),
                         ("post_norm", "post_per_layer_input_norm"), ("pre_ffw_norm_2", "pre_feedforward_layernorm_2"),
                         ("post_ffw_norm_1", "post_feedforward_layernorm_1"),
                         ("post_ffw_norm_2", "post_feedforward_layernorm_2")):
        if hasattr(layer, theirs):
            out[f"{blk}.{ours}.weight"] = as_stored(getattr(layer, theirs).weight, Q.F32)
    for ours, theirs in (("ffn_gate", "gate_proj"), ("ffn_up", "up_proj"), ("ffn_down", "down_proj")):
        out[f"{blk}.{ours}.weight"] = as_stored(getattr(layer.mlp, theirs).weight, Q.Q8_0)
    if hasattr(layer, "per_layer_input_gate"):
        out[f"{blk}.inp_gate.weight"] = as_stored(layer.per_layer_input_gate.weight, Q.Q8_0)
        out[f"{blk}.proj.weight"] = as_stored(layer.per_layer_projection.weight, Q.F16)  # 16 columns: no Q8_0 block
    if hasattr(layer, "experts"):
        out[f"{blk}.ffn_gate_inp.weight"] = as_stored(layer.router.proj.weight, Q.F32)
        out[f"{blk}.ffn_gate_inp.scale"] = as_stored(layer.router.scale, Q.F32)
        out[f"{blk}.ffn_down_exps.scale"] = as_stored(layer.router.per_expert_scale, Q.F32)
        out[f"{blk}.ffn_gate_up_exps.weight"] = as_stored(layer.experts.gate_up_proj, Q.Q8_0)
        out[f"{blk}.ffn_down_exps.weight"] = as_stored(layer.experts.down_proj, Q.Q8_0)
    return out


def gemma4(tok: PreTrainedTokenizerBase, meta: dict, path: Path, moe: bool) -> nn.Module:
    config = gemma4_config(tok, len(meta["tokens"]), moe)
    hf = {"global_head_dim": 32, "num_global_key_value_heads": 1}
    model: Any = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    randomise(model, seed=11 if moe else 9)
    g = torch.Generator().manual_seed(12)
    with torch.no_grad():
        for embed in (model.model.embed_tokens, getattr(model.model, "embed_tokens_per_layer", None)):
            if embed is not None:  # computed, not stored: back to sqrt(width), which randomise changed
                embed.embed_scale.fill_(embed.scalar_embed_scale)
        for layer in model.model.layers:  # away from 1 (randomise sets 1-D values near 0)
            layer.layer_scalar.copy_(0.5 + torch.rand(1, generator=g))
            if moe:
                layer.router.scale.copy_(1 + 0.1 * torch.randn(layer.router.scale.shape, generator=g))
                layer.router.per_expert_scale.copy_(0.5 + torch.rand(layer.router.per_expert_scale.shape, generator=g))
    keys, tensors = convert(model, hf, moe)
    write_gguf(path, "gemma4", keys, meta, tensors)
    return model


@pytest.fixture(scope="session", params=["dense", "moe"])
def converted(request: pytest.FixtureRequest, vocab: tuple[dict, PreTrainedTokenizerBase],
              tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, nn.Module, PreTrainedTokenizerBase]:
    meta, tok = vocab
    path = tmp_path_factory.mktemp(f"gemma4-{request.param}") / "model.gguf"
    return path, gemma4(tok, meta, path, moe=request.param == "moe"), tok


def test_config_is_the_converted_models(converted: tuple) -> None:
    path, ref, _ = converted
    ours = gguf_config(read_header(path)).to_dict()
    theirs = ref.config.to_dict()
    for key in ("model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "per_layer_config", "rms_norm_eps", "rope_parameters",
                "vocab_size", "tie_word_embeddings", "sliding_window", "layer_types", "final_logit_softcapping",
                "attention_k_eq_v", "num_kv_shared_layers", "hidden_size_per_layer_input",
                "vocab_size_per_layer_input", "use_double_wide_mlp", "enable_moe_block", "num_experts",
                "top_k_experts", "moe_intermediate_size", "max_position_embeddings", "hidden_activation"):
        assert f32(ours.get(key)) == f32(theirs.get(key)), key
    assert ours["rope_parameters"]["full_attention"]["partial_rotary_factor"] == 0.25


def test_every_parameter_is_the_files_and_layers_stay_packed(converted: tuple) -> None:
    path, ref, _ = converted
    weights = GGUFWeights(path)
    try:
        with torch.device("meta"):
            hf = AutoModelForCausalLM.from_config(weights.config)
        layer_buffers_as_parameters(hf)  # layer_scalar is loaded as a parameter
        weights.bind(hf)
        layouts = weights.layouts(hf, torch.float32, "none")
        kinds = {e.name: e.kind for e in layouts[1].entries}
        assert kinds["self_attn.q_proj.weight"] == "gguf" and kinds["mlp.down_proj.weight"] == "gguf"
        assert "self_attn.v_proj.weight" not in kinds or ref.config.enable_moe_block  # keys are values (dense)
        if ref.config.enable_moe_block:
            assert kinds["experts.gate_up_proj"] == "gguf" and kinds["router.per_expert_scale"] == "gguf"
        else:  # the last layer reads another layer's K/V: none of its own
            assert not any(e.name.startswith(("self_attn.k_", "self_attn.v_")) for e in layouts[-1].entries)
        state = dict(ref.named_parameters()) | {n: b for n, b in ref.named_buffers() if n.endswith("layer_scalar")}
        for name, p in state.items():
            if name == "lm_head.weight" and ref.config.tie_word_embeddings:
                continue
            assert torch.equal(weights.load(name, torch.float32), p.detach().float()), name
    finally:
        weights.close()


@pytest.mark.parametrize("offload", ["none", "all"])
def test_logits_and_greedy_text_equal_transformers(converted: tuple, offload: str) -> None:
    assert_logits_and_greedy_text_equal(converted, offload)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("experts", ["cpu", "gpu"])
def test_moe_on_a_gpu_gives_transformers_text(converted: tuple, experts: str) -> None:
    """The MoE on a GPU: its routed experts packed in RAM beside it (run by the CPU kernel), or
    every layer resident in its GGUF blocks, a pass de-quantising the routed experts alone
    (engine/offload/routed.py): logits within 1e-4 of transformers' on the GPU, its greedy text."""
    path, ref, tok = converted
    if not ref.config.enable_moe_block:
        pytest.skip("dense")
    if experts == "cpu":
        assert_experts_on_cpu_beside_gpu(path, ref, tok, PROMPTS, 16)
        return
    m = load_model(path, "cuda", torch.float32, offload="none", experts="gpu")
    assert m.model.streamer is not None and any(h is not None for h in m.model.streamer._routed)
    ref = ref.to("cuda")
    engine = Engine(m.model, m.tokenizer)
    for prompt in PROMPTS:
        ids = tok(prompt)["input_ids"]
        with torch.inference_mode():
            theirs = ref(torch.tensor([ids], device="cuda")).logits[0].float().cpu()
        ours = logits(m, ids).cpu()
        assert (ours - theirs).abs().max() <= 1e-4 * theirs.abs().max(), prompt
        x = torch.tensor([ids], device="cuda")
        want = ref.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=16, do_sample=False,
                            pad_token_id=tok.pad_token_id)[0, len(ids):].tolist()
        got = greedy(engine, prompt, n=16)
        assert list(got.token_ids) == (want[: len(got.token_ids)] if got.finish_reason == "eos" else want), prompt


def test_nf4_gives_each_kind_of_layer_its_own_layout(converted: tuple, tmp_path: Path) -> None:
    """--quant nf4 re-quantises the file per kind of layer (sliding or full, computing its K/V
    or reusing another's): the model is the converted model's own NF4 (its folder loaded with
    --quant nf4), to float rounding."""
    path, ref, tok = converted
    folder = tmp_path / "folder"
    ref.save_pretrained(folder)
    tok.save_pretrained(folder)
    m = load_model(path, quant="nf4", offload="all")
    assert m.model.streamer is not None
    kinds = {tuple((e.name, e.shape) for e in layout.entries) for layout in m.model.streamer.layouts}
    assert len(kinds) == (2 if ref.config.enable_moe_block else 4)
    ids = m.tokenizer(PROMPTS[0])["input_ids"]
    theirs = logits(load_model(folder, quant="nf4", offload="all"), ids)
    assert (logits(m, ids) - theirs).abs().max() <= 1e-4 * theirs.abs().max()


def test_every_end_of_answer_token_ends_an_answer(converted: tuple) -> None:
    """llama.cpp stops at the end of a turn and of a message too (Gemma 4's <turn|> and
    <|tool_response>), and at each of a file's own list: so does the config."""
    path, ref, tok = converted
    header = read_header(path)
    assert gguf_config(header).eos_token_id == tok.eos_token_id  # one end: as it is
    meta = {**header.metadata, "tokenizer.ggml.eot_token_id": 7, "tokenizer.ggml.eos_token_ids": np.array([9, 7])}
    assert gguf_config(replace(header, metadata=meta)).eos_token_id == [tok.eos_token_id, 9, 7]


def rewritten(good: Path, out: Path, meta: dict, keys: dict[str, Any] | None = None,
              drop: tuple[str, ...] = (), extra: Stored | None = None) -> Path:
    """`good` written again with some keys changed, some tensors left out, some added."""
    reader = GGUFReader(good)
    values = {k.removeprefix("gemma4."): f.contents() for k, f in reader.fields.items() if k.startswith("gemma4.")}
    tensors: Stored = {t.name: (np.array(t.data), Q(t.tensor_type)) for t in reader.tensors if t.name not in drop}
    return write_gguf(out, "gemma4", {**values, **(keys or {})}, meta, {**tensors, **(extra or {})})


def test_k_and_v_a_conversion_keeps_for_sharing_layers_are_not_read(vocab: tuple, tmp_path: Path) -> None:
    """A checkpoint that still holds k/v weights for the layers that reuse others' K/V gives a
    file with them: the model has no place for them, and computes what it computed without."""
    meta, tok = vocab
    path = tmp_path / "model.gguf"
    ref: Any = gemma4(tok, meta, path, moe=False)
    g = np.random.default_rng(0)
    extra: Stored = {}
    for i in range(LAYERS - ref.config.num_kv_shared_layers, LAYERS):
        width = 32 if TYPES[i] == "full_attention" else 2 * 16
        for name in ("attn_k", "attn_v"):
            extra[f"blk.{i}.{name}.weight"] = (g.standard_normal((width, 64)).astype(np.float32), Q.Q8_0)
    stale = rewritten(path, tmp_path / "stale.gguf", meta, extra=extra)
    m = load_model(stale)
    ids = tok(PROMPTS[0])["input_ids"]
    with torch.inference_mode():
        theirs = ref(torch.tensor([ids])).logits[0]
    assert (logits(m, ids) - theirs).abs().max() <= 1e-4 * theirs.abs().max()


def test_a_sliding_pattern_given_as_a_period_reads_as_llama_cpp_reads_it(converted: tuple, vocab: tuple,
                                                                         tmp_path: Path) -> None:
    """A pattern of 2: the last layer of each two is a full one, as the per-layer list says."""
    path, ref, _ = converted
    period = rewritten(path, tmp_path / "period.gguf", vocab[0], keys={"attention.sliding_window_pattern": 2})
    assert gguf_config(read_header(period)).layer_types == ref.config.layer_types == TYPES


@pytest.mark.parametrize(("change", "words"), [
    ({"keys": {"attention.sliding_window_pattern": [True, False]}}, "marks 2 layers of 6"),
    ({"keys": {"rope.dimension_count_swa": 8}}, "rotates 8 of the 16"),
    ({"keys": {"feed_forward_length": [128, 128, 96, 128, 128, 128]}}, "MLP widths"),
    ({"drop": ("per_layer_token_embd.weight",)}, "per-layer token embeddings"),
])
def test_files_gemma_4_cannot_be_are_refused_in_one_line(vocab: tuple, tmp_path: Path, change: dict,
                                                         words: str) -> None:
    meta, tok = vocab
    good = tmp_path / "good.gguf"
    gemma4(tok, meta, good, moe=False)
    bad = rewritten(good, tmp_path / "bad.gguf", meta, **change)
    with pytest.raises((UnsupportedModel, ValueError)) as err:
        load_model(bad)
    message = getattr(err.value, "user_message", str(err.value))
    assert words in message and "\n" not in message
