"""Every variant of MLA's attention (glmjax/model/mla_variants.py) equals the plain path (latent_attention.py's
`dense_mla` / `sparse_mla`, the indexer's whole score matrix for the top-k) at shapes where mla_paths.py chooses it:
output and the gradients of sum(out * ct) w.r.t. every parameter and the input, f32, packed documents with padding,
S = 37 (a multiple of no block). Context parallelism is the same comparison on 8 devices, model-wide, in
test_context_parallel.py; the kernels against their references in test_flash_attention.py and test_pallas.py."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import FAST, tiny

import pallas_kernels
from glmjax.model import latent_attention, mla_paths
from glmjax.model.backends import Backend, sparse_mla_gpu_kernel
from glmjax.model.indexer import gathered_index_logits, index_scores, index_topk, masked_topk
from glmjax.model.layers import rope_tables
from glmjax.model.mla import MLA, Ctx

B, S = 2, 37
SEG = np.array([[1] * 3 + [2] * 20 + [3] * 14, [1] * 5 + [2] * 25 + [0] * 7], np.int32)  # documents, padding
POS = np.concatenate([np.arange(n) for n in (3, 20, 14, 5, 25, 7)]).reshape(B, S)


def rand(seed, shape, scale=1.0):
    return jnp.asarray(np.random.default_rng(seed).normal(0.0, scale, shape), jnp.float32)


def setup(**kw):
    cfg = tiny(num_attention_heads=4, index_topk=8, block_q=16, init_std=0.3, **kw)
    layers = nnx.List([MLA(cfg, i == 0, nnx.Rngs(i)) for i in range(2)])  # a full layer, then a shared one
    cos, sin = jax.jit(rope_tables, static_argnums=1)(POS, cfg)
    return cfg, layers, cos, sin, rand(0, (B, S, cfg.hidden_size)), rand(1, (B, S, cfg.hidden_size), 0.01)


def plain(layer, x, cos, sin, mode, topk):
    """The formulas: B.4 (dense) or B.6-B.7 (sparse: the whole index score matrix, its top-k, `sparse_mla`)."""
    cfg = layer.cfg
    p = layer.project(x, Ctx(cos, sin, jnp.asarray(SEG), mode))
    if mode == "dense":
        o = latent_attention.dense_mla(p.q_nope, p.q_pe, p.c_kv, p.k_pe, p.w_uk, p.w_uv, SEG, cfg.softmax_scale)[0]
        return layer.output(o), topk
    if layer.indexer is not None:
        topk = masked_topk(index_scores(*layer.indexer(x, p.q_resid, cos, sin), SEG, SEG), cfg.index_topk)
    latent = jnp.concatenate([p.c_kv, p.k_pe], axis=-1)
    o = latent_attention.sparse_mla(p.q_nope, p.q_pe, latent, topk, p.w_uk, p.w_uv, cfg.softmax_scale,
                                    cfg.kv_lora_rank)[0]
    return layer.output(o), topk


def variant(layer, x, cos, sin, mode, topk, cached, backend=None):
    """The layer as it runs: on this sequence, or (cached) prefilling it into an empty cache of S slots."""
    if not cached:
        out, topk, _, _ = layer(x, Ctx(cos, sin, jnp.asarray(SEG), mode, backend=backend), topk)
        return out, topk
    cfg = layer.cfg
    cache = {"latent": jnp.zeros((B, S, cfg.kv_lora_rank + cfg.qk_rope_head_dim))}
    if layer.indexer is not None:
        cache["index_k"] = jnp.zeros((B, S, cfg.index_head_dim))
    slots = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S))
    ctx = Ctx(cos, sin, jnp.asarray(SEG), mode, q_idx=slots, kv_valid=jnp.asarray(SEG))
    out, topk, _, _ = layer(x, ctx, topk, cache)
    return out, topk


def outputs_and_grads(layers, x, ct, fn):
    """(out of both layers, their top-k) and the gradients of sum(out * ct) w.r.t. the parameters and x."""
    graphdef, params = nnx.split(layers)

    def loss(params, x):
        topk, outs = jnp.zeros((B, S, 0), jnp.int32), []
        for layer in nnx.merge(graphdef, params):
            out, topk = fn(layer, x, topk)
            outs.append(out)
        return sum(jnp.sum(o * ct) for o in outs), (jnp.stack(outs), topk)

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True), compiler_options=FAST)(params, x)


GPU_CALLS = []  # the GPU kernel's calls (the test checks the layer took it)


def gpu_sparse_mla(*args, **kw):
    GPU_CALLS.append(args[0].shape)
    return sparse_mla_gpu_kernel(*args, **kw)


# "pallas" on an NVIDIA GPU: XLA's top-k and the Pallas GPU sparse MLA (interpreted here)
GPU_BACKEND = Backend(index_topk, gpu_sparse_mla, gathered_index_logits)
CASES = {  # name: (mode, cached, model config (backend: the Ctx's), limits, the path chosen)
    "materialised": ("dense", False, {}, {}, "materialised"),
    "blocked": ("dense", False, {}, dict(materialise_scores=0), "blocked"),
    "blocked_splash": ("dense", False, dict(dense_attention_impl="splash"), {}, "blocked"),
    "blocked_pallas_gpu": ("dense", False, dict(dense_attention_impl="pallas_gpu"), {}, "blocked"),
    "head_groups": ("dense", False, {}, dict(materialise_scores=0, head_group_rows=2 * S), "head_groups"),
    "absorbed": ("dense", True, {}, {}, "absorbed"),
    "absorbed_blocked": ("dense", True, {}, dict(materialise_scores=0), "absorbed_blocked"),
    "sparse": ("sparse", False, {}, {}, "sparse"),
    "sparse_pallas": ("sparse", False, dict(attention_impl="pallas"), {}, "sparse"),
    "sparse_pallas_gpu": ("sparse", False, dict(backend=GPU_BACKEND), {}, "sparse"),
    "sparse_chunks": ("sparse", False, {}, dict(sparse_chunk_rows=4 * 8), "sparse_chunks"),
    "sparse_cached": ("sparse", True, {}, {}, "sparse"),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_variant_equals_the_plain_path(name, monkeypatch):
    mode, cached, cfg_kw, limits, kind = CASES[name]
    monkeypatch.setenv(pallas_kernels.common.INTERPRET_ENV, "fast")
    monkeypatch.setattr(mla_paths, "LIMITS", mla_paths.Limits(**limits))
    taken = []  # the paths the layers' calls take (the rules' answers, as the layers ask them)
    for rule in ("dense_training", "dense_cached", "sparse"):
        fn = getattr(mla_paths, rule)
        monkeypatch.setattr(mla_paths, rule, lambda *a, fn=fn, **k: taken.append(fn(*a, **k)) or taken[-1])
    backend = cfg_kw.get("backend")
    GPU_CALLS.clear()
    cfg, layers, cos, sin, x, ct = setup(**{k: v for k, v in cfg_kw.items() if k != "backend"})
    (_, (ref, ref_topk)), ref_grads = outputs_and_grads(layers, x, ct, lambda l, x, t: plain(l, x, cos, sin, mode, t))
    assert not taken
    (_, (got, topk)), grads = outputs_and_grads(layers, x, ct,
                                                lambda l, x, t: variant(l, x, cos, sin, mode, t, cached, backend))
    assert {path.kind for path in taken} == {kind}, taken
    assert bool(GPU_CALLS) == (backend is GPU_BACKEND)
    np.testing.assert_array_equal(topk, ref_topk)
    assert float(jnp.max(jnp.abs(ref))) > 1e-2
    np.testing.assert_allclose(got, ref, atol=2e-5, rtol=1e-4)
    flat = lambda g: list(nnx.to_flat_state(g[0])) + [(("x",), g[1])]  # noqa: E731
    nonzero = 0
    for (path, a), (_, b) in zip(flat(grads), flat(ref_grads)):
        a, b = (v[...] if isinstance(v, nnx.Variable) else v for v in (a, b))
        nonzero += float(jnp.max(jnp.abs(b))) > 0
        np.testing.assert_allclose(a, b, atol=1e-4, rtol=1e-3, err_msg=str(path))
    assert nonzero >= 10  # projections, norms and the input (the indexer's weights get no gradient here)


def test_describe_names_each_layers_path():
    """The start-up lines: the path, why, and in sparse mode which layers select and which reuse (IndexShare)."""
    cfg = tiny(num_attention_heads=4)  # indexer_types F F S S F S
    dense = mla_paths.describe(cfg, "dense", 8, 128)
    assert dense == ["attention: layers 0-5 and MTP dense, materialised: B·H·S·T = 524,288 <= 16,777,216 "
                     "(Limits.materialise_scores)"]
    assert "blocked (XLA flash)" in mla_paths.describe(cfg, "dense", 8, 4096)[0]
    sparse = mla_paths.describe(cfg, "sparse", 1, 2 ** 17)
    assert sparse[0].startswith("attention: layers 0-5 and MTP sparse, sparse_chunks (xla backend): S·H = 524,288")
    assert "chunks of 65536 queries" in sparse[0]
    assert sparse[1:] == ["  top-8 keys: own indexer on layers 0-1, 4 and MTP",
                          "  IndexShare: layers 2-3, 5 reuse the previous full layer's top-k"]
