"""Gated DeltaNet ("linear_attention") layers verifying a token tree.

Qwen3.5 / Qwen3.6 (`qwen3_5`, `qwen3_5_moe`) and Qwen3-Next (`qwen3_next`) interleave full
attention with Gated DeltaNet layers, whose memory is not a growing K/V but, per layer, a causal
depthwise-conv state (the last kernel-1 pre-conv inputs) and a recurrent state (dk x dv per value
head). `TreeGatedDeltaNet` replaces transformers' module in its decoder layer
(`layer.linear_attn = TreeGatedDeltaNet(layer.linear_attn)`), adopting its weights under the
same names, and gives every token of a pass the output transformers would give it had it read
the token's own root-to-node path one token at a time after the committed state: the conv reads
the node's ancestors (then the committed conv state), the delta rule starts from its parent.

Delta rule, per value head: S_t = a_t S_p (I - b_t k_t k_t^T) + b_t k_t v_t^T, o_t = S_t^T q_t,
with S_p the parent's state, a_t = exp(g_t) and b_t = beta_t. Along any path the state is
S_j = c_j S_0 + sum_{i in path(j)} (c_j / c_i) k_i u_i^T (c = product of a along the path), and
the corrections u solve a unit-lower-triangular system over ancestor pairs. So a tree is one
block of transformers' chunked form with the ancestor mask in place of the causal one (a node's
u depends only on its ancestors), and a chain is that form in chunks of 64, as transformers does.
No per-node state is ever built; a pass hands back per-node inputs (`LinearPending`), and
`advance` replays the accepted path from the committed state (on the CPU one token at a time in
C: engine/kernels/delta_replay.py).

Contract: the cache passed as `cache_params` satisfies `LinearCache`; the pass's shape is a
`PassTree` the cache builds once per pass (parents before children, -1 = the committed state).
Batch size 1. Numerics match transformers' torch path in the model dtype (fp32 recurrent state,
q/k normalised in fp32) up to float rounding, not bit for bit: a path read one token at a time
and the same path in block form round differently. Costs: a tree pass holds (heads, n, n) fp32
matrices, heads grouped under BLOCK_ELEMENTS; its pending keeps, per node, the pre-conv input
and the post-conv k and v (about 2 conv_dim values), until `advance`.

What it does not do: full-attention layers or their masks (causal_lm), deciding which path is
accepted (engine.decoding), keeping states between passes (the cache), or padding: a 2-D
padding mask is applied as transformers does, any other mask is ignored (the tree comes from the
cache). It does not use the fused fla / causal-conv1d kernels.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TypeVar

import torch
import torch.nn.functional as F
from torch import nn

from engine.errors import UnsupportedModel
from engine.kernels import delta_replay
from engine.model.linear_state import LinearCache, LinearLayerState, LinearPending, NodeInputs, PassTree

CHUNK = 64  # chain block length: transformers' chunk_size
# a config key (set by engine.loading.gguf_hybrid): the value heads are in llama.cpp's tiled order
# ([K0 v0, K1 v0, .., K0 v1, ..]: value head h reads key head h % key heads) rather than grouped by
# key head as transformers' checkpoints have them (h reads key head h // (value heads / key heads))
TILED = "linear_value_heads_tiled"
BLOCK_ELEMENTS = 1 << 25  # (heads, n, n) fp32 elements per tree block: heads go in groups under it
T = TypeVar("T")


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)  # transformers' (and fla's) eps


def _block(q: torch.Tensor | None, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor,
           cum: torch.Tensor, allowed: torch.Tensor, state: torch.Tensor, q_from: int = 0
           ) -> tuple[torch.Tensor | None, torch.Tensor]:
    """Delta rule over m nodes read from `state`, each after its allowed (ancestor) nodes.

    q, k (H, m, dk) normalised (q scaled), v (H, m, dv), beta and cum (H, m) (cum: path sum of g
    within the block), allowed (m, m) bool lower-triangular with the diagonal, state (H, dk, dv).
    Returns the outputs (H, m, dv) (None without q) and the corrections u (H, m, dv). With
    `q_from`, q holds only the rows of nodes q_from.. (the earlier nodes are ancestors read by
    an earlier pass: their corrections are needed, their outputs are not)."""
    decay = (cum[:, :, None] - cum[:, None, :]).masked_fill(~allowed, float("-inf")).exp()  # (H, m, m)
    k_beta = k * beta[..., None]
    system = (k_beta @ k.transpose(-1, -2)) * decay  # its diagonal is ignored: unit triangular
    rhs = torch.cat([v * beta[..., None], k_beta * cum.exp()[..., None]], -1)  # (H, m, dv + dk)
    sol = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
    dv = v.shape[-1]
    u = sol[..., :dv] - sol[..., dv:] @ state  # (H, m, dv)
    if q is None:
        return None, u
    out = (q * cum[:, q_from:].exp()[..., None]) @ state + ((q @ k.transpose(-1, -2)) * decay[:, q_from:]) @ u
    return out, u


def _chain_rule(q: torch.Tensor | None, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor,
                g: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor]:
    """A chain from `state` (H, dk, dv) in blocks of CHUNK: outputs (H, n, dv) and the end state."""
    outs = []
    for s in range(0, k.shape[1], CHUNK):
        e = min(s + CHUNK, k.shape[1])
        cum = g[:, s:e].cumsum(-1)  # (H, m)
        causal = torch.ones(e - s, e - s, dtype=torch.bool, device=k.device).tril()
        out, u = _block(None if q is None else q[:, s:e], k[:, s:e], v[:, s:e], beta[:, s:e],
                        cum, causal, state)
        if out is not None:
            outs.append(out)
        tail = (cum[:, -1:] - cum).exp()[..., None]  # decay from each node to the block's end
        state = state * cum[:, -1].exp()[:, None, None] + (k[:, s:e] * tail).transpose(-1, -2) @ u
    return (torch.cat(outs, 1) if q is not None else None), state


def _tree_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor,
               g: torch.Tensor, state: torch.Tensor, tree: PassTree, q_from: int = 0) -> torch.Tensor:
    """Every node of a tree from `state`: outputs (H, n - q_from, dv) of the nodes q_from..,
    heads in groups to bound memory."""
    assert tree.ancestors is not None
    cum = tree.path_sums(g)  # (H, n)
    heads = k.shape[0]
    group = max(1, BLOCK_ELEMENTS // max(1, tree.n * tree.n))
    outs = []
    for h in range(0, heads, group):
        sl = slice(h, h + group)
        out, _ = _block(q[sl], k[sl], v[sl], beta[sl], cum[sl], tree.ancestors, state[sl], q_from)
        assert out is not None
        outs.append(out)
    return torch.cat(outs, 0)


def _per_value_head(x: torch.Tensor, value_heads: int, tiled: bool) -> torch.Tensor:
    """(n, H_k, d) -> (n, H_v, d): each value head's key head, grouped or tiled (TILED)."""
    r = value_heads // x.shape[1]
    return x.repeat(1, r, 1) if tiled else x.repeat_interleave(r, dim=1)


def _head_major(k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, g: torch.Tensor, tiled: bool = False
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Node-major model-dtype k (n, H_k, dk), v (n, H_v, dv), beta, g (n, H_v) -> fp32 (H_v, n, .)
    with k repeated over its value heads (tiled: see TILED) and normalised, as transformers'
    rule does."""
    k = _per_value_head(k, v.shape[1], tiled)
    k = _l2norm(k.transpose(0, 1).float())
    return k, v.transpose(0, 1).float(), beta.transpose(0, 1).float(), g.transpose(0, 1).float()


@torch.inference_mode()
def advance(state: LinearLayerState, pending: LinearPending,
            path: torch.Tensor | Sequence[int] | None = None, tiled: bool = False) -> None:
    """Update `state` in place to the state after the pass's nodes at `path` (a chain of
    indices from a child of the committed state downward, possibly empty); None keeps the whole
    pass, which must be a chain. `tiled`: the layer's value heads (TILED)."""
    if path is None or (pending.end is not None and len(path) == pending.n):
        assert pending.end is not None, "only a chain is kept whole"
        state.conv.copy_(pending.end.conv)
        state.recurrent.copy_(pending.end.recurrent)
        return
    if len(path) == 0:
        return
    nodes = pending.nodes
    assert nodes is not None, "a chain kept whole cannot be cut"
    idx = torch.as_tensor(path, dtype=torch.long, device=nodes.x.device)
    km1 = state.conv.shape[-1]
    ext = torch.cat([state.conv[0].to(nodes.x), nodes.x[idx].T], -1)  # (C, km1 + L)
    state.conv.copy_(ext[None, :, ext.shape[-1] - km1:])
    rows = nodes.k[idx], nodes.v[idx], nodes.beta[idx], nodes.g[idx]
    if delta_replay.replay(state.recurrent, *rows, tiled):  # the CPU: one token at a time, in C
        return
    k, v, beta, g = _head_major(*rows, tiled)
    _, end = _chain_rule(None, k, v, beta, g, state.recurrent[0].to(k))
    state.recurrent.copy_(end[None])


class TreeGatedDeltaNet(nn.Module):
    """A transformers Gated DeltaNet (qwen3_5 / qwen3_5_moe / qwen3_next) verifying trees.

    Adopts the wrapped module's parameters and submodules under the same names (so loaders and
    state dicts see the layer unchanged) and keeps no reference to the module itself, so a
    loader may later swap a projection for a packed one."""

    # adopted from the wrapped module; the projections may be nn.Linear or a packed stand-in
    conv1d: nn.Conv1d
    in_proj_qkv: nn.Module  # qwen3_5
    in_proj_z: nn.Module
    in_proj_b: nn.Module
    in_proj_a: nn.Module
    in_proj_qkvz: nn.Module  # qwen3_next
    in_proj_ba: nn.Module
    A_log: nn.Parameter  # (H_v,)
    dt_bias: nn.Parameter  # (H_v,)
    norm: nn.Module  # gated RMSNorm over dv
    out_proj: nn.Module

    def __init__(self, original: nn.Module, tiled: bool = False) -> None:
        super().__init__()
        self.tiled = tiled  # value heads in llama.cpp's tiled order (TILED)
        if hasattr(original, "in_proj_qkvz") and hasattr(original, "in_proj_ba"):
            self.fused = True  # qwen3_next: q, k, v, z (and b, a) interleaved per key head
        elif all(hasattr(original, n) for n in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")):
            self.fused = False  # qwen3_5: one projection each
        else:
            raise UnsupportedModel(
                f"This model's linear-attention layer ({type(original).__name__}) has a layout "
                "SpecChat does not know. Choose a Qwen3.5, Qwen3.6 or Qwen3-Next model, or another family.")
        for name, child in original.named_children():
            self.add_module(name, child)
        for name, param in original.named_parameters(recurse=False):
            self.register_parameter(name, param)
        self.layer_idx = _attr(original, "layer_idx", int)
        self.num_k_heads = _attr(original, "num_k_heads", int)
        self.num_v_heads = _attr(original, "num_v_heads", int)
        self.head_k_dim = _attr(original, "head_k_dim", int)
        self.head_v_dim = _attr(original, "head_v_dim", int)
        self.key_dim = _attr(original, "key_dim", int)
        self.value_dim = _attr(original, "value_dim", int)
        self.conv_dim = _attr(original, "conv_dim", int)
        self.kernel = _attr(original, "conv_kernel_size", int)
        self.activation = _attr(original, "activation", str)
        assert self.num_v_heads % self.num_k_heads == 0

    def new_state(self, dtype: torch.dtype, device: torch.device | str) -> LinearLayerState:
        """The state before any token (zeros); `dtype` is the model's activation dtype."""
        return LinearLayerState.zeros(self.conv_dim, self.kernel, self.num_v_heads, self.head_k_dim,
                                      self.head_v_dim, dtype, device)

    def _project(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """h (n, hidden) -> pre-conv x (n, conv_dim), z (n, H_v, dv), b and a (n, H_v)."""
        n = h.shape[0]
        if not self.fused:
            z = self.in_proj_z(h).reshape(n, self.num_v_heads, self.head_v_dim)
            return self.in_proj_qkv(h), z, self.in_proj_b(h), self.in_proj_a(h)
        r = self.num_v_heads // self.num_k_heads
        dk, rdv = self.head_k_dim, r * self.head_v_dim
        qkvz = self.in_proj_qkvz(h).reshape(n, self.num_k_heads, 2 * dk + 2 * rdv)
        ba = self.in_proj_ba(h).reshape(n, self.num_k_heads, 2 * r)
        q, k, v, z = torch.split(qkvz, [dk, dk, rdv, rdv], dim=-1)
        b, a = torch.split(ba, [r, r], dim=-1)
        x = torch.cat([q.reshape(n, -1), k.reshape(n, -1), v.reshape(n, -1)], -1)
        return x, z.reshape(n, self.num_v_heads, self.head_v_dim), b.reshape(n, -1), a.reshape(n, -1)

    def _conv(self, x: torch.Tensor, committed: torch.Tensor, tree: PassTree) -> torch.Tensor:
        """Causal depthwise conv of each node over its path: x (n, C) -> (n, C), x's dtype."""
        weight = self.conv1d.weight  # (C, 1, kernel)
        ext = torch.cat([committed.to(x), x.T], -1).to(weight.dtype)  # (C, kernel - 1 + n)
        if tree.chain:
            out = F.conv1d(ext[None], weight, self.conv1d.bias, groups=self.conv_dim)  # (1, C, n)
        else:
            windows = ext[:, tree.conv_windows(self.kernel)].reshape(1, self.conv_dim, -1)  # (1, C, n*K)
            out = F.conv1d(windows, weight, self.conv1d.bias, stride=self.kernel, groups=self.conv_dim)
        out = F.silu(out) if self.activation == "silu" else _activation(self.activation)(out)
        return out[0].T.to(x.dtype)

    def forward(self, hidden_states: torch.Tensor, cache_params: LinearCache | None = None,
                attention_mask: torch.Tensor | None = None, **kwargs: object) -> torch.Tensor:
        """hidden_states (1, n, hidden) -> (1, n, hidden). Without a cache: a chain from zeros."""
        if attention_mask is not None and attention_mask.dim() == 2:  # padding, as transformers
            hidden_states = (hidden_states * attention_mask[:, :, None]).to(hidden_states.dtype)
        batch, n, _ = hidden_states.shape
        assert batch == 1, "one sequence per pass"
        device, dtype = hidden_states.device, hidden_states.dtype
        if cache_params is None:
            tree, state = PassTree.of_chain(n, device, kept_whole=True), self.new_state(dtype, device)
        elif isinstance(cache_params, LinearCache):
            tree, state = cache_params.pass_tree(), cache_params.linear_state(self.layer_idx)
        else:
            raise TypeError(f"TreeGatedDeltaNet needs a LinearCache, got {type(cache_params).__name__}")
        prior = cache_params.linear_prior(self.layer_idx) if cache_params is not None else None
        m0 = 0 if prior is None else int(prior.x.shape[0])
        assert tree.n == m0 + n, "the pass tree and the hidden states disagree"
        assert prior is None or not tree.chain or m0 == 0, "earlier tokens make a pass a tree"

        x, z, b, a = self._project(hidden_states[0])
        x_all = x if prior is None else torch.cat([prior.x.to(x), x])
        mixed = self._conv(x_all, state.conv[0], tree)[m0:]  # (n, C)
        q_raw, k_raw, v_raw = torch.split(mixed, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q_raw = q_raw.reshape(n, self.num_k_heads, self.head_k_dim)
        k_raw = k_raw.reshape(n, self.num_k_heads, self.head_k_dim).contiguous()
        v_raw = v_raw.reshape(n, self.num_v_heads, self.head_v_dim).contiguous()
        beta = b.sigmoid()  # (n, H_v) in the model dtype, as transformers
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)  # (n, H_v) fp32, <= 0

        if prior is None:
            k, v, beta_h, g_h = _head_major(k_raw, v_raw, beta, g, self.tiled)  # (H_v, n, .) fp32
        else:  # the earlier tokens' corrections come first (their outputs are not needed)
            k, v, beta_h, g_h = _head_major(torch.cat([prior.k.to(k_raw), k_raw]), torch.cat([prior.v.to(v_raw), v_raw]),
                                            torch.cat([prior.beta.to(beta), beta]), torch.cat([prior.g.to(g), g]),
                                            self.tiled)
        q = _l2norm(_per_value_head(q_raw, self.num_v_heads, self.tiled).transpose(0, 1).float()) * self.head_k_dim ** -0.5
        s0 = state.recurrent[0].to(device=device, dtype=torch.float32)  # (H_v, dk, dv)
        end: LinearLayerState | None = None
        if tree.chain:
            out, s_end = _chain_rule(q, k, v, beta_h, g_h, s0)
            assert out is not None
            conv_ext = torch.cat([state.conv[0].to(x), x.T], -1)
            end = LinearLayerState(conv_ext[None, :, conv_ext.shape[-1] - (self.kernel - 1):], s_end[None])
        else:
            out = _tree_rule(q, k, v, beta_h, g_h, s0, tree, m0)
        if cache_params is not None:
            nodes = None if tree.kept_whole else NodeInputs(x, k_raw, v_raw, beta, g)
            cache_params.linear_pending(self.layer_idx, LinearPending(n, nodes, end))

        core = out.transpose(0, 1).to(dtype)  # (n, H_v, dv)
        core = self.norm(core.reshape(-1, self.head_v_dim), z.reshape(-1, self.head_v_dim))
        result: torch.Tensor = self.out_proj(core.reshape(1, n, self.value_dim))  # (1, n, hidden)
        return result


def _activation(name: str) -> nn.Module:
    from transformers.activations import ACT2FN

    act: nn.Module = ACT2FN[name]
    return act


def _attr(module: nn.Module, name: str, kind: type[T]) -> T:
    value = getattr(module, name)
    assert isinstance(value, kind), f"{type(module).__name__}.{name}"
    return value


def install(layers: Iterable[nn.Module], config: object = None) -> list[TreeGatedDeltaNet]:
    """Replace each decoder layer's `linear_attn` by a TreeGatedDeltaNet (value heads tiled
    where `config` says TILED); return the new ones."""
    out = []
    tiled = bool(getattr(config, TILED, False))
    for layer in layers:
        original = getattr(layer, "linear_attn", None)
        if original is not None and not isinstance(original, TreeGatedDeltaNet):
            wrapped = TreeGatedDeltaNet(original, tiled)
            layer.linear_attn = wrapped
            out.append(wrapped)
    return out
