"""Sampling is lossless: SpecExec's first- and second-token frequencies against the target's
exact probabilities, computed independently with the Hugging Face model and its own warpers.

The close draft (a perturbed copy of the target) makes the acceptance walk descend through
the tree often, so both tokens are usually decided inside one tree; a chi-square test on
thousands of seeds would catch a sampler biased towards the draft. A power check shows the
same test rejects a distribution only mildly off (the target at 1.25x the temperature).
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from chi_square import chisquare_pvalue
from transformers.generation.logits_process import (
    TemperatureLogitsWarper,
    TopPLogitsWarper,
)

from engine.decoding.context import ContextIndex, Continuation
from engine.decoding.generation import Engine
from engine.types import (
    Completion,
    GenerationRequest,
    SamplingSettings,
    SpeculationSettings,
)

N_SAMPLES = 2000
PROMPT = "Once upon a time there was"


def exact_distributions(engine: Engine, prompt: list[int], temperature: float, top_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(V,) first-token and (V,) second-token marginal probabilities of the target."""
    model = engine.target.hf_model

    def processed(logits: torch.Tensor) -> torch.Tensor:
        x = TemperatureLogitsWarper(temperature)(None, logits.float())
        if top_p < 1.0:
            x = TopPLogitsWarper(top_p)(None, x)
        return torch.softmax(x, dim=-1)

    with torch.inference_mode():
        p1 = processed(model(torch.tensor([prompt])).logits[:, -1])[0]  # (V,)
        firsts = p1.nonzero()[:, 0]
        batch = torch.tensor(prompt)[None].expand(firsts.shape[0], -1)
        batch = torch.cat([batch, firsts[:, None]], dim=1)  # (K, P+1)
        p2_given = processed(model(batch).logits[:, -1])  # (K, V)
    # the second token exists only when the first is not EOS
    weight = p1[firsts].double() * torch.tensor([int(t) not in engine.eos_ids for t in firsts]).double()
    p2 = (weight[:, None] * p2_given.double()).sum(0)
    return p1.double(), p2 / p2.sum()


def chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    counts, probs = counts.double(), probs.double()
    n = counts.sum()
    expected = probs * n
    big = expected >= 5
    obs = torch.cat([counts[big], counts[~big].sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    if exp[-1] < 1e-9:  # nothing in the tail: drop the empty bin
        obs, exp = obs[:-1], exp[:-1]
    exp = exp * obs.sum() / exp.sum()
    return chisquare_pvalue(obs, exp)


def sample_two_tokens(engine: Engine, temperature: float, top_p: float, vocab: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Counts of the first and second sampled token over N_SAMPLES seeds, and the target passes."""
    c1, c2 = torch.zeros(vocab), torch.zeros(vocab)
    passes = 0
    for seed in range(N_SAMPLES):
        req = GenerationRequest(raw_prompt=PROMPT, max_new_tokens=2,
                                sampling=SamplingSettings(temperature=temperature, top_p=top_p, seed=seed),
                                speculation=SpeculationSettings(budget=8, max_depth=2))
        final = list(engine.generate(req))[-1]
        assert isinstance(final, Completion)
        ids = final.token_ids
        c1[ids[0]] += 1
        if len(ids) > 1:  # the first token may be EOS
            c2[ids[1]] += 1
        passes += final.stats.target_passes
    return c1, c2, passes


@pytest.mark.parametrize(("temperature", "top_p"), [(1.0, 1.0), (0.6, 0.9)])
def test_first_and_second_token_distributions(close_engine: Engine, temperature: float, top_p: float) -> None:
    prompt = close_engine.tokenizer(PROMPT)["input_ids"]
    p1, p2 = exact_distributions(close_engine, prompt, temperature, top_p)
    c1, c2, passes = sample_two_tokens(close_engine, temperature, top_p, p1.shape[0])
    assert passes < 1.8 * N_SAMPLES, "most samples should take both tokens from one tree pass"
    assert chi2_pvalue(c1, p1) > 1e-3
    assert c2.sum() > 0.9 * N_SAMPLES
    assert chi2_pvalue(c2, p2) > 1e-3
    # power: the same data must reject the target at a mildly wrong temperature
    q1, _ = exact_distributions(close_engine, prompt, temperature * 1.25, top_p)
    assert chi2_pvalue(c1, q1) < 1e-3


@pytest.mark.parametrize("with_draft", [True, False], ids=["draft+context", "context-only"])
def test_distributions_with_context_candidates_in_the_tree(close_engine: Engine, with_draft: bool,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Context candidates enter every tree: the target's likeliest first tokens, each followed by
    its likeliest second token (as text that repeats would propose them), so the walk descends
    through candidate nodes, shared with the draft's branches when there is a draft."""
    temperature, top_p = 0.8, 0.95
    engine = close_engine if with_draft else Engine(close_engine.target, close_engine.tokenizer, None)
    prompt = engine.tokenizer(PROMPT)["input_ids"]
    p1, p2 = exact_distributions(engine, prompt, temperature, top_p)
    model = engine.target.hf_model
    with torch.inference_mode():
        firsts = torch.topk(p1, 4).indices
        seconds = model(torch.cat([torch.tensor(prompt)[None].expand(4, -1), firsts[:, None]], 1)).logits[:, -1].argmax(-1)
    candidates = [Continuation((int(a), int(b)), 8) for a, b in zip(firsts, seconds)]
    monkeypatch.setattr(ContextIndex, "continuations", lambda self, depth, count: candidates[:count])
    if not with_draft:  # every candidate verified: the draft-free cut by measured pass times is not under test
        monkeypatch.setattr(engine.costs, "best_size", lambda gains, tokens: len(gains))
    c1, c2, passes = sample_two_tokens(engine, temperature, top_p, p1.shape[0])
    assert passes < 1.9 * N_SAMPLES, "samples should often take both tokens from one tree pass"
    assert chi2_pvalue(c1, p1) > 1e-3
    assert c2.sum() > 0.9 * N_SAMPLES
    assert chi2_pvalue(c2, p2) > 1e-3


def test_an_moe_with_packed_experts_samples_the_target_distribution(model_cache: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 31's sampling check: a Qwen3-MoE GGUF whose routed experts run packed on the CPU
    (engine.kernels.experts), drafted by a noisy copy of itself; first- and second-token
    frequencies against the exact probabilities of transformers' own reading of the same file."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from engine.kernels import build
    from engine.kernels.experts import PackedExperts
    from engine.loading.gguf import isolated
    from engine.loading.load import load_model
    from engine.store.gguf_header import read_header
    from engine.testing.synthetic import tiny_gguf

    if build.kernels() is None:
        pytest.skip("no C compiler here")
    monkeypatch.setenv("SPECCHAT_CACHE_DIR", str(model_cache))
    types = ("Q8_0", "Q4_K/Q6_K", "Q4_0")
    path = tiny_gguf("qwen3_moe", layers=3, layer_types=types, cache_dir=model_cache)
    target = load_model(path)
    draft = load_model(tiny_gguf("qwen3_moe", noise=0.05, layers=3, layer_types=types, cache_dir=model_cache))
    assert any(isinstance(m, PackedExperts) for m in target.model.hf_model.modules())
    engine = Engine(target.model, target.tokenizer, draft.model)
    with isolated(path) as src:
        config = AutoConfig.from_pretrained(src.parent, gguf_file=src.name)
        config.moe_intermediate_size = read_header(path).metadata["qwen3moe.expert_feed_forward_length"]
        ref = AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name, config=config,
                                                   dtype=torch.float32).eval()
    reference = SimpleNamespace(target=SimpleNamespace(hf_model=ref), eos_ids=engine.eos_ids)
    prompt = engine.tokenizer(PROMPT)["input_ids"]
    p1, p2 = exact_distributions(reference, prompt, 1.0, 1.0)  # type: ignore[arg-type]
    c1, c2, passes = sample_two_tokens(engine, 1.0, 1.0, p1.shape[0])
    assert passes < 1.8 * N_SAMPLES, "most samples should take both tokens from one tree pass"
    assert chi2_pvalue(c1, p1) > 1e-3 and c2.sum() > 0.9 * N_SAMPLES and chi2_pvalue(c2, p2) > 1e-3
    q1, _ = exact_distributions(reference, prompt, 1.25, 1.0)  # type: ignore[arg-type]
    assert chi2_pvalue(c1, q1) < 1e-3
