"""Feed-forward blocks (docs/model.md B.9): SwiGLU MLP, and the sigmoid-routed MoE with aux-loss-free correction bias,
group-limited top-k, normalisation, routed scaling and a shared expert.

Experts run with a sort-based dispatch: (token, slot) pairs are sorted by expert and multiplied group by group --
`jax.lax.ragged_dot` on TPU, a Pallas GPU grouped matmul on NVIDIA GPUs (`pallas_kernels/grouped_matmul.py`: every
expert's rows padded to blocks of 16-64 rows, weights read in place, weight gradients without a scatter), a block-padded
grouped matmul in XLA elsewhere (`model.moe_impl`; no one-hot [tokens, experts] einsum anywhere).
Group sizes and the expert load are counted by binary search in the sorted ids, not by scatter-add.

On a device mesh (the abstract mesh in context, see `glmjax/parallel/sharding.py::with_mesh`) the experts run
inside `shard_map`: every device sorts its own tokens' pairs; expert weights are gathered over the axes that split
their model width (FSDP) and their hidden width stays split over "tensor" (partial outputs, one psum).
With the experts themselves split (expert parallelism: over `context` and/or `expert`, the "experts" rule of
glmjax/parallel/rules.py; several mesh axes act as one group) each device sends its sorted rows to the devices of
its group owning their experts, those run their local experts and send the results back.

  dispatch "all_to_all"        fixed `cap` slots per (source, destination) pair, `lax.all_to_all`
  dispatch "ragged_all_to_all" rows packed per destination, `lax.ragged_all_to_all` into EP * cap rows per
                               destination, sources in order (TPU; XLA:CPU lacks it)
  capacity  moe_capacity_factor = 0 (dropless): cap = n * min(K_e, E / EP) for n local tokens -- the most one source
            can send one destination, since a token's K_e experts are distinct -- so nothing is dropped (the
            buffers are sized for the worst case: EP * cap rows); f > 0: cap = ceil(f * n * K_e / EP) and pairs past
            it contribute zero (all_to_all: the last pairs of a source for that destination; ragged: the rows of
            the last sources past a destination's EP * cap).

Dropless results equal the single-device MoE up to float summation order (the "tensor" psum). The expert load is
the global one on any mesh: per-shard counts summed over the token axes (padding rows removed); so is the number of
(token, slot) pairs the capacity dropped (0 when dropless), which the trainer logs as a fraction (`moe_dropped`).
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import pallas_kernels.grouped_matmul as gpu_gmm
from glmjax import hardware
from glmjax.config import ModelConfig
from glmjax.model.layers import dense, dtype_of, f32, normal_param
from glmjax.parallel.rules import batch_axes, logical_spec, sequence_axes, token_axes

EXPERT_IN_AXES = ("experts", "embed", "expert_mlp")  # experts_gate / experts_up [E, D, I]
EXPERT_OUT_AXES = ("experts", "expert_mlp", "embed")  # experts_down [E, I, D]


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
    the weights use the un-biased sigmoid scores, normalised (if norm_topk_prob) and scaled. With scoring_func
    "softmax" (DeepSeek-V2): softmax(z) + bias, "greedy" over all experts or "group_limited_greedy" (group score =
    its best expert).
    """
    s = jax.nn.softmax(logits, axis=-1) if cfg.scoring_func == "softmax" else jax.nn.sigmoid(logits)
    sel = s + bias
    if cfg.n_group > 1 and cfg.topk_method != "greedy":
        N, E = sel.shape
        grouped = sel.reshape(N, cfg.n_group, E // cfg.n_group)
        best = jax.lax.top_k(grouped, 2 if cfg.topk_method == "noaux_tc" else 1)[0]
        group_score = jnp.sum(best, axis=-1)  # [N,G]
        _, keep = jax.lax.top_k(group_score, cfg.topk_group)
        keep_mask = jnp.any(keep[:, :, None] == jnp.arange(cfg.n_group), axis=1)  # [N,G]
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
        self.experts_gate = normal_param(rngs, (E, D, I), EXPERT_IN_AXES, cfg)
        self.experts_up = normal_param(rngs, (E, D, I), EXPERT_IN_AXES, cfg)
        self.experts_down = normal_param(rngs, (E, I, D), EXPERT_OUT_AXES, cfg)
        self.shared_experts = MLP(cfg, I * cfg.n_shared_experts, rngs) if cfg.n_shared_experts else None

    def __call__(self, y):
        """y [B,S,D] -> (out [B,S,D], expert load [E] = number of (token, slot) assignments per expert, number of
        those assignments the capacity dropped (int32 scalar))."""
        cfg = self.cfg
        B, S, D = y.shape
        mesh = jax.sharding.get_abstract_mesh()
        x, unflatten = flatten_tokens(y, mesh)
        logits = jnp.einsum("nd,de->ne", x.astype(f32), self.gate[...].astype(f32))
        weights, ids = route(cfg, logits, self.e_score_correction_bias[...])
        if mesh.empty or mesh.size == 1:
            (out, load), dropped = self.experts(x, ids, weights), jnp.zeros((), jnp.int32)
        else:
            out, load, dropped = self.sharded_experts(x, ids, weights, mesh)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x).astype(f32)
        return unflatten(out.astype(y.dtype)), load, dropped

    def expert_weights(self):
        dt = dtype_of(self.cfg.dtype)
        return tuple(a[...].astype(dt) for a in (self.experts_gate, self.experts_up, self.experts_down))

    def experts(self, x, ids, weights):
        """Dropless sort-based dispatch: x [N,D], ids/weights [N,K_e] -> (sum_k w_k * Expert_{id_k}(x) [N,D] f32,
        load [E])."""
        order, sorted_ids = sort_pairs(ids)
        ys = local_experts(self.cfg, x, order, sorted_ids, self.expert_weights())
        return combine(ys, weights), sorted_counts(sorted_ids, self.cfg.n_routed_experts)

    def sharded_experts(self, x, ids, weights, mesh):
        """`experts` on a mesh: tokens split over the batch and context axes, experts over `expert` (module doc)."""
        cfg = self.cfg
        N, K = ids.shape
        E = cfg.n_routed_experts
        wg, wu, wd = self.expert_weights()
        in_spec = logical_spec(EXPERT_IN_AXES, wg.shape, mesh)
        out_spec = logical_spec(EXPERT_OUT_AXES, wd.shape, mesh)
        e_axes, d_axes, i_axes = (_axes(in_spec, i) for i in range(3))
        if (_axes(out_spec, 0), _axes(out_spec, 1), _axes(out_spec, 2)) != (e_axes, i_axes, d_axes):
            raise ValueError(f"sharding rules split experts_gate {in_spec} and experts_down {out_spec} differently")
        tok_axes = token_axes(mesh)  # batch and context axes: a context shard's tokens are like more rows
        if not set(e_axes) <= set(tok_axes) or set(i_axes) & set(tok_axes):
            raise ValueError(f"expert parallelism needs the experts split over mesh axes that also split tokens, "
                             f"and the expert hidden over axes that do not: experts {e_axes}, hidden {i_axes}, "
                             f"tokens {tok_axes}")
        shards = math.prod(mesh.shape[a] for a in tok_axes)
        pad = -N % shards  # e.g. decoding one token on many devices: pad rows, weight 0, distinct experts 0..K-1
        real = jnp.arange(N + pad) < N  # rows that are tokens (a dropped padding pair is not counted)
        if pad:
            x = jnp.pad(x, ((0, pad), (0, 0)))
            ids = jnp.concatenate([ids, jnp.broadcast_to(jnp.arange(K, dtype=ids.dtype), (pad, K))])
            weights = jnp.pad(weights, ((0, pad), (0, 0)))
        ep = e_axes  # the expert-parallel group: one axis, or several taken as one (e.g. context x expert)
        EP = math.prod(mesh.shape[a] for a in ep)
        dispatch = cfg.moe_dispatch
        if dispatch == "auto":
            dispatch = "ragged_all_to_all" if hardware.platform(mesh) == "tpu" else "all_to_all"

        def body(x, ids, w, real, wg, wu, wd):
            if d_axes:  # FSDP: gather the model width of this shard's experts (the backward reduce-scatters)
                wg, wu = (jax.lax.all_gather(a, d_axes, axis=1, tiled=True) for a in (wg, wu))
                wd = jax.lax.all_gather(wd, d_axes, axis=2, tiled=True)
            order, sorted_ids = sort_pairs(ids)
            load = jax.lax.psum(sorted_counts(sorted_ids, E), tok_axes)  # the global load
            if EP == 1:
                ys, dropped = local_experts(cfg, x, order, sorted_ids, (wg, wu, wd)), jnp.zeros((), jnp.int32)
            else:
                n = x.shape[0]
                cap = n * min(K, wg.shape[0]) if not cfg.moe_capacity_factor else \
                    max(1, math.ceil(cfg.moe_capacity_factor * n * K / EP))
                route_fn = ragged_all_to_all_experts if dispatch == "ragged_all_to_all" else all_to_all_experts
                ys, kept = route_fn(cfg, x, order, sorted_ids, (wg, wu, wd), ep, EP, cap)
                dropped = jax.lax.psum(jnp.sum(~kept & real[order // K], dtype=jnp.int32), tok_axes)
            out = combine(ys, w)
            return (jax.lax.psum(out, i_axes) if i_axes else out), load, dropped  # expert hidden split: partial sums

        tok, whole = jax.sharding.PartitionSpec(tok_axes), jax.sharding.PartitionSpec()
        out, load, dropped = jax.shard_map(body, in_specs=(tok, tok, tok, tok, in_spec, in_spec, out_spec),
                                           out_specs=(tok, whole, whole))(x, ids, weights, real, wg, wu, wd)
        if pad:
            load = load - pad * (jnp.arange(E) < K).astype(load.dtype)
        return out[:N], load, dropped


def flatten_tokens(y, mesh):
    """y [B,S,D] -> (x [B*S,D], the inverse) with each device's tokens one contiguous block of rows, in the order
    of `token_axes` (batch shards major, then sequence shards): the experts' shard_map splits the rows that way.
    With the sequence split (context) and more than one row per batch shard, a plain reshape would interleave the
    shards' tokens, and XLA would all-gather the whole sequence of every row to flatten it; here the rows are
    reordered by (batch shard, sequence shard) first, which moves no data. The MoE is per token, so the order does
    not change the results."""
    B, S, D = y.shape
    nb = 1 if mesh.empty else math.prod(mesh.shape[a] for a in batch_axes(mesh))
    ns = 1 if mesh.empty else math.prod(mesh.shape[a] for a in sequence_axes(mesh))
    if ns == 1 or B % nb or S % ns or B == nb:
        return y.reshape(B * S, D), lambda out: out.reshape(B, S, D)
    def unflatten(out):  # [nb*ns*(B/nb)*(S/ns), D] -> [B,S,D]
        return out.reshape(nb, ns, B // nb, S // ns, D).transpose(0, 2, 1, 3, 4).reshape(B, S, D)

    return y.reshape(nb, B // nb, ns, S // ns, D).transpose(0, 2, 1, 3, 4).reshape(B * S, D), unflatten


def _axes(spec, i) -> tuple[str, ...]:
    a = spec[i] if i < len(spec) else None
    return () if a is None else (a,) if isinstance(a, str) else tuple(a)


MOE_IMPLS = {"tpu": "ragged_dot", **dict.fromkeys(hardware.GPU_PLATFORMS, "pallas_gpu")}  # "auto"'s, per platform
GPU_BLOCK_ROWS = (16, 64)  # rows per block of the Pallas GPU grouped matmul: ~ the mean rows per expert, in range


def moe_impl(cfg: ModelConfig) -> str:
    """The grouped matmul `model.moe_impl` names ("auto": by the platform traced for): ragged_dot | pallas_gpu |
    blocked."""
    return MOE_IMPLS.get(hardware.platform(), "blocked") if cfg.moe_impl == "auto" else cfg.moe_impl


def grouped_matmul(cfg: ModelConfig):
    return {"ragged_dot": grouped_matmul_ragged, "pallas_gpu": grouped_matmul_gpu}.get(moe_impl(cfg),
                                                                                        grouped_matmul_blocked)


def sort_pairs(ids):
    """(token, slot) pairs [N,K] -> (order: pair indices grouped by expert (stable), their expert ids ascending)."""
    flat = ids.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    return order, flat[order]


def sorted_counts(sorted_ids, n: int):
    """How often each of 0..n-1 occurs in an ascending int array (larger values ignored), by binary search: no
    scatter-add (slow on TPU, and of unknown cost to its cost model)."""
    edges = jnp.searchsorted(sorted_ids, jnp.arange(n + 1, dtype=sorted_ids.dtype), side="left",
                             method="scan_unrolled")
    return jnp.diff(edges).astype(jnp.int32)


def combine(ys, weights):
    """Expert outputs per (token, slot) [N*K, D] and routing weights [N,K] -> sum over slots [N,D] f32."""
    N, K = weights.shape
    return jnp.einsum("nkd,nk->nd", ys.reshape(N, K, -1).astype(f32), weights)


def expert_ffn(cfg: ModelConfig, xs, group_sizes, w):
    """SwiGLU of rows sorted by expert: xs [M,D], group_sizes [E] (rows past their sum give 0), w = (gate, up,
    down) [E, ...] -> [M,D]."""
    mm = grouped_matmul(cfg)
    wg, wu, wd = w
    return mm(jax.nn.silu(mm(xs, wg, group_sizes)) * mm(xs, wu, group_sizes), wd, group_sizes)


def local_experts(cfg: ModelConfig, x, order, sorted_ids, w):
    """All experts here: x [N,D], pairs sorted by expert -> expert outputs [N*K, D] in (token, slot) order."""
    K = order.shape[0] // x.shape[0]
    sizes = sorted_counts(sorted_ids, w[0].shape[0])
    if moe_impl(cfg) != "ragged_dot":
        return blocked_local_experts(x, order, sizes, w, kernel=moe_impl(cfg) == "pallas_gpu")
    h = expert_ffn(cfg, x[order // K].astype(w[0].dtype), sizes, w)
    return jnp.zeros_like(h).at[order].set(h)


def blocked_local_experts(x, order, group_sizes, w, kernel: bool = False):
    """`local_experts` with the blocked grouped matmul (kernel: the Pallas GPU one), the same numbers with less data
    movement: each token row is gathered once straight into the padded block layout, the three matmuls stay in
    it, and each (token, slot) pair reads its output row once out of it (instead of a pad and an unpad around each
    matmul and a scatter back)."""
    N, M = x.shape[0], order.shape[0]
    layout = block_layout(group_sizes, M, kernel)
    bm, nb, dest = layout[:3]
    mm = functools.partial(kernel_block_matmul if kernel else block_matmul, layout=layout)
    src = jnp.full((nb * bm,), N, jnp.int32).at[dest].set(order // (M // N), mode="drop")  # token per row, N: none
    xp = x.at[src].get(mode="fill", fill_value=0).astype(w[0].dtype)
    wg, wu, wd = w
    hp = jax.nn.silu(mm(xp, wg)) * mm(xp, wu)  # padding rows stay 0
    slot = jnp.zeros((M,), jnp.int32).at[order].set(dest)  # padded row of each (token, slot) pair
    return mm(hp, wd)[slot]


def _run_received(cfg, rows, local_ids, w):
    """Rows received by this shard with their local expert ids (E_local = padding) -> results, same layout."""
    order, sorted_ids = sort_pairs(local_ids)
    h = expert_ffn(cfg, rows[order], sorted_counts(sorted_ids, w[0].shape[0]), w)
    return jnp.zeros_like(h).at[order].set(h)


def all_to_all_experts(cfg, x, order, sorted_ids, w, axis, EP, cap):
    """Expert parallelism with fixed slots: x [n,D], the n*K (token, slot) pairs sorted by (global) expert,
    w = this shard's experts (gate, up, down) [E/EP, ...] -> (outputs [n*K, D] in (token, slot) order (zeros for
    pairs past the capacity), which sorted pairs were kept [n*K] bool)."""
    M, D = order.shape[0], x.shape[-1]
    K, E_local = M // x.shape[0], w[0].shape[0]
    dest = sorted_ids // E_local  # ascending
    counts = sorted_counts(dest, EP)
    rank = jnp.arange(M) - (jnp.cumsum(counts) - counts)[dest]  # position among the pairs for `dest`
    slot = jnp.where(rank < cap, dest * cap + rank, EP * cap)  # EP * cap = dropped
    xs = x[order // K].astype(w[0].dtype)
    send = jnp.zeros((EP * cap, D), xs.dtype).at[slot].set(xs, mode="drop")
    send_ids = jnp.full((EP * cap,), E_local, jnp.int32).at[slot].set(sorted_ids % E_local, mode="drop")
    recv = jax.lax.all_to_all(send, axis, 0, 0, tiled=True)  # [EP * cap, D]: block i came from shard i
    recv_ids = jax.lax.all_to_all(send_ids, axis, 0, 0, tiled=True)
    back = jax.lax.all_to_all(_run_received(cfg, recv, recv_ids, w), axis, 0, 0, tiled=True)
    ys_sorted = back.at[slot].get(mode="fill", fill_value=0)
    return jnp.zeros_like(ys_sorted).at[order].set(ys_sorted), rank < cap


def ragged_all_to_all_experts(cfg, x, order, sorted_ids, w, axis, EP, cap):
    """`all_to_all_experts` with rows packed per destination (`lax.ragged_all_to_all`): each shard receives into
    EP * cap rows, source after source; rows past that are dropped (none when dropless). Same results."""
    M, D = order.shape[0], x.shape[-1]
    K, E_local = M // x.shape[0], w[0].shape[0]
    R = EP * cap
    sizes = sorted_counts(sorted_ids // E_local, EP)  # rows for each destination
    in_off = (jnp.cumsum(sizes) - sizes).astype(jnp.int32)
    S = jax.lax.all_gather(sizes, axis)  # [source, destination]
    me = jax.lax.axis_index(axis)
    at = jnp.cumsum(S, axis=0) - S  # at[i, j]: where source i's rows start in destination j's buffer
    send = jnp.clip(R - at[me], 0, sizes).astype(jnp.int32)  # what fits at each destination
    recv = jnp.clip(R - at[:, me], 0, S[:, me]).astype(jnp.int32)
    out_off, recv_off = at[me].astype(jnp.int32), at[:, me].astype(jnp.int32)
    xs = x[order // K].astype(w[0].dtype)
    rows = ragged_all_to_all(xs, jnp.zeros((R, D), xs.dtype), in_off, send, out_off, recv, axis_name=axis)
    local_ids = ragged_all_to_all((sorted_ids % E_local).astype(jnp.int32), jnp.full((R,), E_local, jnp.int32),
                                  in_off, send, out_off, recv, axis_name=axis)
    src_off = (jnp.cumsum(S, axis=1) - S)[:, me].astype(jnp.int32)  # where my rows sit in each source's buffer
    ys_sorted = ragged_all_to_all(_run_received(cfg, rows, local_ids, w), jnp.zeros((M, D), xs.dtype),
                                  recv_off, recv, src_off, send, axis_name=axis)
    dest = sorted_ids // E_local
    rank = jnp.arange(M) - in_off[dest]  # position among my rows for `dest`: the first send[dest] of them fit
    return jnp.zeros_like(ys_sorted).at[order].set(ys_sorted), rank < send[dest]


ragged_all_to_all = jax.lax.ragged_all_to_all  # module attribute: tests swap in an all_gather emulation on CPU


def grouped_matmul_ragged(xs, w, group_sizes):
    """xs [M,D] sorted by group, w [E,D,F] -> [M,F] with `lax.ragged_dot` (native grouped matmul on TPU).
    Off TPU, XLA lowers it densely (every row through every group: E/K_e times the work)."""
    return jax.lax.ragged_dot(xs, w, group_sizes)


def grouped_matmul_blocked(xs, w, group_sizes, kernel: bool = False):
    """Same result as `grouped_matmul_ragged` with static shapes and no dense fallback: every group is padded to a
    multiple of a row block (`block_layout`), so each block belongs to one group and is one [bm,D] x [D,F] matmul
    (kernel: the Pallas GPU grouped matmul). Rows past sum(group_sizes) (receive buffers of expert parallelism)
    give 0, as with ragged_dot."""
    M, D = xs.shape
    layout = block_layout(group_sizes, M, kernel)
    bm, nb, dest = layout[:3]
    xp = jnp.zeros((nb * bm, D), xs.dtype).at[dest].set(xs, mode="drop")
    out = (kernel_block_matmul if kernel else block_matmul)(xp, w, layout)
    return out.at[dest].get(mode="fill", fill_value=0)


def grouped_matmul_gpu(xs, w, group_sizes):
    """`grouped_matmul_blocked` by the Pallas GPU grouped matmul (blocks of GPU_BLOCK_ROWS rows)."""
    return grouped_matmul_blocked(xs, w, group_sizes, kernel=True)


def block_layout(group_sizes, M: int, kernel: bool = False):
    """The padded layout of M rows sorted by group, group_sizes [E] -> (bm, nb, dest [M] padded row of each row
    (nb * bm for rows past sum(group_sizes)), block_group [nb] the group of each block of bm rows, group_blocks
    [E+1] the first block of each group and the first block past the last group's rows). Padding costs at most
    E*(bm-1) extra rows; bm ~ the mean group size (8..512; kernel: in GPU_BLOCK_ROWS) keeps that <= M."""
    E = group_sizes.shape[0]
    lo, hi = GPU_BLOCK_ROWS if kernel else (8, 512)
    bm = int(min(hi, max(lo, 2 ** int(np.log2(max(M // E, 1))))))
    nb = -(-(M + E * (bm - 1)) // bm)
    padded = -(-group_sizes // bm) * bm
    ends = jnp.cumsum(padded)
    start, pstart = jnp.cumsum(group_sizes) - group_sizes, ends - padded
    rows = jnp.arange(M)
    group = jnp.minimum(jnp.searchsorted(jnp.cumsum(group_sizes), rows, side="right", method="scan_unrolled"),
                        E - 1)  # of each row
    dest = jnp.where(rows < jnp.sum(group_sizes), pstart[group] + rows - start[group], nb * bm)
    block_group = jnp.minimum(jnp.searchsorted(ends, jnp.arange(nb) * bm, side="right", method="scan_unrolled"),
                              E - 1)
    group_blocks = jnp.concatenate([pstart, ends[-1:]]) // bm
    return bm, nb, dest, block_group, group_blocks.astype(jnp.int32)


def kernel_block_matmul(xp, w, layout):
    """`block_matmul` by the Pallas GPU grouped matmul (interpreted off a GPU)."""
    interpret = MOE_IMPLS.get(hardware.platform()) != "pallas_gpu"
    return gpu_gmm.gmm(xp, w, layout[3].astype(jnp.int32), layout[4], interpret)


def block_matmul(xp, w, layout):
    """Rows in the padded layout [nb*bm, D], w [E,D,F], layout = `block_layout`'s -> [nb*bm, F], each block times
    its group's matrix."""
    block_group = layout[3]
    nb = block_group.shape[0]
    out = jnp.einsum("jbd,jdf->jbf", xp.reshape(nb, -1, xp.shape[-1]), w[block_group])
    return out.reshape(xp.shape[0], -1)
