"""Context parallelism and the Pallas kernels inside the sharded step, on 8 CPU devices (kernels interpreted):
context=2 x fsdp=2 x tensor=2 gives the loss, gradients and top-k indices of one device, with packed documents that
cross the context-shard boundary and S not a multiple of block_q."""
import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

import pallas_kernels
from glmjax import parallel as par
from glmjax.model import GLM, Batch
from glmjax.model.backends import index_topk_on_mesh
from helpers import batch_from_docs
from sharded_training import small_cfg

MESH = dict(data=1, fsdp=2, context=2, tensor=2)
S = 40  # 20 tokens per context shard; block_q 16 divides neither
DOCS = ((15, 17, 8), (40,), (25, 15), (19, 3, 18))  # documents across position 20 in every row
FAST = {"xla_backend_optimization_level": 0}  # halves XLA:CPU's compile time of these tiny programs


@pytest.fixture(scope="module")
def mesh():
    return par.make_mesh(MESH)


def packed_batch(vocab: int) -> Batch:
    rng = np.random.default_rng(0)
    return batch_from_docs([[rng.integers(1, vocab, n) for n in row] for row in DOCS], S)


def cfg(impl):
    """One MoE layer with its own indexer (the MoE's token shards now include the context axis)."""
    return small_cfg(attention_impl=impl, num_hidden_layers=1, first_k_dense_replace=0, indexer_types=("full",))


def kernel_placement(jaxpr, inside=False) -> set:
    """{True: a pallas_call inside a shard_map, False: one outside} over a (closed) jaxpr and its sub-jaxprs."""
    found = set()
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            found.add(inside)
        for v in eqn.params.values():
            for sub in v if isinstance(v, (tuple, list)) else (v,):
                sub = getattr(sub, "jaxpr", sub)
                if hasattr(sub, "eqns"):
                    found |= kernel_placement(sub, inside or eqn.primitive.name == "shard_map")
    return found


def test_sparse_stage_loss_and_gradients_equal_one_device(mesh, monkeypatch):
    """Sparse attention + indexer KL (the sparse_adapt loss), attention_impl="pallas": one device vs the mesh (the
    kernels inside shard_map, keys gathered over context, global query slots; the MoE's tokens split over fsdp x
    context; the chunked LM loss, 2 chunks of 20), f32, <= 1e-5 relative for the loss and every parameter's
    gradient; the XLA backend on the same mesh (XLA partitions it) gives the same loss."""
    monkeypatch.setenv(pallas_kernels.common.INTERPRET_ENV, "fast")
    c = cfg("pallas")
    graphdef, init = par.sharded_init(lambda: GLM(c, nnx.Rngs(0)), mesh, nnx.Param, ...)
    params, rest = init.lower().compile(FAST)()
    batch = packed_batch(c.vocab_size)

    def loss_fn(graphdef):
        return lambda p, r, b: nnx.merge(graphdef, p, r).loss(b, "sparse", index_loss_weight=1.0)[0]

    one_params, one_rest = jax.device_get((params, rest))
    loss1, grads1 = jax.device_get(jax.jit(jax.value_and_grad(loss_fn(graphdef)), compiler_options=FAST)(
        one_params, one_rest, batch))

    sharded = Batch(*par.global_batch(tuple(np.asarray(a) for a in batch[:3]), mesh, len(DOCS)))
    assert sharded.tokens.sharding.spec == P("fsdp", "context")
    traced = jax.jit(par.with_mesh(jax.value_and_grad(loss_fn(graphdef)), mesh)).trace(params, rest, sharded)
    assert kernel_placement(traced.jaxpr.jaxpr) == {True}  # every kernel call runs inside shard_map
    loss, grads = traced.lower().compile(FAST)(params, rest, sharded)
    np.testing.assert_allclose(float(loss), float(loss1), rtol=1e-5)
    for (path, g), g1 in zip(jax.tree_util.tree_leaves_with_path(jax.device_get(grads)), jax.tree.leaves(grads1)):
        err = np.linalg.norm(g - g1) / np.linalg.norm(g1)
        assert err <= 1e-5, (jax.tree_util.keystr(path), err)

    xla = nnx.graphdef(nnx.eval_shape(lambda: GLM(cfg("xla"), nnx.Rngs(0))))  # same state, XLA attention
    loss_xla = jax.jit(par.with_mesh(loss_fn(xla), mesh), compiler_options=FAST)(params, rest, sharded)
    np.testing.assert_allclose(float(loss_xla), float(loss1), rtol=1e-5)


def test_indexer_topk_on_the_mesh_selects_the_keys_of_one_device(mesh, monkeypatch):
    """index_topk_on_mesh (queries over context x tensor, keys gathered) == one device (the kernel's XLA reference,
    which tests/test_pallas.py holds the kernel to), slot for slot; negative control: the kernel in shard_map
    without global query slots selects other keys."""
    monkeypatch.setenv(pallas_kernels.common.INTERPRET_ENV, "fast")
    B, H, D, K = len(DOCS), 4, 16, 8
    rng = np.random.default_rng(1)
    q, k, w = (rng.normal(size=shape).astype(np.float32) for shape in ((B, S, H, D), (B, S, D), (B, S, H)))
    seg = packed_batch(64).segment_ids
    want, _ = jax.jit(pallas_kernels.index_topk_reference, static_argnums=(5, 6))(q, k, w, seg, seg, K, 16)

    args = jax.device_put((q, k, w, seg, seg), NamedSharding(mesh, P()))
    got, _ = jax.jit(par.with_mesh(lambda *a: index_topk_on_mesh(*a, K, 16), mesh), compiler_options=FAST)(*args)
    np.testing.assert_array_equal(got, want)

    queries, keys = P("fsdp", ("context", "tensor")), P("fsdp")
    local = jax.jit(jax.shard_map(lambda *a: pallas_kernels.index_topk(*a, K, 16), mesh=mesh,
                                  in_specs=(queries, keys, queries, queries, keys), out_specs=(queries, queries),
                                  check_vma=False), compiler_options=FAST)(*args)[0]
    assert not np.array_equal(local, want)  # local slots: later shards' queries see only their first keys
