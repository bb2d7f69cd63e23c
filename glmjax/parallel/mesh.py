"""The `parallel` section of an experiment config -> a device mesh; multi-host start-up and each process's data share.

    c.parallel = default_parallel_config(fsdp=16, expert=16, tensor=4)   # data=-1: the remaining devices
    initialize_distributed(c.parallel)    # before anything touches devices; a no-op for one process
    mesh = make_mesh(c.parallel)          # axes ("data", "fsdp", "expert", "context", "tensor"), all Auto

Multi-slice: when the devices belong to several slices (`device.slice_index`, e.g. TPU multislice), the data axis
is laid across slices (data-center network) and the other axes stay inside a slice (ICI), via
`jax.experimental.mesh_utils.create_hybrid_device_mesh`. Inside a slice `create_device_mesh` maps the axes onto
the physical torus (tensor innermost, the fastest-communicating axis, then context).
"""
from __future__ import annotations

import math
import os
from typing import Mapping, Sequence

import jax
import ml_collections
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from glmjax.config import ConfigError
from glmjax.parallel.rules import MESH_AXES

ENV = {"coordinator_address": "GLMJAX_COORDINATOR_ADDRESS", "num_processes": "GLMJAX_NUM_PROCESSES",
       "process_id": "GLMJAX_PROCESS_ID"}


def default_parallel_config(**overrides) -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.data = -1  # mesh axis sizes; exactly one may be -1 = "all remaining devices"
    c.fsdp = 1
    c.expert = 1
    c.context = 1  # context parallelism: the sequence split over this many devices (glmjax/model/context.py;
    # the layout: model.context_layout, zig-zag by default; train.seq_len must divide by 2 x context)
    c.tensor = 1
    c.num_devices = 0  # 0 = every device; N = the first N (e.g. to leave devices to a rollout worker, or in tests)
    c.num_slices = 0  # 0 = count the devices' slice_index values; the data axis spans the slices
    # multi-host (jax.distributed.initialize); unset fields fall back to $GLMJAX_COORDINATOR_ADDRESS,
    # $GLMJAX_NUM_PROCESSES, $GLMJAX_PROCESS_ID; auto_detect=True lets JAX find them (TPU pods, SLURM, ...)
    c.coordinator_address = ml_collections.config_dict.placeholder(str)
    c.num_processes = ml_collections.config_dict.placeholder(int)
    c.process_id = ml_collections.config_dict.placeholder(int)
    c.auto_detect = False
    c.update(overrides)
    return c


def _get(pc, name, default=None):
    if pc is None:
        return default
    return pc.get(name, default) if isinstance(pc, Mapping) or hasattr(pc, "get") else getattr(pc, name, default)


def mesh_shape(pc, num_devices: int) -> dict[str, int]:
    """Resolve the axis sizes (one -1 allowed) against the device count; errors name the field and the rule."""
    sizes = {a: _get(pc, a, -1 if a == "data" else 1) for a in MESH_AXES}
    for a, v in sizes.items():
        if not isinstance(v, int) or isinstance(v, bool) or (v < 1 and v != -1):
            raise ConfigError(f"parallel.{a}={v!r}: must be a positive integer or -1")
    free = [a for a, v in sizes.items() if v == -1]
    if len(free) > 1:
        raise ConfigError(f"parallel.{free[1]}=-1: only one mesh axis may be -1 (also {free[0]})")
    fixed = math.prod(v for v in sizes.values() if v != -1)
    if free:
        if num_devices % fixed:
            raise ConfigError(f"parallel.{free[0]}=-1: the other axes multiply to {fixed}, which does not divide "
                              f"the {num_devices} devices")
        sizes[free[0]] = num_devices // fixed
    if math.prod(sizes.values()) != num_devices:
        raise ConfigError(f"parallel: mesh {sizes} has {math.prod(sizes.values())} devices, there are {num_devices}")
    return sizes


def make_mesh(pc=None, devices: Sequence | None = None) -> Mesh:
    """Mesh with axes MESH_AXES ("data", "fsdp", "expert", "context", "tensor") from a `parallel` config section
    (None: all data)."""
    devices = list(jax.devices() if devices is None else devices)
    n = _get(pc, "num_devices", 0) or len(devices)
    if not isinstance(n, int) or not 1 <= n <= len(devices):
        raise ConfigError(f"parallel.num_devices={n!r}: must be 0 (all) or in [1, {len(devices)}]")
    devices = devices[:n]
    sizes = mesh_shape(pc, len(devices))
    shape = tuple(sizes[a] for a in MESH_AXES)
    slices = _get(pc, "num_slices", 0) or len({getattr(d, "slice_index", 0) for d in devices})
    if slices > 1:
        if sizes["data"] % slices:
            raise ConfigError(f"parallel.data={sizes['data']}: must be a multiple of the {slices} slices "
                              "(the data axis spans slices)")
        ici = (sizes["data"] // slices,) + shape[1:]
        dcn = (slices,) + (1,) * (len(shape) - 1)
        arr = mesh_utils.create_hybrid_device_mesh(ici, dcn, devices, allow_split_physical_axes=True)
    else:
        arr = mesh_utils.create_device_mesh(shape, devices, allow_split_physical_axes=True)
    return Mesh(arr, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


def distributed_args(pc=None) -> dict:
    """coordinator_address / num_processes / process_id from the config, else the environment (unset: None)."""
    out = {}
    for k, env in ENV.items():
        v = _get(pc, k)
        if v is None and os.environ.get(env):
            v = os.environ[env] if k == "coordinator_address" else int(os.environ[env])
        out[k] = v
    return out


def initialize_distributed(pc=None) -> bool:
    """Start multi-host JAX if the config / environment asks for it. -> True when running multi-process.

    Call once, first thing (before any device is touched). With a coordinator address, num_processes and
    process_id are required; with `auto_detect`, JAX's cluster detection fills everything in."""
    if jax.distributed.is_initialized():
        return jax.process_count() > 1
    args = distributed_args(pc)
    if args["coordinator_address"] is not None:
        missing = [k for k in ("num_processes", "process_id") if args[k] is None]
        if missing:
            raise ConfigError(f"parallel.coordinator_address={args['coordinator_address']!r}: also needs "
                              f"parallel.{missing[0]} (or ${ENV[missing[0]]})")
        jax.distributed.initialize(**args)
    elif _get(pc, "auto_detect", False):
        jax.distributed.initialize()
    else:
        return False
    return jax.process_count() > 1


def process_rows(sharding: jax.sharding.Sharding, global_batch: int) -> np.ndarray:
    """Indices of the global batch rows this process's devices hold (ascending): what its data loader must read.
    Feed those rows, in this order, to `glmjax.parallel.global_batch`."""
    if isinstance(sharding, NamedSharding):  # rows only: a [B,S] batch sharding may also split the sequence
        sharding = NamedSharding(sharding.mesh, PartitionSpec(*sharding.spec[:1]))
    rows: set[int] = set()
    for idx in sharding.addressable_devices_indices_map((global_batch,)).values():
        rows.update(range(*idx[0].indices(global_batch)))
    return np.asarray(sorted(rows), np.int64)
