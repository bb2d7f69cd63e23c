"""Greedy speculative decoding with GLM-5's shared MTP layer as the draft (docs/model.md D.4).

The MTP layer keeps its own cache (latent rows and indexer keys, one row per slot, like a trunk layer's). Its row
at slot j is computed from the training input of depth 1 (docs/model.md B.11): the embedding of the token at slot
j+1 and the main model's post-norm hidden at slot j. One round, for every row of the batch at once, is one compiled
program whatever the rows accept:

1. Draft. The MTP layer runs over d+1 rows at slots c0..c0+d: the previous round's verified positions (the tokens
   it emitted, the main model's hidden states of its verify pass). Row `a` (the last accepted) holds the last
   emitted token x0 and drafts y_1; then d-1 single steps at the next slots draft y_2..y_d, each from the MTP's own
   hidden and the previous draft's embedding (the layer's shared weights serve every depth).
2. Verify. The main model runs over [x0, y_1..y_d] at slots L..L+d (L = c0 + a + 1) in one forward over the MLA
   latent cache, greedy tokens g_0..g_d.
3. Accept the longest prefix with y_{j+1} = g_j (acc in 0..d); emit y_1..y_acc and g_acc: acc + 1 tokens, each
   the main model's own greedy choice, so the output is plain greedy decoding's token for token.
4. Roll back. The next round starts at L' = L + acc + 1 (`next_start`): the rows this verify wrote for rejected
   drafts (slots L'..L+d, latent and indexer key) and the MTP rows of draft steps 2..d (slots L..L+d-2) lie at or
   past the next round's writes (d+1 verify rows from L', d+1 MTP rows from L), which overwrite them before any
   query reads them: a query sees only slots up to its own (the causal mask), and those the step has just written.

Equal to plain greedy decoding up to floating-point rounding: a verify pass of d+1 tokens and a decode step of one
compute the same logits through different shapes (and, past `mla_paths.materialise`, possibly a different attention
path), so a near-tie of two logits could in principle resolve differently; in f32 the tests see identical tokens.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from glmjax.infer.decode import Decoder, cache_ctx, forward_cached
from glmjax.model import GLM
from glmjax.model.layers import dtype_of


class Round(NamedTuple):
    """What a round needs from the one before (device arrays): the MTP pass's d+1 rows at slots c0..c0+d and where
    the verify starts."""
    tokens: jax.Array  # [B,d+1] row j embeds the token at slot c0+j+1; tokens[:, a] = x0, the last emitted token
    # (rows past `a` are junk: written into the MTP cache, redone by the next round)
    hidden: jax.Array  # [B,d+1,D] the main model's post-norm hidden at slots c0..c0+d
    c0: jax.Array  # [B] int32
    a: jax.Array  # [B] int32 the row that drafts y_1 (the last accepted)
    start: jax.Array  # [B] int32 the verify's first slot (x0's): c0 + a + 1 after the rollback


def init_mtp_cache(model: GLM, batch_size: int, max_len: int) -> dict:
    """The MTP layer's zero cache: {"latent": [B,T,r_kv+d_r], "index_k": [B,T,d_I]} (it always has an indexer)."""
    cfg, dt = model.cfg, dtype_of(model.cfg.dtype)
    return {"latent": jnp.zeros((batch_size, max_len, cfg.kv_lora_rank + cfg.qk_rope_head_dim), dt),
            "index_k": jnp.zeros((batch_size, max_len, cfg.index_head_dim), dt)}


def mtp_cached(model: GLM, tokens, hidden, start, cache: dict, mode: str):
    """The MTP layer on its cache: row s embeds tokens[:, s] and reads hidden[:, s] (the main model's, or the MTP's
    own for a deeper draft), at slot start[b] + s -> (its post-norm hidden [B,S,D], cache)."""
    dt = dtype_of(model.cfg.dtype)
    slots = start[:, None] + jnp.arange(tokens.shape[1], dtype=jnp.int32)[None]
    ctx = cache_ctx(model.cfg, start, slots, cache["latent"].shape[1], mode)
    h, _, cache = model.mtp(model.embed_tokens[...][tokens].astype(dt), hidden, ctx, dt, cache)
    return h, cache


def greedy(model: GLM, h):
    """[..., D] post-norm hidden -> (logits [..., V] f32, greedy tokens [...] int32)."""
    logits = model.logits(h)
    return logits, jnp.argmax(logits, axis=-1).astype(jnp.int32)


def accepted(drafts, verified):
    """drafts [B,d], the main model's greedy tokens at the verify slots verified [B,d+1] -> acc [B]: the length of
    the longest prefix with drafts[:, j] == verified[:, j]."""
    return jnp.sum(jnp.cumprod(drafts == verified[:, :-1], axis=1), axis=1).astype(jnp.int32)


def next_start(start, acc):
    """The rollback: the first slot of the next round's verify, past the x0 and acc drafts this one accepted."""
    return start + acc + 1


def validate_depth(depth) -> int:
    if isinstance(depth, bool) or not isinstance(depth, int) or depth < 1:
        raise ValueError(f"speculative={depth!r}: the number of drafted tokens per round must be an integer >= 1")
    return depth


class SpeculativeDecoder:
    """Jitted prefill and speculative rounds of `depth` drafts for one Decoder's model (its mode; one device).
    Shapes are fixed per (batch, capacity): one compilation serves every round and every acceptance pattern."""

    def __init__(self, decoder: Decoder, depth: int):
        model = decoder.model
        if model.mtp is None:
            raise ValueError("speculative decoding drafts with the MTP layer, and this model has none "
                             "(model.num_nextn_predict_layers=0)")
        validate_depth(depth)
        if decoder.mesh is not None:
            raise ValueError("speculative decoding runs on one device for now (Decoder(mesh=None))")
        self.decoder, self.depth, self.mode = decoder, depth, decoder.mode
        self.prefill = jax.jit(self._prefill, donate_argnums=(3, 4), compiler_options=decoder.compiler_options)
        self.round = jax.jit(self._round, donate_argnums=(2, 3), compiler_options=decoder.compiler_options)

    def init_cache(self, batch_size: int, max_len: int):
        """(the main model's cache, the MTP layer's cache)."""
        return self.decoder.init_cache(batch_size, max_len), init_mtp_cache(self.decoder.model, batch_size, max_len)

    def _prefill(self, state, tokens, lengths, caches, mtp_cache):
        """Right-padded prompts tokens [B,P], lengths [B] -> (x0: the greedy token after each prompt [B], its log-prob
        [B], the first Round, caches, mtp_cache): the main model's prefill, then the MTP rows of the prompt's slots."""
        model = nnx.merge(self.decoder.graphdef, state)
        B, d = tokens.shape[0], self.depth
        zeros = jnp.zeros((B,), jnp.int32)
        h, caches = forward_cached(model, tokens, zeros, caches, self.mode)
        last = jnp.take_along_axis(h, (lengths - 1)[:, None, None], axis=1)[:, 0]
        logits, x0 = greedy(model, last)
        nxt = jnp.pad(tokens[:, 1:], ((0, 0), (0, 1)))  # slot j's row embeds the token at j+1 (the last: redone)
        _, mtp_cache = mtp_cached(model, nxt, h, zeros, mtp_cache, self.mode)
        first = Round(jnp.zeros((B, d + 1), jnp.int32).at[:, 0].set(x0),
                      jnp.zeros((B, d + 1) + h.shape[2:], h.dtype).at[:, 0].set(last), lengths - 1, zeros, lengths)
        logp = jnp.take_along_axis(jax.nn.log_softmax(logits, axis=-1), x0[:, None], axis=-1)[:, 0]
        return x0, logp, first, caches, mtp_cache

    def _round(self, state, r: Round, caches, mtp_cache):
        """One draft-verify-accept round (module doc) -> (emitted [B,d+1] (the first acc+1 count), their log-probs
        [B,d+1] under the main model, acc [B], the next Round, caches, mtp_cache)."""
        model = nnx.merge(self.decoder.graphdef, state)
        d, T = self.depth, mtp_cache["latent"].shape[1]
        g, mtp_cache = mtp_cached(model, r.tokens, r.hidden, r.c0, mtp_cache, self.mode)
        h = jnp.take_along_axis(g, r.a[:, None, None], axis=1)[:, 0]
        x0 = jnp.take_along_axis(r.tokens, r.a[:, None], axis=1)[:, 0]
        start = jnp.minimum(r.start, T - d - 1)  # a live row never gets there (generate's capacity); a finished one
        # may run on, and stays inside the cache
        _, y = greedy(model, h)
        drafts = [y]
        for k in range(d - 1):  # draft y_{k+2} at slot start + k
            g, mtp_cache = mtp_cached(model, y[:, None], h[:, None], start + k, mtp_cache, self.mode)
            h = g[:, 0]
            _, y = greedy(model, h)
            drafts.append(y)
        drafts = jnp.stack(drafts, axis=1)  # [B,d]
        hidden, caches = forward_cached(model, jnp.concatenate([x0[:, None], drafts], axis=1), start, caches,
                                        self.mode)
        logits, verified = greedy(model, hidden)  # [B,d+1]
        acc = accepted(drafts, verified)
        bonus = jnp.take_along_axis(verified, acc[:, None], axis=1)  # g_acc [B,1]
        j = jnp.arange(d + 1)[None]
        emitted = jnp.where(j < acc[:, None], jnp.pad(drafts, ((0, 0), (0, 1))), bonus)
        logp = jnp.take_along_axis(jax.nn.log_softmax(logits, axis=-1), emitted[..., None], axis=-1)[..., 0]
        return emitted, logp, acc, Round(emitted, hidden, start, acc, next_start(start, acc)), caches, mtp_cache
