"""Feed-forward blocks (SPEC B.9): SwiGLU MLP, and the sigmoid-routed MoE with aux-loss-free correction bias,
group-limited top-k, normalisation, routed scaling and a shared expert.

Experts run dropless with a sort-based dispatch: `jax.lax.ragged_dot` on TPU, a block-padded grouped matmul
elsewhere (no one-hot [tokens, experts] einsum on either path).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from glmjax.config import ModelConfig
from glmjax.model.layers import dense, dtype_of, f32, normal_param


class RouterBias(nnx.Variable):
    """e_score_correction_bias: steers expert selection only; updated from expert load outside backprop."""


class MLP(nnx.Module):
    """down(silu(gate(y)) * up(y)) -- dense layers and the shared expert."""

    def __init__(self, cfg: ModelConfig, width: int, rngs: nnx.Rngs):
        self.cfg = cfg
        D = cfg.hidden_size
        self.gate_proj = normal_param(rngs, (D, width), ("embed", "mlp"), cfg)
        self.up_proj = normal_param(rngs, (D, width), ("embed", "mlp"), cfg)
        self.down_proj = normal_param(rngs, (width, D), ("mlp", "embed"), cfg)

    def __call__(self, y):
        dt = dtype_of(self.cfg.dtype)
        g = dense(y, self.gate_proj[...], "...d,dm->...m", dt)
        u = dense(y, self.up_proj[...], "...d,dm->...m", dt)
        return dense(jax.nn.silu(g) * u, self.down_proj[...], "...m,md->...d", dt)


def route(cfg: ModelConfig, logits: jax.Array, bias: jax.Array):
    """Router logits [N,E] f32 -> (weights [N,K_e] f32, expert ids [N,K_e] int32).

    Selection uses sigmoid(z) + bias, limited to the topk_group best groups (group score = sum of its top-2);
    the weights use the un-biased sigmoid scores, normalised (if norm_topk_prob) and scaled.
    """
    s = jax.nn.sigmoid(logits)
    sel = s + bias
    if cfg.n_group > 1:
        N, E = sel.shape
        grouped = sel.reshape(N, cfg.n_group, E // cfg.n_group)
        group_score = jnp.sum(jax.lax.top_k(grouped, 2)[0], axis=-1)  # [N,G]
        _, keep = jax.lax.top_k(group_score, cfg.topk_group)
        keep_mask = jnp.zeros_like(group_score, dtype=bool).at[jnp.arange(N)[:, None], keep].set(True)
        sel = jnp.where(keep_mask[:, :, None], grouped, -jnp.inf).reshape(N, E)
    _, ids = jax.lax.top_k(sel, cfg.num_experts_per_tok)
    w = jnp.take_along_axis(s, ids, axis=-1)
    if cfg.norm_topk_prob:
        w = w / (jnp.sum(w, axis=-1, keepdims=True) + 1e-20)
    return w * cfg.routed_scaling_factor, ids.astype(jnp.int32)


class MoE(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.cfg = cfg
        D, E, I = cfg.hidden_size, cfg.n_routed_experts, cfg.moe_intermediate_size
        self.gate = normal_param(rngs, (D, E), ("embed", "experts_router"), cfg)
        self.e_score_correction_bias = RouterBias(jnp.zeros((E,), f32), out_sharding=("experts_router",),
                                                  eager_sharding=False)
        self.experts_gate = normal_param(rngs, (E, D, I), ("experts", "embed", "expert_mlp"), cfg)
        self.experts_up = normal_param(rngs, (E, D, I), ("experts", "embed", "expert_mlp"), cfg)
        self.experts_down = normal_param(rngs, (E, I, D), ("experts", "expert_mlp", "embed"), cfg)
        self.shared_experts = MLP(cfg, I * cfg.n_shared_experts, rngs) if cfg.n_shared_experts else None

    def __call__(self, y):
        """y [B,S,D] -> (out [B,S,D], expert load [E] = number of (token, slot) assignments per expert)."""
        cfg = self.cfg
        B, S, D = y.shape
        x = y.reshape(B * S, D)
        logits = jnp.einsum("nd,de->ne", x.astype(f32), self.gate[...].astype(f32))
        weights, ids = route(cfg, logits, self.e_score_correction_bias[...])
        out = self.experts(x, ids, weights)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x).astype(f32)
        load = jnp.zeros((cfg.n_routed_experts,), jnp.int32).at[ids.reshape(-1)].add(1)
        return out.astype(y.dtype).reshape(B, S, D), load

    def experts(self, x, ids, weights):
        """Dropless sort-based dispatch: x [N,D], ids/weights [N,K_e] -> sum_k w_k * Expert_{id_k}(x) [N,D] f32."""
        dt = dtype_of(self.cfg.dtype)
        N, K = ids.shape
        E = self.cfg.n_routed_experts
        flat = ids.reshape(-1)
        order = jnp.argsort(flat, stable=True)  # (token, slot) pairs grouped by expert
        group_sizes = jnp.bincount(flat, length=E).astype(jnp.int32)
        xs = x[order // K].astype(dt)
        impl = self.cfg.moe_impl
        if impl == "auto":
            impl = "ragged_dot" if jax.default_backend() == "tpu" else "blocked"
        mm = grouped_matmul_ragged if impl == "ragged_dot" else grouped_matmul_blocked
        w = [a[...].astype(dt) for a in (self.experts_gate, self.experts_up, self.experts_down)]
        h = mm(jax.nn.silu(mm(xs, w[0], group_sizes)) * mm(xs, w[1], group_sizes), w[2], group_sizes)
        ys = jnp.zeros((N * K, x.shape[-1]), h.dtype).at[order].set(h)  # back to (token, slot) order
        return jnp.einsum("nkd,nk->nd", ys.reshape(N, K, -1).astype(f32), weights)


def grouped_matmul_ragged(xs, w, group_sizes):
    """xs [M,D] sorted by group, w [E,D,F] -> [M,F] with `lax.ragged_dot` (native grouped matmul on TPU).
    Off TPU, XLA lowers it densely (every row through every group: E/K_e times the work)."""
    return jax.lax.ragged_dot(xs, w, group_sizes)


def grouped_matmul_blocked(xs, w, group_sizes):
    """Same result as `grouped_matmul_ragged` with static shapes and no dense fallback: every group is padded to a
    multiple of a row block `bm`, so each block belongs to one group and is one [bm,D] x [D,F] matmul.
    Padding costs at most E*(bm-1) extra rows; bm ~ the mean group size keeps that <= M."""
    M, D = xs.shape
    E = w.shape[0]
    bm = int(min(512, max(8, 2 ** int(np.log2(max(M // E, 1))))))
    nb = -(-(M + E * (bm - 1)) // bm)
    padded = -(-group_sizes // bm) * bm
    ends = jnp.cumsum(padded)
    start, pstart = jnp.cumsum(group_sizes) - group_sizes, ends - padded
    group = jnp.repeat(jnp.arange(E), group_sizes, total_repeat_length=M)  # group of each sorted row
    dest = pstart[group] + jnp.arange(M) - start[group]  # row -> padded slot
    xp = jnp.zeros((nb * bm, D), xs.dtype).at[dest].set(xs)
    block_group = jnp.minimum(jnp.searchsorted(ends, jnp.arange(nb) * bm, side="right"), E - 1)
    out = jnp.einsum("jbd,jdf->jbf", xp.reshape(nb, bm, D), w[block_group])
    return out.reshape(nb * bm, -1)[dest]
