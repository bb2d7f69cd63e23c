"""Aux-loss-free MoE balancing (DeepSeek-V3): after each step, every MoE layer's e_score_correction_bias moves by
`rate * sign(mean_load - load)` -- overloaded experts become less attractive, underloaded ones more.

`model.loss` reports expert load as rows [L_moe, E] in layer order: stacks in order, each stack's units in order,
each unit's MoE layers in order (= increasing layer index), then one row per MTP depth. The bias variables live
stacked per stack and per position j in the unit ([n_units, E]); the MTP layer has one [E] bias shared by its depths.
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from glmjax.model.moe import RouterBias


def router_bias_slots(model) -> list[tuple[RouterBias, np.ndarray, np.ndarray]]:
    """-> [(bias variable, rows, layers)]: `rows` indexes the expert_load rows of that variable, shaped
    var.shape[:-1] + (r,) where the r rows are summed (r = 1 for a stacked layer, mtp_depth for the MTP layer);
    `layers` gives the decoder layer index of each slice (shape var.shape[:-1]; the MTP layer is num_hidden_layers)."""
    slots, row = [], 0
    for plan, stack in zip(model.plans, model.stacks):
        moe_positions = [j for j, (moe, _) in enumerate(plan.kinds) if moe]
        n, m = len(plan.starts), len(moe_positions)
        rows = row + np.arange(n * m).reshape(n, m)  # unit-major, as the scan emits them
        for col, j in enumerate(moe_positions):
            var = stack.units.layers[j].mlp.e_score_correction_bias
            slots.append((var, rows[:, col:col + 1], np.asarray(plan.starts) + j))
        row += n * m
    if model.mtp is not None:
        depth = model.cfg.mtp_depth
        slots.append((model.mtp.layer.mlp.e_score_correction_bias, row + np.arange(depth),
                      np.asarray(model.cfg.num_hidden_layers)))
    return slots


def update_router_bias(model, expert_load, rate: float) -> None:
    """In place (works under jit): bias += rate * sign(mean_load - load) per MoE layer. expert_load [L_moe, E]."""
    if expert_load is None or rate == 0:
        return
    slots = router_bias_slots(model)
    n_rows = sum(rows.size for _, rows, _ in slots)
    if n_rows != expert_load.shape[0]:
        raise ValueError(f"expert_load has {expert_load.shape[0]} rows, the model's MoE layers need {n_rows}")
    for var, rows, _ in slots:
        load = jnp.sum(expert_load[rows], axis=-2).astype(jnp.float32)  # var.shape
        step = rate * jnp.sign(jnp.mean(load, axis=-1, keepdims=True) - load)
        var[...] = var[...] + step.astype(var[...].dtype)
