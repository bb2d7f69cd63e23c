"""The Pallas kernels compile with Mosaic for real TPU topologies at GLM-5 shapes (H=64, latent 512+64, H_I=32,
d_I=128, k=2048), inside shard_map over every chip, without a TPU (jax[tpu]'s libtpu + topologies): GLM-5's 8K
training sequence on v5e:2x2 (sparse_mla: VMEM dkv accumulator, packed bf16 gather), its 202,752-token sequence on
v5p:2x2x1 (HBM dkv accumulator; index_topk with 1584 query blocks), and decode against a 1,048,576-row cache
(row-pair gather, no copy of the cache)."""
import pytest

from pallas_kernels.aot import GLM5, compile_kernel, kernel_flops

HBM_PER_CHIP = {"v5e": 16 * 2 ** 30, "v5p": 95 * 2 ** 30}
KERNEL_CALLS = {"sparse_mla": ("sparse_mla_fwd", "sparse_mla_bwd"), "sparse_mla_fwd": ("sparse_mla_fwd",),
                "index_topk": ("index_topk",)}
M = 2 ** 20
CASES = [("v5e:2x2", "sparse_mla", dict(S=8192)),
         ("v5p:2x2x1", "sparse_mla", dict(S=202_752)), ("v5p:2x2x1", "index_topk", dict(S=202_752)),
         ("v5p:2x2x1", "sparse_mla_fwd", dict(S=16, T=M)), ("v5p:2x2x1", "index_topk", dict(S=16, T=M))]


@pytest.mark.slow
@pytest.mark.parametrize("topology,kernel,shapes", CASES,
                         ids=[f"{k}-S{s['S']}-T{s.get('T', s['S'])}" for _, k, s in CASES])
def test_glm5_kernels_compile_for_tpu(topology, kernel, shapes):
    compiled, chips = compile_kernel(topology, kernel, shapes)
    assert chips == 4
    hlo = compiled.as_text()
    assert hlo.count('custom_call_target="tpu_custom_call"') == len(KERNEL_CALLS[kernel])  # Mosaic, not interpreted
    for name in KERNEL_CALLS[kernel]:
        assert name in hlo
    mem = compiled.memory_analysis()
    per_chip = mem.argument_size_in_bytes + mem.output_size_in_bytes + mem.temp_size_in_bytes
    assert 0 < per_chip < HBM_PER_CHIP[topology[:3]]
    T, C = shapes.get("T", shapes["S"]), GLM5["R"] + GLM5["d_r"]
    if kernel == "sparse_mla_fwd":  # decode reads the cache where it is: no copy of it (T·C·2 bytes) anywhere
        assert mem.temp_size_in_bytes < T * C * 2 // 4
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    declared = kernel_flops(kernel, **dict(GLM5, **shapes))
    assert declared <= cost["flops"] < 1.05 * declared  # the kernels' cost estimates reach XLA's analysis


def test_whole_train_step_with_the_kernels_compiles_for_v5p_on_a_context_mesh():
    """The tiny model's whole sparse_adapt train step with attention_impl="pallas" compiles with Mosaic for v5p:2x2x2
    on fsdp=2 x context=2 x tensor=2 (without shard_map around the kernels XLA refuses: "Mosaic kernels cannot be
    automatically partitioned"). Each kernel sees its shard: sparse MLA 1 row x 32 of the 64 queries x 2 of the 4
    heads against all 64 latent rows; the indexer top-k 16 queries (split over context x tensor)."""
    from glmjax import parallel as par
    from glmjax.optim.config import default_optim_config
    from glmjax.train import aot
    from sharded_training import small_cfg

    cfg = small_cfg(attention_impl="pallas", num_hidden_layers=1, first_k_dense_replace=0, indexer_types=("full",))
    mesh = par.make_mesh(dict(data=1, fsdp=2, context=2, tensor=2), aot.topology_devices("v5p:2x2x2"))
    lowered = aot.lower_train_step(cfg, default_optim_config(name="adamw", warmup_steps=0), mesh, batch=2, seq=64)
    hlo = aot.compile_uncached(lowered).as_text()
    calls = {name: line for line in hlo.splitlines() if 'custom_call_target="tpu_custom_call"' in line
             for name in KERNEL_CALLS["sparse_mla"] + KERNEL_CALLS["index_topk"] if f"%{name}" in line.split("=")[0]}
    assert set(calls) == {"sparse_mla_fwd", "sparse_mla_bwd", "index_topk"}, set(calls)
    C, R = cfg.kv_lora_rank + cfg.qk_rope_head_dim, cfg.kv_lora_rank
    assert f"= (f32[1,32,2,{R}]" in calls["sparse_mla_fwd"] and f"f32[1,64,{C}]" in calls["sparse_mla_fwd"]
    assert "= (s32[1,16,128]" in calls["index_topk"]  # (the 64 keys are padded to one 128-key block)
