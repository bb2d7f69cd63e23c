"""The whole decoder: shapes, causality, IndexShare, packing, MTP loss, bf16 gradients, scanned depth."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from glmjax.model import GLM, Batch, plan_stacks
from glmjax.model.backends import XLA
from glmjax.model.transformer import shifted_targets, token_nll
from helpers import THREE_LAYERS, batch_from_docs, jit_once, random_batch, tiny


@pytest.fixture(scope="module")
def model():
    return GLM(tiny(**THREE_LAYERS), nnx.Rngs(0))


_FORWARD = {}  # a jitted forward per mode: a call with a model and batch shapes seen before neither traces nor compiles


def forward(model, batch, mode):
    if mode not in _FORWARD:
        _FORWARD[mode] = nnx.jit(lambda m, b: m(b, mode))
    return _FORWARD[mode](model, batch)


@pytest.mark.slow
def test_shapes_and_dtypes(model):
    cfg = model.cfg
    b = random_batch(cfg, 2, 48)
    h, aux = forward(model, b, "sparse")
    loads = aux.expert_load
    assert h.shape == (2, 48, cfg.hidden_size) and h.dtype == jnp.float32
    assert loads.shape == (2, cfg.n_routed_experts)  # 2 MoE layers (first_k_dense_replace=1)
    assert int(loads.sum()) == 2 * 2 * 48 * cfg.num_experts_per_tok
    assert model.logits(h).shape == (2, 48, cfg.vocab_size) and model.logits(h).dtype == jnp.float32
    # F F S -> units [F] [F S] (tiny()'s F F S S F S: [F] [F S S] [F S]); stacked parameters carry a leading
    # layer axis
    assert [p.starts for p in model.plans] == [(0,), (1,)]
    assert [p.starts for p in nnx.eval_shape(lambda: GLM(tiny(), nnx.Rngs(0))).plans] == [(0,), (1,), (4,)]
    attn = model.stacks[1].units.layers[0].self_attn
    assert attn.q_b_proj.shape == (1, cfg.q_lora_rank, cfg.num_attention_heads, cfg.qk_head_dim)
    assert attn.q_b_proj.get_metadata()["out_sharding"] == ("layers", "q_lora", "heads", "head_dim")
    assert model.stacks[1].units.layers[1].self_attn.indexer is None  # shared layers own no indexer
    bf = GLM(tiny(dtype="bfloat16", **THREE_LAYERS), nnx.Rngs(0))
    hb, _ = forward(bf, b, "dense")
    assert hb.dtype == jnp.bfloat16
    loss, _ = nnx.jit(lambda m, b: m.loss(b, "sparse"))(bf, b)
    assert loss.dtype == jnp.float32 and np.isfinite(float(loss))


@pytest.mark.parametrize("mode", ["dense", "sparse"])
def test_causality(model, mode):
    b = random_batch(model.cfg, 2, 48, seed=3)
    p = 30
    changed = Batch(b.tokens.at[:, p].set((b.tokens[:, p] + 7) % model.cfg.vocab_size), b.segment_ids, b.positions)
    l0 = model.logits(forward(model, b, mode)[0])
    l1 = model.logits(forward(model, changed, mode)[0])
    np.testing.assert_allclose(l0[:, :p], l1[:, :p], atol=1e-5)
    assert float(jnp.max(jnp.abs(l0[:, p:] - l1[:, p:]))) > 1e-3  # the change is visible from p on


@pytest.mark.slow
def test_indexshare_reuses_exactly_the_previous_full_layers_indices():
    cfg = tiny(scan_layers=False)
    model = GLM(cfg, nnx.Rngs(1))
    seen = []

    def recording(q, kv, indices, **kw):  # the indices each layer's sparse attention is called with
        seen.append(np.asarray(indices))
        return XLA.sparse_mla(q, kv, indices, **kw)

    model(random_batch(cfg, 2, 48, seed=4), "sparse", backend=XLA._replace(sparse_mla=recording))
    assert len(seen) == 6
    types = cfg.layer_indexer_types  # F F S S F S
    assert types == ("full", "full", "shared", "shared", "full", "shared")
    for i in (2, 3):
        np.testing.assert_array_equal(seen[i], seen[1])
    np.testing.assert_array_equal(seen[5], seen[4])
    # the full layers really select (and differ from each other): a no-op indexer would pass the checks above
    assert not np.array_equal(seen[0], seen[1]) and not np.array_equal(seen[1], seen[4])
    assert (seen[0][:, 20:] >= 0).all() and seen[0].shape == (2, 48, cfg.index_topk)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["dense", "sparse"])
def test_packed_batch_gives_the_per_document_losses_of_documents_run_alone(model, mode):
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 512, n).tolist() for n in (20, 28, 40)]
    packed = batch_from_docs([[docs[0], docs[1]], [docs[2]]], 48)  # row 2 ends in 8 padding tokens

    def per_doc_nll(batch):
        h, _ = forward(model, batch, mode)
        targets, valid = shifted_targets(batch, 1)
        nll = token_nll(h, model.lm_head[...], targets, 16) * valid
        seg = np.asarray(batch.segment_ids)
        return {(b, s): float(nll[b][seg[b] == s].sum()) for b in range(seg.shape[0]) for s in set(seg[b]) - {0}}

    got = per_doc_nll(packed)
    # each document alone at the start of its own row (positions from 0, nothing before it), in batches of the packed
    # batch's shape: one compiled forward
    alone = {**per_doc_nll(batch_from_docs([[docs[0]], [docs[1]]], 48)),
             **{(2, 1): per_doc_nll(batch_from_docs([[docs[2]], [docs[0]]], 48))[(0, 1)]}}
    for (b, s), a in zip([(0, 1), (0, 2), (1, 1)], [(0, 1), (1, 1), (2, 1)]):
        np.testing.assert_allclose(got[(b, s)], alone[a], rtol=1e-5, atol=1e-4)


def test_chunked_loss_equals_full_logits_loss(model):
    b = random_batch(model.cfg, 2, 48, seed=6)
    h, _ = forward(model, b, "dense")
    targets, _ = shifted_targets(b, 1)
    full = -jnp.take_along_axis(jax.nn.log_softmax(model.logits(h)), targets[..., None], -1)[..., 0]
    for chunk in (7, 16, 48, 100):
        np.testing.assert_allclose(token_nll(h, model.lm_head[...], targets, chunk), full, atol=2e-5, rtol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["dense", "sparse"])
def test_mtp_loss_against_a_naive_loop_over_depths(model, mode):
    cfg = model.cfg
    rng = np.random.default_rng(1)
    docs = [rng.integers(0, 512, n).tolist() for n in (30, 18, 44)]
    b = batch_from_docs([[docs[0], docs[1]], [docs[2]]], 48)
    loss, metrics = nnx.jit(lambda m, b: m.loss(b, mode))(model, b)

    tok, seg = np.asarray(b.tokens), np.asarray(b.segment_ids)
    B, S = tok.shape

    def naive_ce(h, n):  # mean CE of predicting t_{i+n} from slot i, inside one document
        logp = np.asarray(jax.nn.log_softmax(model.logits(h)))
        terms = [-logp[bb, i, tok[bb, i + n]] for bb in range(B) for i in range(S - n)
                 if seg[bb, i] > 0 and seg[bb, i + n] == seg[bb, i]]
        return np.mean(terms)

    h, _ = forward(model, b, mode)
    ctx = model.ctx(b, mode)
    lm = naive_ce(h, 1)
    ces, h_prev = [], h
    for k in range(1, cfg.mtp_depth + 1):
        shifted = np.zeros_like(tok)
        shifted[:, :S - k] = tok[:, k:]
        emb = model.embed_tokens[...][jnp.asarray(shifted)]
        h_prev, _, _ = model.mtp(emb, h_prev, ctx, jnp.float32)
        ces.append(naive_ce(h_prev, k + 1))
    want = lm + cfg.mtp_loss_weight / cfg.mtp_depth * sum(ces)
    np.testing.assert_allclose(float(metrics["lm_loss"]), lm, rtol=1e-5)
    np.testing.assert_allclose(float(metrics["mtp_loss"]), np.mean(ces), rtol=1e-5)
    np.testing.assert_allclose(float(loss), want, rtol=1e-5)
    assert metrics["expert_load"].shape == (2 + cfg.mtp_depth, cfg.n_routed_experts)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["dense", "sparse"])
def test_gradients_finite_in_bf16(mode):
    m = GLM(tiny(dtype="bfloat16", param_dtype="bfloat16", **THREE_LAYERS), nnx.Rngs(2))
    b = random_batch(m.cfg, 2, 48, seed=7)
    grads = jit_once(nnx.grad(lambda m, b: m.loss(b, mode)[0]))(m, b)
    leaves = jax.tree.leaves(grads)
    assert all(bool(jnp.all(jnp.isfinite(g.astype(jnp.float32)))) for g in leaves)
    assert sum(float(jnp.sum(jnp.abs(g.astype(jnp.float32)))) for g in leaves) > 0


@pytest.mark.slow
def test_lm_loss_never_reaches_the_indexer_and_the_router_bias_is_not_a_param(model):
    b = random_batch(model.cfg, 2, 48, seed=8)
    grads = jit_once(nnx.grad(lambda m, b: m.loss(b, "sparse")[0]))(model, b)
    idx_grad = grads["stacks"][0]["units"]["layers"][0]["self_attn"]["indexer"]
    assert all(float(jnp.max(jnp.abs(g))) == 0 for g in jax.tree.leaves(idx_grad))
    mla_grad = grads["stacks"][0]["units"]["layers"][0]["self_attn"]["q_a_proj"]
    assert float(jnp.max(jnp.abs(mla_grad[...]))) > 0
    assert "e_score_correction_bias" not in str(jax.tree_util.tree_structure(nnx.state(grads)))


@pytest.mark.slow
def test_compiled_program_size_does_not_grow_with_depth():
    def hlo_size(n_layers):
        cfg = tiny(num_hidden_layers=n_layers, indexer_types=None, index_topk_freq=2, index_skip_topk_offset=1)
        m = GLM(cfg, nnx.Rngs(0))
        gd, st = nnx.split(m)
        b = random_batch(cfg, 1, 32)
        f = jax.jit(lambda st, b: nnx.merge(gd, st).loss(b, "sparse")[0])
        return len(f.lower(st, b).as_text())

    small, big = hlo_size(5), hlo_size(17)  # 1 dense + 2 / 8 (F S) units
    assert big < 1.05 * small, (small, big)


def test_glm5_and_glm52_shapes_plan_into_few_stacks_and_count_exactly():
    from glmjax.config import ModelConfig
    glm5 = ModelConfig(vocab_size=154880, hidden_size=6144, intermediate_size=12288, moe_intermediate_size=2048,
                       num_hidden_layers=78, first_k_dense_replace=3, num_attention_heads=64, q_lora_rank=2048,
                       kv_lora_rank=512, qk_nope_head_dim=192, qk_rope_head_dim=64, v_head_dim=256,
                       n_routed_experts=256, n_shared_experts=1, num_experts_per_tok=8, index_n_heads=32,
                       index_head_dim=128, index_topk=2048, max_position_embeddings=202752)
    glm52 = glm5.replace(index_topk_freq=4, index_skip_topk_offset=3)
    assert len(plan_stacks(glm5)) == 2 and len(plan_stacks(glm52)) == 3
    assert glm52.layer_indexer_types.count("full") == 21

    def count(cfg):
        abstract = nnx.eval_shape(lambda: GLM(cfg, nnx.Rngs(0)))
        return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(abstract)))

    # docs/model.md A.1: exact totals from the GLM-5.1 checkpoint shapes (without / with the MTP layer)
    assert count(glm5.replace(num_nextn_predict_layers=0)) == 743_911_218_432
    assert count(glm5) == 753_864_139_008
    # A.2: shared layers carry no indexer: 57 x 9,371,904 fewer parameters
    assert count(glm5) - count(glm52) == 57 * 9_371_904


@pytest.mark.slow
@pytest.mark.parametrize("remat", ["full", "save_dots"])
def test_remat_policies_give_the_same_loss_and_gradients(remat):
    b = random_batch(tiny(), 2, 32, seed=9)
    grad = jit_once(nnx.value_and_grad(lambda m, b: m.loss(b, "sparse")[0]))
    l0, g0 = grad(GLM(tiny(**THREE_LAYERS), nnx.Rngs(3)), b)
    l1, g1 = grad(GLM(tiny(remat=remat, **THREE_LAYERS), nnx.Rngs(3)), b)
    np.testing.assert_allclose(l0, l1, rtol=1e-6)
    for x, y in zip(jax.tree.leaves(g0), jax.tree.leaves(g1)):
        np.testing.assert_allclose(x, y, atol=1e-6, rtol=1e-5)
