"""Pallas DSA kernels (pallas_kernels/) in interpret mode against their XLA references (the kernel modules' own, and
the model's XLA functions that the "xla" backend uses).

"checked" = Pallas' TPU interpreter with out-of-bounds reads raising, NaN-poisoned uninitialised memory and DMA race
detection (the kernels' DMAs really run, one row at a time, ~10 ms each on CPU: small shapes); "fast" = the
discharge interpreter (same kernel code as plain XLA ops) for the bf16, multi-chunk and whole-model cases.
"""
import functools
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax._src.pallas.mosaic.interpret import interpret_pallas_call as tpu_interpret  # race detector state
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

import pallas_kernels
from glmjax import hardware
from glmjax.model import GLM
from glmjax.model import indexer as ref_indexer
from glmjax.model.sparse_attention import sparse_mla_xla
from helpers import batch_from_docs, random_batch, tiny
from pallas_kernels import index_topk, index_topk_reference, sparse_mla, sparse_mla_reference
from pallas_kernels import sparse_mla_gpu
from pallas_kernels.sparse_mla import cache_layout


def segments(B, lengths):
    """[B, sum(lengths)] segment ids 1, 2, ... (packed documents)."""
    return jnp.broadcast_to(jnp.concatenate([jnp.full((n,), i + 1, jnp.int32) for i, n in enumerate(lengths)]),
                            (B, sum(lengths)))


def select(key, seg, K, holes=0.1):
    """Indices [B,S,K] of random visible keys (causal, same segment): highest random score first, -1 where fewer
    than K keys are visible, plus random -1 holes anywhere in a row."""
    B, S = seg.shape
    k1, k2 = jax.random.split(key)
    scores = jnp.where(ref_indexer.visible(seg, seg, jnp.arange(S)), jax.random.uniform(k1, (B, S, S)), -jnp.inf)
    vals, ids = jax.lax.top_k(scores, K)
    ids = jnp.where((vals == -jnp.inf) | (jax.random.uniform(k2, ids.shape) < holes), -1, ids)
    return ids.astype(jnp.int32)


def no_races():
    return tpu_interpret.races is not None and not tpu_interpret.races.races_found


def finite(x):
    return jnp.where(jnp.isfinite(x), x, 0.0)


# ------------------------------------------------------------------------------------------------ sparse MLA

H, C, R, SCALE = 2, 40, 32, 0.3
B_MLA, S_MLA, K_MLA = 1, 12, 6  # S not a multiple of the query blocks (16 forward, 2 x 8 backward); S > k


def mla_inputs(dtype=jnp.float32, B=B_MLA, S=S_MLA, K=K_MLA, seed=0):
    ks = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(ks[0], (B, S, H, C), jnp.float32).astype(dtype)
    kv = jax.random.normal(ks[1], (B, S, C), jnp.float32).astype(dtype)
    seg = segments(B, [S // 2 - 1, S - S // 2 + 1])  # two packed documents: early rows of each have < K keys
    idx = select(ks[2], seg, K)
    return q, kv, jnp.where((idx == 2) | (idx == S - 3), -1, idx)  # two keys nobody selects


def mla_loss(fn, idx, ct, **kw):
    """Scalar loss through both outputs: <out, ct> + 0.5 * sum of the finite lse."""
    def loss(q, kv):
        out, lse = fn(q, kv, idx, scale=SCALE, kv_lora_rank=R, **kw)
        return jnp.sum(out.astype(jnp.float32) * ct) + 0.5 * jnp.sum(finite(lse))
    return loss


def test_sparse_mla_grads_f32_checked():
    q, kv, idx = mla_inputs()
    ct = jax.random.normal(jax.random.key(7), (B_MLA, S_MLA, H, R))
    dq, dkv = jax.jit(jax.grad(mla_loss(sparse_mla, idx, ct, interpret="checked"), (0, 1)))(q, kv)
    assert no_races()  # about the backward kernel, which ran last
    rq, rkv = jax.jit(jax.grad(mla_loss(sparse_mla_reference, idx, ct), (0, 1)))(q, kv)
    np.testing.assert_allclose(dq, rq, atol=1e-4, rtol=1e-4)
    np.testing.assert_allclose(dkv, rkv, atol=1e-4, rtol=1e-4)
    selected = jnp.zeros((B_MLA, S_MLA), bool).at[jnp.arange(B_MLA)[:, None, None],
                                                  jnp.where(idx >= 0, idx, S_MLA)].set(True, mode="drop")
    assert (~selected).any() and (dkv[~selected] == 0).all()  # keys nobody selected get no gradient


def test_sparse_mla_gpu_kernel_equals_the_reference_with_gradients():
    """The Pallas GPU (Triton) sparse MLA, interpreted: out, lse and the gradients w.r.t. q and kv through both
    outputs against `sparse_mla_reference`: two packed documents (early queries with fewer than k keys), -1 holes,
    a first chunk of -1s before valid rows, a query with no key, keys nobody selects (no gradient), 2 heads padded
    to 16, k = 6 in chunks of 4 (the last one padded); the backward's atomic adds run discharged."""
    rope = 16  # the GPU kernel wants the rope part a power of two >= 16 (C = 48)
    q, kv, idx = mla_inputs(B=2)
    q, kv = (jnp.concatenate([a, jax.random.normal(jax.random.key(9), a.shape[:-1] + (R + rope - C,))], -1)
             for a in (q, kv))
    idx = idx.at[1, 7].set(jnp.array([-1, -1, -1, -1, 5, 2])).at[1, 8].set(-1)  # a first chunk of -1s; no key
    ct = jax.random.normal(jax.random.key(7), (2, S_MLA, H, R))
    gpu = functools.partial(sparse_mla_gpu.sparse_mla, interpret=True, block_k=4)
    (out, lse), (ref_out, ref_lse) = (jax.jit(functools.partial(fn, scale=SCALE, kv_lora_rank=R))(q, kv, idx)
                                      for fn in (gpu, sparse_mla_reference))
    np.testing.assert_allclose(out, ref_out, atol=1e-5)
    np.testing.assert_array_equal(jnp.isinf(lse), jnp.isinf(ref_lse))
    assert jnp.isinf(lse[1, 8]).all() and jnp.isfinite(lse[1, 7]).all()
    np.testing.assert_allclose(finite(lse), finite(ref_lse), atol=1e-5)
    grads = jax.jit(jax.grad(mla_loss(gpu, idx, ct), (0, 1)))(q, kv)
    ref_grads = jax.jit(jax.grad(mla_loss(sparse_mla_reference, idx, ct), (0, 1)))(q, kv)
    for a, b in zip(grads, ref_grads):
        np.testing.assert_allclose(a, b, atol=1e-4, rtol=1e-4)
    selected = jnp.zeros((2, S_MLA), bool).at[jnp.arange(2)[:, None, None],
                                              jnp.where(idx >= 0, idx, S_MLA)].set(True, mode="drop")
    assert (~selected).any() and (grads[1][~selected] == 0).all()


def test_pallas_backend_on_a_gpu_takes_the_gpu_kernel(monkeypatch):
    """attention_impl="pallas" traced for an NVIDIA GPU: XLA's top-k (the TPU kernel has no GPU lowering) and the
    Pallas GPU sparse MLA, compiled (not interpreted)."""
    monkeypatch.setattr(hardware, "platform", lambda mesh=None: "gpu")
    cfg = tiny(attention_impl="pallas", num_hidden_layers=2, indexer_types=("full", "shared"), mtp_depth=0,
               num_nextn_predict_layers=0)
    model = GLM(cfg, nnx.Rngs(0))
    batch = random_batch(model.cfg, 1, 16)
    jaxpr = str(jax.make_jaxpr(lambda: model.loss(batch, "sparse"))())
    assert "name=sparse_mla_gpu_fwd" in jaxpr and "name=index_topk" not in jaxpr and "interpret=False" in jaxpr


@pytest.mark.slow
def test_sparse_mla_multi_chunk_and_bf16_fast():
    """3 chunks of online softmax (the table's single chunk: the checked tests above), batch 2, f32 and both bf16
    layouts, forward and backward."""
    B, S, K = 2, 29, 24
    ct = jax.random.normal(jax.random.key(3), (B, S, H, R))

    @functools.partial(jax.jit, static_argnums=3)
    def both(q, kv, idx, layout):
        kw = dict(interpret="fast", block_k=8, layout=layout)
        return (sparse_mla(q, kv, idx, scale=SCALE, kv_lora_rank=R, **kw), sparse_mla_reference(q, kv, idx, scale=SCALE,
                kv_lora_rank=R), jax.grad(mla_loss(sparse_mla, idx, ct, **kw), (0, 1))(q, kv),
                jax.grad(mla_loss(sparse_mla_reference, idx, ct), (0, 1))(q, kv))

    for dtype, layout, tol_out, tol_grad in [(jnp.float32, None, 1e-5, 1e-4), (jnp.bfloat16, "packed", 3e-2, 6e-2),
                                             (jnp.bfloat16, "pairs", 3e-2, 6e-2)]:
        q, kv, idx = mla_inputs(dtype, B, S, K, seed=1)
        if layout == "pairs":  # T must be even: one more row, never selected
            kv = jnp.pad(kv, ((0, 0), (0, 1), (0, 0)))
        (out, lse), (ref_out, ref_lse), g, rg = both(q, kv, idx, layout)
        assert out.dtype == dtype
        np.testing.assert_allclose(out.astype(jnp.float32), ref_out.astype(jnp.float32), atol=tol_out, rtol=tol_out)
        np.testing.assert_allclose(finite(lse), finite(ref_lse), atol=tol_out, rtol=tol_out)
        for a, b in zip(g, rg):
            assert a.dtype == dtype
            scale = float(jnp.max(jnp.abs(b.astype(jnp.float32))))
            np.testing.assert_allclose(a.astype(jnp.float32) / scale, b.astype(jnp.float32) / scale, atol=tol_grad)


def test_sparse_mla_rejects_bad_input():
    q, kv, idx = mla_inputs()
    with pytest.raises(ValueError, match="indices"):
        sparse_mla(q, kv, idx.astype(jnp.float32), scale=SCALE, kv_lora_rank=R)
    with pytest.raises(ValueError, match="kv_lora_rank"):
        sparse_mla(q, kv, idx, scale=SCALE, kv_lora_rank=C + 1)
    with pytest.raises(ValueError, match="layout"):
        sparse_mla(q, kv, idx, scale=SCALE, kv_lora_rank=R, layout="packed")  # f32 cache
    with pytest.raises(ValueError, match="T=11 must be even"):
        sparse_mla(q.astype(jnp.bfloat16), kv[:, :11].astype(jnp.bfloat16), idx, scale=SCALE, kv_lora_rank=R,
                   layout="pairs")


def test_race_detector_is_live():
    """Negative control for the race checks above: reading a DMA destination before waiting is reported."""
    def racy(x_hbm, o_ref, buf, sem):
        copy = pltpu.make_async_copy(x_hbm, buf, sem.at[0])
        copy.start()
        o_ref[...] = buf[...]  # read before wait
        copy.wait()

    x = jnp.ones((8, 128))
    pl.pallas_call(racy, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                   in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
                   scratch_shapes=[pltpu.VMEM(x.shape, x.dtype), pltpu.SemaphoreType.DMA((1,))],
                   interpret=pallas_kernels.common.interpret_params("checked"))(x).block_until_ready()
    assert tpu_interpret.races.races_found


T_LONG = 20_000  # > 16,384, the old bound of the kernels (still > 2·S·k: the automatic layout for bf16 is "pairs")


def long_cache_inputs(dtype, S, K, seed=0):
    """q [1,S,H,C], kv [1,T_LONG,C], indices [1,S,K]: every query picks most of its rows from a pool of 10 (the
    last 8 rows, row 0 and row 17,001), so consecutive queries update the same dkv rows; plus one far row of its
    own, and -1 holes."""
    ks = jax.random.split(jax.random.key(seed), 5)
    q = jax.random.normal(ks[0], (1, S, H, C), jnp.float32).astype(dtype)
    kv = jax.random.normal(ks[1], (1, T_LONG, C), jnp.float32).astype(dtype)
    pool = jnp.array([T_LONG - 1 - i for i in range(8)] + [0, 17_001], jnp.int32)
    picks = jax.vmap(lambda k: jax.random.permutation(k, pool)[:K - 2])(jax.random.split(ks[2], S))  # distinct
    own = jax.random.randint(ks[3], (S, 1), 1, 17_000, jnp.int32)
    idx = jnp.concatenate([picks, own, jnp.full((S, 1), -1, jnp.int32)], axis=1)
    idx = jnp.where(jax.random.uniform(ks[4], idx.shape) < 0.15, -1, idx)
    return q, kv, jax.vmap(lambda k, row: jax.random.permutation(k, row))(jax.random.split(ks[4], S), idx)[None]


@pytest.mark.parametrize("dtype,layout,in_vmem,S", [
    (jnp.float32, None, False, 4),  # HBM dkv accumulator, read-modify-write DMAs
    (jnp.bfloat16, "packed", False, 4),  # uint32 words split in the kernel
    (jnp.bfloat16, None, None, 2),  # decode: the automatic layout ("pairs"), forward only
])
@pytest.mark.slow
def test_sparse_mla_long_cache_checked(dtype, layout, in_vmem, S):
    """T = 20,000 > 16,384 against the XLA reference, forward and backward (dq, dkv; decode: forward), in the checked
    interpreter (DMA race detection, DMAs executed when waited on). k = 12 in chunks of 8 (two chunks, read
    semaphores per chunk). Most rows are selected by several consecutive queries: without the wait for the previous
    query's dkv writes, its reads see stale rows and updates are lost."""
    K = 12
    q, kv, idx = long_cache_inputs(dtype, S, K)
    counts = jnp.zeros(T_LONG, jnp.int32).at[jnp.where(idx[0] >= 0, idx[0], T_LONG)].add(1, mode="drop")
    assert (idx == -1).any() and int(jnp.sum(counts >= S)) >= 3  # holes, and rows that every query updates
    assert all(len(set(r) - {-1}) == (r >= 0).sum() for r in np.asarray(idx[0]))  # distinct within a query
    if layout is None and dtype == jnp.bfloat16:
        assert cache_layout(dtype, S, T_LONG, K) == "pairs"
    ct = jax.random.normal(jax.random.key(7), (1, S, H, R))
    kw = dict(interpret="checked", block_k=8, layout=layout, dkv_in_vmem=in_vmem)
    out, lse = jax.jit(lambda *a: sparse_mla(*a, scale=SCALE, kv_lora_rank=R, **kw))(q, kv, idx)
    assert no_races()
    ref_out, ref_lse = sparse_mla_reference(q, kv, idx, scale=SCALE, kv_lora_rank=R)
    tol_out, tol_grad = (1e-5, 1e-4) if dtype == jnp.float32 else (3e-2, 6e-2)
    np.testing.assert_allclose(out.astype(jnp.float32), ref_out.astype(jnp.float32), atol=tol_out, rtol=tol_out)
    np.testing.assert_array_equal(jnp.isinf(lse), jnp.isinf(ref_lse))
    np.testing.assert_allclose(finite(lse), finite(ref_lse), atol=tol_out, rtol=tol_out)
    if in_vmem is None:
        return
    dq, dkv = jax.jit(jax.grad(mla_loss(sparse_mla, idx, ct, **kw), (0, 1)))(q, kv)
    assert no_races()
    rq, rkv = jax.jit(jax.grad(mla_loss(sparse_mla_reference, idx, ct), (0, 1)))(q, kv)
    for a, b in [(dq, rq), (dkv, rkv)]:
        assert a.dtype == dtype
        a, b = a.astype(jnp.float32), b.astype(jnp.float32)
        scale = float(jnp.max(jnp.abs(b)))
        np.testing.assert_allclose(a / scale, b / scale, atol=tol_grad)
    assert (jnp.abs(rkv[0][counts >= S]) > 0).any()  # rows updated by several queries carry gradient
    assert (dkv[0][counts == 0] == 0).all()  # rows nobody selected get none


def test_sparse_mla_picks_the_dkv_accumulator_by_size():
    """VMEM accumulator while T·C·4 <= 40 MiB (no aliased zero slabs), HBM beyond (zero slabs aliased to dkv)."""
    def bwd_aliases(T, C):
        q = jax.ShapeDtypeStruct((1, 4, H, C), jnp.float32)
        kv = jax.ShapeDtypeStruct((1, T, C), jnp.float32)
        idx = jax.ShapeDtypeStruct((1, 4, 8), jnp.int32)
        grad = jax.grad(lambda q, kv, i: jnp.sum(sparse_mla(q, kv, i, scale=SCALE, kv_lora_rank=R,
                                                            interpret="fast")[0]), (0, 1))
        (bwd,) = [e for e in _all_eqns(jax.make_jaxpr(grad)(q, kv, idx).jaxpr)
                  if e.primitive.name == "pallas_call" and e.params["name"] == "sparse_mla_bwd"]
        return bwd.params["input_output_aliases"]

    assert bwd_aliases(81_920, C) == ()  # 81,920 x 128 lanes x 4 B = 40 MiB
    assert bwd_aliases(81_928, C) != ()


def _all_eqns(jaxpr):
    for eqn in jaxpr.eqns:
        yield eqn
        for v in eqn.params.values():
            for sub in v if isinstance(v, (tuple, list)) else (v,):
                sub = getattr(sub, "jaxpr", sub)
                if hasattr(sub, "eqns"):
                    yield from _all_eqns(sub)


# ------------------------------------------------------------------------------------------------ indexer top-k

HI, DI = 4, 32


def indexer_inputs(B, S, T, seed=0, dyadic=False):
    ks = jax.random.split(jax.random.key(seed), 3)
    if dyadic:  # small integers / 4: every product and sum is exact in f32, so equal keys score exactly equal
        q = jax.random.randint(ks[0], (B, S, HI, DI), -2, 3).astype(jnp.float32) / 4
        k = jax.random.randint(ks[1], (B, T // 3, DI), -2, 3).astype(jnp.float32) / 4
        k = jnp.concatenate([k, k, k, k], axis=1)[:, :T]  # every key has duplicates (ties) at other indices
        w = jax.random.randint(ks[2], (B, S, HI), -2, 3).astype(jnp.float32) / 4
    else:
        q = jax.random.normal(ks[0], (B, S, HI, DI))
        k = jax.random.normal(ks[1], (B, T, DI))
        w = jax.random.normal(ks[2], (B, S, HI))
    return q, k, w


def assert_topk_equal(got, want):
    (gi, gv), (wi, wv) = got, want
    assert gi.shape == wi.shape and gi.dtype == jnp.int32
    np.testing.assert_array_equal(gi, wi)  # same keys in the same slots, -1 in the same places
    np.testing.assert_array_equal(jnp.isinf(gv), jnp.isinf(wv))
    np.testing.assert_allclose(finite(gv), finite(wv), atol=1e-5, rtol=1e-5)


def test_index_topk_packed_ragged_checked():
    B, S, K = 1, 150, 20  # 3 query blocks of 64 (ragged), 2 key blocks of 128 (ragged), k = 20 < S
    q, k, w = indexer_inputs(B, S, S)
    seg = segments(B, [60, 9, 81])
    got = jax.jit(lambda *a: index_topk(*a, seg, seg, K, 64, interpret="checked"))(q, k, w)
    want = jax.jit(lambda *a: index_topk_reference(*a, seg, seg, K, 64))(q, k, w)
    assert_topk_equal(got, want)
    ids = got[0]
    assert (ids[:, 0, 1:] == -1).all() and (ids[:, 0, 0] == 0).all()  # first row sees only itself
    assert (ids[:, 60, 1:] == -1).all() and (ids[:, 60, 0] == 60).all()  # first row of document 2
    assert ((ids[:, 100] >= 69) & (ids[:, 100] <= 100)).all()  # document 3 starts at 69: selects within it
    assert ((ids >= 0).sum(-1) == K).mean() > 0.5  # most rows really select (S > k)


def test_index_topk_skips_key_blocks_before_the_earliest_document_start():
    """Documents that start after key block 0, so the packed-sequence block skip really decides something. Key
    blocks of 128, query blocks of 64. Query block [256, 320) holds the tail of document 2 (starts at 100, key
    block 0) and the head of document 3 (starts at 300, key block 2): the blocks it may skip end at the *earliest*
    start (none here); a bound from the latest start (300) would drop keys 100..255 of document 2. Query blocks
    from 320 on lie in document 3 alone and skip key blocks 0 and 1."""
    B, S, K = 1, 400, 20
    q, k, w = indexer_inputs(B, S, S, seed=5)
    seg = segments(B, [100, 200, 100])
    got = jax.jit(lambda *a: index_topk(*a, seg, seg, K, 64, interpret="fast"))(q, k, w)
    want = jax.jit(lambda *a: index_topk_reference(*a, seg, seg, K, 64))(q, k, w)
    ids = want[0][0]
    assert ((ids[256:300] >= 100) & (ids[256:300] < 256)).any()  # document 2's queries there select early keys
    assert ((ids[300:] == -1) | (ids[300:] >= 300)).all()
    assert_topk_equal(got, want)


def test_index_topk_ties_are_deterministic_and_lowest_index_first():
    B, S, K = 1, 140, 16
    q, k, w = indexer_inputs(B, S, S, seed=2, dyadic=True)
    seg = jnp.ones((B, S), jnp.int32)
    want = jax.jit(lambda *a: index_topk_reference(*a, seg, seg, K, 32))(q, k, w)
    vals, kth = want[1][0], want[1][0][:, -1:]
    assert (jnp.isfinite(vals[:, 1:]) & (vals[:, :-1] == vals[:, 1:])).sum() > 200  # many exact ties in the lists
    tied = (ref_indexer.index_scores(q, k, w, seg, seg)[0] == kth).sum(-1)  # keys scoring exactly the k-th score
    assert (jnp.isfinite(kth[:, 0]) & (tied > (vals == kth).sum(-1))).any()  # ... and ties at the k-th place
    a = jax.jit(lambda *a: index_topk(*a, seg, seg, K, 32, interpret="fast"))(q, k, w)
    b = jax.jit(lambda *a: index_topk(*a, seg, seg, K, 32, interpret="fast"))(q, k, w)  # traced and run again
    np.testing.assert_array_equal(a[0], b[0])
    assert_topk_equal(a, want)


def test_index_topk_decode_cache_and_short_cache():
    B, T, K = 2, 200, 24
    q, k, w = indexer_inputs(B, 3, T, seed=3)
    q_idx = jnp.array([[150, 151, 152], [197, 198, 199]], jnp.int32)  # new tokens at these cache slots
    k_valid = (jnp.arange(T) < q_idx[:, -1:] + 1).astype(jnp.int32).at[:, 10:20].set(0)  # holes in the cache
    q_seg = jnp.ones((B, 3), jnp.int32)

    @functools.partial(jax.jit, static_argnums=0)
    def both(topk, q, k, w, q_seg, k_seg, q_idx=None):
        return (index_topk(q, k, w, q_seg, k_seg, topk, 256, q_idx, interpret="fast"),
                index_topk_reference(q, k, w, q_seg, k_seg, topk, 256, q_idx))

    got, want = both(K, q, k, w, q_seg, k_valid, q_idx)
    assert_topk_equal(got, want)
    assert not ((got[0] >= 10) & (got[0] < 20)).any()
    q, k, w = indexer_inputs(1, 12, 12, seed=4)  # T < topk: k' = T, every visible key selected
    seg = jnp.ones((1, 12), jnp.int32)
    got, want = both(32, q, k, w, seg, seg)
    assert got[0].shape == (1, 12, 12)
    assert_topk_equal(got, want)
    T = 20_000  # a long cache (157 key blocks); the middle query's document is keys 100..18,999
    q, k, w = indexer_inputs(1, 3, T, seed=3)
    k_seg = jnp.ones((1, T), jnp.int32).at[:, 100:19_000].set(2)
    got, want = both(K, q, k, w, jnp.array([[1, 2, 1]], jnp.int32), k_seg, jnp.array([[T - 3, T - 2, T - 1]]))
    assert_topk_equal(got, want)
    assert ((got[0][0, 1] >= 100) & (got[0][0, 1] < 19_000)).all() and (got[0][0, 0] < 100).any()


def test_index_topk_score_gradients():
    """The selected scores are differentiable like lax.top_k's values in the reference."""
    B, S, K = 1, 24, 8
    q, k, w = indexer_inputs(B, S, S, seed=5)
    seg = jnp.ones((B, S), jnp.int32)
    ct = jax.random.normal(jax.random.key(9), (B, S, K))

    def loss(fn, **kw):
        return lambda q, k, w: jnp.sum(finite(fn(q, k, w, seg, seg, K, 16, **kw)[1]) * ct)

    g = jax.jit(jax.grad(loss(index_topk, interpret="fast"), (0, 1, 2)))(q, k, w)
    rg = jax.jit(jax.grad(loss(index_topk_reference), (0, 1, 2)))(q, k, w)
    for a, b in zip(g, rg):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["checked", "fast"])
def test_kernels_under_remat(mode):
    """Both kernels inside jax.checkpoint (nothing saved, as model.remat="full") under jax.grad: the "checked"
    interpreter's io_callbacks used to stop remat ("Effects not supported in partial-eval of checkpoint/remat").
    Same value and gradients as the XLA references."""
    S, K = 8, 4
    q, kv, _ = mla_inputs(S=S)
    qi, ki, w = indexer_inputs(1, S, S, seed=6)
    seg = jnp.ones((1, S), jnp.int32)

    def loss(topk, attend, **kw):
        def f(q, kv, qi, w):
            ids, vals = topk(qi, ki, w, seg, seg, K, 16, **kw)
            out, lse = attend(q, kv, ids, scale=SCALE, kv_lora_rank=R, **kw)
            return jnp.sum(out ** 2) + jnp.sum(finite(lse)) + jnp.sum(finite(vals))
        return f

    args = (q, kv, qi, w)
    kernels = loss(index_topk, sparse_mla, interpret=mode)
    remat = jax.checkpoint(kernels, policy=jax.checkpoint_policies.nothing_saveable)
    got = jax.jit(jax.value_and_grad(remat, (0, 1, 2, 3)))(*args)
    ref = jax.jit(jax.value_and_grad(loss(index_topk_reference, sparse_mla_reference), (0, 1, 2, 3)))(*args)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref)):
        np.testing.assert_allclose(a, b, atol=1e-4, rtol=1e-4)


# ------------------------------------------------------------------------------------------------ the references


def test_references_equal_the_models_xla_functions():
    """The kernels' own references and the model's blocked XLA functions (the "xla" backend) agree: values and
    gradients of sparse MLA, and the top-k indices slot for slot (packed, ties, cache slots)."""
    q, kv, idx = mla_inputs(B=2, S=29, K=24, seed=1)
    ct = jax.random.normal(jax.random.key(3), (2, 29, H, R))
    for a, b in zip(sparse_mla_reference(q, kv, idx, scale=SCALE, kv_lora_rank=R),
                    sparse_mla_xla(q, kv, idx, scale=SCALE, kv_lora_rank=R, block_q=8)):
        np.testing.assert_allclose(finite(a), finite(b), atol=1e-5, rtol=1e-5)
    g = jax.grad(mla_loss(sparse_mla_reference, idx, ct), (0, 1))(q, kv)
    rg = jax.grad(mla_loss(sparse_mla_xla, idx, ct, block_q=8), (0, 1))(q, kv)
    for a, b in zip(g, rg):
        np.testing.assert_allclose(a, b, atol=1e-4, rtol=1e-4)

    q, k, w = indexer_inputs(1, 140, 140, seed=2, dyadic=True)
    seg = segments(1, [60, 80])
    assert_topk_equal(index_topk_reference(q, k, w, seg, seg, 16, 32),
                      ref_indexer.index_topk(q, k, w, seg, seg, 16, 32))
    q, k, w = indexer_inputs(2, 3, 200, seed=3)
    q_idx = jnp.array([[150, 151, 152], [197, 198, 199]], jnp.int32)
    k_valid = (jnp.arange(200) < q_idx[:, -1:] + 1).astype(jnp.int32).at[:, 10:20].set(0)
    q_seg = jnp.ones((2, 3), jnp.int32)
    assert_topk_equal(index_topk_reference(q, k, w, q_seg, k_valid, 24, 256, q_idx),
                      ref_indexer.index_topk(q, k, w, q_seg, k_valid, 24, 256, q_idx))


# ------------------------------------------------------------------------------------------------ the model


def test_pallas_kernels_import_nothing_of_glmjax():
    code = "import sys, pallas_kernels; print(sorted(m for m in sys.modules if m.split('.')[0] == 'glmjax'))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_attention_impl_selects_the_kernels(monkeypatch):
    """The whole model in sparse mode with the indexer KL traces the two Pallas kernels with attention_impl="pallas",
    and none with "xla" (in the "fast" interpret mode: "checked" hides the pallas_call inside a pure_callback)."""
    monkeypatch.setenv(pallas_kernels.common.INTERPRET_ENV, "fast")
    def jaxpr(impl):
        cfg = tiny(attention_impl=impl, num_hidden_layers=2, indexer_types=("full", "shared"), mtp_depth=0,
                   num_nextn_predict_layers=0)
        model = GLM(cfg, nnx.Rngs(0))
        batch = random_batch(model.cfg, 1, 16)
        return str(jax.make_jaxpr(lambda: model.loss(batch, "sparse", index_loss_weight=1.0))())

    pallas = jaxpr("pallas")
    assert "pallas_call" in pallas and "name=index_topk" in pallas and "name=sparse_mla_fwd" in pallas
    assert "pallas_call" not in jaxpr("xla")


def train_losses(impl: str, steps: int = 3):
    """A few Adam steps of the tiny model in sparse mode with the indexer KL: (loss, index KL) per step."""
    cfg = tiny(attention_impl=impl, num_hidden_layers=3, indexer_types=("full", "shared", "full"), mtp_depth=1)
    rng = np.random.default_rng(0)
    batch = batch_from_docs([[rng.integers(1, 500, 20), rng.integers(1, 500, 12)], [rng.integers(1, 500, 30)]], 32)
    graphdef, params, rest = nnx.split(GLM(cfg, nnx.Rngs(0)), nnx.Param, ...)
    tx = optax.adam(1e-2)

    @jax.jit
    def step(params, opt):
        def loss_fn(p):
            return nnx.merge(graphdef, p, rest).loss(batch, "sparse", index_loss_weight=1.0)
        (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        updates, opt = tx.update(grads, opt, params)
        return optax.apply_updates(params, updates), opt, jnp.stack([loss, metrics["index_kl"]])

    opt, out = tx.init(params), []
    for _ in range(steps):
        params, opt, m = step(params, opt)
        out.append(m)
    return np.array(out)


@pytest.mark.slow
def test_tiny_model_trains_the_same_with_pallas(monkeypatch):
    """attention_impl="pallas" (fast interpret mode) vs "xla", sparse mode with the indexer KL: same loss and KL for
    3 Adam steps within 1e-4 relative (observed: 1.4e-6 absolute on losses ~5-7, 8e-6 relative on the KL; the
    kernels sum in a different order, the selected keys are identical)."""
    monkeypatch.setenv(pallas_kernels.common.INTERPRET_ENV, "fast")
    xla, pallas = train_losses("xla"), train_losses("pallas")
    assert xla[-1, 0] < xla[0, 0] - 0.5  # it trains
    np.testing.assert_allclose(pallas, xla, rtol=1e-4)
