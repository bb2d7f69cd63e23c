"""Blocked (flash) dense attention against the materialised reference: MLA training form (per-head keys from the
latent; values, max logit and gradients) and the absorbed cached form (MQA over the latent, kv_valid / q_idx
visibility), with packed documents, a document starting inside the first key block, S not a multiple of the block;
the block skip itself; and no [S,T]-shaped intermediate in the blocked model's dense_warmup / sparse losses."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import FAST, random_batch, tiny

import glmjax.model.mla as mla
from glmjax.config import ModelConfig
from glmjax import hardware
from glmjax.model import GLM, dense_kernels, latent_attention, mla_paths, mla_variants
from glmjax.model.flash_attention import block_needed, flash_attention
from glmjax.model.indexer import visible
from glmjax.model.layers import rope_tables
from glmjax.model.transformer import unit_index_loss
from glmjax.parallel import default_parallel_config, make_mesh, with_mesh
from glmjax.train.aot import compile_uncached, topology_devices

BLOCK = 8


def rand(key, shape, scale=1.0):
    """Normal samples made by numpy: no eager JAX op (each would compile)."""
    return jnp.asarray(np.random.default_rng(key).normal(0.0, scale, shape), jnp.float32)


def np_visible(seg):
    """[B,S,S] causal same-segment mask in numpy."""
    seg, t = np.asarray(seg), np.arange(seg.shape[1])
    return (t[None, None, :] <= t[None, :, None]) & (seg[:, :, None] == seg[:, None, :])


def packed_segments():
    """Row 0: documents of 3, 20 and 14 tokens; row 1: 5 and 25 tokens + 7 padding. In both rows the second document
    starts inside the first key block (a block skip that looks at a block's first key only drops its keys)."""
    return np.array([[1] * 3 + [2] * 20 + [3] * 14, [1] * 5 + [2] * 25 + [0] * 7], np.int32)


@pytest.mark.parametrize("impl", ["xla", "splash", "pallas_gpu"])
def test_blocked_mla_equals_the_materialised_reference_with_gradients(impl):
    """The XLA flash, JAX's Pallas TPU splash kernel (interpreted on CPU; S padded to its 128 block) and its Pallas GPU
    flash kernel (interpreted; head dims 12 / 5 zero-padded to one width, S to its block)."""
    B, S, H, d_n, d_r, r, d_v = 2, 37, 3, 8, 4, 6, 5  # S = 37: not a multiple of the block 8
    args = (rand(0, (B, S, H, d_n)), rand(1, (B, S, H, d_r)), rand(2, (B, S, r)), rand(3, (B, S, d_r)),
            rand(4, (r, H, d_n)), rand(5, (r, H, d_v)))
    seg, ct = packed_segments(), rand(6, (B, S, H, d_v))

    def run(fn):
        def loss(*a):
            out, max_logit, extra = fn(*a)
            return jnp.sum(out * ct), (out, max_logit, extra)
        return jax.jit(jax.value_and_grad(loss, argnums=tuple(range(6)), has_aux=True))(*args)

    (_, (out, max_logit, target)), grads = run(lambda *a: mla_variants.dense_blocked(*a, seg, 0.7, BLOCK, impl=impl))
    (_, (ref, ref_max, _)), ref_grads = run(lambda *a: latent_attention.dense_mla(*a, seg, 0.7))
    np.testing.assert_allclose(out, ref, atol=1e-5)
    np.testing.assert_allclose(max_logit, ref_max, atol=1e-5)
    for name, g, rg in zip(("q_nope", "q_pe", "c_kv", "k_pe", "w_uk", "w_uv"), grads, ref_grads):
        np.testing.assert_allclose(g, rg, atol=1e-4, err_msg=name)
    # the per-head lse the streamed losses use: log of the softmax normaliser, naively in numpy
    q, k = (np.asarray(a, np.float64) for a in (target.q, target.k))
    s = np.einsum("bshd,bthd->bsht", q, k) * 0.7
    s = np.where(np_visible(seg)[:, :, None, :], s, -np.inf)
    m = s.max(-1, keepdims=True)
    np.testing.assert_allclose(target.lse, (m + np.log(np.exp(s - m).sum(-1, keepdims=True)))[..., 0], atol=1e-5)


@pytest.mark.parametrize("impl", ["splash", "pallas_gpu"])
def test_kernel_on_a_mesh_splitting_batch_sequence_and_heads_equals_one_device(impl):
    """Each kernel inside its shard_map on 8 CPU devices (data 2 x context 2 x tensor 2; interpreted): rows
    and heads split, each sequence whole on its shard even where the inputs arrive split over context (a kernel run
    on one context shard's half would miss the earlier half's keys); out, lse and gradients == one device."""
    B, S, H, d, e = 2, 256, 2, 8, 4
    q, k, v, ct = rand(0, (B, S, H, d)), rand(1, (B, S, H, d)), rand(2, (B, S, H, e)), rand(3, (B, S, H, e))
    seg = np.repeat(np.array([[1, 2], [1, 1]], np.int32), S // 2, axis=1)  # row 0: a document starts at the middle

    def run(q, k, v):
        def loss(q, k, v):
            out, lse, _ = flash_attention(q, k, v, seg, seg, None, 0.3, 128, 128, impl)
            return jnp.sum(out * ct), (out, lse)
        return jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)

    (_, (ref, ref_lse)), ref_grads = jax.jit(run)(q, k, v)
    mesh = make_mesh(default_parallel_config(data=2, context=2, tensor=2))
    split = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data", "context", "tensor"))
    (_, (out, lse)), grads = jax.jit(with_mesh(run, mesh))(*(jax.device_put(a, split) for a in (q, k, v)))
    np.testing.assert_allclose(out, ref, atol=1e-5)
    np.testing.assert_allclose(lse, ref_lse, atol=1e-5)
    for g, rg in zip(grads, ref_grads):
        np.testing.assert_allclose(g, rg, atol=1e-5)


def test_blocked_absorbed_cached_attention_equals_the_materialised_reference():
    """Prefill of a chunk at different cache offsets per row (kv_valid with holes past the written rows) and
    decode (S = 1), values and gradients in the queries and the latent cache."""
    B, H, C, R, T = 2, 3, 10, 6, 45
    kv_valid = np.zeros((B, T), np.int32)
    kv_valid[0, :29], kv_valid[1, :40] = 1, 1
    kv_valid[1, 5:9] = 0  # a hole inside a key block
    latent, kv_valid = rand(7, (B, T, C)), jnp.asarray(kv_valid)
    for S, start in ((13, (16, 27)), (1, (28, 39))):
        q_abs, ct = rand(8 + S, (B, S, H, C)), rand(9 + S, (B, S, H, R))
        q_seg = np.ones((B, S), np.int32)
        q_idx = np.asarray(start)[:, None] + np.arange(S)[None]

        @jax.jit
        def both(q, kv):
            blocked = lambda q, kv: mla_variants.dense_mla_absorbed_blocked(  # noqa: E731
                q, kv, q_seg, kv_valid, q_idx, 0.4, R, BLOCK)
            ref = lambda q, kv: mla_variants.dense_mla_absorbed(q, kv, visible(q_seg, kv_valid, q_idx), 0.4, R)  # noqa
            loss = lambda fn, *a: (jnp.sum(fn(*a) * ct), fn(*a))  # noqa: E731
            return [jax.value_and_grad(lambda *a: loss(fn, *a), (0, 1), has_aux=True)(q, kv) for fn in (blocked, ref)]

        ((_, out), g), ((_, out_ref), g_ref) = both(q_abs, latent)
        np.testing.assert_allclose(out, out_ref, atol=1e-5, err_msg=f"S={S}")
        for a, b in zip(g, g_ref):
            np.testing.assert_allclose(a, b, atol=1e-4, err_msg=f"S={S}")


def test_block_skip_is_exact_at_block_granularity():
    """A key block is skipped only when no query of the block can see any of its keys: a document starting inside
    the first key block (row 0) must keep block 0 for its queries in block 2, a causal future block is skipped, and
    so is a block of another document entirely."""
    seg = packed_segments()
    idx = np.broadcast_to(np.arange(37), (2, 37))
    vis = np_visible(seg)
    need = jax.jit(block_needed)
    blk = lambda a, i: a[:, i * BLOCK:(i + 1) * BLOCK]  # noqa: E731
    for qi in range(4):  # whole blocks
        for ki in range(4):
            any_visible = vis[:, qi * BLOCK:(qi + 1) * BLOCK, ki * BLOCK:(ki + 1) * BLOCK].any()
            assert bool(need(blk(seg, qi), blk(idx, qi), blk(seg, ki), ki * BLOCK)) >= any_visible, (qi, ki)
    one_doc = lambda n: np.asarray([[1] * n + [2] * (16 - n)], np.int32)  # noqa: E731
    assert bool(need(one_doc(3)[:, 8:], np.arange(8, 16)[None], one_doc(3)[:, :8], 0))  # doc 2 from slot 3
    assert not bool(need(one_doc(8)[:, 8:], np.arange(8, 16)[None], one_doc(8)[:, :8], 0))  # another document
    assert not bool(need(one_doc(3)[:, :8], np.arange(8)[None], one_doc(3)[:, 8:], 8))  # causal future


@pytest.mark.parametrize("mode", ["dense", "sparse"])
def test_blocked_model_losses_build_no_query_by_key_array(mode, monkeypatch):
    """The dense_warmup (blocked dense attention + streamed KL) and sparse_adapt losses, forward and backward,
    traced (not compiled): no intermediate has two axes of length S (no [.., S, T] scores, probabilities or masks)."""
    monkeypatch.setattr(mla_paths, "LIMITS", mla_paths.Limits(materialise_scores=0))
    S = 72  # no other dimension of the tiny model is 72
    cfg = tiny(num_hidden_layers=2, indexer_types=("full", "shared"), mtp_depth=0, num_nextn_predict_layers=0)
    graphdef, state = nnx.split(GLM(cfg, nnx.Rngs(0)))
    batch = random_batch(cfg, 1, S)

    def loss(state):
        return nnx.merge(graphdef, state).loss(batch, mode, index_loss_weight=1.0)[0]

    jaxpr = jax.make_jaxpr(jax.grad(loss))(state)
    shapes = {tuple(v.aval.shape) for eqn in all_eqns(jaxpr.jaxpr) for v in eqn.outvars if hasattr(v.aval, "shape")}
    assert any(S in s for s in shapes)
    assert not [s for s in shapes if sum(d == S for d in s) >= 2]


def test_flash_inside_scanned_layers_keeps_linear_memory_under_grad():
    """Flash attention in a lax.scan over layers (the model's scanned stacks), differentiated: the compiled
    program's temporaries grow linearly with S. Without the optimization barrier in `_flash_fwd`, JAX's partial
    evaluation of the scan split each block's lax.cond and saved the known half (the block's visibility mask and
    a placeholder for its scores) for every (query block, key block) pair: [S/b, T/b, B, b, H, b] stacks, ~4x the
    temporaries per doubling of S (13.7 -> 47 -> 175 MiB at 1K / 2K / 4K here; with the barrier 2.9 -> 5.4 -> 10.8),
    and 23 GB per chip in GLM-5's dense step at 202,752 tokens."""
    def temp(S, B=1, H=2, d=16, block=128):
        seg = jnp.ones((B, S), jnp.int32)

        def layer(x, w):
            q = x * w
            return x + flash_attention(q, q, q, seg, seg, None, 0.25, block, block, impl="xla")[0], None

        f = jax.jit(jax.grad(lambda x, ws: jnp.sum(jax.lax.scan(layer, x, ws)[0]), argnums=1))
        args = jax.ShapeDtypeStruct((B, S, H, d), jnp.float32), jax.ShapeDtypeStruct((2,), jnp.float32)
        return f.lower(*args).compile().memory_analysis().temp_size_in_bytes

    small, large = temp(1024), temp(4096)
    assert large < 5 * small, (small, large)  # linear: 4x (+ slack); quadratic would be 16x


def all_eqns(jaxpr):
    for eqn in jaxpr.eqns:
        yield eqn
        for sub in sub_jaxprs(eqn):
            yield from all_eqns(sub)


def sub_jaxprs(eqn):
    for p in eqn.params.values():
        for x in p if isinstance(p, (list, tuple)) else (p,):
            if hasattr(x, "jaxpr") and hasattr(x.jaxpr, "eqns"):
                yield x.jaxpr
            elif hasattr(x, "eqns"):
                yield x


def test_dense_attention_choice_follows_platform_override_and_fit(monkeypatch):
    """"auto" picks the splash kernel only when traced for TPU (the abstract mesh's devices: AOT from this CPU host),
    the Pallas GPU kernel on a GPU; "splash" / "pallas_gpu" force them anywhere (interpreted elsewhere), and each
    falls back to the XLA flash where the kernels cannot honour the visibility: explicit query slots
    (context-parallel shards, caches) or keys shared by the heads."""
    q, k_mqa = jnp.zeros((1, 16, 2, 8)), jnp.zeros((1, 16, 8))
    idx = jnp.zeros((1, 16), jnp.int32)
    assert dense_kernels.choose("auto", q, q, None) == "xla"  # CPU
    assert dense_kernels.choose("splash", q, q, None) == "splash"
    assert dense_kernels.choose("splash", q, q, idx) == "xla"
    assert dense_kernels.choose("splash", q, k_mqa, None) == "xla"
    with jax.sharding.use_abstract_mesh(jax.sharding.Mesh(np.array(tpu_devices()[:1]), ("x",)).abstract_mesh):
        assert dense_kernels.choose("auto", q, q, None) == "splash"
        assert dense_kernels.choose("auto", q, q, idx) == "xla"
        assert dense_kernels.choose("xla", q, q, None) == "xla"
    with pytest.raises(ValueError, match="'cudnn'"):
        dense_kernels.choose("cudnn", q, q, None)
    assert dense_kernels.choose("pallas_gpu", q, q, None) == "pallas_gpu"
    assert dense_kernels.choose("pallas_gpu", q, q, idx) == "xla"
    monkeypatch.setattr(hardware, "platform", lambda mesh=None: "gpu")
    assert dense_kernels.choose("auto", q, q, None) == "pallas_gpu"
    assert dense_kernels.choose("auto", q, k_mqa, None) == "xla"
    monkeypatch.undo()
    seg = jnp.ones((1, 16), jnp.int32)
    jaxpr = lambda impl: str(jax.make_jaxpr(  # noqa: E731
        lambda q: flash_attention(q, q, q, seg, seg, None, 1.0, 8, 8, impl))(q))
    assert "pallas_call" in jaxpr("splash") and "pallas_call" not in jaxpr("auto")


def tpu_devices():
    return topology_devices("v5p:2x2x1")


@pytest.mark.slow  # one TPU compile: ~45 s on 2 shared CPU cores
def test_glm5_dense_layer_loss_compiles_for_v5p_with_the_splash_kernel():
    """One MLA layer at GLM-5's head dims (qk 192+64 / v 256, latent 512+64; H 16, D 512), bf16,
    pretrain loss forward + backward, compiled ahead of time for one v5p chip: the "auto" choice lowers to Mosaic
    kernels (splash forward, dq, dkv) with no [S,S] buffer."""
    S = 2048  # B·H·S·T past `mla_paths.materialise`
    cfg = ModelConfig(hidden_size=512, num_attention_heads=16, q_lora_rank=256, kv_lora_rank=512, qk_nope_head_dim=192,
                      qk_rope_head_dim=64, v_head_dim=256, index_n_heads=4, index_head_dim=32, index_topk=64,
                      num_hidden_layers=1, first_k_dense_replace=1, block_q=512, dtype="bfloat16",
                      param_dtype="bfloat16", max_position_embeddings=S)
    layer = nnx.eval_shape(lambda: mla.MLA(cfg, False, nnx.Rngs(0)))
    graphdef, params = nnx.split(layer)
    mesh = jax.sharding.Mesh(np.array(tpu_devices()[:1]), ("x",))
    sh = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())

    def loss(params, x):
        cos, sin = rope_tables(jnp.arange(S)[None], cfg)
        ctx = mla.Ctx(cos, sin, jnp.ones((1, S), jnp.int32), "dense")
        out, _, stats, _ = nnx.merge(graphdef, params)(x, ctx, jnp.zeros((1, S, 0), jnp.int32))
        return jnp.sum(out.astype(jnp.float32)) + stats.max_logit

    args = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh),
                        (params, jax.ShapeDtypeStruct((1, S, cfg.hidden_size), jnp.bfloat16)))
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
        hlo = compile_uncached(jax.jit(jax.grad(loss, argnums=(0, 1))).lower(*args)).as_text()
    assert hlo.count('custom_call_target="tpu_custom_call"') == 3
    assert f"{S},{S}]" not in hlo and f"{S}, {S}]" not in hlo


@pytest.mark.parametrize("q_lora_rank", [64, 0])
def test_head_grouped_layer_equals_the_materialised_layer(monkeypatch, q_lora_rank):
    """One MLA layer (H 4 in 2 head groups, each group's keys / values / output projection in a rematerialised
    step) vs the materialised layer: output, max logit, the streamed indexer KL (it uses the groups' lse) and the
    gradients of sum(out * ct) + KL w.r.t. every parameter and the input; packed documents, S = 37; with a query
    LoRA and without (q_proj, the indexer's wq). The grouping is the same for every dense_attention_impl (the splash
    kernel itself: the tests above)."""
    cfg = tiny(num_attention_heads=4, block_q=BLOCK, init_std=0.3, q_lora_rank=q_lora_rank)
    graphdef, params = nnx.split(mla.MLA(cfg, True, nnx.Rngs(0)))
    seg, S = packed_segments(), 37
    cos, sin = jax.jit(rope_tables, static_argnums=1)(np.broadcast_to(np.arange(S), (2, S)), cfg)
    x, ct = rand(50, (2, S, cfg.hidden_size)), rand(51, (2, S, cfg.hidden_size), 0.01)

    def run(params, x):
        def loss(params, x):
            ctx = mla.Ctx(cos, sin, seg, "dense", index_loss=True)
            out, _, stats, _ = nnx.merge(graphdef, params)(x, ctx, jnp.zeros((2, S, 0), jnp.int32))
            kl, n = unit_index_loss([stats], ctx)
            return jnp.sum(out * ct) + kl / n, (out, stats.max_logit, kl)
        return jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(params, x)

    monkeypatch.setattr(mla_paths, "LIMITS", mla_paths.Limits(materialise_scores=float("inf")))
    (_, ref), ref_grads = jax.jit(lambda *a: run(*a), compiler_options=FAST)(params, x)  # new fn: a new trace
    monkeypatch.setattr(mla_paths, "LIMITS", mla_paths.Limits(materialise_scores=0, head_group_rows=2 * S))
    assert mla_paths.head_groups(S, 4) == 2
    (_, got), grads = jax.jit(lambda *a: run(*a), compiler_options=FAST)(params, x)
    for name, a, b in zip(("out", "max_logit", "kl"), got, ref):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5, err_msg=name)
    flat = lambda g: list(nnx.to_flat_state(g[0])) + [(("x",), g[1])]  # noqa: E731
    for (path, a), (_, b) in zip(flat(grads), flat(ref_grads)):
        a, b = (v[...] if isinstance(v, nnx.Variable) else v for v in (a, b))
        assert float(jnp.max(jnp.abs(b))) > 0, path
        np.testing.assert_allclose(a, b, atol=1e-4, err_msg=str(path))
