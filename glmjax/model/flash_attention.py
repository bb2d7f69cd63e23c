"""Blocked attention with an online softmax ("flash attention") in XLA: O(S) memory forward and backward.

Queries run in blocks of `block_q` (a `lax.map`), keys in blocks of `block_k` (a `lax.scan` carrying the running
row max m, the running sum l and the unnormalised output); only [B, block_q, H, block_k] scores are live at a time.
A `jax.custom_vjp` backward (two passes: dq per query block, dk and dv per key block) recomputes the score blocks
from q, k and the saved per-row log-sum-exp, so neither pass stores [B,H,S,T] nor carries a [B,S,H,d] f32 sum.
A (query block, key block) pair with no visible key is skipped (`lax.cond`): causally (its first key slot is after
the block's last query slot) or by segments (their id ranges do not intersect).

Visibility is the one of `glmjax.model.indexer.visible`: key slot t is visible to a query at slot q_idx iff
t <= q_idx and the query's segment id equals the key's (training: q_idx = arange(S), k_seg = q_seg; against a
cache: k_seg = kv_valid). Keys may be per head ([B,T,H,d], the MLA training form) or shared by all heads
([B,T,d], the absorbed MQA form over the latent).

`flash_attention` is the one entry point: it runs this XLA implementation or, where it applies, a kernel
(`dense_kernels.choose`: JAX's Pallas splash attention on TPU, its Pallas GPU flash attention on NVIDIA GPUs, for
causal self-attention); every implementation computes the same visibility, and where a kernel cannot (explicit
q_idx, MQA keys) this one runs.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from glmjax.model import dense_kernels
from glmjax.model.blocks import from_blocks, to_blocks
from glmjax.model.layers import f32


def flash_attention(q, k, v, q_seg, k_seg, q_idx, scale: float, block_q: int, block_k: int, impl: str = "auto"):
    """q [B,S,H,d], k [B,T,H,d] or [B,T,d], v [B,T,H,e] or [B,T,e] (same form as k), q_seg [B,S], k_seg [B,T],
    q_idx [B,S] key slot of each query (every q_idx < T), or None: query s at key slot s (self-attention, S == T)
    -> (out [B,S,H,e] in v's dtype, lse [B,S,H] f32, row max logit [B,S,H] f32). lse and the row max are -inf for a
    query with no visible key (its output is 0) and carry no gradient; out is differentiable in q, k, v.
    impl: `dense_kernels.DENSE_IMPLS` ("auto": a kernel on TPU / GPU where it applies, else this XLA flash)."""
    if k.ndim != v.ndim or k.shape[:2] != v.shape[:2]:
        raise ValueError(f"flash_attention: k {k.shape} and v {v.shape} must both be [B,T,H,.] or [B,T,.]")
    S, T = q.shape[1], k.shape[1]
    if q_idx is None and S != T:
        raise ValueError(f"flash_attention: q_idx None means self-attention, but S {S} != T {T}")
    bq, bk = min(block_q, S), min(block_k, T)
    q_seg, k_seg = q_seg.astype(jnp.int32), k_seg.astype(jnp.int32)
    kind = dense_kernels.choose(impl, q, k, q_idx)
    if kind != "xla":
        out, lse = dense_kernels.kernel_attention(kind, q, k, v, q_seg, k_seg, scale, block_q)
        idx = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), q_seg.shape)
        row_max = _row_max(*map(jax.lax.stop_gradient, (q, k)), q_seg, k_seg, idx, float(scale), bq, bk)
        return out, jax.lax.stop_gradient(lse), row_max
    q_idx = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), q_seg.shape) if q_idx is None else q_idx
    out, lse, row_max = _flash(q, k, v, q_seg, k_seg, q_idx.astype(jnp.int32), float(scale), bq, bk)
    return out, jax.lax.stop_gradient(lse), jax.lax.stop_gradient(row_max)


def _specs(k) -> dict:
    """einsum subscripts for per-head keys/values (k [B,T,H,d]) or keys/values shared by the heads (k [B,T,d])."""
    kd, ve = ("bkhd", "bkhe") if k.ndim == 4 else ("bkd", "bke")
    return {"s": f"bqhd,{kd}->bqhk", "pv": f"bqhk,{ve}->bqhe", "dv": f"bqhk,bqhe->{ve}", "dp": f"bqhe,{ve}->bqhk",
            "dq": f"bqhk,{kd}->bqhd", "dk": f"bqhk,bqhd->{kd}"}


def block_visible(seg_q, idx_q, seg_k, t0, bk):
    """[B,bq,bk] bool for query block (seg_q, idx_q [B,bq]) against the key block starting at slot t0."""
    t = t0 + jnp.arange(bk)
    return (t[None, None, :] <= idx_q[:, :, None]) & (seg_q[:, :, None] == seg_k[:, None, :])


def block_needed(seg_q, idx_q, seg_k, t0):
    """Scalar bool: may any query of the block see any key of the key block starting at t0 (conservative)?"""
    causal = t0 <= jnp.max(idx_q)
    overlap = (jnp.min(seg_q, axis=1) <= jnp.max(seg_k, axis=1)) & (jnp.min(seg_k, axis=1) <= jnp.max(seg_q, axis=1))
    return causal & jnp.any(overlap)


def _pad_queries(q_seg, q_idx, bq):
    """Query blocks of seg / slot, padded rows at slot -1 (they see no key)."""
    return to_blocks(q_seg, bq), to_blocks(q_idx, bq, -1)


def _scores(qb, kb, vis, scale):
    s = jnp.einsum(_specs(kb)["s"], qb, kb, preferred_element_type=f32) * scale
    return jnp.where(vis[:, :, None, :], s, -jnp.inf)  # [B,bq,H,bk]


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8))
def _flash(q, k, v, q_seg, k_seg, q_idx, scale, bq, bk):
    return _forward(q, k, v, q_seg, k_seg, q_idx, scale, bq, bk)


def _forward(q, k, v, q_seg, k_seg, q_idx, scale, bq, bk):
    B, S, H = q.shape[:3]
    e = v.shape[-1]
    pv = _specs(k)["pv"]
    kb_all, vb_all, sk_all = to_blocks(k, bk), to_blocks(v, bk), to_blocks(k_seg, bk)
    starts = jnp.arange(kb_all.shape[0]) * bk

    def query_block(args):
        qb, sq, iq = args

        def step(carry, xs):
            kb, vb, sk, t0 = xs

            def update(carry):
                m, l, acc = carry
                s = _scores(qb, kb, block_visible(sq, iq, sk, t0, bk), scale)
                m_new = jnp.maximum(m, jnp.max(s, axis=-1))
                m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
                p = jnp.exp(s - m_safe[..., None])
                alpha = jnp.exp(m - m_safe)
                acc = acc * alpha[..., None] + jnp.einsum(pv, p.astype(v.dtype), vb, preferred_element_type=f32)
                return m_new, l * alpha + jnp.sum(p, axis=-1), acc

            return jax.lax.cond(block_needed(sq, iq, sk, t0), update, lambda c: c, carry), None

        init = (jnp.full((B, bq, H), -jnp.inf, f32), jnp.zeros((B, bq, H), f32), jnp.zeros((B, bq, H, e), f32))
        (m, l, acc), _ = jax.lax.scan(step, init, (kb_all, vb_all, sk_all, starts))
        out = (acc / jnp.where(l > 0, l, 1.0)[..., None]).astype(v.dtype)
        lse = jnp.where(l > 0, m + jnp.log(jnp.where(l > 0, l, 1.0)), -jnp.inf)
        return out, lse, m

    sq_all, iq_all = _pad_queries(q_seg, q_idx, bq)
    outs = jax.lax.map(query_block, (to_blocks(q, bq), sq_all, iq_all))
    return tuple(from_blocks(o, S) for o in outs)


def _row_max(q, k, q_seg, k_seg, q_idx, scale, bq, bk):
    """Row max logit [B,S,H] f32 (-inf: no visible key) by a forward-only pass over (query, key) blocks: for a
    kernel that does not return it. Same blocks and skips as `_forward`."""
    kb_all, sk_all = to_blocks(k, bk), to_blocks(k_seg, bk)
    starts = jnp.arange(kb_all.shape[0]) * bk

    def query_block(args):
        qb, sq, iq = args

        def step(m, xs):
            kb, sk, t0 = xs

            def update(m):
                return jnp.maximum(m, jnp.max(_scores(qb, kb, block_visible(sq, iq, sk, t0, bk), scale), axis=-1))

            return jax.lax.cond(block_needed(sq, iq, sk, t0), update, lambda m: m, m), None

        return jax.lax.scan(step, jnp.full(qb.shape[:3], -jnp.inf, f32), (kb_all, sk_all, starts))[0]

    sq_all, iq_all = _pad_queries(q_seg, q_idx, bq)
    return from_blocks(jax.lax.map(query_block, (to_blocks(q, bq), sq_all, iq_all)), q.shape[1])


def _flash_fwd(q, k, v, q_seg, k_seg, q_idx, scale, bq, bk):
    # Inside a differentiated lax.scan (the model's scanned layers) JAX partially evaluates this rule: without the
    # barrier it splits each block's lax.cond into the part known from the integer inputs (the visibility mask, a
    # placeholder for the scores) and the rest, and saves the known part for every (query block, key block) pair
    # -- [S/b, T/b, B, b, H, b] residuals, O(S T) memory (tests/test_flash_attention.py).
    q, k, v, q_seg, k_seg, q_idx = jax.lax.optimization_barrier((q, k, v, q_seg, k_seg, q_idx))
    out, lse, m = _forward(q, k, v, q_seg, k_seg, q_idx, scale, bq, bk)
    return (out, lse, m), (q, k, v, q_seg, k_seg, q_idx, out, lse)


def _flash_bwd(scale, bq, bk, res, cts):
    """Two passes, each carrying one block only: dq by query block (a scan over key blocks), then dk, dv by key
    block (a scan over query blocks); both recompute p = exp(s - lse) and ds = p (dp - rowsum(do * out)) * scale.
    No [B,S,H,d] f32 accumulator is carried through the loops (XLA copies a large loop carry at each skipped
    block's conditional), at the price of recomputing s and dp once more."""
    q, k, v, q_seg, k_seg, q_idx, out, lse = res
    do = cts[0]
    S, T = q.shape[1], k.shape[1]
    spec = _specs(k)
    delta = jnp.sum(do.astype(f32) * out.astype(f32), axis=-1)  # [B,S,H]
    sq_all, iq_all = _pad_queries(q_seg, q_idx, bq)
    q_blocks = (to_blocks(q, bq), to_blocks(do, bq), sq_all, iq_all, to_blocks(lse, bq), to_blocks(delta, bq))
    k_blocks = (to_blocks(k, bk), to_blocks(v, bk), to_blocks(k_seg, bk), jnp.arange(-(-T // bk)) * bk)

    def grads_of_scores(qs, ks):
        """(p [B,bq,H,bk], ds in q's dtype) of one (query block, key block) pair."""
        (qb, dob, sq, iq, lseb, deltab), (kb, vb, sk, t0) = qs, ks
        vis = block_visible(sq, iq, sk, t0, bk)
        p = jnp.where(vis[:, :, None, :], jnp.exp(_scores(qb, kb, vis, scale) - lseb[..., None]), 0.0)
        dp = jnp.einsum(spec["dp"], dob, vb, preferred_element_type=f32)
        return p, (p * (dp - deltab[..., None]) * scale).astype(q.dtype)

    def skip_unless_needed(qs, ks, update, carry):
        return jax.lax.cond(block_needed(qs[2], qs[3], ks[2], ks[3]), update, lambda c: c, carry)

    def dq_block(qs):
        def step(dq, ks):
            update = lambda dq: dq + jnp.einsum(spec["dq"], grads_of_scores(qs, ks)[1], ks[0],  # noqa: E731
                                                preferred_element_type=f32)
            return skip_unless_needed(qs, ks, update, dq), None

        return jax.lax.scan(step, jnp.zeros(qs[0].shape, f32), k_blocks)[0].astype(q.dtype)

    def dkv_block(ks):
        def step(carry, qs):
            def update(carry):
                p, ds = grads_of_scores(qs, ks)
                return (carry[0] + jnp.einsum(spec["dk"], ds, qs[0], preferred_element_type=f32),
                        carry[1] + jnp.einsum(spec["dv"], p.astype(do.dtype), qs[1], preferred_element_type=f32))

            return skip_unless_needed(qs, ks, update, carry), None

        init = (jnp.zeros(ks[0].shape, f32), jnp.zeros(ks[1].shape, f32))
        dk, dv = jax.lax.scan(step, init, q_blocks)[0]
        return dk.astype(k.dtype), dv.astype(v.dtype)

    dq = jax.lax.map(dq_block, q_blocks)
    dk, dv = jax.lax.map(dkv_block, k_blocks)
    return from_blocks(dq, S), from_blocks(dk, T), from_blocks(dv, T), None, None, None


_flash.defvjp(_flash_fwd, _flash_bwd)

