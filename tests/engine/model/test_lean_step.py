"""The lean one-token step (engine.model.lean_step), run eagerly on the CPU as the GPU replays it
in CUDA graphs: the same hidden states as the general path, step after step, for dense, MoE
(shared experts too) and Gated DeltaNet hybrid families, the Qwen3.5-MoE GGUF with its experts
packed among them, across a cache that grows, that is pruned by a tree's accepted path and whose
unwritten columns hold NaN; greedy text equal to transformers' own decoding; the models it must
refuse."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from lean_checks import assert_twin_steps, forced, twin_passes, twin_steps
from test_families import LAYERS, reference, run

from engine.decoding.generation import Engine
from engine.kernels.fused_layer import PassInterrupted
from engine.loading.load import load_model
from engine.model import lean_step
from engine.model.causal_lm import CausalLM
from engine.model.lean_step import LeanStep, refusal
from engine.testing.synthetic import tiny_model


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe", "mixtral", "glm4_moe", "qwen3_5_text", "qwen3_next"])
def test_steps_give_the_general_paths_states_across_a_growing_cache(arch: str, model_cache: Path) -> None:
    model = load_model(tiny_model(arch, seed=0, layers=LAYERS, cache_dir=model_cache)).model
    assert model.lean is None, "on the CPU only a forced lean step runs"
    assert_twin_steps(model)


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe", "mixtral", "glm4_moe"])
def test_passes_in_buckets_give_the_general_paths_states(arch: str, model_cache: Path) -> None:
    """Chains and trees of 1 to 40 tokens, each run as a bucket of the next power of two (pads
    attend to themselves, are never committed, and never reach the routed experts): the general
    path's outputs, a pruned tree's kept path read back by the next pass."""
    model = load_model(tiny_model(arch, seed=0, layers=LAYERS, cache_dir=model_cache)).model
    lean = forced(model)
    sizes = [2, 3, 5, 8, 13, 1, 20, 32, 40, 7, 1, 16]
    worst = twin_passes(model, lean, sizes)
    assert lean.steps == len(sizes) and worst < 5e-6, worst


@pytest.mark.parametrize("arch", ["qwen3_5_text", "qwen3_next"])
def test_a_hybrids_trees_give_the_general_paths_states(arch: str, model_cache: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A hybrid's trees on committed text (its Gated DeltaNet layers reading the tree's tables,
    the pads roots of their own) give the general path's outputs, and the kept path's states,
    replayed from the inputs the lean pass's nodes left, give the next passes' (its chains of
    several tokens take the general path on both twins); from (fake) graphs too: captured at a
    bucket's third tree, replayed from there."""
    model = load_model(tiny_model(arch, seed=0, layers=LAYERS, cache_dir=model_cache)).model
    lean = forced(model)
    sizes = [1, 2, 1, 5, 3, 13, 1, 1, 4, 30, 2, 7]  # trees (odd places) of 2 to 30 nodes, chains between
    worst = twin_passes(model, lean, sizes)
    assert worst < 2e-5, worst
    assert lean.steps == 6 + 3  # the trees and the one-token chains
    monkeypatch.setattr(lean_step, "CudaGraphs", FakeGraphs)
    lean = forced(model)
    lean.graphed, lean.why_eager = True, None
    worst = twin_passes(model, lean, [1, 6, 1, 7, 1, 5, 1, 8], capacity=64)  # four trees in the bucket of 8
    # the one-token chains' bucket and the trees' (of 8), each captured at its third pass, replayed from there
    assert worst < 2e-5 and lean.captures == 2 and lean.replays == 4 * len(lean.segments), worst


def test_a_stop_ends_a_pass_between_segments_committing_nothing(model_cache: Path) -> None:
    model = load_model(tiny_model("qwen3_moe", seed=0, layers=LAYERS, cache_dir=model_cache)).model
    model.lean = forced(model)
    cache = model.new_cache(32)
    stop = threading.Event()
    with torch.inference_mode(), model.interruptible(stop):
        model.forward(torch.arange(3, 10), torch.arange(7), cache, None)
        stop.set()
        model.forward(torch.tensor([5]), torch.tensor([7]), cache, None)  # one token: no check
        with pytest.raises(PassInterrupted, match="stopped before layer 2"):
            model.forward(torch.arange(20, 25), torch.arange(8, 13), cache, None)
    assert cache.length == 8 and model.lean.steps == 2  # the prompt and the step


def test_attention_reads_columns_a_little_past_the_text(model_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """However far a cache grew (for trees), a step reads the least multiple of max(MIN_COLUMNS,
    an eighth of the text's power of two) of its columns past the text (MIN_COLUMNS here 8)."""
    monkeypatch.setattr(lean_step, "MIN_COLUMNS", 8)
    assert [lean_step.columns_for(n, 128) for n in (0, 7, 8, 46, 100, 127)] == [8, 8, 16, 48, 112, 128]
    monkeypatch.setattr(lean_step, "MIN_COLUMNS", 256)
    assert [lean_step.columns_for(n, 1 << 20) for n in (0, 255, 256, 2047, 2048, 20000)] == \
        [256, 256, 512, 2048, 2560, 20480]  # never more than a quarter past the text from 2048 on
    assert lean_step.columns_for(300, 310) == 310
    monkeypatch.setattr(lean_step, "MIN_COLUMNS", 8)
    model = load_model(tiny_model("qwen3_moe", seed=0, layers=LAYERS, cache_dir=model_cache)).model
    lean = forced(model)
    worst, cache = twin_steps(model, lean, steps=40, capacity=128, poison=True)
    assert cache.capacity == 128 and cache.length == 47 and worst < 5e-6, worst
    assert sorted(lean._buffers[cache][1]) == [(1, w, (), False) for w in (8, 16, 24, 32, 40, 48)]  # (bucket,
    # columns, grab, a hybrid's tree)


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen3_5_text"])
def test_a_step_after_a_pruned_tree_reads_the_kept_entries(arch: str, model_cache: Path) -> None:
    """A tree pass then its second branch kept: the next step reads the kept entries (and a
    hybrid's states, replayed along the kept path from the inputs the tree's nodes left) as the
    general path does."""
    model = load_model(tiny_model(arch, seed=0, layers=LAYERS, cache_dir=model_cache)).model
    lean = forced(model)
    prompt, tree = torch.arange(3, 12), torch.tensor([40, 41, 42, 43])
    outs = []
    for use in (None, lean):
        cache = model.new_cache(16)
        with torch.inference_mode():
            model.forward(prompt, torch.arange(len(prompt)), cache, None)
            n = len(prompt)
            model.lean = use
            model.forward(torch.tensor([5]), torch.tensor([n]), cache, None)  # a step first: buffers seen
            # a tree of two branches (40 -> 41, 42 -> 43) at the next position, the second branch kept
            allowed = torch.ones(4, cache.length + 4, dtype=torch.bool)
            allowed[:, cache.length:] = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0], [0, 0, 1, 1]]).bool()
            model.forward(tree, torch.tensor([n + 1, n + 2, n + 1, n + 2]), cache, allowed)
            if use is not None and any(model.linear):  # the tree is pending in the states: not this step's
                assert not lean.takes(cache, 1, None)
            cache.keep(torch.cat([torch.arange(n + 1), torch.tensor([n + 3, n + 4])]))
            outs.append(model.forward(torch.tensor([7]), torch.tensor([n + 3]), cache, None))
            model.lean = None
    assert lean.steps == 3
    torch.testing.assert_close(outs[1], outs[0], atol=2e-5, rtol=0)


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe", "qwen3_5_text"])
def test_greedy_text_through_lean_steps_equals_transformers(arch: str, model_cache: Path) -> None:
    path = tiny_model(arch, seed=0, layers=LAYERS, cache_dir=model_cache)
    target = load_model(path)
    lean = target.model.lean = forced(target.model)
    engine = Engine(target.model, target.tokenizer)
    ids, plain = run(engine, mode="autoregressive")
    assert lean.steps >= len(plain.token_ids) - 1
    assert list(plain.token_ids) == reference(path, ids, target.tokenizer.pad_token_id)
    steps = lean.steps
    _, trees = run(engine)  # draft-free trees
    assert trees.token_ids == plain.token_ids
    assert lean.steps > steps
    # a noisy-copy draft's passes (each tree level a pass; a hybrid draft's levels after the first
    # read the earlier levels' pending nodes: the general path) and the target's trees, lean
    draft = load_model(tiny_model(arch, seed=0, noise=0.05, layers=LAYERS, cache_dir=model_cache))
    drafting = draft.model.lean = forced(draft.model)
    steps = lean.steps
    _, drafted = run(Engine(target.model, target.tokenizer, draft.model), budget=16, max_depth=6)
    assert drafted.token_ids == plain.token_ids and drafted.stats.tokens_per_pass > 1.3
    assert lean.steps - steps == drafted.stats.target_passes
    assert drafting.steps > (0 if any(target.model.linear) else drafted.stats.target_passes)


@pytest.mark.parametrize("arch", ["qwen3", "gpt_oss", "gemma3_text", "gemma4_text"])
def test_models_it_cannot_run_are_refused(arch: str, model_cache: Path) -> None:
    model = load_model(tiny_model(arch, seed=0, layers=LAYERS, cache_dir=model_cache)).model
    why = refusal(model)
    assert why is not None and LeanStep.of(model, anywhere=True) is None
    if arch == "qwen3":  # the tiny qwen3 has sliding layers
        assert "sliding" in why


def test_switches(model_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = load_model(tiny_model("llama", seed=0, layers=LAYERS, cache_dir=model_cache)).model
    assert refusal(model) is None and LeanStep.of(model) is None  # a CPU model keeps its own paths
    monkeypatch.setenv("SPECCHAT_NO_LEAN", "1")
    assert refusal(model) == "SPECCHAT_NO_LEAN"
    monkeypatch.delenv("SPECCHAT_NO_LEAN")
    lean = forced(model)
    cache = model.new_cache(8)
    with torch.inference_mode():
        model.forward(torch.arange(3, 8), torch.arange(5), cache, None)
    assert lean.takes(cache, 1, None) and lean.takes(cache, 2, None)
    assert lean.takes(cache, 1, torch.tensor([[True] * 4 + [False, True]]))
    assert lean.takes(cache, lean_step.MAX_TOKENS, None)
    assert not lean.takes(cache, lean_step.MAX_TOKENS + 1, None)  # long passes: the general path


class FakeGraphs:
    """Stands in for lean_step.CudaGraphs on the CPU (only the GPU is faked): a capture keeps its
    segment and a replay runs it again, so the bookkeeping around graphs (when to capture, which
    buffers, the states the warm-ups fold, replays) runs as on a GPU."""

    def __init__(self, device: torch.device) -> None:
        self.warmed = 0

    def warm(self, run: Callable[[], object]) -> None:
        self.warmed += 1
        run()

    def pool(self) -> None:
        return None

    def capture(self, run: Callable[[], object], pool: None) -> SimpleNamespace:
        return SimpleNamespace(replay=run)

    def settle(self) -> None:
        pass


class BrokenGraphs(FakeGraphs):
    def capture(self, run: Callable[[], object], pool: None) -> SimpleNamespace:
        raise RuntimeError("operation not permitted when stream is capturing")


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen3_5_text"])
def test_graph_bookkeeping_with_a_fake_gpu(arch: str, model_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Captured at a buffer set's CAPTURE_AT-th pass, again for a grown cache, replayed once a
    segment a pass; the warm-ups' folds into a hybrid's states put back (else the replays would
    fold the tokens again and the outputs would differ)."""
    monkeypatch.setattr(lean_step, "CudaGraphs", FakeGraphs)
    model = load_model(tiny_model(arch, seed=0, layers=LAYERS, cache_dir=model_cache)).model
    lean = forced(model)
    lean.graphed, lean.why_eager = True, None
    assert_graphs_replay(model, lean, passes=not any(model.linear))


@pytest.mark.parametrize("graphs", [False, True])
def test_a_draft_heads_layer_inputs_come_out_of_the_segments(graphs: bool, model_cache: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """An EAGLE-3 head reads the inputs of some layers (CausalLM.read_layer_inputs): the first
    layer's (the embedding), and layers that start a segment (after an MoE layer) or sit inside
    one, eager or from (fake) graphs, as the general path keeps them."""
    monkeypatch.setattr(lean_step, "CudaGraphs", FakeGraphs)
    model = load_model(tiny_model("qwen3_moe", seed=0, layers=LAYERS, cache_dir=model_cache)).model
    lean = forced(model)
    lean.graphed, lean.why_eager = graphs, None
    model.read_layer_inputs((0, 1, 2))  # layer 0 dense, 1-3 MoE: segments (0, 2), (2, 3), ...
    worst, _ = twin_steps(model, lean, steps=12, capacity=32)
    assert worst < 5e-6 and lean.steps == 12 and lean.replays == (10 * len(lean.segments) if graphs else 0), worst
    assert twin_passes(model, lean, [3, 8, 1, 5] * 3, capacity=512) < 5e-6


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen3_5_text"])
def test_a_failed_capture_leaves_eager_passes_and_the_states_as_they_were(
        arch: str, model_cache: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(lean_step, "CudaGraphs", BrokenGraphs)
    model = load_model(tiny_model(arch, seed=0, layers=LAYERS, cache_dir=model_cache)).model
    lean = forced(model)
    lean.graphed, lean.why_eager = True, None
    with caplog.at_level("WARNING", logger="engine.model.lean_step"):
        worst, _ = twin_steps(model, lean, steps=12, capacity=32)
    assert worst < 5e-6, worst
    assert not lean.graphed and lean.why_eager == "RuntimeError: operation not permitted when stream is capturing"
    assert lean.captures == 0 and lean.replays == 0
    assert sum("without CUDA graphs" in r.getMessage() for r in caplog.records) == 1  # said once


class TreeBrokenGraphs(FakeGraphs):
    """Captures a step's segments, fails on a hybrid tree's (a Gated DeltaNet tree op a graph
    could not hold)."""

    def capture(self, run: Callable[[], object], pool: None) -> SimpleNamespace:
        if run.args[1].slots.tree is not None:  # type: ignore[attr-defined]  # functools.partial(_segment, s, bufs)
            raise RuntimeError("operation not permitted when stream is capturing")
        return super().capture(run, pool)


def test_a_hybrid_tree_that_cannot_be_captured_leaves_the_steps_their_graphs(
        model_cache: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(lean_step, "CudaGraphs", TreeBrokenGraphs)
    model = load_model(tiny_model("qwen3_5_text", seed=0, layers=LAYERS, cache_dir=model_cache)).model
    lean = forced(model)
    lean.graphed, lean.why_eager = True, None
    with caplog.at_level("WARNING", logger="engine.model.lean_step"):
        worst = twin_passes(model, lean, [1, 6, 1, 7, 1, 5, 1, 8, 1, 6], capacity=64)
    assert worst < 2e-5, worst
    assert lean.graphed and lean.why_eager is None and lean.why_no_trees is not None
    assert lean.captures == 1 and lean.replays == 3 * len(lean.segments)  # the one-token steps' bucket
    assert lean.steps == 5 + 3  # the steps, and the trees until the third failed to be captured
    assert sum("tree passes run on the general path" in r.getMessage() for r in caplog.records) == 1


def assert_graphs_replay(model: CausalLM, lean: LeanStep, passes: bool = True) -> None:
    worst, _ = twin_steps(model, lean, steps=24, capacity=8)
    assert lean.why_eager is None, lean.why_eager
    # graphs from a buffer set's CAPTURE_AT-th pass: the 8-column cache sees one step, the 16- and
    # 32-column ones (grown) 8 and 15, their first CAPTURE_AT - 1 eager
    assert lean.captures == 2 and lean.replays == (24 - 1 - 2 * (lean_step.CAPTURE_AT - 1)) * len(lean.segments)
    assert worst < 5e-6, worst
    worst, cache = twin_steps(model, lean, steps=6, capacity=32, poison=True)
    assert cache.capacity == 32 and worst < 5e-6, worst
    if passes:
        captures = lean.captures
        # buckets of 4, 8 and 16 tokens reading 256 columns (a cache that never grows): captured at
        # their third pass; the bucket of 2 runs once, eagerly
        assert twin_passes(model, lean, [3, 8, 13] * 3 + [2], capacity=512) < 5e-6
        assert lean.captures == captures + 3


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
def test_cuda_graphs_replay_the_general_paths_steps(arch: str, model_cache: Path) -> None:
    """On a GPU the step is taken by itself and replays one graph a segment: the general path's
    states, across a cache that grows (captured again) and whose unwritten columns hold NaN, and
    passes in buckets."""
    model = load_model(tiny_model(arch, seed=0, layers=LAYERS, cache_dir=model_cache), "cuda").model
    lean = model.lean
    assert lean is not None and lean.graphed, refusal(model)
    assert_graphs_replay(model, lean)

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_graphs_replay_a_hybrids_trees(model_cache: Path) -> None:
    """A Qwen3.5's trees on committed text in real graphs (its Gated DeltaNet tree: the tables'
    gathers, pointer jumps and triangular solves captured): the general path's outputs and kept
    states."""
    model = load_model(tiny_model("qwen3_5_text", seed=0, layers=LAYERS, cache_dir=model_cache), "cuda").model
    lean = model.lean
    assert lean is not None and lean.graphed, refusal(model)
    worst = twin_passes(model, lean, [1, 6, 1, 7, 1, 5, 1, 8], capacity=64)
    assert lean.why_eager is None, lean.why_eager
    assert worst < 2e-5 and lean.captures == 2 and lean.replays == 4 * len(lean.segments), worst
