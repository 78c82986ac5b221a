"""The self-draft (engine.loading.self_draft) and its low-bit weights (engine.offload.lowbit), on
real tiny models loaded with their layers offloaded, checked against plain transformers."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.decoding.drafting import copy_of_target
from engine.decoding.generation import Engine
from engine.errors import UsageError
from engine.loading.load import LoadedModel, load_model
from engine.loading.materialise import layer_template
from engine.loading.self_draft import (
    FORMAT,
    SELF_DRAFT_BITS,
    build_self_draft,
    cache_key,
    fitting_bits,
    offloaded_layers,
    substitute_bytes,
)
from engine.model.causal_lm import CausalLM
from engine.offload import calibrate, lowbit
from engine.offload.streamer import LayerHome, LayerStreamer
from engine.testing.synthetic import tiny_gguf, tiny_model
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


def group_params(scale: torch.Tensor, offset: torch.Tensor, rows: torch.Tensor, cols: int,
                 group: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """Each group's (s, m) as the bytes and the rows' factors give them, (groups,) fp32."""
    s, m = lowbit.from_bytes(scale.view(-1, cols // group), offset.view(-1, cols // group), rows)
    return s.reshape(-1), m.reshape(-1)


@pytest.mark.parametrize("bits", lowbit.BITS)
def test_quantised_weight_lies_on_its_grid_and_beats_rounding_the_range(bits: int) -> None:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(96, 256, generator=g) * 0.02
    w[3, 17] = 0.5  # an outlier: its group's range is wide
    w[5, 64:96] = w[5, 64:96] * 0.01 - 0.3  # a group of tiny spread far from zero: its offset is the row's largest
    packed, scale, offset, rows = lowbit.quantize(w, bits, 32, uniform=True)
    assert packed.numel() * 8 / w.numel() == bits and scale.dtype == torch.uint8 and offset.dtype == torch.int8
    assert scale.numel() == offset.numel() == w.numel() // 32 and rows.shape == (96, 2) and rows.dtype == torch.float16
    out = torch.empty_like(w)
    lowbit.dequantize_into(packed, scale, offset, rows, bits, out, uniform=True)
    s, m = group_params(scale, offset, rows, 256)
    q = (out.view(-1, 32) - m[:, None]) / s[:, None]
    assert torch.allclose(q, q.round(), atol=1e-3) and float(q.min()) > -1e-3 and float(q.max()) < 2**bits - 1 + 1e-3
    groups = w.view(-1, 32)
    lo, hi = groups.amin(1), groups.amax(1)
    step = (hi - lo) / (2**bits - 1)
    plain = ((groups - lo[:, None]) / step[:, None]).round() * step[:, None] + lo[:, None]
    err, plain_err = float((out.view(-1, 32) - groups).square().mean()), float((plain - groups).square().mean())
    assert err < 0.95 * plain_err, (err, plain_err)
    assert err < 0.25 * float(w.square().mean()) / 4 ** (bits - 2)  # 2 bits: within a quarter of the weight's power


@pytest.mark.parametrize("bits", lowbit.BITS)
def test_byte_group_parameters_cost_a_fraction_of_what_the_groups_gain(bits: int) -> None:
    """(s, m) in a byte each under the rows' fp16 factors: the weight's error is within a few per
    cent of the same fit with float (s, m), and groups of 32 stored so beat groups of 64 with
    fp16 (s, m) at the same bits a weight (what the self-draft kept before)."""
    g = torch.Generator().manual_seed(4)
    w = torch.randn(64, 512, generator=g) * 0.02 * (torch.rand(64, 1, generator=g) + 0.2)
    err = float((lowbit.roundtrip(w, bits) - w).square().mean())
    grid = lowbit.levels(bits, w.device)
    floats = {}
    for group in (32, 64):
        q, s, m = lowbit.fit_groups(w.view(-1, group).float(), bits, grid)
        value = q.float() if grid is None else grid[q.long()]
        floats[group] = float((value * s.float()[:, None] + m.float()[:, None] - w.view(-1, group)).square().mean())
    assert err < 1.08 * floats[32], (err, floats)
    assert err < 0.9 * floats[64], (err, floats)


@pytest.mark.parametrize("bits", lowbit.BITS)
def test_column_scaled_codes_round_trip(bits: int) -> None:
    """quantize(w, c) codes w * c; dequantize_into(c) divides the columns again: the weight comes
    back with w * c on its group's grid, and c = 1 is the plain quantiser bit for bit."""
    g = torch.Generator().manual_seed(1)
    w = torch.randn(64, 128, generator=g) * 0.02
    c = (torch.rand(128, generator=g) * 8 + 0.25).half()
    packed, scale, offset, rows = lowbit.quantize(w, bits, 32, c, uniform=True)
    out = torch.empty_like(w)
    lowbit.dequantize_into(packed, scale, offset, rows, bits, out, c, uniform=True)
    s, m = group_params(scale, offset, rows, 128)
    q = ((out * c.float()).view(-1, 32) - m[:, None]) / s[:, None]
    assert torch.allclose(q, q.round(), atol=1e-2) and float(q.min()) > -1e-2 and float(q.max()) < 2**bits - 1 + 1e-2
    plain, ones = lowbit.roundtrip(w, bits), lowbit.roundtrip(w, bits, 32, torch.ones(128, dtype=torch.float16))
    assert torch.equal(plain, ones)


@pytest.mark.parametrize("bits", [2, 3])
def test_activation_aware_scaling_cuts_the_output_error_on_outlier_channels(bits: int) -> None:
    """Inputs with a few large channels (as small LLMs have): the scaled codes give a lower output
    error than the plain ones, on held-out inputs of the same kind, not only on the calibration's."""
    g = torch.Generator().manual_seed(2)
    w = torch.randn(128, 256, generator=g) * 0.02
    gain = torch.ones(256)
    gain[torch.randperm(256, generator=g)[:6]] = 40.0

    def inputs(n: int) -> torch.Tensor:
        return torch.randn(n, 256, generator=g) * gain

    x, held = inputs(256), inputs(256)
    packed, scale, offset, rows, c = calibrate.quantise_aware(w, x, bits, 32)
    aware = torch.empty_like(w)
    lowbit.dequantize_into(packed, scale, offset, rows, bits, aware, c)
    plain = lowbit.roundtrip(w, bits)
    ref = held @ w.T
    err, plain_err = float((held @ aware.T - ref).square().mean()), float((held @ plain.T - ref).square().mean())
    assert err < 0.7 * plain_err, (err, plain_err)
    assert not torch.equal(c, torch.ones_like(c)), "an alpha above 0 was chosen"


def test_three_bit_codes_index_normal_quantile_levels() -> None:
    """At 3 bits the codes stand for 8 normal-quantile levels (denser in the middle): the weight
    comes back on those levels, and on Gaussian weights with a lower error than the uniform grid."""
    grid = lowbit.levels(3, torch.device("cpu"))
    assert grid is not None and grid.shape == (8,) and float(grid[0]) == 0 and abs(float(grid[-1]) - 7) < 1e-5
    steps = grid.diff()
    assert float(steps[3]) < float(steps[0]) and torch.allclose(steps, steps.flip(0), atol=1e-5)
    assert lowbit.levels(4, torch.device("cpu")) is None and lowbit.levels(3, torch.device("cpu"), uniform=True) is None
    g = torch.Generator().manual_seed(3)
    w = torch.randn(128, 256, generator=g) * 0.02
    packed, scale, offset, rows = lowbit.quantize(w, 3, 32)
    out = torch.empty_like(w)
    lowbit.dequantize_into(packed, scale, offset, rows, 3, out)
    s, m = group_params(scale, offset, rows, 256)
    t = (out.view(-1, 32) - m[:, None]) / s[:, None]
    assert float((t[..., None] - grid).abs().amin(-1).max()) < 1e-2
    err = float((out - w).square().mean())
    assert err < 0.98 * float((lowbit.roundtrip(w, 3, uniform=True) - w).square().mean())  # groups of 32: ~3 % lower


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
    hf: Any = model.model.hf_model  # (typed as a Module, whose attributes type as Tensor)
    tokenizer: Any = model.tokenizer
    out = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False,
                      pad_token_id=tokenizer.pad_token_id)
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


def test_calibration_inputs_are_each_linears_inputs(offloaded: LoadedModel, tiny_target: LoadedModel) -> None:
    """collect_inputs, run on the streamed target, keeps per layer each Linear's inputs by weight
    name: the same rows that plain transformers feeds those Linears."""
    ids = calibrate.calibration_ids(offloaded.tokenizer)
    assert len(ids) > 200
    got = calibrate.collect_inputs(offloaded.model, ids, [1])
    assert list(got) == [1]
    hf = tiny_target.model.hf_model
    seen: dict[str, torch.Tensor] = {}
    layer = hf.model.layers[1]
    hooks = [m.register_forward_hook(lambda mod, a, o, n=n: seen.__setitem__(n + ".weight", a[0][0]))
             for n, m in layer.named_modules() if isinstance(m, torch.nn.Linear)]
    try:
        hf(torch.tensor([ids]))
    finally:
        for h in hooks:
            h.remove()
    assert set(got[1]) == set(seen) and "mlp.down_proj.weight" in seen
    rows = torch.linspace(0, len(ids) - 1, min(calibrate.MAX_ROWS, len(ids))).long()
    for name, x in got[1].items():
        assert torch.allclose(x, seen[name][rows].float(), atol=1e-4, rtol=1e-3), name


def test_a_calibrated_self_draft_keeps_greedy_text_and_its_own_cache(offloaded: LoadedModel, tiny_target: LoadedModel,
                                                                    tmp_path: Path) -> None:
    """With the tokenizer, the substitutes carry column scales (not all 1), are cached under
    another key than the uncalibrated ones, and greedy text is still plain transformers'."""
    draft = build_self_draft(offloaded.model, 3, cache_dir=tmp_path, tokenizer=offloaded.tokenizer)
    ids = calibrate.calibration_ids(offloaded.tokenizer)
    assert cache_key(offloaded.model, 3, [0, 1], ids) != cache_key(offloaded.model, 3, [0, 1])
    assert [f.stem for f in tmp_path.glob("*.safetensors")] == [cache_key(offloaded.model, 3, [0, 1], ids)]
    assert draft.streamer is not None
    layout, packed = draft.streamer.layouts[0], draft.streamer.homes[0].packed
    assert packed is not None
    widths = {e.name: e.qtype for e in layout.entries if e.kind == "lowbit"}
    assert widths["self_attn.v_proj.weight"] == 4, widths
    assert widths["self_attn.q_proj.weight"] == widths["self_attn.k_proj.weight"] == widths["mlp.down_proj.weight"] \
        == 3, widths
    scales = [layout.view(packed, e) for e in layout.entries if e.name.endswith("#cscale")]
    assert scales and any(not torch.equal(c, torch.ones_like(c)) for c in scales)
    engine = Engine(offloaded.model, offloaded.tokenizer, draft)
    for prompt in PROMPTS:
        got = greedy(engine, prompt, 16)
        ref = reference(tiny_target, engine.encode(GenerationRequest(raw_prompt=prompt)), 32)
        assert list(got.token_ids) == ref[: len(got.token_ids)], prompt
    again = build_self_draft(offloaded.model, 3, cache_dir=tmp_path, tokenizer=offloaded.tokenizer)
    assert again.self_draft.cached  # type: ignore[attr-defined]


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
    assert FORMAT != "specchat-self-draft-2", "the damaged file below is a version-2 one"
    first = build_self_draft(offloaded.model, 3, cache_dir=tmp_path)
    files = list(tmp_path.glob("*.safetensors"))
    assert len(files) == 1 and files[0].stem == cache_key(offloaded.model, 3, [0, 1])
    again = build_self_draft(offloaded.model, 3, cache_dir=tmp_path)
    assert again.self_draft.cached  # type: ignore[attr-defined]
    for a, b in zip(first.streamer.homes, again.streamer.homes):  # type: ignore[union-attr]
        assert a.packed is not None and b.packed is not None and torch.equal(a.packed, b.packed)
    data = files[0].read_bytes()
    for damaged in (data[: len(data) // 2], b"\x00" * 64, data.replace(FORMAT.encode(), b"specchat-self-draft-2")):
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


def test_an_moe_self_draft_scales_its_experts_gate_up_columns(model_cache: Path, tmp_path: Path) -> None:
    """An MoE target (fused experts): the calibration keeps the experts' inputs (every token's
    hidden state), so the substitutes of gate/up carry column scales shared by all experts, and
    the down projection (each expert's own inputs) stays unscaled; greedy text is the target's.
    (A few of the experts' input channels are made 30 times the others, as small LLMs have them.)"""
    folder = tmp_path / "moe"
    shutil.copytree(tiny_model("qwen3_moe", seed=0, layers=2, cache_dir=model_cache), folder)
    state = load_file(folder / "model.safetensors")
    for i in (0, 1):
        state[f"model.layers.{i}.post_attention_layernorm.weight"][:3] *= 30
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    offloaded = load_model(folder, offload="all")
    ids = calibrate.calibration_ids(offloaded.tokenizer)
    seen = calibrate.collect_inputs(offloaded.model, ids, [0, 1])
    hidden = int(offloaded.model.config.hidden_size)
    assert seen[1]["mlp.experts.gate_up_proj"].shape == (min(calibrate.MAX_ROWS, len(ids)), hidden)
    draft = build_self_draft(offloaded.model, 3, cache_dir=None, tokenizer=offloaded.tokenizer)
    assert draft.streamer is not None
    layout, packed = draft.streamer.layouts[1], draft.streamer.homes[1].packed
    assert packed is not None
    scales = {e.name: layout.view(packed, e) for e in layout.entries if e.name.endswith("#cscale")}
    kinds = {e.name: e.kind for e in layout.entries}
    gate_up = scales["mlp.experts.gate_up_proj#cscale"]
    assert gate_up.shape == (hidden,)
    assert not torch.equal(gate_up, torch.ones_like(gate_up)), "an alpha above 0 was chosen for the experts"
    down = scales.get("mlp.experts.down_proj#cscale")  # (dense here: the tiny experts' width, 48, takes no group)
    assert kinds["mlp.experts.down_proj"] == "dense" or (down is not None and torch.equal(down, torch.ones_like(down)))
    assert kinds["mlp.gate.weight"] == "dense", "the router stays as the target has it"
    plain = load_model(folder)
    engine = Engine(offloaded.model, offloaded.tokenizer, draft)
    got = greedy(engine, PROMPTS[0], 16, n=16)
    assert list(got.token_ids) == reference(plain, engine.encode(GenerationRequest(raw_prompt=PROMPTS[0])), 16)
