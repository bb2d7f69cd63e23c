"""Multi-head latent attention (SPEC B.4) with DeepSeek Sparse Attention (B.6-B.8).

mode "dense":  plain causal MLA with per-head keys/values expanded from the latent (training, dense warm-up).
mode "sparse": the layer's indexer (or, on an IndexShare "shared" layer, the previous full layer's indices)
               selects k keys per query; attention gathers those k rows of the 576-d latent cache in MQA form.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from glmjax.config import ModelConfig
from glmjax.model.indexer import Indexer, gathered_index_logits, index_scores, index_topk, masked_topk, visible
from glmjax.model.layers import RMSNorm, apply_rope, dense, dtype_of, f32, normal_param
from glmjax.model.sparse_attention import sparse_attention_probs, sparse_mla_xla

SPARSE_ATTENTION = {"xla": sparse_mla_xla}
INDEX_TOPK = {"xla": index_topk}
GATHERED_INDEX_LOGITS = {"xla": gathered_index_logits}


def kernels(impl: str):
    """(index top-k, sparse attention, gathered index scores) of `attention_impl`; the Pallas kernels register
    on first use."""
    if impl not in SPARSE_ATTENTION:
        import pallas_kernels  # noqa: F401  (adds "pallas" to the tables)
    return INDEX_TOPK[impl], SPARSE_ATTENTION[impl], GATHERED_INDEX_LOGITS[impl]


class Ctx(NamedTuple):
    """Per-forward context shared by every layer: RoPE tables, packing segments, the attention mode and, when
    running against a cache (prefill / decode), where the new rows go and which cache slots hold keys."""
    cos: jax.Array  # [B,S,d_r/2]
    sin: jax.Array
    segment_ids: jax.Array  # [B,S] int32, 0 = padding
    mode: str  # "dense" | "sparse"
    q_idx: jax.Array | None = None  # [B,S] cache slot of each new token (cache only; consecutive per row)
    kv_valid: jax.Array | None = None  # [B,T] int32, 1 where the cache slot holds a key (after this write)
    index_loss: bool = False  # training with an indexer KL: layers return its inputs ("attn_p", "index_logits")
    topk_stats: bool = False  # diagnostics (dense mode): layers return "attn_topk", full layers "index_topk"


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
        -> out [B,S,D], topk used, stats, cache. stats: "max_logit" (largest attention logit, dense training);
        with ctx.index_loss "attn_p" (head-mean attention probabilities, no gradient: [B,S,T] dense, [B,S,k] over
        the selected keys sparse) and on full layers "index_logits" (same shape, differentiable); with
        ctx.topk_stats (dense) "attn_topk" (top-k keys of attn_p) and on full layers "index_topk"."""
        cfg, dt = self.cfg, dtype_of(self.cfg.dtype)
        d_n, r_kv = cfg.qk_nope_head_dim, cfg.kv_lora_rank
        q_resid = self.q_a_layernorm(dense(x, self.q_a_proj[...], "bsd,dr->bsr", dt))
        q = dense(q_resid, self.q_b_proj[...], "bsr,rhd->bshd", dt)
        q_nope = q[..., :d_n]
        q_pe = apply_rope(q[..., d_n:], ctx.cos, ctx.sin, cfg.rope_interleave)  # nope first, rope last
        ckv = dense(x, self.kv_a_proj_with_mqa[...], "bsd,dc->bsc", dt)
        c_kv = self.kv_a_layernorm(ckv[..., :r_kv])
        k_pe = apply_rope(ckv[..., r_kv:], ctx.cos, ctx.sin, cfg.rope_interleave)
        w_kv = self.kv_b_proj[...].astype(dt)
        w_uk, w_uv = w_kv[..., :d_n], w_kv[..., d_n:]  # [r_kv,H,d_n], [r_kv,H,d_v]
        latent = jnp.concatenate([c_kv, k_pe], axis=-1)  # [B,S,576]: the MLA cache row of each token (SPEC D.1)
        q_seg, k_seg, q_idx = ctx.segment_ids, ctx.segment_ids, None
        if cache is not None:
            cache = dict(cache, latent=write_rows(cache["latent"], latent, ctx.q_idx[:, 0]))
            latent, k_seg, q_idx = cache["latent"], ctx.kv_valid, ctx.q_idx

        stats = {}
        if ctx.mode == "dense" and cache is None:
            o, stats["max_logit"], p = dense_mla(q_nope, q_pe, c_kv, k_pe, w_uk, w_uv, ctx.segment_ids,
                                                 cfg.softmax_scale)
            if ctx.index_loss or ctx.topk_stats:
                indexer = self.indexer and self.indexer(x, q_resid, ctx.cos, ctx.sin)
                if ctx.index_loss:
                    stats["attn_p"] = p
                    if indexer:
                        stats["index_logits"] = index_scores(*indexer, q_seg, q_seg)
                if ctx.topk_stats:
                    vis = visible(q_seg, q_seg, jnp.arange(x.shape[1]))
                    stats["attn_topk"] = masked_topk(jnp.where(vis, p, -jnp.inf), cfg.index_topk)
                    if indexer:
                        stats["index_topk"] = index_topk(*indexer, q_seg, q_seg, cfg.index_topk, cfg.block_q)[0]
        elif ctx.mode in ("dense", "sparse"):
            q_abs = jnp.concatenate([jnp.einsum("bshd,chd->bshc", q_nope, w_uk), q_pe], axis=-1)  # [B,S,H,576]
            if ctx.mode == "dense":  # absorbed attention over every visible cache row (SPEC D.2)
                o_lat = dense_mla_absorbed(q_abs, latent, visible(q_seg, k_seg, q_idx), cfg.softmax_scale, r_kv)
            else:
                topk_fn, attend, gathered_scores = kernels(cfg.attention_impl)
                if self.indexer is not None:
                    qi, ki, wi = self.indexer(x, q_resid, ctx.cos, ctx.sin)
                    if cache is not None:
                        cache["index_k"] = write_rows(cache["index_k"], ki, ctx.q_idx[:, 0])
                        ki = cache["index_k"]
                    topk, _ = topk_fn(qi, ki, wi, q_seg, k_seg, cfg.index_topk, cfg.block_q, q_idx)
                o_lat, lse = attend(q_abs, latent, topk, scale=cfg.softmax_scale, kv_lora_rank=r_kv, block_q=cfg.block_q)
                if ctx.index_loss and cache is None:
                    stats["attn_p"] = sparse_attention_probs(q_abs, latent, topk, lse, scale=cfg.softmax_scale,
                                                             block_q=cfg.block_q)
                    if self.indexer is not None:
                        stats["index_logits"] = gathered_scores(qi, ki, wi, topk, cfg.block_q)
            o = jnp.einsum("bshc,chv->bshv", o_lat, w_uv)
        else:
            raise ValueError(f"attention mode {ctx.mode!r}: must be 'dense' or 'sparse'")
        return dense(o, self.o_proj[...], "bshv,hvd->bsd", dt), topk, stats, cache


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
