"""Training throughput per GLM-5 stage on this machine (tokens/s, median step time), for the tiny and small configs.

    python bench/stages.py [--configs tiny small] [--steps 8] [--out bench/results/stages.json]

Each stage's jitted train step (the trainer's own `make_train_step`: forward, backward, optimizer, router bias) runs
on real batches of the embedded corpus; after 2 warm-up steps (compile) `--steps` steps are timed and the median
is reported, with the ratio to the dense pretrain step measured in the same run. Stages:
pretrain (dense), pretrain (sparse), dense_warmup (dense attention + indexer KL over all keys, indexers only),
sparse_adapt (top-k + KL over the selected keys, all weights), indexshare (the config's Full/Shared pattern).
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from glmjax.config import ModelConfig  # noqa: E402
from glmjax.data import make_pipeline  # noqa: E402
from glmjax.model import GLM  # noqa: E402
from glmjax.train.loop import to_batch  # noqa: E402
from glmjax.train.stages import STAGES  # noqa: E402
from glmjax.train.step import make_optimizer, make_train_step, split_model  # noqa: E402

RUNS = (("pretrain", "dense"), ("pretrain", "sparse"), ("dense_warmup", "dense"), ("sparse_adapt", "sparse"),
        ("indexshare", "sparse"))


def device_state(params, rest, tx):
    """(params, rest, tx.init(params)) committed to the first device, as a jitted step's outputs are. A mix of
    committed arrays (a model from `load_hf` or `jax.device_put`) and uncommitted ones (optax's fresh step counts)
    makes a plain-jit step compile again at its second call, when every input is one of its own outputs."""
    return jax.device_put((params, rest, tx.init(params)), jax.devices()[0])


def plain_jit_step(config, stage: str, mode: str):
    """-> (the trainer's train step under a plain jax.jit on one device, its state `device_state`)."""
    model_cfg = dict(config.model)
    cfg0 = ModelConfig.from_dict(model_cfg)
    if stage != "indexshare":  # the non-IndexShare stages run with an indexer on every layer
        model_cfg["indexer_types"] = ("full",) * cfg0.num_hidden_layers
    cfg = ModelConfig.from_dict(model_cfg)
    graphdef, params, rest = split_model(GLM(cfg, nnx.Rngs(0)), STAGES[stage].trainable)
    tx, _ = make_optimizer(params, config.optim, 1000, cfg)
    return make_train_step(graphdef, tx, stage, mode, config.train.bias_update_rate), device_state(params, rest, tx)


def bench_stage(config, stage: str, mode: str, batches, steps: int) -> float:
    step_fn, (params, rest, opt_state) = plain_jit_step(config, stage, mode)
    times = []
    for i in range(steps + 2):
        t0 = time.perf_counter()
        params, rest, opt_state, m = step_fn(params, rest, opt_state, to_batch(batches[i % len(batches)]),
                                             jnp.int32(i + 1))
        jax.block_until_ready(m["loss"])
        times.append(time.perf_counter() - t0)
    return statistics.median(times[2:])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", nargs="+", default=["tiny", "small"])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--out", default="bench/results/stages.json")
    args = ap.parse_args(argv)
    results = {}
    lines = [f"device: {jax.devices()[0].device_kind} x{jax.device_count()}, {os.cpu_count()} CPU cores; "
             f"median of {args.steps} steps after 2 warm-up steps", "",
             "| config | batch x seq | stage | attention | step (s) | tokens/s | vs dense pretrain |",
             "|---|---|---|---|---:|---:|---:|"]
    for name in args.configs:
        config = importlib.import_module(f"configs.{name}").get_config()
        t = config.train
        data = make_pipeline(config.data, t.seq_len, t.batch_size, 0, "train")
        batches = data.take(4)
        tokens = float(np.mean([np.sum(b["segment_ids"] > 0) for b in batches]))
        base = None
        for stage, mode in RUNS:
            sec = bench_stage(config, stage, mode, batches, args.steps)
            base = base or sec
            results[f"{name}/{stage}/{mode}"] = {"step_s": sec, "tokens_per_s": tokens / sec}
            lines.append(f"| {name} | {t.batch_size}x{t.seq_len} | {stage} | {mode} | {sec:.3f} | "
                         f"{tokens / sec:,.0f} | {base / sec:.2f}x |")
            print(lines[-1], flush=True)
    print("\n".join(lines))
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
