"""Sharding on any device mesh: mesh from config, one logical-axis rules table, sharded state and steps, multi-host.

How a training loop adopts it (see `glmjax/parallel/sharding.py` for the whole recipe):

    initialize_distributed(config.parallel); mesh = make_mesh(config.parallel)
    graphdef, params, rest = create_sharded(make_model, mesh, TRAINABLE, ...)
    opt_state = init_opt_state(tx, params, mesh)
    step = shard_train_step(step_fn, mesh, params, rest, opt_state)
    batch = global_batch(rows_of_this_process, mesh, global_batch_size)
"""
from glmjax.parallel.mesh import (default_parallel_config, distributed_args, initialize_distributed, make_mesh,
                                  mesh_shape, process_rows)
from glmjax.parallel.rules import (LOGICAL_RULES, MESH_AXES, batch_axes, batch_spec, logical_sharding, logical_spec,
                                   num_batch_shards, sequence_axes, token_axes)
from glmjax.parallel.sharding import (abstract, batch_sharding, create_sharded, global_batch, init_opt_state,
                                      opt_state_shardings, output_shardings, shard_eval_step, shard_train_step,
                                      sharded_init, shardings_of, state_shardings, with_mesh)

__all__ = [
    "LOGICAL_RULES", "MESH_AXES", "abstract", "batch_axes", "batch_sharding", "batch_spec", "create_sharded",
    "default_parallel_config", "distributed_args", "global_batch", "init_opt_state", "initialize_distributed",
    "logical_sharding", "logical_spec", "make_mesh", "mesh_shape", "num_batch_shards", "opt_state_shardings",
    "output_shardings", "process_rows", "sequence_axes", "shard_eval_step", "shard_train_step", "sharded_init",
    "shardings_of", "state_shardings", "token_axes", "with_mesh",
]
