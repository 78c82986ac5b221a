"""The self-draft (engine.loading.self_draft) and its low-bit weights (engine.offload.lowbit), on
real tiny models loaded with their layers offloaded, checked against plain transformers."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.decoding.drafting import copy_of_target
from engine.decoding.generation import Engine
from engine.errors import UsageError
from engine.loading.load import LoadedModel, load_model
from engine.loading.materialise import layer_template
from engine.loading.self_draft import (
    SELF_DRAFT_BITS,
    build_self_draft,
    cache_key,
    fitting_bits,
    offloaded_layers,
    substitute_bytes,
)
from engine.model.causal_lm import CausalLM
from engine.offload import lowbit
from engine.offload.streamer import LayerHome, LayerStreamer
from engine.testing.synthetic import tiny_gguf
from engine.types import Completion, GenerationRequest, SpeculationSettings

PROMPTS = ["Paris is the capital of", "def add(a, b):"]


# ---- low-bit weights ------------------------------------------------------------------------
@pytest.mark.parametrize("bits", lowbit.BITS)
def test_codes_pack_and_unpack_exactly(bits: int) -> None:
    g = torch.Generator().manual_seed(bits)
    codes = torch.randint(0, 2**bits, (8 * 97,), generator=g, dtype=torch.uint8)
    packed = lowbit.pack(codes, bits)
    assert packed.numel() == lowbit.packed_nbytes(codes.numel(), bits)
    assert torch.equal(lowbit.unpack(packed, bits), codes.to(torch.int32))


@pytest.mark.parametrize("bits", lowbit.BITS)
def test_quantised_weight_lies_on_its_grid_and_beats_rounding_the_range(bits: int) -> None:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(96, 256, generator=g) * 0.02
    w[3, 17] = 0.5  # an outlier: its group's range is wide
    packed, scale, offset = lowbit.quantize(w, bits, 64)
    assert packed.numel() * 8 / w.numel() == bits and scale.dtype == torch.float16 and scale.numel() == w.numel() // 64
    out = torch.empty_like(w)
    lowbit.dequantize_into(packed, scale, offset, bits, out)
    q = (out.view(-1, 64) - offset.float()[:, None]) / scale.float()[:, None]
    assert torch.allclose(q, q.round(), atol=1e-3) and float(q.min()) > -1e-3 and float(q.max()) < 2**bits - 1 + 1e-3
    groups = w.view(-1, 64)
    lo, hi = groups.amin(1), groups.amax(1)
    step = (hi - lo) / (2**bits - 1)
    plain = ((groups - lo[:, None]) / step[:, None]).round() * step[:, None] + lo[:, None]
    err, plain_err = float((out.view(-1, 64) - groups).square().mean()), float((plain - groups).square().mean())
    assert err < 0.95 * plain_err, (err, plain_err)
    assert err < 0.25 * float(w.square().mean()) / 4 ** (bits - 2)  # 2 bits: within a quarter of the weight's power


def test_widths_outside_the_supported_ones_are_refused() -> None:
    with pytest.raises(ValueError, match="bits"):
        lowbit.quantize(torch.zeros(8, 64), 5, 64)
    assert lowbit.group_of((7, 48)) is None and lowbit.group_of((64,)) is None and lowbit.group_of((3, 96)) == 32


# ---- the self-draft -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def offloaded(tiny_target_path: Path) -> LoadedModel:
    """The tiny target with every decoder layer streamed from RAM: the self-draft substitutes them all."""
    return load_model(tiny_target_path, offload="all")


def greedy(engine: Engine, prompt: str, budget: int, n: int = 32) -> Completion:
    req = GenerationRequest(raw_prompt=prompt, max_new_tokens=n, speculation=SpeculationSettings(budget=budget,
                                                                                               max_depth=8, switch_draft=False))
    out = list(engine.generate(req))[-1]
    assert isinstance(out, Completion)
    return out


def reference(model: LoadedModel, ids: list[int], n: int) -> list[int]:
    x = torch.tensor([ids])
    out = model.model.hf_model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False,
                                        pad_token_id=model.tokenizer.pad_token_id)
    return out[0, len(ids):].tolist()


@pytest.mark.parametrize("bits", [4, 2])
def test_greedy_text_with_a_self_draft_equals_plain_transformers(offloaded: LoadedModel, tiny_target: LoadedModel,
                                                                 tmp_path: Path, bits: int) -> None:
    draft = build_self_draft(offloaded.model, bits, cache_dir=tmp_path)
    info = draft.self_draft  # type: ignore[attr-defined]
    assert (info.bits, info.substituted, info.resident, info.cached) == (bits, 2, 0, False)
    assert copy_of_target(offloaded.model, draft), "the self-draft reads the target's K/V (shared context)"
    engine = Engine(offloaded.model, offloaded.tokenizer, draft)
    per_pass = []
    for prompt in PROMPTS:
        for budget in (8, 32):
            got = greedy(engine, prompt, budget)
            ref = reference(tiny_target, engine.encode(GenerationRequest(raw_prompt=prompt)), 32)
            assert list(got.token_ids) == ref[: len(got.token_ids)], (bits, prompt, budget)
            assert got.stats.draft_passes > 0
            per_pass.append(got.stats.tokens_per_pass)
    if bits == 4:  # drafts are accepted beyond the root (a random tiny model's flat distributions keep trees
        assert min(per_pass) > 1.5, per_pass  # shallow: even the target itself as its draft gives ~3 a pass)


def test_the_draft_logits_follow_the_bits(offloaded: LoadedModel, tmp_path: Path) -> None:
    """Wider substitutes give logits nearer the target's: the substitutes really run."""
    ids = torch.tensor(offloaded.tokenizer("Once upon a time there was a little robot")["input_ids"])
    pos = torch.arange(ids.shape[0])

    def logits(model: CausalLM) -> torch.Tensor:
        return model.logits(model.forward(ids, pos, model.new_cache(), None))

    ref = logits(offloaded.model)
    errs = [float((logits(build_self_draft(offloaded.model, b, cache_dir=None)) - ref).square().mean()) for b in (2, 3, 4)]
    assert errs[0] > errs[1] > errs[2] > 0, errs


def test_substitutes_are_saved_read_back_and_rebuilt_when_damaged(offloaded: LoadedModel, tmp_path: Path) -> None:
    first = build_self_draft(offloaded.model, 3, cache_dir=tmp_path)
    files = list(tmp_path.glob("*.safetensors"))
    assert len(files) == 1 and files[0].stem == cache_key(offloaded.model, 3, [0, 1])
    again = build_self_draft(offloaded.model, 3, cache_dir=tmp_path)
    assert again.self_draft.cached  # type: ignore[attr-defined]
    for a, b in zip(first.streamer.homes, again.streamer.homes):  # type: ignore[union-attr]
        assert a.packed is not None and b.packed is not None and torch.equal(a.packed, b.packed)
    data = files[0].read_bytes()
    for damaged in (data[: len(data) // 2], b"\x00" * 64, data.replace(b"specchat-self-draft-1", b"specchat-self-draft-0")):
        files[0].write_bytes(damaged)
        rebuilt = build_self_draft(offloaded.model, 3, cache_dir=tmp_path)
        assert not rebuilt.self_draft.cached  # type: ignore[attr-defined]
        assert build_self_draft(offloaded.model, 3, cache_dir=tmp_path).self_draft.cached, "saved again"  # type: ignore[attr-defined]
    assert cache_key(offloaded.model, 2, [0, 1]) != cache_key(offloaded.model, 3, [0, 1])
    offloaded.model.fingerprint, saved = offloaded.model.fingerprint + "x", offloaded.model.fingerprint
    try:
        assert cache_key(offloaded.model, 3, [0, 1]) != files[0].stem, "a changed target has a new key"
    finally:
        offloaded.model.fingerprint = saved


def test_bits_are_sized_to_the_memory_left(offloaded: LoadedModel) -> None:
    sizes = {b: substitute_bytes(offloaded.model, b) for b in SELF_DRAFT_BITS}
    assert sizes[4] > sizes[3] > sizes[2] > 0
    assert fitting_bits(offloaded.model, sizes[4]) == 4
    assert fitting_bits(offloaded.model, sizes[4] - 1) == 3
    assert fitting_bits(offloaded.model, sizes[2]) == 2 and fitting_bits(offloaded.model, sizes[2] - 1) is None
    draft = build_self_draft(offloaded.model, 3, cache_dir=None)
    assert draft.self_draft.nbytes == sizes[3]  # type: ignore[attr-defined]


def test_a_resident_target_has_no_self_draft(tiny_target: LoadedModel) -> None:
    assert offloaded_layers(tiny_target.model) == [] and substitute_bytes(tiny_target.model, 3) == 0
    with pytest.raises(UsageError, match="--draft none"):
        build_self_draft(tiny_target.model, 3)
    with pytest.raises(UsageError, match="bits"):
        build_self_draft(tiny_target.model, 8)


def test_resident_layers_serve_the_draft_as_they_are(model_cache: Path) -> None:
    """Layer 0 resident, layer 1 streamed (a GPU placement, here on the CPU): only layer 1 gets a
    substitute; greedy text stays the target's. The target here is a GGUF file (its layers
    streamed as Q8_0 and Q4_0 blocks), so the substitutes come from de-quantised blocks."""
    gguf = tiny_gguf("llama", layers=2, layer_types=("Q8_0", "Q4_0"), cache_dir=model_cache)
    streamed = load_model(gguf, offload="all")
    resident = load_model(gguf)
    old = streamed.model.streamer
    assert old is not None
    homes = [LayerHome(module=resident.model.layers[0]), old.homes[1]]
    mixed = CausalLM(streamed.model.hf_model, LayerStreamer(homes, old.layouts, old.store,
                                                            layer_template(streamed.model.hf_model), old.device, 2),
                     streamed.model.placement, fingerprint=streamed.model.fingerprint)
    draft = build_self_draft(mixed, 4, cache_dir=None)
    info = draft.self_draft  # type: ignore[attr-defined]
    assert (info.substituted, info.resident) == (1, 1)
    assert draft.streamer is not None and draft.streamer.homes[0].module is resident.model.layers[0]
    engine = Engine(mixed, streamed.tokenizer, draft)
    got = greedy(engine, PROMPTS[1], 16, n=24)
    plain = list(Engine(resident.model, resident.tokenizer).generate(GenerationRequest(
        raw_prompt=PROMPTS[1], max_new_tokens=24, speculation=SpeculationSettings(mode="autoregressive"))))[-1]
    assert isinstance(plain, Completion) and got.token_ids == plain.token_ids
    assert got.stats.tokens_per_pass > 2.0
