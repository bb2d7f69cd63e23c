"""Sharded training recipe shared by test_parallel.py and test_multihost.py, and the multi-host worker.

As a script it is one process of a multi-process run (tests/test_multihost.py starts two):
    python tests/sharded_training.py PROCESS_ID NUM_PROCESSES PORT CKPT_DIR OUT_JSON
It trains STEPS_BEFORE steps with the trainer's sharded step, checkpoints with orbax from every process, restores into
fresh arrays, checks them, trains STEPS_AFTER more steps and (process 0) writes the per-step losses as JSON.
"""
import json
import os
import sys

import numpy as np

SEQ, BATCH = 32, 8
STEPS_BEFORE, STEPS_AFTER = 5, 3
MULTIHOST_MESH = dict(data=2, fsdp=2, expert=2, tensor=1)  # 8 devices over 2 processes, expert parallel


def small_cfg(**kw):
    """Tiny shapes, 2 layers (one dense with an indexer, one MoE sharing its top-k), no MTP: one scanned stack."""
    from helpers import tiny
    return tiny(**{**dict(num_hidden_layers=2, indexer_types=("full", "shared"), num_nextn_predict_layers=0), **kw})


STAGE, MODE, BIAS_RATE = "pretrain", "sparse", 1e-2  # the stage's trainable set: every parameter but the indexers


def trainable():
    from glmjax.train.stages import STAGES, TRAINABLE
    return TRAINABLE[STAGES[STAGE].trainable]


def make_tx(params, cfg):
    from glmjax.optim import build_optimizer
    from glmjax.optim.config import default_optim_config
    return build_optimizer(params, {**default_optim_config(name="adamw", lr=1e-2, warmup_steps=0).to_dict(),
                                    "total_steps": 100}, cfg)[0]


def make_step(graphdef, tx, mesh=None, state=None):
    """The trainer's train step of STAGE, (params, rest, opt_state, batch, step) -> (params, rest, opt_state,
    metrics): jitted, donating the state; with `mesh`, sharded like state = (params, rest, opt_state)."""
    from glmjax.train.step import make_train_step
    return make_train_step(graphdef, tx, STAGE, MODE, BIAS_RATE, mesh=mesh, state=state)


def batch_rows(step: int, cfg):
    """The global batch of `step` as numpy arrays (tokens, segment_ids, positions): two documents per row, each an
    arithmetic sequence t_{i+1} = t_i + d (mod 64) with d in 1..3, so the loss can fall within a few steps."""
    rng = np.random.default_rng(1000 + step)
    cut = rng.integers(8, SEQ - 8, BATCH)
    seg = np.where(np.arange(SEQ)[None] < cut[:, None], 1, 2).astype(np.int32)
    pos = np.where(seg == 1, np.arange(SEQ)[None], np.arange(SEQ)[None] - cut[:, None]).astype(np.int32)
    start, d = rng.integers(0, 64, (BATCH, 2)), rng.integers(1, 4, (BATCH, 2))
    doc = seg - 1
    tok = (np.take_along_axis(start, doc, 1) + pos * np.take_along_axis(d, doc, 1)) % 64
    return tok.astype(np.int32), seg, pos


def reference_losses(n_steps: int):
    """Single device, unsharded: the losses of n_steps steps."""
    import jax.numpy as jnp
    from flax import nnx
    from glmjax.model import GLM, Batch
    cfg = small_cfg()
    graphdef, params, rest = nnx.split(GLM(cfg, nnx.Rngs(0)), trainable(), ...)
    tx = make_tx(params, cfg)
    opt_state = tx.init(params)
    step = make_step(graphdef, tx)
    losses = []
    for i in range(n_steps):
        params, rest, opt_state, m = step(params, rest, opt_state, Batch(*batch_rows(i, cfg)), jnp.int32(i))
        losses.append(float(m["loss"]))
    return losses


def worker(process_id: int, num_processes: int, port: int, ckpt_dir: str, out_json: str):
    import jax
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    from glmjax import parallel as par
    par.initialize_distributed(par.default_parallel_config(
        coordinator_address=f"127.0.0.1:{port}", num_processes=num_processes, process_id=process_id))
    assert jax.process_count() == num_processes and jax.device_count() == 8, (jax.process_count(), jax.devices())

    import jax.numpy as jnp
    import orbax.checkpoint as ocp
    from flax import nnx
    from jax.experimental import multihost_utils
    from glmjax.model import GLM, Batch

    cfg = small_cfg()
    mesh = par.make_mesh(MULTIHOST_MESH)
    graphdef, params, rest = par.create_sharded(lambda: GLM(cfg, nnx.Rngs(0)), mesh, trainable(), ...)
    tx = make_tx(params, cfg)
    opt_state = par.init_opt_state(tx, params, mesh)
    step = make_step(graphdef, tx, mesh, (params, rest, opt_state))
    rows = par.process_rows(par.batch_sharding(mesh), BATCH)
    assert len(rows) == BATCH // num_processes, rows  # each process holds (and loads) only its share

    losses = []

    def train(params, rest, opt_state, steps):
        for i in steps:
            full = batch_rows(i, cfg)
            batch = Batch(*par.global_batch(tuple(a[rows] for a in full), mesh, BATCH))
            gathered = multihost_utils.process_allgather(batch.tokens, tiled=True)
            assert np.array_equal(gathered, full[0]), "process rows landed in the wrong global rows"
            params, rest, opt_state, m = step(params, rest, opt_state, batch, jnp.int32(i))
            losses.append(float(m["loss"]))
        return params, rest, opt_state

    params, rest, opt_state = train(params, rest, opt_state, range(STEPS_BEFORE))
    state = {"params": params, "rest": rest, "opt_state": opt_state}
    path = os.path.join(ckpt_dir, str(STEPS_BEFORE))
    ckptr = ocp.StandardCheckpointer()
    ckptr.save(path, state)
    ckptr.wait_until_finished()
    restored = ckptr.restore(path, par.abstract(state))
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(restored)):
        assert a.sharding == b.sharding
        for sa, sb in zip(a.addressable_shards, b.addressable_shards):
            assert np.array_equal(np.asarray(sa.data), np.asarray(sb.data))
    del state, params, rest, opt_state  # continue from the restored arrays only
    train(restored["params"], restored["rest"], restored["opt_state"], range(STEPS_BEFORE, STEPS_BEFORE + STEPS_AFTER))
    if process_id == 0:
        with open(out_json, "w") as f:
            json.dump({"losses": losses, "rows": rows.tolist()}, f)
    jax.distributed.shutdown()


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    worker(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5])
