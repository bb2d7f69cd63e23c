"""Hugging Face safetensors import/export (glm_moe_dsa / deepseek_v32; deepseek_v3 imported with fresh indexers). See
glmjax/interop/hf.py and docs/interop.md.

Names resolve lazily: importing the package does not import hf.py (jax, orbax, the model).
"""
import importlib

_NAMES = {
    "HFCheckpointError": "hf", "HFLayout": "hf", "check_hf": "hf", "dequantize_fp8": "hf", "load_hf": "hf",
    "logical_sharding": "hf", "save_hf": "hf", "config_from_hf": "keymap", "config_to_hf": "keymap",
}
__all__ = sorted(_NAMES)


def __getattr__(name):
    if name in _NAMES:
        return getattr(importlib.import_module(f"glmjax.interop.{_NAMES[name]}"), name)
    raise AttributeError(f"module 'glmjax.interop' has no attribute {name!r}")
