"""Advantage estimators on per-token arrays [B,T] (T = token index of the whole prompt+response sequence).

`mask` marks the tokens the policy produced (the loss tokens). Everything else -- prompt, padding, tool/environment
observations -- is *skipped*: the reverse scan carries the bootstrap value and the running advantage straight over
it, so a tool observation neither discounts nor bootstraps (RL_NOTES 1). Rewards must sit on mask tokens (the task
reward on the last policy token); values at masked positions are never read.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

f32 = jnp.float32


def gae(rewards, values, mask, gamma: float, lam: float, bootstrap=None):
    """Token-level GAE: delta_t = r_t + gamma V_next - V_t, A_t = delta_t + gamma lam A_next, where "next" is the next
    mask token of the same row; after the last one V_next = bootstrap[b] (None: 0, the episode ended there; a row
    cut off before its end -- truncated -- passes V of the state at the cut) and A_next = 0. -> (advantages,
    returns = A + V), both [B,T] f32 and 0 off the mask. Returns are formed here, before any whitening."""
    rewards, values, mask = (jnp.asarray(x, f32) for x in (rewards, values, mask))

    def step(carry, x):
        next_v, next_a = carry
        r, v, m = x
        a = r + gamma * next_v - v + gamma * lam * next_a
        keep = m > 0
        return (jnp.where(keep, v, next_v), jnp.where(keep, a, next_a)), jnp.where(keep, a, 0.0)

    zeros = jnp.zeros(rewards.shape[0], f32)
    last_v = zeros if bootstrap is None else jnp.asarray(bootstrap, f32)
    _, adv = jax.lax.scan(step, (last_v, zeros), (rewards.T, values.T, mask.T), reverse=True)
    adv = adv.T
    return adv, (adv + values) * mask


def grpo(scores, group_ids, mask, use_std: bool = True, eps: float = 1e-6):
    """Group-relative advantages: A_i = (R_i - mean_group R) / (std_group R + eps) (Dr.GRPO: use_std=False, no
    division), broadcast over the sequence's mask tokens. scores [B] (sequence rewards), group_ids [B] int,
    mask [B,T] -> [B,T] f32."""
    scores = jnp.asarray(scores, f32)
    group_ids = jnp.asarray(group_ids)
    same = (group_ids[:, None] == group_ids[None, :]).astype(f32)  # [B,B]
    n = jnp.sum(same, axis=1)
    mean = same @ scores / n
    adv = scores - mean
    if use_std:
        var = same @ (scores ** 2) / n - mean ** 2
        adv = adv / (jnp.sqrt(jnp.maximum(var, 0.0)) + eps)
    return adv[:, None] * jnp.asarray(mask, f32)


def masked_whiten(x, mask, eps: float = 1e-8):
    """(x - mean) / std over the mask tokens of the whole array (call it on the global batch, never per shard);
    0 off the mask."""
    x, mask = jnp.asarray(x, f32), jnp.asarray(mask, f32)
    n = jnp.maximum(jnp.sum(mask), 1.0)
    mean = jnp.sum(x * mask) / n
    var = jnp.sum(((x - mean) * mask) ** 2) / n
    return (x - mean) * jax.lax.rsqrt(var + eps) * mask


def explained_variance(values, returns, mask):
    """1 - Var(G - V) / Var(G) over the mask tokens: 1 = perfect critic, 0 = no better than the mean, < 0 worse;
    NaN when the returns do not vary (nothing to explain)."""
    values, returns, mask = (jnp.asarray(x, f32) for x in (values, returns, mask))
    n = jnp.maximum(jnp.sum(mask), 1.0)

    def var(x):
        mu = jnp.sum(x * mask) / n
        return jnp.sum(((x - mu) * mask) ** 2) / n

    vg = var(returns)
    return jnp.where(vg > 1e-12, 1.0 - var(returns - values) / jnp.maximum(vg, 1e-12), jnp.nan)
