"""The shapes of models and where their layers live: plain data the loader, the planner, the
engine and the app all read. LayerShape and ModelShape are what the cost model and the memory
arithmetic need of a decoder; Placement is where its decoder layers went (device, RAM, disk)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

# how decoder layers are kept and streamed: 16-bit, NF4, a GGUF file's own blocks, int4 AWQ/GPTQ
Packing = Literal["none", "nf4", "gguf", "awq", "gptq"]
PACKING_LABELS = {"none": "", "nf4": " (NF4)", "gguf": " (GGUF blocks)", "awq": " (AWQ int4)", "gptq": " (GPTQ int4)"}


@dataclass(frozen=True)
class LayerShape:
    """Shape of one llama-family decoder layer (the values of a model's config.json)."""

    name: str
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int

    @property
    def params(self) -> int:
        h, hd = self.hidden_size, self.head_dim
        attn = h * self.num_attention_heads * hd * 2 + h * self.num_kv_heads * hd * 2  # q, o, k, v
        return attn + 3 * h * self.intermediate_size + 2 * h  # gate/up/down + two norms

    def flops(self, tokens: int) -> float:
        return 2.0 * self.params * tokens


@dataclass(frozen=True)
class ModelShape:
    """What the engine and the cost model need of a decoder-only model: its decoder layer, how
    many, and the vocabulary (rows of the output head)."""

    name: str
    num_layers: int
    layer: LayerShape
    vocab_size: int

    @property
    def hidden_size(self) -> int:
        return self.layer.hidden_size

    @property
    def num_kv_heads(self) -> int:
        return self.layer.num_kv_heads

    @property
    def head_dim(self) -> int:
        return self.layer.head_dim

    @property
    def layer_params(self) -> int:
        return self.layer.params

    @property
    def head_params(self) -> int:
        return self.vocab_size * self.layer.hidden_size

    @property
    def params(self) -> int:
        """Decoder layers plus embeddings and head (counted twice: untied is the common case)."""
        return self.num_layers * self.layer_params + 2 * self.head_params

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """K and V of every layer for one token."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes

    @staticmethod
    def from_config(config: Mapping[str, Any] | Any, name: str = "model") -> ModelShape:
        """From a transformers config object or a config.json dict. The one head_dim formula:
        the config's own `head_dim` (Qwen3, Gemma set it), else hidden_size / heads."""
        def get(key: str) -> Any:
            return config.get(key) if isinstance(config, Mapping) else getattr(config, key, None)

        heads = int(get("num_attention_heads"))
        hidden = int(get("hidden_size"))
        layer = LayerShape(name, hidden, int(get("intermediate_size")), heads,
                           int(get("num_key_value_heads") or heads), int(get("head_dim") or hidden // heads))
        return ModelShape(name, int(get("num_hidden_layers")), layer, int(get("vocab_size")))


@dataclass(frozen=True)
class Placement:
    """Where the target's decoder layers live. layer_bytes is one decoder layer as stored and
    streamed (packed NF4 counts its packed size plus scales; GGUF layers their largest)."""

    num_layers: int
    gpu_layers: int
    ram_layers: int = 0
    disk_layers: int = 0
    layer_bytes: int = 0
    quant: Packing = "none"
    device: str = "cpu"
    # how packed layers resident on a CPU run: "kernel" (their codes, by the packed CPU kernel),
    # "dequantised" (de-quantised once, at load); "" as the packing says (de-quantised as each
    # layer runs, the streamed way)
    resident_form: Literal["", "kernel", "dequantised"] = ""

    @property
    def unpacks_each_pass(self) -> bool:
        """Whether a pass pays for de-quantising its packed layers."""
        return self.quant != "none" and not self.resident_form

    def tiers(self) -> list[Literal["device", "ram", "disk"]]:
        """Each decoder layer's home, in layer order. The device layers are spread evenly among
        the streamed ones rather than taken from the front: a pass runs layers in order, and
        while a resident layer computes the copy stream keeps filling the ring with the next
        streamed layers. With the resident layers in front, the ring (a few slots) fills during
        the first of them and the link then idles for the rest (an H100 at 20 of 80 layers
        resident: 0.72 s per pass against 0.58 s predicted for a busy link). The streamed
        layers go to RAM first, the disk tier takes the last of them."""
        n, g = self.num_layers, self.gpu_layers
        device = [(i + 1) * g // max(n, 1) > i * g // max(n, 1) for i in range(n)]
        out: list[Literal["device", "ram", "disk"]] = []
        streamed = 0
        for on_device in device:
            if on_device:
                out.append("device")
            else:
                out.append("ram" if streamed < self.ram_layers else "disk")
                streamed += 1
        return out

    def describe(self) -> str:
        """Where the layers live, in the status bar's and the CLI's words: "18 of 80 layers on
        GPU, 62 in RAM" on a GPU; on a CPU, where the device memory is the RAM, "3 of 5 layers
        resident, 2 streamed from disk"."""
        n = self.num_layers
        nf4 = PACKING_LABELS[self.quant]
        if self.resident_form and self.quant != "none":
            nf4 = nf4[:-1] + (", packed CPU kernel)" if self.resident_form == "kernel" else ", de-quantised at load)")
        if self.device.startswith("cuda"):
            if self.gpu_layers == n:
                return f"all {n} layers on GPU{nf4}"
            parts = [f"{self.gpu_layers} of {n} layers on GPU"]
            parts += [f"{self.ram_layers} in RAM"] if self.ram_layers else []
            parts += [f"{self.disk_layers} on disk"] if self.disk_layers else []
            return ", ".join(parts) + nf4
        if self.gpu_layers == n:
            return f"all {n} layers resident in RAM{nf4}"
        tiers = [(k, where) for k, where in ((self.ram_layers, "RAM"), (self.disk_layers, "disk")) if k]
        if len(tiers) == 1:
            how = f"streamed from {tiers[0][1]}"
        else:
            how = "streamed (" + ", ".join(f"{k} from {where}" for k, where in tiers) + ")"
        if not self.gpu_layers:
            return f"all {n} layers {how}{nf4}"
        return f"{self.gpu_layers} of {n} layers resident, {self.ram_layers + self.disk_layers} {how}{nf4}"
