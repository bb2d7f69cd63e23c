#!/usr/bin/env python
"""Temp memory of one GLM-5-width attention layer's loss per training stage, forward + backward, at long context,
compiled only (nothing runs): the materialised dense path (before) vs the blocked one (after).

Layer: `glmjax.model.mla.MLA` with GLM-5's dims (D 6144, H 64, MLA-256: qk 192+64 / v 256, latent 512+64, H_I 32,
d_I 128, k 2048), bf16 parameters and matmuls, batch 1, one document. Losses (gradients w.r.t. what the stage
trains, glmjax/train/stages.py):
  dense         pretrain / sft: sum(layer(x) * ct), gradients w.r.t. every parameter and x
  dense_warmup  the layer's indexer KL toward its dense attention (docs/model.md E.2), w.r.t. the indexer
  sparse_adapt  sum(layer(x) * ct) + indexer KL over the selected keys (E.3), w.r.t. everything
  indexshare    a full layer and the shared layer after it (it reuses the full layer's top-k): sum(shared(full(x))
                * ct) + the full layer's indexer KL toward the mean attention of both (E.4), w.r.t. everything;
                two layers, so per layer is half of it
"before" forces the materialised dense path (`mla_paths.Limits.materialise_scores` = inf) and the sparse attention
over the whole sequence at once (`mla_paths.Limits.sparse_chunk_rows` = inf), "after" is the default cost rules
(dense: blocks of `model.block_q`, on TPU JAX's splash kernel, `model.dense_attention_impl` "auto", head groups past
`mla_paths.Limits.head_group_rows`; sparse: rematerialised sequence chunks past `Limits.sparse_chunk_rows`,
`--sparse-chunk-rows` to try another size). Temp memory is XLA's
`jax.jit(f).lower(...).compile().memory_analysis().temp_size_in_bytes`, for the default backend (CPU here) or,
with --topology, one chip of a TPU topology (compiled ahead of time on this host with that chip as the abstract
mesh, so the TPU choices are made; needs jax[tpu]).

  python bench/long_context.py --seq-lens 4096 16384 65536 131072 202752 --json /tmp/long.json
  python bench/long_context.py --topology v5p:2x2x1 --after-only
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # other processes may hold libtpu (topology descriptions)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

import glmjax.model.mla as mla  # noqa: E402
from glmjax.model import mla_paths  # noqa: E402
from glmjax.config import ModelConfig  # noqa: E402
from glmjax.model.layers import rope_tables  # noqa: E402
from glmjax.model.transformer import unit_index_loss  # noqa: E402

GLM5 = dict(hidden_size=6144, num_attention_heads=64, q_lora_rank=2048, kv_lora_rank=512, qk_nope_head_dim=192,
            qk_rope_head_dim=64, v_head_dim=256, index_n_heads=32, index_head_dim=128, index_topk=2048)
STAGES = {"dense": ("dense", nnx.Param, False), "dense_warmup": ("dense", nnx.PathContains("indexer"), True),
          "sparse_adapt": ("sparse", nnx.Param, True), "indexshare": ("sparse", nnx.Param, True)}
GIB = 1024 ** 3


def layer_loss(stage: str, seq_len: int, block: int):
    """-> (f, abstract args): f(trained params, other params, x, ct) -> gradients of the stage's layer loss."""
    mode, trained, with_kl = STAGES[stage]
    cfg = ModelConfig(**GLM5, num_hidden_layers=1, first_k_dense_replace=1, block_q=block, dtype="bfloat16",
                      param_dtype="bfloat16", max_position_embeddings=max(seq_len, 4096))
    n_layers = 2 if stage == "indexshare" else 1  # a full layer (+ the shared layer it serves)
    layers = nnx.eval_shape(lambda: nnx.List([mla.MLA(cfg, i == 0, nnx.Rngs(i)) for i in range(n_layers)]))
    graphdef, params, rest = nnx.split(layers, trained, ...)

    def loss(params, rest, x, ct):
        pos = jnp.arange(seq_len, dtype=jnp.int32)[None]
        cos, sin = rope_tables(pos, cfg)
        seg = jnp.ones((1, seq_len), jnp.int32)
        ctx = mla.Ctx(cos, sin, seg, mode, index_loss=with_kl)
        topk, all_stats = jnp.zeros((1, seq_len, 0), jnp.int32), []
        for layer in nnx.merge(graphdef, params, rest):
            x, topk, stats, _ = layer(x, ctx, topk)
            all_stats.append(stats)
        total = 0.0 if stage == "dense_warmup" else jnp.sum(x.astype(jnp.float32) * ct)
        if with_kl:
            kl, n = unit_index_loss(all_stats, ctx)
            total = total + kl / n
        return total

    x = jax.ShapeDtypeStruct((1, seq_len, cfg.hidden_size), jnp.bfloat16)
    argnums = 0 if stage == "dense_warmup" else (0, 2)
    return jax.grad(loss, argnums=argnums), (params, rest, x, x)


def temp_gib(stage: str, seq_len: int, block: int, before: bool, device=None, chunk_rows=None):
    """-> (temp GiB, compile seconds); device: compile for it (e.g. a TPU topology's chip) instead of the default;
    chunk_rows: Limits.sparse_chunk_rows for the "after" programs (None: the default)."""
    saved = mla_paths.LIMITS
    inf = float("inf")
    mla_paths.LIMITS = mla_paths.Limits(inf, saved.head_group_rows, inf) if before else \
        dataclasses.replace(saved, sparse_chunk_rows=chunk_rows or saved.sparse_chunk_rows)
    try:
        t = time.perf_counter()
        f, args = layer_loss(stage, seq_len, block)
        if device is None:
            compiled = jax.jit(f).lower(*args).compile()
        else:
            mesh = jax.sharding.Mesh(np.array([device]), ("x",))
            sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
            args = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding), args)
            with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
                compiled = jax.jit(f).lower(*args).compile()
        return compiled.memory_analysis().temp_size_in_bytes / GIB, time.perf_counter() - t
    finally:
        mla_paths.LIMITS = saved


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq-lens", type=int, nargs="+", default=[4096, 16384, 65536, 131072, 202752])
    p.add_argument("--stages", nargs="+", default=list(STAGES), choices=list(STAGES))
    p.add_argument("--block", type=int, default=512, help="model.block_q (query and key block)")
    p.add_argument("--topology", help="compile for the first chip of this TPU topology, e.g. v5p:2x2x1 (jax[tpu])")
    p.add_argument("--after-only", action="store_true", help="skip the materialised / unchunked (before) programs")
    p.add_argument("--sparse-chunk-rows", type=int, help="Limits.sparse_chunk_rows (S·H) for the after programs")
    p.add_argument("--json")
    a = p.parse_args()
    device = None
    if a.topology:
        from jax.experimental import topologies
        device = topologies.get_topology_desc(platform="tpu", topology_name=a.topology).devices[0]
        jax.config.update("jax_enable_compilation_cache", False)  # a topology executable cannot be stored
    print(f"target {device or jax.default_backend()}, block {a.block}, load avg {os.getloadavg()[0]:.1f}", flush=True)
    rows = []
    for stage in a.stages:
        dense = STAGES[stage][0] == "dense"
        for before in ((True, False) if not a.after_only else (False,)):
            for S in a.seq_lens:
                gib, secs = temp_gib(stage, S, a.block, before, device, a.sparse_chunk_rows)
                path = ("materialised" if dense else "whole seq") if before else ("blocked" if dense else "chunked")
                rows.append(dict(stage=stage, path=path, seq_len=S, temp_gib=gib, kib_per_token=gib * GIB / 1024 / S))
                print(f"{stage:13s} {path:12s} S={S:7d} temp {gib:10.2f} GiB "
                      f"{rows[-1]['kib_per_token']:7.1f} KiB/token  (compile {secs:.0f}s)", flush=True)
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(rows, fh, indent=1)


if __name__ == "__main__":
    main()
