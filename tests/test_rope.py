"""RoPE layouts, YaRN frequencies and scales, norms -- against closed forms."""
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from glmjax.config import ModelConfig
from glmjax.model.layers import LayerNorm, RMSNorm, apply_rope, rope_inv_freq, rope_tables
from helpers import tiny

YARN = {"rope_type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32,
        "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}


def test_interleaved_rope_is_a_complex_rotation_of_pairs():
    cfg = tiny()
    x = jax.random.normal(jax.random.key(0), (1, 5, 16))
    pos = jnp.arange(5)[None]
    cos, sin = rope_tables(pos, cfg)
    got = np.asarray(apply_rope(x, cos, sin, interleave=True))
    inv = 10000.0 ** (-np.arange(0, 16, 2) / 16)
    z = np.asarray(x[..., 0::2]) + 1j * np.asarray(x[..., 1::2])
    rot = z * np.exp(1j * np.arange(5)[None, :, None] * inv)
    np.testing.assert_allclose(got[..., 0::2], rot.real, atol=1e-5)
    np.testing.assert_allclose(got[..., 1::2], rot.imag, atol=1e-5)


def test_half_split_equals_interleaved_after_permuting_dims():
    """docs/model.md B.5: permuting [0,2,..,1,3,..] turns interleaved RoPE into half-split RoPE, so q.k agree."""
    cfg = tiny()
    q = jax.random.normal(jax.random.key(1), (2, 7, 3, 16))
    k = jax.random.normal(jax.random.key(2), (2, 7, 16))
    cos, sin = rope_tables(jnp.broadcast_to(jnp.arange(7), (2, 7)), cfg)
    perm = np.concatenate([np.arange(0, 16, 2), np.arange(1, 16, 2)])
    qi, ki = apply_rope(q, cos, sin, True), apply_rope(k, cos, sin, True)
    qh, kh = apply_rope(q[..., perm], cos, sin, False), apply_rope(k[..., perm], cos, sin, False)
    np.testing.assert_allclose(qh, qi[..., perm], atol=1e-5)
    np.testing.assert_allclose(jnp.einsum("bshd,btd->bsht", qi, ki), jnp.einsum("bshd,btd->bsht", qh, kh), atol=1e-4)
    # negative control: mixing the layouts between q and k changes the scores
    mixed = jnp.einsum("bshd,btd->bsht", apply_rope(q, cos, sin, False), ki)
    assert float(jnp.max(jnp.abs(mixed - jnp.einsum("bshd,btd->bsht", qi, ki)))) > 1e-2


def test_relative_position_property():
    cfg = tiny()
    q = jax.random.normal(jax.random.key(3), (1, 1, 16))
    k = jax.random.normal(jax.random.key(4), (1, 1, 16))

    def score(pq, pk):
        cq, sq = rope_tables(jnp.array([[pq]]), cfg)
        ck, sk = rope_tables(jnp.array([[pk]]), cfg)
        return float(jnp.sum(apply_rope(q, cq, sq, True) * apply_rope(k, ck, sk, True)))

    np.testing.assert_allclose(score(10, 3), score(107, 100), rtol=1e-4)


def test_yarn_frequencies_and_softmax_scale_match_deepseek_v32():
    cfg = ModelConfig(qk_rope_head_dim=64, qk_nope_head_dim=128, index_head_dim=128, rope_scaling=YARN)
    inv = rope_inv_freq(cfg).astype(np.float64)
    base = 10000.0 ** (-np.arange(0, 64, 2) / 64)
    # docs/model.md B.5: low=10, high=23 for dim 64, theta 1e4, L0 4096, beta (32, 1)
    np.testing.assert_allclose(inv[:10], base[:10], rtol=1e-6)  # extrapolated (unchanged)
    np.testing.assert_allclose(inv[23:], base[23:] / 40, rtol=1e-6)  # interpolated
    ramp = (np.arange(10, 23) - 10) / 13
    np.testing.assert_allclose(inv[10:23], base[10:23] / 40 * ramp + base[10:23] * (1 - ramp), rtol=1e-6)
    # docs/model.md A.4: 192^-0.5 * mscale^2 = 0.135234
    np.testing.assert_allclose(cfg.softmax_scale, 192 ** -0.5 * (0.1 * math.log(40) + 1) ** 2, rtol=1e-9)
    assert abs(cfg.softmax_scale - 0.135234) < 1e-6
    assert tiny().softmax_scale == 48 ** -0.5


def test_norms_against_closed_form():
    cfg = tiny()
    x = jax.random.normal(jax.random.key(5), (3, 8)) * 3 + 1
    rms = RMSNorm(8, 1e-5, cfg)
    rms.weight[...] = jnp.arange(8.0)
    xn = np.asarray(x, np.float64)
    want = xn / np.sqrt((xn ** 2).mean(-1, keepdims=True) + 1e-5) * np.arange(8.0)
    np.testing.assert_allclose(rms(x), want, rtol=1e-5)
    ln = LayerNorm(8, 1e-6, cfg)
    ln.bias[...] = jnp.ones(8)
    mu, var = xn.mean(-1, keepdims=True), xn.var(-1, keepdims=True)
    np.testing.assert_allclose(ln(x), (xn - mu) / np.sqrt(var + 1e-6) + 1, rtol=1e-5, atol=1e-6)
    assert isinstance(rms, nnx.Module)
