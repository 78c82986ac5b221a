"""Gemma 4's assistant model as the engine's draft: found beside its target, loaded from its own
safetensors, decoding exactly what the target alone decodes, and actually used.

A tiny random Gemma 4 target (K/V sharing in its last two layers, per-layer inputs, windows of
6) and a tiny assistant written under the names transformers' Gemma4AssistantForCausalLM saves
(its own layer shapes built from transformers' Gemma4TextConfig). The "oracle" pair makes the
assistant useful by construction: a bigram target (every layer's outputs zeroed, so its next
token depends on the last token alone) and an assistant that computes the same bigram logits
(pre_projection passes the embedding through, its layers add nothing, its norm and lm_head are
the target's) drafts the target's own choices at every depth, so a pair that never used its
assistant, or read the wrong inputs, would take one pass per token."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from bigram_sampling import sampled_like_the_target
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, Gemma4TextConfig
from transformers.models.gemma4.modeling_gemma4 import Gemma4TextDecoderLayer

from engine.decoding.generation import Engine
from engine.errors import UsageError
from engine.loading.load import LoadedModel, load_model
from engine.model.assistant import AssistantCache, AssistantDraft, load_assistant
from engine.model.assistant_spec import AssistantSpec
from engine.model.heads import find_heads, load_head
from engine.testing.synthetic import tiny_model
from engine.types import Completion, GenerationRequest, SpeculationSettings

PROMPT = "Speculative decoding lets a small draft model propose tokens that a large target model verifies."
NEW = 16
STD = 0.15


def assistant_config(target: Path, hidden: int, **changes: object) -> dict:
    """A gemma4_assistant config.json for the target in `target` (`changes` edit its text config)."""
    t = json.loads((target / "config.json").read_text())
    text = dict(model_type="gemma4_text", vocab_size=t["vocab_size"], hidden_size=hidden, intermediate_size=2 * hidden,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, global_head_dim=32,
                num_global_key_value_heads=1, attention_k_eq_v=True, hidden_size_per_layer_input=0,
                vocab_size_per_layer_input=0, sliding_window=t["sliding_window"],
                layer_types=["sliding_attention", "full_attention"], rms_norm_eps=t["rms_norm_eps"],
                max_position_embeddings=t["max_position_embeddings"])
    text.update(changes)
    return {"model_type": "gemma4_assistant", "architectures": ["Gemma4AssistantForCausalLM"], "text_config": text,
            "backbone_hidden_size": t["hidden_size"], "use_ordered_embeddings": False, "tie_word_embeddings": True}


def write_assistant(dest: Path, target: Path, hidden: int = 32, seed: int = 3, oracle: bool = False,
                    backbone: int | None = None, centroids: int = 0, **changes: object) -> Path:
    """An assistant folder: config.json and model.safetensors under transformers' names
    (`backbone`: another backbone_hidden_size than the target's width; `centroids`: that many
    token clusters, the centroid-masked lm_head of use_ordered_embeddings, 2 of them read)."""
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    config = assistant_config(target, hidden, **changes)
    config["backbone_hidden_size"] = backbone or config["backbone_hidden_size"]
    if centroids:
        config.update(use_ordered_embeddings=True, num_centroids=centroids, centroid_intermediate_top_k=2)
    (dest / "config.json").write_text(json.dumps(config))
    text = {k: v for k, v in config["text_config"].items() if k != "model_type"}
    cfg = Gemma4TextConfig(**{**text, "num_kv_shared_layers": 0})
    g = torch.Generator().manual_seed(seed)
    b, v = int(config["backbone_hidden_size"]), int(text["vocab_size"])
    out: dict[str, torch.Tensor] = {}
    for i in range(cfg.num_hidden_layers):
        layer = Gemma4TextDecoderLayer(cfg, i)
        for name, t in [*layer.named_parameters(), *layer.named_buffers()]:
            if name.split(".")[-2:-1] in (["k_proj"], ["v_proj"], ["k_norm"], ["v_norm"]):
                continue  # a shared layer has no key/value projections
            noise = torch.randn(t.shape, generator=g)
            value = noise * STD if t.ndim >= 2 else 1 + noise * 0.1
            if name == "layer_scalar":
                value = torch.ones_like(t)
            if oracle and name.endswith(("o_proj.weight", "down_proj.weight")):
                value = torch.zeros_like(t)
            out[f"model.layers.{i}.{name}"] = value
    out["model.norm.weight"] = 1 + torch.randn(hidden, generator=g) * 0.1
    out["model.embed_tokens.weight"] = torch.randn(v, hidden, generator=g) * 2 * STD
    out["pre_projection.weight"] = torch.randn(hidden, 2 * b, generator=g) * STD
    out["post_projection.weight"] = torch.randn(b, hidden, generator=g) * STD
    if centroids:
        out["masked_embedding.centroids.weight"] = torch.randn(centroids, hidden, generator=g)
        out["masked_embedding.token_ordering"] = torch.randperm(v, generator=g)
    if oracle:  # the target's bigram: lm_head(norm(embed(x))), embedding passed through
        assert hidden == b
        stored = load_file(target / "model.safetensors")
        out["pre_projection.weight"] = torch.cat([torch.eye(b), torch.zeros(b, b)], dim=1)
        out["model.norm.weight"] = stored["model.norm.weight"].clone()
        out["model.embed_tokens.weight"] = stored["lm_head.weight"].clone()
    save_file({k: t.contiguous() for k, t in out.items()}, dest / "model.safetensors", metadata={"format": "pt"})
    return dest


def bigram_target(source: Path, dest: Path) -> Path:
    """A copy of a tiny Gemma 4 whose layers add nothing: next token = f(last token)."""
    if dest.exists():
        shutil.rmtree(dest)
    shutil.copytree(source, dest)
    tensors = load_file(dest / "model.safetensors")
    zeroed = ("o_proj.weight", "down_proj.weight", "per_layer_projection.weight")
    save_file({k: torch.zeros_like(t) if k.endswith(zeroed) else t for k, t in tensors.items()},
              dest / "model.safetensors", metadata={"format": "pt"})
    return dest


Pair = tuple[Path, LoadedModel, AssistantDraft]


@pytest.fixture(scope="module")
def pairs(model_cache: Path) -> dict[str, Pair]:
    """"random": a random assistant beside a random target (target/ and target-assistant/);
    "oracle": the bigram pair."""
    base = model_cache / "gemma4-assistant"
    source = tiny_model("gemma4_text", seed=0, layers=4, cache_dir=model_cache)
    out = {}
    for name in ("random", "oracle"):
        target_dir = base / name / "target"
        if name == "random":
            if target_dir.exists():
                shutil.rmtree(target_dir)
            shutil.copytree(source, target_dir)
            write_assistant(base / name / "target-assistant", target_dir)
        else:
            bigram_target(source, target_dir)
            write_assistant(base / name / "target-assistant", target_dir, hidden=64, oracle=True)
        target = load_model(target_dir)
        [spec] = find_heads(target_dir, target.model.config)
        draft = load_head(target_dir, target.model, spec)
        assert isinstance(draft, AssistantDraft)
        out[name] = (target_dir, target, draft)
    return out


def run(engine: Engine, prompt: str = PROMPT, new: int = NEW, **spec: object) -> Completion:
    speculation = SpeculationSettings(**spec)  # type: ignore[arg-type]
    request = GenerationRequest(raw_prompt=prompt, max_new_tokens=new, speculation=speculation)
    final = list(engine.generate(request))[-1]
    assert isinstance(final, Completion)
    return final


# ---- discovery and refusal ------------------------------------------------------------------------
def test_the_assistant_beside_the_target_is_found(pairs: dict[str, Pair], tmp_path: Path) -> None:
    folder, target, _ = pairs["random"]
    [spec] = find_heads(folder, target.model.config)
    assert isinstance(spec, AssistantSpec) and spec.kind == "assistant" and not spec.problem
    assert spec.folder == folder.parent / "target-assistant" and spec.layers == 2
    lonely = tmp_path / "alone"
    shutil.copytree(folder, lonely)
    assert find_heads(lonely, target.model.config) == []
    # the Hugging Face cache: each repository a folder of snapshots
    snapshot = tmp_path / "hub" / "models--google--gemma-4-tiny-it" / "snapshots" / "abc"
    shutil.copytree(folder, snapshot)
    beside = tmp_path / "hub" / "models--google--gemma-4-tiny-it-assistant" / "snapshots" / "def"
    shutil.copytree(folder.parent / "target-assistant", beside)
    [spec] = find_heads(snapshot, target.model.config)
    assert isinstance(spec, AssistantSpec) and spec.folder == beside and not spec.problem


@pytest.mark.parametrize(("change", "says"), [
    ({"hidden": 32, "num_global_key_value_heads": 2}, "full_attention layers read 2 key/value heads of width 32"),
    ({"hidden": 32, "vocab_size": 77}, "its vocabulary has 77 tokens"),
    ({"hidden": 32, "backbone": 48}, "trained for a model 48 wide (backbone_hidden_size), and this model is 64 wide"),
])
def test_an_assistant_for_another_model_is_refused_clearly(pairs: dict[str, Pair], tmp_path: Path, change: dict,
                                                           says: str) -> None:
    folder, target, _ = pairs["random"]
    bad = write_assistant(tmp_path / "bad", folder, **change)
    with pytest.raises(UsageError, match="cannot draft for this model") as err:
        load_assistant(bad, target.model)
    assert says in err.value.user_message


def test_a_folder_that_is_no_assistant_is_refused(pairs: dict[str, Pair], tmp_path: Path) -> None:
    folder, target, _ = pairs["random"]
    with pytest.raises(UsageError, match="is not a Gemma 4 assistant"):
        load_assistant(folder, target.model)
    broken = tmp_path / "broken"
    broken.mkdir()
    config = assistant_config(folder, 32, num_hidden_layers="two")
    (broken / "config.json").write_text(json.dumps(config))
    with pytest.raises(UsageError, match="its config.json cannot be read"):
        load_assistant(broken, target.model)


def test_the_centroid_masked_head_equals_transformers(pairs: dict[str, Pair], tmp_path: Path) -> None:
    """use_ordered_embeddings: logits only for the tokens of the best centroids, as transformers'
    Gemma4AssistantMaskedEmbedder computes them (the rest one below their least)."""
    from transformers.models.gemma4_assistant import Gemma4AssistantConfig
    from transformers.models.gemma4_assistant.modeling_gemma4_assistant import Gemma4AssistantMaskedEmbedder

    folder, target, _ = pairs["random"]
    path = write_assistant(tmp_path / "ordered", folder, centroids=4)
    draft = load_assistant(path, target.model)
    config = json.loads((path / "config.json").read_text())
    embedder = Gemma4AssistantMaskedEmbedder(Gemma4AssistantConfig(**{k: v for k, v in config.items()
                                                                      if k not in ("model_type", "architectures")}))
    stored = load_file(path / "model.safetensors")
    embedder.load_state_dict({"centroids.weight": stored["masked_embedding.centroids.weight"],
                              "token_ordering": stored["masked_embedding.token_ordering"]})
    hidden = torch.randn(3, 32, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        want = embedder(hidden[None], stored["model.embed_tokens.weight"])[0]
    got = draft.logits(hidden)
    torch.testing.assert_close(got, want)
    assert int((got > got.min()).sum(dim=1)[0]) == 2 * got.shape[1] // 4  # two of four clusters
    run(Engine(target.model, target.tokenizer, draft), budget=8)  # it drafts


# ---- lossless, and used -----------------------------------------------------------------------
def test_greedy_text_with_the_assistant_equals_transformers(pairs: dict[str, Pair]) -> None:
    folder, target, draft = pairs["random"]
    ids = target.tokenizer(PROMPT)["input_ids"]
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    x = torch.tensor([ids])
    ref = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=NEW, do_sample=False,
                         pad_token_id=getattr(target.tokenizer, "pad_token_id", None))[0, len(ids):].tolist()
    for budget in (8, 32):
        got = run(Engine(target.model, target.tokenizer, draft), budget=budget)
        assert list(got.token_ids) == ref, budget
        assert got.stats.draft_passes > 0
    sequoia = run(Engine(target.model, target.tokenizer, draft), budget=16, tree_mode="sequoia", max_depth=4)
    assert list(sequoia.token_ids) == ref


def reference_step(draft: AssistantDraft, token: int, h_in: torch.Tensor, shared: dict, p: int,
                   window: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The assistant's step as the reference runs it, over transformers' own K/V of the text
    (positions 0..p-1): query at p, sliding layers reading the positions within the window.
    Returns (logits (V,), the projected state a child reads)."""
    with torch.inference_mode():
        emb = draft.target.embed(torch.tensor([[token]]))
        x = draft.pre_projection(torch.cat([emb, h_in[None, None]], dim=-1))
        pos = torch.tensor([[p]])
        keys = torch.arange(p)
        far = ~(keys > p - window)  # (p,) outside the window of a query at p
        masks = {"full_attention": torch.zeros(1, 1, 1, p),
                 "sliding_attention": torch.zeros(1, 1, 1, p).masked_fill(far, torch.finfo(x.dtype).min)}
        for layer, t in zip(draft.layers, draft.assistant_types):
            x = layer(x, None, shared_kv_states=shared, position_embeddings=draft.rotary(x, pos, t),
                      attention_mask=masks[t], position_ids=pos)
        normed = draft.norm(x)[0]
        return draft.logits(normed)[0], draft.post_projection(normed)[0]


def test_the_assistant_reads_the_target_states_and_keys(pairs: dict[str, Pair]) -> None:
    """After a generation the assistant's cache holds the target's hidden states of the text and
    is bound to the very cache the target decoded with; its next root and a child of it are the
    reference's step over transformers' own keys and values of the text (the target's last
    windowed and full layers before its shared ones: a window of 6, shorter than the text)."""
    folder, target, draft = pairs["random"]
    engine = Engine(target.model, target.tokenizer, draft)
    run(engine, budget=8)
    [prefix] = engine.prefixes._parked
    cache = prefix.draft
    assert isinstance(cache, AssistantCache) and cache.target_cache() is prefix.target
    p = prefix.target.length  # the text the target holds, then a root it has not read
    text = [*prefix.tokens[:p], prefix.tokens[p] if p < len(prefix.tokens) else prefix.tokens[-1]]
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.inference_mode():
        out = model.model(torch.tensor([text[:-1]]), use_cache=False, return_shared_kv_states=True)
    hidden, shared = out.last_hidden_state[0], dict(out.shared_kv_states)
    assert set(shared) == {"full_attention", "sliding_attention"}
    torch.testing.assert_close(cache.trail[:p], hidden, atol=2e-4, rtol=1e-3)
    window = int(model.config.sliding_window)
    assert p > 2 * window
    want, state = reference_step(draft, text[-1], hidden[-1], shared, p, window)
    cache.truncate(min(cache.length, p))
    rows = draft.forward(torch.tensor(text[cache.length :]), torch.arange(cache.length, p + 1), cache, None)
    torch.testing.assert_close(draft.logits(rows[-1:])[0], want, atol=2e-4, rtol=1e-3)
    child = int(want.argmax())
    allowed = torch.ones((1, cache.length + 1), dtype=torch.bool)
    kid = draft.forward(torch.tensor([child]), torch.tensor([p + 1]), cache, allowed)
    want_kid, _ = reference_step(draft, child, state, shared, p, window)
    torch.testing.assert_close(draft.logits(kid)[0], want_kid, atol=2e-4, rtol=1e-3)
    copied = cache.copy_prefix(p)
    assert copied.target_cache() is None and not copied.knows(p - 1)  # a copy waits for its own target pass


def test_an_assistant_that_drafts_well_makes_deep_trees(pairs: dict[str, Pair]) -> None:
    _, target, draft = pairs["oracle"]
    plain = run(Engine(target.model, target.tokenizer, None), mode="autoregressive")
    got = run(Engine(target.model, target.tokenizer, draft), budget=8, max_depth=8, branching=1, min_pass_gain=0.0)
    assert got.token_ids == plain.token_ids
    assert got.stats.target_passes <= 4, got.stats  # 1 + 9 + 6 tokens; one per pass without the assistant
    random = run(Engine(target.model, target.tokenizer, pairs["random"][2]), budget=8, max_depth=8, branching=1,
                 min_pass_gain=0.0)
    assert random.stats.target_passes > got.stats.target_passes  # the oracle's depth is the assistant's doing


def test_sampling_with_the_assistant_has_the_target_distribution(pairs: dict[str, Pair]) -> None:
    """Two sampled tokens per seed follow the bigram target's exact marginals (bigram_sampling)."""
    _, target, draft = pairs["oracle"]
    engine = Engine(target.model, target.tokenizer, draft)
    finals = sampled_like_the_target(engine, PROMPT, 2, 240, 0.6, SpeculationSettings(budget=4, max_depth=2))
    assert sum(final.stats.draft_passes for final in finals) > 0


# ---- how a user gets it: --draft auto, or --draft FOLDER ------------------------------------------
def test_auto_and_a_named_folder_both_draft_with_the_assistant(pairs: dict[str, Pair]) -> None:
    from engine.decoding.pair import draft_choice_of, load_engine
    from engine.types import CacheSettings, LoadSettings

    folder, target, _ = pairs["random"]
    cpu = LoadSettings(device="cpu", offload="none", cache=CacheSettings(disk_budget_bytes=0))
    auto = load_engine(folder, "auto", cpu)
    choice = draft_choice_of(auto)
    assert choice is not None and choice.kind == "assistant" and isinstance(auto.draft, AssistantDraft), choice
    assert "target-assistant" in choice.label
    named = load_engine(folder, str(folder.parent / "target-assistant"), cpu)
    by_hand = draft_choice_of(named)
    assert by_hand is not None and by_hand.kind == "assistant" and isinstance(named.draft, AssistantDraft)
    plain = run(Engine(target.model, target.tokenizer, None), mode="autoregressive")
    assert run(named, budget=8).token_ids == plain.token_ids
    # `specchat bench speculation --draft FOLDER` loads it the same way (a head is not a model)
    from engine.cli.common import bench_engine

    bench = bench_engine(str(folder), str(folder.parent / "target-assistant"))
    assert isinstance(bench.draft, AssistantDraft) and bench.draft_choice.kind == "assistant"  # type: ignore[attr-defined]


def test_an_offloaded_target_hands_its_keys_over_too(pairs: dict[str, Pair]) -> None:
    """Every layer streamed (their modules stay on the meta device, templates run them): the
    assistant still binds to the target's cache, and the oracle's trees are as deep."""
    folder, _, _ = pairs["oracle"]
    streamed = load_model(folder, offload="all")
    assert streamed.model.streamer is not None
    [spec] = find_heads(folder, streamed.model.config)
    draft = load_head(folder, streamed.model, spec)
    plain = run(Engine(streamed.model, streamed.tokenizer, None), mode="autoregressive")
    got = run(Engine(streamed.model, streamed.tokenizer, draft), budget=8, max_depth=8, branching=1,
              min_pass_gain=0.0)
    assert got.token_ids == plain.token_ids and got.stats.target_passes <= 4, got.stats


def test_a_chat_reusing_and_saving_its_cache_equals_fresh_decodes(pairs: dict[str, Pair], tmp_path: Path) -> None:
    """Turns that reuse the conversation's cache (a copy of the assistant's cache binds to its
    own target pass), and a conversation saved to disk and read back by a new engine."""
    from engine.decoding.pair import cache_files
    from engine.types import CacheSettings, Message

    _, target, draft = pairs["random"]

    cached: list[int] = []

    def chat(engine: Engine, conversation: str, turns: int = 2) -> list[tuple[int, ...]]:
        out: list[tuple[int, ...]] = []
        cached.clear()
        messages: tuple[Message, ...] = (Message("system", "You are a robot who loved to read books."),)
        for text in ("Paris is the capital of", "def add(a, b):")[:turns]:
            messages = (*messages, Message("user", text))
            request = GenerationRequest(messages=messages, max_new_tokens=10, conversation=conversation,
                                        speculation=SpeculationSettings(budget=16, max_depth=5))
            final = list(engine.generate(request))[-1]
            assert isinstance(final, Completion)
            out.append(final.token_ids)
            cached.append(final.stats.cached_tokens)
            messages = (*messages, Message("assistant", final.text))
        return out

    fresh = chat(Engine(target.model, target.tokenizer, None, CacheSettings(enabled=False)), "c")
    settings = CacheSettings(ram_budget_bytes=0, min_saved_tokens=8, disk_dir=str(tmp_path / "kv"))
    first = Engine(target.model, target.tokenizer, draft, settings, cache_files(settings, target.model, draft))
    assert chat(first, "a") == fresh and cached[1] > 0
    chat(first, "b", turns=1)  # evicts a: saved to disk
    again = Engine(target.model, target.tokenizer, draft, settings, cache_files(settings, target.model, draft))
    assert chat(again, "a") == fresh and cached[0] > 8  # the saved cache was read
