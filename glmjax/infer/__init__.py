"""Inference: MLA latent cache, absorbed-weight prefill/decode (dense or top-k sparse), sampling, generate,
speculative decoding with the MTP layer."""
from glmjax.infer.decode import Decoder, forward_cached, init_cache, sample
from glmjax.infer.generate import Generation, generate
from glmjax.infer.speculative import SpeculativeDecoder

__all__ = ["Decoder", "Generation", "SpeculativeDecoder", "forward_cached", "generate", "init_cache", "sample"]
