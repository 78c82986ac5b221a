"""Pre-quantised safetensors checkpoints: a tiny model quantised here into AWQ's and GPTQ's
4-bit layouts (and into FP8) loads with its layers kept packed, and gives the logits of the same
model de-quantised by an independent reference written from each format's description. Formats
SpecChat does not read are refused by name, never reported as corrupt."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from engine.errors import UnsupportedModel
from engine.loading.load import load_model
from engine.testing.synthetic import tiny_model

GROUP = 32
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ: nibble k of an int32 holds output column 8c + AWQ_ORDER[k]
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.fixture(autouse=True)
def _cache_dir(model_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPECCHAT_CACHE_DIR", str(model_cache))


@pytest.fixture(scope="session")
def source(model_cache: Path) -> Path:
    return tiny_model("llama", seed=3, layers=3, cache_dir=model_cache)


def pack(nibbles: np.ndarray) -> np.ndarray:
    """(..., 8) codes 0..15 -> (...,) int32, code k in bits 4k..4k+3."""
    words = np.zeros(nibbles.shape[:-1], dtype=np.uint32)
    for k in range(8):
        words |= nibbles[..., k].astype(np.uint32) << np.uint32(4 * k)
    return np.ascontiguousarray(words.view(np.int32))


def quantise(w: np.ndarray, symmetric: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """w (out, in) -> codes q (in, out), zeros z (groups, out), scales s (groups, out) fp16 with
    w[o, i] ~ (q[i, o] - z[g, o]) * s[g, o], g = i // GROUP."""
    wt = w.T.reshape(-1, GROUP, w.shape[0])  # (groups, GROUP, out)
    lo, hi = wt.min(1), wt.max(1)
    if symmetric:  # GPTQ sym: zero point 8
        s = np.maximum(np.abs(lo), np.abs(hi)) / 7.5
        z = np.full(s.shape, 8)
    else:
        s = (hi - lo) / 15
        z = np.clip(np.round(-lo / s), 0, 15)
    s = s.astype(np.float16)
    q = np.clip(np.round(wt / s.astype(np.float32)[:, None]) + z[:, None], 0, 15)
    return q.reshape(-1, w.shape[0]).astype(np.int64), z.astype(np.int64), s


def write_quantised(src: Path, dest: Path, method: str) -> None:
    """The tiny model's decoder Linears in `method`'s layout ("awq" or "gptq", with a shuffled
    act-order g_idx), the rest as it is."""
    shutil.copytree(src, dest)
    state = load_file(str(src / "model.safetensors"))
    out = {}
    rng = np.random.default_rng(0)
    for name, t in state.items():
        module = name.rpartition(".")[0]
        if not (module.split(".")[-1] in LINEARS and name.endswith(".weight")):
            out[name] = t
            continue
        w = t.float().numpy()
        n_out, n_in = w.shape
        if method == "gptq":  # act order: input channels visit the groups in a shuffled order
            g_idx = rng.permutation(n_in) // GROUP
            order = np.argsort(g_idx, kind="stable")
            q_sorted, z, s = quantise(w[:, order], symmetric=True)
            q = np.empty_like(q_sorted)
            q[order] = q_sorted
            out[module + ".qweight"] = torch.from_numpy(pack(q.reshape(n_in // 8, 8, n_out).transpose(0, 2, 1)))
            out[module + ".qzeros"] = torch.from_numpy(pack((z - 1).reshape(-1, n_out // 8, 8) & 15))
            out[module + ".g_idx"] = torch.from_numpy(g_idx.astype(np.int32))
        else:
            q, z, s = quantise(w, symmetric=False)
            inv = [AWQ_ORDER[k] for k in range(8)]
            out[module + ".qweight"] = torch.from_numpy(pack(q.reshape(n_in, n_out // 8, 8)[..., inv]))
            out[module + ".qzeros"] = torch.from_numpy(pack(z.reshape(-1, n_out // 8, 8)[..., inv]))
        out[module + ".scales"] = torch.from_numpy(np.ascontiguousarray(s))
    save_file(out, str(dest / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = (
        {"quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": True, "sym": True,
         "checkpoint_format": "gptq"} if method == "gptq" else
        {"quant_method": "awq", "bits": 4, "group_size": GROUP, "zero_point": True, "version": "gemm"})
    (dest / "config.json").write_text(json.dumps(config))


def reference_weight(tensors: dict[str, torch.Tensor], module: str, method: str) -> torch.Tensor:
    """De-quantise one Linear element by element, straight from the format's description."""
    qweight = tensors[module + ".qweight"].numpy().view(np.uint32)
    qzeros = tensors[module + ".qzeros"].numpy().view(np.uint32)
    scales = tensors[module + ".scales"].float().numpy()
    n_out = scales.shape[1]
    n_in = qweight.shape[0] * 8 if method == "gptq" else qweight.shape[0]

    def nibble(word: int, k: int) -> int:
        return (int(word) >> (4 * k)) & 0xF

    w = np.zeros((n_out, n_in), dtype=np.float32)
    for i in range(n_in):
        for o in range(n_out):
            if method == "gptq":
                g = int(tensors[module + ".g_idx"][i])
                q = nibble(qweight[i // 8, o], i % 8)
                z = nibble(qzeros[g, o // 8], o % 8) + 1  # stored minus one
            else:
                g = i // GROUP
                k = AWQ_ORDER.index(o % 8)
                q = nibble(qweight[i, o // 8], k)
                z = nibble(qzeros[g, o // 8], k)
            w[o, i] = (q - z) * scales[g, o]
    return torch.from_numpy(w)


def reference_logits(folder: Path, src: Path, ids: torch.Tensor, method: str) -> torch.Tensor:
    tensors = load_file(str(folder / "model.safetensors"))
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            module = name.rpartition(".")[0]
            if module + ".qweight" in tensors:
                p.copy_(reference_weight(tensors, module, method))
            elif module + ".weight_scale" in tensors or module + ".weight_scale_inv" in tensors:
                p.copy_(reference_fp8(tensors, name))
        return model(ids[None]).logits[0]


def our_logits(folder: Path, ids: torch.Tensor, **kw: object) -> tuple[torch.Tensor, object]:
    m = load_model(folder, **kw)  # type: ignore[arg-type]
    cache = m.model.new_cache(64)
    return m.model.logits(m.model.forward(ids, torch.arange(len(ids)), cache, None)), m.model.placement


IDS = torch.tensor([5, 17, 101, 42, 7, 250, 33, 64, 12])


@pytest.mark.parametrize("method", ["awq", "gptq"])
def test_int4_checkpoints_stay_packed_and_match_the_reference(method: str, source: Path, tmp_path: Path) -> None:
    folder = tmp_path / method
    write_quantised(source, folder, method)
    ref = reference_logits(folder, source, IDS, method)
    dense = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    with torch.no_grad():
        assert not torch.allclose(dense(IDS[None]).logits[0], ref, atol=1e-3)  # quantisation shows
    places = (dict(offload="none"), dict(offload="none", ram_limit_bytes=0), dict(offload="all"),
              dict(offload="all", ram_limit_bytes=0))
    for kw in places:
        ours, placement = our_logits(folder, IDS, **kw)
        # a CPU with the RAM de-quantises the layers once, at load; else they stay packed
        assert placement.quant == method  # type: ignore[attr-defined]
        assert placement.resident_form == ("dequantised" if kw == dict(offload="none") else "")  # type: ignore[attr-defined]
        assert (ours - ref).abs().max() <= 1e-3 * ref.abs().max(), kw


def write_fp8(src: Path, dest: Path, blockwise: bool) -> None:
    """Decoder Linears as FP8 E4M3 with a per-channel `weight_scale`, or per 32x32 block
    `weight_scale_inv` (DeepSeek's layout); E5M2 for the MLP's down projection."""
    shutil.copytree(src, dest)
    state = load_file(str(src / "model.safetensors"))
    out = {}
    for name, t in state.items():
        module = name.rpartition(".")[0]
        if not (module.split(".")[-1] in LINEARS and name.endswith(".weight")):
            out[name] = t
            continue
        fp8 = torch.float8_e5m2 if "down_proj" in name else torch.float8_e4m3fn
        w = t.float()
        if blockwise:
            blocks = w.reshape(w.shape[0] // 32, 32, w.shape[1] // 32, 32)
            scale = blocks.abs().amax(dim=(1, 3)) / 200  # (rows/32, cols/32)
            q = (blocks / scale[:, None, :, None]).reshape(w.shape).to(fp8)
            out[name], out[name + "_scale_inv"] = q, scale
        else:
            scale = w.abs().amax(dim=1, keepdim=True) / 200  # (rows, 1)
            out[name], out[name + "_scale"] = (w / scale).to(fp8), scale
    save_file(out, str(dest / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [32, 32] if blockwise else None}
    (dest / "config.json").write_text(json.dumps(config))


def reference_fp8(tensors: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    w = tensors[name].float()
    if name + "_scale" in tensors:
        return w * tensors[name + "_scale"]
    scale = tensors[name + "_scale_inv"]
    out = torch.empty_like(w)
    for r in range(w.shape[0]):
        for c in range(0, w.shape[1], 32):
            out[r, c:c + 32] = w[r, c:c + 32] * scale[r // 32, c // 32]
    return out


@pytest.mark.parametrize("blockwise", [False, True], ids=["per-channel", "per-block"])
def test_fp8_checkpoints_load_de_quantised(blockwise: bool, source: Path, tmp_path: Path) -> None:
    folder = tmp_path / "fp8"
    write_fp8(source, folder, blockwise)
    ref = reference_logits(folder, source, IDS, "fp8")
    for kw in (dict(offload="none"), dict(offload="all")):
        ours, _ = our_logits(folder, IDS, **kw)
        assert (ours - ref).abs().max() <= 1e-3 * ref.abs().max()


def test_unknown_formats_are_refused_by_name_not_as_corrupt(source: Path, tmp_path: Path) -> None:
    folder = tmp_path / "exl2"
    shutil.copytree(source, folder)
    config = json.loads((folder / "config.json").read_text())
    for qc, named in (({"quant_method": "exl2", "bits": 4}, "exl2"),
                      ({"quant_method": "bitsandbytes", "load_in_8bit": True}, "8-bit bitsandbytes"),
                      ({"quant_method": "awq", "bits": 4, "version": "gemv"}, "AWQ 4-bit gemv")):
        (folder / "config.json").write_text(json.dumps({**config, "quantization_config": qc}))
        with pytest.raises(UnsupportedModel) as err:
            load_model(folder)
        assert named in err.value.user_message and "corrupt" not in err.value.user_message

    dtype_folder = tmp_path / "e8m0"
    shutil.copytree(source, dtype_folder)
    raw = (dtype_folder / "model.safetensors").read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    name = next(k for k in header if k.endswith("up_proj.weight"))
    header[name]["dtype"] = "F8_E8M0"  # a dtype safetensors knows and SpecChat does not load
    text = json.dumps(header).encode()
    (dtype_folder / "model.safetensors").write_bytes(len(text).to_bytes(8, "little") + text + raw[8 + n:])
    with pytest.raises(UnsupportedModel) as err:
        load_model(dtype_folder)
    assert "F8_E8M0" in err.value.user_message and "corrupt" not in err.value.user_message
