"""glmjax: GLM-5 / DeepSeek-V3.2-class models (MoE + MLA + DeepSeek Sparse Attention) in JAX / Flax NNX."""
from glmjax.config import ConfigError, ModelConfig

__all__ = ["ConfigError", "ModelConfig"]
__version__ = "0.1.0"
