"""Pallas TPU kernels for DeepSeek Sparse Attention and a Pallas GPU grouped matmul for the MoE, each beside its XLA
reference:

| module           | kernel       | XLA reference          |
|------------------|--------------|------------------------|
| `indexer`        | `index_topk` | `index_topk_reference` |
| `sparse_mla`     | `sparse_mla` | `sparse_mla_reference` |
| `grouped_matmul` | `gmm` (GPU)  | `gmm_reference`        |

A library on jax alone: the model's choice between these kernels and its own XLA functions
(`ModelConfig(attention_impl="xla" | "pallas")`) is made in `glmjax.model.backends` (the grouped matmul:
`model.moe_impl`, `glmjax.model.moe`). Off TPU the TPU kernels run in Pallas' TPU interpret mode
(`common.interpret_params`), off a GPU the GPU kernel in Pallas' interpret mode; the block-size table of each
kernel is in its module docstring.
"""
from pallas_kernels.indexer import index_topk, index_topk_reference
from pallas_kernels.sparse_mla import sparse_mla, sparse_mla_reference

__all__ = ["index_topk", "index_topk_reference", "sparse_mla", "sparse_mla_reference"]
