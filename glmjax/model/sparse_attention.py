"""Sparse MLA attention in MQA form, XLA reference (docs/model.md B.7, D.2).

DSA runs MLA "in MQA mode": every head attends over the same k gathered rows of the latent cache
kv = [c_kv | k_pe] (r_kv + d_r = 576 for GLM-5), with absorbed queries q = [q_nope . W_UK | q_pe].
Values are the r_kv-wide latent part. Work and memory are O(S * k): per query block only the
[B, bq, k, r_kv + d_r] gathered rows exist, and the block is rematerialised in the backward pass.
The Pallas kernel `pallas_kernels.sparse_mla` implements the same signature (`glmjax.model.backends` picks one).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from glmjax.model.blocks import from_blocks, to_blocks

f32 = jnp.float32


def gather_block_bytes() -> int:
    """Budget for one query block's gathered rows: cache-sized on CPU (why: docs/benchmarks.md, measurements
    behind the model code's choices), larger on accelerators."""
    return (16 if jax.default_backend() == "cpu" else 512) * 2 ** 20


def sparse_mla_xla(q, kv, indices, *, scale: float, kv_lora_rank: int, block_q: int = 256):
    """q [B,S,H,R+d_r], kv [B,T,R+d_r], indices [B,S,k] int32 (-1 = ignore)
    -> out [B,S,H,R] (dtype of q), lse [B,S,H] f32 (-inf for a query with no valid index).
    Queries go in blocks of at most block_q rows and at most gather_block_bytes() of gathered rows."""
    B, S, H, _ = q.shape
    R = kv_lora_rank
    bq = query_block(kv, indices, block_q)

    @jax.checkpoint
    def one_block(args):
        qb, ib = args  # [B,bq,H,C], [B,bq,k]
        valid = ib >= 0
        rows = jax.vmap(lambda cache, ids: cache[ids])(kv, jnp.maximum(ib, 0))  # [B,bq,k,C]
        s = jnp.einsum("bqhc,bqkc->bqhk", qb, rows, preferred_element_type=f32) * scale
        s = jnp.where(valid[:, :, None, :], s, -jnp.inf)
        m = jnp.max(s, axis=-1, keepdims=True)
        m = jnp.where(jnp.isfinite(m), m, 0.0)
        p = jnp.exp(s - m)
        l = jnp.sum(p, axis=-1)
        o = jnp.einsum("bqhk,bqkr->bqhr", p.astype(q.dtype), rows[..., :R], preferred_element_type=f32)
        o = o / jnp.where(l > 0, l, 1.0)[..., None]
        lse = jnp.where(l > 0, m[..., 0] + jnp.log(jnp.where(l > 0, l, 1.0)), -jnp.inf)
        return o.astype(q.dtype), lse

    out, lse = jax.lax.map(one_block, (to_blocks(q, bq), to_blocks(indices, bq, -1)))
    return from_blocks(out, S), from_blocks(lse, S)


def query_block(kv, indices, block_q: int) -> int:
    """Rows per query block: at most block_q, and at most gather_block_bytes() of gathered latent rows."""
    per_query = indices.shape[0] * indices.shape[-1] * kv.shape[-1] * kv.dtype.itemsize
    return max(1, min(block_q, indices.shape[1], gather_block_bytes() // per_query))


def sparse_attention_probs(q, kv, indices, lse, *, scale: float, block_q: int = 256):
    """Head-mean attention probabilities over the selected keys [B,S,k] f32 (0 at -1 slots), no gradient: the
    main-attention target of the sparse-stage indexer loss (docs/model.md E.3). lse [B,S,H] from the attention forward."""
    q, kv, lse = jax.lax.stop_gradient((q, kv, lse))
    bq = query_block(kv, indices, block_q)

    def one_block(args):
        qb, ib, lb = args
        rows = jax.vmap(lambda cache, ids: cache[ids])(kv, jnp.maximum(ib, 0))
        s = jnp.einsum("bqhc,bqkc->bqhk", qb, rows, preferred_element_type=f32) * scale
        p = jnp.where((ib >= 0)[:, :, None, :] & jnp.isfinite(lb)[..., None], jnp.exp(s - lb[..., None]), 0.0)
        return jnp.mean(p, axis=2)

    return from_blocks(jax.lax.map(one_block, (to_blocks(q, bq), to_blocks(indices, bq, -1), to_blocks(lse, bq))),
                       indices.shape[1])
