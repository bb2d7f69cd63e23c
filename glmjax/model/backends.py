"""The attention backends `ModelConfig.attention_impl` selects (`BACKENDS`): the functions that compute the
lightning indexer's top-k, the sparse MLA attention and the sparse-stage index scores (docs/model.md B.6, B.7, E.3).

    "xla":    indexer.index_topk, sparse_attention.sparse_mla_xla, indexer.gathered_index_logits
    "pallas": index_topk_on_mesh, sparse_mla_on_mesh,              indexer.gathered_index_logits

A forward may also be handed a `Backend` of its own (`Ctx.backend`), e.g. one that records what the layers select.

XLA partitions the "xla" functions over any mesh by itself; Mosaic kernels cannot be partitioned automatically, so
the "pallas" functions run the kernels inside `jax.shard_map` over the mesh the step is traced for (the abstract
mesh in context, `glmjax.parallel.with_mesh`), with specs from the logical-axis rules: rows over the batch axes,
sparse-MLA queries over context (sequence) and tensor (heads), indexer queries over context and tensor (see the
"index_queries" rule). Keys -- the latent rows [B,T,576], indexer keys [B,T,d_I] and key segment ids -- are
replicated along context and tensor, i.e. all-gathered on the way in; the backward sums their gradients over those
axes (the shard_map transpose) before XLA slices them back to context shards. Every query gets its global key slot
(q_idx, sharded like the queries), so each shard selects exactly the keys one device would. Without a mesh, or on
one device, the kernels are called as they are.
"""
from __future__ import annotations

import functools
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

import pallas_kernels
from glmjax.model import indexer, sparse_attention
from glmjax.parallel.rules import logical_spec


class Backend(NamedTuple):
    index_topk: Callable  # (q, k, w, q_seg, k_seg, topk, block_q, q_idx) -> (indices [B,S,k'], scores)
    sparse_mla: Callable  # (q, kv, indices, *, scale, kv_lora_rank, block_q) -> (out [B,S,H,R], lse [B,S,H])
    gathered_index_logits: Callable  # (q, k, w, indices, block_q) -> index scores at the selected keys [B,S,k']


def _mesh():
    """The mesh in context when it has more than one device, else None."""
    mesh = jax.sharding.get_abstract_mesh()
    return None if mesh.empty or mesh.size == 1 else mesh


def _interpret(mesh) -> bool:
    """Mosaic for a TPU mesh (also when compiling for a TPU topology from a CPU host), else interpreted."""
    return mesh.abstract_device is None or mesh.abstract_device.platform != "tpu"


def index_topk_on_mesh(q, k, w, q_seg, k_seg, topk: int, block_q: int, q_idx=None):
    """`pallas_kernels.index_topk` on the mesh in context: each shard scores its queries against all keys."""
    mesh = _mesh()
    if mesh is None:
        return pallas_kernels.index_topk(q, k, w, q_seg, k_seg, topk, block_q, q_idx)
    B, S = q.shape[:2]
    b, s = logical_spec(("batch", "index_queries"), (B, S), mesh)
    q_idx = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32) if q_idx is None else q_idx, (B, S))  # global slots
    fn = functools.partial(pallas_kernels.index_topk, topk=topk, block_q=block_q, interpret=_interpret(mesh))
    rows, queries = P(b), P(b, s)
    return jax.shard_map(lambda q, k, w, qs, ks, qi: fn(q, k, w, qs, ks, q_idx=qi),
                         in_specs=(queries, rows, queries, queries, rows, queries), out_specs=(queries, queries),
                         check_vma=False)(q, k, w, q_seg, k_seg, q_idx)


def sparse_mla_on_mesh(q, kv, indices, *, scale: float, kv_lora_rank: int, block_q: int = 256):
    """`pallas_kernels.sparse_mla` on the mesh in context: each shard attends with its queries and heads over the
    whole latent (the indices are global key slots)."""
    fn = functools.partial(pallas_kernels.sparse_mla, scale=scale, kv_lora_rank=kv_lora_rank, block_q=block_q)
    mesh = _mesh()
    if mesh is None:
        return fn(q, kv, indices)
    b, s, h = logical_spec(("batch", "sequence", "heads"), q.shape[:3], mesh)
    return jax.shard_map(functools.partial(fn, interpret=_interpret(mesh)),
                         in_specs=(P(b, s, h), P(b), P(b, s)), out_specs=(P(b, s, h), P(b, s, h)),
                         check_vma=False)(q, kv, indices)


XLA = Backend(indexer.index_topk, sparse_attention.sparse_mla_xla, indexer.gathered_index_logits)
# The gathered index scores are gathers and small batched matmuls that XLA fuses well: there is no Pallas kernel
# for them, so the Pallas backend uses the XLA function.
PALLAS = Backend(index_topk_on_mesh, sparse_mla_on_mesh, indexer.gathered_index_logits)
BACKENDS = {"xla": XLA, "pallas": PALLAS}
