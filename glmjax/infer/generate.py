"""`generate`: batched prompts of different lengths -> sampled tokens and their log-probabilities."""
from __future__ import annotations

from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from glmjax.infer.decode import Decoder, sample


class Generation(NamedTuple):
    tokens: np.ndarray  # [B, N] int32 generated tokens (pad_id after a row stopped)
    logprobs: np.ndarray  # [B, N] f32 log-prob of each generated token (0 after a row stopped)
    lengths: np.ndarray  # [B] number of generated tokens per row, including the stop token


def generate(decoder: Decoder, prompts: Sequence[Sequence[int]], max_new_tokens: int, *, key: jax.Array,
             temperature: float = 0.0, top_p: float = 1.0, stop_tokens: Sequence[int] = (), pad_id: int = 0,
             max_len: int | None = None) -> Generation:
    """Prefill all prompts (right-padded), then decode token by token until every row hit a stop token or
    max_new_tokens. `key` drives sampling (one split per step); temperature 0 is greedy. max_len: the cache
    capacity (default: longest prompt + max_new_tokens, rounded up to `decoder.cache_multiple`)."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("generate: every prompt needs at least one token")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens}: must be >= 1")
    if temperature < 0 or not 0 < top_p <= 1:
        raise ValueError(f"temperature={temperature} must be >= 0 and top_p={top_p} in (0, 1]")
    B = len(prompts)
    lengths = np.array([len(p) for p in prompts], np.int32)
    S = int(lengths.max())
    need = S + max_new_tokens
    m = decoder.cache_multiple  # a mesh's context shards split the cache's slots
    max_len = -(-need // m) * m if max_len is None else max_len
    if max_len < need:
        raise ValueError(f"max_len={max_len} < longest prompt {S} + max_new_tokens {max_new_tokens}")
    vocab = decoder.model.cfg.vocab_size
    tokens = np.full((B, S), pad_id, np.int32)
    for b, p in enumerate(prompts):
        if min(p) < 0 or max(p) >= vocab:
            raise ValueError(f"prompt {b} has token ids outside [0, {vocab})")
        tokens[b, :len(p)] = p
    caches = decoder.init_cache(B, max_len)
    logits, caches = decoder.prefill(decoder.state, jnp.asarray(tokens), jnp.asarray(lengths), caches)
    cur = jnp.asarray(lengths)
    out_tok = np.full((B, max_new_tokens), pad_id, np.int32)
    out_lp = np.zeros((B, max_new_tokens), np.float32)
    done = np.zeros(B, bool)
    n_gen = np.zeros(B, np.int32)
    stops = np.asarray(list(stop_tokens), np.int32)
    for i in range(max_new_tokens):
        key, sub = jax.random.split(key)
        tok, lp = sample(logits, sub, temperature=float(temperature), top_p=float(top_p))
        tok_np, lp_np = np.asarray(tok), np.asarray(lp)
        live = ~done
        out_tok[live, i], out_lp[live, i] = tok_np[live], lp_np[live]
        n_gen[live] += 1
        done |= live & np.isin(tok_np, stops)
        if done.all() or i == max_new_tokens - 1:
            break
        logits, caches = decoder.decode(decoder.state, tok, cur, caches)
        cur = cur + 1
    return Generation(out_tok, out_lp, n_gen)
