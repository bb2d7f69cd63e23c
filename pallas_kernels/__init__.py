"""Pallas TPU kernels for DeepSeek Sparse Attention, each beside its XLA reference with the same signature:

| module       | kernel       | XLA reference          |
|--------------|--------------|------------------------|
| `indexer`    | `index_topk` | `index_topk_reference` |
| `sparse_mla` | `sparse_mla` | `sparse_mla_reference` |

A library on jax alone: the model's choice between these kernels and its own XLA functions
(`ModelConfig(attention_impl="xla" | "pallas")`) is made in `glmjax.model.backends`. Off TPU the kernels run in
Pallas' TPU interpret mode (`common.interpret_params`); the block-size table of each kernel is in its module
docstring.
"""
from pallas_kernels.indexer import index_topk, index_topk_reference
from pallas_kernels.sparse_mla import sparse_mla, sparse_mla_reference

__all__ = ["index_topk", "index_topk_reference", "sparse_mla", "sparse_mla_reference"]
