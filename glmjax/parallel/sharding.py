"""Sharded state and sharded steps: model state created directly in its shardings, optimizer-state and batch
shardings, and `jax.jit` step functions with explicit in/out shardings and donation.

    mesh = make_mesh(config.parallel)
    graphdef, params, rest = create_sharded(lambda: GLM(cfg, nnx.Rngs(seed)), mesh, TRAINABLE, ...)
    opt_state = init_opt_state(tx, params, mesh)
    step = shard_train_step(train_step_fn, mesh, params, rest, opt_state)    # any (p, r, o, batch) -> (p, r, o, m)
    batch = global_batch(local_rows, mesh, global_batch_size)                # each process passes its own rows
    params, rest, opt_state, metrics = step(params, rest, opt_state, batch)

Nothing is ever materialised whole on one device: the model is traced abstractly (`nnx.eval_shape`), its
shardings come from the logical-axis rules (`glmjax/parallel/rules.py`), and the real initialisation runs inside
`jax.jit` with those out_shardings. Step functions are traced with the mesh as the abstract mesh in context, which
is how the MoE finds the `expert` axis for expert parallelism (`glmjax/model/moe.py`).
"""
from __future__ import annotations

import functools
import math
from typing import Any, Callable, Mapping

import jax
import numpy as np
from flax import nnx
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from glmjax.parallel.rules import batch_spec, logical_spec, num_batch_shards, sequence_axes


def _is_var(x) -> bool:
    return isinstance(x, nnx.Variable)


def state_shardings(state, mesh, rules: Mapping[str, Any] | None = None):
    """nnx.State (concrete or abstract) whose Variables carry logical axis names (`out_sharding` metadata) -> the
    same tree with every Variable holding its NamedSharding (usable as jit in/out_shardings)."""

    def one(v):
        spec = logical_spec(v.get_metadata().get("out_sharding"), v.shape, mesh, rules)
        return v.replace(NamedSharding(mesh, spec))

    return jax.tree.map(one, state, is_leaf=_is_var)


def shardings_of(tree):
    """The `.sharding` of every leaf (arrays, or ShapeDtypeStructs built by `abstract`)."""
    return jax.tree.map(lambda x: x.sharding, tree)


def abstract(tree, shardings=None):
    """Leaves -> jax.ShapeDtypeStruct carrying a sharding (its own, or the matching leaf of `shardings`): inputs for
    AOT lowering (`bench/aot.py`) and targets for orbax restores."""
    if shardings is None:
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)


def create_sharded(make: Callable[[], nnx.Module], mesh, *filters, rules: Mapping[str, Any] | None = None):
    """-> (graphdef, *states) = nnx.split(make(), *filters), every state created by one jit directly in its
    shardings (the same values as an unsharded `make()`: JAX's random bits do not depend on the sharding)."""
    graphdef, init = sharded_init(make, mesh, *filters, rules=rules)
    return (graphdef, *init())


def sharded_init(make: Callable[[], nnx.Module], mesh, *filters, rules: Mapping[str, Any] | None = None):
    """-> (graphdef, init): `init()` is the jitted initialiser behind `create_sharded` (lower it to inspect its
    per-device memory, or to AOT-compile it)."""
    graphdef, *abs_states = nnx.split(nnx.eval_shape(make), *filters)
    shardings = tuple(state_shardings(s, mesh, rules) for s in abs_states)

    @functools.partial(jax.jit, out_shardings=shardings)
    def init():
        return tuple(nnx.split(make(), *filters)[1:])

    return graphdef, init


def explicit_mesh(mesh):
    """The same devices and axes with every axis Explicit (sharding in types)."""
    return jax.sharding.Mesh(mesh.devices, mesh.axis_names, axis_types=(AxisType.Explicit,) * len(mesh.axis_names))


def output_shardings(fn: Callable, mesh, *args):
    """Shardings of fn(*args)'s outputs, found by tracing with sharding-in-types (no compilation, no allocation).

    With Explicit axes every op carries its operands' shardings to its result, so e.g. an optimizer's zeros_like
    moments and sliced Muon parts inherit their parameter's sharding; an Auto-axes compile would be free to
    replicate them. args: arrays or ShapeDtypeStructs with NamedShardings on `mesh`."""
    emesh = explicit_mesh(mesh)
    args = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                                       sharding=NamedSharding(emesh, x.sharding.spec)), args)
    with jax.set_mesh(emesh):
        out = jax.eval_shape(fn, *args)
    return jax.tree.map(lambda x: NamedSharding(mesh, x.sharding.spec if x.sharding is not None else P()), out)


def opt_state_shardings(tx, params, mesh):
    """Shardings of tx.init(params) (params: sharded arrays or `abstract(...)` leaves)."""
    return output_shardings(tx.init, mesh, abstract(params))


def init_opt_state(tx, params, mesh):
    """tx.init(params) computed under jit directly in `opt_state_shardings`."""
    return jax.jit(tx.init, out_shardings=opt_state_shardings(tx, params, mesh))(params)


def batch_sharding(mesh, rules: Mapping[str, Any] | None = None) -> NamedSharding:
    """Sharding of every [B, S, ...] batch array: B split over the batch axes (data, fsdp, expert), S over context."""
    return NamedSharding(mesh, batch_spec(mesh, rules))


def global_batch(local, mesh, global_batch_size: int, rules: Mapping[str, Any] | None = None):
    """Per-process rows (a pytree of numpy [b, ...], the rows `process_rows(batch_sharding(mesh), B)` names, in
    that order) -> global jax.Arrays [B, ...] split over the batch axes. One process: `local` is the whole batch."""
    shards = num_batch_shards(mesh, rules)
    if global_batch_size % shards:
        raise ValueError(f"global batch {global_batch_size} is not divisible by the {shards} batch shards of mesh "
                         f"{dict(mesh.shape)} (batch axes {batch_spec(mesh, rules)})")
    sharding = batch_sharding(mesh, rules)
    seq = math.prod(dict(mesh.shape)[a] for a in sequence_axes(mesh, rules))

    def one(x):
        x = np.asarray(x)
        if seq > 1 and (x.ndim < 2 or x.shape[1] % seq):
            raise ValueError(f"batch array of shape {x.shape}: its sequence length must be divisible by the {seq} "
                             f"context shards of mesh {dict(mesh.shape)}")
        return jax.make_array_from_process_local_data(sharding, x, (global_batch_size,) + x.shape[1:])

    return jax.tree.map(one, local)


def with_mesh(fn: Callable, mesh) -> Callable:
    """fn traced with `mesh` as the abstract mesh in context (the MoE reads its expert axis from it)."""

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
            return fn(*args, **kwargs)

    return wrapped


def shard_train_step(step_fn: Callable, mesh, params, rest, opt_state, *, batch=None, extra_args: int = 0,
                     donate: bool = True, rules: Mapping[str, Any] | None = None):
    """jax.jit of a pure step `(params, rest, opt_state, batch, *extra) -> (params, rest, opt_state, metrics)` with
    explicit shardings: the state keeps the shardings of `params` / `rest` / `opt_state` (arrays, `abstract`
    leaves, or trees of shardings), the batch is split over the batch axes (or `batch`: its sharding tree), the
    `extra_args` trailing arguments (e.g. a step counter) and the metrics are replicated. The three state
    arguments are donated (their buffers are reused for the new state). The result also has `.lower(...)` for AOT
    compilation. A step_fn that is itself jitted works too (its own donation is then moot)."""
    state = tuple(_shardings(t) for t in (params, rest, opt_state))
    batch_sh = batch_sharding(mesh, rules) if batch is None else _shardings(batch)
    replicated = NamedSharding(mesh, P())
    return jax.jit(with_mesh(step_fn, mesh), in_shardings=(*state, batch_sh) + (replicated,) * extra_args,
                   out_shardings=(*state, replicated), donate_argnums=(0, 1, 2) if donate else ())


def shard_eval_step(eval_fn: Callable, mesh, params, rest, *, batch=None, rules: Mapping[str, Any] | None = None):
    """jax.jit of `(params, rest, batch) -> metrics` with the given state shardings, nothing donated."""
    batch_sh = batch_sharding(mesh, rules) if batch is None else _shardings(batch)
    return jax.jit(with_mesh(eval_fn, mesh), in_shardings=(_shardings(params), _shardings(rest), batch_sh),
                   out_shardings=NamedSharding(mesh, P()))


def _shardings(tree):
    """A tree of shardings, or arrays / ShapeDtypeStructs / Variables holding them -> a tree of shardings."""
    def one(x):
        if isinstance(x, jax.sharding.Sharding):
            return x
        if _is_var(x):
            return x.replace(one(x.get_value()))
        return x.sharding

    return jax.tree.map(one, tree, is_leaf=lambda x: _is_var(x) or isinstance(x, jax.sharding.Sharding))
