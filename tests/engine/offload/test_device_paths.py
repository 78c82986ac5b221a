"""The CUDA paths `specchat bench gpu` relies on, checked on the first GPU it runs on (it runs
`pytest -m gpu` first): pinned arenas, the copy stream's event ordering under slow compute and
under slow copies, NF4 dequantisation on the device against a from-scratch decoder, the VRAM
cap as the placement sees it, and the GPU probes. The from-scratch decoder itself is checked
against bitsandbytes on the CPU here, so the GPU comparison has a reference that is right."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from engine.loading.load import load_model
from engine.loading.layer_plan import device_free_bytes
from engine.testing.synthetic import tiny_model
from engine.offload.host_store import HostStore
from engine.offload.layout import (
    LayerLayout,
    dequantize_nf4,
    nf4_code,
    pack_entry,
    quantize_nf4,
)
from engine.offload.streamer import LayerHome, LayerStreamer
from engine.offload.unpack import Unpacker
from engine.planning.measure import measure_hardware
from engine.units import GIB, MIB

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(autouse=True)
def _cache_dir(model_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPECCHAT_CACHE_DIR", str(model_cache))  # prepared layers and the disk tier go here


@pytest.fixture(scope="session")
def five_layer_path(model_cache: Path) -> Path:
    return tiny_model("llama", seed=0, layers=5, cache_dir=model_cache)

# The 16 NF4 levels (QLoRA paper, appendix E; bitsandbytes' table)
NF4_LEVELS = (-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
              -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
              0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
              0.7229568362236023, 1.0)


def nf4_from_scratch(packed: torch.Tensor, absmax: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """Two 4-bit codes per byte, the first in the high nibble; weight = level x its block's absmax."""
    b = packed.flatten().cpu()
    codes = torch.stack([b >> 4, b & 15], dim=1).flatten().long()
    return (torch.tensor(NF4_LEVELS)[codes].view(-1, 64) * absmax.cpu().float()[:, None]).view(shape)


def test_the_from_scratch_nf4_decoder_matches_bitsandbytes_on_cpu() -> None:
    w = torch.randn(256, 192, generator=torch.Generator().manual_seed(0)) * 0.05
    packed, absmax = quantize_nf4(w)
    for dtype in (torch.float32, torch.bfloat16):
        out = torch.empty(256, 192, dtype=dtype)
        dequantize_nf4(packed, absmax, out, nf4_code(torch.device("cpu")))
        assert torch.equal(out, nf4_from_scratch(packed, absmax, (256, 192)).to(dtype))


@pytest.mark.gpu
@cuda
def test_nf4_dequantised_on_the_device_equals_the_cpu_reference() -> None:
    dev = torch.device("cuda")
    w = torch.randn(512, 384, generator=torch.Generator().manual_seed(1)) * 0.05
    packed, absmax = quantize_nf4(w)  # on the CPU, as a layer packed in RAM is
    ref = nf4_from_scratch(packed, absmax, (512, 384))
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        out = torch.empty(512, 384, dtype=dtype, device=dev)
        dequantize_nf4(packed.to(dev), absmax.to(dev), out, nf4_code(dev))
        got, want = out.cpu().float(), ref.to(dtype).float()
        assert torch.allclose(got, want, rtol=2**-7 if dtype != torch.float32 else 0.0, atol=0.0), dtype
    # through the packed layout, as the streamer runs it
    layer = Toy(64).eval()
    layout = LayerLayout.of(layer, torch.bfloat16, "nf4")
    buf = torch.empty(layout.nbytes, dtype=torch.uint8)
    for name, p in layer.named_parameters():
        pack_entry(layout, buf, name, p.detach())
    dense = layout.dense_layout()
    on_cpu = torch.empty(dense.nbytes, dtype=torch.uint8)
    on_dev = torch.empty(dense.nbytes, dtype=torch.uint8, device=dev)
    Unpacker(torch.device("cpu"))(layout, buf, dense.params(on_cpu))
    Unpacker(dev)(layout, buf.to(dev), dense.params(on_dev))
    for name, t in dense.params(on_dev).items():
        assert torch.allclose(t.cpu().float(), dense.params(on_cpu)[name].float(), rtol=2**-7, atol=0.0), name


@pytest.mark.gpu
@cuda
def test_pinned_arenas_hold_and_return_exact_bytes() -> None:
    store = HostStore([3 * MIB + 256] * 5, ram_layers=5, pin=True, arena_bytes=8 * MIB)  # several arenas
    views = [store.ram_buffer(j) for j in range(5)]
    assert store.pinned and all(v.is_pinned() for v in views)
    assert len({v.untyped_storage().data_ptr() for v in views}) == 3  # two layers per 8 MiB arena
    g = torch.Generator().manual_seed(2)
    for v in views:
        v.copy_(torch.randint(0, 256, v.shape, dtype=torch.uint8, generator=g))
    side = torch.cuda.Stream()
    dst = [torch.empty_like(v, device="cuda") for v in views]
    with torch.cuda.stream(side):
        for d, v in zip(dst, views):
            d.copy_(v, non_blocking=True)
    side.synchronize()
    assert all(torch.equal(d.cpu(), v) for d, v in zip(dst, views))
    store.close()
    assert not any(v.is_pinned() for v in views)  # unregistered on close


class Toy(nn.Module):
    """A stand-in decoder layer: a Linear (NF4-packable) and a per-channel scale (dense)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.proj = nn.Linear(width, width, bias=False)
        self.scale = nn.Parameter(torch.ones(width))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + torch.tanh(self.proj(h)) * self.scale


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("quant", ["none", "nf4"])
@pytest.mark.parametrize("slow", ["compute", "copies"])
def test_the_copy_stream_keeps_slots_and_layers_in_order(quant: str, slow: str) -> None:
    """Slow compute: the copy thread runs far ahead, so a copy that did not wait for the slot's
    last layer (its `free` event) would overwrite weights still to be read. Slow copies (large
    layers, no compute to speak of): a layer that did not wait for its copy (`loaded`) would read
    a half-written slot. Either shows as a difference from the same layers resident."""
    dev = torch.device("cuda")
    width = 256 if slow == "compute" else 4096  # 64 MiB per fp32 layer: a copy takes milliseconds
    n, ring = 6, 2
    g = torch.Generator().manual_seed(3)
    layers = []
    for _ in range(n):
        layer = Toy(width).eval()
        with torch.no_grad():
            layer.proj.weight.normal_(0.0, 0.05, generator=g)
            layer.scale.uniform_(0.5, 1.5, generator=g)
        layers.append(layer)
    layout = LayerLayout.of(layers[0], torch.float32, quant)  # type: ignore[arg-type]
    store = HostStore([layout.nbytes] * n, ram_layers=n, pin=True)
    for j, layer in enumerate(layers):
        for name, p in layer.named_parameters():
            pack_entry(layout, store.ram_buffer(j), name, p.detach())
    store.seal()

    def template(index: int = 0) -> nn.Module:
        with torch.device("meta"):
            return Toy(width).eval()

    streamed = LayerStreamer([LayerHome(store_index=j) for j in range(n)], layout, store, template, dev, ring)
    if quant == "nf4":
        homes = [LayerHome(packed=store.ram_buffer(j).to(dev)) for j in range(n)]
    else:
        homes = [LayerHome(module=layer.to(dev)) for layer in layers]
    resident = LayerStreamer(homes, layout, None, template, dev, ring)
    spin = 20_000_000 if slow == "compute" else 0  # ~10 ms of GPU clock per layer

    def call(module: nn.Module, i: int, h: torch.Tensor) -> torch.Tensor:
        if spin:
            torch.cuda._sleep(spin)
        return module(h)

    h0 = torch.randn(1, 8, width, generator=g).to(dev)
    with torch.inference_mode():
        want = [resident.run(h0 + p, call) for p in range(3)]
        got = [streamed.run(h0 + p, call) for p in range(3)]  # consecutive passes: the prefetch wraps
    torch.cuda.synchronize()
    for a, b in zip(got, want):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6)
    streamed.close()


@pytest.mark.gpu
@cuda
def test_a_model_on_the_gpu_attends_without_cudnns_per_shape_plans(five_layer_path: Path) -> None:
    """load_model keeps SDPA off cuDNN's kernel (engine.model.cache.steady_attention): it built a
    plan for every new key length, ~8 ms a layer, and a conversation's every step has a new one
    (an H200 answered 13-22 tok/s with it, 71-91 without). Decode steps then run no cuDNN
    attention op."""
    torch.backends.cuda.enable_cudnn_sdp(True)
    loaded = load_model(five_layer_path, "cuda", torch.bfloat16)  # (cuDNN's kernel takes 16-bit only)
    assert not torch.backends.cuda.cudnn_sdp_enabled()
    ids = torch.arange(1, 9, device="cuda")[None]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        loaded.model.hf_model(ids)
        loaded.model.hf_model(ids[:, :5])
    assert not [e.key for e in prof.key_averages() if "cudnn_attention" in e.key]


@pytest.mark.gpu
@cuda
def test_a_vram_cap_is_what_the_placement_sees(five_layer_path: Path) -> None:
    """With the caching allocator capped, device_free_bytes reports what is left under the cap
    (mem_get_info does not see it), allocations past it fail, and the loader then streams the
    layers it would otherwise keep on the device."""
    dev = torch.device("cuda", torch.cuda.current_device())
    before = torch.cuda.get_per_process_memory_fraction(dev)
    uncapped = load_model(five_layer_path, "cuda", torch.float32, offload="auto")
    assert uncapped.model.placement.gpu_layers == 5
    del uncapped
    torch.cuda.empty_cache()
    total = torch.cuda.mem_get_info(dev)[1]
    limit = torch.cuda.memory_reserved(dev) + 512 * MIB
    try:
        torch.cuda.set_per_process_memory_fraction(limit / total, dev)
        left = device_free_bytes(dev)
        assert abs(left - 512 * MIB) < MIB and device_free_bytes("cuda") == left  # a bare "cuda" works too
        assert torch.cuda.mem_get_info(dev)[0] > left + GIB  # the driver's figure ignores the cap
        kept = torch.empty(256 * MIB, dtype=torch.uint8, device=dev)
        with pytest.raises(torch.OutOfMemoryError):
            torch.empty(512 * MIB, dtype=torch.uint8, device=dev)
        del kept
        capped = load_model(five_layer_path, "cuda", torch.float32, offload="auto")  # under 1 GiB of margin
        p = capped.model.placement
        assert (p.gpu_layers, p.ram_layers) == (0, 5)
        cache = capped.model.new_cache(16)
        ids = torch.arange(9) % 300
        hidden = capped.model.forward(ids, torch.arange(9), cache, None)
        assert torch.isfinite(capped.model.logits(hidden)).all()
    finally:
        torch.cuda.set_per_process_memory_fraction(before, dev)


@pytest.mark.gpu
@cuda
def test_the_gpu_probes_measure_this_card(tmp_path: Path) -> None:
    profile = measure_hardware(quick=True, models_dir=tmp_path)
    gpu = profile.gpu
    assert gpu is not None and gpu.name == torch.cuda.get_device_name(0)
    assert gpu.pinned_h2d_gbps > 1.0 and gpu.pageable_h2d_gbps > 0.1
    assert gpu.device_memory_gbps > 50.0 and gpu.bf16_tflops > 1.0
    assert profile.layer_timing.device.startswith("cuda")
    link = (gpu.pcie_gen_max, gpu.pcie_width_max)  # NVML: both read, or neither (no NVML here)
    assert link == (None, None) or (1 <= link[0] <= 7 and link[1] in (1, 2, 4, 8, 16, 32))
