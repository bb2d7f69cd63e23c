"""The variants of MLA's attention that run where the plain paths (latent_attention.py) would not fit, each equal to
its plain path within float tolerance (tests/test_mla_paths.py); mla_paths.py chooses among them.

    dense, training  materialised (the plain `dense_mla`), blocked (flash attention over per-head keys expanded
                     from the latent: splash kernel or XLA flash), head_groups (blocked, one rematerialised step per
                     group of heads from q_resid through the output projection)
    dense, cached    absorbed / absorbed_blocked: MQA over the cache's latent rows, values their first r_kv columns
    sparse           the backend's indexer top-k and sparse MLA (glmjax/model/backends.py) over the whole sequence,
                     or in rematerialised query chunks (`sparse_chunked`)
Context parallelism wraps each in `context.local_queries` (local queries, key rows gathered): per-head keys are
expanded on each shard from the gathered 576-wide latent rows, not gathered themselves.

The entry points (`dense_training`, `dense_cached`, `sparse`) and the functions they call with the layer take the
layer itself (`glmjax.model.mla.MLA`: its weights, `queries`, `output`) and the call's `Ctx`.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from glmjax.model import context, mla_paths
from glmjax.model.backends import BACKENDS
from glmjax.model.context import Layout, local_queries
from glmjax.model.flash_attention import flash_attention
from glmjax.model.index_loss import DenseTarget, dense_target, streaming_attention_topk
from glmjax.model.indexer import index_scores, index_topk, masked_topk, visible
from glmjax.model.latent_attention import AttnStats, Projected, absorb, dense_mla, expand_kv
from glmjax.model.layers import dtype_of, f32
from glmjax.model.sparse_attention import sparse_attention_probs


def dense_training(layer, path: mla_paths.Path, x, p: Projected, ctx):
    """Causal MLA over this sequence by `path` -> out [B,S,D] (output-projected), AttnStats (max_logit; with
    ctx.index_loss attn_p and index_logits, or when blocked attn_target and index_qkw; attn_topk and index_topk
    with ctx.topk_stats)."""
    cfg, seg = layer.cfg, ctx.segment_ids
    args = (p.q_nope, p.q_pe, p.c_kv, p.k_pe, p.w_uk, p.w_uv, seg, cfg.softmax_scale)
    attn_p = target = None
    if path.kind == "head_groups":
        out, max_logit, lse = dense_grouped(layer, p, ctx, path.groups)
        target = training_target(*args[:5], lse, cfg.softmax_scale, cfg.block_q, ctx.layout)
    elif path.kind == "blocked":
        o, max_logit, target = dense_blocked(*args, cfg.block_q, ctx.q_idx, ctx.layout, cfg.dense_attention_impl)
        out = layer.output(o)
    elif path.kind == "materialised":
        o, max_logit, attn_p = dense_mla(*args)
        out = layer.output(o)
    else:
        raise ValueError(f"dense training attention: no variant {path.kind!r}")
    if not (ctx.index_loss or ctx.topk_stats):
        return out, AttnStats(max_logit)
    return out, dense_stats(layer, x, p, ctx, AttnStats(max_logit), attn_p, target)


def dense_stats(layer, x, p: Projected, ctx, stats: AttnStats, attn_p, target: DenseTarget | None) -> AttnStats:
    """The indexer-loss inputs (ctx.index_loss) and top-k diagnostics (ctx.topk_stats) of a dense training call,
    from its head-mean probabilities attn_p [B,S,T] (materialised) or its streamed target (blocked)."""
    cfg, seg = layer.cfg, ctx.segment_ids
    blocked = target is not None
    qkw = None if layer.indexer is None else layer.indexer(x, p.q_resid, ctx.cos, ctx.sin)
    if ctx.index_loss and blocked:
        stats = stats._replace(attn_target=target, index_qkw=qkw)
    elif ctx.index_loss:
        stats = stats._replace(attn_p=attn_p, index_logits=None if qkw is None else index_scores(*qkw, seg, seg))
    if not ctx.topk_stats:
        return stats
    if blocked:
        attn_topk = local_queries(ctx.layout, streaming_attention_topk,
                                  (context.target_axes(target), context.IQ, None, context.K, context.IQ),
                                  (context.IQ,))(target, seg, cfg.index_topk, seg, ctx.q_idx)
    else:
        attn_topk = masked_topk(jnp.where(visible(seg, seg, jnp.arange(x.shape[1])), attn_p, -jnp.inf),
                                cfg.index_topk)
    return stats._replace(
        attn_topk=attn_topk,
        index_topk=None if qkw is None else local_queries(ctx.layout, index_topk, *context.INDEX_TOPK)(
            *qkw, seg, seg, cfg.index_topk, cfg.block_q, ctx.q_idx)[0])


def dense_grouped(layer, p: Projected, ctx, groups: int):
    """Blocked causal MLA, output-projected, with the heads in `groups` groups: one rematerialised step per group
    forms the group's queries from q_resid, its keys / values from the latent, attends and adds its output
    projection, so per-head [B,S,H/groups,.] tensors (and their gradients) exist for one group at a time; the
    backward redoes each group's step. -> out [B,S,D], max logit (no gradient), lse [B,S,H] f32."""
    cfg, dt = layer.cfg, dtype_of(layer.cfg.dtype)
    hg = cfg.num_attention_heads // groups
    w_q, w_o = layer.w_q(), layer.o_proj[...]
    heads = lambda a, i, axis: jax.lax.dynamic_slice_in_dim(a, i * hg, hg, axis=axis)  # noqa: E731

    @jax.checkpoint  # saves only its input i (the rest is loop-invariant)
    def group(i):
        q_nope, q_pe = layer.queries(p.q_resid, ctx.cos, ctx.sin, heads(w_q, i, 1))
        o, max_logit, target = dense_blocked(q_nope, q_pe, p.c_kv, p.k_pe, heads(p.w_uk, i, 1),
                                             heads(p.w_uv, i, 1), ctx.segment_ids, cfg.softmax_scale, cfg.block_q,
                                             ctx.q_idx, ctx.layout, cfg.dense_attention_impl)
        return layer.output(o, heads(w_o, i, 0)).astype(jnp.float32), (max_logit, target.lse)

    def step(acc, i):
        out, stats = group(i)
        return acc + out, stats

    B, S = p.q_resid.shape[:2]
    acc, (max_logit, lse) = jax.lax.scan(step, jnp.zeros((B, S, cfg.hidden_size), jnp.float32), jnp.arange(groups))
    return acc.astype(dt), jnp.max(max_logit), jnp.moveaxis(lse, 0, 2).reshape(B, S, -1)


def dense_blocked(q_nope, q_pe, c_kv, k_pe, w_uk, w_uv, segment_ids, scale, block: int, q_idx=None,
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
    queries [q_nope . W_UK | q_pe] [B,S,H,576] against the latent rows [c_kv | k_pe] [B,T,576] shared by the
    heads, the same scores -- because the streamed losses gather the keys of the whole sequence onto every context
    shard: 576 values per key instead of H x d_qk, at the price of 576 instead of d_qk multiply-adds per
    query-key pair and head in the target's recomputation (memory: docs/benchmarks.md, long context)."""
    q_nope, q_pe, c_kv, k_pe, w_uk = map(jax.lax.stop_gradient, (q_nope, q_pe, c_kv, k_pe, w_uk))
    if layout is None:
        q, k, _ = expand_kv(q_nope, q_pe, c_kv, k_pe, w_uk, w_uk)  # (the values are not used)
        return dense_target(q, k, lse, scale, block)
    return dense_target(absorb(q_nope, q_pe, w_uk), jnp.concatenate([c_kv, k_pe], axis=-1), lse, scale, block)


def flash_from_latent(q_nope, q_pe, c_kv, k_pe, w_uk, w_uv, q_seg, k_seg, q_idx, scale, block: int):
    """flash_attention of the per-head queries against keys / values expanded here from the latent rows
    c_kv [B,T,r_kv], k_pe [B,T,d_r] (`expand_kv`) -> (out [B,S,H,d_v], lse, row max)."""
    q, k, v = expand_kv(q_nope, q_pe, c_kv, k_pe, w_uk, w_uv)
    return flash_attention(q, k, v, q_seg, k_seg, q_idx, scale, block, block)


ABSORBED = ((context.QH, context.K, context.Q, context.K, context.Q, None, None, None), (context.QH,))


def dense_cached(layer, p: Projected, ctx, latent):
    """Absorbed attention over every visible row of the cache latent [B,T,576] -> o [B,S,H,d_v]
    (`absorbed_attention`; with ctx.layout each context shard's queries against the gathered cache rows)."""
    cfg = layer.cfg
    o_lat = local_queries(ctx.layout, absorbed_attention, *ABSORBED)(
        absorb(p.q_nope, p.q_pe, p.w_uk), latent, ctx.segment_ids, ctx.kv_valid, ctx.q_idx, cfg.softmax_scale,
        cfg.kv_lora_rank, cfg.block_q)
    return jnp.einsum("bshc,chv->bshv", o_lat, p.w_uv)


def absorbed_attention(q_abs, latent, q_seg, kv_valid, q_idx, scale, r_kv, block: int):
    """Absorbed queries [B,S,H,576] over the visible latent rows [B,T,576] -> [B,S,H,r_kv], by the path
    `mla_paths.dense_cached` chooses for the shapes seen here (each context shard's, under ctx.layout)."""
    path = mla_paths.dense_cached(*q_abs.shape[:3], latent.shape[1], split_cache=context.context_size() > 1)
    if path.kind == "absorbed":
        return dense_mla_absorbed(q_abs, latent, visible(q_seg, kv_valid, q_idx), scale, r_kv)
    if path.kind != "absorbed_blocked":
        raise ValueError(f"cached dense attention: no variant {path.kind!r}")
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


def sparse(layer, path: mla_paths.Path, x, p: Projected, ctx, latent, topk, cache, write):
    """Sparse attention over the latent rows [B,T,576] (this sequence, or the cache) that the layer's indexer
    selects (or, on a shared layer, topk) -> out [B,S,D] (output-projected), topk used, AttnStats (attn_p and
    index_logits with ctx.index_loss, without a cache), cache (index keys written on full layers by `write`)."""
    cfg, q_seg = layer.cfg, ctx.segment_ids
    k_seg, q_idx = (q_seg if cache is None else ctx.kv_valid), ctx.q_idx
    on_context = lambda fn, axes: local_queries(ctx.layout, fn, *axes)  # noqa: E731 (local queries, gathered keys)
    fns = BACKENDS[cfg.attention_impl] if ctx.backend is None else ctx.backend
    if layer.indexer is not None:
        qi, ki, wi = layer.indexer(x, p.q_resid, ctx.cos, ctx.sin)
        if cache is not None:
            cache = dict(cache, index_k=write(ctx, cache["index_k"], ki))
            ki = cache["index_k"]
        topk, _ = on_context(fns.index_topk, context.INDEX_TOPK)(qi, ki, wi, q_seg, k_seg, cfg.index_topk,
                                                                 cfg.block_q, q_idx)
    with_p = ctx.index_loss and cache is None
    if path.kind == "sparse_chunks":
        out, attn_p = sparse_chunked(layer, p, ctx, latent, topk, fns.sparse_mla, path.chunk, with_p)
    elif path.kind == "sparse":  # the backend's sparse_mla: absorbed queries in, the latent-space output out
        q_abs = absorb(p.q_nope, p.q_pe, p.w_uk)
        o_lat, lse = on_context(fns.sparse_mla, context.SPARSE_MLA)(
            q_abs, latent, topk, scale=cfg.softmax_scale, kv_lora_rank=cfg.kv_lora_rank, block_q=cfg.block_q)
        out = layer.output(jnp.einsum("bshc,chv->bshv", o_lat, p.w_uv))
        attn_p = None if not with_p else on_context(sparse_attention_probs, context.SPARSE_PROBS)(
            q_abs, latent, topk, lse, scale=cfg.softmax_scale, block_q=cfg.block_q)
    else:
        raise ValueError(f"sparse attention: no variant {path.kind!r}")
    if not with_p:
        return out, topk, AttnStats(), cache
    index_logits = None if layer.indexer is None else on_context(
        fns.gathered_index_logits, context.GATHERED_INDEX_LOGITS)(qi, ki, wi, topk, cfg.block_q)
    return out, topk, AttnStats(attn_p=attn_p, index_logits=index_logits), cache


def sparse_chunked(layer, p: Projected, ctx, latent, topk, sparse_mla, chunk: int, with_p: bool):
    """Sparse attention of this sequence's queries over its latent rows [B,S,576] in rematerialised chunks of
    `chunk` queries (`map_chunks`): each chunk forms its queries from q_resid, their absorbed form, attends with
    its rows of topk [B,S,k] over the whole latent and projects its output (W_UV, o_proj), so per-head
    [B,chunk,H,.] tensors (and their gradients) exist for one chunk at a time; the backward redoes each chunk's
    forward. Under context parallelism each shard loops over its own queries (`local_queries`; the queries split
    like the indexer's, over context x tensor, every head on each rank). -> out [B,S,D], attn_p [B,S,k] f32 (head
    mean, no gradient; None unless with_p)."""
    cfg = layer.cfg

    def attend(q_resid, cos, sin, idx, latent, w_q, w_uk, w_uv, w_o):  # one chunk: [B,c,...] -> [B,c,D], [B,c,k]
        q_abs = absorb(*layer.queries(q_resid, cos, sin, w_q), w_uk)
        o_lat, lse = sparse_mla(q_abs, latent, idx, scale=cfg.softmax_scale, kv_lora_rank=cfg.kv_lora_rank,
                                block_q=cfg.block_q)
        out = layer.output(jnp.einsum("bshc,chv->bshv", o_lat, w_uv), w_o)
        if not with_p:
            return (out,)
        return out, sparse_attention_probs(q_abs, latent, idx, lse, scale=cfg.softmax_scale, block_q=cfg.block_q)

    def chunks(q_resid, cos, sin, idx, latent, *weights):
        return map_chunks(attend, (q_resid, cos, sin, idx), (latent,) + weights, chunk)

    in_axes = (context.IQ,) * 4 + (context.K,) + ((),) * 4
    outs = local_queries(ctx.layout, chunks, in_axes, (context.IQ,) * (2 if with_p else 1))(
        p.q_resid, ctx.cos, ctx.sin, topk, latent, layer.w_q(), p.w_uk, p.w_uv, layer.o_proj[...])
    return outs[0], outs[1] if with_p else None


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
