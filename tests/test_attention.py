"""Lightning indexer top-k and gathered sparse MLA attention against naive references."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from glmjax.model.indexer import CAUSAL_GROUPS, causal_groups, index_logits, index_scores, index_topk
from glmjax.model.layers import rope_tables
from glmjax.model.mla import MLA, Ctx
from glmjax.model.sparse_attention import sparse_mla_xla
from helpers import tiny


def naive_topk(scores, seg, k):
    """Per query: visible keys (causal, same segment) sorted by (-score, index); the first k, padded with -1."""
    B, S, T = scores.shape
    out = np.full((B, S, min(k, T)), -1, np.int64)
    for b in range(B):
        for s in range(S):
            keys = [t for t in range(T) if t <= s and seg[b, t] == seg[b, s]]
            keys.sort(key=lambda t: (-scores[b, s, t], t))
            sel = keys[:k]
            out[b, s, :len(sel)] = sel
    return out


def random_indexer_inputs(B=2, S=37, H=4, d=16, seed=0, dtype=jnp.float32):
    ks = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(ks[0], (B, S, H, d), dtype)
    k = jax.random.normal(ks[1], (B, S, d), dtype)
    w = jax.random.normal(ks[2], (B, S, H), jnp.float32)
    return q, k, w


@pytest.mark.parametrize("block_q", [8, 16, 64])
def test_index_topk_matches_naive_with_segments_and_ragged_blocks(block_q):
    q, k, w = random_indexer_inputs()
    seg = np.ones((2, 37), np.int32)
    seg[1, 15:] = 2  # two packed documents in row 1
    seg[1, 33:] = 0  # padding tail
    seg = jnp.asarray(seg)
    ids, vals = index_topk(q, k, w, seg, seg, topk=8, block_q=block_q)
    scores = np.asarray(index_logits(q, k, w))
    ref = naive_topk(scores, np.asarray(seg), 8)
    np.testing.assert_array_equal(np.asarray(ids), ref)
    # early rows have fewer than k visible keys and say so with -1 ...
    assert (np.asarray(ids)[0, 0] == -1).sum() == 7 and (np.asarray(ids)[1, 15] == -1).sum() == 7
    # ... while rows past k are full (S > k, so the indexer really selects)
    assert (np.asarray(ids)[:, 23:33] >= 0).all()
    # selected scores are the scores of the selected keys
    sel = np.take_along_axis(scores, np.maximum(ref, 0), axis=-1)
    np.testing.assert_allclose(np.asarray(vals)[ref >= 0], sel[ref >= 0], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("S,topk,block_q", [(150, 16, 8), (20, 64, 8)])
def test_index_topk_causal_key_prefixes_select_what_full_blocks_select(S, topk, block_q):
    """Without q_idx the query blocks score only the keys their group can see (`causal_groups`); with q_idx (the
    cache / context-parallel form) every block scores all T keys. Same indices (-1 slots, packed segments and
    S < topk included), scores within rounding (a narrower dot)."""
    q, k, w = random_indexer_inputs(S=S, seed=S)
    q = jnp.where(q < -0.5, -1.0, q)  # many ReLU-clipped heads: exact ties at 0 among the scores
    seg = np.ones((2, S), np.int32)
    seg[1, S // 3:] = 2
    seg[1, S - 3:] = 0
    seg = jnp.asarray(seg)
    groups = causal_groups(S, S, block_q)
    assert len(groups) == min(-(-S // block_q), CAUSAL_GROUPS) and groups[-1][1:] == (-(-S // block_q), S)
    fn = jax.jit(lambda q_idx: index_topk(q, k, w, seg, seg, topk, block_q, q_idx))
    (ids, vals), (ids_full, vals_full) = fn(None), fn(jnp.arange(S))
    np.testing.assert_array_equal(ids, ids_full)
    np.testing.assert_allclose(vals, vals_full, rtol=1e-5, atol=1e-6)
    assert (np.asarray(ids) == -1).any() and (np.asarray(vals) == 0).any()
    np.testing.assert_array_equal(ids, naive_topk(np.asarray(index_logits(q, k, w)), np.asarray(seg), topk))


def test_index_topk_ties_break_by_lowest_index_and_are_deterministic():
    B, S, H, d = 1, 24, 2, 8
    q = jnp.ones((B, S, H, d))
    k = jnp.ones((B, S, d)).at[:, ::3].set(2.0)  # every 3rd key scores higher; the rest tie
    w = jnp.ones((B, S, H))
    seg = jnp.ones((B, S), jnp.int32)
    ids1, _ = index_topk(q, k, w, seg, seg, topk=5, block_q=8)
    ids2, _ = jax.jit(lambda *a: index_topk(*a, topk=5, block_q=16))(q, k, w, seg, seg)
    np.testing.assert_array_equal(ids1, ids2)
    # query 20: high keys 0,3,...,18 (7 of them) -> the 5 lowest: 0,3,6,9,12
    np.testing.assert_array_equal(ids1[0, 20], [0, 3, 6, 9, 12])
    # query 7: high keys 0,3,6 then ties 1,2 (lowest indices)
    np.testing.assert_array_equal(ids1[0, 7], [0, 3, 6, 1, 2])


def test_index_scores_match_the_formula():
    q, k, w = random_indexer_inputs(B=1, S=5, H=3, d=4)
    seg = jnp.ones((1, 5), jnp.int32)
    got = np.asarray(index_scores(q, k, w, seg, seg))
    qn, kn, wn = map(np.asarray, (q, k, w))
    for t in range(5):
        for s in range(5):
            want = sum(wn[0, t, h] * max(qn[0, t, h] @ kn[0, s], 0.0) for h in range(3)) / 2.0 if s <= t else -np.inf
            np.testing.assert_allclose(got[0, t, s], want, rtol=1e-5, atol=1e-6)


def naive_masked_dense(q, kv, ids, scale, R):
    """Dense MQA attention over all T keys with a [B,S,T] mask built from the indices (the thing we avoid)."""
    B, S, H, _ = q.shape
    T = kv.shape[1]
    mask = np.zeros((B, S, T), bool)
    idn = np.asarray(ids)
    for b in range(B):
        for s in range(S):
            mask[b, s, idn[b, s][idn[b, s] >= 0]] = True
    logits = jnp.einsum("bshc,btc->bsht", q, kv) * scale
    logits = jnp.where(jnp.asarray(mask)[:, :, None, :], logits, -jnp.inf)
    return jnp.einsum("bsht,btr->bshr", jax.nn.softmax(logits, axis=-1), kv[..., :R])


@pytest.mark.parametrize("block_q", [8, 48])
def test_sparse_mla_matches_masked_dense_reference(block_q):
    B, S, H, R, dr = 2, 45, 3, 16, 8
    ks = jax.random.split(jax.random.key(1), 5)
    q = jax.random.normal(ks[0], (B, S, H, R + dr))
    kv = jax.random.normal(ks[1], (B, S, R + dr))
    qi, ki, wi = random_indexer_inputs(B=B, S=S, seed=2)
    seg = jnp.ones((B, S), jnp.int32)
    ids, _ = index_topk(qi, ki, wi, seg, seg, topk=8, block_q=16)
    assert (np.asarray(ids) == -1).any()  # early rows with fewer than k valid keys are part of the test
    out, lse = sparse_mla_xla(q, kv, ids, scale=0.3, kv_lora_rank=R, block_q=block_q)
    ref = naive_masked_dense(q, kv, ids, 0.3, R)
    np.testing.assert_allclose(out, ref, atol=1e-5, rtol=1e-5)
    # gradients w.r.t. queries and the latent cache agree too
    ct = jax.random.normal(ks[3], out.shape)
    g = jax.grad(lambda a, b: jnp.sum(sparse_mla_xla(a, b, ids, scale=0.3, kv_lora_rank=R, block_q=block_q)[0] * ct),
                 argnums=(0, 1))(q, kv)
    gr = jax.grad(lambda a, b: jnp.sum(naive_masked_dense(a, b, ids, 0.3, R) * ct), argnums=(0, 1))(q, kv)
    for x, y in zip(g, gr):
        np.testing.assert_allclose(x, y, atol=1e-4, rtol=1e-4)
    # lse is the log-normaliser of the selected logits
    l0 = jnp.einsum("hc,kc->hk", q[0, 30], kv[0][ids[0, 30]]) * 0.3
    np.testing.assert_allclose(lse[0, 30], jax.nn.logsumexp(l0, axis=-1), rtol=1e-5)


def test_sparse_mla_ignores_all_invalid_rows():
    q = jnp.ones((1, 4, 2, 6))
    kv = jnp.ones((1, 4, 6))
    ids = jnp.full((1, 4, 3), -1, jnp.int32)
    out, lse = sparse_mla_xla(q, kv, ids, scale=1.0, kv_lora_rank=4)
    assert np.all(np.asarray(out) == 0) and np.all(np.isneginf(np.asarray(lse)))


def _layer_outputs(cfg, S, mode, topk=None, seed=0):
    mla = MLA(cfg, has_indexer=True, rngs=nnx.Rngs(seed))
    x = jax.random.normal(jax.random.key(5), (2, S, cfg.hidden_size))
    pos = jnp.broadcast_to(jnp.arange(S), (2, S))
    cos, sin = rope_tables(pos, cfg)
    ctx = Ctx(cos, sin, jnp.ones((2, S), jnp.int32), mode)
    kk = min(cfg.index_topk, S)
    out, used, _, _ = mla(x, ctx, jnp.full((2, S, kk), -1, jnp.int32))
    return out, used


def test_sparse_equals_dense_when_topk_covers_the_sequence():
    cfg = tiny(index_topk=64)
    dense, _ = _layer_outputs(cfg, 48, "dense")
    sparse, used = _layer_outputs(cfg, 48, "sparse")
    assert used.shape == (2, 48, 48)
    np.testing.assert_allclose(sparse, dense, atol=2e-5, rtol=1e-4)


def test_sparse_differs_from_dense_when_sequence_exceeds_topk():
    cfg = tiny(index_topk=8)
    dense, _ = _layer_outputs(cfg, 48, "dense")
    sparse, used = _layer_outputs(cfg, 48, "sparse")
    assert used.shape == (2, 48, 8)
    # the first 8 rows see all their keys either way; later rows attend to a strict subset
    np.testing.assert_allclose(sparse[:, :8], dense[:, :8], atol=2e-5, rtol=1e-4)
    assert float(jnp.max(jnp.abs(sparse[:, 16:] - dense[:, 16:]))) > 1e-3
