"""Needle recall: how often each DSA indexer's top-k holds the needle a retrieval prompt hides.

For one prompt, a layer's needle recall is the share of pairs (q, p), p a position of a needle statement and q a query
from the statement's last position on (q sees the whole statement), with p in the indexer's top-k of q. An indexer that
scores the needle highest gets 1.0; a random top-k of the q + 1 visible keys gets k / (q + 1) per pair, about k / S
for needles early in a prompt of S tokens.

The top-k are the indexers' (`Aux.index_topk`, one per layer with its own indexer) on a dense forward of the prompt:
for the first full layer exactly the keys a sparse forward attends to; for later ones the selection on the dense
model's hidden states.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from glmjax.model import GLM, Batch


def needle_recall(topk: np.ndarray, spans) -> np.ndarray:
    """topk [B,S,k] key positions (-1: none), spans: per row, the [start, end) token positions of its needles ->
    [B] recall (NaN for a row whose needles end at its last position: no query after them)."""
    topk = np.asarray(topk)
    B, S, _ = topk.shape
    out = np.full(B, np.nan)
    for b in range(B):
        hits = pairs = 0
        for start, end in spans[b]:
            if not 0 <= start < end <= S:
                raise ValueError(f"needle [{start}, {end}) outside the row's {S} positions")
            keys = topk[b, end - 1:]  # the queries from the statement's last position on
            chosen = np.zeros((keys.shape[0], S + 1), bool)  # column S: the -1 slots
            chosen[np.arange(keys.shape[0])[:, None], np.where(keys < 0, S, keys)] = True
            hits += int(chosen[:, start:end].sum())
            pairs += chosen.shape[0] * (end - start)
        if pairs:
            out[b] = hits / pairs
    return out


@nnx.jit
def _index_topk(model: GLM, tokens: jax.Array) -> jax.Array:
    B, S = tokens.shape
    batch = Batch(tokens, jnp.ones((B, S), jnp.int32), jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S)))
    return model(batch, "dense", topk_stats=True)[1].index_topk


def index_topk(model: GLM, tokens) -> np.ndarray:
    """tokens [B,S] (one document per row) -> the top-k of every layer with its own indexer [F,B,S,k]."""
    return np.asarray(jax.device_get(_index_topk(model, jnp.asarray(tokens, jnp.int32))))
