"""Supervised warm-up on task demonstrations: the model's own LM loss (`GLM.loss`, MTP included) with
Batch.loss_mask on the policy's response tokens only (prompt and tool observations are context, not targets).

A stand-in until PPO starts from an SFT checkpoint (`ppo.init_checkpoint` + a params loader); also used by the tests
to get a policy that solves part of the task, which is where PPO has something to improve.
"""
from __future__ import annotations

from typing import Callable

import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm import tqdm

from glmjax.model import GLM, Batch
from glmjax.optim import build_optimizer
from glmjax.train.step import make_train_step, split_model

Episode = tuple  # (prompt tokens, response tokens, response loss mask), as env.run_script returns


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
    optimizer at peak `lr` (10% warmup, then the config's schedule): the `sft` stage's train step (everything but
    the indexers, LM + MTP loss on the masked tokens; router biases stay). -> the loss of every step."""
    graphdef, params, rest = split_model(model, "model")
    tx, _ = build_optimizer(params, {**optim_cfg, "lr": lr, "muon_lr": None, "total_steps": steps,
                                     "warmup_steps": steps // 10}, model.cfg)
    opt_state = tx.init(params)
    step = make_train_step(graphdef, tx, "sft", mode, bias_rate=0.0)

    rng, losses = np.random.default_rng(seed), []
    for i in tqdm(range(steps), desc="sft warm-up", disable=not progress, dynamic_ncols=True):
        batch = pack_episodes([episode(rng) for _ in range(batch_size)], seq_len, pad_id)
        params, rest, opt_state, m = step(params, rest, opt_state, batch, jnp.int32(i))
        losses.append(float(m["loss"]))
    nnx.update(model, params, rest)
    return losses
