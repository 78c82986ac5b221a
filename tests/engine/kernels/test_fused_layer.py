"""The fused decoding step and pass (engine/kernels/fused_layer.py, qmatmul.c's qm_decode_layers
and qm_pass_layers): for packed llama, qwen2 (q/k/v biases) and qwen3 (per-head q/k norms) models,
with sliding windows or without, and packed MoEs (Qwen3-MoE, Mixtral, gpt-oss) they compute the
hidden states and the K/V transformers' own layer modules compute on the same packed weights
(fp32 rounding apart), step after step while the cache grows, rolls back and drops what its
windows left behind, and for chains and tree passes under any mask; greedy text, plain and
speculative, is the text without them and transformers' on the de-quantised GGUF; everything else
(unpacked Linears, other caches, passes past FUSED_PASS_TOKENS, SPECCHAT_NO_FUSED=1) keeps the
general path."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import (AutoConfig, AutoModelForCausalLM, AutoTokenizer, Gemma3TextConfig, LlamaConfig,
                          MistralConfig, PretrainedConfig, PreTrainedModel, Qwen2Config, Qwen3Config)

from engine.decoding.generation import Engine
from engine.kernels import build
from engine.kernels.fused_layer import LINEARS, FusedDecoder
from engine.kernels.linear import PackedLinear, dequantize, from_codes, from_dense, from_nibbles, qlinear
from engine.loading.gguf import isolated
from engine.loading.load import load_model
from engine.model import causal_lm
from engine.model.causal_lm import CausalLM
from engine.model.window_cache import WindowedCache
from engine.store.gguf_header import read_header
from engine.testing.random_gguf import synthetic_gpt_oss_gguf
from engine.testing.synthetic import tiny_gguf, tiny_model
from engine.types import Completion, DecodeMode, GenerationRequest, SpeculationSettings

PROMPTS = ["Paris is the capital of", "def add(a, b):"]


@pytest.fixture(scope="module", autouse=True)
def lib() -> object:
    found = build.kernels()
    if found is None:
        pytest.skip("no C compiler here")
    return found


@pytest.fixture(autouse=True)
def _cache_dir(model_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPECCHAT_CACHE_DIR", str(model_cache))
    monkeypatch.delenv("SPECCHAT_NO_FUSED", raising=False)


@pytest.fixture
def fused_passes(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """The token count of each pass that took the fused several-token path (the real pass)."""
    calls: list[int] = []
    real = FusedDecoder.pass_

    def counted(self: FusedDecoder, input_ids: torch.Tensor, positions: torch.Tensor, cache: object,
                *rest: Any) -> torch.Tensor:
        calls.append(int(input_ids.shape[0]))
        return real(self, input_ids, positions, cache, *rest)  # type: ignore[arg-type]

    monkeypatch.setattr(FusedDecoder, "pass_", counted)
    yield calls


@pytest.fixture
def fused_steps(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """How many steps took the fused path (the real step, counted)."""
    calls: list[int] = []
    real = FusedDecoder.step

    def counted(self: FusedDecoder, input_ids: torch.Tensor, positions: torch.Tensor, cache: object,
                *rest: Any) -> torch.Tensor:
        calls.append(int(positions[0]))
        return real(self, input_ids, positions, cache, *rest)  # type: ignore[arg-type]

    monkeypatch.setattr(FusedDecoder, "step", counted)
    yield calls


def packed(config: PretrainedConfig, seed: int = 0) -> Any:
    """A random model of `config` whose layers' Linears are PackedLinear, Q4 and Q8 mixed."""
    torch.manual_seed(seed)
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for p in hf.parameters():  # peaked logits; norms away from 1, biases away from 0
            p.normal_(0.0, 0.15) if p.ndim == 2 else p.add_(torch.randn_like(p) * 0.2)
    for i, layer in enumerate(hf.model.layers):
        for j, (_, path) in enumerate(LINEARS):
            parent, _, child = path.rpartition(".")
            lin = layer.get_submodule(path)
            weight = from_dense(lin.weight.data, "q4" if (i + j) % 2 else "q8")
            bias = lin.bias.data if lin.bias is not None else None
            setattr(layer.get_submodule(parent), child, PackedLinear(weight, bias))
    return hf


def config(family: str) -> PretrainedConfig:
    common: dict[str, Any] = dict(vocab_size=300, hidden_size=128, intermediate_size=256, num_hidden_layers=3,
                                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                  tie_word_embeddings=False, rms_norm_eps=1e-5)
    if family == "llama":
        return LlamaConfig(**common)
    if family == "qwen2":
        return Qwen2Config(**common, use_sliding_window=False)
    if family == "gemma3":  # windows of 4 on layers 0 and 2, a local and a global rotary table, four norms a layer
        return Gemma3TextConfig(**common, head_dim=32, sliding_window=4, layer_types=None, sliding_window_pattern=2,
                                query_pre_attn_scalar=24, final_logit_softcapping=30.0)
    if family == "mistral":  # every layer slides over 4 positions (the config's window, not the module's)
        return MistralConfig(**common, sliding_window=4)
    if family == "qwen3-window":  # layers 1 and 2 slide over 4 positions (shorter than the tests' passes)
        return Qwen3Config(**common, use_sliding_window=True, sliding_window=4, max_window_layers=1, head_dim=48)
    return Qwen3Config(**common, use_sliding_window=False, head_dim=48)  # wider heads than hidden / heads


def pair(hf: PreTrainedModel, monkeypatch: pytest.MonkeyPatch) -> tuple[CausalLM, CausalLM]:
    """The same model with the fused step and without it (SPECCHAT_NO_FUSED=1 at load)."""
    fused = CausalLM(hf)
    monkeypatch.setenv("SPECCHAT_NO_FUSED", "1")
    plain = CausalLM(hf)
    monkeypatch.delenv("SPECCHAT_NO_FUSED")
    assert fused.fused is not None and plain.fused is None
    return fused, plain


def close(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Within 3e-5 of the largest value. fp32 rows measured about 1e-6 here, the integer rows of
    AVX-512 VNNI CPUs (22-bit activations, qm_digits.h) up to 9e-6; a wrong mask or rotation is off
    by far more."""
    return bool((got - want).abs().max() <= 3e-5 * want.abs().max())


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "qwen3-window", "mistral", "gemma3"])
def test_fused_steps_equal_the_layer_modules(family: str, monkeypatch: pytest.MonkeyPatch,
                                             fused_steps: list[int], fused_passes: list[int]) -> None:
    hf = packed(config(family))
    if family == "qwen2":
        assert hf.model.layers[0].self_attn.q_proj.bias is not None
    if family == "qwen3":
        assert hf.model.layers[0].self_attn.q_norm is not None
    fused, plain = pair(hf, monkeypatch)
    ours, theirs = fused.new_cache(4), plain.new_cache(4)
    prompt = torch.tensor([5, 17, 42, 99, 3])
    fused.forward(prompt, torch.arange(5), ours, None)
    plain.forward(prompt, torch.arange(5), theirs, None)
    assert fused_steps == [] and fused_passes == [5]  # a prompt of several tokens takes the fused pass
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 300, (14,), generator=g)
    for s, token in enumerate(tokens):
        if s == 10:  # roll back three entries: the next step overwrites them
            ours.truncate(ours.length - 3)
            theirs.truncate(theirs.length - 3)
        pos = torch.tensor([ours.length])
        got = fused.forward(token[None], pos, ours, None)
        want = plain.forward(token[None], pos, theirs, None)
        assert got.shape == want.shape == (1, 128)
        assert close(got, want), s
        assert ours.length == theirs.length
        for k1, k2 in zip(ours.tensors(), theirs.tensors()):
            assert close(k1[0], k2[0]) and close(k1[1], k2[1]), s
    assert len(fused_steps) == len(tokens) and ours.capacity >= 16  # every step fused, across two reserve() growths


def tree_mask(parents: list[int], past: torch.Tensor) -> torch.Tensor:
    """(n, len(past) + n) bool: node i sees the past entries `past` allows and its ancestors
    (parents[i] < i, -1 for a root) and itself."""
    n = len(parents)
    own = torch.zeros(n, n, dtype=torch.bool)
    for i, p in enumerate(parents):
        own[i, i] = True
        if p >= 0:
            own[i] |= own[p]
    return torch.cat([past[None].expand(n, -1), own], dim=1)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "qwen3-window", "mistral", "gemma3"])
def test_fused_passes_equal_the_layer_modules(family: str, monkeypatch: pytest.MonkeyPatch,
                                              fused_passes: list[int], fused_steps: list[int]) -> None:
    """Chains and trees: the hidden state of every node and every K/V entry, across a tree,
    keeping its accepted path, a chain with the cache growing, and a mask hiding past entries."""
    fused, plain = pair(packed(config(family), seed=3), monkeypatch)
    ours, theirs = fused.new_cache(4), plain.new_cache(4)
    g = torch.Generator().manual_seed(7)

    def both(tokens: torch.Tensor, positions: torch.Tensor, allowed: torch.Tensor | None) -> None:
        got = fused.forward(tokens, positions, ours, allowed)
        want = plain.forward(tokens, positions, theirs, allowed)
        assert got.shape == want.shape == (len(tokens), 128)
        assert close(got, want)
        assert ours.length == theirs.length
        for k1, k2 in zip(ours.tensors(), theirs.tensors()):
            assert close(k1[0], k2[0]) and close(k1[1], k2[1])

    both(torch.randint(0, 300, (7,), generator=g), torch.arange(7), None)  # a prompt: a chain
    # a tree of 9 nodes over the 7 entries: two roots' branches, depths 1 to 4
    parents = [-1, 0, 0, 1, 1, 3, 2, -1, 7]
    depth = [0] * len(parents)
    for i, p in enumerate(parents):
        depth[i] = depth[p] + 1 if p >= 0 else 0
    both(torch.randint(0, 300, (9,), generator=g), 7 + torch.tensor(depth), tree_mask(parents, torch.ones(7, dtype=torch.bool)))
    for cache in (ours, theirs):  # accept the path 0 -> 1 -> 3 -> 5, as verification keeps it
        cache.keep(torch.tensor([*range(7), 7, 8, 10, 12]))
    both(torch.randint(0, 300, (3,), generator=g), torch.arange(11, 14), None)  # a chain after it
    # a tree whose nodes may not see some past entries (a mask the general path also takes)
    past = torch.ones(14, dtype=torch.bool)
    past[[2, 9]] = False
    both(torch.randint(0, 300, (4,), generator=g), torch.tensor([14, 15, 15, 16]), tree_mask([-1, 0, 0, 2], past))
    ours.truncate(14)
    theirs.truncate(14)  # and two nodes (the integer rows of VNNI CPUs take passes of up to 4)
    both(torch.randint(0, 300, (2,), generator=g), torch.tensor([14, 15]), tree_mask([-1, 0], past))
    # one node under a mask: the several-token path too (the tree above rejected whole)
    ours.truncate(14)
    theirs.truncate(14)
    both(torch.randint(0, 300, (1,), generator=g), torch.tensor([14]), tree_mask([-1], past))
    assert fused_passes == [7, 9, 3, 4, 2, 1] and ours.capacity >= 19
    # one node that sees the whole cache (a tree cut to its root): the one-token step
    both(torch.randint(0, 300, (1,), generator=g), torch.tensor([15]), torch.ones(1, 16, dtype=torch.bool))
    assert fused_passes == [7, 9, 3, 4, 2, 1] and fused_steps == [15]


def greedy(engine: Engine, prompt: str, n: int, mode: DecodeMode = "autoregressive") -> list[int]:
    req = GenerationRequest(raw_prompt=prompt, max_new_tokens=n, speculation=SpeculationSettings(mode=mode, budget=16))
    final = list(engine.generate(req))[-1]
    assert isinstance(final, Completion)
    return list(final.token_ids)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3_text"])
def test_greedy_text_equals_the_general_path_and_transformers(arch: str, model_cache: Path,
                                                                monkeypatch: pytest.MonkeyPatch,
                                                                fused_steps: list[int],
                                                                fused_passes: list[int]) -> None:
    path = tiny_gguf(arch, layers=3, hidden=128, layer_types=("Q4_1", "Q8_0", "Q4_0"),
                     head_type="Q8_0", cache_dir=model_cache)
    with isolated(path) as src:
        tok = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
        config = AutoConfig.from_pretrained(src.parent, gguf_file=src.name)
        if arch == "gemma3_text":  # llama.cpp's attention scale, 1/sqrt(head_dim) (test_gguf_families.py)
            config.query_pre_attn_scalar = read_header(path).metadata["gemma3.attention.key_length"]
        ref = AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name, config=config,
                                                   dtype=torch.float32).eval()
    fused = load_model(path, offload="none")
    assert fused.model.fused is not None
    monkeypatch.setenv("SPECCHAT_NO_FUSED", "1")
    plain = load_model(path, offload="none")
    monkeypatch.delenv("SPECCHAT_NO_FUSED")
    assert plain.model.fused is None
    for prompt in PROMPTS:
        before = len(fused_steps)
        ours = greedy(Engine(fused.model, fused.tokenizer), prompt, 48)
        assert len(fused_steps) - before >= len(ours) - 1  # every step after the prompt's pass
        assert ours == greedy(Engine(plain.model, plain.tokenizer), prompt, 48), prompt
        before = len(fused_passes)  # draft-free trees (as large as the measured costs make them)
        assert greedy(Engine(fused.model, fused.tokenizer), prompt, 48, "specexec") == ours, prompt
        assert len(fused_passes) > before  # the prompt's pass at least; trees: test_fused_passes_*
        x = torch.tensor([tok(prompt)["input_ids"]])
        want = ref.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=48, do_sample=False,
                            pad_token_id=tok.pad_token_id)[0, x.shape[1]:].tolist()
        assert ours == want[: len(ours)] and (len(ours) == 48 or ours[-1] == tok.eos_token_id), prompt


def test_other_models_and_passes_keep_the_general_path(model_cache: Path, monkeypatch: pytest.MonkeyPatch,
                                                       fused_steps: list[int], fused_passes: list[int]) -> None:
    # Linears not packed (the tiny qwen3 family, with a sliding window)
    windowed = AutoModelForCausalLM.from_pretrained(tiny_model("qwen3", cache_dir=model_cache), dtype=torch.float32)
    assert CausalLM(windowed).fused is None
    # a Linear left unpacked
    hf = packed(config("llama"))
    lin = hf.model.layers[1].mlp.down_proj
    hf.model.layers[1].mlp.down_proj = torch.nn.Linear(lin.in_features, lin.out_features, bias=False)
    assert CausalLM(hf).fused is None
    # switched off
    monkeypatch.setenv("SPECCHAT_NO_FUSED", "1")
    assert CausalLM(packed(config("qwen2"))).fused is None
    monkeypatch.delenv("SPECCHAT_NO_FUSED")
    # an eligible model: other caches, and passes longer than FUSED_PASS_TOKENS, take the general path
    model = CausalLM(packed(config("llama")))
    assert model.fused is not None
    monkeypatch.setattr(causal_lm, "FUSED_PASS_TOKENS", 2)
    cache = model.new_cache(8)
    model.forward(torch.tensor([1, 2, 3]), torch.arange(3), cache, None)
    assert fused_passes == []
    model.forward(torch.tensor([4]), torch.tensor([3]), cache, torch.tensor([[True, False, True, True]]))
    assert fused_steps == [] and fused_passes == [1]
    other = WindowedCache(3, 2, 32, torch.float32, "cpu", 8, None, [4, None, None])
    assert not model.fused.takes(other)
    model.forward(torch.tensor([4]), torch.tensor([3]), cache, None)
    assert fused_steps == [3]


def test_a_long_cache_is_read_a_tile_at_a_time_by_each_group_of_heads(monkeypatch: pytest.MonkeyPatch,
                                                                      fused_steps: list[int],
                                                                      fused_passes: list[int]) -> None:
    """Four query heads a K/V head read the keys and values 64 entries at a time (attend_group):
    a 150-token prompt, steps over 2 tiles and a part, and a tree whose mask hides entries on both
    sides of a tile's edge give what the layer modules give, and the same bits at 1 and 3 threads
    (3 threads split a step's two K/V heads' query heads in halves)."""
    cfg = LlamaConfig(vocab_size=300, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=8, num_key_value_heads=2, head_dim=64, max_position_embeddings=512,
                      tie_word_embeddings=False, rms_norm_eps=1e-5)
    fused, plain = pair(packed(cfg, seed=5), monkeypatch)
    ids = torch.randint(0, 300, (160,), generator=torch.Generator().manual_seed(2))
    past = torch.ones(153, dtype=torch.bool)
    past[[0, 63, 64, 128, 150]] = False
    before, runs = torch.get_num_threads(), []
    try:
        for model, threads in ((fused, 1), (fused, 3), (plain, 1)):
            torch.set_num_threads(threads)
            cache = model.new_cache(8)
            outs = [model.forward(ids[:150], torch.arange(150), cache, None)]
            outs += [model.forward(ids[p : p + 1], torch.tensor([p]), cache, None) for p in range(150, 153)]
            outs.append(model.forward(ids[153:158], torch.tensor([153, 154, 154, 155, 155]), cache,
                                      tree_mask([-1, 0, 0, 1, 2], past)))
            runs.append(torch.cat(outs))
    finally:
        torch.set_num_threads(before)
    assert fused_passes == [150, 5] * 2 and fused_steps == [150, 151, 152] * 2
    assert torch.equal(runs[0], runs[1])
    assert close(runs[0], runs[2])


def test_thread_counts_give_the_same_step_and_pass() -> None:
    """Rows, tiles, heads and norms are computed whole by one thread each: the split does not
    change a bit of a step or of a tree pass."""
    model = CausalLM(packed(config("qwen3")))
    before = torch.get_num_threads()
    got = []
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            cache = model.new_cache(8)
            model.forward(torch.tensor([1, 2, 3]), torch.arange(3), cache, None)
            steps = [model.forward(torch.tensor([t]), torch.tensor([2 + t]), cache, None) for t in range(1, 6)]
            tree = model.forward(torch.tensor([4, 5, 6, 7, 8]), torch.tensor([8, 9, 9, 10, 10]), cache,
                                 tree_mask([-1, 0, 0, 1, 2], torch.ones(8, dtype=torch.bool)))
            got.append(torch.cat([*steps, tree]))
    finally:
        torch.set_num_threads(before)
    assert torch.equal(got[0], got[1]) and torch.equal(got[0], got[2])


def cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    return set(next((line for line in text.splitlines() if line.startswith("flags")), "").split())


VNNI = {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"} <= cpu_flags()
# what a CPU without AVX-512 (or without AVX2) gets; on a VNNI CPU the AVX-512 fp32 rows it skips; on
# a CPU with AVX-VNNI what an Intel desktop CPU without AVX-512 gets (AVX2 + AVX-VNNI)
# an AVX-512 VNNI CPU without AVX-VNNI (AMD Zen 4) runs the AVX-VNNI build's rows through the 256-bit
# EVEX form of the same instruction (AVX-512 VNNI + VL): the build is told it has AVX-VNNI and its one
# AVX-VNNI instruction is spelled as that form, the rest of it AVX2
AVXVNNI_THROUGH_AVX512 = ("-O3", "-mavx2", "-mfma", "-mf16c", "-mavx512vnni", "-mavx512vl", "-D__AVXVNNI__=1",
                          "-D_mm256_dpbusd_avx_epi32=_mm256_dpbusd_epi32", "-fopenmp")
AVXVNNI = "avx_vnni" in cpu_flags()
BUILDS = (*build.FLAG_SETS[1:], *([("-O3", "-march=native", "-DQM_NO_VNNI", "-fopenmp")] if VNNI else []),
          *([("-O3", "-mavx2", "-mfma", "-mf16c", "-mavxvnni", "-fopenmp")] if AVXVNNI else []),
          *([AVXVNNI_THROUGH_AVX512] if VNNI and not AVXVNNI else []))
# qm_simd() of a build, by its telling flag (the first that matches)
SIMD = {"-D__AVXVNNI__=1": 5, "-DQM_NO_VNNI": 3, "-mavxvnni": 5, "-mavx2": 2}


@pytest.mark.skipif(not VNNI, reason="the CPU has no AVX-512 VNNI")
def test_a_vnni_cpu_takes_the_integer_rows_unless_told_not_to(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    lib = build.kernels()
    assert lib is not None and lib.qm_simd() == 4
    monkeypatch.setenv("SPECCHAT_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("SPECCHAT_NO_VNNI", "1")
    build.reset()
    try:
        lib = build.kernels()
        assert lib is not None and lib.qm_simd() == 3
    finally:
        build.reset()


@pytest.mark.parametrize("flags", BUILDS, ids=lambda f: " ".join(f[1:-1]) or "plain C")
def test_the_portable_builds_compute_the_same(flags: tuple[str, ...], tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """The AVX2 and plain C builds, AVX-512 without its integer rows, and AVX2 with AVX-VNNI's:
    packed products with fp16 and fp32 scales, a fused step and a fused tree pass, against the
    dense product and the general path."""
    monkeypatch.setenv("SPECCHAT_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(build, "FLAG_SETS", (flags,))
    build.reset()
    try:
        lib = build.kernels()
        assert lib is not None
        assert lib.qm_simd() == next((code for flag, code in SIMD.items() if flag in flags), 0)
        g = torch.Generator().manual_seed(5)
        for k in (96, 128, 256):  # the integer rows take inputs of a multiple of 64
            codes = torch.randint(0, 16, (23, k), generator=g)  # blocks of 4 rows and a tail of 3
            for scales in (torch.rand(23, k // 32, generator=g), torch.rand(23, k // 32, generator=g).half().float()):
                for kind, bits in (("q4", 4), ("q6" if k % 64 == 0 else "q8", 5), ("q8", 8)):
                    w = from_codes(codes, scales, -scales * 8, 32, bits)
                    assert w.kind == kind
                    for m in (1, 5):
                        x = torch.randn(m, k, generator=g)
                        assert close(qlinear(x, w), x @ dequantize(w).T)
            # nibbles of a table: MXFP4's (q4 codes of E2M1 values; its scales powers of two, in
            # fp16 and, 2^-30 and less, not) and IQ4's (q8 codes, fp16 scales or IQ4_XS's factored)
            nibbles = torch.randint(0, 256, (23, k // 2), generator=g, dtype=torch.uint8)
            mxfp4 = from_nibbles(nibbles, "e2m1", 2.0 ** torch.randint(-33 if k == 96 else -12, 0, (23, k // 32),
                                                                          generator=g).float())
            assert (mxfp4.kind, mxfp4.scales.dtype) == ("q4", torch.float32 if k == 96 else torch.float16)
            iq4 = [from_nibbles(nibbles, "iq4", torch.rand(23, k // 32, generator=g).half().float())]
            if k % 256 == 0:
                iq4.append(from_nibbles(nibbles, "iq4", d=torch.rand(23, k // 256, generator=g).half().float(),
                                        mult=torch.randint(-32, 32, (23, k // 32), generator=g).float()))
            for w in (mxfp4, *iq4):
                for m in (1, 3, 5):
                    x = torch.randn(m, k, generator=g)
                    assert close(qlinear(x, w), x @ dequantize(w).T)
            if k % 128 == 0:  # two and three bits in groups of 16 (Q2_K's, with minimums; Q3_K's, signed)
                s16 = torch.rand(23, k // 16, generator=g)
                low = [from_codes(torch.randint(0, 4, (23, k), generator=g), s16, -s16 / 3, 16, 2),
                       from_codes(torch.randint(-4, 4, (23, k), generator=g), s16, None, 16, 3)]
                assert [w.kind for w in low] == ["q2", "q3"]
                for w in low:
                    for m in (1, 3, 5):
                        x = torch.randn(m, k, generator=g)
                        assert close(qlinear(x, w), x @ dequantize(w).T)
        fused, plain = pair(packed(config("qwen2"), seed=4), monkeypatch)
        ours, theirs = fused.new_cache(16), plain.new_cache(16)
        for tokens, positions, allowed in ((torch.tensor([3, 9, 27]), torch.arange(3), None),
                                           (torch.tensor([81]), torch.tensor([3]), None),
                                           (torch.tensor([5, 6, 7]), torch.tensor([4, 5, 5]),
                                            tree_mask([-1, 0, 0], torch.ones(4, dtype=torch.bool)))):
            assert close(fused.forward(tokens, positions, ours, allowed), plain.forward(tokens, positions, theirs, allowed))
    finally:
        build.reset()


def moe_pair(arch: str, model_cache: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Any, Any, list[list[Any]]]:
    """A tiny MoE GGUF of `arch` (3 layers, 4 experts, top 2; gpt-oss: MXFP4 experts, Q8_0 attention,
    windows of 6 on even layers; else Q8_0, Q4_K/Q6_K and Q4_0 layers) loaded fused and not, with
    each one's PackedExperts."""
    from engine.kernels.experts import PackedExperts

    if arch == "gpt_oss":
        path = synthetic_gpt_oss_gguf(model_cache / "fused-gpt-oss" / "model.gguf", hidden=128, layers=3, vocab=384,
                                      heads=4, kv_heads=2, head_dim=32, experts=4, top_k=2, expert_width=128, window=6)
    else:
        path = tiny_gguf(arch, layers=3, layer_types=("Q8_0", "Q4_K/Q6_K", "Q4_0"), cache_dir=model_cache)
    fused = load_model(path, offload="none")
    monkeypatch.setenv("SPECCHAT_NO_FUSED", "1")
    plain = load_model(path, offload="none")
    monkeypatch.delenv("SPECCHAT_NO_FUSED")
    assert fused.model.fused is not None and fused.model.fused.moe and plain.model.fused is None
    experts = [[m for m in model.model.hf_model.modules() if isinstance(m, PackedExperts)] for model in (fused, plain)]
    assert len(experts[0]) == 3
    return fused, plain, experts


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral", "gpt_oss"])
def test_moe_steps_route_in_the_fused_step(arch: str, model_cache: Path, monkeypatch: pytest.MonkeyPatch,
                                           fused_steps: list[int], fused_passes: list[int]) -> None:
    """An MoE whose routed experts are all packed (Qwen3-MoE, Mixtral, gpt-oss) takes its decode
    steps and its passes of several tokens (a prompt's chain, a tree) in one C call too: the
    router (softmax, top-k, renormalised; gpt-oss's: biased logits, top-k, softmax of those),
    each token's routed experts summed in expert order (gpt-oss's gate and biases), counted into
    each layer's PackedExperts.hits; a pass reads each woken expert once for all its tokens and
    logs the union it woke (what trees are priced by). gpt-oss's attention too: sinks, q/k/v/o
    biases, its half-width rotary tables, and windows of 6 on even layers (a WindowedCache that
    drops what they left behind). Every hidden state and K/V entry is the general path's (which
    tests/engine/loading/test_gguf_families.py and test_gguf_families2.py hold to
    transformers'), the routing counts and unions the same, and greedy text, plain and with
    draft-free trees, the same."""
    fused, plain, experts = moe_pair(arch, model_cache, monkeypatch)
    caches = [m.model.new_cache(64) for m in (fused, plain)]

    def both(tokens: torch.Tensor, positions: torch.Tensor, allowed: torch.Tensor | None) -> torch.Tensor:
        got, want = (m.model.forward(tokens, positions, c, allowed) for m, c in zip((fused, plain), caches))
        assert close(got, want)
        for k1, k2 in zip(caches[0].tensors(), caches[1].tensors()):
            assert close(k1[0], k2[0]) and close(k1[1], k2[1])
        for mine, theirs in zip(*experts):
            assert torch.equal(mine.hits, theirs.hits) and mine.union_log == theirs.union_log
        return got

    ids = fused.tokenizer(PROMPTS[0])["input_ids"]
    out = both(torch.tensor(ids), torch.arange(len(ids)), None)  # the prompt: a chain
    assert fused_steps == [] and fused_passes == [len(ids)]
    assert all(0 < m.last_union <= m.num_experts for m in experts[0])
    past = torch.ones(len(ids), dtype=torch.bool)
    parents = [-1, 0, 0, 1, 2, 2, 4]  # a tree of 7 nodes (the integer rows take up to 4 tokens an expert)
    depth = [0] * len(parents)
    for i, p in enumerate(parents):
        depth[i] = depth[p] + 1 if p >= 0 else 0
    both(torch.randint(0, 200, (7,)), len(ids) + torch.tensor(depth), tree_mask(parents, past))
    for cache in caches:  # keep the path 0 -> 2 -> 4, as verification does
        cache.keep(torch.tensor([*range(len(ids)), len(ids), len(ids) + 2, len(ids) + 4]))
    both(torch.randint(0, 200, (3,)), len(ids) + 3 + torch.tensor([0, 1, 1]), tree_mask([-1, 0, 0], torch.ones(len(ids) + 3, dtype=torch.bool)))
    for cache in caches:
        cache.truncate(len(ids) + 3)
    assert fused_passes == [len(ids), 7, 3]
    token = int(fused.model.logits(out[-1:]).argmax())
    for step in range(12):
        pos = torch.tensor([len(ids) + 3 + step])
        token = int(fused.model.logits(both(torch.tensor([token]), pos, None)).argmax())
    assert len(fused_steps) == 12
    assert int(experts[0][0].hits.sum()) == 2 * (len(ids) + 7 + 3 + 12)
    before = len(fused_steps)
    ours = greedy(Engine(fused.model, fused.tokenizer), PROMPTS[1], 24)
    assert len(fused_steps) - before >= len(ours) - 1
    assert ours == greedy(Engine(plain.model, plain.tokenizer), PROMPTS[1], 24)
    passes = len(fused_passes)
    assert greedy(Engine(fused.model, fused.tokenizer), PROMPTS[1], 24, "specexec") == ours
    assert len(fused_passes) > passes  # the prompt's pass at least

@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss"])
def test_a_long_pass_reads_its_busy_experts_in_panels(arch: str, model_cache: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A pass of many tokens (a prompt's chunk, a big tree) hands an expert routed 17 tokens or
    more (QM_EXPERT_PANEL_MIN) to the panels: its rows decoded to fp32 once (Q4_K's K-scales,
    Q6_K's six-bit codes, MXFP4's table) for all its tokens, its activations transposed; the
    others keep the integer rows. Hidden states and K/V match the general path's over a 48-token
    chain and a 40-node tree after it, as the routing counts do."""
    fused, plain, experts = moe_pair(arch, model_cache, monkeypatch)
    caches = [m.model.new_cache(96) for m in (fused, plain)]
    g = torch.Generator().manual_seed(11)
    parents = [-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, 40)]
    depth = [0] * len(parents)
    for i, p in enumerate(parents[1:], 1):
        depth[i] = depth[p] + 1
    passes = ((torch.randint(0, 300, (48,), generator=g), torch.arange(48), None),
              (torch.randint(0, 300, (40,), generator=g), 48 + torch.tensor(depth),
               tree_mask(parents, torch.ones(48, dtype=torch.bool))))
    for tokens, positions, allowed in passes:
        before = [m.hits.clone() for m in experts[0]]
        got, want = (m.model.forward(tokens, positions, c, allowed) for m, c in zip((fused, plain), caches))
        assert close(got, want)
        for k1, k2 in zip(caches[0].tensors(), caches[1].tensors()):
            assert close(k1[0], k2[0]) and close(k1[1], k2[1])
        for mine, theirs in zip(*experts):
            assert torch.equal(mine.hits, theirs.hits)
        # 2 of 4 experts a token: 96 and 80 pairs, so an expert of every layer is at least 24 and 20
        # tokens busy; the panels' share is what this test is for
        assert all(int((m.hits - b).max()) >= 17 for m, b in zip(experts[0], before))


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_a_stop_mid_pass_commits_nothing_and_the_prompt_reads_on(family: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Inside `interruptible`, a pass checks the Stop between runs of its layers (the fused C
    calls, and the layer modules): set after the first run, the pass raises PassInterrupted and
    the cache (a windowed one too) is as it was.
    A CPU prefill with that Stop ends there, holding the chunks before it, and reading the prompt
    on afterwards gives the hidden states of the model that was never stopped."""
    from engine.decoding.prefill import prefill
    from engine.kernels.fused_layer import PassInterrupted

    fused, plain = pair(packed(config(family), seed=3), monkeypatch)
    assert fused.can_interrupt() and fused.fused is not None
    stop, runs = threading.Event(), []
    real = fused.fused._many

    def run_then_stop(*args: Any) -> int:
        runs.append(args[2])  # the run's layers
        if len(runs) == stop_after:
            stop.set()
        return int(real(*args))

    fused.fused._many = run_then_stop
    ids = torch.randint(0, 300, (120,), generator=torch.Generator().manual_seed(2)).tolist()
    ours, theirs = fused.new_cache(16), plain.new_cache(16)
    stop_after = 1
    with fused.interruptible(stop), pytest.raises(PassInterrupted):
        fused.forward(torch.tensor(ids[:40]), torch.arange(40), ours, None)
    assert runs == [1] and ours.length == 0 and fused.interrupt is None
    stop.clear()
    runs.clear()
    stop_after = 3 + 2  # the second chunk's second run (three layers, a run each)
    prefill(fused, ours, ids, cancel=stop)
    assert ours.length == 32 and len(runs) == 5  # the first chunk (PREFILL_FIRST_CHUNK) and no more
    prefill(fused, ours, ids)
    hook = plain.layers[0].register_forward_hook(lambda *_: stop.set())  # the layer modules' path stops too
    stop.clear()
    with plain.interruptible(stop), pytest.raises(PassInterrupted):
        plain.forward(torch.tensor(ids[:40]), torch.arange(40), theirs, None)
    hook.remove()
    assert theirs.length == 0 and plain.interrupt is None
    got = fused.forward(torch.tensor(ids[-1:]), torch.tensor([len(ids)]), ours, None)
    plain.forward(torch.tensor(ids), torch.arange(len(ids)), theirs, None)
    want = plain.forward(torch.tensor(ids[-1:]), torch.tensor([len(ids)]), theirs, None)
    assert close(got, want) and ours.length == theirs.length == len(ids) + 1
