"""Sparse MLA attention in MQA form (docs/model.md B.7, D.2) for NVIDIA GPUs: Pallas kernels (Triton backend),
forward and backward, with the contract of `sparse_mla.sparse_mla_reference`:
q [B,S,H,C] (absorbed nope part R + rope part d_r), kv [B,T,C], indices [B,S,k] int32 (-1 = ignore)
-> out [B,S,H,R] (dtype of q), lse [B,S,H] f32 (-inf for a query with no valid index).

One program per query (grid B x S), every head at once (the heads are the matmuls' rows: padded to 16).
Forward: the query's k rows are gathered from the cache in chunks of bk (`kv[b, idx]`: a Triton gather load), split
into the value part [bk, R] and the rope part [bk, d_r] (R and d_r powers of two, as Triton's tiles want), scores
q_R·rows_R + q_r·rows_r, an online softmax in f32 over the chunks (running max m, sum l, accumulator [H,R]);
lse = m + log l.
Backward (`jax.custom_vjp`): per query the rows are gathered again, p = exp(s - lse) rebuilt from the saved lse,
ds = p·(dp - delta + dlse) with delta = Σ do·out; dq = scale·ds @ rows is the program's own output; the row
gradients scale·dsᵀ @ q (+ pᵀ @ do on the value part) are added into an f32 dkv by atomic adds at the rows' slots
-- no gather transpose, no scatter pass. -1 slots add into a spare row T, dropped at the end. The adds make dkv's
float summation order vary from run to run (as any atomic reduction). Off a GPU the kernels run in Pallas'
interpret mode (the same atomic adds, discharged), which is how the tests run them.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.common import sparse_mla_vjp

f32 = jnp.float32
MIN_ROWS = 16  # Triton's dots want at least 16 rows: heads are padded to it


def sparse_mla(q, kv, indices, *, scale: float, kv_lora_rank: int, block_q: int = 256, interpret: bool = False,
               block_k: int = 64):
    """The Pallas GPU sparse MLA attention; the signature of `sparse_mla_reference` (block_q unused), plus interpret
    and block_k (gathered rows per chunk; below 16 only interpreted). Differentiable in q and kv, through out and
    lse. A query's indices must be distinct (as a top-k's are) apart from -1."""
    del block_q
    B, S, H, C = q.shape
    R, k = kv_lora_rank, indices.shape[-1]
    for name, n in (("kv_lora_rank", R), ("rope width C - kv_lora_rank", C - R)):
        if n < 16 or n & (n - 1):
            raise ValueError(f"sparse_mla (GPU): {name} = {n} must be a power of two >= 16")
    bk = min(block_k, max(MIN_ROWS, 1 << (k - 1).bit_length()))
    if bk < MIN_ROWS and not interpret or bk & (bk - 1):
        raise ValueError(f"sparse_mla (GPU): block_k={bk} must be a power of two >= {MIN_ROWS} (Triton's dots)")
    Hp = max(MIN_ROWS, 1 << (H - 1).bit_length())  # a power of two (Triton's tiles)
    qp = jnp.pad(q, [(0, 0), (0, 0), (0, Hp - H), (0, 0)])
    ids = jnp.pad(indices, [(0, 0), (0, 0), (0, -k % bk)], constant_values=-1)
    out, lse = _sparse_mla(qp, kv, ids, float(scale), R, bk, bool(interpret))
    return out[:, :, :H], lse[:, :, :H]


def _gather(kv_ref, idx, R: int):
    """The rows idx [bk] (-1: row 0) of this batch row's cache -> value part [bk, R], rope part [bk, C - R]."""
    rows = jnp.maximum(idx, 0)[:, None]
    C = kv_ref.shape[-1]
    return kv_ref[rows, jnp.arange(R)[None, :]], kv_ref[rows, R + jnp.arange(C - R)[None, :]]


def _scores(q_ref, rows_v, rows_r, idx, scale: float, R: int):
    """[Hp, bk] f32 scores of the query's heads against the gathered rows, -inf at -1 slots."""
    s = jnp.dot(q_ref[:, :R], rows_v.T, preferred_element_type=f32)
    s = (s + jnp.dot(q_ref[:, R:], rows_r.T, preferred_element_type=f32)) * scale
    return jnp.where((idx >= 0)[None, :], s, -jnp.inf)


def _forward_kernel(q_ref, kv_ref, idx_ref, o_ref, lse_ref, *, scale: float, R: int, bk: int):
    Hp = q_ref.shape[0]

    def chunk(c, carry):
        m, l, acc = carry
        idx = idx_ref[pl.ds(c * bk, bk)]
        rows_v, rows_r = _gather(kv_ref, idx, R)
        s = _scores(q_ref, rows_v, rows_r, idx, scale, R)
        m_new = jnp.maximum(m, jnp.max(s, axis=-1))
        m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        p = jnp.exp(s - m_safe[:, None])
        corr = jnp.exp(m - m_safe)
        acc = acc * corr[:, None] + jnp.dot(p.astype(rows_v.dtype), rows_v, preferred_element_type=f32)
        return m_new, l * corr + jnp.sum(p, axis=-1), acc

    init = (jnp.full((Hp,), -jnp.inf, f32), jnp.zeros((Hp,), f32), jnp.zeros((Hp, R), f32))
    m, l, acc = jax.lax.fori_loop(0, idx_ref.shape[0] // bk, chunk, init)
    l_safe = jnp.where(l > 0, l, 1.0)
    o_ref[...] = (acc / l_safe[:, None]).astype(o_ref.dtype)
    lse_ref[...] = jnp.where(l > 0, m + jnp.log(l_safe), -jnp.inf)


def _backward_kernel(q_ref, kv_ref, idx_ref, do_ref, lse_ref, dterm_ref, dkv_in_ref, dq_ref, dkv_ref, *,
                     scale: float, R: int, bk: int):
    del dkv_in_ref  # aliased with dkv_ref: the zeros the adds start from
    Hp, C = q_ref.shape
    T = kv_ref.shape[0]
    do = do_ref[...].astype(f32)
    lse, dterm = lse_ref[...], dterm_ref[...]

    def chunk(c, carry):
        dq_v, dq_r = carry
        idx = idx_ref[pl.ds(c * bk, bk)]
        rows_v, rows_r = _gather(kv_ref, idx, R)
        s = _scores(q_ref, rows_v, rows_r, idx, scale, R)
        p = jnp.where(jnp.isfinite(lse)[:, None], jnp.exp(s - jnp.where(jnp.isfinite(lse), lse, 0.0)[:, None]), 0.0)
        dp = jnp.dot(do, rows_v.astype(f32).T, preferred_element_type=f32)
        ds = p * (dp - dterm[:, None]) * scale  # [Hp, bk]
        dq_v = dq_v + jnp.dot(ds, rows_v.astype(f32), preferred_element_type=f32)
        dq_r = dq_r + jnp.dot(ds, rows_r.astype(f32), preferred_element_type=f32)
        slot = jnp.where(idx >= 0, idx, T)[:, None]  # -1 slots: the spare row T
        d_v = jnp.dot(ds.T, q_ref[:, :R].astype(f32), preferred_element_type=f32) + \
            jnp.dot(p.T, do, preferred_element_type=f32)
        plgpu.atomic_add(dkv_ref, (slot, jnp.arange(R)[None, :]), d_v)
        plgpu.atomic_add(dkv_ref, (slot, R + jnp.arange(C - R)[None, :]),
                         jnp.dot(ds.T, q_ref[:, R:].astype(f32), preferred_element_type=f32))
        return dq_v, dq_r

    init = (jnp.zeros((Hp, R), f32), jnp.zeros((Hp, C - R), f32))
    dq_v, dq_r = jax.lax.fori_loop(0, idx_ref.shape[0] // bk, chunk, init)
    dq_ref[:, :R] = dq_v.astype(dq_ref.dtype)
    dq_ref[:, R:] = dq_r.astype(dq_ref.dtype)


def _specs(Hp: int, C: int, T: int, k: int):
    """BlockSpecs over the grid (b, s): the query's heads, the batch row's cache, the query's indices."""
    return (pl.BlockSpec((None, None, Hp, C), lambda b, s: (b, s, 0, 0)),
            pl.BlockSpec((None, T, C), lambda b, s: (b, 0, 0)),
            pl.BlockSpec((None, None, k), lambda b, s: (b, s, 0)))


def _forward(q, kv, ids, scale: float, R: int, bk: int, interpret: bool):
    B, S, Hp, C = q.shape
    per_query = pl.BlockSpec((None, None, Hp), lambda b, s: (b, s, 0))
    return pl.pallas_call(
        functools.partial(_forward_kernel, scale=scale, R=R, bk=bk), grid=(B, S),
        in_specs=list(_specs(Hp, C, kv.shape[1], ids.shape[-1])),
        out_specs=[pl.BlockSpec((None, None, Hp, R), lambda b, s: (b, s, 0, 0)), per_query],
        out_shape=[jax.ShapeDtypeStruct((B, S, Hp, R), q.dtype), jax.ShapeDtypeStruct((B, S, Hp), f32)],
        interpret=interpret, name="sparse_mla_gpu_fwd")(q, kv, ids)


def _backward(q, kv, ids, dout, lse, dterm, scale: float, R: int, bk: int, interpret: bool):
    """-> (dq [B,S,Hp,C], dkv [B,T,C]) (`common.sparse_mla_vjp`'s backward)."""
    B, S, Hp, C = q.shape
    T = kv.shape[1]
    per_query = pl.BlockSpec((None, None, Hp), lambda b, s: (b, s, 0))
    dkv_spec = pl.BlockSpec((None, T + 1, C), lambda b, s: (b, 0, 0))
    dq, dkv = pl.pallas_call(
        functools.partial(_backward_kernel, scale=scale, R=R, bk=bk), grid=(B, S),
        in_specs=[*_specs(Hp, C, T, ids.shape[-1]), pl.BlockSpec((None, None, Hp, R), lambda b, s: (b, s, 0, 0)),
                  per_query, per_query, dkv_spec],
        out_specs=[pl.BlockSpec((None, None, Hp, C), lambda b, s: (b, s, 0, 0)), dkv_spec],
        out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((B, T + 1, C), f32)],
        input_output_aliases={6: 1}, interpret=interpret, name="sparse_mla_gpu_bwd")(
            q, kv, ids, dout, lse, dterm, jnp.zeros((B, T + 1, C), f32))
    return dq, dkv[:, :T].astype(kv.dtype)


_sparse_mla = sparse_mla_vjp(_forward, _backward)  # what `sparse_mla` calls
