"""The attention backends `ModelConfig.attention_impl` selects (`BACKENDS`): the functions that compute the
lightning indexer's top-k, the sparse MLA attention and the sparse-stage index scores (docs/model.md B.6, B.7, E.3).

    "xla":    indexer.index_topk, sparse_attention.sparse_mla_xla, indexer.gathered_index_logits
    "pallas": index_topk_on_mesh, sparse_mla_on_mesh,              indexer.gathered_index_logits

A forward may also be handed a `Backend` of its own (`Ctx.backend`), e.g. one that records what the layers select.

XLA partitions the "xla" functions over any mesh by itself; Mosaic kernels cannot be partitioned automatically, so
the "pallas" functions run the kernels inside `jax.shard_map` over the mesh the step is traced for (the abstract
mesh in context, `glmjax.parallel.with_mesh`) by `glmjax.model.context.local_queries`, with specs from the
logical-axis rules: rows over the batch axes, sparse-MLA queries over context (sequence) and tensor (heads),
indexer queries over context and tensor (the "index_queries" rule). Keys -- the latent rows [B,T,576], indexer
keys [B,T,d_I] and key segment ids -- enter replicated along context and tensor (XLA all-gathers them); the
backward sums their gradients over those axes (the shard_map transpose). Every query gets its global key slot
(q_idx, sharded like the queries), so each shard selects exactly the keys one device would. Under context
parallelism the model already calls the backend inside a shard_map (the layout's local queries, keys gathered in
natural order): there, and without a mesh or on one device, the kernels are called as they are.
"""
from __future__ import annotations

import functools
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

import pallas_kernels
from glmjax.model import context, indexer, sparse_attention


class Backend(NamedTuple):
    index_topk: Callable  # (q, k, w, q_seg, k_seg, topk, block_q, q_idx) -> (indices [B,S,k'], scores)
    sparse_mla: Callable  # (q, kv, indices, *, scale, kv_lora_rank, block_q) -> (out [B,S,H,R], lse [B,S,H])
    gathered_index_logits: Callable  # (q, k, w, indices, block_q) -> index scores at the selected keys [B,S,k']


def _on_mesh(kernel, axes, *args, **static):
    """kernel(*args, **static) on the mesh in context: in shard_map (`local_queries`, keys whole), or directly without
    a mesh, on one device, or inside a region where every mesh axis is already manual."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return kernel(*args, **static)
    interpret = mesh.abstract_device is None or mesh.abstract_device.platform != "tpu"  # Mosaic for a TPU mesh
    kernel = functools.partial(kernel, interpret=interpret)
    if not context.needs_shard_map(mesh):
        return kernel(*args, **static)
    return context.local_queries(context.Layout("contiguous", 1), kernel, *axes)(*args, **static)


def index_topk_on_mesh(q, k, w, q_seg, k_seg, topk: int, block_q: int, q_idx=None):
    """`pallas_kernels.index_topk` on the mesh in context: each shard scores its queries against all keys."""
    q_idx = jnp.broadcast_to(jnp.arange(q.shape[1], dtype=jnp.int32) if q_idx is None else q_idx, q.shape[:2])
    return _on_mesh(pallas_kernels.index_topk, context.INDEX_TOPK, q, k, w, q_seg, k_seg, topk, block_q, q_idx)


def sparse_mla_on_mesh(q, kv, indices, *, scale: float, kv_lora_rank: int, block_q: int = 256):
    """`pallas_kernels.sparse_mla` on the mesh in context: each shard attends with its queries and heads over the
    whole latent (the indices are global key slots)."""
    return _on_mesh(pallas_kernels.sparse_mla, context.SPARSE_MLA, q, kv, indices, scale=scale,
                    kv_lora_rank=kv_lora_rank, block_q=block_q)


XLA = Backend(indexer.index_topk, sparse_attention.sparse_mla_xla, indexer.gathered_index_logits)
# The gathered index scores are gathers and small batched matmuls that XLA fuses well: there is no Pallas kernel
# for them, so the Pallas backend uses the XLA function.
PALLAS = Backend(index_topk_on_mesh, sparse_mla_on_mesh, indexer.gathered_index_logits)
BACKENDS = {"xla": XLA, "pallas": PALLAS}
