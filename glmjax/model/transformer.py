"""The GLM-5 decoder: embedding, scanned layer stacks, final norm, untied LM head, parameter-shared MTP, losses.

Layers are grouped into *units*: a unit starts at a "full" (own indexer) layer and takes the "shared" layers that
follow it (they reuse its top-k indices). Consecutive units with the same layer kinds are stacked (parameters get a
leading "layers" axis) and run with one `lax.scan`, so compile time does not grow with depth:
GLM-5 (3 dense + 75 MoE, all full) -> 2 stacks; GLM-5.2 (FFF SSS F SSS ...) -> 3 stacks.
"""
from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from glmjax.config import ModelConfig
from glmjax.model import context
from glmjax.model.blocks import from_blocks, to_blocks
from glmjax.model.context import IQ, K, SUM, Layout, local_queries
from glmjax.model.index_loss import streaming_index_kl
from glmjax.model.indexer import index_kl
from glmjax.model.layers import RMSNorm, dense, dtype_of, f32, normal_param, rope_tables
from glmjax.model.mla import MLA, AttnStats, Ctx
from glmjax.model.moe import MLP, MoE
from glmjax.parallel.rules import batch_spec


class Aux(NamedTuple):
    """What the layers report besides the hidden states, one entry per layer that produces it, stacked along a
    leading layer axis in layer order (`stack_aux`, `concat_aux`); None where no layer produces it."""
    max_logit: jax.Array | None = None  # [L] largest attention logit per layer, no gradient (dense training)
    expert_load: jax.Array | None = None  # [L_moe, E] tokens routed to each expert, MoE layers
    expert_dropped: jax.Array | None = None  # [L_moe] (token, slot) pairs the capacity dropped, MoE layers
    index_kl_sum: jax.Array | None = None  # [indexers] with index_loss: sum over queries of the indexer KL
    index_kl_tokens: jax.Array | None = None  # [indexers] with index_loss: the queries counted
    attn_topk: jax.Array | None = None  # [L,B,S,k] with topk_stats (dense): top-k keys of the head-mean attention
    index_topk: jax.Array | None = None  # [full layers,B,S,k] with topk_stats (dense): the indexers' top-k


def layer_aux(stats: AttnStats, moe, index_kl_sum=None, index_kl_tokens=None) -> Aux:
    """One layer's entries (no layer axis); moe: (expert load, dropped pairs) of a MoE layer, else None; the indexer
    KL, when given, is that of the unit it leads."""
    load, dropped = moe if moe is not None else (None, None)
    return Aux(stats.max_logit, load, dropped, index_kl_sum, index_kl_tokens, stats.attn_topk, stats.index_topk)


def stack_aux(auxs: list[Aux]) -> Aux:
    return _join(jnp.stack, auxs)


def concat_aux(auxs: list[Aux]) -> Aux:
    return _join(jnp.concatenate, auxs)


def _join(fn, auxs: list[Aux]) -> Aux:
    def field(values):
        present = [v for v in values if v is not None]
        return fn(present) if present else None
    return Aux(*map(field, zip(*auxs)))


class DecoderLayer(nnx.Module):
    """Pre-norm residual block: h += MLA_DSA(norm(h)); h += MLP/MoE(norm(h)) (docs/model.md B.2)."""

    def __init__(self, cfg: ModelConfig, moe: bool, has_indexer: bool, rngs: nnx.Rngs):
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg)
        self.self_attn = MLA(cfg, has_indexer, rngs)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg)
        self.mlp = MoE(cfg, rngs) if moe else MLP(cfg, cfg.intermediate_size, rngs)

    def __call__(self, h, topk, ctx: Ctx, cache=None):
        """h [B,S,D], topk [B,S,k'], cache (see MLA) -> (h, topk, AttnStats, (expert load [E], dropped pairs) on MoE
        layers (else None), cache)."""
        a, topk, stats, cache = self.self_attn(self.input_layernorm(h), ctx, topk, cache)
        h = h + a
        y = self.post_attention_layernorm(h)
        if isinstance(self.mlp, MoE):
            m, *moe = self.mlp(y)
        else:
            m, moe = self.mlp(y), None
        return h + m, topk, stats, moe, cache


@dataclasses.dataclass(frozen=True)
class StackPlan:
    kinds: tuple[tuple[bool, bool], ...]  # per layer of one unit: (moe, has_indexer)
    starts: tuple[int, ...]  # first layer index of each unit in the stack


def plan_stacks(cfg: ModelConfig) -> list[StackPlan]:
    types = cfg.layer_indexer_types
    units: list[tuple[int, tuple]] = []
    for i in range(cfg.num_hidden_layers):
        kind = (i >= cfg.first_k_dense_replace, types[i] == "full")
        if kind[1] or not units:
            units.append((i, (kind,)))
        else:
            units[-1] = (units[-1][0], units[-1][1] + (kind,))
    plans: list[StackPlan] = []
    for start, kinds in units:
        if plans and plans[-1].kinds == kinds:
            plans[-1] = StackPlan(kinds, plans[-1].starts + (start,))
        else:
            plans.append(StackPlan(kinds, (start,)))
    return plans


def layer_slots(cfg: ModelConfig) -> list[tuple[int, int, int]]:
    """Decoder layer i -> (stack, unit within the stack, position within the unit): where its weights live."""
    slots = [None] * cfg.num_hidden_layers
    for s, plan in enumerate(plan_stacks(cfg)):
        for u, start in enumerate(plan.starts):
            for j in range(len(plan.kinds)):
                slots[start + j] = (s, u, j)
    return slots


class Unit(nnx.Module):
    def __init__(self, cfg: ModelConfig, kinds, rngs: nnx.Rngs):
        self.layers = nnx.List([DecoderLayer(cfg, moe, idx, rngs) for moe, idx in kinds])

    def __call__(self, h, topk, ctx: Ctx, caches=None):
        """-> h, topk, Aux stacked over the unit's layers, caches (list per layer)."""
        stats, moes, new_caches = [], [], []
        for j, layer in enumerate(self.layers):
            h, topk, st, moe, c = layer(h, topk, ctx, None if caches is None else caches[j])
            stats.append(st)
            moes.append(moe)
            new_caches.append(c)
        kl = unit_index_loss(stats, ctx) if ctx.index_loss else ()
        auxs = [layer_aux(st, moe, *(kl if j == 0 else ())) for j, (st, moe) in enumerate(zip(stats, moes))]
        return h, topk, stack_aux(auxs), (None if caches is None else new_caches)


def unit_index_loss(stats: list[AttnStats], ctx: Ctx):
    """The unit's full layer (stats[0]) distils its indexer toward the mean attention distribution of every layer it
    serves (itself and the shared layers after it: docs/model.md E.4; a lone full layer is E.2 / E.3) -> (sum of KL, queries
    counted). Blocked dense attention streams the KL over key blocks (`streaming_index_kl`, no [B,S,T]); under
    context parallelism with each shard's queries against the gathered keys."""
    if stats[0].attn_target is not None:
        targets, seg = [st.attn_target for st in stats], ctx.segment_ids
        axes = ([context.target_axes(t) for t in targets], IQ, K, IQ, IQ, IQ, K, IQ)
        return local_queries(ctx.layout, streaming_index_kl, axes, (SUM, SUM))(
            targets, *stats[0].index_qkw, seg, seg > 0, seg, ctx.q_idx)
    target = jnp.mean(jnp.stack([st.attn_p for st in stats]), axis=0)
    return index_kl(target, stats[0].index_logits, ctx.segment_ids > 0)


REMAT = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "save_dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


class Stack(nnx.Module):
    """`n` units of identical kinds with stacked parameters, run by one scan."""

    def __init__(self, cfg: ModelConfig, plan: StackPlan, rngs: nnx.Rngs):
        self.cfg = cfg
        self.n = len(plan.starts)

        @nnx.split_rngs(splits=self.n)
        @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
        def create(r):
            return Unit(cfg, plan.kinds, r)

        self.units = create(rngs)

    def __call__(self, h, topk, ctx: Ctx, caches=None):
        """caches: None, or per position in the unit a cache dict stacked over the units ([n, B, T, C] leaves).
        -> h, topk, Aux over the stack's layers, caches."""
        graphdef, state = nnx.split(self.units)

        def body(carry, xs):
            h, topk = carry
            unit_state, unit_caches = xs
            h, topk, aux, unit_caches = nnx.merge(graphdef, unit_state)(h, topk, ctx, unit_caches)
            return (h, topk), (aux, unit_caches)

        if self.cfg.remat != "none":
            body = jax.checkpoint(body, policy=REMAT[self.cfg.remat], prevent_cse=False)
        if self.cfg.scan_layers:
            (h, topk), (aux, caches) = jax.lax.scan(body, (h, topk), (state, caches))
        else:
            outs = []
            for i in range(self.n):
                (h, topk), out = body((h, topk), jax.tree.map(lambda a: a[i], (state, caches)))
                outs.append(out)
            aux, caches = jax.tree.map(lambda *a: jnp.stack(a), *outs)
        # [units, layers per unit, ...] -> [layers, ...] in layer order
        return h, topk, jax.tree.map(lambda a: a.reshape((-1,) + a.shape[2:]), aux), caches


class MTP(nnx.Module):
    """GLM-5's multi-token-prediction layer (docs/model.md B.11): one set of weights applied for `mtp_depth` depths."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        D = cfg.hidden_size
        self.enorm = RMSNorm(D, cfg.rms_norm_eps, cfg)
        self.hnorm = RMSNorm(D, cfg.rms_norm_eps, cfg)
        self.eh_proj = normal_param(rngs, (2 * D, D), ("mtp_in", "embed"), cfg)
        self.layer = DecoderLayer(cfg, moe=True, has_indexer=True, rngs=rngs)
        self.shared_head_norm = RMSNorm(D, cfg.rms_norm_eps, cfg)

    def __call__(self, emb, h_prev, ctx: Ctx, dtype, cache=None):
        """emb = Embed[t_{i+k}] [B,S,D], h_prev = post-norm hidden of depth k-1 -> post-norm hidden of depth k, the
        layer's Aux entries (no layer axis), cache (the layer's own, as MLA's; None without one: training)."""
        u = jnp.concatenate([self.enorm(emb), self.hnorm(h_prev)], axis=-1)  # embedding first, hidden second
        u = dense(u, self.eh_proj[...], "bsd,de->bse", dtype)
        topk0 = jnp.full(u.shape[:2] + (0,), -1, jnp.int32)
        h, _, stats, moe, cache = self.layer(u, topk0, ctx, cache)
        kl = unit_index_loss([stats], ctx) if ctx.index_loss else ()
        return self.shared_head_norm(h), layer_aux(stats, moe, *kl), cache


class Batch(NamedTuple):
    tokens: jax.Array  # [B,S] int32
    segment_ids: jax.Array  # [B,S] int32, documents numbered from 1, 0 = padding
    positions: jax.Array  # [B,S] int32, position within the document
    loss_mask: jax.Array | None = None  # [B,S], 1 where the token may be *predicted* (SFT: response tokens)


class GLM(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.cfg = cfg
        D, V = cfg.hidden_size, cfg.vocab_size
        self.embed_tokens = normal_param(rngs, (V, D), ("vocab", "embed"), cfg)
        self.plans = tuple(plan_stacks(cfg))
        self.stacks = nnx.List([Stack(cfg, p, rngs) for p in self.plans])
        self.norm = RMSNorm(D, cfg.rms_norm_eps, cfg)
        self.lm_head = normal_param(rngs, (D, V), ("embed", "vocab"), cfg)
        self.mtp = MTP(cfg, rngs) if cfg.has_mtp else None

    def layout(self, batch: Batch) -> Layout | None:
        """The context-parallel layout of the batch's sequence on the mesh in context (None: not split)."""
        return context.layout(self.cfg.context_layout, batch.tokens.shape[1])

    def ctx(self, batch: Batch, mode: str, layout: Layout | None = None, **flags) -> Ctx:
        """batch in the layout's order when given (queries at the layout's natural slots)."""
        cos, sin = rope_tables(batch.positions, self.cfg)
        q_idx = None if layout is None else layout.slots(batch.segment_ids.shape)
        return Ctx(cos, sin, batch.segment_ids, mode, q_idx=q_idx, layout=layout, **flags)

    def __call__(self, batch: Batch, mode: str = "dense", **flags):
        """-> final post-norm hidden [B,S,D], Aux of the trunk's layers: expert_load, max_logit (dense mode), with
        index_loss=True index_kl_sum / index_kl_tokens, with topk_stats=True (dense) attn_topk and index_topk
        (flags: see Ctx, e.g. backend=). Under context parallelism the model runs in the layout's order and the
        per-token outputs (h, the top-k diagnostics) come back in natural order."""
        layout = self.layout(batch)
        lb = to_layout(batch, layout)
        h, aux, _ = self.trunk(lb.tokens, self.ctx(lb, mode, layout, **flags), None)
        if layout is not None:
            natural = lambda x: None if x is None else layout.to_natural(x, axis=2)  # noqa: E731  [L,B,S,k]
            h = layout.to_natural(h)
            aux = aux._replace(attn_topk=natural(aux.attn_topk), index_topk=natural(aux.index_topk))
        return h, aux

    def trunk(self, tokens, ctx: Ctx, caches):
        """Embedding, every stack, final norm. caches: None or one entry per stack (see Stack) -> h, Aux, caches."""
        B, S = tokens.shape
        h = self.embed_tokens[...][tokens].astype(dtype_of(self.cfg.dtype))
        keys = S if caches is None else ctx.kv_valid.shape[1]
        topk = jnp.full((B, S, min(self.cfg.index_topk, keys) if ctx.mode == "sparse" else 0), -1, jnp.int32)
        auxs, new_caches = [], []
        for i, stack in enumerate(self.stacks):
            h, topk, aux, c = stack(h, topk, ctx, None if caches is None else caches[i])
            auxs.append(aux)
            new_caches.append(c)
        return self.norm(h), concat_aux(auxs), (None if caches is None else new_caches)

    def logits(self, h):
        """Full logits [.., V] f32 -- for inspection and decoding; training uses `token_nll` (chunked)."""
        return jnp.einsum("...d,dv->...v", h, self.lm_head[...].astype(h.dtype), preferred_element_type=f32)

    def loss(self, batch: Batch, mode: str = "dense", lm_weight: float = 1.0, index_loss_weight: float = 0.0):
        """L = lm_weight * (CE_main + mtp_loss_weight / D * sum_k CE_k) (docs/model.md E.1, E.5)
             + index_loss_weight * sum over indexers of their token-mean KL (E.2 dense / E.3 sparse / E.4 shared).
        The KL reaches only indexer weights and the LM terms never do (detached indexer inputs, stop-gradient
        targets, non-differentiable top-k), so one sum serves every stage. -> (loss, metrics dict)."""
        cfg = self.cfg
        with_kl = index_loss_weight > 0
        layout = self.layout(batch)  # context parallelism: everything below runs in the layout's order
        lb = to_layout(batch, layout)
        h, aux, _ = self.trunk(lb.tokens, self.ctx(lb, mode, layout, index_loss=with_kl), None)
        targets, valid = to_layout(shifted_targets(batch, 1), layout)  # shifted in natural order
        nll = token_nll(h, self.lm_head[...], targets, cfg.loss_chunk)
        lm_sum, lm_count = jnp.sum(nll * valid), jnp.sum(valid)
        lm = lm_sum / jnp.maximum(lm_count, 1.0)
        metrics = {"lm_loss": lm, "lm_nll_sum": lm_sum, "lm_tokens": lm_count}
        loss = lm
        if aux.max_logit is not None:
            metrics["max_attn_logit"] = jnp.max(aux.max_logit)
        if self.mtp is not None:
            mtp_losses, mtp_aux = self.mtp_losses(batch, h, mode, with_kl)
            loss = loss + cfg.mtp_loss_weight / cfg.mtp_depth * jnp.sum(mtp_losses)
            metrics["mtp_loss"] = jnp.mean(mtp_losses)
            aux = concat_aux([aux, mtp_aux._replace(max_logit=None)])  # the MTP layer's max logit is not reported
        loss = lm_weight * loss
        if with_kl:  # per indexer (trunk full layers, then the MTP indexer per depth): token-mean KL
            kl = aux.index_kl_sum / jnp.maximum(aux.index_kl_tokens, 1.0)
            loss = loss + index_loss_weight * jnp.sum(kl)
            metrics["index_kl"] = jnp.mean(kl)
            metrics["index_kl_per_layer"] = kl
        metrics["loss"] = loss
        if aux.expert_load is not None:
            metrics["expert_load"] = aux.expert_load  # [L_moe (+ mtp_depth), E], layer order, MTP depths last
            metrics["moe_dropped"] = jnp.sum(aux.expert_dropped) / jnp.maximum(jnp.sum(aux.expert_load), 1)
        return loss, metrics

    def mtp_losses(self, batch: Batch, h, mode: str, index_loss: bool = False):
        """Per-depth CE [mtp_depth] and the MTP layer's Aux per depth (e.g. expert_load [D_mtp, E]). Depth k at slot i
        embeds t_{i+k} and predicts t_{i+k+1}, inside the same document. The depth loop is rematerialised with
        `model.remat`, like the layer stacks. batch in natural order, h in the layout's (`GLM.layout`)."""
        cfg, dt = self.cfg, dtype_of(self.cfg.dtype)
        layout = self.layout(batch)
        ctx = self.ctx(to_layout(batch, layout), mode, layout, index_loss=index_loss)
        ks = range(1, cfg.mtp_depth + 1)
        # shifted in natural order (across context shards), then put in the layout's order
        emb_tokens = jnp.stack([to_layout(shift_left(batch.tokens, k, 0), layout) for k in ks])
        targets, valid = zip(*(to_layout(shifted_targets(batch, k + 1), layout) for k in ks))

        def depth(h_prev, xs):
            tok, tgt, ok = xs
            emb = on_batch_layout(self.embed_tokens[...][on_batch_layout(tok)].astype(dt))
            hk, aux, _ = self.mtp(emb, h_prev, ctx, dt)
            nll = token_nll(hk, self.lm_head[...], tgt, cfg.loss_chunk)
            return hk, (jnp.sum(nll * ok) / jnp.maximum(jnp.sum(ok), 1.0), aux)

        if cfg.remat != "none":  # like the trunk's layers: a depth's activations are recomputed in the backward pass
            depth = jax.checkpoint(depth, policy=REMAT[cfg.remat], prevent_cse=False)
        _, (losses, aux) = jax.lax.scan(depth, h, (emb_tokens, jnp.stack(targets), jnp.stack(valid)))
        return losses, aux


def on_batch_layout(x):
    """x [B,S,...] held in the batch layout of the mesh in context (rows over the batch axes, S over context; a no-op
    without a mesh). Inside the MTP depth loop XLA loses the tokens' layout and would look up the embeddings of the
    whole [B,S] on every device (its size: docs/benchmarks.md, measurements behind the model code's choices)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.size == 1:
        return x
    return jax.lax.with_sharding_constraint(x, jax.sharding.NamedSharding(mesh, batch_spec(mesh)))


def to_layout(x, layout: Layout | None):
    """A [B,S,...] array, or a tuple of them / a Batch (None fields kept), in the layout's order (None: as is)."""
    if layout is None:
        return x
    if isinstance(x, tuple):
        out = [None if a is None else layout.to_layout(a) for a in x]
        return type(x)(*out) if hasattr(x, "_fields") else tuple(out)
    return layout.to_layout(x)


def shift_left(x, n: int, fill):
    return jnp.concatenate([x[:, n:], jnp.full((x.shape[0], n), fill, x.dtype)], axis=1)


def shifted_targets(batch: Batch, n: int):
    """Targets t_{i+n} [B,S] and their validity (same document, not padding, allowed by loss_mask) as f32."""
    seg = batch.segment_ids
    ok = (shift_left(seg, n, -1) == seg) & (seg > 0)
    if batch.loss_mask is not None:
        ok = ok & (shift_left(batch.loss_mask, n, 0) > 0)
    return shift_left(batch.tokens, n, 0), ok.astype(f32)


def map_position_chunks(fn, h, targets, chunk: int, *params):
    """fn((h [B,c,D], targets [B,c]), *params) -> tuple of [B,c] arrays, applied `chunk` positions at a time under
    remat (lax.map), so whatever fn builds per chunk (e.g. [B,c,V] logits) never exists for all S positions, forward
    or backward. h [B,S,D], targets [B,S], params (e.g. the LM head) -> tuple of [B,S]. On a mesh that splits the
    sequence each context shard maps over its own positions (in any order: positions are independent); the tensor
    axis stays with XLA, so the vocabulary split of the LM head is kept."""
    layout = context.layout("contiguous", h.shape[1])
    if layout is not None:
        n = len(jax.eval_shape(fn, (h[:, :1], targets[:, :1]), *params))
        return local_queries(layout, lambda h, t, *p: map_position_chunks(fn, h, t, chunk, *p),
                             (context.Q, context.Q) + ((),) * len(params), (context.Q,) * n, auto=("tensor",))(
            h, targets, *params)
    c = min(chunk, h.shape[1])
    outs = jax.lax.map(jax.checkpoint(lambda args: fn(args, *params)), (to_blocks(h, c), to_blocks(targets, c)))
    return tuple(from_blocks(o, h.shape[1]) for o in outs)


def token_nll(h, head, targets, chunk: int):
    """-log softmax(h @ head)[target] per token [B,S] f32, `chunk` positions at a time (`map_position_chunks`)."""

    def one(args, head):
        hc, tc = args
        logits = jnp.einsum("bcd,dv->bcv", hc, head.astype(hc.dtype), preferred_element_type=f32)
        return (jax.nn.logsumexp(logits, axis=-1) - jnp.take_along_axis(logits, tc[..., None], axis=-1)[..., 0],)

    return map_position_chunks(one, h, targets, chunk, head)[0]
