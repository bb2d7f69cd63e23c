"""The attention backends `ModelConfig.attention_impl` selects (`BACKENDS`): the functions that compute the
lightning indexer's top-k, the sparse MLA attention and the sparse-stage index scores (docs/model.md B.6, B.7, E.3).

    "xla":    indexer.index_topk, sparse_attention.sparse_mla_xla, indexer.gathered_index_logits
    "pallas": index_topk_on_mesh, sparse_mla_on_mesh,              indexer.gathered_index_logits

"pallas" runs the Pallas TPU kernels (pallas_kernels/indexer.py, sparse_mla.py; interpreted off TPU), except on an
NVIDIA GPU: there the top-k is XLA's (`indexer.index_topk`; the TPU kernel has no GPU lowering) and the sparse MLA
the Pallas GPU kernel (pallas_kernels/sparse_mla_gpu.py: its backward adds the row gradients by atomic adds).

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
natural order): there, and without a mesh or on one device, the kernels are called as they are. A decode step on a
mesh with context > 1 (glmjax/infer/decode.py) calls them with the context axis still automatic and the cache split
over it along T: then each shard runs the kernels on its own slots and the results are merged (`_index_topk_split`,
`_sparse_mla_split`); the cache never moves.
"""
from __future__ import annotations

import functools
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

import pallas_kernels
from glmjax import hardware
from glmjax.model import context, indexer, sparse_attention
from glmjax.parallel.rules import logical_spec
from pallas_kernels import sparse_mla_gpu


class Backend(NamedTuple):
    index_topk: Callable  # (q, k, w, q_seg, k_seg, topk, block_q, q_idx) -> (indices [B,S,k'], scores)
    sparse_mla: Callable  # (q, kv, indices, *, scale, kv_lora_rank, block_q) -> (out [B,S,H,R], lse [B,S,H])
    gathered_index_logits: Callable  # (q, k, w, indices, block_q) -> index scores at the selected keys [B,S,k']


def _on_mesh(kernel, axes, *args, split_keys, native=("tpu",), **static):
    """kernel(*args, **static) on the mesh in context: in shard_map (`local_queries`, keys whole), or directly without
    a mesh, on one device, or inside a region where every mesh axis is already manual. With the context axis still
    automatic (not inside the model's context-parallel shard_map: decoding against a cache split over context,
    glmjax/infer/decode.py), `split_keys(kernel, *args, **static)` instead. native: the platforms the kernel is
    compiled for (interpreted on others: the TPU kernels by the mesh's devices, the GPU one by
    `hardware.platform()`)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return kernel(*args, **static)
    if native == hardware.GPU_PLATFORMS:
        interpret = hardware.platform() not in hardware.GPU_PLATFORMS
    else:
        interpret = mesh.abstract_device is None or mesh.abstract_device.platform != "tpu"  # Mosaic for a TPU mesh
    kernel = functools.partial(kernel, interpret=interpret)
    if not context.needs_shard_map(mesh):
        return kernel(*args, **static)
    if context.context_size(mesh) > 1:
        return split_keys(kernel, *args, **static)
    return context.local_queries(context.Layout("contiguous", 1), kernel, *axes)(*args, **static)


def _split_keys(body, queries: tuple, keys: tuple, n_out: int):
    """shard_map of body(key_axes, offset, *queries, *keys) over the mesh in context: query arguments [B,S,...] split
    over the batch axes only, key arguments [B,T,...] over the batch axes and, along T, context (the cache's layout,
    glmjax/infer/decode.py); offset = the first key slot of this shard. Its n_out outputs are split like the queries."""
    mesh = jax.sharding.get_abstract_mesh()
    q_specs = [logical_spec(("batch",) + (None,) * (a.ndim - 1), a.shape, mesh) for a in queries]
    k_specs = [logical_spec(("batch", "sequence") + (None,) * (a.ndim - 2), a.shape, mesh) for a in keys]
    key_axes = k_specs[0][1]
    if key_axes is None:
        raise ValueError(f"keys {keys[0].shape}: T does not split over context {context.context_size(mesh)}")

    def wrapped(*args):
        offset = jax.lax.axis_index(key_axes) * args[len(queries)].shape[1]
        return body(key_axes, offset, *args)

    return jax.shard_map(wrapped, in_specs=tuple(q_specs + k_specs), out_specs=(P(q_specs[0][0]),) * n_out,
                         check_vma=False)(*queries, *keys)


def _index_topk_split(kernel, q, k, w, q_seg, k_seg, topk, block_q, q_idx):
    """Each context shard's top-k over its T/N keys (query slots shifted into its range), then the exact top-k of
    the N x k' candidates, all-gathered in slot order (equal scores: the lower slot first, as on one device)."""
    kk = min(topk, k.shape[1])

    def body(axes, off, q, w, q_seg, q_idx, k, k_seg):
        ids, vals = kernel(q, k, w, q_seg, k_seg, topk, block_q, q_idx - off)
        ids = jnp.where(ids >= 0, ids + off, -1)
        ids, vals = (jax.lax.all_gather(a, axes, axis=a.ndim - 1, tiled=True) for a in (ids, vals))
        vals, pick = jax.lax.top_k(vals, kk)
        return jnp.take_along_axis(ids, pick, axis=-1), vals

    return _split_keys(body, (q, w, q_seg, q_idx), (k, k_seg), 2)


def _sparse_mla_split(kernel, q, kv, indices, **static):
    """Each context shard attends over the selected rows it holds (flash-decoding): its normalised output and
    log-sum-exp, combined over context with weights exp(lse_i - max lse)."""

    def body(axes, off, q, indices, kv):
        local = indices - off
        mine = (indices >= 0) & (local >= 0) & (local < kv.shape[1])
        out, lse = kernel(q, kv, jnp.where(mine, local, -1), **static)
        m = jax.lax.pmax(lse, axes)
        m = jnp.where(jnp.isfinite(m), m, 0.0)
        wgt = jnp.exp(lse - m)  # 0 on a shard none of whose rows this query selected
        den = jax.lax.psum(wgt, axes)
        num = jax.lax.psum(out.astype(jnp.float32) * wgt[..., None], axes)
        out = (num / jnp.where(den > 0, den, 1.0)[..., None]).astype(q.dtype)
        return out, jnp.where(den > 0, m + jnp.log(jnp.where(den > 0, den, 1.0)), -jnp.inf)

    return _split_keys(body, (q, indices), (kv,), 2)


def index_topk_on_mesh(q, k, w, q_seg, k_seg, topk: int, block_q: int, q_idx=None):
    """`pallas_kernels.index_topk` on the mesh in context: each shard scores its queries against all keys (or, on a
    cache split over context, its keys, then the top-k of the candidates: `_index_topk_split`)."""
    if hardware.platform() in hardware.GPU_PLATFORMS:
        return indexer.index_topk(q, k, w, q_seg, k_seg, topk, block_q, q_idx)
    q_idx = jnp.broadcast_to(jnp.arange(q.shape[1], dtype=jnp.int32) if q_idx is None else q_idx, q.shape[:2])
    return _on_mesh(pallas_kernels.index_topk, context.INDEX_TOPK, q, k, w, q_seg, k_seg, topk, block_q, q_idx,
                    split_keys=_index_topk_split)


def sparse_mla_on_mesh(q, kv, indices, *, scale: float, kv_lora_rank: int, block_q: int = 256):
    """`pallas_kernels.sparse_mla` on the mesh in context: each shard attends with its queries and heads over the
    whole latent (the indices are global key slots; on a cache split over context: `_sparse_mla_split`). On an
    NVIDIA GPU the Pallas GPU kernel (`sparse_mla_gpu_kernel`)."""
    gpu = hardware.platform() in hardware.GPU_PLATFORMS
    return _on_mesh(sparse_mla_gpu_kernel if gpu else pallas_kernels.sparse_mla, context.SPARSE_MLA, q, kv, indices,
                    scale=scale, kv_lora_rank=kv_lora_rank, block_q=block_q, split_keys=_sparse_mla_split,
                    native=hardware.GPU_PLATFORMS if gpu else ("tpu",))


def sparse_mla_gpu_kernel(q, kv, indices, *, interpret: bool | None = None, **static):
    """`pallas_kernels.sparse_mla_gpu.sparse_mla`, interpreted unless traced for an NVIDIA GPU (interpret None)."""
    interpret = hardware.platform() not in hardware.GPU_PLATFORMS if interpret is None else interpret
    return sparse_mla_gpu.sparse_mla(q, kv, indices, interpret=bool(interpret), **static)


XLA = Backend(indexer.index_topk, sparse_attention.sparse_mla_xla, indexer.gathered_index_logits)
# The gathered index scores are gathers and small batched matmuls that XLA fuses well: there is no Pallas kernel
# for them, so the Pallas backend uses the XLA function.
PALLAS = Backend(index_topk_on_mesh, sparse_mla_on_mesh, indexer.gathered_index_logits)
BACKENDS = {"xla": XLA, "pallas": PALLAS}
