"""The shapes of models and where their layers live: plain data the loader, the planner, the
engine and the app all read. LayerShape and ModelShape are what the cost model and the memory
arithmetic need of a decoder; Placement is where its decoder layers went (device, RAM, disk).

What a model's caches hold is priced per layer (CacheLayer), because layers differ: a full
attention layer keeps K/V for every token; a sliding-window layer at most its window plus the
tree being verified; a layer that reuses another layer's K/V (Gemma 4) keeps none; Gemma 4's
full layers have wider heads and fewer of them than its windowed ones; a Gated DeltaNet layer
keeps a fixed-size state instead (plus its snapshots at turn ends, and per pending tree token
the inputs a replay needs). `ModelShape.kv_bytes(context, tree, dtype_bytes)` is the one
figure the planner and the memory checks use; a 128k context on a Gemma 3 is mostly windowed
layers, a fraction of the every-layer-keeps-everything figure.

A mixture-of-experts model's layer stores every routed expert but a token reads only its top-k
(`ExpertShape`): the layer's parameters (what is stored, moved and held) count them all, while
what a pass reads and computes is its always-on part (attention, router, shared experts, a dense
MLP beside the experts) plus the union of the experts its tokens route to
(engine.planning.moe.expert_union).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any, Literal

# how decoder layers are kept and streamed: 16-bit, NF4, a GGUF file's own blocks, int4 AWQ/GPTQ
Packing = Literal["none", "nf4", "gguf", "awq", "gptq", "lowbit"]  # lowbit: a self-draft's substitutes
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


# Copies of a linear layer's state a cache keeps: the live one and engine.model.hybrid_cache's
# SNAPSHOTS (2: this turn's prompt end and the previous one); a test holds the two together.
STATE_COPIES = 3
WINDOW_SLACK_MIN = 4  # engine.model.window_cache.SLACK_MIN (a test holds the two together)


@dataclass(frozen=True)
class CacheLayer:
    """What one decoder layer keeps between passes. An attention layer: K and V of `kv_heads`
    heads of `head_dim` per entry (head_dim 0: it reads another layer's K/V and keeps none),
    for every entry, or with a `window` for the last `window` positions plus the tree. A Gated
    DeltaNet layer: a fixed state (its convolution's last inputs in the model's dtype, its
    recurrent state in fp32) and, per pending tree token, the inputs a replay of the
    accepted path needs (model dtype, and its log-decay in fp32)."""

    kv_heads: int = 0
    head_dim: int = 0
    window: int | None = None
    state_elements: int = 0  # model dtype
    state_fp32_elements: int = 0
    pending_elements: int = 0  # per pending tree token, model dtype
    pending_fp32_elements: int = 0

    def entries(self, context: int, tree: int, state_copies: int = STATE_COPIES) -> int:
        """K/V entries kept with `context` committed tokens and a `tree` of pending ones. A
        windowed layer (engine.model.window_cache) holds at most its window less one plus the
        dead entries it lets gather before shifting (a quarter window, at least WINDOW_SLACK_MIN),
        and the window before each of the turn ends it keeps (`state_copies` - 1 of them)."""
        if self.window is None:
            return context + tree
        held = min(context, self.window - 1 + max(WINDOW_SLACK_MIN, self.window // 4))
        return held + tree + (state_copies - 1) * min(context, self.window - 1)

    def nbytes(self, context: int, tree: int, dtype_bytes: int, state_copies: int = STATE_COPIES) -> int:
        kv = 2 * self.kv_heads * self.head_dim * dtype_bytes * self.entries(context, tree, state_copies)
        state = state_copies * (self.state_elements * dtype_bytes + 4 * self.state_fp32_elements)
        pending = tree * (self.pending_elements * dtype_bytes + 4 * self.pending_fp32_elements)
        return kv + state + pending


def _getter(config: Mapping[str, Any] | Any) -> Callable[[str], Any]:
    """A config's field by name, from a transformers config object or a config.json dict."""
    if isinstance(config, Mapping):
        return config.get
    return lambda key: getattr(config, key, None)


@dataclass(frozen=True)
class ExpertShape:
    """The routed experts of an MoE model: `experts` per layer, `top_k` of them per token, each a
    gated MLP of `width` (gate, up and down: 3 x hidden x width weights), in `moe_layers` of the
    model's layers (the others, e.g. GLM-4.5's first_k_dense_replace, have a dense MLP)."""

    experts: int
    top_k: int
    width: int
    moe_layers: int
    # how much a pass's tokens share their experts: 1.0 the prior (routing spread evenly), less
    # as measured for the model (engine.planning.moe.fit_sharing)
    sharing: float = 1.0

    @staticmethod
    def from_config(config: Mapping[str, Any] | Any) -> ExpertShape | None:
        """The routed experts a transformers config or config.json dict describes, None for a
        dense model. Reads each family's names: num_experts / num_local_experts / n_routed_experts,
        num_experts_per_tok / top_k_experts, moe_intermediate_size (else intermediate_size: Mixtral,
        gpt-oss), and which layers are dense (first_k_dense_replace, mlp_only_layers,
        decoder_sparse_step)."""
        get = _getter(config)

        experts = int(get("num_experts") or get("num_local_experts") or get("n_routed_experts") or 0)
        top_k = int(get("num_experts_per_tok") or get("top_k_experts") or 0)
        if experts <= 1 or top_k <= 0 or get("enable_moe_block") is False:  # Gemma 4 without its experts
            return None
        width = int(get("moe_intermediate_size") or get("intermediate_size") or 0)
        layers = int(get("num_hidden_layers"))
        dense = set(get("mlp_only_layers") or ())
        step = int(get("decoder_sparse_step") or 1)
        first_dense = int(get("first_k_dense_replace") or 0)
        moe = [i for i in range(layers) if i not in dense and i >= first_dense and (i + 1) % step == 0]
        return ExpertShape(experts, min(top_k, experts), width, len(moe)) if width and moe else None


@dataclass(frozen=True)
class ModelShape:
    """What the engine and the cost model need of a decoder-only model: its decoder layer, how
    many, the vocabulary (rows of the output head), and what each layer's cache keeps
    (`cache_layers`; empty: every layer is full attention of the decoder layer's K/V shape,
    as a catalog entry's shape fields describe it)."""

    name: str
    num_layers: int
    layer: LayerShape
    vocab_size: int
    cache_layers: tuple[CacheLayer, ...] = ()
    experts: ExpertShape | None = None

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

    # ---- mixtures of experts (all per decoder layer, averaged over the layers) ----
    @property
    def expert_params(self) -> int:
        """One routed expert's weights (gate, up, down); 0 for a dense model."""
        return 3 * self.hidden_size * self.experts.width if self.experts else 0

    @property
    def moe_fraction(self) -> float:
        """Share of the decoder layers that route to experts."""
        return self.experts.moe_layers / self.num_layers if self.experts else 0.0

    @property
    def routed_params(self) -> int:
        """A layer's routed experts' weights, all of them (a layer's average)."""
        return int(self.moe_fraction * self.experts.experts * self.expert_params) if self.experts else 0

    @property
    def always_params(self) -> int:
        """What every token of a layer reads besides its routed experts: attention, norms, router,
        shared experts, dense MLPs (all of `layer_params` for a dense model)."""
        return self.layer_params - self.routed_params

    def union_params(self, tokens: int, union: float | None = None) -> int:
        """A layer's weights a pass over `tokens` tokens reads: the always-on part and the union
        of the experts they route to (`union` experts per MoE layer; default
        engine.planning.moe.expert_union at the model's sharing); the whole layer for a dense model."""
        if self.experts is None:
            return self.layer_params
        if union is None:
            from engine.planning.moe import expert_union  # noqa: PLC0415 - pure arithmetic, no cycle at import

            union = expert_union(tokens, self.experts.experts, self.experts.top_k, self.experts.sharing)
        return self.always_params + int(self.moe_fraction * union * self.expert_params)

    @property
    def active_params(self) -> int:
        """A layer's weights one token reads (its top-k experts): union_params(1)."""
        if self.experts is None:
            return self.layer_params
        return self.always_params + int(self.moe_fraction * self.experts.top_k * self.expert_params)

    @property
    def activation_width(self) -> int:
        """The MLP width a token's activations take: the dense width, or for an MoE its top-k
        experts' and its always-on MLPs' (not every expert's, which `layer.intermediate_size`
        counts to size the stored layer)."""
        if self.experts is None:
            return self.layer.intermediate_size
        always_mlp = (self.always_params - self._attention_params()) // (3 * self.hidden_size)
        return max(0, always_mlp) + self.experts.top_k * self.experts.width

    def _attention_params(self) -> int:
        return replace(self.layer, intermediate_size=0).params

    @property
    def caches(self) -> tuple[CacheLayer, ...]:
        """Each decoder layer's CacheLayer."""
        if self.cache_layers:
            return self.cache_layers
        return (CacheLayer(self.num_kv_heads, self.head_dim),) * self.num_layers

    def kv_layer_bytes(self, context: int, tree: int, dtype_bytes: int,
                       state_copies: int = STATE_COPIES) -> list[int]:
        """What each layer's cache holds with `context` committed tokens and a `tree` of pending
        ones (CacheLayer.nbytes)."""
        return [c.nbytes(context, tree, dtype_bytes, state_copies) for c in self.caches]

    def kv_bytes(self, context: int, tree: int, dtype_bytes: int, state_copies: int = STATE_COPIES) -> int:
        """The whole cache with `context` committed tokens and a `tree` of pending ones: K/V of
        full-attention layers for context + tree entries, of windowed layers for at most
        window + tree, none for layers that reuse another's; linear layers' fixed states
        (`state_copies` of them: the live one and its snapshots) and their pending inputs."""
        return sum(self.kv_layer_bytes(context, tree, dtype_bytes, state_copies))

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """K and V for one token of every layer that keeps K/V, as if none were windowed: what
        the cache grows by per token before any window is full (an upper bound past it)."""
        return sum(2 * c.kv_heads * c.head_dim * dtype_bytes for c in self.caches)

    @staticmethod
    def from_config(config: Mapping[str, Any] | Any, name: str = "model") -> ModelShape:
        """From a transformers config object or a config.json dict. The one head_dim formula:
        the config's own `head_dim` (Qwen3, Gemma set it), else hidden_size / heads. What each
        layer's cache keeps follows from its kind (engine.model.family) where the family is one
        SpecChat runs; another model_type is taken as full attention in every layer."""
        from engine.planning.kv_sizing import cache_layers_of  # reads engine.model.family's table

        get = _getter(config)

        caches = cache_layers_of(config, name)  # first: it opens Gemma 4's per-layer fields to get()
        heads = int(get("num_attention_heads"))
        hidden = int(get("hidden_size"))
        layers = int(get("num_hidden_layers"))
        experts = ExpertShape.from_config(config)
        width = int(get("intermediate_size") or 0)
        if experts is not None:  # the stored layer's MLP width, averaged over the layers
            width = _moe_width(get, experts, layers, width)
        layer = LayerShape(name, hidden, width, heads,
                           int(get("num_key_value_heads") or heads), int(get("head_dim") or hidden // heads))
        return ModelShape(name, layers, layer, int(get("vocab_size")), caches, experts)


def moe_layer_width(experts: ExpertShape, always: int = 0) -> int:
    """The width of a dense MLP with an MoE layer's weights: every routed expert, the router
    (hidden x experts: a third of a width each) and `always`, the MLPs every token runs."""
    return experts.experts * experts.width + always + -(-experts.experts // 3)


def _moe_width(get: Any, experts: ExpertShape, layers: int, dense_width: int) -> int:
    """The width of a dense MLP with the weights an MoE model's layer stores, averaged over its
    layers: in an MoE layer every routed expert, the router (hidden x experts: a third of a
    width each), shared experts (Qwen's shared_expert_intermediate_size, DeepSeek/GLM's
    n_shared_experts x the expert width) and a dense MLP beside the experts (Gemma 4); in a
    dense layer its intermediate_size."""
    shared = int(get("shared_expert_intermediate_size") or 0) + int(get("n_shared_experts") or 0) * experts.width
    beside = dense_width if get("enable_moe_block") else 0  # Gemma 4 runs its MLP and the experts
    moe_layer = moe_layer_width(experts, shared + beside)
    return round((experts.moe_layers * moe_layer + (layers - experts.moe_layers) * dense_width) / layers)


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
    # layer runs, the streamed way); "experts-cpu": an MoE on a GPU whose routed experts stay
    # packed in RAM, run by the CPU kernel, the rest de-quantised at load on the GPU
    resident_form: Literal["", "kernel", "dequantised", "experts-cpu"] = ""
    cached_experts: float = 0.0  # "experts-cpu": the share of routed experts cached in VRAM (expert_cache)
    experts_streamed: bool = False  # "experts-cpu" with `--experts stream`: every pass's experts run on the GPU

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

    def experts_where(self) -> str:
        """"experts: 12 % in VRAM, rest on CPU" (an "experts-cpu" placement)."""
        if self.experts_streamed:
            return "experts: in RAM, each pass's streamed to the GPU"
        share = self.cached_experts * 100
        pct = f"{share:.0f}" if share >= 1 or share == 0 else f"{share:.1f}"
        return f"experts: {pct} % in VRAM, rest on CPU"

    def describe(self) -> str:
        """Where the layers live, in the status bar's and the CLI's words: "18 of 80 layers on
        GPU, 62 in RAM" on a GPU; "all 48 layers on GPU, experts: 0 % in VRAM, rest on CPU" for
        an MoE whose routed experts run on the CPU; on a CPU, where the device memory is the RAM,
        "3 of 5 layers resident, 2 streamed from disk"."""
        n = self.num_layers
        nf4 = PACKING_LABELS[self.quant]
        if self.resident_form and self.quant != "none" and self.resident_form != "experts-cpu":
            nf4 = nf4[:-1] + {"kernel": ", packed CPU kernel)", "dequantised": ", de-quantised at load)"}[self.resident_form]
        if self.device.startswith("cuda"):
            if self.resident_form == "experts-cpu":
                return f"all {n} layers on GPU, {self.experts_where()}{nf4}"
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
