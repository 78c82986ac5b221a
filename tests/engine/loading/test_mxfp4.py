"""gpt-oss's MXFP4 experts: blocks and scales written here by the format's documented layout
load de-quantised, bit for bit what transformers' own de-quantisation gives (its function, and
its model loaded with Mxfp4Config(dequantize=True)), resident and streamed."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import AutoModelForCausalLM
from transformers.integrations.mxfp4 import FP4_VALUES, convert_moe_packed_tensors
from transformers.utils.quantization_config import Mxfp4Config

from engine.errors import UnsupportedModel
from engine.kernels.build import kernels
from engine.kernels.experts import PackedExperts
from engine.loading.load import LoadedModel, load_model
from engine.loading.materialise import resident_bytes
from engine.loading.mxfp4 import dequantize_mxfp4
from engine.model.gpt_oss_experts import RowExperts
from engine.testing.synthetic import tiny_model

PROMPT = "Speculative decoding lets a small draft model propose tokens that a large target model verifies."
EXPERTS = ("gate_up_proj", "down_proj")


def quantise(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A model tensor (experts, K, rows) -> MXFP4 blocks (experts, rows, K / 32, 16) and
    scales (experts, rows, K / 32): each group of 32 along K scaled by a power of two so its
    largest value fits FP4's 6, each value rounded to the nearest FP4 value; code 2i in the
    low nibble of byte i."""
    stored = w.transpose(1, 2).float()  # (E, rows, K): the layout the checkpoint keeps
    e, rows, k = stored.shape
    groups = stored.reshape(e, rows, k // 32, 32)
    amax = groups.abs().amax(-1).clamp(min=2.0**-100)
    exponent = torch.ceil(torch.log2(amax / 6.0))  # (E, rows, G)
    lut = torch.tensor(FP4_VALUES)
    scaled = groups / torch.exp2(exponent)[..., None]
    codes = (scaled[..., None] - lut).abs().argmin(-1).to(torch.uint8)  # (E, rows, G, 32)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks.contiguous(), (exponent + 127).to(torch.uint8)


def write_mxfp4(src: Path, dest: Path) -> None:
    """The tiny gpt-oss with its experts' matrices as MXFP4 blocks and scales, as gpt-oss ships."""
    shutil.copytree(src, dest)
    state = load_file(src / "model.safetensors")
    out = {}
    for name, t in state.items():
        if name.endswith(tuple(f".experts.{p}" for p in EXPERTS)):
            out[f"{name}_blocks"], out[f"{name}_scales"] = quantise(t)
        else:
            out[name] = t.to(torch.bfloat16)
    save_file(out, dest / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((dest / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (dest / "config.json").write_text(json.dumps(config))


@pytest.fixture(scope="module")
def mxfp4_folder(model_cache: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("mxfp4") / "gpt-oss-mxfp4"
    source = tiny_model("gpt_oss", seed=0, layers=4, cache_dir=model_cache)
    write_mxfp4(source, folder)
    shutil.copy(source / "model.safetensors", folder.parent / "source.safetensors")
    return folder


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_dequantisation_is_transformers_own(dtype: torch.dtype) -> None:
    """Every code and every exponent (the extremes overflow and underflow the same way)."""
    g = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 24, 4, 16), dtype=torch.uint8, generator=g)
    scales = torch.randint(100, 150, (3, 24, 4), dtype=torch.uint8, generator=g)
    scales[0, 0] = torch.tensor([0, 1, 253, 254], dtype=torch.uint8)
    want = convert_moe_packed_tensors(blocks, scales, dtype=dtype)  # (3, 128, 24)
    got = torch.stack([dequantize_mxfp4(blocks[e], scales[e]) for e in range(3)]).to(dtype)
    assert got.shape == want.shape == (3, 128, 24)
    assert torch.equal(got.view(torch.uint8 if dtype != torch.float32 else torch.int32).view(-1),
                       want.view(torch.uint8 if dtype != torch.float32 else torch.int32).view(-1))


def logits(m: LoadedModel) -> torch.Tensor:
    ids = torch.tensor(m.tokenizer(PROMPT)["input_ids"])
    cache = m.model.new_cache(len(ids))
    return m.model.logits(m.model.forward(ids, torch.arange(len(ids)), cache, None))


def expert_values(experts: nn.Module, proj: str) -> torch.Tensor:
    """An experts module's matrices as transformers' GptOssExperts holds them, (E, in, out) fp32:
    from the packed kernel's codes (PackedExperts) or RowExperts' rows (no kernel here)."""
    if isinstance(experts, PackedExperts):
        parts = experts.gate_up if proj == "gate_up_proj" else experts.down
        rows = torch.stack([PackedExperts.expert_matrix(parts, e) for e in range(experts.num_experts)])
    else:
        assert isinstance(experts, RowExperts) and experts.interleaved
        rows = getattr(experts, proj).detach().float()
    return rows.transpose(1, 2)


def test_mxfp4_experts_load_as_transformers_dequantises_them(mxfp4_folder: Path) -> None:
    """Held rows first in their MXFP4 blocks (their nibbles, packed, on the CPU with the kernel):
    every value transformers' de-quantisation gives, and its logits."""
    loaded = load_model(mxfp4_folder)
    ref = AutoModelForCausalLM.from_pretrained(mxfp4_folder, quantization_config=Mxfp4Config(dequantize=True),
                                               dtype=torch.float32).eval()
    mine = loaded.model.layers[1].mlp.experts
    assert isinstance(mine, PackedExperts) == (kernels() is not None)
    theirs = dict(ref.model.layers[1].named_parameters())
    ours = {f"mlp.experts.{proj}": expert_values(mine, proj) for proj in EXPERTS}
    for proj in EXPERTS:
        assert torch.equal(ours[f"mlp.experts.{proj}"], theirs[f"mlp.experts.{proj}"]), proj
    ids = loaded.tokenizer(PROMPT)["input_ids"]
    with torch.inference_mode():
        want = ref(torch.tensor([ids])).logits[0].float()  # (T, V)
    got = logits(loaded)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    # the MXFP4 rounding is really there: near the 16-bit model's experts, not them
    source = load_file(mxfp4_folder.parent / "source.safetensors")
    for proj in EXPERTS:
        w, q = source[f"model.layers.1.mlp.experts.{proj}"], ours[f"mlp.experts.{proj}"]
        error = float((q - w).abs().mean() / w.abs().mean())
        assert 0.01 < error < 0.2, (proj, error)


def test_streamed_mxfp4_layers_equal_resident_ones(mxfp4_folder: Path) -> None:
    streamed = load_model(mxfp4_folder, offload="all")
    assert streamed.model.streamer is not None and not any(h.module for h in streamed.model.streamer.homes)
    # streamed: the blocks de-quantised each pass; resident: the packed kernel's sums (another order)
    torch.testing.assert_close(logits(streamed), logits(load_model(mxfp4_folder)), rtol=1e-5, atol=1e-5)


def test_resident_bytes_count_the_de_quantised_experts(mxfp4_folder: Path, model_cache: Path) -> None:
    dense = tiny_model("gpt_oss", seed=0, layers=4, cache_dir=model_cache)
    assert resident_bytes(mxfp4_folder, torch.bfloat16) == resident_bytes(dense, torch.bfloat16)


def test_mismatched_blocks_and_scales_are_refused(mxfp4_folder: Path, tmp_path: Path) -> None:
    folder = tmp_path / "bad"
    shutil.copytree(mxfp4_folder, folder)
    state = load_file(folder / "model.safetensors")
    name = "model.layers.0.mlp.experts.down_proj_scales"
    state[name] = state[name][:, :-1].contiguous()
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(UnsupportedModel, match="do not fit together"):
        load_model(folder)


def test_mxfp4_outside_the_experts_is_refused_by_name(mxfp4_folder: Path, tmp_path: Path) -> None:
    folder = tmp_path / "linear"
    shutil.copytree(mxfp4_folder, folder)
    state = load_file(folder / "model.safetensors")
    w = state.pop("model.layers.0.self_attn.q_proj.weight")  # (out, in) -> one "expert" of MXFP4
    blocks, scales = quantise(w.float().T[None].contiguous())
    state["model.layers.0.self_attn.q_proj.weight_blocks"] = blocks[0].contiguous()
    state["model.layers.0.self_attn.q_proj.weight_scales"] = scales[0].contiguous()
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(UnsupportedModel, match="MXFP4 only for the experts") as caught:
        load_model(folder)
    assert "corrupt" not in caught.value.user_message
