"""Flax NNX modules: norms + RoPE, MLA, lightning indexer, sparse attention (XLA), the attention backends (XLA or
pallas_kernels), MoE, MTP, the decoder."""
from glmjax.model.transformer import GLM, Batch, plan_stacks

__all__ = ["GLM", "Batch", "plan_stacks"]
