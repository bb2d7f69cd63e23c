"""MLA's attention as its formulas (docs/model.md B.4, B.7, D.2): the plain dense path and the plain sparse path.

    dense_mla   causal MLA with per-head keys / values expanded from the latent (B.4 steps 7-11, before o_proj)
    sparse_mla  each query over the k latent rows its top-k selects, in the absorbed MQA form (B.7, D.2)

Both build their whole score tensor ([B,H,S,T] dense, [B,S,H,k] sparse). They are what the layer computes; the
blocked, head-grouped, chunked, context-parallel and kernel variants that run at other sizes (mla_variants.py,
chosen by mla_paths.py) compute the same numbers within float tolerance (tests/test_mla_paths.py). Also here: the
layer's intermediate and reported types (`Projected`, `AttnStats`).
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from glmjax.model.index_loss import DenseTarget
from glmjax.model.indexer import visible
from glmjax.model.layers import f32


class Projected(NamedTuple):
    """The query / latent projections of one layer call (B.4 steps 1-6, RoPE applied) and the up-projections."""
    q_resid: jax.Array  # [B,S,r_q] (normed), or x [B,S,D] without a query LoRA: the query input (the indexer's too)
    q_nope: jax.Array  # [B,S,H,d_n]
    q_pe: jax.Array  # [B,S,H,d_r]
    c_kv: jax.Array  # [B,S,r_kv] (normed)
    k_pe: jax.Array  # [B,S,d_r]
    w_uk: jax.Array  # [r_kv,H,d_n]
    w_uv: jax.Array  # [r_kv,H,d_v]


def up_project(c_kv, w_uk, w_uv):
    """B.4 step 7: the latent c_kv [B,T,r_kv] -> per-head k_nope [B,T,H,d_n] and values v [B,T,H,d_v]."""
    return jnp.einsum("btc,chd->bthd", c_kv, w_uk), jnp.einsum("btc,chv->bthv", c_kv, w_uv)


def expand_kv(q_nope, q_pe, c_kv, k_pe, w_uk, w_uv):
    """B.4 steps 7-8 as whole tensors: queries [q_nope | q_pe] [B,S,H,d_qk], keys [k_nope | k_pe] [B,T,H,d_qk]
    (the one rope key broadcast over the heads) and values [B,T,H,d_v]."""
    k_nope, v = up_project(c_kv, w_uk, w_uv)
    k_pe = jnp.broadcast_to(k_pe[:, :, None, :], k_nope.shape[:3] + k_pe.shape[-1:]).astype(k_nope.dtype)
    return jnp.concatenate([q_nope, q_pe], axis=-1), jnp.concatenate([k_nope, k_pe], axis=-1), v


def absorb(q_nope, q_pe, w_uk):
    """D.2: queries against the latent rows, [q_nope . W_UK | q_pe] [B,S,H,r_kv+d_r] (scores equal to B.4's)."""
    return jnp.concatenate([jnp.einsum("bshd,chd->bshc", q_nope, w_uk), q_pe], axis=-1)


def dense_mla(q_nope, q_pe, c_kv, k_pe, w_uk, w_uv, segment_ids, scale: float):
    """Causal MLA over one packed sequence (B.4 steps 7-11; the output projection o_proj is the caller's).

    q_nope [B,S,H,d_n], q_pe [B,S,H,d_r] (roped), c_kv [B,S,r_kv] (normed), k_pe [B,S,d_r] (roped), w_uk
    [r_kv,H,d_n], w_uv [r_kv,H,d_v], segment_ids [B,S] (0 = padding) -> out [B,S,H,d_v], the largest logit (a
    scalar, no gradient) and the head-mean probabilities [B,S,S] f32 (no gradient: the indexer loss's target)."""
    k_nope, v = up_project(c_kv, w_uk, w_uv)  # step 7
    # steps 8-9: Q K^T = q_nope . k_nope + q_pe . k_pe (the one rope key shared by the heads), times the scale
    logits = jnp.einsum("bshd,bthd->bhst", q_nope, k_nope, preferred_element_type=f32)
    logits = (logits + jnp.einsum("bshr,btr->bhst", q_pe, k_pe, preferred_element_type=f32)) * scale
    S = q_nope.shape[1]
    logits = jnp.where(visible(segment_ids, segment_ids, jnp.arange(S))[:, None], logits, -jnp.inf)  # step 10
    p = jax.nn.softmax(logits, axis=-1)
    out = jnp.einsum("bhst,bthv->bshv", p.astype(v.dtype), v)  # step 11 before o_proj
    return out, jax.lax.stop_gradient(jnp.max(logits)), jax.lax.stop_gradient(jnp.mean(p, axis=1))


def sparse_mla(q_nope, q_pe, latent, topk, w_uk, w_uv, scale: float, kv_lora_rank: int):
    """Sparse MLA (B.7) in the absorbed form (D.2): each query attends over the latent rows its top-k selects.

    q_nope [B,S,H,d_n], q_pe [B,S,H,d_r] (roped), latent [B,T,r_kv+d_r] (the cache rows [c_kv | k_pe]), topk
    [B,S,k] int32 key slots (-1: no key; the indexer's selection is causal and same-document, B.6 steps 7-8),
    w_uk [r_kv,H,d_n], w_uv [r_kv,H,d_v] -> out [B,S,H,d_v] (0 for a query without a key), lse [B,S,H] f32 (-inf
    for a query without a key). The backends' `sparse_mla` (glmjax/model/backends.py) is its core: absorbed
    queries in, the latent-space output (before W_UV) out."""
    q_abs = absorb(q_nope, q_pe, w_uk)  # [B,S,H,576]: q_nope . W_UK | q_pe
    rows = jax.vmap(lambda rows_b, ids: rows_b[ids])(latent, jnp.maximum(topk, 0))  # [B,S,k,576]: the selected keys
    logits = jnp.einsum("bshc,bskc->bshk", q_abs, rows, preferred_element_type=f32) * scale
    logits = jnp.where((topk >= 0)[:, :, None, :], logits, -jnp.inf)
    lse = jax.nn.logsumexp(logits, axis=-1)  # [B,S,H]
    p = jnp.where(jnp.isfinite(lse)[..., None], jnp.exp(logits - jnp.where(jnp.isfinite(lse), lse, 0.0)[..., None]), 0)
    o_lat = jnp.einsum("bshk,bskr->bshr", p.astype(latent.dtype), rows[..., :kv_lora_rank])  # values: c_kv rows
    return jnp.einsum("bshr,rhv->bshv", o_lat, w_uv), lse


class AttnStats(NamedTuple):
    """What an attention layer reports besides its output; None where its mode and the Ctx flags produce nothing.
    With ctx.index_loss a layer reports its indexer-loss inputs either materialised (attn_p, index_logits: sparse
    mode, and the materialised dense path) or in the streamed form (attn_target, index_qkw: blocked dense)."""
    max_logit: jax.Array | None = None  # () largest attention logit, no gradient (dense training)
    attn_p: jax.Array | None = None  # head-mean attention probabilities, no gradient, [B,S,T] dense, [B,S,k] sparse
    index_logits: jax.Array | None = None  # full layers: index scores of the same keys, differentiable
    attn_topk: jax.Array | None = None  # ctx.topk_stats (dense): [B,S,k] top-k keys of the head-mean attention
    index_topk: jax.Array | None = None  # ctx.topk_stats (dense), full layers: [B,S,k] the indexer's top-k
    attn_target: DenseTarget | None = None  # dense, streamed: the attention to recompute per key block
    index_qkw: tuple | None = None  # dense, streamed, full layers: the indexer's (q, k, w), differentiable
