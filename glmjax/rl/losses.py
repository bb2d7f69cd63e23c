"""Per-token PPO losses and their exact aggregation.

Every loss here is *unreduced*: one value per token [B,T]. The batch loss is sum(loss * weight), with per-token
weights computed once over the whole optimizer mini-batch (`loss_weights`: the global token count, or the global
sequence count and each sequence's length). Summing sum(loss * weight) -- and its gradient -- over any split into
micro-batches or data-parallel shards gives exactly the full-batch mean: no per-micro-batch or per-device mean
ever exists (the pitfall RL_NOTES 2 records in peers).

Policy losses (rho = importance ratio, A = advantage, eps_lo / eps_hi = clip range):
  ppo_clip         rho = pi_theta / pi_old (old = trainer log-probs recomputed before this step's updates);
                   L = max(-rho A, -clip(rho, 1-eps_lo, 1+eps_hi) A); dual clip c > 1: L = min(L, -c A) for A < 0.
  async_two_sided  GLM-5's asynchronous variant: rho = pi_theta / pi_rollout (the stored sampler log-probs, no
                   recomputation); keep = 1[1-eps_lo <= rho <= 1+eps_hi] (no gradient through it); L = -keep rho A.
                   A token outside the band gets *no* gradient at all -- unlike clipping, which keeps the pessimistic
                   branch (e.g. A > 0 with rho < 1-eps_lo still pushes rho up).
  icepop           the ppo_clip term weighted by k = pi_old / pi_rollout (trainer vs sampler at the same weights)
                   where icepop_low <= k <= icepop_high, and 0 outside: tokens the two engines disagree on are dropped.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

f32 = jnp.float32
POLICY_LOSSES = ("ppo_clip", "async_two_sided", "icepop")
AGGREGATIONS = ("token_mean", "seq_mean_token_mean")


class PolicyLossConfig(NamedTuple):
    mode: str = "ppo_clip"
    clip_low: float = 0.2
    clip_high: float = 0.2
    dual_clip: float | None = None  # c > 1, or None
    icepop_low: float = 0.5
    icepop_high: float = 2.0


def ppo_clip_terms(ratio, adv, clip_low, clip_high, dual_clip):
    """-> (per-token loss, 1 where the clipped branch is the active one)."""
    unclipped = -ratio * adv
    clipped = -jnp.clip(ratio, 1.0 - clip_low, 1.0 + clip_high) * adv
    loss = jnp.maximum(unclipped, clipped)
    if dual_clip is not None:
        loss = jnp.where(adv < 0, jnp.minimum(loss, -dual_clip * adv), loss)
    return loss, (clipped > unclipped).astype(f32)


def policy_loss(logp, old_logp, rollout_logp, adv, cfg: PolicyLossConfig):
    """logp (differentiable), old_logp, rollout_logp, adv: [B,T] -> (loss [B,T], info [B,T]): info is the clip
    indicator (ppo_clip), the out-of-band indicator (async_two_sided) or the dropped-by-IcePop indicator (icepop)."""
    old_logp, rollout_logp, adv = (jax.lax.stop_gradient(jnp.asarray(x, f32)) for x in (old_logp, rollout_logp, adv))
    logp = logp.astype(f32)
    if cfg.mode == "ppo_clip":
        return ppo_clip_terms(jnp.exp(logp - old_logp), adv, cfg.clip_low, cfg.clip_high, cfg.dual_clip)
    if cfg.mode == "async_two_sided":
        ratio = jnp.exp(logp - rollout_logp)
        keep = jax.lax.stop_gradient((ratio >= 1.0 - cfg.clip_low) & (ratio <= 1.0 + cfg.clip_high))
        return -jnp.where(keep, ratio * adv, 0.0), (~keep).astype(f32)
    if cfg.mode == "icepop":
        k = jnp.exp(old_logp - rollout_logp)
        inside = (k >= cfg.icepop_low) & (k <= cfg.icepop_high)
        loss, _ = ppo_clip_terms(jnp.exp(logp - old_logp), adv, cfg.clip_low, cfg.clip_high, cfg.dual_clip)
        return jnp.where(inside, k, 0.0) * loss, (~inside).astype(f32)
    raise ValueError(f"policy loss {cfg.mode!r}: must be one of {POLICY_LOSSES}")


def value_loss(values, old_values, returns, clip: float | None):
    """0.5 max((v - G)^2, (v_old + clip(v - v_old, -clip, clip) - G)^2) per token; clip None/0 -> 0.5 (v - G)^2."""
    old_values, returns = jax.lax.stop_gradient(old_values), jax.lax.stop_gradient(returns)
    loss = (values - returns) ** 2
    if clip:
        v_clipped = old_values + jnp.clip(values - old_values, -clip, clip)
        loss = jnp.maximum(loss, (v_clipped - returns) ** 2)
    return 0.5 * loss


def kl_k3(logp, ref_logp):
    """Per-token KL(pi_theta || pi_ref) estimate exp(r) - r - 1 with r = ref - logp (>= 0, unbiased)."""
    r = jax.lax.stop_gradient(ref_logp) - logp
    return jnp.exp(r) - r - 1.0


def loss_weights(mask, agg: str) -> np.ndarray:
    """Per-token weights [B,T] over the *whole* mini-batch such that sum(loss * weights) is its aggregated loss.
    token_mean: 1/N_tokens on every loss token (every token weighs the same). seq_mean_token_mean: the mean over
    sequences of each sequence's token mean (1 / (len_b * N_sequences)); rows without loss tokens count for nothing."""
    mask = np.asarray(mask, np.float64)
    if agg == "token_mean":
        w = mask / max(mask.sum(), 1.0)
    elif agg == "seq_mean_token_mean":
        lengths = mask.sum(axis=1, keepdims=True)
        w = mask / np.maximum(lengths, 1.0) / max(int((lengths > 0).sum()), 1)
    else:
        raise ValueError(f"loss aggregation {agg!r}: must be one of {AGGREGATIONS}")
    return w.astype(np.float32)
