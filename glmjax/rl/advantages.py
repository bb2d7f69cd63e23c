"""Advantage estimators on per-token arrays [B,T] (T = token index of the whole prompt+response sequence).

`mask` marks the tokens the policy produced (the loss tokens). Everything else -- prompt, padding, tool/environment
observations -- is *skipped*: the reverse scan carries the bootstrap value and the running advantage straight over
it, so a tool observation neither discounts nor bootstraps (RL_NOTES 1). Rewards must sit on mask tokens (the task
reward on the last policy token); values at masked positions are never read.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

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


def episode_rows(episode, segment) -> np.ndarray:
    """The rows of each episode in sub-trajectory order: episode [B] ids, segment [B] the row's index within its
    episode (0, 1, ...) -> [E, K] row indices, -1 after an episode's last sub-trajectory (E episodes, in order of
    first appearance; K the most sub-trajectories of one). ValueError for a repeated or missing segment index."""
    episode, segment = np.asarray(episode), np.asarray(segment)
    ids = list(dict.fromkeys(episode.tolist()))
    out = np.full((len(ids), int(segment.max(initial=0)) + 1), -1, np.int64)
    for e, i in enumerate(ids):
        rows = np.flatnonzero(episode == i)
        order = np.sort(segment[rows])
        if not np.array_equal(order, np.arange(len(rows))):
            raise ValueError(f"episode {i}: sub-trajectory indices {order.tolist()}, not 0..{len(rows) - 1}")
        out[e, segment[rows]] = rows
    return out


def episode_gae(rewards, values, mask, chains, gamma: float, lam: float, bootstrap=None):
    """`gae` over whole episodes whose sub-trajectories are rows (compaction, docs/ppo.md): chains [E,K] (from
    `episode_rows`; every row in one chain; jit-able). Each episode's rows are laid end to end and `gae` runs over
    the result, so the last policy token of sub-trajectory j bootstraps from V at the first policy token of j+1 and
    its advantage continues from there (the prompt of j+1 is skipped as any non-policy token is); a reward counts
    once, where it sits. bootstrap [E]: V after the episode's last token (a truncated episode), None: 0. ->
    (advantages, returns) [B,T], equal to `gae` on the uncompacted episode when compaction keeps everything."""
    rewards, values, mask = (jnp.asarray(x, f32) for x in (rewards, values, mask))
    (B, T), (E, K) = rewards.shape, chains.shape
    idx = jnp.where(jnp.asarray(chains) >= 0, jnp.asarray(chains), B).reshape(-1)  # row B: zeros, no policy token
    laid = [jnp.concatenate([x, jnp.zeros((1, T), f32)])[idx].reshape(E, K * T) for x in (rewards, values, mask)]
    adv, ret = gae(*laid, gamma, lam, bootstrap)
    rows = [jnp.zeros((B + 1, T), f32).at[idx].set(x.reshape(E * K, T))[:B] for x in (adv, ret)]
    return rows[0], rows[1]


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


def episode_grpo(scores, group_ids, chains, mask, use_std: bool = True) -> np.ndarray:
    """`grpo` with one baseline per episode: an episode compacted into several rows (chains [E,K] from
    `episode_rows`) counts once in its group's mean and std, whatever its number of sub-trajectories; its advantage
    is broadcast over the policy tokens of all its rows. scores, group_ids [B] per row (the episode's) -> [B,T]."""
    chains = np.asarray(chains)
    first = chains[:, 0]
    per_episode = np.asarray(grpo(np.asarray(scores)[first], np.asarray(group_ids)[first],
                                  np.ones((len(first), 1), np.float32), use_std))[:, 0]
    of_row = np.zeros(len(scores), np.int64)
    of_row[chains[chains >= 0]] = np.nonzero(chains >= 0)[0]
    return per_episode[of_row][:, None] * np.asarray(mask, np.float32)


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
