"""Check a run before launching it: `train.py --config=... --dry-run --topology=v5p:8x8x4` compiles the train step
of every stage of the config (each stage of a recipe with its own overrides, mesh, batch and sequence length) ahead
of time for a TPU topology, on this host (no TPU, no weights, no data: `glmjax.train.aot`), and prints per stage
whether it fits one chip's HBM and how the memory per chip splits.

What it reports is the compiler's buffer assignment for the real step (scanned layers, the config's loops, the
Pallas kernels with attention_impl="pallas"): arguments (parameters, optimizer state, batch), temporaries (the
activations kept for the backward pass and the peak of the rest), outputs not aliased to donated inputs, and the
generated code. The TPU compiler itself refuses a program that cannot fit (RESOURCE_EXHAUSTED): that is reported
as "does NOT fit" with the compiler's message. No step time is estimated here (bench/aot.py does, at the cost of
extra compiles).
"""
from __future__ import annotations

import time

import jax

from glmjax.config import ConfigError
from glmjax.hardware import GiB, chip_of_topology
from glmjax.parallel import make_mesh, num_batch_shards
from glmjax.train.aot import compile_uncached, lower_train_step, memory_per_chip, topology_devices
from glmjax.train.config import stage_config, validate_recipe
from glmjax.train.loop import check_config


def stage_names(config) -> list[str]:
    if config.stage == "ppo":
        raise ConfigError("stage='ppo': --dry-run compiles LM stages and recipes only")
    if config.stage == "recipe":
        validate_recipe(config)
        return list(config.recipe)
    return [config.stage]


def devices_of(topology: str, num_slices: int = 1) -> list:
    try:
        chip_of_topology(topology)
        return topology_devices(topology, num_slices)
    except (ValueError, RuntimeError, jax.errors.JaxRuntimeError) as e:
        raise ConfigError(f"--topology={topology!r}: {str(e).splitlines()[0]} (e.g. 'v5p:2x2x2', 'v5e:2x4', "
                          "'v6e:2x2')") from None


def checked_stage(config, name: str):
    """The stage's config (no weights are read: a stage that starts from a trained model gets a placeholder
    init_from) -> (stage config, ModelConfig, Stage)."""
    c = stage_config(config, name)
    c.init_from = c.init_from or "(dry run: no weights)"
    cfg, _, stage = check_config(c, init_exists=False)
    return c, cfg, stage


def compile_stage(config, name: str, devices: list):
    """-> (result dict, compiled or None) for stage `name` of `config` on `devices`."""
    c, cfg, stage = checked_stage(config, name)
    t = c.train
    mesh = make_mesh(c.parallel if "parallel" in c else None, devices)
    if t.batch_size % num_batch_shards(mesh):
        raise ConfigError(f"stages.{name}: train.batch_size={t.batch_size} must split evenly over the mesh's "
                          f"{num_batch_shards(mesh)} batch shards ({dict(mesh.shape)})")
    mode = stage.mode or t.mode
    optim = {**c.optim.to_dict(), "total_steps": t.steps}
    result = dict(stage=name, mode=mode, mesh=dict(mesh.shape), batch=t.batch_size, seq=t.seq_len,
                  attention_impl=cfg.attention_impl, remat=cfg.remat)
    t0 = time.perf_counter()
    try:
        lowered = lower_train_step(cfg, optim, mesh, t.batch_size, t.seq_len, stage=name, mode=mode,
                                   index_loss_weight=t.index_loss_weight, bias_rate=t.bias_update_rate)
        compiled = compile_uncached(lowered)
    except jax.errors.JaxRuntimeError as e:  # the TPU compiler refuses a program that cannot fit
        if "RESOURCE_EXHAUSTED" not in str(e):
            raise
        result.update(fits=False, compile_s=time.perf_counter() - t0, message=str(e).splitlines()[0])
        return result, None
    result.update(memory=memory_per_chip(compiled), compile_s=time.perf_counter() - t0)
    return result, compiled


def describe(result: dict, hbm: int) -> str:
    mesh = {a: n for a, n in result["mesh"].items() if n > 1} or {"data": 1}
    head = (f"stage {result['stage']}: {result['mode']} attention ({result['attention_impl']}), batch "
            f"{result['batch']} x seq {result['seq']:,}, mesh {mesh}, compiled in {result['compile_s']:.0f} s")
    if "memory" not in result:
        return f"{head}\n  does NOT fit: {result['message']}"
    m = result["memory"]
    return (f"{head}\n  per chip: arguments {m['argument'] / GiB:.2f} GiB (state + batch), temporaries "
            f"{m['temp'] / GiB:.2f} GiB, outputs {m['output'] / GiB:.2f} GiB ({m['alias'] / GiB:.2f} aliased to "
            f"donated inputs), code {m['code'] / GiB:.2f} GiB\n  total {m['total'] / GiB:.2f} GiB of "
            f"{hbm / GiB:.0f} GiB HBM: {'fits' if result['fits'] else 'does NOT fit'}")


def dry_run(config, topology: str, num_slices: int = 1, log=print) -> list[dict]:
    """Compile every stage of `config` for `topology` and log what fits -> one result dict per stage (stage, mode,
    mesh, batch, seq, fits, compile_s, and memory per chip in bytes or the compiler's message)."""
    names = stage_names(config)
    for name in names:  # every stage's config is checked before anything compiles
        checked_stage(config, name)
    devices = devices_of(topology, num_slices)
    hbm = chip_of_topology(topology).hbm_bytes
    log(f"dry run on {topology} x{num_slices} ({len(devices)} chips, {hbm / GiB:.0f} GiB HBM each): "
        f"{', '.join(names)}")
    results = []
    for name in names:
        result, compiled = compile_stage(config, name, devices)
        if compiled is not None:
            result["fits"] = result["memory"]["total"] <= hbm
        del compiled
        log(describe(result, hbm))
        results.append(result)
    return results
