"""Inference: MLA latent cache, absorbed-weight prefill/decode (dense or top-k sparse), sampling, generate."""
from glmjax.infer.decode import Decoder, forward_cached, init_cache, sample
from glmjax.infer.generate import Generation, generate

__all__ = ["Decoder", "Generation", "forward_cached", "generate", "init_cache", "sample"]
