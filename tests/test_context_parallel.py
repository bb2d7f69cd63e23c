"""Context parallelism on 8 CPU devices (kernels interpreted): every stage's loss and gradients on context=4 x
expert=2 (XLA attention), and the sparse stages' on context=2 x fsdp=2 x tensor=2 (Pallas kernels), equal one
device's, in the zig-zag layout, with packed documents that cross the context-shard boundaries, padding, and S = 56
(7 tokens per zig-zag chunk) a multiple of no block (block_q 16, loss_chunk 20; 14 or 28 local queries per shard);
the layout's causal work per shard; top-k indices."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import pallas_kernels
from glmjax import parallel as par
from glmjax.model import context
from glmjax.model.indexer import index_topk
from sharded_training import (DOCS, FAST, GROUPS, S, assert_equal_to_reference, context_reference,
                              context_stages_on_mesh)

# (mesh, attention_impl, stage groups): context=4 with expert parallelism (the MoE's tokens split over expert x
# context, experts over expert) with the XLA functions, every stage; context=2 x fsdp=2 x tensor=2 with the Pallas
# kernels, the sparse stages (the kernels are their top-k and sparse MLA; the dense stages and PPO's forward run the
# same XLA functions with either impl, the suite's time budget: 42 s of compiling alone against 18 s, and the dense
# forward on this mesh is test_decode_sharded's). One compile per mesh.
MESHES = {"context4_expert2_xla": (dict(data=1, expert=2, context=4), "xla", GROUPS),
          "context2_fsdp2_tensor2_pallas": (dict(data=1, fsdp=2, context=2, tensor=2), "pallas", ("sparse",))}


@pytest.fixture(scope="module")
def reference():
    """One device, XLA attention: (graphdef, params, rest, batch, w, stage results)."""
    return context_reference()


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(MESHES))
def test_every_stage_equals_one_device(name, reference, monkeypatch):
    """The mesh's stages: every loss and every gradient (f32, <= 1e-5 relative), PPO's per-token log-probs and the
    top-k diagnostics on the mesh equal one device's (XLA attention)."""
    monkeypatch.setenv(pallas_kernels.common.INTERPRET_ENV, "fast")
    mesh_axes, impl, groups = MESHES[name]
    stages, fwd = reference[-1]
    want = (stages, fwd) if groups == GROUPS else ({"sparse_adapt+indexshare": stages["sparse_adapt+indexshare"]}, {})
    got = context_stages_on_mesh(par.make_mesh(mesh_axes), impl, groups=groups)
    assert_equal_to_reference(jax.device_get(got), want)


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
    mesh = par.make_mesh(MESHES["context4_expert2_xla"][0])
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
