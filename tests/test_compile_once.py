"""Nothing compiles again after the first step: the trainer's train step (mesh, explicit shardings), bench/stages.py's
plain-jit step (also on a model committed to the device, as `load_hf` gives it), and prefill / decode / generate.
Counted with jax.monitoring's jaxpr -> MLIR lowering event, which fires on every compilation, persistent
compilation cache hits included."""
import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from bench.stages import device_state, plain_jit_step
from configs import tiny as tiny_config_file
from glmjax.config import ModelConfig
from glmjax.infer import Decoder, generate
from glmjax.model import GLM, Batch
from glmjax.parallel import create_sharded, global_batch, init_opt_state, make_mesh
from glmjax.train.stages import STAGES, TRAINABLE
from glmjax.train.step import make_optimizer, make_train_step, split_model

LOWERING = "/jax/core/compile/jaxpr_to_mlir_module_duration"


@contextlib.contextmanager
def lowerings():
    """-> a list that collects one entry per jit lowering (= compilation) while the block runs."""
    seen = []

    def listener(event, _secs, **_):
        if event == LOWERING:
            seen.append(event)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield seen
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)


def small_config():
    c = tiny_config_file.get_config()
    c.model.update(num_hidden_layers=1, first_k_dense_replace=1, indexer_types=("full",), num_nextn_predict_layers=0,
                   index_topk=4)  # one layer (a dense MLP), sparse attention: compiles fastest
    return c


def batch(step: int, B=8, S=16):
    tok = np.random.default_rng(step).integers(0, 512, (B, S)).astype(np.int32)
    return {"tokens": tok, "segment_ids": np.ones((B, S), np.int32),
            "positions": np.broadcast_to(np.arange(S, dtype=np.int32), (B, S)).copy()}


def to_batch(b):
    return Batch(jnp.asarray(b["tokens"]), jnp.asarray(b["segment_ids"]), jnp.asarray(b["positions"]))


def compiles_per_step(step_fn, state, make_batch, steps=3):
    """Lowerings during each of `steps` train steps (a fresh batch and step number each time)."""
    counts = []
    for i in range(steps):
        with lowerings() as seen:
            *state, m = step_fn(*state, make_batch(i), jnp.int32(i + 1))
            jax.block_until_ready(m["loss"])
        counts.append(len(seen))
    return counts


@pytest.mark.slow
def test_plain_jit_step_compiles_once_also_for_an_imported_model():
    """bench/stages.py's plain-jit step, and the same step on a model whose parameters are committed to the device
    as `load_hf` leaves them (with optax's fresh step counts uncommitted that one compiled again at step 2)."""
    config = small_config()
    step_fn, state = plain_jit_step(config, "pretrain", "sparse")
    counts = compiles_per_step(step_fn, state, lambda i: to_batch(batch(i)))
    assert counts[0] >= 1 and counts[1:] == [0, 0], counts
    cfg = ModelConfig.from_dict(dict(config.model))
    graphdef, params, rest = split_model(GLM(cfg, nnx.Rngs(1)), "model")
    params, rest = jax.device_put((params, rest), jax.devices()[0])
    tx, _ = make_optimizer(params, config.optim, 1000, cfg)
    step_fn = make_train_step(graphdef, tx, "pretrain", "sparse", 1e-3)
    counts = compiles_per_step(step_fn, device_state(params, rest, tx), lambda i: to_batch(batch(i)))
    assert counts[0] >= 1 and counts[1:] == [0, 0], counts


def test_the_counter_sees_a_recompile_from_uncommitted_inputs():
    """Negative control, at a small scale: an AdamW update fed committed parameters and optax's fresh (uncommitted)
    step count -- bench/stages.py's old state -- compiles again at step 2, when its inputs are its own outputs."""
    tx = optax.adamw(1e-3)
    params = jax.device_put({"w": jnp.ones((4, 4))}, jax.devices()[0])

    @jax.jit
    def step(params, opt_state):
        updates, opt_state = tx.update(jax.tree.map(jnp.ones_like, params), opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    state = (params, tx.init(params))
    counts = []
    for _ in range(3):
        with lowerings() as seen:
            state = step(*state)
        counts.append(len(seen))
    assert counts == [1, 1, 0], counts


def test_trainer_mesh_step_is_compiled_before_its_first_call(tmp_path):
    """The step as glmjax.train.loop builds it (sharded state on a 2-device mesh, global batches of the data
    pipeline): `setup` compiles it in a thread while `restore` creates the model, so not even the first call
    compiles, and nothing compiles after."""
    from glmjax.train import loop

    config = small_config()
    config.parallel.num_devices = 2  # batch over data=2: sharded, and cheaper to compile than 8 devices
    config.train.update(batch_size=8, seq_len=16, steps=100, eval_batches=0)
    cfg, data_cfg, stage = loop.check_config(config)
    run = loop.setup(config, str(tmp_path), cfg, data_cfg, stage)
    try:
        loop.restore(run)  # nothing to resume: the fresh state
        step_fn = run.train_step.result()
        jnp.int32(0)  # the step number's own small conversion program, compiled once per process
        counts = compiles_per_step(step_fn, (run.params, run.rest, run.opt_state), lambda i: run.global_rows(
            next(run.it)))
    finally:
        run.ckpt.close()
    assert counts == [0, 0, 0], counts


def test_prefill_decode_and_generate_compile_once():
    config = small_config()
    decoder = Decoder(GLM(ModelConfig.from_dict(dict(config.model)), nnx.Rngs(0)), "sparse")
    prompts = [[1, 2, 3, 4, 5], [6, 7, 8]]
    first = generate(decoder, prompts, 4, key=jax.random.key(0))  # compiles prefill, decode, sampling
    with lowerings() as seen:
        again = generate(decoder, [[9, 8, 7, 6, 5], [4, 3, 2]], 4, key=jax.random.key(1))
    assert len(first.tokens) == len(again.tokens) == 2
    assert seen == [], f"{len(seen)} compilations in the second generate"
    assert decoder.prefill._cache_size() == decoder.decode._cache_size() == 1  # 3 decode steps per generate
