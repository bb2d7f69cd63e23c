"""Position blocking: [B,S,...] <-> [nb,B,bq,...], so a `lax.map` / `lax.scan` runs over blocks of bq positions
(query blocks of the indexer and sparse attention, loss chunks) and only one block's temporaries are live."""
from __future__ import annotations

import jax.numpy as jnp


def to_blocks(a, bq: int, fill=0):
    """[B,S,...] -> [nb,B,bq,...], nb = ceil(S / bq), the tail padded with `fill`."""
    B, S = a.shape[:2]
    nb = -(-S // bq)
    a = jnp.pad(a, [(0, 0), (0, nb * bq - S)] + [(0, 0)] * (a.ndim - 2), constant_values=fill)
    return jnp.moveaxis(a.reshape((B, nb, bq) + a.shape[2:]), 1, 0)


def from_blocks(a, S: int):
    """[nb,B,bq,...] -> [B,S,...] (the padded tail dropped)."""
    a = jnp.moveaxis(a, 0, 1)
    return a.reshape((a.shape[0], -1) + a.shape[3:])[:, :S]
