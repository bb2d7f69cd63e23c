"""Blocked (flash) dense attention against the materialised reference: MLA training form (per-head keys from the
latent; values, max logit and gradients) and the absorbed cached form (MQA over the latent, kv_valid / q_idx
visibility), with packed documents, a document starting inside the first key block, S not a multiple of the block;
the block skip itself; and no [S,T]-shaped intermediate in the blocked model's dense_warmup / sparse losses."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import random_batch, tiny

import glmjax.model.mla as mla
from glmjax.model import GLM
from glmjax.model.flash_attention import block_needed
from glmjax.model.indexer import visible

BLOCK = 8


def rand(key, shape, scale=1.0):
    """Normal samples made by numpy: no eager JAX op (each would compile)."""
    return jnp.asarray(np.random.default_rng(key).normal(0.0, scale, shape), jnp.float32)


def np_visible(seg):
    """[B,S,S] causal same-segment mask in numpy."""
    seg, t = np.asarray(seg), np.arange(seg.shape[1])
    return (t[None, None, :] <= t[None, :, None]) & (seg[:, :, None] == seg[:, None, :])


def packed_segments():
    """Row 0: documents of 3, 20 and 14 tokens; row 1: 5 and 25 tokens + 7 padding. In both rows the second document
    starts inside the first key block (a block skip that looks at a block's first key only drops its keys)."""
    return np.array([[1] * 3 + [2] * 20 + [3] * 14, [1] * 5 + [2] * 25 + [0] * 7], np.int32)


def test_blocked_mla_equals_the_materialised_reference_with_gradients():
    B, S, H, d_n, d_r, r, d_v = 2, 37, 3, 8, 4, 6, 5  # S = 37: not a multiple of the block 8
    args = (rand(0, (B, S, H, d_n)), rand(1, (B, S, H, d_r)), rand(2, (B, S, r)), rand(3, (B, S, d_r)),
            rand(4, (r, H, d_n)), rand(5, (r, H, d_v)))
    seg, ct = packed_segments(), rand(6, (B, S, H, d_v))

    def run(fn):
        def loss(*a):
            out, max_logit, extra = fn(*a)
            return jnp.sum(out * ct), (out, max_logit, extra)
        return jax.jit(jax.value_and_grad(loss, argnums=tuple(range(6)), has_aux=True))(*args)

    (_, (out, max_logit, target)), grads = run(lambda *a: mla.dense_mla_blocked(*a, seg, 0.7, BLOCK))
    (_, (ref, ref_max, _)), ref_grads = run(lambda *a: mla.dense_mla(*a, seg, 0.7))
    np.testing.assert_allclose(out, ref, atol=1e-5)
    np.testing.assert_allclose(max_logit, ref_max, atol=1e-5)
    for name, g, rg in zip(("q_nope", "q_pe", "c_kv", "k_pe", "w_uk", "w_uv"), grads, ref_grads):
        np.testing.assert_allclose(g, rg, atol=1e-4, err_msg=name)
    # the per-head lse the streamed losses use: log of the softmax normaliser, naively in numpy
    q, k = (np.asarray(a, np.float64) for a in (target.q, target.k))
    s = np.einsum("bshd,bthd->bsht", q, k) * 0.7
    s = np.where(np_visible(seg)[:, :, None, :], s, -np.inf)
    m = s.max(-1, keepdims=True)
    np.testing.assert_allclose(target.lse, (m + np.log(np.exp(s - m).sum(-1, keepdims=True)))[..., 0], atol=1e-5)


def test_blocked_absorbed_cached_attention_equals_the_materialised_reference():
    """Prefill of a chunk at different cache offsets per row (kv_valid with holes past the written rows) and
    decode (S = 1), values and gradients in the queries and the latent cache."""
    B, H, C, R, T = 2, 3, 10, 6, 45
    kv_valid = np.zeros((B, T), np.int32)
    kv_valid[0, :29], kv_valid[1, :40] = 1, 1
    kv_valid[1, 5:9] = 0  # a hole inside a key block
    latent, kv_valid = rand(7, (B, T, C)), jnp.asarray(kv_valid)
    for S, start in ((13, (16, 27)), (1, (28, 39))):
        q_abs, ct = rand(8 + S, (B, S, H, C)), rand(9 + S, (B, S, H, R))
        q_seg = np.ones((B, S), np.int32)
        q_idx = np.asarray(start)[:, None] + np.arange(S)[None]

        @jax.jit
        def both(q, kv):
            blocked = lambda q, kv: mla.dense_mla_absorbed_blocked(q, kv, q_seg, kv_valid, q_idx, 0.4, R, BLOCK)  # noqa
            ref = lambda q, kv: mla.dense_mla_absorbed(q, kv, visible(q_seg, kv_valid, q_idx), 0.4, R)  # noqa
            loss = lambda fn, *a: (jnp.sum(fn(*a) * ct), fn(*a))  # noqa: E731
            return [jax.value_and_grad(lambda *a: loss(fn, *a), (0, 1), has_aux=True)(q, kv) for fn in (blocked, ref)]

        ((_, out), g), ((_, out_ref), g_ref) = both(q_abs, latent)
        np.testing.assert_allclose(out, out_ref, atol=1e-5, err_msg=f"S={S}")
        for a, b in zip(g, g_ref):
            np.testing.assert_allclose(a, b, atol=1e-4, err_msg=f"S={S}")


def test_block_skip_is_exact_at_block_granularity():
    """A key block is skipped only when no query of the block can see any of its keys: a document starting inside
    the first key block (row 0) must keep block 0 for its queries in block 2, a causal future block is skipped, and
    so is a block of another document entirely."""
    seg = packed_segments()
    idx = np.broadcast_to(np.arange(37), (2, 37))
    vis = np_visible(seg)
    need = jax.jit(block_needed)
    blk = lambda a, i: a[:, i * BLOCK:(i + 1) * BLOCK]  # noqa: E731
    for qi in range(4):  # whole blocks
        for ki in range(4):
            any_visible = vis[:, qi * BLOCK:(qi + 1) * BLOCK, ki * BLOCK:(ki + 1) * BLOCK].any()
            assert bool(need(blk(seg, qi), blk(idx, qi), blk(seg, ki), ki * BLOCK)) >= any_visible, (qi, ki)
    one_doc = lambda n: np.asarray([[1] * n + [2] * (16 - n)], np.int32)  # noqa: E731
    assert bool(need(one_doc(3)[:, 8:], np.arange(8, 16)[None], one_doc(3)[:, :8], 0))  # doc 2 from slot 3
    assert not bool(need(one_doc(8)[:, 8:], np.arange(8, 16)[None], one_doc(8)[:, :8], 0))  # another document
    assert not bool(need(one_doc(3)[:, :8], np.arange(8)[None], one_doc(3)[:, 8:], 8))  # causal future


@pytest.mark.parametrize("mode", ["dense", "sparse"])
def test_blocked_model_losses_build_no_query_by_key_array(mode, monkeypatch):
    """The dense_warmup (blocked dense attention + streamed KL) and sparse_adapt losses, forward and backward,
    traced (not compiled): no intermediate has two axes of length S (no [.., S, T] scores, probabilities or masks)."""
    monkeypatch.setattr(mla, "MATERIALISE_MAX_SCORES", 0)
    S = 72  # no other dimension of the tiny model is 72
    cfg = tiny(num_hidden_layers=2, indexer_types=("full", "shared"), mtp_depth=0, num_nextn_predict_layers=0)
    graphdef, state = nnx.split(GLM(cfg, nnx.Rngs(0)))
    batch = random_batch(cfg, 1, S)

    def loss(state):
        return nnx.merge(graphdef, state).loss(batch, mode, index_loss_weight=1.0)[0]

    jaxpr = jax.make_jaxpr(jax.grad(loss))(state)
    shapes = {tuple(v.aval.shape) for eqn in all_eqns(jaxpr.jaxpr) for v in eqn.outvars if hasattr(v.aval, "shape")}
    assert any(S in s for s in shapes)
    assert not [s for s in shapes if sum(d == S for d in s) >= 2]


def all_eqns(jaxpr):
    for eqn in jaxpr.eqns:
        yield eqn
        for sub in sub_jaxprs(eqn):
            yield from all_eqns(sub)


def sub_jaxprs(eqn):
    for p in eqn.params.values():
        for x in p if isinstance(p, (list, tuple)) else (p,):
            if hasattr(x, "jaxpr") and hasattr(x.jaxpr, "eqns"):
                yield x.jaxpr
            elif hasattr(x, "eqns"):
                yield x
