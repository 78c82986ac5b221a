"""Qwen3.5's decode steps and tree passes in the fused C step and pass (engine/kernels/
fused_layer.py, qmatmul.c's delta_mix and delta_tree): Gated DeltaNet layers (projections, the
causal conv over its state or its node's path, the delta rule from the committed state or the
node's parent, the gated norm) beside gated full attention, dense or routed MLPs (the MoE's
shared expert under its sigmoid gate), on tiny GGUFs written as llama.cpp's converter writes them
(value heads tiled: the layers read them in the file's order), and on a packed Qwen3.5 in
transformers' order (value heads grouped by key head). Every step's and pass's hidden
states, the attention layers' K/V, the linear layers' conv and recurrent states and the inputs
a tree pass hands the cache for its nodes equal the general path's (TreeGatedDeltaNet, which
test_gguf_families2 holds to transformers, as it holds the fused greedy text), across kept
paths, a snapshot and a cut back to it, prompt chunks (folded into the states as steps would,
delta_chain; one in panels) and a 20-node tree (its products in panels); a pass on pending entries
keeps the general path. A Stop mid-chunk leaves the states as they were, on both paths."""

from __future__ import annotations

import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM, Qwen3_5TextConfig
from test_gguf_families2 import hybrid, vocab  # noqa: F401  (vocab: a session fixture)

from engine.decoding.generation import Engine
from engine.kernels import build
from engine.kernels.fused_layer import HYBRID_PASS_TOKENS, FusedDecoder, PassInterrupted
from engine.kernels.linear import PackedLinear, from_dense
from engine.model.causal_lm import CausalLM
from engine.loading.load import LoadedModel, load_model
from engine.model.hybrid_cache import HybridCache
from engine.types import GenerationRequest, SpeculationSettings

pytestmark = pytest.mark.skipif(build.kernels() is None, reason="no C compiler here")


@pytest.fixture(autouse=True)
def _cache_dir(model_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPECCHAT_CACHE_DIR", str(model_cache))
    monkeypatch.delenv("SPECCHAT_NO_FUSED", raising=False)


def grouped() -> tuple[Any, Any]:
    """A packed Qwen3.5 as transformers' checkpoints order it (value heads grouped by key head;
    b's rows packed, a's dense): (with the fused step, without), as CausalLMs."""
    config = Qwen3_5TextConfig(vocab_size=300, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=32, linear_num_key_heads=2,
                               linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=32,
                               linear_conv_kernel_dim=4, full_attention_interval=2, max_position_embeddings=512,
                               tie_word_embeddings=False)
    torch.manual_seed(0)
    hf: Any = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.normal_(0.0, 0.15) if p.ndim >= 2 else p.add_(torch.randn_like(p) * 0.2)
        for i, layer in enumerate(hf.model.layers):
            for j, (name, lin) in enumerate(list(layer.named_modules())):
                if type(lin) is nn.Linear and not name.endswith("in_proj_a"):
                    parent, _, child = name.rpartition(".")
                    kind = "q4" if (i + j) % 2 else "q8"
                    setattr(layer.get_submodule(parent), child, PackedLinear(from_dense(lin.weight.data, kind)))
    fused = CausalLM(hf)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SPECCHAT_NO_FUSED", "1")
        plain = CausalLM(hf)
    assert fused.fused is not None and fused.fused.hybrid and plain.fused is None
    assert not any(getattr(layer, "linear_attn", None) is not None and layer.linear_attn.tiled for layer in fused.layers)
    return SimpleNamespace(model=fused, tokenizer=None), SimpleNamespace(model=plain, tokenizer=None)


@pytest.fixture(scope="module", params=["qwen35", "qwen35moe", "grouped"])
def pair(request: pytest.FixtureRequest, vocab: tuple, tmp_path_factory: pytest.TempPathFactory  # noqa: F811
         ) -> tuple[LoadedModel, LoadedModel]:
    """The tiny GGUF loaded with the fused step and without it (SPECCHAT_NO_FUSED=1); or
    `grouped()`."""
    if request.param == "grouped":
        return grouped()  # type: ignore[return-value]
    path = tmp_path_factory.mktemp(request.param) / "model.gguf"
    hybrid(vocab[1], vocab[0], path, request.param)
    fused = load_model(path, offload="none")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SPECCHAT_NO_FUSED", "1")
        plain = load_model(path, offload="none")
    assert fused.model.fused is not None and fused.model.fused.hybrid and plain.model.fused is None
    assert all(la.tiled for la in (getattr(layer, "linear_attn", None) for layer in fused.model.layers) if la)
    return fused, plain


def close(got: torch.Tensor, want: torch.Tensor) -> bool:
    """As test_fused_layer's: within 3e-5 of the largest value."""
    return bool((got - want).abs().max() <= 3e-5 * want.abs().max().clamp_min(1e-6))


def assert_same(ours: HybridCache, theirs: HybridCache) -> None:
    assert ours.length == theirs.length and ours.committed == theirs.committed
    for i, spec in enumerate(ours.linear):
        if spec is None:
            k1, v1 = ours.keys[i][:, :, : ours.length], ours.values[i][:, :, : ours.length]
            assert close(k1, theirs.keys[i][:, :, : ours.length]) and close(v1, theirs.values[i][:, :, : ours.length])
        else:
            assert close(ours.states[i].conv, theirs.states[i].conv), i
            assert close(ours.states[i].recurrent, theirs.states[i].recurrent), i
    assert sorted(ours.snapshots) == sorted(theirs.snapshots)


def tree_mask(parents: list[int], past: int) -> torch.Tensor:
    n = len(parents)
    allowed = torch.zeros(n, past + n, dtype=torch.bool)
    allowed[:, :past] = True
    for i, p in enumerate(parents):
        allowed[i, past + i] = True
        if p >= 0:
            allowed[i, past:] |= allowed[p, past:]
    return allowed


def test_steps_equal_the_general_path(pair: tuple[LoadedModel, LoadedModel], monkeypatch: pytest.MonkeyPatch) -> None:
    fused, plain = pair
    steps: list[int] = []
    passes: list[int] = []
    real_step, real_pass = FusedDecoder.step, FusedDecoder.pass_

    def step(self: FusedDecoder, *args: Any) -> torch.Tensor:
        steps.append(1)
        return real_step(self, *args)

    def pass_(self: FusedDecoder, ids: torch.Tensor, *args: Any) -> torch.Tensor:
        passes.append(int(ids.shape[0]))
        return real_pass(self, ids, *args)

    monkeypatch.setattr(FusedDecoder, "step", step)
    monkeypatch.setattr(FusedDecoder, "pass_", pass_)
    models = (fused.model, plain.model)
    caches = [m.new_cache(8) for m in models]
    assert all(type(c) is HybridCache for c in caches)

    def both(tokens: list[int], positions: list[int], allowed: torch.Tensor | None) -> torch.Tensor:
        got, want = (m.forward(torch.tensor(tokens), torch.tensor(positions), c, allowed) for m, c in zip(models, caches))
        assert close(got, want)
        assert_same(*caches)
        for i, mine in caches[0].prior.items():  # what a tree pass handed the cache for its nodes
            theirs = caches[1].prior[i]
            assert (mine is None) == (theirs is None)
            if mine is not None and theirs is not None:
                for a, b in zip((mine.x, mine.k, mine.v, mine.beta, mine.g),
                                (theirs.x, theirs.k, theirs.v, theirs.beta, theirs.g)):
                    assert a.shape == b.shape and close(a, b)
        return got

    g = torch.Generator().manual_seed(3)

    def token() -> int:
        return int(torch.randint(3, 300, (1,), generator=g))

    prompt = [token() for _ in range(7)]
    both(prompt, list(range(7)), None)  # a prompt's chunk: the C pass, folded into the states
    assert steps == [] and passes == [7]
    for c in caches:
        c.mark(10)  # a snapshot after the third step (the engine marks each prompt's end)
    for s in range(5):  # steps across a reserve() growth (capacity 8)
        both([token()], [7 + s], None)
    assert len(steps) == 5 and all(10 in c.snapshots for c in caches)
    past = caches[0].length
    parents = [-1, 0, 0, 1, 3, 4, 2]  # a tree pass (deeper than the conv): its nodes' inputs pending
    both([token() for _ in parents], [past + d for d in (0, 1, 1, 2, 3, 4, 2)], tree_mask(parents, past))
    assert len(steps) == 5 and passes == [7, 7] and not caches[0].complete
    both([token()], [past + 3], tree_mask([-1], past + 7)[:, : past + 8] & torch.tensor(
        [True] * past + [True, True, False, True, False, False, False, True]))  # on pending entries: general path
    assert len(steps) == 5 and passes == [7, 7]
    for c in caches:
        c.keep(torch.tensor([*range(past), past, past + 1, past + 3, past + 7]))
    assert_same(*caches)
    for s in range(4):  # the kept path folded into the states: the C step again
        both([token()], [past + 4 + s], None)
    assert len(steps) == 9
    past = caches[0].length
    both([token()], [past], tree_mask([-1], past))  # a tree of one node: the C pass
    for c in caches:
        c.keep(torch.arange(past + 1))
    assert passes == [7, 7, 1] and caches[0].complete
    for c in caches:  # back below the committed tokens: the snapshot's states (new tensors)
        c.truncate(11)
    assert caches[0].length == 10
    assert_same(*caches)
    for s in range(3):
        both([token()], [10 + s], None)
    assert len(steps) == 12
    for c in caches:  # a chain under a mask from a fresh state (all pass nodes before the conv's reach)
        c.truncate(0)
    both([token() for _ in range(3)], [0, 1, 2], tree_mask([-1, 0, 1], 0))
    assert passes == [7, 7, 1, 3]
    parents = [-1, *range(10), 0, *range(11, 19)]  # 20 nodes, two branches: the products in panels (16+ tokens)
    depth: list[int] = []
    for p in parents:
        depth.append(0 if p < 0 else depth[p] + 1)
    for c in caches:  # the chain kept: the next pass reads committed states only
        c.keep(torch.arange(3))
    both([token()], [3], None)
    both([token(), token()], [4, 5], None)  # a chunk shorter than the conv's state: part of that stays
    both([token() for _ in range(20)], list(range(6, 26)), None)  # a chunk in panels (16+ tokens)
    past = caches[0].length
    both([token() for _ in parents], [past + d for d in depth], tree_mask(parents, past))
    assert passes == [7, 7, 1, 3, 2, 20, 20]


def test_a_stop_mid_chunk_leaves_the_states_as_they_were(pair: tuple[LoadedModel, LoadedModel]) -> None:
    """A prompt's chunk stopped between runs of layers (CausalLM.interruptible, as the prefill
    does on a Stop): the fused pass has folded it into its first layer's Gated DeltaNet state by
    then and puts that back; the general path changes no state before its commit and drops what
    it left pending. The cache is as it was, and the chunk read again gives the general path's
    result."""
    fused, plain = pair
    models = (fused.model, plain.model)
    assert all(m.can_interrupt() for m in models)
    assert models[0].linear[0] is not None  # the first run of layers folds a state
    g = torch.Generator().manual_seed(5)
    prompt = torch.randint(3, 300, (12,), generator=g)
    chunk = torch.randint(3, 300, (9,), generator=g)
    caches = [m.new_cache(8) for m in models]
    stop = threading.Event()
    stop.set()
    for m, c in zip(models, caches):
        m.forward(prompt, torch.arange(12), c, None)
        before = {i: s.clone() for i, s in c.states.items()}
        with m.interruptible(stop), pytest.raises(PassInterrupted):
            m.forward(chunk, torch.arange(12, 21), c, None)
        assert c.length == c.committed == 12 and not c._pass_pending
        for i, s in before.items():
            assert torch.equal(c.states[i].conv, s.conv) and torch.equal(c.states[i].recurrent, s.recurrent), i
    got, want = (m.forward(chunk, torch.arange(12, 21), c, None) for m, c in zip(models, caches))
    assert close(got, want)
    assert_same(*caches)


def test_a_short_prompt_is_read_as_one_chain_before_a_tree(pair: tuple[LoadedModel, LoadedModel],
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Before draft-free trees the prefill reads a short prompt's tail as well (one chain, folded
    in the C pass), so the first decoding pass is the tree alone, which the C tree pass takes
    (CausalLM.tree_room); plain decoding still reads the whole prompt in its first step."""
    fused, _ = pair
    if fused.tokenizer is None:
        pytest.skip("no tokenizer")
    model = fused.model
    assert model.tree_room() == HYBRID_PASS_TOKENS
    calls: list[tuple[int, bool]] = []  # (tokens, chain) of each target pass
    forward = model.forward

    def counted(tokens: torch.Tensor, positions: torch.Tensor, cache: Any, allowed: Any) -> torch.Tensor:
        calls.append((int(tokens.shape[0]), allowed is None))
        return forward(tokens, positions, cache, allowed)

    monkeypatch.setattr(model, "forward", counted)
    prompt = "def add(a, b):\n    return a + b\n\n" * 9
    for mode in ("specexec", "autoregressive"):
        calls.clear()
        req = GenerationRequest(raw_prompt=prompt, max_new_tokens=4, speculation=SpeculationSettings(mode=mode))  # type: ignore[arg-type]
        engine = Engine(model, fused.tokenizer)
        n = len(engine.encode(req))
        assert 2 * HYBRID_PASS_TOKENS < n <= 192
        list(engine.generate(req))
        if mode == "specexec":
            assert calls[0] == (n - 1, True)  # the prompt but its last token, one chain
            assert all(k <= HYBRID_PASS_TOKENS for k, _ in calls[1:])
        else:
            assert calls[0] == (n, True)  # the first step reads it all


def test_greedy_text_plain_and_with_trees(pair: tuple[LoadedModel, LoadedModel]) -> None:
    """Greedy text through the fused steps equals the general path's, plain decoding and
    draft-free trees (whose passes the general path runs between fused steps)."""
    fused, plain = pair
    if fused.tokenizer is None:
        pytest.skip("no tokenizer: the grouped model's steps are compared above")

    def text(m: LoadedModel, mode: str) -> list[int]:
        req = GenerationRequest(raw_prompt="def add(a, b):", max_new_tokens=20,
                                speculation=SpeculationSettings(mode=mode))  # type: ignore[arg-type]
        return list(list(Engine(m.model, m.tokenizer).generate(req))[-1].token_ids)

    want = text(plain, "autoregressive")
    assert text(fused, "autoregressive") == want
    assert text(fused, "specexec") == want
