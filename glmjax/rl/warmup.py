"""Supervised warm-up on task demonstrations: the model's own LM loss (`GLM.loss`, MTP included) with
Batch.loss_mask on the policy's response tokens only (prompt and tool observations are context, not targets).

A stand-in until PPO starts from an SFT checkpoint (`ppo.init_checkpoint` + a params loader); also used by the tests
to get a policy that solves part of the task, which is where PPO has something to improve.
"""
from __future__ import annotations

from typing import Callable

import jax
import numpy as np
import optax
from flax import nnx
from tqdm import tqdm

from glmjax.model import GLM, Batch
from glmjax.optim import build_optimizer

Episode = tuple  # (prompt tokens, response tokens, response loss mask), as env.run_script returns
SFT_TRAINABLE = nnx.All(nnx.Param, nnx.Not(nnx.PathContains("indexer")))


def pack_episodes(episodes, seq_len: int, pad_id: int) -> Batch:
    """One episode per row, right-padded: tokens, segment_ids (1 on the episode, 0 on padding), positions, and
    loss_mask = 1 on the response tokens the policy produced."""
    B = len(episodes)
    tok = np.full((B, seq_len), pad_id, np.int32)
    seg = np.zeros((B, seq_len), np.int32)
    mask = np.zeros((B, seq_len), np.int32)
    for b, (prompt, response, m) in enumerate(episodes):
        n = len(prompt) + len(response)
        if n > seq_len:
            raise ValueError(f"episode of {n} tokens > seq_len={seq_len}")
        tok[b, :n] = list(prompt) + list(response)
        seg[b, :n] = 1
        mask[b, len(prompt):n] = m
    pos = np.broadcast_to(np.arange(seq_len, dtype=np.int32), (B, seq_len))
    return Batch(tok, seg, np.ascontiguousarray(pos), mask)


def supervised_warmup(model: GLM, episode: Callable[[np.random.Generator], Episode], steps: int, batch_size: int,
                      seq_len: int, optim_cfg: dict, lr: float, mode: str, pad_id: int, seed: int = 0,
                      progress: bool = False) -> list[float]:
    """Train `model` in place for `steps` steps on batches of `episode(rng)` demonstrations with the config's
    optimizer at peak `lr` (10% warmup, then the config's schedule). -> the loss of every step."""
    graphdef, params, rest = nnx.split(model, SFT_TRAINABLE, ...)
    tx, _ = build_optimizer(params, {**optim_cfg, "lr": lr, "muon_lr": None, "total_steps": steps,
                                     "warmup_steps": steps // 10}, model.cfg)
    opt_state = tx.init(params)

    @jax.jit
    def step(params, opt_state, batch):
        (loss, _), grads = jax.value_and_grad(lambda p: nnx.merge(graphdef, p, rest).loss(batch, mode),
                                              has_aux=True)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    rng, losses = np.random.default_rng(seed), []
    for _ in tqdm(range(steps), desc="sft warm-up", disable=not progress, dynamic_ncols=True):
        batch = pack_episodes([episode(rng) for _ in range(batch_size)], seq_len, pad_id)
        params, opt_state, loss = step(params, opt_state, batch)
        losses.append(float(loss))
    nnx.update(model, params)
    return losses
