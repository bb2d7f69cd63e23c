"""Optimizer, trainable-parameter split, and the jitted train / eval steps (functional: state in, state out)."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from glmjax.model.transformer import GLM, Batch
from glmjax.optim import GroupTable, build_optimizer
from glmjax.train.router_bias import update_router_bias

# What the LM loss trains: every nnx.Param except the indexers'. Top-k selection is not differentiable and dense
# mode does not run the indexer, so the LM loss never reaches indexer weights (SPEC E.3); they train only from
# the indexer KL loss of the DSA stages. Freezing them here keeps weight decay from shrinking them meanwhile.
TRAINABLE = nnx.All(nnx.Param, nnx.Not(nnx.PathContains("indexer")))


def split_model(model: GLM):
    """-> graphdef, trainable params (nnx.State), everything else (frozen params, router biases)."""
    return nnx.split(model, TRAINABLE, ...)


def count_params(state) -> int:
    return sum(x.size for x in jax.tree.leaves(state))


def make_optimizer(params, optim_cfg, steps: int, model_cfg) -> tuple[optax.GradientTransformation, GroupTable]:
    """The config's optimizer (AdamW / Muon / Muon-Split, glmjax.optim) over `params`; its schedules end at `steps`."""
    return build_optimizer(params, {**optim_cfg.to_dict(), "total_steps": steps}, model_cfg)


def load_stats(expert_load):
    """Mean over MoE layers of max(load)/mean(load): 1.0 = perfectly balanced."""
    load = expert_load.astype(jnp.float32)
    return jnp.mean(jnp.max(load, -1) / jnp.maximum(jnp.mean(load, -1), 1e-9))


def make_train_step(graphdef, tx, mode: str, bias_rate: float):
    @functools.partial(jax.jit, donate_argnums=(0, 1, 2))
    def train_step(params, rest, opt_state, batch: Batch):
        def loss_fn(p):
            return nnx.merge(graphdef, p, rest).loss(batch, mode)

        (_, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        metrics["grad_norm"] = optax.tree.norm(grads)
        load = metrics.pop("expert_load", None)
        if load is not None:
            model = nnx.merge(graphdef, params, rest)
            update_router_bias(model, load, bias_rate)
            _, params, rest = split_model(model)
            metrics["load_imbalance"] = load_stats(load)
        return params, rest, opt_state, metrics

    return train_step


def make_eval_step(graphdef, mode: str):
    @jax.jit
    def eval_step(params, rest, batch: Batch):
        _, m = nnx.merge(graphdef, params, rest).loss(batch, mode)
        out = {"lm_nll_sum": m["lm_nll_sum"], "lm_tokens": m["lm_tokens"]}
        if "mtp_loss" in m:
            out["mtp_loss"] = m["mtp_loss"]
        return out

    return eval_step
