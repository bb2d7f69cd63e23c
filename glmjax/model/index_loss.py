"""Dense-attention indexer losses and diagnostics streamed over key blocks: O(S) memory, never [B,S,T].

The dense warm-up target (docs/model.md E.2, E.4) is p[s,t] = mean over layers j and heads h of
exp(scale * q_jh[s] . k_jh[t] - lse_jh[s]) on visible keys: the flash forward's per-head log-sum-exps turn a block
of scores back into probabilities. With the index scores I (B.6) and their log-sum-exp Z[s] over the visible keys,

    KL(p_s || softmax I_s) = sum_t p log p - sum_t p I + (sum_t p) Z

so one pass over key blocks accumulates sum p log p, sum p I, sum p and an online log-sum-exp of I. Query blocks
run in a rematerialised `lax.map` and key blocks in a rematerialised `lax.scan`, so the gradient (q - p per score,
taken back through the index scores of each block) is recomputed block by block as well. Blocks with no visible
key are skipped (`flash_attention.block_needed`).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from glmjax.model.blocks import from_blocks, to_blocks
from glmjax.model.flash_attention import block_needed, block_visible
from glmjax.model.indexer import index_logits
from glmjax.model.layers import f32


@functools.partial(jax.tree_util.register_dataclass, data_fields=["q", "k", "lse"], meta_fields=["scale", "block"])
@dataclasses.dataclass(frozen=True)
class DenseTarget:
    """One layer's dense attention, enough to recompute its probabilities block by block (no gradient); a pytree
    whose scale and block are static."""
    q: jax.Array  # [B,S,H,d] queries (RoPE applied; nope and rope parts concatenated)
    k: jax.Array  # [B,T,H,d] per-head keys, or [B,T,d] keys shared by the heads
    lse: jax.Array  # [B,S,H] f32 log-sum-exp of the scaled scores over the visible keys (-inf: none)
    scale: float
    block: int  # query and key block of the streamed losses


def dense_target(q, k, lse, scale: float, block: int) -> DenseTarget:
    return DenseTarget(*map(jax.lax.stop_gradient, (q, k, lse)), float(scale), int(block))


def _target_block(targets, qbs, lsebs, kbs, vis):
    """Mean over layers and heads of the probabilities of a (query block, key block) pair -> [B,bq,bk] f32."""
    total = 0.0
    for t, qb, lseb, kb in zip(targets, qbs, lsebs, kbs):
        spec = "bqhd,bkhd->bqhk" if kb.ndim == 4 else "bqhd,bkd->bqhk"
        s = jnp.einsum(spec, qb, kb, preferred_element_type=f32) * t.scale
        p = jnp.where(vis[:, :, None, :], jnp.exp(s - lseb[..., None]), 0.0)
        total = total + jnp.mean(p, axis=2)
    return total / len(targets)


def _query_blocks(segment_ids, block: int, k_seg=None, q_idx=None):
    """(bq, query segment blocks, query slot blocks padded with -1, key segment blocks, key block starts).
    k_seg [B,T] (default: the queries' segment ids) and q_idx [B,S] (default arange(S)): queries that are not the
    keys, e.g. one context shard's queries at their global slots against all keys (glmjax/model/context.py)."""
    S = segment_ids.shape[1]
    b = min(block, S)
    idx = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32) if q_idx is None else q_idx, segment_ids.shape)
    sk = to_blocks(segment_ids if k_seg is None else k_seg, b)
    return b, to_blocks(segment_ids, b), to_blocks(idx, b, -1), sk, jnp.arange(sk.shape[0]) * b


def streaming_index_kl(targets: list[DenseTarget], q, k, w, segment_ids, query_ok, k_seg=None, q_idx=None):
    """sum over counted queries of KL(p || softmax(I)) with p the mean of `targets` (the layers a full layer serves,
    docs/model.md E.4) and I the index scores of the indexer outputs q [B,S,H_I,d_I], k [B,S,d_I], w [B,S,H_I] over
    the causal keys of the query's segment; counted: query_ok [B,S] and some target mass. Equals
    `indexer.index_kl(p, index_scores(q, k, w, seg, seg), query_ok)` without [B,S,T] -> (sum of KL, queries) f32.
    Differentiable in q, k, w; blocks of targets[0].block. k_seg, q_idx: see `_query_blocks`."""
    b, sq_all, iq_all, sk_all, starts = _query_blocks(segment_ids, targets[0].block, k_seg, q_idx)
    kb_all = to_blocks(k, b)
    tk_all = [to_blocks(t.k, b) for t in targets]

    @jax.checkpoint
    def query_block(args):
        qb, wb, sq, iq, ok, tqs, tls = args

        @jax.checkpoint
        def step(carry, xs):
            kb, sk, t0, tks = xs

            def update(carry):
                plogp, pi, mass, m, l = carry
                vis = block_visible(sq, iq, sk, t0, b)
                p = _target_block(targets, tqs, tls, tks, vis)
                scores = index_logits(qb, kb, wb)
                plogp = plogp + jnp.sum(jnp.where(p > 0, p * jnp.log(jnp.where(p > 0, p, 1.0)), 0.0), axis=-1)
                pi = pi + jnp.sum(jnp.where(vis, p * scores, 0.0), axis=-1)
                masked = jnp.where(vis, scores, -jnp.inf)
                m_new = jax.lax.stop_gradient(jnp.maximum(m, jnp.max(masked, axis=-1)))
                m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
                l = l * jnp.exp(m - m_safe) + jnp.sum(jnp.exp(masked - m_safe[..., None]), axis=-1)
                return plogp, pi, mass + jnp.sum(p, axis=-1), m_new, l

            return jax.lax.cond(block_needed(sq, iq, sk, t0), update, lambda c: c, carry), None

        zeros = jnp.zeros(sq.shape, f32)
        init = (zeros, zeros, zeros, jnp.full(sq.shape, -jnp.inf, f32), zeros)
        (plogp, pi, mass, m, l), _ = jax.lax.scan(step, init, (kb_all, sk_all, starts, tk_all))
        lse = jnp.where(l > 0, jnp.where(jnp.isfinite(m), m, 0.0) + jnp.log(jnp.where(l > 0, l, 1.0)), 0.0)
        counted = ok & (mass > 0)
        return jnp.where(counted, plogp - pi + mass * lse, 0.0), counted

    kl, counted = jax.lax.map(query_block, (to_blocks(q, b), to_blocks(w, b), sq_all, iq_all,
                                            to_blocks(query_ok, b, False), [to_blocks(t.q, b) for t in targets],
                                            [to_blocks(t.lse, b, -jnp.inf) for t in targets]))
    return jnp.sum(kl), jnp.sum(counted).astype(f32)


def streaming_attention_topk(target: DenseTarget, segment_ids, topk: int, k_seg=None, q_idx=None):
    """Top-k keys of one layer's head-mean attention probabilities over the visible keys, merged block by block
    (block top-k, then top-k of [running, block]: ties keep the lowest key index). Equals
    `indexer.masked_topk(where(visible, p, -inf), topk)` -> [B,S,min(topk, T)] int32, -1 = no key. k_seg, q_idx:
    see `_query_blocks`."""
    S, T = target.q.shape[1], target.k.shape[1]
    kk = min(topk, T)
    b, sq_all, iq_all, sk_all, starts = _query_blocks(segment_ids, target.block, k_seg, q_idx)
    kb_all = to_blocks(target.k, b)

    def query_block(args):
        qb, lseb, sq, iq = args

        def step(carry, xs):
            kb, sk, t0 = xs

            def update(carry):
                vals, ids = carry
                vis = block_visible(sq, iq, sk, t0, b)
                p = jnp.where(vis, _target_block([target], [qb], [lseb], [kb], vis), -jnp.inf)
                bv, bi = jax.lax.top_k(p, min(kk, b))
                vals, pos = jax.lax.top_k(jnp.concatenate([vals, bv], axis=-1), kk)
                return vals, jnp.take_along_axis(jnp.concatenate([ids, bi + t0], axis=-1), pos, axis=-1)

            return jax.lax.cond(block_needed(sq, iq, sk, t0), update, lambda c: c, carry), None

        init = (jnp.full(sq.shape + (kk,), -jnp.inf, f32), jnp.full(sq.shape + (kk,), -1, jnp.int32))
        (vals, ids), _ = jax.lax.scan(step, init, (kb_all, sk_all, starts))
        return jnp.where(vals == -jnp.inf, -1, ids).astype(jnp.int32)

    ids = jax.lax.map(query_block, (to_blocks(target.q, b), to_blocks(target.lse, b, -jnp.inf), sq_all, iq_all))
    return from_blocks(ids, S)
