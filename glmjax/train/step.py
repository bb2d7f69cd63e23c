"""Optimizer, trainable-parameter split, and the train / eval steps (functional: state in, state out).

`train_step_fn` is the one train step: the trainer (`make_train_step`), the AOT tool (glmjax/train/aot.py), the
supervised PPO warm-up and the sharding tests all run it."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from glmjax.model.transformer import GLM, Batch
from glmjax.optim import GroupTable, build_optimizer
from glmjax.train.router_bias import update_router_bias
from glmjax.train.stages import STAGES, TRAINABLE, Stage


def split_model(model: GLM, trainable: str = "model"):
    """-> graphdef, trainable params (nnx.State), everything else (frozen params, router biases).
    trainable: "model" = every Param but the indexers' (the LM loss never reaches them: top-k is not
    differentiable and dense mode does not run them; freezing keeps weight decay off them), "indexer", "all"."""
    return nnx.split(model, TRAINABLE[trainable], ...)


def count_params(state) -> int:
    return sum(x.size for x in jax.tree.leaves(state))


def make_optimizer(params, optim_cfg, steps: int, model_cfg) -> tuple[optax.GradientTransformation, GroupTable]:
    """The config's optimizer (AdamW / Muon / Muon-Split, glmjax.optim) over `params`; its schedules end at `steps`."""
    return build_optimizer(params, {**optim_cfg.to_dict(), "total_steps": steps}, model_cfg)


def load_stats(expert_load):
    """Mean over MoE layers of max(load)/mean(load): 1.0 = perfectly balanced."""
    load = expert_load.astype(jnp.float32)
    return jnp.mean(jnp.max(load, -1) / jnp.maximum(jnp.mean(load, -1), 1e-9))


def jit_step(fn, mesh=None, state=None, donate: bool = True):
    """jax.jit of fn(*state, batch, *scalars): a train step (state = params, rest, opt_state; donated; takes the step
    number) or an eval step (state = params, rest). With a mesh: explicit shardings from the arrays of `state`
    (`glmjax.parallel.shard_train_step` / `shard_eval_step`)."""
    if mesh is None:
        return jax.jit(fn, donate_argnums=tuple(range(len(state) if state is not None else 3)) if donate else ())
    from glmjax.parallel import shard_eval_step, shard_train_step

    if len(state) == 3:
        return shard_train_step(fn, mesh, *state, extra_args=1, donate=donate)
    return shard_eval_step(fn, mesh, *state)


def train_step_fn(graphdef, tx, stage: Stage | str, mode: str, bias_rate: float, index_loss_weight: float = 1.0,
                  inject_nan_at: int | None = None):
    """-> the pure (unjitted) train step of `stage`, the one the trainer runs:
    train_step(params, rest, opt_state, batch, step) -> (params, rest, opt_state, metrics). Jit it with
    `make_train_step`, or lower it ahead of time (glmjax/train/aot.py).

    Gradients reach the stage's trainable parameters (`params`; `split_model(model, stage.trainable)`), the loss
    has the stage's weights, and stages that move the router bias update it from the step's (global) expert load.
    A step whose loss or gradient norm is not finite changes nothing (params, optimizer state and router biases
    stay as they were) and reports metrics["skipped"] = 1. inject_nan_at (tests only) multiplies the loss of that
    step by NaN."""
    stage = STAGES[stage] if isinstance(stage, str) else stage
    weights = dict(lm_weight=stage.lm_weight, index_loss_weight=index_loss_weight if stage.index_loss else 0.0)

    def train_step(params, rest, opt_state, batch: Batch, step):
        def loss_fn(p):
            loss, m = nnx.merge(graphdef, p, rest).loss(batch, mode, **weights)
            if inject_nan_at is not None:
                loss = loss * jnp.where(step == inject_nan_at, jnp.nan, 1.0)
            return loss, m

        (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        metrics["loss"] = loss
        metrics["grad_norm"] = optax.tree.norm(grads)
        ok = jnp.isfinite(loss) & jnp.isfinite(metrics["grad_norm"])
        updates, new_opt = tx.update(grads, opt_state, params)
        new_params = optax.apply_updates(params, updates)
        new_rest = rest
        load = metrics.pop("expert_load", None)
        if load is not None:
            metrics["load_imbalance"] = load_stats(load)
            if stage.moves_router_bias:
                model = nnx.merge(graphdef, new_params, rest, copy=True)  # the bias update must not touch `rest`
                update_router_bias(model, load, bias_rate)
                _, new_params, new_rest = nnx.split(model, TRAINABLE[stage.trainable], ...)
        keep = functools.partial(jax.tree.map, lambda new, old: jnp.where(ok, new, old))
        metrics["skipped"] = 1 - ok.astype(jnp.int32)
        return keep(new_params, params), keep(new_rest, rest), keep(new_opt, opt_state), metrics

    return train_step


def make_train_step(graphdef, tx, stage: Stage | str, mode: str, bias_rate: float, index_loss_weight: float = 1.0,
                    inject_nan_at: int | None = None, mesh=None, state=None):
    """-> `train_step_fn(...)` jitted, donating the state (with `mesh`: explicit shardings from
    state = (params, rest, opt_state), see `jit_step`)."""
    return jit_step(train_step_fn(graphdef, tx, stage, mode, bias_rate, index_loss_weight, inject_nan_at), mesh, state)


def make_eval_step(graphdef, stage: Stage | str, mode: str, mesh=None, state=None):
    """-> eval_step(params, rest, batch) -> sums for exact token means: LM NLL, MTP loss, and for stages with an
    indexer loss the indexer KL plus (dense diagnostics) the indexer's top-k recall of the attention's own top-k
    and the adjacent-layer top-k overlaps."""
    stage = STAGES[stage] if isinstance(stage, str) else stage

    def eval_step(params, rest, batch: Batch):
        model = nnx.merge(graphdef, params, rest)
        _, m = model.loss(batch, mode, index_loss_weight=1.0 if stage.index_loss else 0.0)
        out = {k: m[k] for k in ("lm_nll_sum", "lm_tokens", "mtp_loss", "index_kl") if k in m}
        if stage.index_loss:
            out.update(topk_stats(model, batch))
        return out

    return jit_step(eval_step, mesh, state, donate=False)


def topk_stats(model: GLM, batch: Batch) -> dict:
    """Dense-attention diagnostics of the DSA indexers: "topk_recall" = mean over full layers of
    |indexer top-k ∩ attention top-k| / |attention top-k| (the attention's own top-k: the k keys with the largest
    head-mean probability), and "adjacent_overlap" = mean over neighbouring layers of the overlap of their attention
    top-k sets (how much IndexShare's reuse loses)."""
    _, aux = model(batch, "dense", topk_stats=True)
    attn, index = aux.attn_topk, aux.index_topk  # the only read of the model's top-k sets
    full = model.cfg.full_layers
    return {"topk_recall": jnp.mean(topk_overlap(index, attn[jnp.asarray(full)])),
            "adjacent_overlap": jnp.mean(topk_overlap(attn[1:], attn[:-1]))}


def topk_overlap(a, b):
    """Overlap of index sets a, b [..., B, S, k] (same leading shape; -1 = empty slot; a row's indices distinct) as
    |a ∩ b| / |b| averaged over query rows with a non-empty b -> [...]. Each b index is looked up in its row of a,
    sorted: O(S·k log k) work and O(S·k) memory (never a [S,T] membership mask)."""
    lead = a.shape[:-1]
    sa = jnp.sort(jnp.where(a < 0, jnp.iinfo(jnp.int32).max, a.astype(jnp.int32)), axis=-1).reshape(-1, a.shape[-1])
    fb = b.astype(jnp.int32).reshape(-1, b.shape[-1])
    pos = jnp.minimum(jax.vmap(jnp.searchsorted)(sa, fb), sa.shape[-1] - 1)
    found = jnp.take_along_axis(sa, pos, axis=-1) == fb  # a holds no negative entries
    inter = jnp.sum(found, axis=-1).reshape(lead)
    size = jnp.sum(b >= 0, axis=-1)
    rows = jnp.maximum(jnp.sum(size > 0, axis=(-2, -1)), 1)
    return jnp.sum(jnp.where(size > 0, inter / jnp.maximum(size, 1), 0.0), axis=(-2, -1)) / rows
