"""Pallas TPU kernels for DeepSeek Sparse Attention, each with the signature of its XLA reference:

| module            | function                | XLA reference                                        |
|-------------------|-------------------------|------------------------------------------------------|
| `indexer`         | `index_topk`            | `glmjax.model.indexer.index_topk`                    |
| `sparse_mla`      | `sparse_mla`            | `glmjax.model.sparse_attention.sparse_mla_xla`       |
| `index_scores`    | `gathered_index_logits` | `glmjax.model.indexer.gathered_index_logits` (XLA, custom VJP) |

Importing the package registers "pallas" in `glmjax.model.mla.INDEX_TOPK`, `SPARSE_ATTENTION` and
`GATHERED_INDEX_LOGITS` (the sparse-stage indexer loss), which is what
`ModelConfig(attention_impl="pallas")` selects. Off TPU the kernels run in Pallas' TPU interpret mode
(`common.interpret_params`); the block-size table of each kernel is in its module docstring.
"""
from glmjax.model import mla as _mla
from pallas_kernels.index_scores import gathered_index_logits
from pallas_kernels.indexer import index_topk
from pallas_kernels.sparse_mla import sparse_mla

_mla.INDEX_TOPK["pallas"] = index_topk
_mla.SPARSE_ATTENTION["pallas"] = sparse_mla
_mla.GATHERED_INDEX_LOGITS["pallas"] = gathered_index_logits

__all__ = ["gathered_index_logits", "index_topk", "sparse_mla"]
