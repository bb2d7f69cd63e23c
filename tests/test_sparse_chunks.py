"""Sparse training attention in rematerialised sequence chunks (`mla_variants.sparse_chunked`) == the whole sequence
at once."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import FAST, tiny

import glmjax.model.mla as mla
from glmjax.model import mla_paths
from glmjax.model.layers import rope_tables
from glmjax.model.transformer import unit_index_loss

S, CHUNK = 37, 8  # 4 whole chunks and a remainder of 5


def rand(key, shape, scale=1.0):
    return jnp.asarray(np.random.default_rng(key).normal(0.0, scale, shape), jnp.float32)


@pytest.mark.slow
@pytest.mark.parametrize("q_lora_rank", [64, 0])
def test_chunked_sparse_layers_equal_the_unchunked_layers(monkeypatch, q_lora_rank):
    """A full layer (own indexer) and the shared layer after it (IndexShare: the full layer's top-k): outputs, the
    indexer KL toward both layers' mean attention (docs/model.md E.4) and the gradients of sum(out * ct) + KL
    w.r.t. every parameter and the input (both layers read x), in chunks of 8 queries (S = 37) vs the whole
    sequence; packed documents and padding (queries with fewer than k visible keys: -1 slots), f32; with a query
    LoRA and without (q_proj, the indexer's wq)."""
    cfg = tiny(num_attention_heads=4, index_topk=8, block_q=16, init_std=0.3, q_lora_rank=q_lora_rank)
    graphdef, params = nnx.split(nnx.List([mla.MLA(cfg, i == 0, nnx.Rngs(i)) for i in range(2)]))
    seg = np.array([[1] * 3 + [2] * 20 + [3] * 14, [1] * 5 + [2] * 25 + [0] * 7], np.int32)
    pos = np.concatenate([np.arange(n) for n in (3, 20, 14, 5, 25, 7)]).reshape(2, S)
    cos, sin = jax.jit(rope_tables, static_argnums=1)(pos, cfg)
    x, ct = rand(0, (2, S, cfg.hidden_size)), rand(1, (2, S, cfg.hidden_size), 0.01)

    def run(params, x):
        def loss(params, x):
            ctx = mla.Ctx(cos, sin, jnp.asarray(seg), "sparse", index_loss=True)
            h, topk, stats = 0.0, jnp.zeros((2, S, 0), jnp.int32), []
            for layer in nnx.merge(graphdef, params):  # both on x (an unnormed output would inflate the logits)
                out, topk, st, _ = layer(x, ctx, topk)
                h, stats = h + out, stats + [st]
            kl, n = unit_index_loss(stats, ctx)
            return jnp.sum(h * ct) + kl / n, (h, kl, topk)
        return jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(params, x)

    assert mla_paths.sparse_chunk(S, 4) is None
    (_, ref), ref_grads = jax.jit(lambda *a: run(*a), compiler_options=FAST)(params, x)  # new fn: a new trace
    monkeypatch.setattr(mla_paths, "LIMITS", mla_paths.Limits(sparse_chunk_rows=4 * CHUNK))
    assert mla_paths.sparse_chunk(S, 4) == CHUNK  # 37 is prime: whole chunks of 8 and a remainder
    (_, got), grads = jax.jit(lambda *a: run(*a), compiler_options=FAST)(params, x)
    topk = np.asarray(ref[2])
    assert (topk == -1).any() and (topk[1, 12:30] >= 0).all()  # -1 slots and full rows (row 1, document 2)
    np.testing.assert_array_equal(got[2], topk)
    for name, a, b in zip(("out", "kl"), got[:2], ref[:2]):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5, err_msg=name)
    assert float(ref[1]) > 1e-2  # a KL far from 0
    flat = lambda g: list(nnx.to_flat_state(g[0])) + [(("x",), g[1])]  # noqa: E731
    paths = 0
    for (path, a), (_, b) in zip(flat(grads), flat(ref_grads)):
        a, b = (v[...] if isinstance(v, nnx.Variable) else v for v in (a, b))
        assert float(jnp.max(jnp.abs(b))) > 0, path
        np.testing.assert_allclose(a, b, atol=1e-4, err_msg=str(path))
        paths += 1
    assert paths == len(jax.tree.leaves(params)) + 1


def test_sparse_chunk_takes_a_divisor_of_the_sequence_where_one_is_close():
    """Whole chunks where S has a divisor in [c/2, c] (no remainder call, whose concatenation copies the output);
    else chunks of c and a remainder."""
    assert mla_paths.sparse_chunk(4096, 64) is None  # S x H <= Limits.sparse_chunk_rows: the whole sequence at once
    assert mla_paths.sparse_chunk(131_072, 64) == 4096
    assert mla_paths.sparse_chunk(202_752, 64) == 3168  # GLM-5's length: 64 chunks of 3168 instead of 49 x 4096 + 2048
    assert mla_paths.sparse_chunk(4099, 64) == 4096  # 4099 is prime: 4096 and a remainder of 3
