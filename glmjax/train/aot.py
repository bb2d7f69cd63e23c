"""Ahead-of-time compilation of the trainer's train step (`glmjax.train.step.train_step_fn`: forward, backward,
optimizer, router-bias update, non-finite guard) for a TPU topology, from a CPU host: no TPU and no weights needed
(abstract inputs only).

    devices = topology_devices("v5p:8x8x16")                       # 1024 v5p chips, described by libtpu
    mesh = make_mesh(dict(fsdp=4, expert=64, tensor=4), devices)
    compiled = compile_uncached(lower_train_step(model_cfg, optim_cfg, mesh, batch=256, seq=4096))
    memory_per_chip(compiled), cost(compiled), roofline(cost(compiled), "v5p")

What the compiler reports is an estimate, not a measurement. XLA's cost analysis counts the body of a while loop
once, not once per trip, so the FLOPs / time of a scanned model would be those of one layer; `cost` adds the count
with every loop body once per trip (glmjax/train/hlo_cost.py), which `bench/aot.py` uses (its cross-check, unrolled
builds: `estimate_build`). The chips' peak numbers are glmjax/hardware.py's.
"""
from __future__ import annotations

import os

import numpy as np

import jax
import jax.numpy as jnp
from flax import nnx

from glmjax.config import ModelConfig
from glmjax.hardware import CHIPS, chip_of_topology
from glmjax.model import GLM, Batch
from glmjax.model.context import Layout
from glmjax.optim import build_optimizer
from glmjax.parallel import abstract, batch_sharding, opt_state_shardings, state_shardings
from glmjax.train import hlo_cost
from glmjax.train.stages import STAGES, TRAINABLE
from glmjax.train.step import make_train_step
from pallas_kernels.aot import compile_uncached  # noqa: F401  (the dry run's and bench/aot.py's compile)


def topology_devices(topology_name: str, num_slices: int = 1) -> list:
    """Devices of a TPU topology, e.g. "v5p:2x2x2" (8 chips) or "v5e:2x4" (v5e-8); libtpu only describes them."""
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # several processes may describe topologies at once
    from jax.experimental import topologies
    chip_of_topology(topology_name)
    return list(topologies.get_topology_desc(platform="tpu", topology_name=topology_name,
                                             num_slices=num_slices).devices)


def lower_train_step(cfg: ModelConfig, optim_cfg, mesh, batch: int, seq: int, *, stage: str = "sparse_adapt",
                     mode: str = "sparse", index_loss_weight: float = 1.0, bias_rate: float = 1e-3):
    """-> jax.stages.Lowered of the trainer's sharded train step of `stage` on abstract inputs (by default the
    sparse adaptation stage: every parameter trains, the most memory), batch [batch, seq] split over the batch
    axes (and seq over context). With attention_impl="pallas" the kernels are compiled by Mosaic inside shard_map
    (glmjax/model/backends.py)."""
    trainable = TRAINABLE[STAGES[stage].trainable]
    graphdef, abs_params, abs_rest = nnx.split(nnx.eval_shape(lambda: GLM(cfg, nnx.Rngs(0))), trainable, ...)
    params = abstract(abs_params, state_shardings(abs_params, mesh))
    rest = abstract(abs_rest, state_shardings(abs_rest, mesh))
    opt_cfg = {**(optim_cfg.to_dict() if hasattr(optim_cfg, "to_dict") else dict(optim_cfg))}
    opt_cfg["total_steps"] = max(opt_cfg.get("total_steps") or 0, opt_cfg.get("warmup_steps", 0) + 1)
    tx, _ = build_optimizer(abs_params, opt_cfg, cfg)
    opt_state = abstract(jax.eval_shape(tx.init, params), opt_state_shardings(tx, params, mesh))
    tok = jax.ShapeDtypeStruct((batch, seq), jnp.int32, sharding=batch_sharding(mesh))
    step = make_train_step(graphdef, tx, stage, mode, bias_rate, index_loss_weight, mesh=mesh,
                           state=(params, rest, opt_state))
    return step.lower(params, rest, opt_state, Batch(tok, tok, tok), jax.ShapeDtypeStruct((), jnp.int32))


def memory_per_chip(compiled) -> dict:
    """Bytes per chip from `memory_analysis`: arguments (the state and the batch), outputs, temporaries, aliased
    (donated state reused for the outputs), and the peak = arguments + outputs + temporaries - aliased."""
    m = compiled.memory_analysis()
    out = dict(argument=m.argument_size_in_bytes, output=m.output_size_in_bytes, temp=m.temp_size_in_bytes,
               alias=m.alias_size_in_bytes, code=m.generated_code_size_in_bytes)
    out["total"] = out["argument"] + out["output"] + out["temp"] - out["alias"] + out["code"]
    return out


def cost(compiled) -> dict:
    """Per chip, from the compiled program: FLOPs and HBM bytes accessed (`cost_analysis`) and ICI bytes of its
    collectives (`hlo_cost.collective_bytes`), each while-loop body counted once ("loops": how many are left), and
    "per_trip": the same counts with every loop body counted once per trip (`hlo_cost.count`; "cond_*": the part
    inside conditional branches, which skip blocks). Per-trip FLOPs are XLA's plus hlo_cost's for the further trips
    (the two count FLOPs alike); per-trip HBM bytes are hlo_cost's scaled by XLA's bytes per hlo_cost byte of the
    loop-once program, because XLA's TPU model also counts the re-reads of tiled matmul operands, which hlo_cost
    does not (alone it counts 0.38x XLA's bytes for the tiny model's step; scaled, the tiny model's dense step is
    within 1.3% of XLA's count of its unrolled build and GLM-5's sparse step at 202,752 tokens within 0.1%,
    docs/benchmarks.md).

    A Mosaic kernel ("tpu_custom_call") counts with the `pl.CostEstimate` it declares (pallas_kernels/ declare
    theirs); one without (JAX's splash attention, ragged_dot on TPU) counts nothing ("custom_calls": kernels,
    "uncounted": those without an estimate). Its "optimal_seconds" is kept for reference only: for these programs it
    is not additive and goes negative (operations without a cost model count as negative time), so step time is
    estimated from the counts instead (`roofline`)."""
    ca = compiled.cost_analysis()
    ca = ca[0] if isinstance(ca, (list, tuple)) else ca
    text = compiled.as_text()
    kernels = [line for line in text.splitlines() if 'custom_call_target="tpu_custom_call"' in line]
    out = {"flops": float(ca.get("flops", 0.0)), "bytes": float(ca.get("bytes accessed", 0.0)),
           "comm_bytes": hlo_cost.collective_bytes(text), "optimal_seconds": float(ca.get("optimal_seconds", 0.0)),
           "custom_calls": len(kernels), "uncounted": sum('"cost_estimate"' not in k for k in kernels),
           "loops": text.count(" while(")}
    trips, once = hlo_cost.count(text), hlo_cost.count(text, per_trip=False)
    ratio = out["bytes"] / once["bytes"] if once["bytes"] else 1.0  # XLA's bytes per hlo_cost byte
    per_trip = {"flops": out["flops"] + trips["flops"] - once["flops"], "bytes": trips["bytes"] * ratio,
                "comm_bytes": trips["comm_bytes"], "cond_flops": trips["cond_flops"],
                "cond_bytes": trips["cond_bytes"] * ratio, "cond_comm_bytes": trips["cond_comm_bytes"],
                "loops": trips["loops"], "unknown_trips": trips["unknown_trips"]}
    out["per_trip"] = per_trip
    return out


def roofline(c: dict, gen: str) -> dict:
    """Step-time bounds per chip from counts c (flops, bytes, comm_bytes) and the peaks of chip `gen` (a
    glmjax.hardware.CHIPS name): "compute", "memory" (HBM) and "network" (ICI) seconds; "fast" = their max
    (everything overlapped), "slow" = their sum (nothing overlapped)."""
    chip = CHIPS[gen]
    t = {"compute": c["flops"] / chip.peak_bf16_flops, "memory": c["bytes"] / chip.hbm_bandwidth,
         "network": c["comm_bytes"] / chip.ici_bandwidth}
    return {**t, "fast": max(t.values()), "slow": sum(t.values())}


def needed_block_fraction(seq: int, block: int, shards: int = 1, layout: str = "zigzag") -> float:
    """Share of (query block, key block) pairs that blocked attention runs (`flash_attention.block_needed`: the
    key block starts at or before the query block's last slot) on the busiest context shard, for rows of one
    document each (packed documents skip more): how often the block-skipping conditionals take their branch. Query
    blocks of min(block, seq / shards) local queries at their layout's slots (`context.Layout`), key blocks of
    min(block, seq)."""
    n = seq // shards
    slots = Layout(layout, shards).perm(seq) if shards > 1 else np.arange(seq)
    bq, bk = min(block, n), min(block, seq)
    starts = np.arange(-(-seq // bk)) * bk
    worst = 0.0
    for i in range(shards):
        q = np.concatenate([slots[i * n:(i + 1) * n], np.full(-n % bq, -1)]).reshape(-1, bq).max(axis=1)
        worst = max(worst, float(np.mean(starts[None, :] <= q[:, None])))
    return worst


def estimate_build(cfg: ModelConfig, seq: int, layers: int, mtp: bool) -> ModelConfig:
    """A build whose every model loop runs one trip, so cost analysis counts all of it: `layers` decoder layers
    unrolled, one loss chunk, one query block, the MTP layer for one depth (or none)."""
    types = cfg.layer_indexer_types[:layers]
    return cfg.replace(num_hidden_layers=layers, indexer_types=types, index_topk_freq=1, index_skip_topk_offset=2,
                       first_k_dense_replace=min(cfg.first_k_dense_replace, layers), scan_layers=False,
                       loss_chunk=seq, block_q=seq, num_nextn_predict_layers=1 if mtp else 0,
                       mtp_depth=1 if mtp else 0)
