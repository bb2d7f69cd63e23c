"""Multi-head latent attention (docs/model.md B.4) with DeepSeek Sparse Attention (B.6-B.8): the layer.

`MLA.project` computes B.4 steps 1-6 (queries, the latent and its rope key); the attention itself is one of

    mode "dense":  causal MLA with per-head keys / values expanded from the latent (training, the dense warm-up);
                   against a cache (prefill / decode) absorbed attention over every visible cache row
    mode "sparse": the layer's indexer (or, on an IndexShare "shared" layer, the previous full layer's indices)
                   selects k keys per query; attention over those k rows of the 576-d latent in MQA form

whose plain formulas are latent_attention.py's `dense_mla` and `sparse_mla`. Which variant runs at a call's shapes
(materialised, blocked, head groups, chunks, context-parallel, kernels) is chosen by mla_paths.py, the one place of
those rules (printed at start-up), and computed by mla_variants.py.
"""
from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from glmjax.config import ModelConfig
from glmjax.model import mla_paths, mla_variants
from glmjax.model.backends import Backend
from glmjax.model.context import Layout
from glmjax.model.indexer import Indexer
from glmjax.model.latent_attention import AttnStats, Projected
from glmjax.model.layers import RMSNorm, apply_rope, dense, dtype_of, normal_param

__all__ = ["MLA", "Ctx", "AttnStats", "write_rows"]


class Ctx(NamedTuple):
    """Per-forward context shared by every layer: RoPE tables, packing segments, the attention mode and, when
    running against a cache (prefill / decode), where the new rows go and which cache slots hold keys."""
    cos: jax.Array  # [B,S,d_r/2]
    sin: jax.Array
    segment_ids: jax.Array  # [B,S] int32, 0 = padding
    mode: str  # "dense" | "sparse"
    q_idx: jax.Array | None = None  # [B,S] key slot of each query: a cache's new slots, or the context layout's
    # natural slots (None: arange(S))
    kv_valid: jax.Array | None = None  # [B,T] int32, 1 where the cache slot holds a key (after this write)
    index_loss: bool = False  # training with an indexer KL: layers return its inputs (attn_p, index_logits)
    topk_stats: bool = False  # diagnostics (dense mode): layers return attn_topk, full layers index_topk
    backend: Backend | None = None  # sparse-mode functions; None: BACKENDS[cfg.attention_impl]
    layout: Layout | None = None  # context parallelism: the sequence's layout (glmjax/model/context.py); with a
    # cache, the cache's (contiguous: shard i holds slots i*T/N..): queries local at q_idx, cache rows gathered
    cache_write: Callable | None = None  # (cache [B,T,C], rows [B,S,C], q_idx) -> cache; None: `write_rows`


class MLA(nnx.Module):
    def __init__(self, cfg: ModelConfig, has_indexer: bool, rngs: nnx.Rngs):
        self.cfg = cfg
        D, H = cfg.hidden_size, cfg.num_attention_heads
        r_q, r_kv, d_r = cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_rope_head_dim
        if r_q:  # the query LoRA: x -> q latent [r_q] -> RMSNorm -> per-head queries
            self.q_a_proj = normal_param(rngs, (D, r_q), ("embed", "q_lora"), cfg)
            self.q_a_layernorm = RMSNorm(r_q, cfg.latent_norm_eps, cfg)
            self.q_b_proj = normal_param(rngs, (r_q, H, cfg.qk_head_dim), ("q_lora", "heads", "head_dim"), cfg)
        else:  # q_lora_rank 0 (DeepSeek-V2-Lite): the queries straight from x
            self.q_proj = normal_param(rngs, (D, H, cfg.qk_head_dim), ("embed", "heads", "head_dim"), cfg)
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
        latent = jnp.concatenate([p.c_kv, p.k_pe], axis=-1)  # [B,S,576]: each token's cache row (docs/model.md D.1)
        if cache is not None:
            cache = dict(cache, latent=write_new_rows(ctx, cache["latent"], latent))
            latent = cache["latent"]
        path = self.path(ctx, p, cached=cache is not None)
        if ctx.mode == "sparse":  # output-projected by the variant (per chunk in sparse_chunks)
            return mla_variants.sparse(self, path, x, p, ctx, latent, topk, cache, write_new_rows)
        if cache is None:  # output-projected by the variant (per head group in head_groups)
            out, stats = mla_variants.dense_training(self, path, x, p, ctx)
            return out, topk, stats, cache
        return self.output(mla_variants.dense_cached(self, p, ctx, latent)), topk, AttnStats(), cache

    def path(self, ctx: Ctx, p: Projected, cached: bool) -> mla_paths.Path | None:
        """The variant this call runs (mla_paths.py's rules); None against a cache in dense mode, whose choice
        `mla_variants.absorbed_attention` makes from the shapes each context shard sees."""
        B, S, H = p.q_nope.shape[:3]
        if ctx.mode == "sparse":
            return mla_paths.sparse(S, H, cached)
        if cached:
            return None
        return mla_paths.dense_training(B, S, H, self.cfg.dense_attention_impl, ctx.layout is not None)

    def output(self, o, w_o=None):
        """o [B,S,H',d_v] -> [B,S,D] by the output projection (or its head slice w_o [H',d_v,D])."""
        return dense(o, self.o_proj[...] if w_o is None else w_o, "bshv,hvd->bsd", dtype_of(self.cfg.dtype))

    def w_q(self):
        """[r_q, H, d_qk] q_b_proj, or [D, H, d_qk] q_proj without a query LoRA: the per-head query weight that
        every path applies to the query input (`query_input`)."""
        return self.q_b_proj[...] if self.cfg.q_lora_rank else self.q_proj[...]

    def query_input(self, x):
        """x [B,S,D] (normed) -> the query input: the normed q latent [B,S,r_q], or x itself without a query LoRA."""
        if not self.cfg.q_lora_rank:
            return x
        return self.q_a_layernorm(dense(x, self.q_a_proj[...], "bsd,dr->bsr", dtype_of(self.cfg.dtype)))

    def queries(self, q_resid, cos, sin, w_q=None):
        """B.4 steps 3 and 6: the query input [B,S,r_q] (or x) -> q_nope [B,S,H,d_n], roped q_pe [B,S,H,d_r]
        (nope first, rope last); w_q: a head slice of `w_q()` (its heads only)."""
        q = dense(q_resid, self.w_q() if w_q is None else w_q, "bsr,rhd->bshd", dtype_of(self.cfg.dtype))
        d_n = self.cfg.qk_nope_head_dim
        return q[..., :d_n], apply_rope(q[..., d_n:], cos, sin, self.cfg.rope_interleave)

    def project(self, x, ctx: Ctx) -> Projected:
        """B.4 steps 1-6 and the up-projection's halves: x [B,S,D] (normed) -> Projected."""
        cfg, dt = self.cfg, dtype_of(self.cfg.dtype)
        d_n, r_kv = cfg.qk_nope_head_dim, cfg.kv_lora_rank
        q_resid = self.query_input(x)  # steps 1-2
        q_nope, q_pe = self.queries(q_resid, ctx.cos, ctx.sin)  # steps 3, 6
        ckv = dense(x, self.kv_a_proj_with_mqa[...], "bsd,dc->bsc", dt)  # step 4
        c_kv = self.kv_a_layernorm(ckv[..., :r_kv])  # step 5
        k_pe = apply_rope(ckv[..., r_kv:], ctx.cos, ctx.sin, cfg.rope_interleave)  # step 6
        w_kv = self.kv_b_proj[...].astype(dt)  # step 7's weights: W_UK | W_UV per head
        return Projected(q_resid, q_nope, q_pe, c_kv, k_pe, w_kv[..., :d_n], w_kv[..., d_n:])


def write_rows(cache, rows, start):
    """cache [B,T,C] with rows [B,S,C] written at slots start[b] .. start[b]+S-1."""
    return jax.vmap(lambda c, r, s: jax.lax.dynamic_update_slice_in_dim(c, r.astype(c.dtype), s, 0))(cache, rows, start)


def write_new_rows(ctx: Ctx, cache, rows):
    """cache [B,T,C] with this step's rows [B,S,C] written at their slots ctx.q_idx (by ctx.cache_write if set)."""
    if ctx.cache_write is None:
        return write_rows(cache, rows, ctx.q_idx[:, 0])
    return ctx.cache_write(cache, rows, ctx.q_idx)
