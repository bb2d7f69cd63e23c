"""The PPO trainer's pieces: actor log-probs, the critic (backbone + scalar value head), jitted loss/gradient
functions, exact gradient accumulation over micro-batches and data-parallel devices, and the optimizers.

Alignment (RL_NOTES 5, verl #1758): arrays are indexed by *token* position i of the prompt+response sequence. The
policy's log-prob of token i and the critic's value V(s_i) of the state before token i are both read from the final
hidden state at position i-1; position 0 (BOS) has neither.
"""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from glmjax.model import GLM, Batch
from glmjax.model.transformer import map_position_chunks, shift_left
from glmjax.optim import build_optimizer, make_schedule, validate_optim_config
from glmjax.rl.losses import PolicyLossConfig, kl_k3, policy_loss, value_loss

f32 = jnp.float32

# What RL trains. The indexer is frozen (GLM-5; its top-k is not differentiable), the MTP layer gets no RL loss, and
# the critic does not use the LM head: leaving them out keeps weight decay from eroding them.
ACTOR_TRAINABLE = nnx.All(nnx.Param, nnx.Not(nnx.PathContains("indexer")), nnx.Not(nnx.PathContains("mtp")))
CRITIC_TRAINABLE = nnx.All(ACTOR_TRAINABLE, nnx.Not(nnx.PathContains("lm_head")))


def token_logprobs(h, head, tokens, temperature: float, chunk: int):
    """Final hidden h [B,S,D], LM head [D,V], tokens [B,S] -> (log-prob of token i under softmax(logits_{i-1} / T),
    entropy of that distribution), both [B,S] f32 with 0 at i = 0. Computed `chunk` positions at a time under remat,
    so the [B,S,V] logits never exist. The temperature matches the sampler's log-probs."""

    def one(args, head):
        hc, tc = args
        logits = jnp.einsum("bcd,dv->bcv", hc, head.astype(hc.dtype), preferred_element_type=f32) / temperature
        logp_all = jax.nn.log_softmax(logits, axis=-1)
        lp = jnp.take_along_axis(logp_all, tc[..., None], axis=-1)[..., 0]
        return lp, -jnp.sum(jnp.exp(logp_all) * logp_all, axis=-1)

    # position i-1 predicts token i; all S positions are mapped (the last one's output is dropped), so the sequence
    # keeps its length (a context-parallel mesh splits it evenly)
    lp, ent = map_position_chunks(one, h, shift_left(tokens, 1, 0), chunk, head)
    first = lambda x: jnp.pad(x[:, :-1], ((0, 0), (1, 0)))  # noqa: E731  (no prediction for position 0)
    return first(lp), first(ent)


def init_value_head(hidden_size: int) -> dict:
    """Zero-initialised scalar head: every value starts at 0 (a cold critic cannot blow up the first updates)."""
    return {"w": jnp.zeros((hidden_size,), f32), "b": jnp.zeros((), f32)}


def state_values(model: GLM, head: dict, batch: Batch, mode: str):
    """V of the state after token i, read at position i -> [B,S] f32."""
    h, _ = model(batch, mode)
    return jnp.einsum("bsd,d->bs", h.astype(f32), head["w"]) + head["b"]


def before(v):
    """Values of the states after each token [B,S] -> V(s_i) of the states before each token i (0 at i = 0)."""
    return jnp.pad(v[:, :-1], ((0, 0), (1, 0)))


def critic_values(model: GLM, head: dict, batch: Batch, mode: str):
    """V(s_i) of the state before token i, read at position i-1 -> [B,S] f32 (0 at i = 0)."""
    return before(state_values(model, head, batch, mode))


def as_batch(mb: dict) -> Batch:
    return Batch(mb["tokens"], mb["segment_ids"], mb["positions"])


class PPOFunctions:
    """Jitted forward passes and per-micro-batch (loss-sum, gradient) functions. Losses are sum(loss * weights) with
    the global per-token weights of `losses.loss_weights`, so gradients add up exactly across micro-batches."""

    def __init__(self, actor_graphdef, critic_graphdef, mode: str, temperature: float, chunk: int,
                 ploss: PolicyLossConfig, entropy_coef: float, kl_coef: float, value_clip: float):
        self.actor_graphdef, self.critic_graphdef = actor_graphdef, critic_graphdef
        self.mode, self.temperature, self.chunk = mode, temperature, chunk
        self.ploss, self.entropy_coef, self.kl_coef, self.value_clip = ploss, entropy_coef, kl_coef, value_clip
        self.logprobs = jax.jit(self._logprobs)
        self.values = jax.jit(self._values)
        self.actor_grads = jax.jit(jax.grad(self._actor_loss, has_aux=True))
        self.critic_grads = jax.jit(jax.grad(self._critic_loss, argnums=(0, 2), has_aux=True))

    def _logprobs(self, params, rest, mb):
        model = nnx.merge(self.actor_graphdef, params, rest)
        h, _ = model(as_batch(mb), self.mode)
        return token_logprobs(h, model.lm_head[...], mb["tokens"], self.temperature, self.chunk)[0]

    def _values(self, params, rest, head, mb):
        """-> [B,S]: V of the state after token i (`before` shifts them to the states before the tokens)."""
        return state_values(nnx.merge(self.critic_graphdef, params, rest), head, as_batch(mb), self.mode)

    def _actor_loss(self, params, rest, mb):
        model = nnx.merge(self.actor_graphdef, params, rest)
        h, _ = model(as_batch(mb), self.mode)
        logp, ent = token_logprobs(h, model.lm_head[...], mb["tokens"], self.temperature, self.chunk)
        pl, info = policy_loss(logp, mb["old_logp"], mb["rollout_logp"], mb["advantages"], self.ploss)
        w = mb["weights"]
        total = pl - self.entropy_coef * ent
        sums = {"policy_loss": jnp.sum(pl * w), "entropy": jnp.sum(ent * w), "clip_or_mask_frac": jnp.sum(info * w),
                "approx_kl_old": jnp.sum(0.5 * (logp - mb["old_logp"]) ** 2 * w)}
        if self.kl_coef:
            kl = kl_k3(logp, mb["ref_logp"])
            total = total + self.kl_coef * kl
            sums["kl_ref"] = jnp.sum(kl * w)
        return jnp.sum(total * w), sums

    def _critic_loss(self, params, rest, head, mb):
        v = critic_values(nnx.merge(self.critic_graphdef, params, rest), head, as_batch(mb), self.mode)
        vl = value_loss(v, mb["old_values"], mb["returns"], self.value_clip)
        loss = jnp.sum(vl * mb["weights"])
        return loss, {"value_loss": loss}


class Placement:
    """The trainer's devices: a 1-D "data" mesh; micro-batches are sharded over it along the batch axis, parameters
    and optimizer state replicated. Under jit the loss sums are global sums, so the result is independent of the
    number of devices."""

    def __init__(self, n_devices: int = 1):
        self.mesh = jax.sharding.Mesh(np.array(jax.devices()[:n_devices]), ("data",),
                                      axis_types=(jax.sharding.AxisType.Auto,))
        self.data = jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec("data"))
        self.replicated = jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec())

    def shard(self, arrays: dict) -> dict:
        return {k: jax.device_put(v, self.data) for k, v in arrays.items()}

    def replicate(self, tree):
        return jax.device_put(tree, self.replicated)


_tree_add = jax.jit(lambda a, b: jax.tree.map(jnp.add, a, b))


def accumulate(grad_fn: Callable, args: tuple, batch: dict, n_micro: int, placement: Placement):
    """Sum grad_fn(*args, micro_batch) -> (grads, metric sums) over `n_micro` equal slices of the rows of `batch`
    (numpy arrays [B, ...]), each sharded over the placement's devices."""
    B = len(next(iter(batch.values())))
    if B % n_micro:
        raise ValueError(f"{B} rows do not split into {n_micro} micro-batches")
    size, total = B // n_micro, None
    for i in range(n_micro):
        out = grad_fn(*args, placement.shard({k: v[i * size:(i + 1) * size] for k, v in batch.items()}))
        total = out if total is None else _tree_add(total, out)
    return total


def forward(fn: Callable, args: tuple, batch: dict, n_micro: int, placement: Placement) -> np.ndarray:
    """fn(*args, micro_batch) -> [b, S] over all rows, micro-batch by micro-batch -> numpy [B, S]."""
    B = len(next(iter(batch.values())))
    size = B // n_micro
    outs = [fn(*args, placement.shard({k: v[i * size:(i + 1) * size] for k, v in batch.items()}))
            for i in range(n_micro)]
    return np.concatenate([np.asarray(o) for o in outs])


def make_apply(tx: optax.GradientTransformation):
    """-> apply(params, opt_state, grads, scale=1.0): one optimizer update, its step multiplied by `scale` (the PPO
    trust region's step-size multiplier; the optimizer's moments are those of the unscaled gradients)."""
    @jax.jit
    def apply(params, opt_state, grads, scale=1.0):
        updates, opt_state = tx.update(grads, opt_state, params)
        updates = jax.tree.map(lambda u: u * jnp.asarray(scale, u.dtype), updates)
        return optax.apply_updates(params, updates), opt_state, optax.tree.norm(grads)

    return apply


def critic_optimizer(backbone_params, opt_cfg: dict, model_cfg, head_lr: float | None = None):
    """The critic's optimizer over (backbone params, value head): the backbone's groups from build_optimizer;
    Adam (no weight decay, its own global-norm clip) for the head, at peak `head_lr` (default: the critic lr) on
    the same schedule."""
    tx_b, table = build_optimizer(backbone_params, opt_cfg, model_cfg)
    o = validate_optim_config(opt_cfg)
    sched = make_schedule(head_lr or o["lr"], o["warmup_steps"], o["total_steps"], o["schedule"], o["end_lr_ratio"])
    tx_h = optax.chain(optax.clip_by_global_norm(o["grad_clip"]) if o["grad_clip"] else optax.identity(),
                       optax.adam(sched, b1=o["b1"], b2=o["b2"], eps=o["eps"]))

    def init(params):
        return tx_b.init(params[0]), tx_h.init(params[1])

    def update(grads, state, params=None):
        ub, sb = tx_b.update(grads[0], state[0], None if params is None else params[0])
        uh, sh = tx_h.update(grads[1], state[1], None if params is None else params[1])
        return (ub, uh), (sb, sh)

    return optax.GradientTransformation(init, update), table


def full_state(graphdef, params, rest):
    """The model's complete state (trainable + frozen params + router biases), the layout `Decoder` expects."""
    return nnx.state(nnx.merge(graphdef, params, rest))

