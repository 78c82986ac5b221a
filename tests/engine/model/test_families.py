"""The families of 2025-26 (sliding windows, sinks, routed and shared experts) verified as trees:
each tiny random model, built from transformers' own config class, decodes exactly what plain
transformers decoding of the same folder gives, in every mode the engine has. The reference is
`AutoModelForCausalLM.from_pretrained` + `generate`: transformers' own loading (its expert
fusing included), masks and caches, none of ours."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from chi_square import chisquare_pvalue
from transformers import AutoModelForCausalLM

from engine.decoding.context import ContextIndex, Continuation
from engine.decoding.costs import PassCosts
from engine.decoding.generation import Engine
from engine.errors import UnsupportedModel
from engine.loading.load import LoadedModel, load_model
from engine.model.family import LayerKind, describe_kinds, layer_kinds
from engine.testing.synthetic import TINY_FAMILIES, TINY_WINDOW, tiny_model
from engine.types import Completion, GenerationRequest, SamplingSettings, SpeculationSettings

FAMILIES = sorted(TINY_FAMILIES)
LAYERS = 4
PROMPT = ("Speculative decoding lets a small draft model propose tokens that a large target model verifies. "
          "def add(a, b):")
NEW = 24


@pytest.fixture(scope="module", params=FAMILIES)
def family(request: pytest.FixtureRequest, model_cache: Path) -> tuple[str, Path, Path]:
    arch = request.param
    return (arch, tiny_model(arch, seed=0, layers=LAYERS, cache_dir=model_cache),
            tiny_model(arch, seed=0, noise=0.05, layers=LAYERS, cache_dir=model_cache))


def run(engine: Engine, **spec: object) -> tuple[list[int], Completion]:
    req = GenerationRequest(raw_prompt=PROMPT, max_new_tokens=NEW, speculation=SpeculationSettings(**spec))  # type: ignore[arg-type]
    final = list(engine.generate(req))[-1]
    assert isinstance(final, Completion)
    return engine.encode(req), final


def reference(path: Path, ids: list[int], pad: int | None, device: str = "cpu") -> list[int]:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device).eval()
    x = torch.tensor([ids], device=device)
    out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=NEW, do_sample=False, pad_token_id=pad)
    return out[0, len(ids):].tolist()


def candidates_from(text: list[int], monkeypatch: pytest.MonkeyPatch) -> None:
    """Draft-free trees that are really verified: every 4-gram of `text` (the reference
    continuation) enters each tree as a context candidate, and none is cut for cost, so the
    tree holds the right continuation and many wrong ones."""
    grams = list(dict.fromkeys(tuple(text[i : i + 4]) for i in range(len(text) - 3)))[:16]
    monkeypatch.setattr(ContextIndex, "continuations",
                        lambda self, depth, count: [Continuation(g, 4) for g in grams[:count]])
    monkeypatch.setattr(PassCosts, "best_size", lambda self, gains, overhead=1: len(gains))


def test_greedy_text_equals_transformers_in_every_mode(family: tuple[str, Path, Path],
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    assert_every_mode(*family, "cpu", monkeypatch)


def assert_every_mode(arch: str, target_path: Path, draft_path: Path, device: str,
                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Plain, draft-free trees, a noisy-copy draft and every layer streamed, on `device`, each
    decode what transformers' `generate` gives on the same device (test_families_gpu.py runs it
    on CUDA)."""
    target, draft = load_model(target_path, device), load_model(draft_path, device)
    streamed = load_model(target_path, device, offload="all")
    assert streamed.model.streamer is not None and not any(h.module for h in streamed.model.streamer.homes)
    ids, plain = run(Engine(target.model, target.tokenizer), mode="autoregressive")
    assert len(ids) > 3 * TINY_WINDOW, "the windows must be shorter than the prompt to be under test"
    ref = reference(target_path, ids, target.tokenizer.pad_token_id, device)
    with monkeypatch.context() as m:
        candidates_from(ref, m)
        free = run(Engine(target.model, target.tokenizer), budget=64, context_candidates=16)[1]
    modes = {
        "plain": plain,
        "draft-free trees": free,
        "noisy-copy draft": run(Engine(target.model, target.tokenizer, draft.model), budget=16, max_depth=6)[1],
        "every layer streamed": run(Engine(streamed.model, streamed.tokenizer, draft.model), budget=16,
                                    max_depth=6)[1],
    }
    for mode, got in modes.items():
        want = ref[: len(got.token_ids)] if got.finish_reason == "eos" else ref
        assert list(got.token_ids) == want, f"{arch} on {device}: {mode} differs from transformers"
    assert modes["noisy-copy draft"].stats.tokens_per_pass > 1.3, "a close draft's trees should be accepted"
    assert free.stats.tokens_per_pass > 2.0, "the right candidate should be accepted deep"


def test_the_families_have_the_kinds_they_claim(model_cache: Path) -> None:
    def kinds(arch: str) -> list[LayerKind]:
        return load_model(tiny_model(arch, seed=0, layers=LAYERS, cache_dir=model_cache)).model.kinds

    gemma = kinds("gemma3_text")
    assert [k.window for k in gemma] == [TINY_WINDOW, None] * 2
    assert all(k.sinks for k in kinds("gpt_oss"))
    glm = kinds("glm4_moe")
    assert [k.ffn for k in glm] == ["dense", "experts", "experts", "experts"] and glm[1].shared_experts
    assert [k.ffn for k in kinds("qwen3_moe")] == ["dense", "experts", "experts", "experts"]
    assert describe_kinds(kinds("mistral")) == f"4 layers: 4 sliding-window attention ({TINY_WINDOW}), dense MLP"
    assert [k.window for k in kinds("gemma4_text")] == [TINY_WINDOW, None] * 2
    assert describe_kinds(kinds("gemma4_text+moe")) == (f"4 layers: 2 sliding-window attention ({TINY_WINDOW}), "
                                                        "routed experts + shared; 2 full attention, routed experts + shared")


@pytest.mark.parametrize("arch", ["qwen3_moe", "glm4_moe"])
def test_nf4_experts_stream_as_they_run_resident(arch: str, model_cache: Path) -> None:
    """Fused expert tensors are NF4 like any Linear weight; dense and expert layers (GLM's first
    layer is dense) stream through templates of their own kind."""
    path = tiny_model(arch, seed=0, layers=LAYERS, cache_dir=model_cache)
    resident, streamed = load_model(path, quant="nf4"), load_model(path, quant="nf4", offload="all")
    dense = load_model(path)

    def logits(m: LoadedModel) -> torch.Tensor:
        ids = torch.tensor(m.tokenizer(PROMPT)["input_ids"])
        cache = m.model.new_cache(len(ids))
        return m.model.logits(m.model.forward(ids, torch.arange(len(ids)), cache, None))

    assert torch.equal(logits(resident), logits(streamed))
    layouts = streamed.model.streamer.layouts  # type: ignore[union-attr]
    experts = [e for e in layouts[1].entries if ".experts." in f".{e.name}" and not e.side]
    assert experts and all(e.kind == "nf4" for e in experts)
    assert layouts[0].entries != layouts[1].entries, "the dense first layer has a layout of its own"
    # the experts as a pass de-quantises them: NF4's error, per expert, not another tensor
    s = streamed.model.streamer
    assert s is not None and s.store is not None and s.homes[1].store_index is not None
    params = s._dense_params[s._kind[1]]
    s._unpack(layouts[1], s.store.source(s.homes[1].store_index), params)  # type: ignore[misc]
    for e in experts:
        got, want = params[e.name], dict(dense.model.layers[1].named_parameters())[e.name]
        per_expert = (got - want).abs().mean(dim=(1, 2)) / want.abs().mean(dim=(1, 2))
        assert bool((per_expert > 0).all()) and bool((per_expert < 0.15).all()), per_expert


def _damaged(model_cache: Path, tmp_path: Path, arch: str, **changes: object) -> Path:
    folder = tmp_path / arch
    shutil.copytree(tiny_model(arch, seed=0, layers=LAYERS, cache_dir=model_cache), folder)
    config = json.loads((folder / "config.json").read_text())
    config.update(changes)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize(("arch", "changes", "message"), [
    ("gemma3_text", {"sliding_window": 0}, "sliding_window is 0"),
    ("mistral", {"sliding_window": -3}, "sliding_window is -3"),
    ("mixtral", {"num_experts_per_tok": 9}, "routes each token to 9 experts but has only 4"),
    ("gpt_oss", {"layer_types": ["full_attention"] * 3}, "layer_types has 3 entries for 4 layers"),
    ("gemma3_text", {"layer_types": ["full_attention", "sliding_attention", "chunked_attention", "full_attention"]},
     "a layer of kind 'chunked_attention'"),
    ("gpt_oss", {"layer_types": ["full_attention", "linear_attention"] * 2}, "a layer of kind 'linear_attention'"),
    ("gemma3_text", {"use_bidirectional_attention": True}, "attends in both directions"),
    ("qwen3_moe", {"num_experts_per_tok": "two"}, "num_experts_per_tok is 'two'"),
    ("gemma4_text+moe", {"top_k_experts": 5}, "routes each token to 5 experts but has only 4"),
    ("gemma4_text", {"num_kv_shared_layers": 4}, "shares the keys and values of its last 4 layers"),
    ("gemma4_text", {"layer_types": ["sliding_attention"] * 3}, "layer_types has 3 entries for 4 layers"),
    ("gemma4_text", {"use_bidirectional_attention": "all"}, "attends in both directions"),
])
def test_damaged_configs_get_one_clear_message(model_cache: Path, tmp_path: Path, arch: str, changes: dict,
                                               message: str) -> None:
    with pytest.raises(UnsupportedModel) as caught:
        load_model(_damaged(model_cache, tmp_path, arch, **changes))
    assert message in caught.value.user_message, caught.value.user_message


def test_an_unknown_family_is_refused_by_name() -> None:
    with pytest.raises(UnsupportedModel, match="'falcon_h1' model; SpecChat runs .*gpt_oss"):
        layer_kinds({"model_type": "falcon_h1", "num_hidden_layers": 2})


def assert_first_token_is_lossless(target_path: Path, draft_path: Path, n: int = 1000) -> None:
    """The first sampled token's frequencies over n seeds (trees of budget 8 from the draft)
    against the target's exact distribution from transformers (chi-square), with a power check:
    the same counts reject the target at temperature 1.5."""
    target = load_model(target_path)
    engine = Engine(target.model, target.tokenizer, load_model(draft_path).model)
    ids = target.tokenizer(PROMPT)["input_ids"]
    hf = AutoModelForCausalLM.from_pretrained(target_path, dtype=torch.float32).eval()
    with torch.inference_mode():
        logits = hf(torch.tensor([ids])).logits[0, -1].double()
    counts, passes = torch.zeros(logits.shape[0]), 0
    for seed in range(n):
        req = GenerationRequest(raw_prompt=PROMPT, max_new_tokens=2, sampling=SamplingSettings(temperature=1.0, seed=seed),
                                speculation=SpeculationSettings(budget=8, max_depth=2))
        final = list(engine.generate(req))[-1]
        assert isinstance(final, Completion)
        counts[final.token_ids[0]] += 1
        passes += final.stats.target_passes
    assert passes < 1.9 * n, "both tokens should often come from one tree"

    def pvalue(probs: torch.Tensor) -> float:
        expected = probs * n
        big = expected >= 5
        obs = torch.cat([counts.double()[big], counts.double()[~big].sum()[None]])
        exp = torch.cat([expected[big], expected[~big].sum()[None]])
        return chisquare_pvalue(obs, exp * obs.sum() / exp.sum())

    assert pvalue(torch.softmax(logits, -1)) > 1e-3
    assert pvalue(torch.softmax(logits / 1.5, -1)) < 1e-3


def test_sampling_from_an_moe_model_with_windows_is_lossless(model_cache: Path) -> None:
    """Mixtral (experts, every layer windowed), a close draft's trees accepted beyond the root."""
    assert_first_token_is_lossless(tiny_model("mixtral", seed=0, layers=LAYERS, cache_dir=model_cache),
                                   tiny_model("mixtral", seed=0, noise=0.05, layers=LAYERS, cache_dir=model_cache))
