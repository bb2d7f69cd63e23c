"""Pallas kernels, each beside its XLA reference: for TPU the DeepSeek Sparse Attention kernels, for NVIDIA GPUs
(Triton backend) a sparse MLA and the MoE's grouped matmul.

| module           | kernel             | XLA reference                      |
|------------------|--------------------|------------------------------------|
| `indexer`        | `index_topk`       | `index_topk_reference`             |
| `sparse_mla`     | `sparse_mla`       | `sparse_mla_reference`             |
| `sparse_mla_gpu` | `sparse_mla` (GPU) | `sparse_mla.sparse_mla_reference`  |
| `grouped_matmul` | `gmm` (GPU)        | `glmjax.model.moe.block_matmul`    |

A library on jax alone: the model's choice between these kernels and its own XLA functions is made in
`glmjax.model.backends` (`ModelConfig(attention_impl="xla" | "pallas")`; "pallas" on a GPU takes the GPU sparse
MLA) and `glmjax.model.moe` (`model.moe_impl`). Off TPU the TPU kernels run in Pallas' TPU interpret mode
(`common.interpret_params`), off a GPU the GPU kernels in Pallas' interpret mode; the block-size table of each
kernel is in its module docstring.
"""
from pallas_kernels.indexer import index_topk, index_topk_reference
from pallas_kernels.sparse_mla import sparse_mla, sparse_mla_reference

__all__ = ["index_topk", "index_topk_reference", "sparse_mla", "sparse_mla_reference"]
