"""Multi-head latent attention (docs/model.md B.4) with DeepSeek Sparse Attention (B.6-B.8).

mode "dense":  plain causal MLA with per-head keys/values expanded from the latent (training, dense warm-up);
               against a cache (prefill / decode), absorbed attention over every visible cache row. Key ranges
               past a size run blocked (flash_attention.py, O(S) memory; the cost rule `materialise`), in training
               by JAX's splash kernel on TPU (`model.dense_attention_impl`, dense_kernels.py).
mode "sparse": the layer's indexer (or, on an IndexShare "shared" layer, the previous full layer's indices)
               selects k keys per query; attention gathers those k rows of the 576-d latent cache in MQA form;
               in training past SPARSE_CHUNK_ROWS in rematerialised sequence chunks (`MLA.sparse_chunked`).
"""
from __future__ import annotations

import functools
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from glmjax.config import ModelConfig
from glmjax.model import context
from glmjax.model.backends import BACKENDS, Backend
from glmjax.model.context import Layout, local_queries
from glmjax.model.flash_attention import flash_attention
from glmjax.model.index_loss import DenseTarget, dense_target, streaming_attention_topk
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
    q_idx: jax.Array | None = None  # [B,S] key slot of each query: a cache's new slots, or the context layout's
    # natural slots (None: arange(S))
    kv_valid: jax.Array | None = None  # [B,T] int32, 1 where the cache slot holds a key (after this write)
    index_loss: bool = False  # training with an indexer KL: layers return its inputs (attn_p, index_logits)
    topk_stats: bool = False  # diagnostics (dense mode): layers return attn_topk, full layers index_topk
    backend: Backend | None = None  # sparse-mode functions; None: BACKENDS[cfg.attention_impl]
    layout: Layout | None = None  # context parallelism: the sequence's layout (glmjax/model/context.py); with a
    # cache, the cache's (contiguous: shard i holds slots i*T/N..): queries local at q_idx, cache rows gathered
    cache_write: Callable | None = None  # (cache [B,T,C], rows [B,S,C], q_idx) -> cache; None: `write_rows`


class AttnStats(NamedTuple):
    """What an attention layer reports besides its output; None where its mode and the Ctx flags produce nothing.
    With ctx.index_loss a layer reports its indexer-loss inputs either materialised (attn_p, index_logits: sparse
    mode, and dense mode while `materialise`) or in the streamed form (attn_target, index_qkw: blocked dense)."""
    max_logit: jax.Array | None = None  # () largest attention logit, no gradient (dense training)
    attn_p: jax.Array | None = None  # head-mean attention probabilities, no gradient, [B,S,T] dense, [B,S,k] sparse
    index_logits: jax.Array | None = None  # full layers: index scores of the same keys, differentiable
    attn_topk: jax.Array | None = None  # ctx.topk_stats (dense): [B,S,k] top-k keys of the head-mean attention
    index_topk: jax.Array | None = None  # ctx.topk_stats (dense), full layers: [B,S,k] the indexer's top-k
    attn_target: DenseTarget | None = None  # dense, streamed: the attention to recompute per key block
    index_qkw: tuple | None = None  # dense, streamed, full layers: the indexer's (q, k, w), differentiable


class Projected(NamedTuple):
    """The query / latent projections of one layer call (RoPE applied) and the up-projection slices."""
    q_resid: jax.Array  # [B,S,r_q] (normed), or x [B,S,D] without a query LoRA: the query input (the indexer's too)
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
        if ctx.mode == "dense" and cache is None:
            out, stats = self.dense_training(x, p, ctx)  # output-projected itself (head groups at long S)
            return out, topk, stats, cache
        if ctx.mode == "sparse":
            out, topk, stats, cache = self.sparse(x, p, ctx, latent, topk, cache)  # output-projected itself
            return out, topk, stats, cache
        return self.output(self.dense_cached(p, ctx, latent)), topk, AttnStats(), cache

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

    def project(self, x, ctx: Ctx) -> Projected:
        cfg, dt = self.cfg, dtype_of(self.cfg.dtype)
        d_n, r_kv = cfg.qk_nope_head_dim, cfg.kv_lora_rank
        q_resid = self.query_input(x)
        q = dense(q_resid, self.w_q(), "bsr,rhd->bshd", dt)
        q_pe = apply_rope(q[..., d_n:], ctx.cos, ctx.sin, cfg.rope_interleave)  # nope first, rope last
        ckv = dense(x, self.kv_a_proj_with_mqa[...], "bsd,dc->bsc", dt)
        c_kv = self.kv_a_layernorm(ckv[..., :r_kv])
        k_pe = apply_rope(ckv[..., r_kv:], ctx.cos, ctx.sin, cfg.rope_interleave)
        w_kv = self.kv_b_proj[...].astype(dt)
        return Projected(q_resid, q[..., :d_n], q_pe, c_kv, k_pe, w_kv[..., :d_n], w_kv[..., d_n:])

    def dense_training(self, x, p: Projected, ctx: Ctx):
        """Causal MLA over this sequence with per-head keys/values -> out [B,S,D] (output-projected), AttnStats
        (max_logit; with ctx.index_loss attn_p and index_logits, or (blocked) attn_target and index_qkw; attn_topk
        and index_topk with ctx.topk_stats). Materialised while `materialise` (unless model.dense_attention_impl
        is "splash"), else blocked (flash_attention: the splash kernel or the XLA flash), in head groups past
        HEAD_GROUP_ROWS (`dense_grouped`)."""
        cfg, seg = self.cfg, ctx.segment_ids
        args = (p.q_nope, p.q_pe, p.c_kv, p.k_pe, p.w_uk, p.w_uv, seg, cfg.softmax_scale)
        B, S, H = p.q_nope.shape[:3]
        blocked = ctx.layout is not None or cfg.dense_attention_impl == "splash" or not materialise(B, H, S, S)
        if blocked and head_groups(S, H) > 1:
            out, max_logit, lse = self.dense_grouped(p, ctx, head_groups(S, H))
            target = training_target(*args[:5], lse, cfg.softmax_scale, cfg.block_q, ctx.layout)
        elif blocked:
            o, max_logit, target = dense_mla_blocked(*args, cfg.block_q, ctx.q_idx, ctx.layout,
                                                     cfg.dense_attention_impl)
            out = self.output(o)
        else:
            o, max_logit, attn_p = dense_mla(*args)
            out = self.output(o)
        if not (ctx.index_loss or ctx.topk_stats):
            return out, AttnStats(max_logit)
        qkw = None if self.indexer is None else self.indexer(x, p.q_resid, ctx.cos, ctx.sin)
        stats = AttnStats(max_logit)
        if ctx.index_loss and blocked:
            stats = stats._replace(attn_target=target, index_qkw=qkw)
        elif ctx.index_loss:
            stats = stats._replace(attn_p=attn_p, index_logits=None if qkw is None else index_scores(*qkw, seg, seg))
        if ctx.topk_stats:
            if blocked:
                attn_topk = local_queries(ctx.layout, streaming_attention_topk,
                                          (context.target_axes(target), context.IQ, None, context.K, context.IQ),
                                          (context.IQ,))(target, seg, cfg.index_topk, seg, ctx.q_idx)
            else:
                attn_topk = masked_topk(jnp.where(visible(seg, seg, jnp.arange(x.shape[1])), attn_p, -jnp.inf),
                                        cfg.index_topk)
            stats = stats._replace(
                attn_topk=attn_topk,
                index_topk=None if qkw is None else local_queries(ctx.layout, index_topk, *context.INDEX_TOPK)(
                    *qkw, seg, seg, cfg.index_topk, cfg.block_q, ctx.q_idx)[0])
        return out, stats

    def dense_grouped(self, p: Projected, ctx: Ctx, groups: int):
        """Blocked causal MLA, output-projected, with the heads in `groups` groups: one rematerialised step per
        group forms the group's queries from q_resid, its keys / values from the latent, attends and adds its
        output projection, so per-head [B,S,H/groups,.] tensors (and their gradients) exist for one group at a
        time; the backward redoes each group's step. -> out [B,S,D], max logit (no gradient), lse [B,S,H] f32."""
        cfg, dt = self.cfg, dtype_of(self.cfg.dtype)
        d_n, hg = cfg.qk_nope_head_dim, cfg.num_attention_heads // groups
        w_q, w_o = self.w_q(), self.o_proj[...]
        heads = lambda a, i, axis: jax.lax.dynamic_slice_in_dim(a, i * hg, hg, axis=axis)  # noqa: E731

        @jax.checkpoint  # saves only its input i (the rest is loop-invariant)
        def group(i):
            q = dense(p.q_resid, heads(w_q, i, 1), "bsr,rhd->bshd", dt)
            q_pe = apply_rope(q[..., d_n:], ctx.cos, ctx.sin, cfg.rope_interleave)
            o, max_logit, target = dense_mla_blocked(q[..., :d_n], q_pe, p.c_kv, p.k_pe, heads(p.w_uk, i, 1),
                                                     heads(p.w_uv, i, 1), ctx.segment_ids, cfg.softmax_scale,
                                                     cfg.block_q, ctx.q_idx, ctx.layout, cfg.dense_attention_impl)
            return self.output(o, heads(w_o, i, 0)).astype(jnp.float32), (max_logit, target.lse)

        def step(acc, i):
            out, stats = group(i)
            return acc + out, stats

        B, S = p.q_resid.shape[:2]
        acc, (max_logit, lse) = jax.lax.scan(step, jnp.zeros((B, S, cfg.hidden_size), jnp.float32),
                                             jnp.arange(groups))
        return acc.astype(dt), jnp.max(max_logit), jnp.moveaxis(lse, 0, 2).reshape(B, S, -1)

    def dense_cached(self, p: Projected, ctx: Ctx, latent):
        """Absorbed attention over every visible row of the cache latent [B,T,576] -> o [B,S,H,d_v]
        (`absorbed_attention`; with ctx.layout each context shard's queries against the gathered cache rows)."""
        cfg = self.cfg
        o_lat = local_queries(ctx.layout, absorbed_attention, *ABSORBED)(
            absorb(p.q_nope, p.q_pe, p.w_uk), latent, ctx.segment_ids, ctx.kv_valid, ctx.q_idx, cfg.softmax_scale,
            cfg.kv_lora_rank, cfg.block_q)
        return jnp.einsum("bshc,chv->bshv", o_lat, p.w_uv)

    def sparse(self, x, p: Projected, ctx: Ctx, latent, topk, cache):
        """Sparse attention over the latent rows [B,T,576] (this sequence, or the cache) that the layer's indexer
        selects (or, on a shared layer, topk) -> out [B,S,D] (output-projected), topk used, AttnStats (attn_p and
        index_logits with ctx.index_loss, without a cache), cache (index keys written on full layers). In training
        past SPARSE_CHUNK_ROWS the attention runs in rematerialised sequence chunks (`sparse_chunked`)."""
        cfg, q_seg = self.cfg, ctx.segment_ids
        k_seg, q_idx = (q_seg if cache is None else ctx.kv_valid), ctx.q_idx
        on_context = functools.partial(local_queries, ctx.layout)  # local queries, gathered keys (no cache)
        fns = BACKENDS[cfg.attention_impl] if ctx.backend is None else ctx.backend
        if self.indexer is not None:
            qi, ki, wi = self.indexer(x, p.q_resid, ctx.cos, ctx.sin)
            if cache is not None:
                cache = dict(cache, index_k=write_new_rows(ctx, cache["index_k"], ki))
                ki = cache["index_k"]
            topk, _ = on_context(fns.index_topk, *context.INDEX_TOPK)(qi, ki, wi, q_seg, k_seg, cfg.index_topk,
                                                                      cfg.block_q, q_idx)
        with_p = ctx.index_loss and cache is None
        chunk = sparse_chunk(*p.q_nope.shape[1:3]) if cache is None else None
        if chunk is not None:
            out, attn_p = self.sparse_chunked(p, ctx, latent, topk, fns.sparse_mla, chunk, with_p)
        else:
            q_abs = absorb(p.q_nope, p.q_pe, p.w_uk)
            o_lat, lse = on_context(fns.sparse_mla, *context.SPARSE_MLA)(
                q_abs, latent, topk, scale=cfg.softmax_scale, kv_lora_rank=cfg.kv_lora_rank, block_q=cfg.block_q)
            out = self.output(jnp.einsum("bshc,chv->bshv", o_lat, p.w_uv))
            attn_p = None if not with_p else on_context(sparse_attention_probs, *context.SPARSE_PROBS)(
                q_abs, latent, topk, lse, scale=cfg.softmax_scale, block_q=cfg.block_q)
        if not with_p:
            return out, topk, AttnStats(), cache
        index_logits = None if self.indexer is None else on_context(
            fns.gathered_index_logits, *context.GATHERED_INDEX_LOGITS)(qi, ki, wi, topk, cfg.block_q)
        return out, topk, AttnStats(attn_p=attn_p, index_logits=index_logits), cache

    def sparse_chunked(self, p: Projected, ctx: Ctx, latent, topk, sparse_mla, chunk: int, with_p: bool):
        """Sparse attention of this sequence's queries over its latent rows [B,S,576] in rematerialised chunks of
        `chunk` queries (`map_chunks`): each chunk forms its queries from q_resid, their absorbed form, attends
        with its rows of topk [B,S,k] over the whole latent and projects its output (W_UV, o_proj), so per-head
        [B,chunk,H,.] tensors (and their gradients) exist for one chunk at a time and each query's k rows are
        gathered once per pass; the backward redoes each chunk's forward. Under context parallelism each shard
        loops over its own queries (`local_queries`; the queries split like the indexer's, over context x tensor,
        every head on each rank). -> out [B,S,D], attn_p [B,S,k] f32 (head mean, no gradient; None unless with_p)."""
        cfg, dt = self.cfg, dtype_of(self.cfg.dtype)
        d_n = cfg.qk_nope_head_dim

        def attend(q_resid, cos, sin, idx, latent, w_q, w_uk, w_uv, w_o):  # one chunk: [B,c,...] -> [B,c,D], [B,c,k]
            q = dense(q_resid, w_q, "bsr,rhd->bshd", dt)
            q_pe = apply_rope(q[..., d_n:], cos, sin, cfg.rope_interleave)
            q_abs = jnp.concatenate([jnp.einsum("bshd,chd->bshc", q[..., :d_n], w_uk), q_pe], axis=-1)
            o_lat, lse = sparse_mla(q_abs, latent, idx, scale=cfg.softmax_scale, kv_lora_rank=cfg.kv_lora_rank,
                                    block_q=cfg.block_q)
            out = self.output(jnp.einsum("bshc,chv->bshv", o_lat, w_uv), w_o)
            if not with_p:
                return (out,)
            return out, sparse_attention_probs(q_abs, latent, idx, lse, scale=cfg.softmax_scale, block_q=cfg.block_q)

        def chunks(q_resid, cos, sin, idx, latent, *weights):
            return map_chunks(attend, (q_resid, cos, sin, idx), (latent,) + weights, chunk)

        in_axes = (context.IQ,) * 4 + (context.K,) + ((),) * 4
        outs = local_queries(ctx.layout, chunks, in_axes, (context.IQ,) * (2 if with_p else 1))(
            p.q_resid, ctx.cos, ctx.sin, topk, latent, self.w_q(), p.w_uk, p.w_uv, self.o_proj[...])
        return outs[0], outs[1] if with_p else None


def write_rows(cache, rows, start):
    """cache [B,T,C] with rows [B,S,C] written at slots start[b] .. start[b]+S-1."""
    return jax.vmap(lambda c, r, s: jax.lax.dynamic_update_slice_in_dim(c, r.astype(c.dtype), s, 0))(cache, rows, start)


def write_new_rows(ctx: Ctx, cache, rows):
    """cache [B,T,C] with this step's rows [B,S,C] written at their slots ctx.q_idx (by ctx.cache_write if set)."""
    if ctx.cache_write is None:
        return write_rows(cache, rows, ctx.q_idx[:, 0])
    return ctx.cache_write(cache, rows, ctx.q_idx)


MATERIALISE_MAX_SCORES = 2 ** 24  # [B,H,S,T] scores (64 MiB in f32) up to which dense attention materialises them


def materialise(B: int, H: int, S: int, T: int) -> bool:
    """The cost rule of dense attention: while the [B,H,S,T] scores stay small (<= MATERIALISE_MAX_SCORES) the
    materialised path (exact, one fused softmax, the fastest at short lengths; every test-size model and the tiny
    recipe), beyond it the blocked (flash) path in blocks of `model.block_q`, O(S) memory. GLM-5 (H 64, batch 1):
    materialised up to S = T = 512 in training, decode (S = 1) up to T = 262,144."""
    return B * H * S * T <= MATERIALISE_MAX_SCORES


SPARSE_CHUNK_ROWS = 2 ** 18  # S·H up to which sparse training attention takes the whole sequence at once


def sparse_chunk(S: int, H: int) -> int | None:
    """Queries per rematerialised chunk of sparse training attention (`MLA.sparse_chunked`): None (the whole
    sequence at once) while S·H <= SPARSE_CHUNK_ROWS, else c = SPARSE_CHUNK_ROWS // H, or the largest divisor of S
    in [c/2, c] if there is one: whole chunks only, so `map_chunks` needs no remainder call, whose concatenation
    copies the [B,S,D] output (2.3 GiB more at GLM-5's 202,752 with c = 4096; it takes 3168). GLM-5 (H 64): chunks
    of 2048-4096 queries past S = 4096; the tiny recipe (H 4) is never chunked up to S = 65,536."""
    if S * H <= SPARSE_CHUNK_ROWS:
        return None
    c = max(1, SPARSE_CHUNK_ROWS // H)
    return next((d for d in range(c, (c + 1) // 2 - 1, -1) if S % d == 0), c)


def map_chunks(fn, per_query, shared, chunk: int):
    """fn(*per_query chunk [B,c,...], *shared) -> tuple of [B,c,...], applied to `chunk` positions at a time, each
    application rematerialised (it saves only its start; the backward redoes it): a lax.scan over the whole chunks,
    one more call for the remainder (S not a multiple of chunk). per_query [B,S,...] -> tuple of [B,S,...]."""
    S = per_query[0].shape[1]
    n, r = divmod(S, chunk)
    outs = []
    if n:
        @jax.checkpoint
        def step(start):
            return fn(*(jax.lax.dynamic_slice_in_dim(a, start, chunk, axis=1) for a in per_query), *shared)

        ys = jax.lax.scan(lambda _, start: (None, step(start)), None, jnp.arange(n) * chunk)[1]  # [n,B,c,...]
        outs.append([jnp.moveaxis(y, 0, 1).reshape((y.shape[1], n * chunk) + y.shape[3:]) for y in ys])
    if r:
        outs.append(jax.checkpoint(fn)(*(a[:, n * chunk:] for a in per_query), *shared))
    return tuple(parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=1) for parts in zip(*outs))


ABSORBED = ((context.QH, context.K, context.Q, context.K, context.Q, None, None, None), (context.QH,))


def absorbed_attention(q_abs, latent, q_seg, kv_valid, q_idx, scale, r_kv, block: int):
    """Absorbed queries [B,S,H,576] over the visible latent rows [B,T,576] -> [B,S,H,r_kv]: materialised while
    `materialise`, else blocked (flash, MQA form). On a cache split over context (decode, glmjax/infer/decode.py)
    always materialised: [B,H,S,T/context] scores per device, which XLA splits with the cache (a loop over key
    blocks would gather it)."""
    if context.context_size() > 1 or materialise(*q_abs.shape[:3], latent.shape[1]):
        return dense_mla_absorbed(q_abs, latent, visible(q_seg, kv_valid, q_idx), scale, r_kv)
    return dense_mla_absorbed_blocked(q_abs, latent, q_seg, kv_valid, q_idx, scale, r_kv, block)


def dense_mla_absorbed(q_abs, latent, vis, scale, r_kv):
    """MQA-form attention of absorbed queries [B,S,H,576] over all visible latent rows [B,T,576] -> [B,S,H,r_kv].
    Builds [B,H,S,T]: the materialised reference of `dense_mla_absorbed_blocked`."""
    s = jnp.einsum("bshc,btc->bhst", q_abs, latent, preferred_element_type=f32) * scale
    p = jax.nn.softmax(jnp.where(vis[:, None], s, -jnp.inf), axis=-1)
    return jnp.einsum("bhst,btr->bshr", p.astype(latent.dtype), latent[..., :r_kv])


def dense_mla_absorbed_blocked(q_abs, latent, q_seg, kv_valid, q_idx, scale, r_kv, block: int):
    """`dense_mla_absorbed` with the visibility of `visible(q_seg, kv_valid, q_idx)` by flash attention: the latent
    rows are the keys and their first r_kv columns the values, shared by the heads -> [B,S,H,r_kv]."""
    q_idx = jnp.broadcast_to(q_idx, q_seg.shape)
    return flash_attention(q_abs, latent, latent[..., :r_kv], q_seg, kv_valid, q_idx, scale, block, block)[0]


def expand_kv(q_nope, q_pe, c_kv, k_pe, w_uk, w_uv):
    """Per-head queries [q_nope | q_pe] [B,S,H,d_n+d_r], keys [k_nope | k_pe] [B,T,H,d_n+d_r] (k_pe broadcast over
    heads) and values [B,T,H,d_v] from the latent (docs/model.md B.4 steps 7-8)."""
    k_nope = jnp.einsum("btc,chd->bthd", c_kv, w_uk)
    v = jnp.einsum("btc,chv->bthv", c_kv, w_uv)
    k_pe = jnp.broadcast_to(k_pe[:, :, None, :], k_nope.shape[:3] + k_pe.shape[-1:]).astype(k_nope.dtype)
    return jnp.concatenate([q_nope, q_pe], axis=-1), jnp.concatenate([k_nope, k_pe], axis=-1), v


HEAD_GROUP_ROWS = 2 ** 20  # S·(heads per group) up to which blocked training attention takes all heads at once


def head_groups(S: int, H: int) -> int:
    """Number of head groups of blocked training attention (`MLA.dense_grouped`): the fewest (a divisor of H) with
    S·H/groups <= HEAD_GROUP_ROWS. GLM-5 (H 64): 1 up to S = 16K, 4 at 64K, 8 at 128K, 16 at 202,752."""
    return next(g for g in range(1, H + 1) if H % g == 0 and (S * H // g <= HEAD_GROUP_ROWS or g == H))


def dense_mla_blocked(q_nope, q_pe, c_kv, k_pe, w_uk, w_uv, segment_ids, scale, block: int, q_idx=None,
                      layout: Layout | None = None, impl: str = "auto"):
    """`dense_mla` by flash attention in query and key blocks of `block`, O(S) memory forward and backward
    -> out [B,S,H,d_v], max logit (scalar, no gradient), DenseTarget (what the streamed indexer loss and top-k
    recompute the head-mean probabilities from). q_idx [B,S]: the key slot of each query (None: self-attention,
    slot = position in the row); layout: context parallelism (local queries, the latent rows gathered,
    `context.local_queries`); impl: `dense_kernels.DENSE_IMPLS` (explicit slots run the XLA flash)."""
    if layout is None:
        q, k, v = expand_kv(q_nope, q_pe, c_kv, k_pe, w_uk, w_uv)
        out, lse, row_max = flash_attention(q, k, v, segment_ids, segment_ids, q_idx, scale, block, block, impl)
        target = dense_target(q, k, lse, scale, block)
    else:  # each context shard gathers the latent rows (576 wide), not H x (d_qk + d_v) keys and values
        out, lse, row_max = local_queries(layout, flash_from_latent, *context.LATENT_FLASH)(
            q_nope, q_pe, c_kv, k_pe, w_uk, w_uv, segment_ids, segment_ids, q_idx, scale, block)
        target = training_target(q_nope, q_pe, c_kv, k_pe, w_uk, lse, scale, block, layout)
    return out, jax.lax.stop_gradient(jnp.max(row_max)), target


def training_target(q_nope, q_pe, c_kv, k_pe, w_uk, lse, scale: float, block: int, layout: Layout | None):
    """The dense attention's DenseTarget (no gradient) from the projections and the flash lse [B,S,H]. One device:
    per-head queries and keys (`expand_kv`). Context parallelism: in the absorbed form (docs/model.md D.2) --
    queries [q_nope . W_UK | q_pe] [B,S,H,576] against the latent rows [c_kv | k_pe] [B,T,576] shared by the heads,
    the same scores -- because the streamed losses gather the keys of the whole sequence onto every context shard:
    576 values per key instead of H x 256 (GLM-5 at 202,752 tokens, 7 rows a shard: 1.6 GB instead of 46 GB);
    the price is 576 instead of 256 multiply-adds per query-key pair and head in the target's recomputation."""
    q_nope, q_pe, c_kv, k_pe, w_uk = map(jax.lax.stop_gradient, (q_nope, q_pe, c_kv, k_pe, w_uk))
    if layout is None:
        q, k, _ = expand_kv(q_nope, q_pe, c_kv, k_pe, w_uk, w_uk)  # (the values are not used)
        return dense_target(q, k, lse, scale, block)
    return dense_target(absorb(q_nope, q_pe, w_uk), jnp.concatenate([c_kv, k_pe], axis=-1), lse, scale, block)


def absorb(q_nope, q_pe, w_uk):
    """[q_nope . W_UK | q_pe] [B,S,H,r_kv+d_r]: queries against the latent rows in MQA form (docs/model.md D.2)."""
    return jnp.concatenate([jnp.einsum("bshd,chd->bshc", q_nope, w_uk), q_pe], axis=-1)


def flash_from_latent(q_nope, q_pe, c_kv, k_pe, w_uk, w_uv, q_seg, k_seg, q_idx, scale, block: int):
    """flash_attention of the per-head queries against keys / values expanded here from the latent rows
    c_kv [B,T,r_kv], k_pe [B,T,d_r] (`expand_kv`) -> (out [B,S,H,d_v], lse, row max)."""
    q, k, v = expand_kv(q_nope, q_pe, c_kv, k_pe, w_uk, w_uv)
    return flash_attention(q, k, v, q_seg, k_seg, q_idx, scale, block, block)


def dense_mla(q_nope, q_pe, c_kv, k_pe, w_uk, w_uv, segment_ids, scale):
    """Causal MLA with keys/values expanded per head -> out [B,S,H,d_v], max logit (scalar, no gradient), head-mean
    probabilities [B,S,T] (no gradient; unused outputs cost nothing under jit). Builds [B,H,S,T]: the materialised
    path and the reference of `dense_mla_blocked`."""
    k_nope = jnp.einsum("btc,chd->bthd", c_kv, w_uk)
    v = jnp.einsum("btc,chv->bthv", c_kv, w_uv)
    logits = jnp.einsum("bshd,bthd->bhst", q_nope, k_nope, preferred_element_type=f32)
    logits = (logits + jnp.einsum("bshr,btr->bhst", q_pe, k_pe, preferred_element_type=f32)) * scale
    S = q_nope.shape[1]
    logits = jnp.where(visible(segment_ids, segment_ids, jnp.arange(S))[:, None], logits, -jnp.inf)
    p = jax.nn.softmax(logits, axis=-1)
    out = jnp.einsum("bhst,bthv->bshv", p.astype(v.dtype), v)
    return out, jax.lax.stop_gradient(jnp.max(logits)), jax.lax.stop_gradient(jnp.mean(p, axis=1))
