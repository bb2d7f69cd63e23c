"""Multi-head latent attention (docs/model.md B.4) with DeepSeek Sparse Attention (B.6-B.8).

mode "dense":  plain causal MLA with per-head keys/values expanded from the latent (training, dense warm-up);
               against a cache (prefill / decode), absorbed attention over every visible cache row.
mode "sparse": the layer's indexer (or, on an IndexShare "shared" layer, the previous full layer's indices)
               selects k keys per query; attention gathers those k rows of the 576-d latent cache in MQA form.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from glmjax.config import ModelConfig
from glmjax.model.backends import BACKENDS, Backend
from glmjax.model.indexer import Indexer, index_scores, index_topk, masked_topk, visible
from glmjax.model.layers import RMSNorm, apply_rope, dense, dtype_of, f32, normal_param
from glmjax.model.sparse_attention import sparse_attention_probs


class Ctx(NamedTuple):
    """Per-forward context shared by every layer: RoPE tables, packing segments, the attention mode and, when
    running against a cache (prefill / decode), where the new rows go and which cache slots hold keys."""
    cos: jax.Array  # [B,S,d_r/2]
    sin: jax.Array
    segment_ids: jax.Array  # [B,S] int32, 0 = padding
    mode: str  # "dense" | "sparse"
    q_idx: jax.Array | None = None  # [B,S] cache slot of each new token (cache only; consecutive per row)
    kv_valid: jax.Array | None = None  # [B,T] int32, 1 where the cache slot holds a key (after this write)
    index_loss: bool = False  # training with an indexer KL: layers return its inputs (attn_p, index_logits)
    topk_stats: bool = False  # diagnostics (dense mode): layers return attn_topk, full layers index_topk
    backend: Backend | None = None  # sparse-mode functions; None: BACKENDS[cfg.attention_impl]


class AttnStats(NamedTuple):
    """What an attention layer reports besides its output; None where its mode and the Ctx flags produce nothing."""
    max_logit: jax.Array | None = None  # () largest attention logit, no gradient (dense training)
    attn_p: jax.Array | None = None  # ctx.index_loss: head-mean attention probabilities, no gradient, [B,S,T]
    #                                  dense, [B,S,k] over the selected keys sparse
    index_logits: jax.Array | None = None  # ctx.index_loss, full layers: index scores of the same keys, differentiable
    attn_topk: jax.Array | None = None  # ctx.topk_stats (dense): [B,S,k] top-k keys of attn_p
    index_topk: jax.Array | None = None  # ctx.topk_stats (dense), full layers: [B,S,k] the indexer's top-k


class Projected(NamedTuple):
    """The query / latent projections of one layer call (RoPE applied) and the up-projection slices."""
    q_resid: jax.Array  # [B,S,r_q] (normed), the indexer's query input
    q_nope: jax.Array  # [B,S,H,d_n]
    q_pe: jax.Array  # [B,S,H,d_r]
    c_kv: jax.Array  # [B,S,r_kv] (normed)
    k_pe: jax.Array  # [B,S,d_r]
    w_uk: jax.Array  # [r_kv,H,d_n]
    w_uv: jax.Array  # [r_kv,H,d_v]


class MLA(nnx.Module):
    def __init__(self, cfg: ModelConfig, has_indexer: bool, rngs: nnx.Rngs):
        self.cfg = cfg
        D, H = cfg.hidden_size, cfg.num_attention_heads
        r_q, r_kv, d_r = cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_rope_head_dim
        self.q_a_proj = normal_param(rngs, (D, r_q), ("embed", "q_lora"), cfg)
        self.q_a_layernorm = RMSNorm(r_q, cfg.latent_norm_eps, cfg)
        self.q_b_proj = normal_param(rngs, (r_q, H, cfg.qk_head_dim), ("q_lora", "heads", "head_dim"), cfg)
        self.kv_a_proj_with_mqa = normal_param(rngs, (D, r_kv + d_r), ("embed", "kv_lora"), cfg)
        self.kv_a_layernorm = RMSNorm(r_kv, cfg.latent_norm_eps, cfg)
        self.kv_b_proj = normal_param(rngs, (r_kv, H, cfg.qk_nope_head_dim + cfg.v_head_dim),
                                      ("kv_lora", "heads", "head_dim"), cfg)
        self.o_proj = normal_param(rngs, (H, cfg.v_head_dim, D), ("heads", "head_dim", "embed"), cfg)
        self.indexer = Indexer(cfg, rngs) if has_indexer else None

    def __call__(self, x: jax.Array, ctx: Ctx, topk: jax.Array, cache: dict | None = None):
        """x [B,S,D] (normed), topk [B,S,k'] indices of the previous full layer, cache None (keys = this sequence)
        or {"latent": [B,T,r_kv+d_r], "index_k": [B,T,d_I] on full layers} (the new rows are written first)
        -> out [B,S,D], topk used, AttnStats, cache."""
        if ctx.mode not in ("dense", "sparse"):
            raise ValueError(f"attention mode {ctx.mode!r}: must be 'dense' or 'sparse'")
        p = self.project(x, ctx)
        latent = jnp.concatenate([p.c_kv, p.k_pe], axis=-1)  # [B,S,576]: the MLA cache row of each token (docs/model.md D.1)
        if cache is not None:
            cache = dict(cache, latent=write_rows(cache["latent"], latent, ctx.q_idx[:, 0]))
            latent = cache["latent"]
        if ctx.mode == "dense" and cache is None:
            o, stats = self.dense_training(x, p, ctx)
        elif ctx.mode == "dense":
            o, stats = self.dense_cached(p, ctx, latent), AttnStats()
        else:
            o, topk, stats, cache = self.sparse(x, p, ctx, latent, topk, cache)
        return dense(o, self.o_proj[...], "bshv,hvd->bsd", dtype_of(self.cfg.dtype)), topk, stats, cache

    def project(self, x, ctx: Ctx) -> Projected:
        cfg, dt = self.cfg, dtype_of(self.cfg.dtype)
        d_n, r_kv = cfg.qk_nope_head_dim, cfg.kv_lora_rank
        q_resid = self.q_a_layernorm(dense(x, self.q_a_proj[...], "bsd,dr->bsr", dt))
        q = dense(q_resid, self.q_b_proj[...], "bsr,rhd->bshd", dt)
        q_pe = apply_rope(q[..., d_n:], ctx.cos, ctx.sin, cfg.rope_interleave)  # nope first, rope last
        ckv = dense(x, self.kv_a_proj_with_mqa[...], "bsd,dc->bsc", dt)
        c_kv = self.kv_a_layernorm(ckv[..., :r_kv])
        k_pe = apply_rope(ckv[..., r_kv:], ctx.cos, ctx.sin, cfg.rope_interleave)
        w_kv = self.kv_b_proj[...].astype(dt)
        return Projected(q_resid, q[..., :d_n], q_pe, c_kv, k_pe, w_kv[..., :d_n], w_kv[..., d_n:])

    def dense_training(self, x, p: Projected, ctx: Ctx):
        """Causal MLA over this sequence with per-head keys/values -> o [B,S,H,d_v], AttnStats (max_logit; attn_p
        and index_logits with ctx.index_loss; attn_topk and index_topk with ctx.topk_stats)."""
        cfg, seg = self.cfg, ctx.segment_ids
        o, max_logit, attn_p = dense_mla(p.q_nope, p.q_pe, p.c_kv, p.k_pe, p.w_uk, p.w_uv, seg, cfg.softmax_scale)
        if not (ctx.index_loss or ctx.topk_stats):
            return o, AttnStats(max_logit)
        qkw = None if self.indexer is None else self.indexer(x, p.q_resid, ctx.cos, ctx.sin)
        stats = AttnStats(max_logit)
        if ctx.index_loss:
            stats = stats._replace(attn_p=attn_p, index_logits=None if qkw is None else index_scores(*qkw, seg, seg))
        if ctx.topk_stats:
            vis = visible(seg, seg, jnp.arange(x.shape[1]))
            stats = stats._replace(
                attn_topk=masked_topk(jnp.where(vis, attn_p, -jnp.inf), cfg.index_topk),
                index_topk=None if qkw is None else index_topk(*qkw, seg, seg, cfg.index_topk, cfg.block_q)[0])
        return o, stats

    def absorbed_queries(self, p: Projected):
        """[q_nope . W_UK | q_pe] [B,S,H,r_kv+d_r]: queries against the latent rows in MQA form (docs/model.md D.2)."""
        return jnp.concatenate([jnp.einsum("bshd,chd->bshc", p.q_nope, p.w_uk), p.q_pe], axis=-1)

    def dense_cached(self, p: Projected, ctx: Ctx, latent):
        """Absorbed attention over every visible row of the cache latent [B,T,576] -> o [B,S,H,d_v]."""
        vis = visible(ctx.segment_ids, ctx.kv_valid, ctx.q_idx)
        o_lat = dense_mla_absorbed(self.absorbed_queries(p), latent, vis, self.cfg.softmax_scale, self.cfg.kv_lora_rank)
        return jnp.einsum("bshc,chv->bshv", o_lat, p.w_uv)

    def sparse(self, x, p: Projected, ctx: Ctx, latent, topk, cache):
        """Sparse attention over the latent rows [B,T,576] (this sequence, or the cache) that the layer's indexer
        selects (or, on a shared layer, topk) -> o [B,S,H,d_v], topk used, AttnStats (attn_p and index_logits with
        ctx.index_loss, without a cache), cache (index keys written on full layers)."""
        cfg, q_seg = self.cfg, ctx.segment_ids
        k_seg, q_idx = (q_seg, None) if cache is None else (ctx.kv_valid, ctx.q_idx)
        fns = BACKENDS[cfg.attention_impl] if ctx.backend is None else ctx.backend
        q_abs = self.absorbed_queries(p)
        if self.indexer is not None:
            qi, ki, wi = self.indexer(x, p.q_resid, ctx.cos, ctx.sin)
            if cache is not None:
                cache = dict(cache, index_k=write_rows(cache["index_k"], ki, ctx.q_idx[:, 0]))
                ki = cache["index_k"]
            topk, _ = fns.index_topk(qi, ki, wi, q_seg, k_seg, cfg.index_topk, cfg.block_q, q_idx)
        o_lat, lse = fns.sparse_mla(q_abs, latent, topk, scale=cfg.softmax_scale, kv_lora_rank=cfg.kv_lora_rank,
                                    block_q=cfg.block_q)
        o = jnp.einsum("bshc,chv->bshv", o_lat, p.w_uv)
        if not ctx.index_loss or cache is not None:
            return o, topk, AttnStats(), cache
        attn_p = sparse_attention_probs(q_abs, latent, topk, lse, scale=cfg.softmax_scale, block_q=cfg.block_q)
        index_logits = None if self.indexer is None else fns.gathered_index_logits(qi, ki, wi, topk, cfg.block_q)
        return o, topk, AttnStats(attn_p=attn_p, index_logits=index_logits), cache


def write_rows(cache, rows, start):
    """cache [B,T,C] with rows [B,S,C] written at slots start[b] .. start[b]+S-1."""
    return jax.vmap(lambda c, r, s: jax.lax.dynamic_update_slice_in_dim(c, r.astype(c.dtype), s, 0))(cache, rows, start)


def dense_mla_absorbed(q_abs, latent, vis, scale, r_kv):
    """MQA-form attention of absorbed queries [B,S,H,576] over all visible latent rows [B,T,576] -> [B,S,H,r_kv]."""
    s = jnp.einsum("bshc,btc->bhst", q_abs, latent, preferred_element_type=f32) * scale
    p = jax.nn.softmax(jnp.where(vis[:, None], s, -jnp.inf), axis=-1)
    return jnp.einsum("bhst,btr->bshr", p.astype(latent.dtype), latent[..., :r_kv])


def dense_mla(q_nope, q_pe, c_kv, k_pe, w_uk, w_uv, segment_ids, scale):
    """Causal MLA with keys/values expanded per head -> out [B,S,H,d_v], max logit (scalar, no gradient), head-mean
    probabilities [B,S,T] (no gradient; unused outputs cost nothing under jit). Builds [B,H,S,T]: the dense baseline."""
    k_nope = jnp.einsum("btc,chd->bthd", c_kv, w_uk)
    v = jnp.einsum("btc,chv->bthv", c_kv, w_uv)
    logits = jnp.einsum("bshd,bthd->bhst", q_nope, k_nope, preferred_element_type=f32)
    logits = (logits + jnp.einsum("bshr,btr->bhst", q_pe, k_pe, preferred_element_type=f32)) * scale
    S = q_nope.shape[1]
    logits = jnp.where(visible(segment_ids, segment_ids, jnp.arange(S))[:, None], logits, -jnp.inf)
    p = jax.nn.softmax(logits, axis=-1)
    out = jnp.einsum("bhst,bthv->bshv", p.astype(v.dtype), v)
    return out, jax.lax.stop_gradient(jnp.max(logits)), jax.lax.stop_gradient(jnp.mean(p, axis=1))
