"""The drafts a model brings, and the one SpecChat makes, on a CUDA GPU: MTP/NextN heads (Qwen3.5,
Qwen3-Next, GLM-4.5), a Gemma 4 assistant, an EAGLE-3 head, and a low-bit self-draft of a target whose layers all
stream from pinned RAM each decode on the device exactly what transformers' `generate` gives on the
same device. Their CPU twins are test_heads.py, test_assistant.py, test_eagle.py and
test_self_draft.py; these
run where a GPU is (`python scripts/gpu_proof.py`)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from eagle_checkpoints import write_eagle
from head_checkpoints import tiny_with_head
from test_assistant import write_assistant
from transformers import AutoModelForCausalLM

from engine.decoding.drafting import copy_of_target
from engine.decoding.generation import Engine
from engine.loading.load import LoadedModel, load_model
from engine.loading.self_draft import build_self_draft
from engine.model.eagle import load_eagle
from engine.model.heads import find_heads, load_head
from engine.testing.synthetic import tiny_model
from engine.types import Completion, GenerationRequest, SpeculationSettings

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
PROMPT = "Speculative decoding lets a small draft model propose tokens that a large target model verifies."
NEW = 16


def run(engine: Engine, **spec: object) -> Completion:
    request = GenerationRequest(raw_prompt=PROMPT, max_new_tokens=NEW, speculation=SpeculationSettings(**spec))  # type: ignore[arg-type]
    final = list(engine.generate(request))[-1]
    assert isinstance(final, Completion)
    return final


def reference(folder: Path, target: LoadedModel) -> list[int]:
    """transformers' greedy continuation of PROMPT, on the GPU."""
    ids = target.tokenizer(PROMPT)["input_ids"]
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).to("cuda").eval()
    x = torch.tensor([ids], device="cuda")
    out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=NEW, do_sample=False,
                         pad_token_id=getattr(target.tokenizer, "pad_token_id", None))
    return out[0, len(ids):].tolist()


def assert_drafts_as_transformers(folder: Path, target: LoadedModel, draft: object) -> None:
    ref = reference(folder, target)
    for budget in (8, 32):
        got = run(Engine(target.model, target.tokenizer, draft), budget=budget)  # type: ignore[arg-type]
        assert list(got.token_ids) == ref[: len(got.token_ids)] and len(got.token_ids) == len(ref), budget
        assert got.stats.draft_passes > 0


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("arch", ["qwen3_next", "qwen3_5_text", "glm4_moe"])
def test_an_mtp_head_drafts_on_the_gpu_as_transformers_decodes(arch: str, model_cache: Path) -> None:
    folder = tiny_with_head(arch, model_cache)
    target = load_model(folder, "cuda")
    [spec] = find_heads(folder, target.model.config)
    head = load_head(folder, target.model, spec)
    assert_drafts_as_transformers(folder, target, head)


@pytest.mark.gpu
@cuda
def test_an_assistant_drafts_on_the_gpu_as_transformers_decodes(model_cache: Path, tmp_path: Path) -> None:
    folder = tmp_path / "target"
    shutil.copytree(tiny_model("gemma4_text", seed=0, layers=4, cache_dir=model_cache), folder)
    write_assistant(tmp_path / "target-assistant", folder)
    target = load_model(folder, "cuda")
    [spec] = find_heads(folder, target.model.config)
    assert_drafts_as_transformers(folder, target, load_head(folder, target.model, spec))


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("offload", ["none", "all"])
def test_an_eagle_head_drafts_on_the_gpu_as_transformers_decodes(offload: str, model_cache: Path,
                                                                 tmp_path: Path) -> None:
    """The target keeps its inputs of three layers on the GPU, resident or streamed from pinned RAM."""
    folder = tmp_path / "target"
    shutil.copytree(tiny_model("llama", seed=0, layers=6, cache_dir=model_cache), folder)
    head = write_eagle(tmp_path / "target-eagle3", folder, aux=[1, 3, 5], draft_vocab=60)
    target = load_model(folder, "cuda", offload=offload)
    assert_drafts_as_transformers(folder, target, load_eagle(head, target.model))


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("bits", [4, 2])
def test_a_self_draft_in_vram_drafts_as_transformers_decodes(bits: int, tiny_target_path: Path) -> None:
    """Every layer of the target streams from pinned RAM; the self-draft's low-bit substitutes of
    them sit on the GPU and read the target's K/V there."""
    streamed = load_model(tiny_target_path, "cuda", offload="all")
    draft = build_self_draft(streamed.model, bits, cache_dir=None)
    assert copy_of_target(streamed.model, draft)
    assert draft.self_draft.substituted == 2 and draft.streamer is not None  # type: ignore[attr-defined]
    assert all(h.packed.device.type == "cuda" for h in draft.streamer.homes if h.packed is not None)
    assert_drafts_as_transformers(tiny_target_path, streamed, draft)
