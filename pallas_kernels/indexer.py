"""Lightning-indexer top-k (docs/model.md B.6, F-9, F-10) as a Pallas TPU kernel with a streaming, exact top-k.

Same contract as the XLA reference `index_topk_reference` below (and `glmjax.model.indexer.index_topk`, the
model's XLA path): q [B,S,H_I,d_I], k [B,T,d_I],
w [B,S,H_I] (f32), segment ids q_seg [B,S] / k_seg [B,T], q_idx ([S] or [B,S], the cache slot of each query,
default arange(S)) -> (indices [B,S,k'] int32, scores [B,S,k'] f32), k' = min(topk, T), highest score first, ties
broken by the lowest key index, -1 / -inf in slots that have no visible key (key t is visible to query s iff
t <= q_idx[s] and k_seg[t] == q_seg[s]).

Grid (batch, query block, key block), key blocks innermost. Per step the kernel scores one [bq, bk] tile,
I[s,t] = d_I^-0.5 · Σ_h w[s,h]·ReLU(q[s,h]·k[t]) (one [bq,d_I]x[d_I,bk] MXU matmul per head, accumulated in
float32), masks it, and merges it into a running top-k per query kept in VMEM ([bq, K] scores + key indices), so
neither [B,S,T] nor [B,S,H_I,T] ever reaches HBM. Merge: the tile is sorted with a bitonic network (lane rolls;
the stages are loop iterations), combined element-wise with the tail of the running list (a descending list against
an ascending one gives a bitonic sequence holding the top K of their union) and bitonic-merged back into order.
The order is total, (score desc, key index asc), which is `lax.top_k`'s tie rule: the indices equal the
reference's slot for slot. A tile is not merged when no query in it has a candidate better than its current K-th.

Key blocks that no query of the block can see are skipped, and their DMA elided by clamping the key block index
(scalar-prefetched per query block): blocks after the largest q_idx (causal), and blocks before the first key of
the earliest segment in the query block (packed sequences).

The selected scores are differentiable (`jax.custom_jvp`): their tangent is that of the gathered index scores at
the selected keys (`selected_scores`, plain XLA), as for `lax.top_k`'s values in the reference; the indices have
none.

Block sizes (K = k' rounded up to a power of two, at least 128):

    | bq (queries per tile)                  | bk (keys per tile)        |
    |----------------------------------------|---------------------------|
    | min(128, S and block_q rounded to 16)  | 512 if K >= 512, else 128 |

GLM-5 (H_I 32, d_I 128, k 2048, S 8192): bq 128, bk 512, K 2048; Mosaic reports 16.9 MiB of VMEM used (running
list 2 MiB, q block 1 MiB double-buffered, sort and merge temporaries).

Context length. Nothing in VMEM or SMEM depends on T (keys stream through [bk, d_I] blocks); SMEM holds the two
[B, S/bq] block bounds. Around the kernel, XLA transposes q (S·H_I·d_I·2 bytes of HBM) and finds each segment's
first key (O(T) int32). 17.5 MiB of VMEM at S = T = 202,752 and at 1,048,576 (v5p, bench/pallas_aot.py); decode
(S = 16) against T = 1,048,576 uses 5.7 MiB. What used to bound it: XLA fused the padding of q_idx into the per-block
maximum, and that fusion crashed the TPU compiler beyond 1024 query blocks (S > 131,072); an optimization barrier
keeps them apart.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.common import call, interpret_params, lane_padded, pad_axis, round_up, vmem_limit

f32 = jnp.float32
NO_KEY = jnp.iinfo(jnp.int32).max  # key index of the running list's initial (-inf) entries


def block_sizes(S: int, kk: int, block_q: int) -> tuple[int, int, int]:
    """-> (bq, bk, K) from the table in the module docstring."""
    K = max(128, pl.next_power_of_2(kk))
    bq = min(128, round_up(S, 16), round_up(max(block_q, 1), 16))
    return bq, (512 if K >= 512 else 128), K


def index_topk(q, k, w, q_seg, k_seg, topk: int, block_q: int, q_idx=None, *,
               interpret: bool | str | None = None):
    """Pallas lightning-indexer top-k; the signature of `index_topk_reference` (+ interpret)."""
    B, S, HI, D = q.shape
    T = k.shape[1]
    if k.shape != (B, T, D) or w.shape != (B, S, HI):
        raise ValueError(f"index_topk: k {k.shape} must be [B,T,{D}] and w {w.shape} [B,S,{HI}] for q {q.shape}")
    if q_seg.shape != (B, S) or k_seg.shape != (B, T):
        raise ValueError(f"index_topk: q_seg {q_seg.shape} must be [{B},{S}] and k_seg {k_seg.shape} [{B},{T}]")
    if topk < 1:
        raise ValueError(f"index_topk: topk={topk} must be >= 1")
    q_idx = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32) if q_idx is None else q_idx, (B, S)).astype(jnp.int32)
    return _index_topk(q, k, w, q_seg.astype(jnp.int32), k_seg.astype(jnp.int32), q_idx, int(topk), int(block_q),
                       interpret)


@functools.partial(jax.custom_jvp, nondiff_argnums=(6, 7, 8))
def _index_topk(q, k, w, q_seg, k_seg, q_idx, topk, block_q, interpret):
    return _kernel_call(q, k, w, q_seg, k_seg, q_idx, topk, block_q, interpret)


@_index_topk.defjvp
def _index_topk_jvp(topk, block_q, interpret, primals, tangents):
    """Indices have no tangent; the selected scores move like the index scores at those keys (as `lax.top_k`'s
    values do in the reference): the tangent of the gathered scores, O(S·k'·H_I·d_I)."""
    q, k, w = primals[:3]
    ids, vals = _index_topk(*primals, topk, block_q, interpret)
    _, dvals = jax.jvp(lambda *a: selected_scores(*a, ids, block_q), (q, k, w), tuple(tangents[:3]))
    return (ids, vals), (np.zeros(ids.shape, jax.dtypes.float0), jnp.where(ids >= 0, dvals, 0.0))


def index_topk_reference(q, k, w, q_seg, k_seg, topk: int, block_q: int, q_idx=None):
    """The XLA reference: the whole masked score matrix [B,S,T] at once and `lax.top_k` (block_q is unused)."""
    B, S = q.shape[:2]
    T = k.shape[1]
    q_idx = jnp.broadcast_to(jnp.arange(S) if q_idx is None else q_idx, (B, S))
    z = jnp.einsum("bshd,btd->bsht", q, k, preferred_element_type=f32)
    s = jnp.einsum("bsht,bsh->bst", jax.nn.relu(z), w.astype(f32)) * q.shape[-1] ** -0.5
    vis = (jnp.arange(T) <= q_idx[..., None]) & (q_seg[:, :, None] == k_seg[:, None, :])
    vals, ids = jax.lax.top_k(jnp.where(vis, s, -jnp.inf), min(topk, T))
    return jnp.where(vals == -jnp.inf, -1, ids).astype(jnp.int32), vals


def selected_scores(q, k, w, ids, block_q: int):
    """Index scores at the keys ids [B,S,k'] (>= 0 where used; other slots hold garbage) -> [B,S,k'] f32, in XLA,
    `block_q` queries at a time (each block gathers only its [B,bq,k',d_I] key rows): the kernel's JVP."""
    B, S = q.shape[:2]
    bq = min(block_q, S)
    Sp = round_up(S, bq)

    def blocks(a):  # [B,S,...] -> [Sp/bq, B, bq, ...]
        return jnp.moveaxis(pad_axis(a, 1, Sp).reshape((B, Sp // bq, bq) + a.shape[2:]), 1, 0)

    def one_block(args):
        qb, wb, ib = args
        rows = jax.vmap(lambda kb, i: kb[i])(k, jnp.maximum(ib, 0))  # [B,bq,k',d_I]
        z = jnp.einsum("bqhd,bqkd->bqhk", qb, rows, preferred_element_type=f32)
        return jnp.einsum("bqhk,bqh->bqk", jax.nn.relu(z), wb) * q.shape[-1] ** -0.5

    out = jax.lax.map(one_block, (blocks(q), blocks(w), blocks(ids)))
    return jnp.moveaxis(out, 0, 1).reshape((B, Sp) + out.shape[3:])[:, :S]


def _kernel_call(q, k, w, q_seg, k_seg, q_idx, topk, block_q, interpret):
    B, S, HI, D = q.shape
    T = k.shape[1]
    kk = min(topk, T)
    bq, bk, K = block_sizes(S, kk, block_q)
    Sp, Tp = round_up(S, bq), round_up(T, bk)
    nq, nk = Sp // bq, Tp // bk

    q_idx = pad_axis(q_idx, 1, Sp, -1)  # padded queries see nothing
    q_seg = pad_axis(q_seg, 1, Sp)
    # Per query block: the last key any query may see (causal), and a lower bound on the first (segment start).
    # (the barrier keeps XLA from fusing the padding into the block reduction: that fusion crashes the TPU
    # compiler for more than 1024 query blocks, "Check failed: llo::CouldLtS32", libtpu 0.10.2)
    qmax = jnp.minimum(jnp.max(jax.lax.optimization_barrier(q_idx).reshape(B, nq, bq), axis=-1), T - 1)
    first = jax.vmap(lambda seg: jax.ops.segment_min(jnp.arange(T, dtype=jnp.int32), jnp.clip(seg, 0, T),
                                                     num_segments=T + 1))(k_seg)  # first key of each segment id
    kfirst = jnp.take_along_axis(first, jnp.clip(q_seg, 0, T), axis=1)
    kmin = jnp.min(jnp.where(q_idx >= 0, kfirst, T).reshape(B, nq, bq), axis=-1)

    qt = pad_axis(q, 1, Sp).transpose(0, 2, 1, 3)  # [B,H_I,Sp,d_I]: one [bq, d_I] tile per head
    kp = pad_axis(k, 1, Tp)
    wp = pad_axis(w.astype(f32), 1, Sp)
    ksp = pad_axis(k_seg, 1, Tp)[:, None, :]

    def key_block(b, i, j, qmax_ref, kmin_ref):  # skipped key blocks re-use the previous block: no DMA
        hi = jnp.maximum(qmax_ref[b, i], 0) // bk
        return jnp.minimum(jnp.maximum(j, kmin_ref[b, i] // bk), hi)

    isz = q.dtype.itemsize
    need = (2 * HI * lane_padded(bq, D, isz) + 2 * lane_padded(bk, D, isz) + 4 * lane_padded(bq, K, 4)
            + 10 * lane_padded(bq, max(K, bk), 4) + 2 * lane_padded(bq, HI, 4))
    mode = interpret_params(interpret)
    kernel = pl.pallas_call(
        functools.partial(_topk_kernel, T=T, bk=bk, K=K, scale=D ** -0.5),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(B, nq, nk),
            in_specs=[
                pl.BlockSpec((1, HI, bq, D), lambda b, i, j, *_: (b, 0, i, 0)),
                pl.BlockSpec((1, bk, D), lambda b, i, j, *r: (b, key_block(b, i, j, *r), 0)),
                pl.BlockSpec((1, bq, HI), lambda b, i, j, *_: (b, i, 0)),
                pl.BlockSpec((1, bq, 1), lambda b, i, j, *_: (b, i, 0)),
                pl.BlockSpec((1, bq, 1), lambda b, i, j, *_: (b, i, 0)),
                pl.BlockSpec((1, 1, bk), lambda b, i, j, *r: (b, 0, key_block(b, i, j, *r))),
            ],
            out_specs=[pl.BlockSpec((1, bq, K), lambda b, i, j, *_: (b, i, 0))] * 2,
            scratch_shapes=[pltpu.VMEM((bq, K), f32), pltpu.VMEM((bq, K), jnp.int32)],
        ),
        out_shape=[jax.ShapeDtypeStruct((B, Sp, K), jnp.int32), jax.ShapeDtypeStruct((B, Sp, K), f32)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary"),
                                             vmem_limit_bytes=vmem_limit(need)),
        cost_estimate=pl.CostEstimate(flops=2 * B * Sp * Tp * HI * D, transcendentals=0,
                                      bytes_accessed=qt.size * isz + nq * kp.size * isz + B * Sp * K * 8),
        interpret=mode,
        name="index_topk",
    )
    ids, vals = call(kernel, mode, qmax.astype(jnp.int32), kmin.astype(jnp.int32), qt, kp, wp, q_idx[..., None],
                     q_seg[..., None], ksp)
    return ids[:, :S, :kk], vals[:, :S, :kk]


def _topk_kernel(qmax_ref, kmin_ref, q_ref, k_ref, w_ref, qidx_ref, qseg_ref, kseg_ref, oi_ref, ov_ref,
                 vals, ids, *, T, bk, K, scale):
    b, i, j, last = pl.program_id(0), pl.program_id(1), pl.program_id(2), pl.num_programs(2) - 1
    HI = q_ref.shape[1]

    @pl.when(j == 0)
    def _():
        vals[...] = jnp.full(vals.shape, -jnp.inf, f32)
        ids[...] = jnp.full(ids.shape, NO_KEY, jnp.int32)

    @pl.when((j * bk <= qmax_ref[b, i]) & ((j + 1) * bk > kmin_ref[b, i]))
    def _():
        kb, w = k_ref[0], w_ref[0]  # [bk, d_I], [bq, H_I]
        precision = jax.lax.Precision.HIGHEST if kb.dtype == f32 else None  # f32: not one bf16 MXU pass
        s = None
        for h in range(HI):
            z = jax.lax.dot_general(q_ref[0, h], kb, (((1,), (1,)), ((), ())), precision=precision,
                                    preferred_element_type=f32)
            term = w[:, h:h + 1] * jnp.maximum(z, 0.0)
            s = term if s is None else s + term
        key = j * bk + jax.lax.broadcasted_iota(jnp.int32, (1, bk), 1)
        vis = (key <= qidx_ref[0]) & (qseg_ref[0] == kseg_ref[0]) & (key < T)  # [bq, bk]
        s = jnp.where(vis, s * scale, -jnp.inf)

        @pl.when(jnp.any(jnp.max(s, axis=1, keepdims=True) > vals[:, K - 1:K]))
        def _():
            _merge(s, jnp.broadcast_to(key, s.shape), vals, ids)

    @pl.when(j == last)
    def _():
        v = vals[...]
        ov_ref[0] = v
        oi_ref[0] = jnp.where(v == -jnp.inf, -1, ids[...])


# ------------------------------------------------------------------------------------------------ bitonic top-k


def _better(va, ia, vb, ib):
    """(score desc, index asc) order: a comes before b."""
    return (va > vb) | ((va == vb) & (ia < ib))


def _exchange(v, ix, j, better_first):
    """One compare-exchange stage at lane distance j (a traced power of two). better_first [1,n] bool (or a Python
    bool): the 2j-group of each lane is being ordered best first. Partners come from lane rolls; which roll delivers
    lane i^j is read off a rolled lane iota, so the code does not depend on the roll direction convention."""
    n = v.shape[-1]
    lane = jax.lax.broadcasted_iota(jnp.int32, (1, n), 1)
    fwd = pltpu.roll(lane, j, 1) == (lane ^ j)
    pv = jnp.where(fwd, pltpu.roll(v, j, 1), pltpu.roll(v, n - j, 1))
    pi = jnp.where(fwd, pltpu.roll(ix, j, 1), pltpu.roll(ix, n - j, 1))
    wants_better = ((lane & j) == 0) == better_first
    keep = _better(v, ix, pv, pi) == wants_better
    return jnp.where(keep, v, pv), jnp.where(keep, ix, pi)


def _sort_ascending(v, ix):
    """Bitonic sort of each row, worst first: for size = 2, 4, .., n, exchanges at j = size/2, .., 1, the groups of
    `size` lanes alternating direction. Stages are loop iterations (dynamic roll shifts) to keep the kernel small."""
    n = v.shape[-1]
    lane = jax.lax.broadcasted_iota(jnp.int32, (1, n), 1)

    def one_size(p, carry):  # size = 2**p
        def one_stage(r, carry):  # j = 2**(p-1-r)
            return _exchange(*carry, jnp.left_shift(1, p - 1 - r), (lane & jnp.left_shift(1, p)) != 0)
        return jax.lax.fori_loop(0, p, one_stage, carry)

    return jax.lax.fori_loop(1, n.bit_length(), one_size, (v, ix))


def _merge(s, key, vals, ids):
    """Merge candidates s/key [bq, bk] into the sorted running lists vals/ids [bq, K] (refs), keeping the best K."""
    bk, K = s.shape[-1], vals.shape[-1]
    cv, ci = _sort_ascending(s, key)
    m = min(K, bk)
    av, ai = vals[...], ids[...]
    tv, ti = av[:, K - m:], ai[:, K - m:]
    take = _better(cv[:, bk - m:], ci[:, bk - m:], tv, ti)
    tv, ti = jnp.where(take, cv[:, bk - m:], tv), jnp.where(take, ci[:, bk - m:], ti)
    if K > m:
        tv, ti = jnp.concatenate([av[:, :K - m], tv], axis=1), jnp.concatenate([ai[:, :K - m], ti], axis=1)
    # the list is now bitonic (descending, then ascending): merge it best first, j = K/2, .., 1
    tv, ti = jax.lax.fori_loop(1, K.bit_length(), lambda r, c: _exchange(*c, jnp.right_shift(K, r), True), (tv, ti))
    vals[...] = tv
    ids[...] = ti
