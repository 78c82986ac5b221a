"""GGUF files of the newer families load in their own blocks and run what transformers reads
from the same file: Qwen3-MoE (llama.cpp's qwen3moe: gate, up and down experts as three 3-D
tensors, the fused gate_up_proj made of two of them) and Gemma 3 (norms stored plus one,
windowed layers). Mixtral (llama.cpp's llama with experts), which transformers does not load
from a GGUF, against a reference built from scratch: every tensor de-quantised by gguf-py,
q/k rows un-permuted by transformers' Llama processor, gate and up experts concatenated.
Logits equal the reference bit for bit wherever the file's values run de-quantised (streamed,
resident packed, de-quantised at load), within float rounding where the packed CPU kernel
multiplies; greedy text is identical in every place."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from gguf import GGUFReader
from gguf import quants as gq
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

from engine.decoding.generation import Engine
from engine.errors import UnsupportedModel
from engine.kernels import build
from engine.kernels.expert_cache import CountsFile, fill
from engine.kernels.experts import PackedExperts
from engine.kernels.linear import PackedLinear
from engine.loading.gguf import GGUFWeights, gguf_config, isolated
from engine.loading.layer_plan import MaterialiseSettings, cache_experts, stream_experts
from engine.loading.load import LoadedModel, load_model
from engine.store.gguf_header import read_header
from engine.testing.gguf_write import Q, gguf_name, write_gguf
from engine.testing.synthetic import tiny_gguf
from engine.types import Completion, GenerationRequest, SpeculationSettings

PROMPTS = ["Paris is the capital of", "Once upon a time there was a little robot who"]
# every layer's matrices and experts in its own type: Q8_0, a Q4_K_M layer (attn_v and the down
# experts in Q6_K), Q4_0, IQ4_XS (packed in its nibbles, q8 codes of its table's values)
MOE_TYPES = ("Q8_0", "Q4_K/Q6_K", "Q4_0", "IQ4_XS")
GEMMA_TYPES = ("Q8_0", "Q4_K/Q6_K", "Q5_K")
PLACES = {"kernel": dict(offload="none"), "dequantised": dict(offload="none"),
          "resident": dict(offload="none", ram_limit_bytes=0), "RAM": dict(offload="all"),
          "disk": dict(offload="all", ram_limit_bytes=0)}


@pytest.fixture(autouse=True)
def _cache_dir(model_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPECCHAT_CACHE_DIR", str(model_cache))


@pytest.fixture
def no_kernels(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv("SPECCHAT_NO_KERNELS", "1")
    build.reset()
    yield
    monkeypatch.delenv("SPECCHAT_NO_KERNELS")
    build.reset()


def tiny(arch: str, model_cache: Path) -> Path:
    if arch in ("qwen3_moe", "mixtral"):
        return tiny_gguf(arch, layers=4, layer_types=MOE_TYPES, cache_dir=model_cache)
    return tiny_gguf("gemma3_text", layers=6, layer_types=GEMMA_TYPES, tied=True, cache_dir=model_cache)


@pytest.fixture(scope="session", params=["qwen3_moe", "gemma3_text", "mixtral"])
def family_pair(request: pytest.FixtureRequest, model_cache: Path) -> tuple[Path, nn.Module, object]:
    """A tiny GGUF and transformers' own reading of it (from_pretrained(gguf_file=...)). For
    Qwen3-MoE transformers' key table has no expert width, so its config is given that one
    value from the file; every tensor is still transformers' own conversion. Mixtral: the
    reference from scratch (module docstring)."""
    path = tiny(request.param, model_cache)
    with isolated(path) as src:
        tok = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
        if request.param == "mixtral":
            return path, from_scratch(path), tok
        config = AutoConfig.from_pretrained(src.parent, gguf_file=src.name)
        for key, value in llama_cpp_fields(path).items():
            setattr(config, key, value)
        ref = AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name, config=config,
                                                   dtype=torch.float32).eval()
    return path, ref, tok


def llama_cpp_fields(path: Path) -> dict:
    """Config fields that transformers' GGUF key table leaves at a default and SpecChat reads as
    llama.cpp does: Qwen-MoE's expert width; Gemma 3's attention scale (1/sqrt(head_dim))."""
    header = read_header(path)
    if header.architecture == "qwen3moe":
        return {"moe_intermediate_size": header.metadata["qwen3moe.expert_feed_forward_length"]}
    if header.architecture == "gemma3":
        return {"query_pre_attn_scalar": header.metadata["gemma3.attention.key_length"]}
    return {}


def from_scratch(path: Path) -> nn.Module:
    """A Mixtral GGUF as a transformers model: each tensor de-quantised by gguf-py."""
    config = AutoConfig.for_model("mixtral", **{k: v for k, v in gguf_config(read_header(path)).to_dict().items()
                                                if k not in ("model_type", "transformers_version")})
    ref = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    stored = {t.name: t for t in GGUFReader(path).tensors}
    permute = LlamaTensorProcessor(config.to_dict())

    def value(hf_name: str) -> np.ndarray:
        t = stored[gguf_name("llama", hf_name, config.num_hidden_layers)]
        return gq.dequantize(t.data, t.tensor_type).reshape([int(n) for n in reversed(t.shape.tolist())])

    state = {}
    for name, _ in ref.named_parameters():
        if name.endswith("gate_up_proj"):  # per expert: gate rows, then up rows
            base = name.removesuffix("gate_up_proj")
            v = np.concatenate([value(base + "gate_proj"), value(base + "up_proj")], axis=1)
        else:
            v = value(name)
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                heads = config.num_attention_heads if "q_proj" in name else config.num_key_value_heads
                v = permute._reverse_permute_weights(v, config.num_attention_heads, heads)
        state[name] = torch.from_numpy(np.array(v))  # a copy: gguf-py maps the file read-only
    ref.load_state_dict(state, strict=True)
    return ref


def logits(m: LoadedModel, ids: list[int]) -> torch.Tensor:
    cache = m.model.new_cache(64)
    return m.model.logits(m.model.forward(torch.tensor(ids), torch.arange(len(ids)), cache, None))


def greedy(engine: Engine, prompt: str, mode: str = "autoregressive", n: int = 20) -> Completion:
    req = GenerationRequest(raw_prompt=prompt, max_new_tokens=n,
                            speculation=SpeculationSettings(mode=mode, budget=16, max_depth=6))  # type: ignore[arg-type]
    final = list(engine.generate(req))[-1]
    assert isinstance(final, Completion)
    return final


def test_config_is_transformers_own_and_the_expert_width_the_files(family_pair: tuple) -> None:
    path, ref, _ = family_pair
    header = read_header(path)
    ours = gguf_config(header).to_dict()
    with isolated(path) as src:
        theirs = AutoConfig.from_pretrained(src.parent, gguf_file=src.name).to_dict()
    if ours["model_type"] == "mixtral":  # transformers reads a llama: its experts are ours alone
        assert theirs["model_type"] == "llama" and ours["num_local_experts"] == 4 and ours["num_experts_per_tok"] == 2
        theirs.update({k: ours.get(k) for k in ("model_type", "num_local_experts", "num_experts_per_tok",
                                                  "sliding_window", "head_dim")})
    theirs.update(llama_cpp_fields(path))
    for key in ("model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_parameters", "vocab_size",
                "tie_word_embeddings", "sliding_window", "layer_types", "num_experts", "num_local_experts",
                "num_experts_per_tok", "norm_topk_prob", "moe_intermediate_size", "mlp_only_layers",
                "query_pre_attn_scalar"):
        assert ours.get(key) == theirs.get(key), key
    if ours["model_type"] == "qwen3_moe":
        assert ours["moe_intermediate_size"] == 256 and ours["num_local_experts"] == 4
    elif ours["model_type"] == "gemma3_text":
        assert "full_attention" in ours["layer_types"]


def test_fused_experts_are_two_parts_of_the_files_own_span(family_pair: tuple) -> None:
    path, _, _ = family_pair
    if "gemma3" in path.parent.name:
        pytest.skip("no experts")
    weights = GGUFWeights(path)
    try:
        with torch.device("meta"):
            hf = AutoModelForCausalLM.from_config(weights.config)
        weights.bind(hf)
        layouts = weights.layouts(hf, torch.float32, "none")
    finally:
        weights.close()
    header = read_header(path)
    for i, layout in enumerate(layouts):
        parts = [e for e in layout.entries if e.param == "mlp.experts.gate_up_proj"]
        assert len(parts) == 2 and all(e.kind == "gguf" and e.shape == (4, 512, 256) for e in parts)
        width = parts[0].shape[1] // 2
        assert [e.part for e in parts] == [(0, width), (width, 2 * width)]
        gate, up = (header.tensor(f"blk.{i}.ffn_{w}_exps.weight") for w in ("gate", "up"))
        assert gate is not None and up is not None
        assert [e.nbytes for e in parts] == [gate.nbytes, up.nbytes] and parts[1].offset - parts[0].offset == up.offset - gate.offset
        # the dense twin has the parameter once, at its full size
        dense = [e for e in layout.dense_layout().entries if e.name.startswith("mlp.experts.")]
        assert [(e.name, e.shape) for e in dense] == [("mlp.experts.gate_up_proj", (4, 2 * width, 256)),
                                                      ("mlp.experts.down_proj", (4, 256, width))]


@pytest.mark.parametrize("place", PLACES)
def test_logits_and_greedy_text_equal_transformers(family_pair: tuple, place: str,
                                                   request: pytest.FixtureRequest) -> None:
    path, ref, ref_tok = family_pair
    if place == "dequantised":
        request.getfixturevalue("no_kernels")
    elif place == "kernel" and build.kernels() is None:
        pytest.skip("no C compiler here")
    m = load_model(path, **PLACES[place])  # type: ignore[arg-type]
    p = m.model.placement
    assert p is not None and p.quant == "gguf"
    if place in ("kernel", "dequantised"):
        assert p.resident_form == place and m.model.streamer is None
        layer = m.model.hf_model.model.layers[0]
        packed = [mod for mod in layer.modules() if isinstance(mod, PackedLinear)]
        experts = getattr(layer.mlp, "experts", None)
        # a Q8_0 layer's q, k, v, o (and gate, up, down of a dense MLP)
        assert len(packed) == (0 if place == "dequantised" else 4 if experts is not None else 7)
        if experts is not None:
            check_experts(m, place)
    else:
        assert not p.resident_form and m.model.streamer is not None  # de-quantised as each pass runs it
    engine = Engine(m.model, m.tokenizer)
    for prompt in PROMPTS:
        ids = ref_tok(prompt)["input_ids"]
        assert m.tokenizer(prompt)["input_ids"] == ids
        with torch.inference_mode():
            theirs = ref(torch.tensor([ids])).logits[0]
        ours = logits(m, ids)
        if place == "kernel":  # the file's own values; the kernel sums in its own order
            assert (ours - theirs).abs().max() <= 1e-4 * theirs.abs().max()
        else:
            assert torch.equal(ours, theirs)  # the file's own weights, bit for bit
        x = torch.tensor([ids])
        want = ref.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=20, do_sample=False,
                            pad_token_id=ref_tok.pad_token_id)[0, len(ids):].tolist()
        got = greedy(engine, prompt)
        assert list(got.token_ids) == (want[: len(got.token_ids)] if got.finish_reason == "eos" else want), prompt
        if place == "RAM":  # draft-free trees verify against the same streamed layers
            assert greedy(engine, prompt, mode="specexec").token_ids == got.token_ids


@pytest.mark.skipif(build.kernels() is None, reason="no C compiler here")
def test_the_routing_an_moe_measured_is_kept_for_the_next_process(model_cache: Path, tmp_path: Path) -> None:
    """The experts the passes of 2+ tokens woke (PackedExperts.union_log) are saved with the
    learned costs after an answer, and a fresh engine of the same model starts from them: the
    budget planner prices its first trees by the measured routing (auto_budget.routed_shape)."""
    from engine.decoding.auto_budget import routed_shape
    from engine.decoding.learned import learned_file
    from engine.kernels.expert_unions import measured_unions, union_totals
    from engine.planning.moe import fit_sharing

    m = load_model(tiny("qwen3_moe", model_cache), offload="none")
    assert m.model.shape.experts is not None
    for module in m.model.hf_model.modules():  # this test's passes only (the model is its own)
        if isinstance(module, PackedExperts):
            module.union_log.clear()
    learned = learned_file(m.model, None, root=tmp_path)
    assert learned is not None
    first = Engine(m.model, m.tokenizer, learned=learned)
    assert first.routing_seed == {} and routed_shape(first) == m.model.shape  # nothing measured yet
    greedy(first, PROMPTS[0], mode="specexec")
    measured = union_totals(m.model.hf_model.modules())
    assert measured and all(bucket >= 2 and calls >= 1 for bucket, (calls, _, _) in measured.items())
    saved = json.loads(learned.path.read_text())["routing"]
    assert {row[0]: tuple(row[1:]) for row in saved} == measured
    for module in m.model.hf_model.modules():  # as a fresh process: nothing measured in its modules
        if isinstance(module, PackedExperts):
            module.union_log.clear()
    second = Engine(m.model, m.tokenizer, learned=learned)
    assert second.routing_seed == measured
    planned, shape = routed_shape(second), m.model.shape
    assert planned.experts is not None and shape.experts is not None
    assert planned.experts.sharing == fit_sharing(measured_unions([], measured), shape.experts.experts,
                                                   shape.experts.top_k)


@pytest.mark.skipif(build.kernels() is None, reason="no C compiler here")
def test_experts_cached_beside_the_cpus_give_transformers_text(family_pair: tuple, tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Half the packed experts cached where the model runs (engine.kernels.expert_cache; the CPU
    stands in for the GPU: dense products there, the kernel for the rest, as on a GPU machine):
    transformers' logits and greedy text, tokens served by both, passes of three tokens or more
    streaming all their experts; the engine keeps the routing counts per model after each answer."""
    assert_experts_cached_beside_cpu(*family_pair, tmp_path, monkeypatch)


def assert_experts_cached_beside_cpu(path: Path, ref: nn.Module, tok: Any, tmp_path: Path,
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """test_experts_cached_beside_the_cpus_give_transformers_text's checks, for any GGUF."""
    if not any(name.endswith(".experts") for name, _ in ref.named_modules()):
        pytest.skip("no experts")
    monkeypatch.setenv("SPECCHAT_DATA_DIR", str(tmp_path))
    m = load_model(path, offload="none")
    packed = [mod for mod in m.model.hf_model.modules() if isinstance(mod, PackedExperts)]
    total = sum(e.num_experts for e in packed)
    state = fill(m.model.hf_model, total // 2 * packed[0].expert_nbytes, "cpu", torch.float32)
    assert state.cached == total // 2 and 0 < state.fraction < 1
    for e in packed:  # and passes of 3+ tokens (the prompts' chunks) run every expert "there"
        e.stream("cpu", torch.float32, 3)
    engine = Engine(m.model, m.tokenizer)
    assert engine.expert_counts.active and engine.expert_counts.seed is None
    for prompt in PROMPTS:
        ids = tok(prompt)["input_ids"]
        with torch.inference_mode():
            theirs = ref(torch.tensor([ids])).logits[0]
        assert (logits(m, ids) - theirs).abs().max() <= 1e-4 * theirs.abs().max(), prompt
        x = torch.tensor([ids])
        want = ref.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=20, do_sample=False,
                            pad_token_id=tok.pad_token_id)[0, len(ids):].tolist()
        got = greedy(engine, prompt)
        assert list(got.token_ids) == (want[: len(got.token_ids)] if got.finish_reason == "eos" else want), prompt
    hot, routed = sum(e.hot_hits for e in packed), sum(int(e.hits.sum()) for e in packed)
    assert 0 < hot < routed and sum(e.streamed_passes for e in packed) >= 2 * len(packed)
    saved = CountsFile.of(m.model.fingerprint).load(len(packed), packed[0].num_experts)  # type: ignore[union-attr]
    assert saved is not None and sum(map(sum, saved)) == routed


def check_experts(m: LoadedModel, place: str) -> None:
    """With the kernel, routed experts in kernel types stay packed (a Q4_K_M layer's Q4_K
    gate/up merged into one q4 weight per expert, its Q6_K down a q6 one: six bits a code;
    IQ4_XS ones q8 codes of its table's values, its nibbles, scales as K-quants factor theirs); without it
    every expert is de-quantised once at load."""
    kinds = []
    for layer in m.model.hf_model.model.layers:
        experts = layer.mlp.experts
        if isinstance(experts, PackedExperts):
            assert experts.num_experts == 4 and len(experts.gate_up) == len(experts.down) == 1
            kinds.append((experts.gate_up[0].packed[0].kind, experts.down[0].packed[0].kind))
        else:
            assert experts.gate_up_proj.dtype == torch.float32 and experts.gate_up_proj.shape[0] == 4
            kinds.append("dense")
    assert kinds == ([("q8", "q8"), ("q4", "q6"), ("q4", "q4"), ("q8", "q8")] if place == "kernel" else ["dense"] * 4)
    if place == "kernel":  # IQ4_XS in its nibbles, its scales as the file factors them (10 bytes per 8 groups)
        w = m.model.hf_model.model.layers[3].mlp.experts.gate_up[0].packed[0]
        assert (w.table, w.scales.dtype) == ("iq4", torch.uint8)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_experts_on_the_cpu_beside_a_gpu_give_transformers_text(family_pair: tuple) -> None:
    path, ref, tok = family_pair
    if not any(name.endswith(".experts") for name, _ in ref.named_modules()):
        pytest.skip("no experts")
    assert_experts_on_cpu_beside_gpu(path, ref, tok, PROMPTS, 20)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_experts_streamed_every_pass_give_the_same_text(model_cache: Path) -> None:
    """`--experts stream` (a benchmark's mode): the experts packed in RAM, every pass's (a step's
    too) de-quantised on the GPU; nothing cached, nothing run by the CPU; the text `--experts cpu`
    gives, and the status bar says so."""
    from engine.decoding.pair import load_engine
    from engine.types import LoadSettings

    if build.kernels() is None:
        pytest.skip("no C compiler here")
    path = tiny(model_cache=model_cache, arch="qwen3_moe")
    texts = {}
    for mode in ("cpu", "stream"):
        engine = load_engine(path, None, LoadSettings(device="cuda", experts=mode))  # type: ignore[arg-type]
        packed = [m for m in engine.target.hf_model.modules() if isinstance(m, PackedExperts)]
        placement = engine.target.placement
        assert packed and placement is not None and placement.resident_form == "experts-cpu"
        assert ("streamed to the GPU" in placement.describe()) == (mode == "stream")
        texts[mode] = greedy(engine, PROMPTS[0], n=16).token_ids
        if mode == "stream":
            assert all(m._stream is not None and m._stream[2] == 1 and m._hot is None for m in packed)
            assert all(m.streamed_passes > 0 for m in packed)
    assert texts["stream"] == texts["cpu"]


def assert_experts_on_cpu_beside_gpu(path: Path, ref: nn.Module, tok: object, prompts: list[str], n: int) -> None:
    """`--experts cpu` on a GPU: routed experts packed in RAM (run by the CPU kernel; a layer whose
    experts are in a type it does not read keeps them on the GPU), everything else on the GPU;
    logits within 1e-4 of transformers' on the GPU, its greedy text, and draft-free trees giving
    the same text; then the same with half the experts cached in VRAM, then with passes of two
    tokens or more streaming their experts to the GPU as well."""
    if build.kernels() is None:
        pytest.skip("no C compiler here")
    m = load_model(path, "cuda", torch.float32, offload="none", experts="cpu")
    p = m.model.placement
    assert p is not None and p.resident_form == "experts-cpu" and m.model.streamer is None
    experts = [mod for name, mod in m.model.hf_model.named_modules() if name.endswith(".experts")]
    packed = [e for e in experts if isinstance(e, PackedExperts)]
    assert packed and all(w.codes.device.type == "cpu" for e in packed for part in e.gate_up for w in part.packed)
    others = [t for name, t in m.model.hf_model.named_parameters() if ".experts." not in name]
    assert all(t.device.type == "cuda" for t in others)
    ref = ref.to("cuda")
    try:
        for cached in (False, True, True):
            if cached and any(e._hot is not None for e in packed):  # then passes of 2+ tokens streamed as well
                assert stream_experts(m.model, MaterialiseSettings(device="cuda", dtype=torch.float32), 2) > 0
            elif cached:  # then half the experts cached in VRAM (expert_cache), run there beside the CPU's
                half = sum(e.num_experts for e in packed) // 2 * packed[0].expert_nbytes
                state = cache_experts(m.model, MaterialiseSettings(device="cuda", dtype=torch.float32,
                                                                   expert_cache=half))
                p = m.model.placement
                assert state is not None and state.cached > 0 and p is not None and p.cached_experts > 0
                assert "% in VRAM" in p.describe() and not p.describe().startswith("experts: 0 %")
                assert all(t.device.type == "cuda" for e in packed if e._hot is not None for t in e._hot)
            engine = Engine(m.model, m.tokenizer)
            for prompt in prompts:
                ids = tok(prompt)["input_ids"]  # type: ignore[operator]
                with torch.inference_mode():
                    theirs = ref(torch.tensor([ids], device="cuda")).logits[0]
                ours = logits(m, ids)
                assert (ours - theirs).abs().max() <= 1e-4 * theirs.abs().max(), prompt
                x = torch.tensor([ids], device="cuda")
                want = ref.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False,
                                    pad_token_id=tok.pad_token_id)[0, len(ids):].tolist()  # type: ignore[attr-defined]
                got = greedy(engine, prompt, n=n)
                assert list(got.token_ids) == (want[: len(got.token_ids)] if got.finish_reason == "eos" else want), prompt
                assert greedy(engine, prompt, mode="specexec", n=n).token_ids == got.token_ids
            assert sum(e.calls for e in packed) > 0 and (sum(e.hot_hits for e in packed) > 0) == cached
        assert sum(e.streamed_passes for e in packed) > 0
    finally:
        ref.to("cpu")


def test_the_disk_tier_reads_the_moe_file_itself(model_cache: Path) -> None:
    path = tiny("qwen3_moe", model_cache)
    before = set((model_cache / "offload").glob("*")) if (model_cache / "offload").is_dir() else set()
    disk = load_model(path, offload="all", ram_limit_bytes=0)
    store = disk.model.streamer.store  # type: ignore[union-attr]
    assert store is not None and store.disk_layers == 4 and store.disk_path == path
    after = set((model_cache / "offload").glob("*")) if (model_cache / "offload").is_dir() else set()
    assert after == before  # no second copy on disk


def test_experts_that_do_not_tile_the_fused_parameter_are_refused(tmp_path: Path, model_cache: Path) -> None:
    """A file whose up experts are narrower than its gate experts: one message, no traceback."""
    good = tiny("qwen3_moe", model_cache)
    header = read_header(good)
    weights = GGUFWeights(good)
    weights.close()
    config = weights.config.to_dict()
    config.update(num_experts=config["num_local_experts"], rope_theta=config["rope_parameters"]["rope_theta"])
    h, i = config["hidden_size"], config["moe_intermediate_size"]
    tensors = [("model.embed_tokens.weight", (config["vocab_size"], h), Q.F32), ("model.norm.weight", (h,), Q.F32)]
    for name, shape in (("self_attn.q_proj.weight", (h, h)), ("self_attn.k_proj.weight", (h // 2, h)),
                        ("self_attn.v_proj.weight", (h // 2, h)), ("self_attn.o_proj.weight", (h, h)),
                        ("self_attn.q_norm.weight", (h // 4,)), ("self_attn.k_norm.weight", (h // 4,)),
                        ("mlp.experts.gate_proj", (4, i, h)), ("mlp.experts.up_proj", (4, i // 2, h)),
                        ("mlp.experts.down_proj", (4, h, i)), ("mlp.gate.weight", (4, h)),
                        ("input_layernorm.weight", (h,)), ("post_attention_layernorm.weight", (h,))):
        tensors.append((f"model.layers.0.{name}", shape, Q.F32))
    config["num_hidden_layers"] = 1
    fields = GGUFReader(good).fields
    vocab = {"tokens": fields["tokenizer.ggml.tokens"].contents(), "merges": fields["tokenizer.ggml.merges"].contents(),
             "bos_id": 0, "eos_id": 1, "pad_id": 0}
    shapes = dict((n, s) for n, s, _ in tensors)
    bad = write_gguf(tmp_path / "bad.gguf", "qwen3moe", config, vocab, tensors,
                     lambda n: torch.zeros(shapes[n]).numpy())
    assert header.architecture == "qwen3moe"
    with pytest.raises(UnsupportedModel) as err:
        load_model(bad)
    assert "ffn_up_exps" in err.value.user_message and "\n" not in err.value.user_message


@pytest.mark.parametrize("arch", ["falcon", "phi3", "mamba"])
def test_other_architectures_are_refused_by_name(tmp_path: Path, model_cache: Path, arch: str) -> None:
    fields = GGUFReader(tiny("qwen3_moe", model_cache)).fields
    vocab = {"tokens": fields["tokenizer.ggml.tokens"].contents(), "merges": fields["tokenizer.ggml.merges"].contents(),
             "bos_id": 0, "eos_id": 1, "pad_id": 0}
    config = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-6, rope_theta=1e4)
    path = write_gguf(tmp_path / f"{arch}.gguf", arch, config, vocab, [], lambda n: np.zeros(1))
    with pytest.raises(UnsupportedModel) as err:
        load_model(path)
    message = err.value.user_message
    assert f"'{arch}' GGUF; SpecChat runs GGUF files of" in message and "qwen3moe" in message and "\n" not in message


@pytest.mark.parametrize("layers", [6, 62])
def test_gemma3_attention_scale_and_rope_scaling_are_llama_cpps(tmp_path: Path, model_cache: Path, layers: int) -> None:
    """llama.cpp scales Gemma 3's queries by 1/sqrt(head_dim), but by 1/sqrt(hidden / heads) for
    the 62-layer 27B (168 there), and scales its global layers' rope as the file says."""
    fields = GGUFReader(tiny("qwen3_moe", model_cache)).fields
    vocab = {"tokens": fields["tokenizer.ggml.tokens"].contents(), "merges": fields["tokenizer.ggml.merges"].contents(),
             "bos_id": 0, "eos_id": 1, "pad_id": 0}
    config = dict(hidden_size=5376, intermediate_size=21504, num_hidden_layers=layers, num_attention_heads=32,
                  num_key_value_heads=16, head_dim=128, max_position_embeddings=131072, rms_norm_eps=1e-6,
                  rope_theta=1e6, sliding_window=1024, rope_scaling={"rope_type": "linear", "factor": 8.0})
    path = write_gguf(tmp_path / "gemma.gguf", "gemma3", config, vocab, [], lambda n: np.zeros(1))
    ours = gguf_config(read_header(path))
    assert ours.model_type == "gemma3_text" and ours.query_pre_attn_scalar == (168 if layers == 62 else 128)
    assert ours.rope_parameters["full_attention"] == {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}
    assert ours.rope_parameters["sliding_attention"]["rope_type"] == "default"
