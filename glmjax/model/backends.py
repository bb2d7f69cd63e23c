"""The attention backends `ModelConfig.attention_impl` selects (`BACKENDS`): the functions that compute the
lightning indexer's top-k, the sparse MLA attention and the sparse-stage index scores (docs/model.md B.6, B.7, E.3).

    "xla":    indexer.index_topk,        sparse_attention.sparse_mla_xla, indexer.gathered_index_logits
    "pallas": pallas_kernels.index_topk, pallas_kernels.sparse_mla,       indexer.gathered_index_logits

A forward may also be handed a `Backend` of its own (`Ctx.backend`), e.g. one that records what the layers select.
"""
from __future__ import annotations

from typing import Callable, NamedTuple

import pallas_kernels
from glmjax.model import indexer, sparse_attention


class Backend(NamedTuple):
    index_topk: Callable  # (q, k, w, q_seg, k_seg, topk, block_q, q_idx) -> (indices [B,S,k'], scores)
    sparse_mla: Callable  # (q, kv, indices, *, scale, kv_lora_rank, block_q) -> (out [B,S,H,R], lse [B,S,H])
    gathered_index_logits: Callable  # (q, k, w, indices, block_q) -> index scores at the selected keys [B,S,k']


XLA = Backend(indexer.index_topk, sparse_attention.sparse_mla_xla, indexer.gathered_index_logits)
# The gathered index scores are gathers and small batched matmuls that XLA fuses well: there is no Pallas kernel
# for them, so the Pallas backend uses the XLA function.
PALLAS = Backend(pallas_kernels.index_topk, pallas_kernels.sparse_mla, indexer.gathered_index_logits)
BACKENDS = {"xla": XLA, "pallas": PALLAS}
