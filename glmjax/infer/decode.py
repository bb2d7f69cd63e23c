"""Prefill and token-by-token decode against the MLA compressed cache (docs/model.md D).

Per layer and token the cache holds the 576-d latent row [c_kv (normed, 512) | k_pe (roped, 64)]; full layers
also hold the indexer key (d_I). IndexShare "shared" layers keep no indexer cache. Attention against the cache
uses absorbed weights (docs/model.md D.2); sparse mode gathers only the top-k latent rows, chosen by the same exact,
lowest-index-tie-breaking top-k as training.

Rows of a batch may have different lengths: sequence b occupies cache slots [0, length[b]); a step writes its S new
tokens at slots start[b] .. start[b]+S-1 (RoPE position = slot) and every slot >= the new length is invisible.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from glmjax.model import GLM
from glmjax.model.layers import dtype_of, rope_tables
from glmjax.model.mla import Ctx


def init_cache(model: GLM, batch_size: int, max_len: int):
    """Zero cache: per stack, per position in its unit, {"latent": [n_units, B, T, r_kv+d_r], "index_k": [..., d_I]}
    (index_k on full layers only)."""
    cfg = model.cfg
    dt = dtype_of(cfg.dtype)
    caches = []
    for plan in model.plans:
        n = len(plan.starts)
        per_pos = []
        for _, has_indexer in plan.kinds:
            c = {"latent": jnp.zeros((n, batch_size, max_len, cfg.kv_lora_rank + cfg.qk_rope_head_dim), dt)}
            if has_indexer:
                c["index_k"] = jnp.zeros((n, batch_size, max_len, cfg.index_head_dim), dt)
            per_pos.append(c)
        caches.append(per_pos)
    return caches


def forward_cached(model: GLM, tokens, start, caches, mode: str):
    """tokens [B,S] written at slots start[b]+s -> (post-norm hidden [B,S,D], caches). The caller's lengths after
    this step are start + S (prefill of right-padded prompts passes S = max length and masks by `lengths` later)."""
    B, S = tokens.shape
    T = caches[0][0]["latent"].shape[2]
    slots = start[:, None] + jnp.arange(S, dtype=jnp.int32)[None]
    cos, sin = rope_tables(slots, model.cfg)
    kv_valid = (jnp.arange(T)[None, :] < (start + S)[:, None]).astype(jnp.int32)
    ctx = Ctx(cos, sin, jnp.ones((B, S), jnp.int32), mode, q_idx=slots, kv_valid=kv_valid)
    h, _, caches = model.trunk(tokens, ctx, caches)
    return h, caches


class Decoder:
    """Jitted prefill / decode steps for one model; caches are donated, shapes are fixed per (batch, capacity),
    so generating a token never recompiles."""

    def __init__(self, model: GLM, mode: str = "sparse"):
        if mode not in ("dense", "sparse"):
            raise ValueError(f"mode={mode!r}: must be 'dense' or 'sparse'")
        self.model, self.mode = model, mode
        self.graphdef, self.state = nnx.split(model)
        self.prefill = jax.jit(self._prefill, donate_argnums=(3,))
        self.decode = jax.jit(self._decode, donate_argnums=(3,))
        self.extend = jax.jit(self._extend, donate_argnums=(3,))

    def init_cache(self, batch_size: int, max_len: int):
        return init_cache(self.model, batch_size, max_len)

    def _prefill(self, state, tokens, lengths, caches):
        """Right-padded prompts tokens [B,S], lengths [B] -> logits of each row's last prompt token [B,V], caches."""
        model = nnx.merge(self.graphdef, state)
        h, caches = forward_cached(model, tokens, jnp.zeros_like(lengths), caches, self.mode)
        last = jnp.take_along_axis(h, (lengths - 1)[:, None, None], axis=1)[:, 0]
        return model.logits(last), caches

    def _extend(self, state, tokens, start, caches):
        """Chunked prefill: tokens [B,S] appended at slots start[b].. -> logits of each row's last new token, caches.
        A long prompt goes in as several chunks, so attention temporaries stay [B, H, chunk, T]."""
        model = nnx.merge(self.graphdef, state)
        h, caches = forward_cached(model, tokens, start, caches, self.mode)
        return model.logits(h[:, -1]), caches

    def _decode(self, state, tokens, lengths, caches):
        """One new token per row, tokens [B] at slot lengths[b] -> logits [B,V] f32, caches."""
        model = nnx.merge(self.graphdef, state)
        h, caches = forward_cached(model, tokens[:, None], lengths, caches, self.mode)
        return model.logits(h[:, 0]), caches


@functools.partial(jax.jit, static_argnames=("temperature", "top_p"))
def sample(logits, key, temperature: float, top_p: float):
    """logits [B,V] f32 -> (tokens [B] int32, log-probs [B] f32).

    temperature 0 = greedy. The log-prob is that of the temperature-scaled, untruncated distribution
    log softmax(logits / T) -- what an RL trainer recomputes; top-p only restricts which tokens may be drawn.
    """
    if temperature == 0:
        tok = jnp.argmax(logits, axis=-1)
        logp = jax.nn.log_softmax(logits, axis=-1)
    else:
        logp = jax.nn.log_softmax(logits / temperature, axis=-1)
        masked = logp
        if top_p < 1.0:
            order = jnp.argsort(-logp, axis=-1)
            p_sorted = jnp.exp(jnp.take_along_axis(logp, order, axis=-1))
            keep_sorted = (jnp.cumsum(p_sorted, axis=-1) - p_sorted) < top_p  # always keeps the most likely
            keep = jnp.zeros_like(keep_sorted).at[jnp.arange(logp.shape[0])[:, None], order].set(keep_sorted)
            masked = jnp.where(keep, logp, -jnp.inf)
        tok = jax.random.categorical(key, masked, axis=-1)
    tok = tok.astype(jnp.int32)
    return tok, jnp.take_along_axis(logp, tok[:, None], axis=-1)[:, 0]
