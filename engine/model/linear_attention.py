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
`advance` replays the accepted path from the committed state.

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

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar, runtime_checkable

import torch
import torch.nn.functional as F
from torch import nn

from engine.errors import UnsupportedModel

CHUNK = 64  # chain block length: transformers' chunk_size
BLOCK_ELEMENTS = 1 << 25  # (heads, n, n) fp32 elements per tree block: heads go in groups under it
T = TypeVar("T")


@dataclass
class LinearLayerState:
    """The committed state of one linear layer for one sequence."""

    conv: torch.Tensor  # (1, conv_dim, kernel - 1) the last pre-conv inputs, model dtype
    recurrent: torch.Tensor  # (1, H_v, dk, dv) fp32, as transformers keeps it

    @classmethod
    @torch.inference_mode()
    def zeros(cls, conv_dim: int, kernel: int, num_v_heads: int, dk: int, dv: int,
              dtype: torch.dtype, device: torch.device | str) -> LinearLayerState:
        return cls(torch.zeros(1, conv_dim, kernel - 1, dtype=dtype, device=device),
                   torch.zeros(1, num_v_heads, dk, dv, dtype=torch.float32, device=device))

    @torch.inference_mode()
    def clone(self) -> LinearLayerState:
        return LinearLayerState(self.conv.clone(), self.recurrent.clone())

    @torch.inference_mode()
    def to(self, device: torch.device | str) -> LinearLayerState:
        """Self, moved to `device`."""
        self.conv, self.recurrent = self.conv.to(device), self.recurrent.to(device)
        return self

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(conv, recurrent), for saving."""
        return self.conv, self.recurrent

    @classmethod
    @torch.inference_mode()
    def from_tensors(cls, conv: torch.Tensor, recurrent: torch.Tensor,
                     device: torch.device | str) -> LinearLayerState:
        assert conv.dim() == 3 and recurrent.dim() == 4 and recurrent.dtype == torch.float32
        return cls(conv.to(device).clone(), recurrent.to(device).clone())

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())


@dataclass(frozen=True)
class PassTree:
    """The shape of one pass's n tokens, built once per pass and read by every linear layer.

    Invariant: parents[i] < i; -1 means the node hangs off the committed state."""

    parents: torch.Tensor  # (n,) long, on the model's device
    chain: bool  # parents == [-1, 0, ..., n-2]
    kept_whole: bool  # a chain the caller keeps in full (prefill): layers hand back no per-node inputs
    ancestors: torch.Tensor | None  # (n, n) bool, [j, i]: i is j or an ancestor of j; None for a chain
    jumps: tuple[torch.Tensor, ...]  # (n + 1,) long each: 2^t-th ancestors, n = none (pointer jumping)

    @property
    def n(self) -> int:
        return int(self.parents.shape[0])

    @classmethod
    def of_chain(cls, n: int, device: torch.device | str, kept_whole: bool = False) -> PassTree:
        parents = torch.arange(-1, n - 1, device=device)
        return cls(parents, True, kept_whole, None, ())

    @classmethod
    def from_parents(cls, parents: torch.Tensor | Sequence[int], device: torch.device | str,
                     chain_ok: bool = True) -> PassTree:
        """One host read of the parents; every table built on `device`. `chain_ok=False` keeps
        the tree form for a chain (the cache's pending tokens come first in it)."""
        ps = [int(p) for p in (parents.tolist() if isinstance(parents, torch.Tensor) else parents)]
        n = len(ps)
        depth = [0] * n
        for i, p in enumerate(ps):
            if not -1 <= p < i:
                raise ValueError(f"token {i} has parent {p}: parents must come first")
            depth[i] = 1 if p < 0 else depth[p] + 1
        if chain_ok and all(p == i - 1 for i, p in enumerate(ps)):
            return cls.of_chain(n, device)
        par = torch.tensor(ps, dtype=torch.long, device=device)
        ancestors = torch.eye(n, dtype=torch.bool, device=device)
        by_depth: dict[int, list[int]] = {}
        for i, d in enumerate(depth):
            by_depth.setdefault(d, []).append(i)
        for d in range(2, max(depth) + 1):  # a row is complete once its parent's level is done
            rows = torch.tensor(by_depth[d], device=device)
            ancestors[rows] |= ancestors[par[rows]]
        jump = torch.cat([torch.where(par >= 0, par, n), torch.tensor([n], device=device)])  # (n + 1,)
        jumps = []
        for _ in range(math.ceil(math.log2(max(depth)))):
            jumps.append(jump)
            jump = jump[jump]
        return cls(par, False, False, ancestors, tuple(jumps))

    def path_sums(self, g: torch.Tensor) -> torch.Tensor:
        """(H, n) -> (H, n): each node's sum of g over its root-to-node path (itself included)."""
        if self.chain:
            return g.cumsum(-1)
        total = torch.cat([g, g.new_zeros(g.shape[0], 1)], -1)  # column n: "no ancestor", stays 0
        for jump in self.jumps:
            total = total + total[:, jump]
        return total[:, :-1]

    def conv_windows(self, kernel: int) -> torch.Tensor:
        """(n, kernel) long: each node's conv inputs, oldest first, as indices into
        [committed conv columns (kernel - 1), this pass's tokens (n)]."""
        km1 = kernel - 1
        own = torch.arange(self.n, device=self.parents.device) + km1
        committed_parent = (torch.arange(km1, device=own.device) - 1).clamp(min=0)  # col 0: never read
        ext_parent = torch.cat([committed_parent, torch.where(self.parents >= 0, self.parents + km1, km1 - 1)])
        cols = [own]
        for _ in range(km1):
            cols.append(ext_parent[cols[-1]])
        return torch.stack(cols[::-1], dim=1)


@dataclass(frozen=True)
class NodeInputs:
    """Per-node inputs of one layer's pass, enough to replay any root-to-node path."""

    x: torch.Tensor  # (n, conv_dim) pre-conv inputs, model dtype
    k: torch.Tensor  # (n, H_k, dk) post-conv keys, not normalised, model dtype
    v: torch.Tensor  # (n, H_v, dv) post-conv values, model dtype
    beta: torch.Tensor  # (n, H_v) model dtype
    g: torch.Tensor  # (n, H_v) fp32 log-decay


@dataclass(frozen=True)
class LinearPending:
    """What one layer's pass hands back for `advance`: per-node inputs (None for a chain kept
    whole) and, for a chain, the state after all of it."""

    n: int
    nodes: NodeInputs | None
    end: LinearLayerState | None


@runtime_checkable
class LinearCache(Protocol):
    """What `TreeGatedDeltaNet` needs from the `past_key_values` object of a pass."""

    def pass_tree(self) -> PassTree:
        """This pass's shape, built once per pass (`PassTree.from_parents`, `PassTree.of_chain`)."""
        ...

    def linear_state(self, layer_idx: int) -> LinearLayerState:
        """The layer's committed state; the pass only reads it."""
        ...

    def linear_pending(self, layer_idx: int, pending: LinearPending) -> None:
        """Keep `pending` until the accepted path is known, then `advance(state, pending, path)`."""
        ...

    def linear_prior(self, layer_idx: int) -> NodeInputs | None:
        """The inputs of the tokens earlier passes read that are not yet folded into the
        committed state (a draft's tree grows over several passes), or None. When given, the
        pass tree covers them first, then this pass's tokens."""
        ...


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


def _head_major(k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, g: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Node-major model-dtype k (n, H_k, dk), v (n, H_v, dv), beta, g (n, H_v) -> fp32 (H_v, n, .)
    with k repeated over its value heads and normalised, as transformers' rule does."""
    k = k.repeat_interleave(v.shape[1] // k.shape[1], dim=1)
    k = _l2norm(k.transpose(0, 1).float())
    return k, v.transpose(0, 1).float(), beta.transpose(0, 1).float(), g.transpose(0, 1).float()


@torch.inference_mode()
def advance(state: LinearLayerState, pending: LinearPending,
            path: torch.Tensor | Sequence[int] | None = None) -> None:
    """Update `state` in place to the state after the pass's nodes at `path` (a chain of
    indices from a child of the committed state downward, possibly empty); None keeps the whole
    pass, which must be a chain."""
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
    k, v, beta, g = _head_major(nodes.k[idx], nodes.v[idx], nodes.beta[idx], nodes.g[idx])
    _, end = _chain_rule(None, k, v, beta, g, state.recurrent[0].to(k))
    state.conv.copy_(ext[None, :, ext.shape[-1] - km1:])
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

    def __init__(self, original: nn.Module) -> None:
        super().__init__()
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
            k, v, beta_h, g_h = _head_major(k_raw, v_raw, beta, g)  # (H_v, n, .) fp32
        else:  # the earlier tokens' corrections come first (their outputs are not needed)
            k, v, beta_h, g_h = _head_major(torch.cat([prior.k.to(k_raw), k_raw]), torch.cat([prior.v.to(v_raw), v_raw]),
                                            torch.cat([prior.beta.to(beta), beta]), torch.cat([prior.g.to(g), g]))
        r = self.num_v_heads // self.num_k_heads
        q = _l2norm(q_raw.repeat_interleave(r, dim=1).transpose(0, 1).float()) * self.head_k_dim ** -0.5
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


def install(layers: Iterable[nn.Module]) -> list[TreeGatedDeltaNet]:
    """Replace each decoder layer's `linear_attn` by a TreeGatedDeltaNet; return the new ones."""
    out = []
    for layer in layers:
        original = getattr(layer, "linear_attn", None)
        if original is not None and not isinstance(original, TreeGatedDeltaNet):
            wrapped = TreeGatedDeltaNet(original)
            layer.linear_attn = wrapped
            out.append(wrapped)
    return out
