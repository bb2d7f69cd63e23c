"""Shared by the notebooks: runtime detection, the size presets of the GLM-5 DSA recipe, and small readers.

Sizes (the notebooks' SIZE parameter; "auto" picks "large" on a TPU or GPU runtime, else "cpu"):
  "ci"     2 layers, no MTP, a handful of steps per stage: seconds of training, what the tests run (1/4 of the
           indexers is then 1/2)
  "cpu"    the tiny recipe (configs/recipe_tiny.py) with 8 layers: minutes on a 2-core Colab CPU
  "large"  a ~0.1B-parameter model at sequence 1024 on a TPU (or GPU) runtime, batch split over all chips

A preset fixes the model, the batch and the steps of every stage; the notebooks with the same SIZE and WORKDIR
share their runs (a finished stage is never trained twice: glmjax.train.run skips it).
"""
from __future__ import annotations

import json
import os

import jax
import ml_collections
import numpy as np

from glmjax.data import make_pipeline
from glmjax.train.loop import to_batch

SIZES = ("ci", "cpu", "large")
STAGE_STEPS = {"ci": (8, 4, 4, 4), "cpu": (200, 60, 60, 60), "large": (2000, 300, 300, 300)}


def runtime() -> dict:
    """What this Python process runs on: backend ("tpu", "gpu", "cpu"), device kind and count."""
    devices = jax.devices()
    return {"backend": jax.default_backend(), "kind": devices[0].device_kind, "devices": len(devices)}


def pick_size(size: str) -> str:
    if size == "auto":
        return "large" if jax.default_backend() in ("tpu", "gpu") else "cpu"
    if size not in SIZES:
        raise ValueError(f"SIZE={size!r}: must be 'auto' or one of {SIZES}")
    return size


def patterns(layers: int) -> dict[str, tuple[str, ...]]:
    """IndexShare patterns by the share of layers that keep their indexer: "1" (GLM-5: every layer), "1/2" (every
    2nd layer, the others reuse the top-k of the previous full layer), "1/4" (every 4th)."""
    return {share: tuple("full" if i % n == 0 else "shared" for i in range(layers))
            for share, n in (("1", 1), ("1/2", 2), ("1/4", 4))}


def per_device_batch() -> int:
    """Sequences per device for "large": a step with 8 x 1024 tokens per chip needs ~9.5 GiB (dense pretrain,
    compiled ahead of time for v5e); devices with less than 12 GiB (TPU v2: 8) get 4."""
    limit = (jax.devices()[0].memory_stats() or {}).get("bytes_limit", 16 * 2 ** 30)
    return 8 if limit >= 12 * 2 ** 30 else 4


def run_dir(workdir: str, size: str, steps: int | None) -> str:
    """Where the recipe of this size (and step count) runs: workdir/recipe_<size>[_<steps>]."""
    return os.path.join(workdir, f"recipe_{size}" + (f"_{steps}" if steps else ""))


def recipe_config(size: str, steps: int | None = None) -> ml_collections.ConfigDict:
    """The recipe pretrain -> dense_warmup -> sparse_adapt -> indexshare (every 2nd layer keeps its indexer) for a
    size preset. steps: pretrain steps (the later stages get a third each); None = the preset's."""
    from configs import recipe_tiny

    c = recipe_tiny.get_config()
    layers = 2 if size == "ci" else 8
    c.model.update(num_hidden_layers=layers, indexer_types=patterns(layers)["1"])
    if size == "ci":
        c.model.update(first_k_dense_replace=0, num_nextn_predict_layers=0)
        c.train.update(seq_len=64, batch_size=4, eval_batches=0, log_every=1, checkpoint_every=10_000,
                       tensorboard=False)  # no held-out evals in the stages: their compilation is a third of the time
        c.data.max_docs = 100
    elif size == "large":
        c.model.update(hidden_size=512, intermediate_size=1408, moe_intermediate_size=256, num_attention_heads=8,
                       q_lora_rank=384, kv_lora_rank=256, qk_nope_head_dim=64, qk_rope_head_dim=32,
                       v_head_dim=64, n_routed_experts=32, index_n_heads=8, index_head_dim=64, index_topk=256,
                       max_position_embeddings=1024, mtp_depth=1, dtype="bfloat16")
        c.train.update(seq_len=1024, batch_size=per_device_batch() * jax.device_count(), log_every=20,
                       checkpoint_every=250)
        c.optim.update(lr=1e-3, warmup_steps=100)
    if steps is not None and (not isinstance(steps, int) or steps < 2):
        raise ValueError(f"STEPS={steps!r}: must be None or an integer >= 2")
    stage_steps = STAGE_STEPS[size] if steps is None else (steps,) + (max(2, steps // 3),) * 3
    for name, n in zip(c.recipe, stage_steps):
        stage = c.stages[name]
        stage.train.update(steps=n, eval_every=n // 2)
        if "optim" not in stage:
            stage.optim = ml_collections.ConfigDict()
        stage.optim.warmup_steps = max(1, min(stage.optim.get("warmup_steps", c.optim.warmup_steps), n // 5))
    c.stages.indexshare.model.indexer_types = patterns(layers)["1/2"]
    return c


def metrics(workdir: str) -> list[dict]:
    """The JSON lines of a stage's metrics.jsonl."""
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def series(records: list[dict], key: str) -> tuple[np.ndarray, np.ndarray]:
    """(steps, values) of the records that carry `key`."""
    rows = [(r["step"], r[key]) for r in records if key in r]
    return np.array([s for s, _ in rows]), np.array([v for _, v in rows])


def eval_batches(config, n: int = 2, max_rows: int = 8) -> list:
    """n held-out batches (model.Batch) of the config's corpus and sequence length, at most max_rows rows each."""
    t = config.train
    data = make_pipeline(config.data, t.seq_len, min(t.batch_size, max_rows), t.seed, "eval")
    return [to_batch(b) for b in data.take(n)]


def decoder_layer(model, i: int):
    """Decoder layer i of a GLM as a module of its own (its weights sliced out of the scanned stack)."""
    from flax import nnx

    from glmjax.model.transformer import layer_slots

    stack, unit, pos = layer_slots(model.cfg)[i]
    graphdef, state = nnx.split(model.stacks[stack].units)
    return nnx.merge(graphdef, jax.tree.map(lambda a: a[unit], state)).layers[pos]


def ppo_config(size: str, steps: int | None = None) -> ml_collections.ConfigDict:
    """configs/ppo_tiny.py (supervised warm-up, then critic PPO with asynchronous rollouts on single-digit sums)
    for a size preset. steps: PPO steps; None = the preset's."""
    from configs import ppo_tiny

    c = ppo_tiny.get_config()
    if size == "ci":  # 2 layers, a few tiny steps: every code path, no learning to speak of
        c.model.update(num_hidden_layers=2, indexer_types=("full", "shared"), n_routed_experts=8,
                       num_experts_per_tok=2)
        c.ppo.update(steps=4, prompts_per_step=4, group_size=2, sft_steps=40, sft_batch_size=32, eval_every=2,
                     eval_problems=8, eval_samples=2, critic_warmup_steps=1)
        c.optim.warmup_steps = 1
    elif size == "large":  # the same model, 4x the rollouts per step, longer; with several devices the trainer
        # shards its micro-batches over half of them and the rollout worker samples on the next one
        c.ppo.update(steps=300, prompts_per_step=64, sft_steps=100, eval_every=25, eval_problems=128,
                     data_parallel=max(1, jax.device_count() // 2))
    if steps is not None:
        if not isinstance(steps, int) or steps < 1:
            raise ValueError(f"STEPS={steps!r}: must be None or an integer >= 1")
        c.ppo.update(steps=steps, eval_every=max(1, steps // 6),
                     critic_warmup_steps=min(c.ppo.critic_warmup_steps, steps // 4))
    # the optimizers' warm-up must be shorter than their schedules: the actor's runs (steps - critic warm-up steps)
    # x epochs x mini-batches updates, the critic's steps x epochs x mini-batches
    updates = (c.ppo.steps - c.ppo.critic_warmup_steps) * c.ppo.ppo_epochs * c.ppo.minibatches
    c.optim.warmup_steps = min(c.optim.warmup_steps, updates // 5)
    return c
