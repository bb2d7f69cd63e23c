"""Building blocks: parameters with logical axis names, RMSNorm, LayerNorm, RoPE (interleaved / half-split, YaRN)."""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from glmjax.config import ModelConfig, yarn_mscale

f32 = jnp.float32


def dtype_of(name: str):
    return {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}[name]


def param(value: jax.Array, axes: tuple[str | None, ...]) -> nnx.Param:
    """A parameter carrying logical axis names (mapped to mesh axes by one rules table, never named here)."""
    assert len(axes) == value.ndim, (axes, value.shape)
    return nnx.Param(value, out_sharding=axes, eager_sharding=False)


def normal_param(rngs: nnx.Rngs, shape, axes, cfg: ModelConfig, std: float | None = None) -> nnx.Param:
    std = cfg.init_std if std is None else std
    value = std * jax.random.truncated_normal(rngs.params(), -2.0, 2.0, shape, f32)
    return param(value.astype(dtype_of(cfg.param_dtype)), axes)


def dense(x: jax.Array, kernel: jax.Array, spec: str, dtype) -> jax.Array:
    """einsum in the compute dtype (inputs and weights cast), e.g. spec='bsd,dr->bsr'."""
    return jnp.einsum(spec, x.astype(dtype), kernel.astype(dtype))


class RMSNorm(nnx.Module):
    """w * x / sqrt(mean(x^2) + eps); statistics and the scale multiply in f32 (DeepSeek reference, docs/model.md B.3)."""

    def __init__(self, dim: int, eps: float, cfg: ModelConfig, axes=("norm",)):
        self.eps = eps
        self.weight = param(jnp.ones((dim,), dtype_of(cfg.param_dtype)), axes)

    def __call__(self, x: jax.Array) -> jax.Array:
        xf = x.astype(f32)
        y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return (y * self.weight[...].astype(f32)).astype(x.dtype)


class LayerNorm(nnx.Module):
    """LayerNorm with weight and bias, computed in f32 (the indexer's k_norm, docs/model.md F-5)."""

    def __init__(self, dim: int, eps: float, cfg: ModelConfig):
        self.eps = eps
        self.weight = param(jnp.ones((dim,), dtype_of(cfg.param_dtype)), ("norm",))
        self.bias = param(jnp.zeros((dim,), dtype_of(cfg.param_dtype)), ("norm",))

    def __call__(self, x: jax.Array) -> jax.Array:
        xf = x.astype(f32)
        mu = jnp.mean(xf, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(xf - mu), axis=-1, keepdims=True)
        return (xf - mu) * jax.lax.rsqrt(var + self.eps) * self.weight[...].astype(f32) + self.bias[...].astype(f32)


# ----------------------------------------------------------------------------------------------- RoPE


def rope_inv_freq(cfg: ModelConfig) -> np.ndarray:
    """inv_freq_j = theta^(-2j/d), j < d/2; with YaRN the low frequencies are interpolated (docs/model.md B.5)."""
    d = cfg.qk_rope_head_dim
    base = cfg.rope_theta
    inv = 1.0 / base ** (np.arange(0, d, 2, dtype=np.float64) / d)
    if not cfg.yarn:
        return inv.astype(np.float32)
    rs = cfg.rope_scaling
    factor = float(rs["factor"])
    orig = float(rs["original_max_position_embeddings"])

    def correction_dim(n_rot):
        return d * math.log(orig / (n_rot * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(correction_dim(rs.get("beta_fast", 32))), 0)
    high = min(math.ceil(correction_dim(rs.get("beta_slow", 1))), d - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(d // 2, dtype=np.float64) - low) / (high - low), 0.0, 1.0)
    return (inv / factor * ramp + inv * (1.0 - ramp)).astype(np.float32)


def rope_attention_factor(cfg: ModelConfig) -> float:
    """Scale on cos/sin (HF `attention_factor`); 1.0 unless YaRN's mscale != mscale_all_dim."""
    if not cfg.yarn:
        return 1.0
    rs = cfg.rope_scaling
    if rs.get("attention_factor") is not None:
        return float(rs["attention_factor"])
    if rs.get("mscale") and rs.get("mscale_all_dim"):
        return yarn_mscale(rs["factor"], rs["mscale"]) / yarn_mscale(rs["factor"], rs["mscale_all_dim"])
    return yarn_mscale(rs["factor"], 1.0)


def rope_tables(positions: jax.Array, cfg: ModelConfig) -> tuple[jax.Array, jax.Array]:
    """positions [B, S] -> cos, sin [B, S, d_r/2] in f32."""
    angles = positions.astype(f32)[..., None] * jnp.asarray(rope_inv_freq(cfg))
    a = rope_attention_factor(cfg)
    return jnp.cos(angles) * a, jnp.sin(angles) * a


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array, interleave: bool) -> jax.Array:
    """Rotate x [B, S, (H,) d] by cos/sin [B, S, d/2].

    interleave=True: pairs (x_2j, x_2j+1) (GPT-J / DeepSeek reference layout, kept in place);
    interleave=False: pairs (x_j, x_j+d/2) (NeoX / half-split).
    """
    if x.ndim == 4:
        cos, sin = cos[:, :, None, :], sin[:, :, None, :]
    xf = x.astype(f32)
    if interleave:
        x1, x2 = xf[..., 0::2], xf[..., 1::2]
        out = jnp.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).reshape(x.shape)
    else:
        h = x.shape[-1] // 2
        x1, x2 = xf[..., :h], xf[..., h:]
        out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)
