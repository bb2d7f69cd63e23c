"""Context parallelism on 8 CPU devices (kernels interpreted): every stage's loss and gradients on `context=4` and
on `context=2 x fsdp=2 x tensor=2` equal one device's, in the zig-zag layout, with packed documents that cross the
context-shard boundaries, padding, and S = 56 (7 tokens per zig-zag chunk) a multiple of no block (block_q 16,
loss_chunk 20; 14 or 28 local queries per shard); the layout's causal work per shard; top-k indices."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

import pallas_kernels
from glmjax import parallel as par
from glmjax.model import GLM, Batch, context
from glmjax.model.indexer import index_topk
from glmjax.rl.trainer import token_logprobs
from helpers import batch_from_docs, tiny

MESHES = {"context4": dict(context=4), "context2_fsdp2_tensor2": dict(data=1, fsdp=2, context=2, tensor=2)}
S = 56
DOCS = ((20, 25, 11), (56,), (9, 30, 10), (3, 40, 9))  # every row crosses shard boundaries; row 3 ends in padding
FAST = {"xla_backend_optimization_level": 0}  # halves XLA:CPU's compile time of these tiny programs
TEMPERATURE = 0.7


def cfg(impl: str):
    """Layer 0 dense with its indexer, layer 1 MoE sharing its top-k (IndexShare), the MTP layer for 2 depths."""
    return tiny(attention_impl=impl, num_hidden_layers=2, first_k_dense_replace=1, indexer_types=("full", "shared"),
                mtp_depth=2, init_std=0.1)  # init_std: a KL far from 0 (no cancellation in the 1e-5 check)


def packed_batch(vocab: int) -> tuple[Batch, np.ndarray]:
    """The packed batch with an SFT loss mask (-> Batch with loss_mask) and per-token PPO weights."""
    rng = np.random.default_rng(0)
    b = batch_from_docs([[rng.integers(1, vocab, n) for n in row] for row in DOCS], S)
    mask = (rng.random((len(DOCS), S)) < 0.6).astype(np.int32)
    return Batch(*b[:3], jnp.asarray(mask)), rng.normal(size=(len(DOCS), S)).astype(np.float32)


def all_stages(graphdef, sparse_only: bool = False):
    """(params, rest, batch, ppo weights) -> {stage group: ((loss, metrics), grads)}, per-token forward outputs.

    The dense stages are one loss: LM + MTP on the SFT mask (sft; pretrain is the same path without a mask) plus the
    indexer KL against dense attention (dense_warmup): the KL reaches only the indexers and the LM terms never do,
    so the gradient holds each stage's gradient on its own parameters and the metrics each stage's loss. The sparse
    stages (sparse_adapt; indexshare: layer 1 shares layer 0's top-k and its indexer distils toward both layers'
    attention) are the LM + MTP + indexer KL in sparse mode, no mask. PPO: the actor's log-prob path (h back in
    natural order, log-probs of the next token) with the dense top-k diagnostics of the same forward."""

    def fn(params, rest, batch, w):
        def stage(mode, b):
            def f(p):
                loss, m = nnx.merge(graphdef, p, rest).loss(b, mode, lm_weight=1.0, index_loss_weight=1.0)
                return loss, {k: m[k] for k in ("lm_loss", "mtp_loss", "index_kl")}
            return jax.value_and_grad(f, has_aux=True)(params)

        def ppo(p):
            m = nnx.merge(graphdef, p, rest)
            h, aux = m(batch._replace(loss_mask=None), "dense", topk_stats=True)
            lp, ent = token_logprobs(h, m.lm_head[...], batch.tokens, TEMPERATURE, m.cfg.loss_chunk)
            return jnp.sum((lp + 0.1 * ent) * w), (lp, aux.attn_topk, aux.index_topk)

        out = {"sparse_adapt+indexshare": stage("sparse", batch._replace(loss_mask=None))}
        if sparse_only:
            return out, None
        out["pretrain/sft+dense_warmup"] = stage("dense", batch)
        (loss, fwd), grads = jax.value_and_grad(ppo, has_aux=True)(params)
        out["ppo"] = ((loss, {}), grads)
        return out, dict(zip(("logp", "attn_topk", "index_topk"), fwd))

    return fn


@pytest.fixture(scope="module")
def reference():
    """One device, XLA attention: (graphdef, params, rest, batch, w, stage results)."""
    c = cfg("xla")
    graphdef, params, rest = nnx.split(GLM(c, nnx.Rngs(0)), nnx.Param, ...)
    batch, w = packed_batch(c.vocab_size)
    out = jax.jit(all_stages(graphdef), compiler_options=FAST)(params, rest, batch, w)
    return graphdef, params, rest, batch, w, jax.device_get(out)


def on_mesh(mesh_axes, impl, sparse_only, reference):
    _, params, rest, batch, w, _ = reference
    mesh = par.make_mesh(mesh_axes)
    graphdef = nnx.graphdef(nnx.eval_shape(lambda: GLM(cfg(impl), nnx.Rngs(0))))
    params, rest = (jax.device_put(t, par.state_shardings(t, mesh)) for t in (params, rest))
    batch, w = par.global_batch((batch, w), mesh, len(DOCS))
    assert batch.tokens.sharding.spec[1] == "context"
    fn = jax.jit(par.with_mesh(all_stages(graphdef, sparse_only), mesh), compiler_options=FAST)
    return jax.device_get(fn(params, rest, batch, w))


def assert_equal_to_reference(got, want):
    (stages, fwd), (stages1, fwd1) = got, want
    for name, ((loss, metrics), grads) in stages.items():
        (loss1, metrics1), grads1 = stages1[name]
        np.testing.assert_allclose(loss, loss1, rtol=1e-5, err_msg=name)
        for k in metrics:
            np.testing.assert_allclose(metrics[k], metrics1[k], rtol=1e-5, err_msg=f"{name} {k}")
        for (path, g), g1 in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(grads1)):
            norm = np.linalg.norm(g1)
            err = np.linalg.norm(g - g1) / norm if norm else np.abs(g).max()
            assert err <= 1e-5, (name, jax.tree_util.keystr(path), err)
    if fwd is None:
        return
    np.testing.assert_allclose(fwd["logp"], fwd1["logp"], atol=2e-5, rtol=1e-5)  # per token, natural order
    np.testing.assert_array_equal(fwd["index_topk"], fwd1["index_topk"])  # the indexer's top-k: identical
    # the attention's top-k (streamed on the mesh, materialised on one device: near-ties may order differently) on
    # the queries of documents (padding queries see only padding keys, all but tied)
    real = np.arange(S)[None] < np.asarray([sum(row) for row in DOCS])[:, None]  # [B,S] not padding
    np.testing.assert_array_equal(fwd["attn_topk"][:, real], fwd1["attn_topk"][:, real])


@pytest.mark.parametrize("mesh_name", sorted(MESHES))
def test_every_stage_equals_one_device_xla(mesh_name, reference):
    """Every stage's loss and every gradient (f32, <= 1e-5 relative) and the per-token outputs equal one device's."""
    assert_equal_to_reference(on_mesh(MESHES[mesh_name], "xla", False, reference), reference[-1])


def test_sparse_stages_with_the_kernels_equal_one_device(reference, monkeypatch):
    """attention_impl="pallas" (the indexer top-k and sparse MLA kernels in shard_map, local queries at their global
    slots) on context=2 x fsdp=2 x tensor=2: the sparse stages equal one device's (XLA attention)."""
    monkeypatch.setenv(pallas_kernels.common.INTERPRET_ENV, "fast")
    got = on_mesh(MESHES["context2_fsdp2_tensor2"], "pallas", True, reference)
    assert_equal_to_reference(got, reference[-1])


def causal_work(perm: np.ndarray, shards: int, block: int | None = None) -> np.ndarray:
    """Per shard, the query-key pairs causal attention computes for its queries (natural slots perm[shard's
    positions]): exactly (block None), or in (query block, key block) tiles the flash kernels skip when the key block
    starts after the query block's last slot."""
    work = []
    for q in perm.reshape(shards, -1):
        if block is None:
            work.append(np.sum(q + 1))
        else:
            last = [np.max(q[i:i + block]) for i in range(0, len(q), block)]
            work.append(sum(block * block * (int(m) // block + 1) for m in last))
    return np.asarray(work, np.float64)


@pytest.mark.parametrize("shards", [2, 4, 8])
def test_zigzag_layout_balances_causal_work(shards):
    """Zig-zag: per-shard causal attention FLOPs within 5% of each other (exactly equal pairs; in 256-row tiles at
    GLM-5's 202,752 tokens too); the contiguous split is the negative control (shard N-1 does ~2N-1 times shard 0)."""
    S_long = 202_752
    zigzag, contiguous = context.Layout("zigzag", shards), context.Layout("contiguous", shards)
    for S_, block in ((2 * shards * 7, None), (S_long, None), (S_long, 256)):
        w = causal_work(zigzag.perm(S_), shards, block)
        assert w.max() / w.min() <= 1.05, (S_, block, w)
        assert np.array_equal(np.sort(zigzag.perm(S_)), np.arange(S_))  # a permutation
    w = causal_work(contiguous.perm(S_long), shards)
    assert w.max() / w.min() > 2 * shards - 1.5
    if shards == 4:  # shard i holds chunks i and 2N-1-i
        np.testing.assert_array_equal(zigzag.perm(16), [0, 1, 14, 15, 2, 3, 12, 13, 4, 5, 10, 11, 6, 7, 8, 9])


def test_indexer_topk_on_context_shards_selects_the_keys_of_one_device(reference, monkeypatch):
    """The XLA indexer top-k with local queries on context=4 (zig-zag, keys gathered and put back in natural order,
    queries at their natural slots) == one device, slot for slot. Negative controls: without the global slots, and
    without the key un-permutation, the indices differ."""
    B, H, D, K = len(DOCS), 4, 16, 8
    rng = np.random.default_rng(1)
    q, k, w = (rng.normal(size=shape).astype(np.float32) for shape in ((B, S, H, D), (B, S, D), (B, S, H)))
    seg = np.asarray(reference[3].segment_ids)
    want, _ = index_topk(q, k, w, seg, seg, K, 16)
    mesh = par.make_mesh(MESHES["context4"])
    args = jax.device_put((q, k, w, seg), NamedSharding(mesh, P(None, "context")))

    def sharded(global_slots=True):
        def fn(q, k, w, seg):
            layout = context.layout("zigzag", S)
            q, k, w, seg = (layout.to_layout(a) for a in (q, k, w, seg))
            slots = layout.slots(seg.shape) if global_slots else jnp.broadcast_to(jnp.arange(S), seg.shape)
            ids, _ = context.local_queries(layout, index_topk, *context.INDEX_TOPK)(q, k, w, seg, seg, K, 16, slots)
            return layout.to_natural(ids)
        return np.asarray(jax.jit(par.with_mesh(fn, mesh), compiler_options=FAST)(*args))

    np.testing.assert_array_equal(sharded(), want)
    assert not np.array_equal(sharded(global_slots=False), want)
    monkeypatch.setattr(context.Layout, "to_natural", lambda self, x, axis=1: x)  # keys left in layout order
    assert not np.array_equal(sharded(), want)
