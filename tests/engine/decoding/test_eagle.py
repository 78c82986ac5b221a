"""EAGLE-3 heads as the engine's draft: found beside the target in both published layouts, checked
against the target from config.json and safetensors headers, and drafting from the target's own
layer inputs, which every forward path keeps (plain, streamed, the fused CPU layers).

A head's entries are held to its formula written out in plain torch (eagle_checkpoints.reference:
no transformers module, no cache, no waves) over transformers' own hidden states of the text, so a
head that read anything else (the final hidden state, another layer, a shifted position) fails.
Lossless as every draft: greedy text equals transformers' `generate`, sampling the target's
distribution (a chi-square test on a bigram target whose head drafts it exactly)."""

from __future__ import annotations

from pathlib import Path

import shutil

import pytest
import torch
from bigram_sampling import sampled_like_the_target
from eagle_checkpoints import bigram_target, reference, write_eagle
from transformers import AutoModelForCausalLM

from engine.decoding.generation import Engine
from engine.decoding.pair import draft_options, load_engine
from engine.errors import UnsupportedModel
from engine.loading.load import LoadedModel, load_model
from engine.model.eagle import EagleCache, EagleDraft, load_eagle
from engine.model.eagle_spec import EagleSpec, eagle_spec
from engine.model.heads import find_heads, load_head
from engine.testing.synthetic import tiny_gguf, tiny_model
from engine.types import Completion, GenerationRequest, LoadSettings, SpeculationSettings

PROMPT = "Speculative decoding lets a small draft model propose tokens that a large target model verifies."
NEW = 16
AUX = [1, 3, 5]  # the input of the second layer, a middle one, the last one


@pytest.fixture(scope="module")
def models(model_cache: Path) -> Path:
    """A folder of models: a 6-layer tiny Llama and heads beside it."""
    home = model_cache / "eagle-models"
    target = home / "tiny-llama"
    if not (target / "config.json").is_file():
        home.mkdir(parents=True, exist_ok=True)
        source = tiny_model("llama", seed=0, layers=6, cache_dir=model_cache)
        shutil.copytree(source, target)
    write_eagle(home / "tiny-llama-EAGLE3", target, aux=AUX)
    return home


@pytest.fixture(scope="module")
def target(models: Path) -> LoadedModel:
    return load_model(models / "tiny-llama")


def run(engine: Engine, prompt: str = PROMPT, **spec: object) -> Completion:
    request = GenerationRequest(raw_prompt=prompt, max_new_tokens=NEW, speculation=SpeculationSettings(**spec))  # type: ignore[arg-type]
    final = list(engine.generate(request))[-1]
    assert isinstance(final, Completion)
    return final


def hf_states(folder: Path, ids: list[int], layers: list[int]) -> torch.Tensor:
    """transformers' own inputs of `layers` (hidden_states[j]: the input of layer j), side by side."""
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.inference_mode():
        states = model.model(torch.tensor([ids]), use_cache=False, output_hidden_states=True).hidden_states
    return torch.cat([states[j][0] for j in layers], dim=-1)


def greedy_reference(folder: Path, target: LoadedModel, prompt: str = PROMPT) -> tuple[int, ...]:
    ids = target.tokenizer(prompt)["input_ids"]
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    x = torch.tensor([ids])
    return tuple(model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=NEW, do_sample=False,
                                pad_token_id=target.tokenizer.pad_token_id)[0, len(ids):].tolist())


# ---- finding and checking -----------------------------------------------------------------------
def test_a_head_beside_the_model_is_found_in_either_layout(models: Path, target: LoadedModel, tmp_path: Path) -> None:
    [spec] = [s for s in find_heads(models / "tiny-llama", target.model.config) if isinstance(s, EagleSpec)]
    assert spec.kind == "assistant" and not spec.problem and spec.aux == tuple(AUX)
    assert spec.label == "EAGLE-3 head (1 layer, tiny-llama-EAGLE3)" and spec.stored("fc.weight") == "fc.weight"
    assert spec.stored("self_attn.q_proj.weight") == "midlayer.self_attn.q_proj.weight"
    # vLLM speculators' layout, in the Hugging Face cache's layout beside the target's snapshot
    hub = tmp_path / "hub"
    snap = hub / "models--org--tiny-llama" / "snapshots" / "abc"
    shutil.copytree(models / "tiny-llama", snap)
    write_eagle(hub / "models--org--tiny-llama-speculator.eagle3" / "snapshots" / "def", snap, layout="speculators",
                aux=AUX, draft_vocab=40)
    write_eagle(hub / "models--org--unrelated" / "snapshots" / "x", snap, aux=AUX)  # no "eagle" in its name
    [spec] = [s for s in find_heads(snap, target.model.config) if isinstance(s, EagleSpec)]
    assert not spec.problem and spec.stored("self_attn.q_proj.weight") == "layers.0.self_attn.q_proj.weight"
    assert spec.stored("d2t") == "d2t" and spec.aux == tuple(AUX)
    # a subfolder of the model's own folder, whatever its name; no ids named: vLLM's default
    write_eagle(snap / "drafter", snap)
    found = [s for s in find_heads(snap, target.model.config) if isinstance(s, EagleSpec)]
    assert {s.folder.name for s in found} == {"def", "drafter"}
    assert next(s for s in found if s.folder.name == "drafter").aux == (2, 3, 3)  # (2, L // 2, L - 3), L = 6


@pytest.mark.parametrize(("damage", "says"), [
    ({"edit": {"fc.weight": torch.zeros(64, 128)}}, "fc.weight is [64, 128], not [64, 192]"),
    ({"drop": "midlayer.self_attn.k_proj.weight"}, "have no tensor midlayer.self_attn.k_proj.weight"),
    ({"draft_vocab": 40, "drop": "d2t"}, "no d2t map"),
    ({"config_edit": {"vocab_size": 999}}, "vocabulary has 999 tokens"),
    ({"config_edit": {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 3, 9]}}}, "layers [1, 3, 9]"),
    ({"config_edit": {"target_hidden_size": 128}}, "trained for a model 128 wide"),
    ({"config_edit": {"num_hidden_layers": 2}}, "it has 2 layers"),
    ({"config_edit": {"hidden_size": "wide"}}, "config.json cannot be read"),
])
def test_a_head_that_does_not_fit_is_refused_clearly(models: Path, target: LoadedModel, tmp_path: Path,
                                                      damage: dict, says: str) -> None:
    bad = write_eagle(tmp_path / "bad-eagle", models / "tiny-llama", aux=AUX, **damage)
    spec = eagle_spec(bad, target.model.config)
    assert spec is not None and says in spec.problem, spec
    with pytest.raises(UnsupportedModel, match="cannot draft for this model"):
        load_eagle(bad, target.model)


def test_a_head_is_refused_as_a_model_to_chat_with(models: Path) -> None:
    with pytest.raises(UnsupportedModel, match="holds an EAGLE-3 head that drafts for another model"):
        load_model(models / "tiny-llama-EAGLE3")


def test_a_config_nested_too_deep_beside_the_model_is_passed_over(models: Path, target: LoadedModel,
                                                                    tmp_path: Path) -> None:
    home = tmp_path / "m"
    shutil.copytree(models / "tiny-llama", home / "tiny-llama")
    (home / "deep-eagle3").mkdir()
    (home / "deep-eagle3" / "config.json").write_text("[" * 100_000 + "]" * 100_000)
    write_eagle(home / "tiny-llama-eagle3", home / "tiny-llama", aux=AUX)
    found = [s for s in find_heads(home / "tiny-llama", target.model.config) if isinstance(s, EagleSpec)]
    assert [s.folder.name for s in found] == ["tiny-llama-eagle3"]


def test_pickled_weights_are_never_read(models: Path, target: LoadedModel, tmp_path: Path) -> None:
    folder = write_eagle(tmp_path / "pickled-eagle", models / "tiny-llama", aux=AUX)
    (folder / "model.safetensors").rename(folder / "pytorch_model.bin")
    spec = eagle_spec(folder, target.model.config)
    assert spec is not None and "no .safetensors file" in spec.problem


def test_a_damaged_d2t_map_is_refused_at_load(models: Path, target: LoadedModel, tmp_path: Path) -> None:
    folder = write_eagle(tmp_path / "map-eagle", models / "tiny-llama", aux=AUX, draft_vocab=40,
                         edit={"d2t": torch.full((40,), 10_000, dtype=torch.int64)})
    with pytest.raises(UnsupportedModel, match="d2t map"):
        load_eagle(folder, load_model(models / "tiny-llama").model)


# ---- the target keeps its layer inputs on every path --------------------------------------------
def test_every_forward_path_keeps_the_layer_inputs_the_head_reads(models: Path, model_cache: Path) -> None:
    ids = list(range(5, 17))
    want = hf_states(models / "tiny-llama", ids, AUX)
    for offload in ("none", "all"):  # resident layers, and every layer streamed
        model = load_model(models / "tiny-llama", offload=offload).model
        model.read_layer_inputs(tuple(AUX))
        cache = model.new_cache(64)
        hidden = model.forward(torch.tensor(ids[:8]), torch.arange(8), cache, None)
        first = model.head_states(hidden)
        hidden = model.forward(torch.tensor(ids[8:]), torch.arange(8, 12), cache, None)
        torch.testing.assert_close(torch.cat([first, model.head_states(hidden)]), want, atol=1e-5, rtol=1e-4)
    # the fused CPU layers (a packed GGUF): run in pieces between the kept layers, the same numbers
    path = tiny_gguf("llama", layers=6, hidden=256, layer_types=("Q8_0", "Q4_0"), cache_dir=model_cache)
    fused = load_model(path).model
    assert fused.fused is not None
    plain = load_model(path).model
    plain.fused = None
    for m in (fused, plain):
        m.read_layer_inputs((0, 2, 5))
    for n in (1, 5):  # a decoding step, and a pass
        got = []
        for m in (fused, plain):
            cache = m.new_cache(64)
            m.forward(torch.arange(3, 10), torch.arange(7), cache, None)
            hidden = m.forward(torch.arange(20, 20 + n), torch.arange(7, 7 + n), cache, None)
            got.append((hidden, m.head_states(hidden)))
        torch.testing.assert_close(got[0][1], got[1][1], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(got[0][0], got[1][0], atol=1e-4, rtol=1e-4)
        assert got[0][1].shape == (n, 3 * 256)


# ---- it drafts from the target's layer inputs ---------------------------------------------------
@pytest.mark.parametrize("layout", ["eagle", "speculators"])
def test_the_head_reads_the_target_layer_inputs_of_the_text(models: Path, target: LoadedModel, tmp_path: Path,
                                                            layout: str) -> None:
    """After a generation the head holds fc(the target's inputs of its layers) for every committed
    token but the last, and each entry is the head's formula over them; a node and its child read
    in one pass: the child reads the node's output."""
    folder = models / "tiny-llama-EAGLE3"
    if layout == "speculators":  # another width (its own embedding), a reduced vocabulary, norm before residual
        folder = write_eagle(tmp_path / "spec-eagle3", models / "tiny-llama", layout=layout, aux=AUX, width=48,
                             draft_vocab=50)
    head = load_eagle(folder, target.model)
    engine = Engine(target.model, target.tokenizer, head)
    done = run(engine, budget=8)
    assert done.stats.draft_passes > 0
    [prefix] = engine.prefixes._parked
    cache = prefix.draft
    assert isinstance(cache, EagleCache)
    text = prefix.tokens
    with torch.inference_mode():
        fused = head.fc(hf_states(models / "tiny-llama", text, AUX))
    n = len(text) - 1
    assert cache.trail_length >= n and bool(cache.known[:n].all())
    torch.testing.assert_close(cache.trail[:n], fused[:n], atol=2e-4, rtol=1e-3)
    d = cache.length
    assert not bool(cache.seen[0]) and bool(cache.seen[1:d].all())
    logits, own = reference(folder, models / "tiny-llama", text[1:d], fused[: d - 1], list(range(1, d)))
    torch.testing.assert_close(cache.own[1:d], own, atol=2e-4, rtol=1e-3)
    a, b = 5, 9
    allowed = torch.zeros((2, d + 2), dtype=torch.bool)
    allowed[:, :d] = True
    allowed[0, d] = allowed[1, d] = allowed[1, d + 1] = True
    out = head.forward(torch.tensor([a, b]), torch.tensor([d, d + 1]), cache, allowed)
    want, _ = reference(folder, models / "tiny-llama", [*text[1:d], a, b],
                        torch.cat([fused[: d - 1], own[-1:], cache.own[d : d + 1]]), list(range(1, d + 2)))
    _, own_a = reference(folder, models / "tiny-llama", [*text[1:d], a], torch.cat([fused[: d - 1], own[-1:]]),
                         list(range(1, d + 1)))
    torch.testing.assert_close(cache.own[d], own_a[-1], atol=2e-4, rtol=1e-3)
    got = head.logits(out)
    finite = torch.isfinite(want[-2:])
    assert torch.equal(torch.isfinite(got), finite) and int(finite[0].sum()) == (50 if layout == "speculators" else
                                                                               target.model.shape.vocab_size)
    torch.testing.assert_close(got[finite], want[-2:][finite], atol=2e-3, rtol=1e-3)


# ---- lossless ------------------------------------------------------------------------------------
@pytest.mark.parametrize("budget", [8, 32])
def test_greedy_text_with_the_head_equals_transformers(models: Path, target: LoadedModel, tmp_path: Path,
                                                       budget: int) -> None:
    ref = greedy_reference(models / "tiny-llama", target)
    head = load_eagle(models / "tiny-llama-EAGLE3", target.model)
    assert run(Engine(target.model, target.tokenizer, head), budget=budget).token_ids == ref
    small = write_eagle(tmp_path / "small-eagle3", models / "tiny-llama", aux=AUX, draft_vocab=30, seed=4)
    got = run(Engine(target.model, target.tokenizer, load_eagle(small, target.model)), budget=budget)
    assert got.token_ids == ref


def test_a_streamed_target_with_a_head_equals_transformers(models: Path) -> None:
    streamed = load_model(models / "tiny-llama", offload="all")
    head = load_eagle(models / "tiny-llama-EAGLE3", streamed.model)
    got = run(Engine(streamed.model, streamed.tokenizer, head), budget=16, tree_mode="sequoia", max_depth=4)
    assert got.token_ids == greedy_reference(models / "tiny-llama", streamed)


@pytest.fixture(scope="module")
def oracle(models: Path, model_cache: Path) -> tuple[LoadedModel, EagleDraft]:
    """A bigram target and an EAGLE-3 head that drafts its distribution (eagle_checkpoints.oracle_head)."""
    folder = bigram_target(models / "tiny-llama", model_cache / "eagle-bigram" / "bigram")
    head = write_eagle(model_cache / "eagle-bigram" / "bigram-eagle3", folder, aux=AUX, oracle=True)
    target = load_model(folder)
    return target, load_eagle(head, target.model)


def test_a_head_that_drafts_well_makes_deep_trees(oracle: tuple[LoadedModel, EagleDraft]) -> None:
    target, head = oracle
    plain = run(Engine(target.model, target.tokenizer, None), mode="autoregressive")
    got = run(Engine(target.model, target.tokenizer, head), budget=8, max_depth=8, branching=1, min_pass_gain=0.0)
    assert got.token_ids == plain.token_ids and got.stats.target_passes == 3  # 1 + 9 + 6 tokens


def test_sampling_with_a_head_has_the_target_distribution(oracle: tuple[LoadedModel, EagleDraft]) -> None:
    target, head = oracle
    engine = Engine(target.model, target.tokenizer, head)
    finals = sampled_like_the_target(engine, PROMPT, 3, 300, 0.6, SpeculationSettings(budget=8, max_depth=3))
    assert sum(f.stats.target_passes for f in finals) < 2.2 * len(finals)


# ---- chosen by the engine, or by hand -------------------------------------------------------------
def test_auto_lists_the_head_and_a_path_loads_it(models: Path, target: LoadedModel) -> None:
    options, loaders = draft_options(target, models / "tiny-llama", LoadSettings())
    [head] = options.heads
    assert head.kind == "assistant" and head.label.startswith("EAGLE-3 head") and not head.refusal
    assert isinstance(loaders["assistant"](lambda *a: None), EagleDraft)
    engine = load_engine(str(models / "tiny-llama"), str(models / "tiny-llama-EAGLE3"))
    assert isinstance(engine.draft, EagleDraft)
    choice = engine.draft_choice  # type: ignore[attr-defined]
    assert choice.kind == "assistant" and "EAGLE-3" in choice.label and "by hand" in choice.reason
    assert run(engine, budget=8).token_ids == greedy_reference(models / "tiny-llama", target)


def test_load_head_refuses_a_head_whose_files_changed(models: Path, target: LoadedModel, tmp_path: Path) -> None:
    home = tmp_path / "m"
    shutil.copytree(models / "tiny-llama", home / "tiny-llama")
    folder = write_eagle(home / "tiny-llama-eagle3", home / "tiny-llama", aux=AUX)
    [spec] = [s for s in find_heads(home / "tiny-llama", target.model.config) if isinstance(s, EagleSpec)]
    write_eagle(folder, home / "tiny-llama", aux=[1, 2, 3])
    with pytest.raises(UnsupportedModel, match="changed"):
        load_head(home / "tiny-llama", target.model, spec)
