"""Draft heads from the checkpoint (MTP / NextN) as the engine's draft: found by name and shape
in the safetensors headers, loaded onto the target, and decoding exactly what the target alone
decodes. Tiny random targets of each family that carries a head, with a random head written
into model.safetensors under the real names (head_checkpoints.py).

What makes a head a head is that it drafts from the target's hidden states: checked against a
from-scratch recomputation (transformers' hidden states of the text, the head's formula over
them, no cache, no waves, the references' positions), so a head that read anything else (its
own guesses for committed tokens, zeros, a shifted position) fails."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from bigram_sampling import sampled_like_the_target
from head_checkpoints import tiny_with_head, with_head
from transformers import AutoModelForCausalLM

from engine.decoding import costs
from engine.decoding.generation import Engine
from engine.decoding.pair import cache_files
from engine.errors import UnsupportedModel
from engine.loading.load import LoadedModel, load_model
from engine.model.head_draft import HeadCache, HeadDraft
from engine.model.heads import find_heads, load_head
from engine.testing.synthetic import tiny_model
from engine.types import (
    CacheSettings,
    Completion,
    GenerationRequest,
    Message,
    SpeculationSettings,
)

ARCHS = ["qwen3_next", "qwen3_5_text", "qwen3_5_moe_text", "glm4_moe"]
PROMPT = "Speculative decoding lets a small draft model propose tokens that a large target model verifies."
NEW = 16


@pytest.fixture(scope="module")
def heads(model_cache: Path) -> dict[str, tuple[Path, LoadedModel, HeadDraft]]:
    out = {}
    for arch in ARCHS:
        folder = tiny_with_head(arch, model_cache)
        target = load_model(folder)
        [spec] = find_heads(folder, target.model.config)
        out[arch] = (folder, target, load_head(folder, target.model, spec))
    return out


def run(engine: Engine, prompt: str = PROMPT, **spec: object) -> Completion:
    request = GenerationRequest(raw_prompt=prompt, max_new_tokens=NEW, speculation=SpeculationSettings(**spec))  # type: ignore[arg-type]
    final = list(engine.generate(request))[-1]
    assert isinstance(final, Completion)
    return final


def reference_rows(head: HeadDraft, tokens: list[int], inputs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The head over rows (token, input hidden state) read causally, as the references run it:
    the first row is the text's position 1 at their position 0 (NextN zeroes its embedding
    there). Returns (normed output, the output that recurses) per row."""
    with torch.inference_mode():
        emb = head.embed(torch.tensor(tokens))
        if not head.recurse_normed:
            emb[0] = 0
        x = head.fc(torch.cat([head.norm_embedding(emb), head.norm_hidden(inputs)], dim=-1))[None]
        n = x.shape[1]
        mask = torch.full((n, n), torch.finfo(x.dtype).min).triu(1)[None, None]
        pos = torch.arange(n)[None]
        h = head.layer(x, attention_mask=mask, position_ids=pos, position_embeddings=head.rotary(x, position_ids=pos))
        h = (h[0] if isinstance(h, tuple) else h)[0]
        normed = head.norm(h)
    return normed, normed if head.recurse_normed else h


def target_hidden(folder: Path, ids: list[int]) -> torch.Tensor:
    """transformers' own final hidden states of the text (after the final norm), (n, H)."""
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.inference_mode():
        return model.model(torch.tensor([ids]), use_cache=False).last_hidden_state[0]


# ---- discovery --------------------------------------------------------------------------------
def test_each_family_head_is_found_with_its_names(heads: dict, model_cache: Path) -> None:
    for arch, (folder, target, head) in heads.items():
        [spec] = find_heads(folder, target.model.config)
        assert spec.kind == "mtp" and not spec.problem
        if arch == "glm4_moe":
            assert spec.naming == "nextn" and spec.layer_prefix == "model.layers.4." and spec.label.startswith("NextN")
            assert spec.fc == "model.layers.4.eh_proj.weight"
        else:
            assert spec.naming == "mtp" and spec.fc == "mtp.fc.weight" and spec.label == "MTP (1 layer, from the checkpoint)"
        assert spec.experts == (arch != "qwen3_5_text")
        assert any(t.endswith("mlp.experts.gate_up_proj") for t in spec.tensors) == spec.experts  # from its parts
    plain = tiny_model("qwen3_5_text", seed=0, layers=4, cache_dir=model_cache)
    assert find_heads(plain, heads["qwen3_5_text"][1].model.config) == []


@pytest.mark.parametrize(("damage", "says"), [
    ({"edit": {"mtp.fc.weight": torch.zeros(64, 96)}}, "mtp.fc.weight is [64, 96], not [64, 128]"),
    ({"drop": "mtp.layers.0.self_attn.k_proj.weight"}, "has no tensor mtp.layers.0.self_attn.k_proj.weight"),
    ({"edit": {"mtp.layers.0.mlp.experts.1.up_proj.weight": torch.zeros(40, 64)}}, "mlp.experts.gate_up_proj"),
])
def test_a_head_of_wrong_names_or_shapes_is_refused_clearly(heads: dict, model_cache: Path, tmp_path: Path,
                                                            damage: dict, says: str) -> None:
    _, target, _ = heads["qwen3_next"]
    bad = with_head(tiny_model("qwen3_next", seed=0, layers=4, cache_dir=model_cache), tmp_path / "bad", **damage)
    [spec] = find_heads(bad, target.model.config)
    assert says in spec.problem
    with pytest.raises(UnsupportedModel, match="draft head cannot be used"):
        load_head(bad, target.model, spec)


# ---- it drafts from the target's hidden states ------------------------------------------------
@pytest.mark.parametrize("arch", ARCHS)
def test_the_head_reads_the_target_hidden_states_of_the_text(heads: dict, arch: str) -> None:
    """After a generation the head holds the target's hidden state of every committed token but
    the last, and each of its entries is the head's formula over them (accepted tokens were read
    again with the target's states, not kept from the tree); a tree read in waves (a node and
    its child in one batch) recurses on the head's own outputs."""
    folder, target, head = heads[arch]
    engine = Engine(target.model, target.tokenizer, head)
    done = run(engine, budget=8)
    [prefix] = engine.prefixes._parked
    cache = prefix.draft
    assert isinstance(cache, HeadCache)
    text = prefix.tokens
    hidden = target_hidden(folder, text)
    n = len(text) - 1
    assert cache.trail_length >= n and bool(cache.known[:n].all())
    torch.testing.assert_close(cache.trail[:n], hidden[:n], atol=2e-4, rtol=1e-3)
    d = cache.length
    assert d > len(text) - 1 - NEW and not bool(cache.seen[0]) and bool(cache.seen[1:d].all())
    normed, own = reference_rows(head, text[1:d], hidden[: d - 1])
    torch.testing.assert_close(cache.own[1:d], own, atol=2e-4, rtol=1e-3)
    assert done.stats.draft_passes > 0
    # a node and its child in one pass: the child's input is the node's output
    a, b = 5, 9
    allowed = torch.zeros((2, d + 2), dtype=torch.bool)
    allowed[:, :d] = True
    allowed[0, d] = allowed[1, d] = allowed[1, d + 1] = True
    out = head.forward(torch.tensor([a, b]), torch.tensor([d, d + 1]), cache, allowed)
    root = own[-1:]
    _, own_a = reference_rows(head, [*text[1:d], a], torch.cat([hidden[: d - 1], root]))
    want, _ = reference_rows(head, [*text[1:d], a, b], torch.cat([hidden[: d - 1], root, own_a[-1:]]))
    torch.testing.assert_close(out, want[-2:], atol=2e-4, rtol=1e-3)


# ---- lossless ------------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_text_with_the_head_equals_transformers(heads: dict, arch: str) -> None:
    folder, target, head = heads[arch]
    ids = target.tokenizer(PROMPT)["input_ids"]
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    x = torch.tensor([ids])
    ref = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=NEW, do_sample=False,
                         pad_token_id=target.tokenizer.pad_token_id)[0, len(ids):].tolist()
    for budget in (8, 32):
        got = run(Engine(target.model, target.tokenizer, head), budget=budget)
        assert list(got.token_ids) == ref[: len(got.token_ids)] and len(got.token_ids) == len(ref), budget
    sequoia = run(Engine(target.model, target.tokenizer, head), budget=16, tree_mode="sequoia", max_depth=4)
    assert list(sequoia.token_ids) == ref


def chat(engine: Engine, turns: int = 3, conversation: str = "c") -> list[Completion]:
    out, messages = [], (Message("system", "You are a robot who loved to read books."),)
    for text in ("Paris is the capital of", "def add(a, b):", "Once upon a time there was")[:turns]:
        messages += (Message("user", text),)
        request = GenerationRequest(messages=messages, max_new_tokens=10, conversation=conversation,
                                    speculation=SpeculationSettings(budget=16, max_depth=5))
        final = list(engine.generate(request))[-1]
        assert isinstance(final, Completion)
        out.append(final)
        messages += (Message("assistant", final.text),)
    return out


@pytest.mark.parametrize("arch", ["qwen3_next", "glm4_moe"])
def test_a_multi_turn_chat_reusing_the_cache_equals_fresh_decodes(heads: dict, arch: str) -> None:
    _, target, head = heads[arch]
    fresh = chat(Engine(target.model, target.tokenizer, None, CacheSettings(enabled=False)))
    reused = chat(Engine(target.model, target.tokenizer, head))
    assert [c.token_ids for c in reused] == [c.token_ids for c in fresh]
    assert all(c.stats.cached_tokens > 0 for c in reused[1:])


def test_a_saved_cache_comes_back_and_the_head_reads_only_what_follows(heads: dict, tmp_path: Path) -> None:
    _, target, head = heads["glm4_moe"]
    settings = CacheSettings(ram_budget_bytes=0, min_saved_tokens=8, disk_dir=str(tmp_path / "kv"))
    first = Engine(target.model, target.tokenizer, head, settings, cache_files(settings, target.model, head))
    chat(first, turns=1, conversation="a")
    chat(first, turns=1, conversation="b")  # evicts a: saved to disk
    fresh = chat(Engine(target.model, target.tokenizer, None, CacheSettings(enabled=False)), turns=2)
    restarted = Engine(target.model, target.tokenizer, head, settings, cache_files(settings, target.model, head))
    again = chat(restarted, turns=2, conversation="a")
    assert [c.token_ids for c in again] == [c.token_ids for c in fresh]
    assert again[0].stats.cached_tokens > 8  # the saved cache was read
    [prefix] = [p for p in restarted.prefixes._parked if p.conversation == "a"]
    assert isinstance(prefix.draft, HeadCache)


def test_the_draft_switch_keeps_the_head_in_step(heads: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    """The draft goes off and on every other step: off, its cache falls behind while the target's
    hidden states keep coming; back on, it reads what it missed from them."""
    folder, target, head = heads["qwen3_5_text"]
    want = run(Engine(target.model, target.tokenizer, None), mode="autoregressive")
    flips = iter([True, False] * 40)
    monkeypatch.setattr(costs.DraftSwitch, "decide", lambda self, pass_costs: next(flips))
    engine = Engine(target.model, target.tokenizer, head)
    got = run(engine, budget=8, switch_draft=True)
    assert got.token_ids == want.token_ids and got.stats.draft_passes > 0
    [prefix] = engine.prefixes._parked
    cache = prefix.draft
    assert isinstance(cache, HeadCache)
    n = len(prefix.tokens) - 1
    hidden = target_hidden(folder, prefix.tokens)
    torch.testing.assert_close(cache.trail[:n], hidden[:n], atol=2e-4, rtol=1e-3)


@pytest.fixture(scope="module")
def oracle(model_cache: Path) -> tuple[LoadedModel, HeadDraft]:
    """A bigram target and a head that drafts its exact distribution (head_checkpoints.with_head)."""
    folder = with_head(tiny_model("glm4_moe", seed=0, layers=4, cache_dir=model_cache), model_cache / "oracle",
                       oracle=True)
    target = load_model(folder)
    return target, load_head(folder, target.model, find_heads(folder, target.model.config)[0])


def test_a_head_that_drafts_well_makes_deep_trees(oracle: tuple[LoadedModel, HeadDraft]) -> None:
    target, head = oracle
    plain = run(Engine(target.model, target.tokenizer, None), mode="autoregressive")
    # a chain of 8 (one child a node): every tree after the first step (a plain pass) is taken whole
    got = run(Engine(target.model, target.tokenizer, head), budget=8, max_depth=8, branching=1, min_pass_gain=0.0)
    assert got.token_ids == plain.token_ids and got.stats.target_passes == 3  # 1 + 9 + 6 tokens


def test_sampling_with_a_head_has_the_target_distribution(oracle: tuple[LoadedModel, HeadDraft]) -> None:
    """Three sampled tokens per seed follow the bigram target's exact marginals (bigram_sampling)."""
    target, head = oracle
    engine = Engine(target.model, target.tokenizer, head)
    finals = sampled_like_the_target(engine, PROMPT, 3, 300, 0.6, SpeculationSettings(budget=8, max_depth=3))
    passes = sum(final.stats.target_passes for final in finals)
    assert passes < 2.2 * len(finals), "without the head's trees, three tokens take three passes"


def test_a_head_never_counts_as_a_copy_of_the_target(heads: dict) -> None:
    _, target, head = heads["glm4_moe"]
    assert not Engine(target.model, target.tokenizer, head).copied_draft
    assert dataclasses.replace(head.shape).num_layers == 1
