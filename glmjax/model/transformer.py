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
from glmjax.model.layers import RMSNorm, dense, dtype_of, f32, normal_param, rope_tables
from glmjax.model.mla import MLA, Ctx
from glmjax.model.moe import MLP, MoE


class DecoderLayer(nnx.Module):
    """Pre-norm residual block: h += MLA_DSA(norm(h)); h += MLP/MoE(norm(h)) (SPEC B.2)."""

    def __init__(self, cfg: ModelConfig, moe: bool, has_indexer: bool, rngs: nnx.Rngs):
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg)
        self.self_attn = MLA(cfg, has_indexer, rngs)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg)
        self.mlp = MoE(cfg, rngs) if moe else MLP(cfg, cfg.intermediate_size, rngs)

    def __call__(self, h, topk, ctx: Ctx):
        """h [B,S,D], topk [B,S,k'] -> (h, topk, expert load [E] or None)."""
        a, topk = self.self_attn(self.input_layernorm(h), ctx, topk)
        h = h + a
        y = self.post_attention_layernorm(h)
        if isinstance(self.mlp, MoE):
            m, load = self.mlp(y)
        else:
            m, load = self.mlp(y), None
        return h + m, topk, load


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


class Unit(nnx.Module):
    def __init__(self, cfg: ModelConfig, kinds, rngs: nnx.Rngs):
        self.layers = nnx.List([DecoderLayer(cfg, moe, idx, rngs) for moe, idx in kinds])

    def __call__(self, h, topk, ctx: Ctx):
        loads = []
        for layer in self.layers:
            h, topk, load = layer(h, topk, ctx)
            if load is not None:
                loads.append(load)
        return h, topk, (jnp.stack(loads) if loads else None)


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

    def __call__(self, h, topk, ctx: Ctx):
        graphdef, state = nnx.split(self.units)

        def body(carry, unit_state):
            h, topk = carry
            h, topk, loads = nnx.merge(graphdef, unit_state)(h, topk, ctx)
            return (h, topk), loads

        if self.cfg.remat != "none":
            body = jax.checkpoint(body, policy=REMAT[self.cfg.remat], prevent_cse=False)
        if self.cfg.scan_layers:
            (h, topk), loads = jax.lax.scan(body, (h, topk), state)
        else:
            outs = []
            for i in range(self.n):
                (h, topk), loads_i = body((h, topk), jax.tree.map(lambda a: a[i], state))
                outs.append(loads_i)
            loads = None if outs[0] is None else jnp.stack(outs)
        return h, topk, (None if loads is None else loads.reshape(-1, loads.shape[-1]))


class MTP(nnx.Module):
    """GLM-5's multi-token-prediction layer (SPEC B.11): one set of weights applied for `mtp_depth` depths."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        D = cfg.hidden_size
        self.enorm = RMSNorm(D, cfg.rms_norm_eps, cfg)
        self.hnorm = RMSNorm(D, cfg.rms_norm_eps, cfg)
        self.eh_proj = normal_param(rngs, (2 * D, D), ("mtp_in", "embed"), cfg)
        self.layer = DecoderLayer(cfg, moe=True, has_indexer=True, rngs=rngs)
        self.shared_head_norm = RMSNorm(D, cfg.rms_norm_eps, cfg)

    def __call__(self, emb, h_prev, ctx: Ctx, dtype):
        """emb = Embed[t_{i+k}] [B,S,D], h_prev = post-norm hidden of depth k-1 -> post-norm hidden of depth k."""
        u = jnp.concatenate([self.enorm(emb), self.hnorm(h_prev)], axis=-1)  # embedding first, hidden second
        u = dense(u, self.eh_proj[...], "bsd,de->bse", dtype)
        topk0 = jnp.full(u.shape[:2] + (0,), -1, jnp.int32)
        h, _, load = self.layer(u, topk0, ctx)
        return self.shared_head_norm(h), load


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

    def ctx(self, batch: Batch, mode: str) -> Ctx:
        cos, sin = rope_tables(batch.positions, self.cfg)
        return Ctx(cos, sin, batch.segment_ids, mode)

    def __call__(self, batch: Batch, mode: str = "dense"):
        """-> final post-norm hidden [B,S,D], per-MoE-layer expert load [L_moe, E] (or None)."""
        cfg = self.cfg
        B, S = batch.tokens.shape
        ctx = self.ctx(batch, mode)
        h = self.embed_tokens[...][batch.tokens].astype(dtype_of(cfg.dtype))
        kk = min(cfg.index_topk, S) if mode == "sparse" else 0
        topk = jnp.full((B, S, kk), -1, jnp.int32)
        loads = []
        for stack in self.stacks:
            h, topk, load = stack(h, topk, ctx)
            if load is not None:
                loads.append(load)
        return self.norm(h), (jnp.concatenate(loads) if loads else None)

    def logits(self, h):
        """Full logits [.., V] f32 -- for inspection and decoding; training uses `token_nll` (chunked)."""
        return jnp.einsum("...d,dv->...v", h, self.lm_head[...].astype(h.dtype), preferred_element_type=f32)

    def loss(self, batch: Batch, mode: str = "dense"):
        """L = CE_main + mtp_loss_weight / D * sum_k CE_k (SPEC E.1, E.5). -> (loss, metrics dict)."""
        cfg = self.cfg
        h, loads = self(batch, mode)
        targets, valid = shifted_targets(batch, 1)
        nll = token_nll(h, self.lm_head[...], targets, cfg.loss_chunk)
        lm_sum, lm_count = jnp.sum(nll * valid), jnp.sum(valid)
        lm = lm_sum / jnp.maximum(lm_count, 1.0)
        metrics = {"lm_loss": lm, "lm_nll_sum": lm_sum, "lm_tokens": lm_count}
        loss = lm
        if self.mtp is not None:
            mtp_losses, mtp_loads = self.mtp_losses(batch, h, mode)
            loss = loss + cfg.mtp_loss_weight / cfg.mtp_depth * jnp.sum(mtp_losses)
            metrics["mtp_loss"] = jnp.mean(mtp_losses)
            loads = mtp_loads if loads is None else jnp.concatenate([loads, mtp_loads])
        metrics["loss"] = loss
        if loads is not None:
            metrics["expert_load"] = loads
        return loss, metrics

    def mtp_losses(self, batch: Batch, h, mode: str):
        """Per-depth CE [mtp_depth] and the MTP layer's expert load per depth [D_mtp, E]. Depth k (1-based) at slot i
        embeds t_{i+k} and predicts t_{i+k+1}, inside the same document."""
        cfg, dt = self.cfg, dtype_of(self.cfg.dtype)
        ctx = self.ctx(batch, mode)
        ks = range(1, cfg.mtp_depth + 1)
        emb_tokens = jnp.stack([shift_left(batch.tokens, k, 0) for k in ks])
        targets, valid = zip(*(shifted_targets(batch, k + 1) for k in ks))

        def depth(h_prev, xs):
            tok, tgt, ok = xs
            emb = self.embed_tokens[...][tok].astype(dt)
            hk, load = self.mtp(emb, h_prev, ctx, dt)
            nll = token_nll(hk, self.lm_head[...], tgt, cfg.loss_chunk)
            return hk, (jnp.sum(nll * ok) / jnp.maximum(jnp.sum(ok), 1.0), load)

        _, (losses, loads) = jax.lax.scan(depth, h, (emb_tokens, jnp.stack(targets), jnp.stack(valid)))
        return losses, loads


def shift_left(x, n: int, fill):
    return jnp.concatenate([x[:, n:], jnp.full((x.shape[0], n), fill, x.dtype)], axis=1)


def shifted_targets(batch: Batch, n: int):
    """Targets t_{i+n} [B,S] and their validity (same document, not padding, allowed by loss_mask) as f32."""
    seg = batch.segment_ids
    ok = (shift_left(seg, n, -1) == seg) & (seg > 0)
    if batch.loss_mask is not None:
        ok = ok & (shift_left(batch.loss_mask, n, 0) > 0)
    return shift_left(batch.tokens, n, 0), ok.astype(f32)


def token_nll(h, head, targets, chunk: int):
    """-log softmax(h @ head)[target] per token [B,S] f32, computed `chunk` positions at a time under remat,
    so the [B,S,V] logits never exist (forward or backward)."""
    B, S, D = h.shape
    c = min(chunk, S)
    n = -(-S // c)
    pad = n * c - S
    hs = jnp.moveaxis(jnp.pad(h, ((0, 0), (0, pad), (0, 0))).reshape(B, n, c, D), 1, 0)
    ts = jnp.moveaxis(jnp.pad(targets, ((0, 0), (0, pad))).reshape(B, n, c), 1, 0)

    @jax.checkpoint
    def one(args):
        hc, tc = args
        logits = jnp.einsum("bcd,dv->bcv", hc, head.astype(hc.dtype), preferred_element_type=f32)
        return jax.nn.logsumexp(logits, axis=-1) - jnp.take_along_axis(logits, tc[..., None], axis=-1)[..., 0]

    nll = jax.lax.map(one, (hs, ts))
    return jnp.moveaxis(nll, 0, 1).reshape(B, n * c)[:, :S]
