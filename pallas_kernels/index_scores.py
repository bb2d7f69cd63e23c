"""Index scores at the selected keys with a hand-written VJP: the sparse-stage indexer loss (SPEC E.3).

Same contract as the XLA reference `glmjax.model.indexer.gathered_index_logits`: q [B,S,H_I,d_I], k [B,T,d_I],
w [B,S,H_I], indices [B,S,k'] (-1 = none) -> I [B,S,k'] f32,
I[s,j] = d_I^-0.5 Σ_h w[s,h]·ReLU(q[s,h]·k[idx[s,j]]), and -inf at -1 slots.

Written in XLA (this is the deliverable's "kernel or XLA" choice): the work is gathers plus small batched matmuls
that XLA fuses well, O(S·k'·H_I·d_I) in time and O(block·k'·H_I) in memory. Query blocks of `block_q` rows are
processed by a scan; each gathers its k' key rows once. The backward pass recomputes z = q·k_sel per block and
forms, with g the cotangent (zeroed at -1 slots) and c = d_I^-0.5:
    dw[s,h] = c Σ_j g[s,j]·ReLU(z[s,h,j]),  dz = c·g[s,j]·w[s,h]·1[z > 0],
    dq[s,h] = Σ_j dz[s,h,j]·k[idx[s,j]],    dk[t] = Σ_{(s,j): idx[s,j] = t} Σ_h dz[s,h,j]·q[s,h]
the last one a scatter-add of the block's [bq·k', d_I] row gradients into a float32 [B,T,d_I] carry. Nothing is
saved between the passes but the inputs.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.common import pad_axis, round_up

f32 = jnp.float32


def gathered_index_logits(q, k, w, indices, block_q: int = 256):
    """I[s,j] at the selected keys, differentiable in q, k and w (see the module docstring)."""
    B, S, HI, D = q.shape
    if k.shape != (B, k.shape[1], D) or w.shape != (B, S, HI) or indices.shape[:2] != (B, S):
        raise ValueError(f"gathered_index_logits: q {q.shape}, k {k.shape}, w {w.shape}, indices {indices.shape}")
    return _gathered(q, k, w, indices, min(max(int(block_q), 1), S))


def _blocks(a, bq: int, fill=0):
    """[B,S,...] -> [nb,B,bq,...] (tail padded with `fill`)."""
    B, S = a.shape[:2]
    a = pad_axis(a, 1, round_up(S, bq), fill)
    return jnp.moveaxis(a.reshape((B, -1, bq) + a.shape[2:]), 1, 0)


def _unblocks(a, S: int):
    a = jnp.moveaxis(a, 0, 1)
    return a.reshape((a.shape[0], -1) + a.shape[3:])[:, :S]


def _rows(k, ids):
    """k [B,T,d], ids [B,bq,k'] (>= 0) -> [B,bq,k',d]."""
    return jax.vmap(lambda kb, ib: kb[ib])(k, ids)


def _scores(qb, kb, wb, ib):
    z = jnp.einsum("bqhd,bqkd->bqhk", qb, _rows(kb, jnp.maximum(ib, 0)), preferred_element_type=f32)
    return z, jnp.einsum("bqhk,bqh->bqk", jnp.maximum(z, 0.0), wb.astype(f32)) * qb.shape[-1] ** -0.5


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _gathered(q, k, w, indices, bq):
    def one(_, blk):
        qb, wb, ib = blk
        return None, jnp.where(ib >= 0, _scores(qb, k, wb, ib)[1], -jnp.inf)

    _, out = jax.lax.scan(one, None, (_blocks(q, bq), _blocks(w, bq), _blocks(indices, bq, -1)))
    return _unblocks(out, q.shape[1])


def _gathered_fwd(q, k, w, indices, bq):
    return _gathered(q, k, w, indices, bq), (q, k, w, indices)


def _gathered_bwd(bq, res, g):
    q, k, w, indices = res
    c = q.shape[-1] ** -0.5

    def one(dk, blk):
        qb, wb, ib, gb = blk
        gb = jnp.where(ib >= 0, gb, 0.0)
        z, _ = _scores(qb, k, wb, ib)
        dw = jnp.einsum("bqk,bqhk->bqh", gb, jnp.maximum(z, 0.0)) * c
        dz = jnp.where(z > 0, gb[:, :, None, :] * wb.astype(f32)[..., None] * c, 0.0)  # [B,bq,H_I,k']
        sel = _rows(k, jnp.maximum(ib, 0))
        dq = jnp.einsum("bqhk,bqkd->bqhd", dz.astype(q.dtype), sel, preferred_element_type=f32)
        drows = jnp.einsum("bqhk,bqhd->bqkd", dz.astype(q.dtype), qb, preferred_element_type=f32)
        drows = jnp.where((ib >= 0)[..., None], drows, 0.0)
        dk = jax.vmap(lambda acc, ids, r: acc.at[ids.reshape(-1)].add(r.reshape(-1, r.shape[-1])))(
            dk, jnp.maximum(ib, 0), drows)
        return dk, (dq.astype(q.dtype), dw.astype(w.dtype))

    dk0 = jnp.zeros(k.shape, f32)
    dk, (dq, dw) = jax.lax.scan(one, dk0, (_blocks(q, bq), _blocks(w, bq), _blocks(indices, bq, -1),
                                           _blocks(g, bq)))
    S = q.shape[1]
    return _unblocks(dq, S), dk.astype(k.dtype), _unblocks(dw, S), None


_gathered.defvjp(_gathered_fwd, _gathered_bwd)
