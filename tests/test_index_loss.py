"""Indexer losses in O(S) memory against materialised [B,S,T] references: the streamed dense KL (dense_warmup, one
layer; IndexShare, the mean target of two layers), values and gradients w.r.t. the indexer parameters; the sparse
KL over the selected keys (sparse_adapt) against the dense formula restricted to the selection; the streamed top-k
of the attention (ties across key blocks -> lowest index); and the whole model, blocked vs materialised."""
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from helpers import random_batch, tiny

from glmjax.model import GLM, latent_attention, mla_paths, mla_variants
from glmjax.model.index_loss import streaming_attention_topk, streaming_index_kl
from glmjax.model.indexer import (Indexer, gathered_index_logits, index_kl, index_scores, index_topk, masked_topk,
                                  visible)
from glmjax.model.layers import rope_tables
from glmjax.model.sparse_attention import sparse_attention_probs, sparse_mla_xla

BLOCK = 8
B, S, H, d_n, d_r, r, d_v = 2, 37, 3, 8, 4, 6, 5


def rand(key, shape, scale=1.0):
    """Normal samples made by numpy: no eager JAX op (each would compile)."""
    return jnp.asarray(np.random.default_rng(key).normal(0.0, scale, shape), jnp.float32)


def packed_segments():
    """Row 0: documents of 3, 20 and 14 tokens; row 1: 5 and 25 tokens + 7 padding. In both rows the second document
    starts inside the first key block (a block skip that looks at a block's first key only drops its keys)."""
    return np.array([[1] * 3 + [2] * 20 + [3] * 14, [1] * 5 + [2] * 25 + [0] * 7], np.int32)


def mla_inputs(seed):
    return (rand(seed, (B, S, H, d_n)), rand(seed + 1, (B, S, H, d_r)), rand(seed + 2, (B, S, r)),
            rand(seed + 3, (B, S, d_r)), rand(seed + 4, (r, H, d_n)), rand(seed + 5, (r, H, d_v)))


def indexer_setup():
    """A tiny-config Indexer (H_I 4, d_I 32; RoPE on its first 16 dims) and its inputs."""
    cfg = tiny(hidden_size=16, q_lora_rank=12, index_n_heads=4, index_head_dim=32, qk_rope_head_dim=16,
               init_std=0.3)
    graphdef, params = nnx.split(Indexer(cfg, nnx.Rngs(0)))
    pos = np.broadcast_to(np.arange(S), (B, S))
    cos, sin = jax.jit(rope_tables, static_argnums=1)(pos, cfg)
    return graphdef, params, (rand(20, (B, S, 16)), rand(21, (B, S, 12)), cos, sin)


def test_streamed_dense_kl_equals_the_materialised_kl_with_indexer_gradients():
    """dense_warmup, one layer (the IndexShare mean of two layers: the model test below)."""
    seg = packed_segments()
    ok = seg > 0
    graphdef, params, inputs = indexer_setup()
    args = mla_inputs(0)

    @jax.jit
    def both(params):
        qkw = lambda p: nnx.merge(graphdef, p)(*inputs)  # noqa: E731
        target = mla_variants.dense_blocked(*args, seg, 0.5, BLOCK)[2]
        p = latent_attention.dense_mla(*args, seg, 0.5)[2]
        stream = lambda prm: streaming_index_kl([target], *qkw(prm), seg, ok)  # noqa: E731
        ref = lambda prm: index_kl(p, index_scores(*qkw(prm), seg, seg), ok)  # noqa: E731
        return [jax.value_and_grad(fn, has_aux=True)(params) for fn in (stream, ref)]

    (kl, g), (kl_ref, g_ref) = both(params)
    assert float(kl_ref[1]) == int(ok.sum()) and float(kl[0]) > 0.1
    np.testing.assert_allclose(kl[0], kl_ref[0], rtol=1e-5)
    np.testing.assert_array_equal(kl[1], kl_ref[1])
    for (path, a), (_, b) in zip(nnx.to_flat_state(g), nnx.to_flat_state(g_ref)):
        assert float(jnp.max(jnp.abs(b[...]))) > 0, path
        np.testing.assert_allclose(a[...], b[...], atol=1e-4, err_msg=str(path))


def test_sparse_kl_equals_the_dense_formula_restricted_to_the_selected_keys():
    """sparse_adapt (docs/model.md E.3): target and prediction over the selected set S_t, computed [B,S,k] by the
    model's path and [B,S,T] here (attention and index scores masked to S_t)."""
    seg, k = packed_segments(), 6
    graphdef, params, inputs = indexer_setup()
    q_abs, latent = rand(30, (B, S, H, 10)), rand(31, (B, S, 10))
    ok = seg > 0

    @jax.jit
    def both(params):
        qkw = lambda p: nnx.merge(graphdef, p)(*inputs)  # noqa: E731
        ids = index_topk(*qkw(params), seg, seg, k, BLOCK)[0]
        _, lse = sparse_mla_xla(q_abs, latent, ids, scale=0.4, kv_lora_rank=6, block_q=BLOCK)
        p_sel = sparse_attention_probs(q_abs, latent, ids, lse, scale=0.4, block_q=BLOCK)
        rows = (jnp.arange(B)[:, None, None], jnp.arange(S)[None, :, None], jnp.where(ids < 0, S, ids))
        chosen = jnp.zeros((B, S, S + 1), bool).at[rows].set(True)[..., :S]
        s = jnp.einsum("bshc,btc->bhst", q_abs, latent) * 0.4
        p_dense = jnp.mean(jax.nn.softmax(jnp.where(chosen[:, None], s, -jnp.inf), axis=-1), axis=1)
        sparse = lambda p: index_kl(p_sel, gathered_index_logits(*qkw(p), ids, BLOCK), ok)  # noqa: E731
        dense = lambda p: index_kl(p_dense, jnp.where(chosen, index_scores(*qkw(p), seg, seg), -jnp.inf), ok)  # noqa
        return [jax.value_and_grad(fn, has_aux=True)(params) for fn in (sparse, dense)]

    (kl, g), (kl_ref, g_ref) = both(params)
    assert float(kl[0]) > 0.1
    np.testing.assert_allclose(kl[0], kl_ref[0], rtol=1e-5)
    for (path, a), (_, b) in zip(nnx.to_flat_state(g), nnx.to_flat_state(g_ref)):
        np.testing.assert_allclose(a[...], b[...], atol=1e-4, err_msg=str(path))


def test_streamed_attention_topk_equals_the_materialised_topk_with_ties_across_blocks():
    seg = packed_segments()
    args = [np.array(a) for a in mla_inputs(40)]
    for a in args[2:4]:  # c_kv and k_pe of keys 3, 13, 20 (three different key blocks) equal: tied probabilities
        a[:, 3] = a[:, 20] = a[:, 13]

    @jax.jit
    def both(args):
        target = mla_variants.dense_blocked(*args, seg, 0.5, BLOCK)[2]
        p = latent_attention.dense_mla(*args, seg, 0.5)[2]
        p = jnp.where(visible(seg, seg, jnp.arange(S)), p, -jnp.inf)
        # k > S: min(k, T) slots, -1 past the visible keys
        return [(streaming_attention_topk(target, seg, k), masked_topk(p, k)) for k in (4, 40)]

    for got, want in both(args):
        np.testing.assert_array_equal(got, want)
    row = list(np.asarray(got[0, 22]))  # a query of document 2 (slots 3..22): sees all three
    assert row.index(3) < row.index(13) < row.index(20)  # tied keys, lowest index first
    assert got.shape == (B, S, S) and int(got[1, 31, 0]) >= 30  # padding query row attends to padding only


def test_model_index_loss_and_topk_stats_blocked_equal_materialised(monkeypatch):
    """The whole model (F S IndexShare unit, dense mode): the indexer KL per unit, its gradients w.r.t. every
    indexer parameter, and the diagnostics' attention top-k, with the dense attention blocked and streamed vs
    materialised."""
    cfg = tiny(num_hidden_layers=2, indexer_types=("full", "shared"), mtp_depth=0, num_nextn_predict_layers=0,
               init_std=0.1)
    graphdef, params, rest = nnx.split(GLM(cfg, nnx.Rngs(0)), nnx.PathContains("indexer"), ...)
    batch = random_batch(cfg, 2, 40)

    def run(params):
        model = nnx.merge(graphdef, params, rest)
        loss = lambda p: nnx.merge(graphdef, p, rest).loss(batch, "dense", 0.0, 1.0)  # noqa: E731
        (_, m), g = jax.value_and_grad(loss, has_aux=True)(params)
        return m["index_kl_per_layer"], g, model(batch, "dense", topk_stats=True)[1].attn_topk

    ref = jax.jit(lambda p: run(p))(params)  # a new function each time: jit's trace cache keys on the function
    monkeypatch.setattr(mla_paths, "LIMITS", mla_paths.Limits(materialise_scores=0))
    got = jax.jit(lambda p: run(p))(params)
    np.testing.assert_allclose(got[0], ref[0], rtol=1e-5)
    assert float(ref[0][0]) > 1e-3
    for (path, a), (_, b) in zip(nnx.to_flat_state(got[1]), nnx.to_flat_state(ref[1])):
        np.testing.assert_allclose(a[...], b[...], atol=1e-4, err_msg=str(path))
    np.testing.assert_array_equal(got[2], ref[2])
