"""FP8 block-scaled checkpoints of MoE models (as Qwen3.6's FP8 releases ship): each expert's
matrices stored one by one, each with its own `weight_scale_inv` per 32x32 block, in shapes
that are no whole number of blocks (the last block of a row or column is short), in a Qwen3-MoE
checkpoint and in a Qwen3.5-MoE vision-language one (Qwen3.6-35B-A3B-FP8's layout). The model
loads de-quantised and fused, giving the logits of transformers running the weights
de-quantised by a reference written from the format's description."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from engine.loading.load import LoadedModel, load_model
from engine.testing.synthetic import tiny_model
from wrapper_helpers import tiny_wrapper

BLOCK = 32
PROMPT = "Speculative decoding lets a small draft model propose tokens that a large target model verifies."


def quantise(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, cols) -> E4M3 codes and (ceil(rows / 32), ceil(cols / 32)) fp32 scales."""
    rows, cols = w.shape
    scale = torch.empty(-(-rows // BLOCK), -(-cols // BLOCK))
    q = torch.empty(rows, cols)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            block = w[i * BLOCK:(i + 1) * BLOCK, j * BLOCK:(j + 1) * BLOCK].float()
            scale[i, j] = block.abs().max() / 400
            q[i * BLOCK:(i + 1) * BLOCK, j * BLOCK:(j + 1) * BLOCK] = block / scale[i, j]
    return q.to(torch.float8_e4m3fn), scale


def reference(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Element by element: weight[r, c] = code[r, c] * scale[r // 32, c // 32]."""
    out = torch.empty(q.shape)
    for r in range(q.shape[0]):
        for c in range(q.shape[1]):
            out[r, c] = q[r, c].float() * scale[r // BLOCK, c // BLOCK]
    return out


@pytest.fixture(scope="module", params=["qwen3_moe", "qwen3_5_moe"])
def folders(request: pytest.FixtureRequest, model_cache: Path,
            tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(the FP8 checkpoint, the same de-quantised by `reference` in a 32-bit folder)."""
    root = tmp_path_factory.mktemp("fp8-moe")
    if request.param == "qwen3_moe":
        src, layer = tiny_model("qwen3_moe", seed=0, layers=4, cache_dir=model_cache), "model.layers.1."
    else:
        src, layer = tiny_wrapper(root / "src", "qwen3_5_moe"), "model.language_model.layers.1."
    fp8, dense = root / "fp8", root / "dense"
    shutil.copytree(src, fp8)
    shutil.copytree(src, dense)
    state = load_file(src / "model.safetensors")
    assert f"{layer}mlp.experts.3.down_proj.weight" in state, "experts stored one by one"
    quantised, dequantised = {}, {}
    for name, t in state.items():
        if ".layers." in name and name.endswith("proj.weight"):
            q, scale = quantise(t)
            quantised[name], quantised[f"{name}_scale_inv"] = q, scale
            dequantised[name] = reference(q, scale)
        else:
            quantised[name] = dequantised[name] = t
    assert quantised[f"{layer}mlp.experts.0.gate_proj.weight_scale_inv"].shape == (2, 2), "48 rows: 32 + 16"
    save_file(quantised, fp8 / "model.safetensors", metadata={"format": "pt"})
    save_file(dequantised, dense / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": [BLOCK, BLOCK], "modules_to_not_convert": ["lm_head"]}
    (fp8 / "config.json").write_text(json.dumps(config))
    return fp8, dense


def logits(m: LoadedModel) -> torch.Tensor:
    ids = torch.tensor(m.tokenizer(PROMPT)["input_ids"])
    cache = m.model.new_cache(len(ids))
    return m.model.logits(m.model.forward(ids, torch.arange(len(ids)), cache, None))


@pytest.mark.parametrize("offload", ["none", "all"])
def test_fp8_experts_stored_one_by_one_load_de_quantised(folders: tuple[Path, Path], offload: str) -> None:
    fp8, dense = folders
    loaded = load_model(fp8, offload=offload)  # type: ignore[arg-type]
    ref = AutoModelForCausalLM.from_pretrained(dense, dtype=torch.float32).eval()
    ids = loaded.tokenizer(PROMPT)["input_ids"]
    with torch.inference_mode():
        want = ref(torch.tensor([ids])).logits[0]  # (T, V)
    torch.testing.assert_close(logits(loaded), want, rtol=1e-4, atol=1e-4)
    if offload == "none":  # the fused experts are the reference's, value for value
        ours = dict(loaded.model.layers[1].named_parameters())
        theirs = dict(ref.model.layers[1].named_parameters())
        for proj in ("gate_up_proj", "down_proj"):
            assert torch.equal(ours[f"mlp.experts.{proj}"], theirs[f"mlp.experts.{proj}"]), proj
