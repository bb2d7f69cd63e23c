"""The DSA lightning indexer (docs/model.md B.6): index scores I[t,s] = sum_h w[t,h] * ReLU(q_I[t,h] . k_I[s]) * d_I^-0.5,
and the exact, deterministic top-k over them computed in query blocks so [B, S, T] never exists at once.

Top-k contract (shared by training, decoding and the Pallas kernel): indices [B, S, min(k, T)] int32, the highest
scores first, ties broken by the lowest key index (`lax.top_k` is stable), and -1 in every slot that has no valid
key (fewer than k causal keys in the query's own segment).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from glmjax.config import ModelConfig
from glmjax.model.blocks import from_blocks, to_blocks
from glmjax.model.layers import LayerNorm, apply_rope, dense, dtype_of, f32, normal_param

NEG_INF = -jnp.inf


class Indexer(nnx.Module):
    """Parameters: wq_b [r_q, H_I, d_I] (from the MLA's q latent; without a query LoRA wq [D, H_I, d_I] from the
    normed hidden state, the query input the MLA reads instead), wk [D, d_I], k_norm (LayerNorm d_I),
    weights_proj [D, H_I]."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.cfg = cfg
        if cfg.q_lora_rank:
            self.wq_b = normal_param(rngs, (cfg.q_lora_rank, cfg.index_n_heads, cfg.index_head_dim),
                                     ("q_lora", "index_heads", "index_head_dim"), cfg)
        else:
            self.wq = normal_param(rngs, (cfg.hidden_size, cfg.index_n_heads, cfg.index_head_dim),
                                   ("embed", "index_heads", "index_head_dim"), cfg)
        self.wk = normal_param(rngs, (cfg.hidden_size, cfg.index_head_dim), ("embed", "index_head_dim"), cfg)
        self.k_norm = LayerNorm(cfg.index_head_dim, cfg.indexer_norm_eps, cfg)
        self.weights_proj = normal_param(rngs, (cfg.hidden_size, cfg.index_n_heads), ("embed", "index_heads"), cfg)

    def __call__(self, x, q_resid, cos, sin):
        """x [B,S,D] (normed hidden), q_resid [B,S,r_q] (the MLA's query input: x without a query LoRA)
        -> q [B,S,H_I,d_I], k [B,S,d_I], w [B,S,H_I] (f32).

        Inputs are detached: the indexer learns only from its own KL loss (docs/model.md E.2/E.3).
        """
        cfg, dt = self.cfg, dtype_of(self.cfg.dtype)
        x, q_resid = jax.lax.stop_gradient(x), jax.lax.stop_gradient(q_resid)
        dr, inter = cfg.qk_rope_head_dim, cfg.indexer_rope_interleave
        w_q = self.wq_b[...] if cfg.q_lora_rank else self.wq[...]
        q = dense(q_resid, w_q, "bsr,rhd->bshd", dt)  # rope first, nope after (docs/model.md F-3)
        q = jnp.concatenate([apply_rope(q[..., :dr], cos, sin, inter), q[..., dr:]], axis=-1)
        k = self.k_norm(dense(x, self.wk[...], "bsd,dk->bsk", dt))
        k = jnp.concatenate([apply_rope(k[..., :dr], cos, sin, inter), k[..., dr:]], axis=-1).astype(dt)
        w = jnp.einsum("bsd,dh->bsh", x.astype(f32), self.weights_proj[...].astype(f32)) * cfg.index_n_heads ** -0.5
        return q, k, w


def index_logits(q, k, w):
    """Unmasked index scores. q [B,S,H_I,d_I], k [B,T,d_I], w [B,S,H_I] -> [B,S,T] f32."""
    s = jnp.einsum("bshd,btd->bsht", q, k, preferred_element_type=f32)
    return jnp.einsum("bsht,bsh->bst", jax.nn.relu(s), w) * q.shape[-1] ** -0.5


def visible(q_seg, k_seg, q_idx):
    """[B,S,T] bool: key slot t is visible to the query at cache slot q_idx ([S] or [B,S]): causal, same segment."""
    t = jnp.arange(k_seg.shape[1])
    q_idx = jnp.broadcast_to(q_idx, q_seg.shape)
    return (t[None, None, :] <= q_idx[:, :, None]) & (q_seg[:, :, None] == k_seg[:, None, :])


def index_scores(q, k, w, q_seg, k_seg, q_idx=None):
    """Differentiable masked index scores [B,S,T] (-inf where not visible): the path the indexer KL losses use."""
    q_idx = jnp.arange(q.shape[1]) if q_idx is None else q_idx
    return jnp.where(visible(q_seg, k_seg, q_idx), index_logits(q, k, w), NEG_INF)


def index_topk(q, k, w, q_seg, k_seg, topk: int, block_q: int, q_idx=None):
    """Exact top-k of the masked index scores, one query block at a time. q_idx ([S] or [B,S]) is the key slot of
    each query (its own position in the cache when decoding; global slots on a context shard).

    Returns (indices [B,S,k'] int32 with -1 for invalid slots, scores [B,S,k'] f32), k' = min(topk, T).
    Only [B, block_q, H_I, T] is live per block; the scores never reach HBM as [B,S,T].
    Without q_idx the queries sit at slots 0..S-1 and the query blocks go in `causal_groups`: each group scores
    only the keys its last query can see (a key past that prefix is masked for the whole group), ~half the score
    and top-k work of a causal sequence. The top-k is exact over the scores as computed; a narrower dot may round
    a score differently (~1e-7 relative; bit for bit the same at the block sizes of bench/peers.py).
    """
    B, S = q.shape[:2]
    T = k.shape[1]
    kk = min(topk, T)
    bq = min(block_q, S)
    groups = [(0, -(-S // bq), T)] if q_idx is not None else causal_groups(S, T, bq)
    q_idx = jnp.broadcast_to(jnp.arange(S) if q_idx is None else q_idx, (B, S))
    blocks = (to_blocks(q, bq), to_blocks(w, bq), to_blocks(q_seg, bq), to_blocks(q_idx, bq))

    def one_block(args, L: int):  # scores and top-k of the keys 0..L-1
        qb, wb, segb, idxb = args
        s = jnp.where(visible(segb, k_seg[:, :L], idxb), index_logits(qb, k[:, :L], wb), NEG_INF)
        vals, ids = jax.lax.top_k(s, min(kk, L))
        pad = [(0, 0)] * (vals.ndim - 1) + [(0, kk - vals.shape[-1])]  # a prefix shorter than k: no key there
        return (jnp.pad(jnp.where(vals == NEG_INF, -1, ids).astype(jnp.int32), pad, constant_values=-1),
                jnp.pad(vals, pad, constant_values=NEG_INF))

    outs = [jax.lax.map(functools.partial(one_block, L=L), jax.tree.map(lambda a: a[b0:b1], blocks))
            for b0, b1, L in groups]
    ids, vals = (jnp.concatenate(x, axis=0) for x in zip(*outs))
    return from_blocks(ids, S), from_blocks(vals, S)


CAUSAL_GROUPS = 8  # at most this many key-prefix lengths (each compiles its own block body)


def causal_groups(S: int, T: int, bq: int) -> list[tuple[int, int, int]]:
    """Query blocks of bq rows at slots 0..S-1 in at most CAUSAL_GROUPS contiguous groups -> [(first block,
    end block, keys the group's last query can see)]: work ~ (G+1)/(2G) of scoring every block against all T."""
    nb = -(-S // bq)
    G = min(nb, CAUSAL_GROUPS)
    ends = [round(nb * (g + 1) / G) for g in range(G)]
    return [(b0, b1, min(T, b1 * bq)) for b0, b1 in zip([0] + ends[:-1], ends)]


def gathered_index_logits(q, k, w, indices, block_q: int = 256):
    """Index scores at the selected keys only (the sparse-stage indexer loss, docs/model.md E.3), differentiable.
    q [B,S,H_I,d_I], k [B,T,d_I], w [B,S,H_I], indices [B,S,k'] (-1 = none) -> [B,S,k'] f32, -inf at -1.
    O(S·k'·H_I·d_I): query blocks gather their k' key rows, rematerialised in the backward pass."""
    bq = min(block_q, q.shape[1])

    @jax.checkpoint
    def one_block(args):
        qb, wb, ib = args
        rows = jax.vmap(lambda kk, ids: kk[ids])(k, jnp.maximum(ib, 0))  # [B,bq,k',d_I]
        s = jnp.einsum("bqhd,bqkd->bqhk", qb, rows, preferred_element_type=f32)
        s = jnp.einsum("bqhk,bqh->bqk", jax.nn.relu(s), wb) * q.shape[-1] ** -0.5
        return jnp.where(ib >= 0, s, NEG_INF)

    out = jax.lax.map(one_block, (to_blocks(q, bq), to_blocks(w, bq), to_blocks(indices, bq, -1)))
    return from_blocks(out, q.shape[1])


def index_kl(p, logits, query_ok):
    """Indexer distillation loss (docs/model.md E.2 / E.3): sum over valid queries of KL(p_t || softmax(logits_t)).
    p [B,S,K] target (rows sum to 1, 0 where masked; no gradient), logits [B,S,K] (-inf where masked),
    query_ok [B,S] bool -> (sum of KL, number of queries counted) f32."""
    logq = jax.nn.log_softmax(jnp.where(logits == NEG_INF, -1e30, logits), axis=-1)
    kl = jnp.sum(jnp.where(p > 0, p * (jnp.log(jnp.where(p > 0, p, 1.0)) - logq), 0.0), axis=-1)
    ok = query_ok & (jnp.sum(p, axis=-1) > 0)
    return jnp.sum(jnp.where(ok, kl, 0.0)), jnp.sum(ok).astype(f32)


def masked_topk(scores, k: int):
    """Top-k of scores [B,S,T] (-inf = not a candidate) with the index contract of `index_topk`."""
    vals, ids = jax.lax.top_k(scores, min(k, scores.shape[-1]))
    return jnp.where(vals == NEG_INF, -1, ids).astype(jnp.int32)
