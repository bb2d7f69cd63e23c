"""Stage losses and plumbing against independent references: the indexer KL (docs/model.md E.2 / E.3 / E.4) computed
naively, the sparse-stage attention target, gradient routing (the KL reaches only indexers, the LM loss never does),
parameter surgery across IndexShare patterns, the top-k overlap metric, and the train step's NaN guard."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import FAST, random_batch, tiny

from glmjax.model import GLM
from glmjax.model.indexer import gathered_index_logits, index_kl, index_scores, index_topk
from glmjax.model.sparse_attention import sparse_attention_probs, sparse_mla_xla
from glmjax.train.stages import surgery
from glmjax.train.step import make_train_step, split_model, topk_overlap

ALL_FULL = ("full",) * 6
SHARE_2 = ("full", "shared") * 3


def rand(key, shape, scale=1.0):
    return jax.random.normal(jax.random.key(key), shape, jnp.float32) * scale


def test_index_kl_matches_a_naive_loop():
    B, S, K = 2, 5, 7
    p = np.asarray(jax.nn.softmax(rand(0, (B, S, K), 2.0)))
    logits = np.asarray(rand(1, (B, S, K), 3.0))
    masked = np.zeros((B, S, K), bool)
    masked[0, 1, 3:] = True  # a query with fewer candidates
    masked[1, 4, :] = True  # a query with no candidate at all: not counted
    p = np.where(masked, 0.0, p)
    p = p / np.maximum(p.sum(-1, keepdims=True), 1e-30)
    p[0, 2, 0] = 0.0  # a zero target entry: 0 log 0 = 0
    p[0, 2] /= p[0, 2].sum()
    logits = np.where(masked, -np.inf, logits)
    query_ok = np.ones((B, S), bool)
    query_ok[1, 0] = False  # padding query
    total, n = 0.0, 0
    for b in range(B):
        for s in range(S):
            keep = ~masked[b, s]
            if not query_ok[b, s] or not keep.any():
                continue
            lg = logits[b, s, keep]
            q = np.exp(lg - lg.max()) / np.exp(lg - lg.max()).sum()
            pt = p[b, s, keep]
            total += sum(pi * (np.log(pi) - np.log(qi)) for pi, qi in zip(pt, q) if pi > 0)
            n += 1
    got, count = index_kl(jnp.asarray(p), jnp.asarray(logits), jnp.asarray(query_ok))
    np.testing.assert_allclose(float(got), total, rtol=1e-5)
    assert float(count) == n == B * S - 2


def test_multi_layer_target_gives_the_mean_kl_gradient():
    """docs/model.md E.4 Prop. 1: d/dI KL(mean_j p_j || softmax I) = d/dI mean_j KL(p_j || softmax I)."""
    ps = jax.nn.softmax(rand(2, (3, 1, 4, 9), 2.0), axis=-1)
    logits = rand(3, (1, 4, 9))
    ok = jnp.ones((1, 4), bool)
    g_mean_target = jax.grad(lambda lg: index_kl(jnp.mean(ps, 0), lg, ok)[0])(logits)
    g_mean_kl = jax.grad(lambda lg: jnp.mean(jnp.stack([index_kl(p, lg, ok)[0] for p in ps])))(logits)
    np.testing.assert_allclose(g_mean_target, g_mean_kl, atol=1e-6)


def test_gathered_index_logits_equal_the_dense_scores_with_gradients():
    B, S, H, d, k = 2, 37, 4, 16, 8  # S > k: real selection; S not a multiple of the block
    q, kk, w = rand(4, (B, S, H, d)), rand(5, (B, S, d)), rand(6, (B, S, H))
    seg = jnp.asarray(np.repeat([[1] * 20 + [2] * 17], B, 0), jnp.int32)  # two packed documents
    ids, vals = index_topk(q, kk, w, seg, seg, k, 8)
    assert bool(jnp.any(ids == -1)) and bool(jnp.all(ids[:, -1] >= 0))
    ct = rand(7, (B, S, k))

    def gathered(q, kk, w):
        g = gathered_index_logits(q, kk, w, ids, block_q=8)
        return jnp.sum(jnp.where(ids >= 0, g, 0.0) * ct), g

    def dense(q, kk, w):
        g = jnp.take_along_axis(index_scores(q, kk, w, seg, seg), jnp.maximum(ids, 0), axis=-1)
        return jnp.sum(jnp.where(ids >= 0, g, 0.0) * ct)

    (_, g), grads = jax.value_and_grad(gathered, argnums=(0, 1, 2), has_aux=True)(q, kk, w)
    np.testing.assert_allclose(jnp.where(ids >= 0, g, 0.0), jnp.where(ids >= 0, vals, 0.0), atol=1e-5)
    assert bool(jnp.all((g == -jnp.inf) == (ids < 0)))
    for a, b in zip(grads, jax.grad(dense, argnums=(0, 1, 2))(q, kk, w)):
        np.testing.assert_allclose(a, b, atol=1e-4)


def test_sparse_attention_target_is_the_head_mean_softmax_over_the_selected_keys():
    B, S, T, H, C, R, k = 1, 9, 9, 3, 12, 8, 4
    q, kv = rand(8, (B, S, H, C)), rand(9, (B, T, C))
    ids = np.full((B, S, k), -1, np.int32)
    for s in range(S):  # causal candidates, fewer than k for early rows
        cand = np.random.default_rng(s).permutation(s + 1)[:k]
        ids[0, s, :len(cand)] = cand
    ids = jnp.asarray(ids)
    _, lse = sparse_mla_xla(q, kv, ids, scale=0.3, kv_lora_rank=R, block_q=4)
    got = np.asarray(sparse_attention_probs(q, kv, ids, lse, scale=0.3, block_q=4))
    for s in range(S):
        sel = [int(i) for i in ids[0, s] if i >= 0]
        logits = np.einsum("hc,kc->hk", np.asarray(q[0, s]), np.asarray(kv[0, sel])) * 0.3
        p = np.exp(logits - logits.max(-1, keepdims=True))
        p = (p / p.sum(-1, keepdims=True)).mean(0)
        np.testing.assert_allclose(got[0, s, :len(sel)], p, rtol=1e-5)
        assert (got[0, s, len(sel):] == 0).all()


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["dense", "sparse"])
def test_gradient_routing(mode):
    """docs/model.md E.2/E.3: the indexer KL reaches only indexer weights; the LM (+MTP) loss never reaches them."""
    cfg = tiny(num_hidden_layers=3, indexer_types=("full", "shared", "full"), mtp_depth=1)
    graphdef, params, rest = split_model(GLM(cfg, nnx.Rngs(0)), "all")
    batch = random_batch(cfg, 2, 24)  # S = 24 > index_topk = 8

    @functools.partial(jax.jit, compiler_options=FAST)
    def grads(p):
        def loss(p, **w):
            return nnx.merge(graphdef, p, rest).loss(batch, mode, **w)[0]
        return jax.grad(loss)(p, lm_weight=0.0, index_loss_weight=1.0), jax.grad(loss)(p)

    def maxabs(g):
        return {"/".join(map(str, path)): float(jnp.max(jnp.abs(v[...]))) for path, v in nnx.to_flat_state(g)}

    kl, lm = map(maxabs, grads(params))
    indexer = {n for n in kl if "indexer" in n}
    assert len(indexer) == 3 * 5  # layers 0, 2 and the MTP layer
    for name in kl:
        if name in indexer:
            assert lm[name] == 0.0 and kl[name] > 0.0, name
        else:
            assert kl[name] == 0.0, name
    assert sum(lm[n] > 0 for n in lm if n not in indexer) > 0.9 * (len(lm) - len(indexer))


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["dense", "sparse"])
def test_full_layer_distils_toward_the_mean_attention_of_the_layers_it_serves(mode, monkeypatch):
    """docs/model.md E.4 with IndexShare F S F S F S: each unit's KL is taken against the mean of both layers' attention
    distributions (captured from an unjitted, unscanned forward and recomputed naively), and those distributions
    are proper (rows sum to 1, zero outside the causal / selected keys)."""
    import glmjax.model.transformer as tr

    cfg = tiny(indexer_types=SHARE_2, scan_layers=False, mtp_depth=0, num_nextn_predict_layers=0, init_std=0.1)
    model = GLM(cfg, nnx.Rngs(0))
    S = 24
    batch = random_batch(cfg, 2, S)
    captured = []
    real = tr.unit_index_loss

    def spy(stats, ctx):
        captured.append(([np.asarray(st.attn_p, np.float64) for st in stats],
                         np.asarray(stats[0].index_logits, np.float64)))
        return real(stats, ctx)

    monkeypatch.setattr(tr, "unit_index_loss", spy)
    kl = np.asarray(model.loss(batch, mode, index_loss_weight=1.0)[1]["index_kl_per_layer"])
    assert len(captured) == 3 and all(len(ps) == 2 for ps, _ in captured)
    for u, (ps, logits) in enumerate(captured):
        for p in ps:
            np.testing.assert_allclose(p.sum(-1), 1.0, rtol=1e-5)
            assert (p[np.isneginf(logits)] == 0).all()
        assert not np.allclose(ps[0], ps[1])  # the two layers attend differently: the mean matters
        target = (ps[0] + ps[1]) / 2
        logq = logits - np.log(np.sum(np.exp(logits - logits.max(-1, keepdims=True)), -1, keepdims=True)) \
            - logits.max(-1, keepdims=True)
        terms = target * (np.log(np.where(target > 0, target, 1)) - np.where(target > 0, logq, 0))
        ref = terms.sum(-1).mean()
        assert ref > 1e-3  # a real distillation gap, not two uniform distributions
        np.testing.assert_allclose(kl[u], ref, rtol=2e-4)
    if mode == "dense":
        assert captured[0][1].shape == (2, S, S)  # dense E.2: over every causal key
    else:
        assert captured[0][1].shape == (2, S, cfg.index_topk)  # sparse E.3: over the selected keys only


@pytest.mark.slow
def test_surgery_across_indexshare_patterns_and_from_a_dense_checkpoint():
    cfg = tiny(indexer_types=ALL_FULL)
    src = GLM(cfg, nnx.Rngs(0))
    src_state = nnx.state(src).to_pure_dict()
    dst = GLM(cfg.replace(indexer_types=SHARE_2), nnx.Rngs(1))
    log = surgery(dst, src_state, cfg)
    assert "fresh (not in the checkpoint): none" in log
    assert "dropped (not in this model): 15 tensors" in log[2] and "layers.1.self_attn.indexer" in log[2]
    # every layer's weights, compared by layer through the two storage layouts
    for i in range(6):
        a, b = src_layer(src, i), src_layer(dst, i)
        assert set(b) == ({n for n in a if "indexer" not in n} if i % 2 else set(a))
        for name in b:
            np.testing.assert_array_equal(a[name], b[name], err_msg=f"layer {i} {name}")
    np.testing.assert_array_equal(src.embed_tokens[...], dst.embed_tokens[...])
    # a checkpoint without indexers (a dense model) -> fresh indexers, listed
    no_idx = {k: v for k, v in src_state.items()}
    fresh_model = GLM(cfg, nnx.Rngs(2))
    stripped = strip(no_idx, "indexer")
    log = surgery(fresh_model, stripped, cfg)
    assert "fresh (not in the checkpoint): 35 tensors" in log[1], log  # 6 layers + MTP, 5 tensors each
    with pytest.raises(ValueError, match="shape"):
        surgery(GLM(cfg.replace(hidden_size=64), nnx.Rngs(0)), src_state, cfg)


def strip(tree, word):
    if isinstance(tree, dict):
        return {k: strip(v, word) for k, v in tree.items() if k != word}
    return tree


def src_layer(model, i):
    from glmjax.model.transformer import layer_slots
    s, u, j = layer_slots(model.cfg)[i]
    layer = model.stacks[s].units.layers[j]
    return {"/".join(map(str, p)): np.asarray(v[...])[u] for p, v in nnx.to_flat_state(nnx.state(layer))}


def test_topk_overlap_against_python_sets():
    rng = np.random.default_rng(0)
    T, k = 12, 4
    a = np.stack([rng.permutation(T)[:k] for _ in range(10)]).reshape(1, 2, 5, k)
    b = np.stack([rng.permutation(T)[:k] for _ in range(10)]).reshape(1, 2, 5, k)
    b[0, 0, 0, 2:] = -1  # a query with 2 keys only
    b[0, 1, 4, :] = -1  # a query with none: not counted
    a[0, 0, 1, 1:] = -1  # empty slots of a match nothing, not b's empty slots
    b[0, 0, 1, 3] = -1
    b[0, 1, 0] = a[0, 1, 0][::-1]  # the same set in another order: overlap 1
    ref = [len((set(x) - {-1}) & (set(y) - {-1})) / len(set(y) - {-1})
           for x, y in zip(a.reshape(-1, k), b.reshape(-1, k)) if (y >= 0).any()]
    got = topk_overlap(jnp.asarray(a), jnp.asarray(b))
    np.testing.assert_allclose(float(got[0]), np.mean(ref), rtol=1e-6)


@pytest.mark.slow
def test_nan_step_is_skipped_and_changes_nothing():
    import optax

    cfg = tiny()
    graphdef, params, rest = split_model(GLM(cfg, nnx.Rngs(0)), "model")
    tx = optax.adam(1e-2)
    step = make_train_step(graphdef, tx, "pretrain", "dense", 1e-3, inject_nan_at=2)
    batch = random_batch(cfg, 2, 16)
    copy = lambda t: jax.tree.map(lambda x: jnp.array(x, copy=True), t)  # noqa: E731
    p, r, o, m = step(params, rest, tx.init(params), batch, jnp.int32(1))
    assert int(m["skipped"]) == 0
    before = copy((p, r, o))
    p, r, o, m = step(p, r, o, batch, jnp.int32(2))
    assert int(m["skipped"]) == 1 and not np.isfinite(float(m["loss"]))
    for x, y in zip(jax.tree.leaves(before), jax.tree.leaves((p, r, o))):
        np.testing.assert_array_equal(x, y)
