"""Each catalog entry against what it states and against what the engine runs.

Every entry names its size, licence, files, model_type and the pages its facts were read from.
An entry is marked "cannot run yet" (`unsupported`) exactly when the engine's own checks refuse
a checkpoint like it: engine.loading.load.check_folder on a config.json of the entry's
model_type and weight format (a vision-language wrapper is given its text model, as the hub's
configs are), or, for a GGUF, the architectures the GGUF loader runs. So when the engine learns
a format (MXFP4 experts, Gemma 4) the mark fails here until the catalog says so too. An
EAGLE-3 head (role "head") is held to engine.model.eagle_spec: a config.json of its shape, read
against each target it is declared for, must fit that target.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from engine.errors import UnsupportedModel
from engine.loading.load import check_folder
from engine.model.eagle_spec import eagle_spec
from engine.model.family import FAMILIES
from engine.store import load_catalog
from engine.store.catalog import DEFAULT_CATALOG_PATH, CatalogModel
from engine.store.gguf_archs import RUNNABLE

CATALOG = load_catalog()
RAW = {m["id"]: m for m in json.loads(DEFAULT_CATALOG_PATH.read_text())["models"]}
# The GGUF architectures engine.loading.gguf runs (llama.cpp's names, as its refusal gives them):
# a GGUF entry of another architecture (gpt-oss, glm4moe, qwen35, gemma4...) must be marked.
GGUF_ARCHITECTURES = RUNNABLE
# config.json's quantization_config for each weight format (dtype) a Hugging Face entry names
QUANTISATION: dict[str, dict[str, Any] | None] = {
    "bfloat16": None,
    "float16": None,
    "awq-int4": {"quant_method": "awq", "bits": 4, "version": "gemm", "group_size": 128},
    "gptq-int4": {"quant_method": "gptq", "bits": 4},
    "bnb-nf4": {"quant_method": "bitsandbytes", "load_in_4bit": True},
    "fp8": {"quant_method": "fp8", "weight_block_size": [128, 128]},
    "mxfp4": {"quant_method": "mxfp4"},  # gpt-oss's experts
}


def head_refusal(model: CatalogModel, folder: Path) -> str | None:
    """Why engine.model.eagle_spec would refuse a head of `model`'s config beside each target it
    is declared for (its problem), None if it takes it; weights are not written, so a head that
    fits stops at the missing .safetensors, after every config check."""
    folder.mkdir()
    config = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": model.model_type, "num_hidden_layers": 1,
              "hidden_size": model.hidden_size, "intermediate_size": model.intermediate_size,
              "num_attention_heads": model.num_attention_heads, "num_key_value_heads": model.num_kv_heads,
              "head_dim": model.head_dim, "vocab_size": model.vocab_rows, "draft_vocab_size": model.draft_vocab_size}
    (folder / "config.json").write_text(json.dumps(config))
    for target_id in model.head_for:
        target = CATALOG.find(target_id)
        assert target is not None and target.hidden_size is not None
        spec = eagle_spec(folder, SimpleNamespace(hidden_size=target.hidden_size, vocab_size=target.vocab_rows,
                                                  num_hidden_layers=target.layers))
        assert spec is not None
        if not spec.problem.startswith("it has no .safetensors file"):
            return f"for {target_id}: {spec.problem}"
    return None


def engine_refusal(model: CatalogModel, folder: Path) -> str | None:
    """Why the engine would refuse a checkpoint like `model` (its user message), None if it takes it."""
    if model.is_head:
        return head_refusal(model, folder)
    if model.gguf_file:
        return None if model.model_type in GGUF_ARCHITECTURES else f"a '{model.model_type}' GGUF"
    config: dict[str, Any] = {"model_type": model.model_type, "num_hidden_layers": model.layers,
                              "vocab_size": model.vocab_rows}
    if model.model_type not in FAMILIES:  # a wrapper (or another family): its text model as the hub writes it
        config["text_config"] = {"num_hidden_layers": model.layers, "vocab_size": model.vocab_rows}
    if QUANTISATION[model.dtype] is not None:
        config["quantization_config"] = QUANTISATION[model.dtype]
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "model.safetensors").write_bytes(b"")  # the check looks for weights, it does not read them
    try:
        check_folder(folder)
    except UnsupportedModel as exc:
        return exc.user_message
    return None


@pytest.mark.parametrize("model", CATALOG.models, ids=lambda m: m.id)
def test_each_entry_states_its_size_licence_files_and_sources(model: CatalogModel) -> None:
    assert model.download_bytes > 0 and model.parameters > 0 and model.layers > 0 and model.vocab_rows > 0
    assert model.shards >= 1 and model.license.strip() and model.model_type.strip()
    assert model.files and all(f.strip() for f in model.files)
    assert any(f.endswith((".safetensors", ".gguf")) for f in model.files)  # it names its weights
    assert model.memory and all(0 < m.vram_min_gb <= m.vram_full_gb and m.ram_gb > 0 for m in model.memory)
    checked = RAW[model.id]["checked"]
    assert "huggingface.co" in checked["source"] and checked["facts"].strip()
    if not model.gguf_file and model.prequantised is None and model.dtype == "bfloat16":
        assert model.download_bytes == pytest.approx(2 * model.parameters, rel=0.06)  # 16-bit weights


@pytest.mark.parametrize("model", CATALOG.models, ids=lambda m: m.id)
def test_an_entry_is_marked_unrunnable_exactly_when_the_engine_refuses_it(model: CatalogModel, tmp_path: Path) -> None:
    refusal = engine_refusal(model, tmp_path / model.id)
    if model.runnable:
        assert refusal is None, f"{model.id} is marked runnable but the engine refuses it: {refusal}"
    else:
        assert refusal is not None, f"{model.id} is marked '{model.unsupported}' but the engine now takes it"


def test_a_target_is_offered_in_a_pair_exactly_when_specchat_runs_it() -> None:
    """The app lists pairs: every target it runs is in one (draft-free when no small model of
    its tokenizer was confirmed: none with its rows and chat template; Qwen3's 151936 rows are
    Qwen2.5's, but not its template and thinking tokens), and none it cannot run is."""
    for model in CATALOG.models:
        offered = any(model.id in (p.target, p.draft) for p in CATALOG.pairs)
        assert offered == model.runnable if model.role == "target" else model.runnable or not offered, model.id
    for pair in CATALOG.pairs:
        if pair.draft_free:
            target = CATALOG.find(pair.target)
            assert target is not None
            assert not any(m.role == "draft" and m.vocab_rows == target.vocab_rows and m.template == target.template
                           for m in CATALOG.models)


@pytest.mark.parametrize(("model_id", "repo_id", "model_type", "label", "pair_id"), [
    ("gpt-oss-20b", "openai/gpt-oss-20b", "gpt_oss", "MXFP4", "gpt-oss-20b-draft-free"),
    ("gpt-oss-120b", "openai/gpt-oss-120b", "gpt_oss", "MXFP4", "gpt-oss-120b-draft-free"),
    ("qwen3.6-27b", "Qwen/Qwen3.6-27B", "qwen3_5", "BF16", "qwen3.6-27b-draft-free"),
])
def test_the_current_models_are_there_as_published(model_id: str, repo_id: str, model_type: str, label: str,
                                                   pair_id: str) -> None:
    """gpt-oss as OpenAI ships it (MXFP4 experts, de-quantised as they load); Qwen3.6 as its
    image-text release (the text model runs, the vision tower is skipped). Neither family has a
    confirmed small model of its tokenizer, so each is draft-free."""
    entry = CATALOG.find(repo_id)
    assert entry is not None and entry.id == model_id
    assert (entry.model_type, entry.format_label) == (model_type, label)
    assert entry.license == "apache-2.0" and not entry.gated
    assert RAW[model_id]["checked"]["on"] == "2026-11-26"
    pair = CATALOG.pair(pair_id)
    assert pair is not None and pair.target == model_id and pair.draft_free


@pytest.mark.parametrize(("model_id", "repo_id", "model_type", "file", "size"), [
    ("qwen3-30b-a3b-q4_k_m", "Qwen/Qwen3-30B-A3B-GGUF", "qwen3moe", "Qwen3-30B-A3B-Q4_K_M.gguf", 18_556_685_824),
    ("qwen3.6-35b-a3b-q4_k_m", "unsloth/Qwen3.6-35B-A3B-GGUF", "qwen35moe", "Qwen3.6-35B-A3B-UD-Q4_K_M.gguf",
     22_134_528_992),
])
def test_the_moe_ggufs_are_there_priced_by_their_experts(model_id: str, repo_id: str, model_type: str, file: str,
                                                        size: int) -> None:
    """The MoE GGUFs users run on one GPU (issue 31's two models) are offered, draft-free; their
    shape carries the experts, so the planner prices a token at its active size: about a tenth of
    the stored weights read per token, not all of them."""
    entry = CATALOG.find(repo_id)
    assert entry is not None and entry.id == model_id and entry.runnable
    assert (entry.model_type, entry.gguf_file, entry.download_bytes) == (model_type, file, size)
    assert entry.format_label.startswith("GGUF") and entry.license == "apache-2.0" and not entry.gated
    shape = entry.shape()
    assert shape.experts is not None and shape.experts.top_k == 8
    assert shape.params == pytest.approx(entry.parameters, rel=0.03)
    active = shape.num_layers * shape.active_params + 2 * shape.head_params  # the "A3B": ~3B a token
    assert 2.5e9 < active < 4e9 and active / shape.params < 0.12
    pair = next(p for p in CATALOG.pairs if p.target == model_id)
    assert pair.draft_free


def test_each_head_is_offered_with_the_targets_it_was_trained_for() -> None:
    """An EAGLE-3 head's pairs are exactly its declared targets, its facts say what was not read
    from the hub, and its id keeps its folder where the engine looks for heads."""
    heads = [m for m in CATALOG.models if m.is_head]
    assert [h.id for h in heads] == ["llama-3.3-70b-instruct-eagle3"]
    for head in heads:
        assert "eagle" in head.id and head.layers == 1 and head.draft_vocab_size
        assert {p.target for p in CATALOG.pairs if p.draft == head.id} == set(head.head_for)
        assert "NOT checked" in RAW[head.id]["checked"]["facts"] and RAW[head.id]["checked"]["estimated"]
        for target in head.head_for:
            pair = CATALOG.draft_pair(target)
            assert pair is None or pair.draft != head.id  # never loaded as a draft model


def test_the_2024_pairs_stay() -> None:
    assert {p.id for p in CATALOG.pairs} >= {
        "smollm2-1.7b+135m", "llama-3.3-70b+1b", "llama-3.3-70b-4bit+1b", "llama-3.3-70b-q4_k_m+1b",
        "llama-3.1-70b+1b", "llama-3.1-70b-awq+1b", "qwen2.5-72b+0.5b", "qwen2.5-72b-4bit+0.5b",
        "qwen2.5-72b-awq+0.5b", "qwen2.5-32b+0.5b"}
