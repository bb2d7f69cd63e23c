"""`train_ppo`: the PPO post-training stage (critic PPO with token-level GAE, or GRPO), asynchronous rollouts.

    summary = train_ppo(config, workdir)               # config: model, optim (actor), ppo (glmjax/rl/config.py)

One PPO step:
  rollout batch  (from the rollout thread, generated with weights of version v' <= v; or generated here when
                  ppo.async_rollout is False) -> filter_groups: env crashes and samples staler than max_staleness
                  dropped, groups padded or dropped
  forward        trainer log-probs pi_old (also the rollout-vs-trainer mismatch), critic values, reference log-probs
  advantages     GAE (actor lambda) + returns (critic lambda, before whitening), global whitening; or GRPO
  updates        ppo_epochs x minibatches optimizer updates of actor and critic; each gradient is the exact global
                 token mean (or sequence mean) accumulated over micro_batches x data_parallel devices
  weight sync    version v+1 handed to the rollout worker
Metrics go to workdir/metrics.jsonl (one line per step, plus eval lines), interceptions to
workdir/interceptions.jsonl, checkpoints every ppo.checkpoint_every steps to workdir/checkpoints (the stages'
machinery; the same call resumes a killed run: `PPORun.save` / `restore` say what they hold), the final policy to
workdir/policy (ppo.save_policy), and a tqdm bar shows reward / eval accuracy / wait share. Tasks: the built-in
demos, or your prompts JSONL with a reward by import path (glmjax/rl/prompts.py); text goes through ppo.tokenizer's
rule (glmjax/rl/text.py).

`load_params(path, target_state) -> state` plugs in checkpoint loading for ppo.init_checkpoint: it receives the
model's complete nnx.State (as a shape/structure target) and returns one of the same structure (train.py, through
glmjax.launch, passes glmjax.train.init_from.checkpoint_loader). The loop's metrics log, eval and checkpoint hooks
and signal handling are glmjax/train/hooks.py's.
"""
from __future__ import annotations

import json
import math
import os
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from glmjax.config import ConfigError
from glmjax.data.chat import ChatTemplate
from glmjax.data.tokenizer import make_tokenizer
from glmjax.infer import Decoder
from glmjax.model import GLM, mla_paths
from glmjax.optim import build_optimizer, make_schedule, validate_optim_config
from glmjax.resolve import write_import
from glmjax.rl.advantages import episode_gae, episode_grpo, episode_rows, explained_variance, masked_whiten
from glmjax.rl.compaction import Budget, chat_rule, make_budget
from glmjax.rl.config import default_ppo_config, validate_ppo_config
from glmjax.rl.chat_env import ChatToolEnv
from glmjax.rl.env import BYTES, ENVS, SCRIPTS, run_script
from glmjax.rl.interceptor import Interceptor
from glmjax.rl.losses import PolicyLossConfig, loss_weights
from glmjax.rl.rollout import RolloutBatch, RolloutWorker, Sampler, filter_groups
from glmjax.rl.prompts import PromptsTask, TASKS
from glmjax.rl.tasks import REWARDS, resolve_callable, resolve_tools
from glmjax.rl.text import ChatText
from glmjax.rl.trainer import (ACTOR_TRAINABLE, CRITIC_TRAINABLE, Placement, PPOFunctions, accumulate, before,
                               critic_optimizer, forward, full_state, init_value_head, make_apply)
from glmjax.rl.warmup import supervised_warmup
from glmjax.train.checkpoint import CheckpointError, Checkpoints, newest_meta
from glmjax.train.hooks import CheckpointHook, EvalHook, MetricsLog, due, stop_signals
from glmjax.train.loop import prepare_workdir
from glmjax.train.resume import ConfigMismatch, archive_run, check_resume, fingerprint

LoadParams = Callable[[str, nnx.State], nnx.State]


def build_task(p):
    try:
        return TASKS[p.task](**p.task_args.to_dict(), heldout_fraction=p.heldout_fraction)
    except TypeError as e:
        raise ConfigError(f"ppo.task_args={p.task_args.to_dict()!r}: {e}") from e


def build_text(p, vocab_size: int):
    """The token rule of ppo.tokenizer (glmjax/rl/text.py): the byte rule, or the HF tokenizer with its chat template
    (required for the tool environment, which renders every turn with it)."""
    if p.tokenizer == "byte":
        return BYTES
    tok = make_tokenizer(p.tokenizer)
    if tok.vocab_size > vocab_size:
        raise ConfigError(f"ppo.tokenizer={p.tokenizer!r}: its vocab_size {tok.vocab_size} exceeds "
                          f"model.vocab_size={vocab_size}")
    template = None
    if tok.chat_template is not None or p.env == "tool":
        template = ChatTemplate(tok.chat_template, tok.chat_template_file, tok.special_tokens,
                                for_training=p.env == "tool")
    return ChatText(tok, template)


# the ppo section's defaults: a field added since a run's checkpoints were written counts as its default on resume
PPO_DEFAULTS = fingerprint({"ppo": json.loads(default_ppo_config().to_json())})


def env_factory(p, task_reward, interceptor, text=BYTES, tools=None, crash_prob: float | None = None,
                compaction: bool = True):
    """-> make_env(problem, rng) for the configured environment (crash_prob: overrides ppo.env_crash_prob); with
    ppo.context_budget (and `compaction`), each episode's Budget (compaction.py)."""
    crash_prob = p.env_crash_prob if crash_prob is None else crash_prob
    if p.env == "tool" and text is BYTES and p.context_budget and compaction:
        return lambda problem, rng: ENVS["tool"](problem, task_reward, interceptor, p.max_tool_calls, crash_prob,
                                                 rng, tools, budget=make_budget(p.compaction, p.context_budget,
                                                                                p.compaction_headroom, text))
    if p.env == "tool" and text is not BYTES:
        def chat_env(problem, rng):
            env = ChatToolEnv(problem, task_reward, text, interceptor, p.max_tool_calls, crash_prob, rng, tools)
            if p.context_budget and compaction:
                env.budget = Budget(p.context_budget, chat_rule(p.compaction, env), p.compaction_headroom, text)
            return env

        return chat_env
    if p.env == "tool":
        return lambda problem, rng: ENVS["tool"](problem, task_reward, interceptor, p.max_tool_calls, crash_prob,
                                                 rng, tools)
    return lambda problem, rng: ENVS["single_turn"](problem, task_reward, text)


def pack_samples(samples, rows: int, seq_len: int, pad_id: int, segment_advantage: str = "episode") -> dict:
    """Samples -> numpy arrays [rows, seq_len] indexed by token position (rows beyond len(samples) are padding):
    tokens, segment_ids, positions, mask (policy tokens), rollout_logp, rewards (the episode's reward on its last
    policy token: of its last sub-trajectory, or split evenly over every sub-trajectory's under
    segment_advantage="independent"), plus per-row version / group / score, episode / segment (each row of an
    uncompacted episode is an episode of its own), last (position of the row's last token) and truncated (1.0
    where the response hit max_response_len: its advantages bootstrap from V of the state at the cut)."""
    out = {k: np.zeros((rows, seq_len), np.float32) for k in ("mask", "rollout_logp", "rewards")}
    out["tokens"] = np.full((rows, seq_len), pad_id, np.int32)
    out["segment_ids"] = np.zeros((rows, seq_len), np.int32)
    out["positions"] = np.ascontiguousarray(np.broadcast_to(np.arange(seq_len, dtype=np.int32), (rows, seq_len)))
    version = np.full(rows, -1, np.int64)
    group = -1 - np.arange(rows)  # padding rows: groups of their own
    score, truncated = np.zeros(rows, np.float32), np.zeros(rows, np.float32)
    last = np.zeros(rows, np.int32)
    episode, segment = -1 - np.arange(rows), np.zeros(rows, np.int64)  # negative: an episode of its own
    pieces: dict[int, int] = {}
    for s in samples:
        if s.episode >= 0:
            pieces[s.episode] = max(pieces.get(s.episode, 0), s.segment + 1)
    for b, s in enumerate(samples):
        p, n = len(s.prompt), len(s.prompt) + len(s.response)
        out["tokens"][b, :n] = np.concatenate([s.prompt, s.response])
        out["segment_ids"][b, :n] = 1
        out["mask"][b, p:n] = s.loss_mask
        out["rollout_logp"][b, p:n] = s.logprobs
        policy = np.flatnonzero(s.loss_mask)
        n_pieces = pieces.get(s.episode, 1)
        if len(policy) and segment_advantage == "independent":
            out["rewards"][b, p + policy[-1]] = s.reward / n_pieces
        elif len(policy) and s.segment == n_pieces - 1:
            out["rewards"][b, p + policy[-1]] = s.reward
        if s.episode >= 0:
            episode[b], segment[b] = s.episode, s.segment
        version[b], group[b], score[b] = s.version, s.group, s.reward
        last[b], truncated[b] = n - 1, s.status == "truncated"
    return {**out, "version": version, "group": group, "score": score, "last": last, "truncated": truncated,
            "episode": episode, "segment": segment}


@jax.jit
def _gae_both(rewards, after, mask, last, truncated, chains, gamma, lam_actor, lam_critic):
    """after: V of the states after each token [B,S] -> (values of the states before the tokens, 0 off the mask;
    advantages with lam_actor; returns with lam_critic), along each chain of rows (`episode_rows`: an episode's
    sub-trajectories; one row each without compaction). A truncated episode bootstraps from V(after the last token
    of its last row)."""
    values = before(after) * mask
    boot_rows = jnp.take_along_axis(after, last[:, None], axis=1)[:, 0] * truncated
    final = jnp.take_along_axis(chains, jnp.sum(chains >= 0, axis=1, keepdims=True) - 1, axis=1)[:, 0]
    boot = boot_rows[final]
    adv, _ = episode_gae(rewards, values, mask, chains, gamma, lam_actor, boot)
    _, returns = episode_gae(rewards, values, mask, chains, gamma, lam_critic, boot)
    return values, adv, returns


class Learner:
    """The trainer's side: actor (and critic) parameters with their optimizers on the trainer devices, and the PPO
    update on one batch of samples (forward passes, advantages, ppo_epochs x minibatches optimizer updates)."""

    def __init__(self, model: GLM, p, actor_opt: dict, critic_opt: dict, pad_id: int):
        cfg, self.p, self.pad_id = model.cfg, p, pad_id
        self.placement = Placement(p.data_parallel)
        self.graphdef, params, rest = nnx.split(model, ACTOR_TRAINABLE, ...)
        self.params, self.rest = self.placement.replicate((params, rest))
        self.ref_params = self.params  # the policy PPO starts from (KL reference); arrays are never donated
        actor_tx, self.table = build_optimizer(self.params, actor_opt, cfg)
        self.actor_state, self.apply_actor = actor_tx.init(self.params), make_apply(actor_tx)
        self.use_critic = p.advantage == "gae"
        cgraphdef = None
        if self.use_critic:
            cgraphdef, backbone, crest = nnx.split(model, CRITIC_TRAINABLE, ...)
            self.cparams = self.placement.replicate((backbone, init_value_head(cfg.hidden_size)))
            self.crest = self.placement.replicate(crest)
            critic_tx, _ = critic_optimizer(self.cparams[0], critic_opt, cfg)
            self.critic_state, self.apply_critic = critic_tx.init(self.cparams), make_apply(critic_tx)
        self.fns = PPOFunctions(self.graphdef, cgraphdef, p.mode, p.temperature, p.logprob_chunk,
                                PolicyLossConfig(p.policy_loss, p.clip_low, p.clip_high, p.dual_clip, p.icepop_low,
                                                 p.icepop_high), p.entropy_coef, p.kl_coef, p.value_clip)
        self.rng = np.random.default_rng(p.seed + 2)
        self.lr_scale = 1.0  # the multiplier of the actor's learning rate that ppo.step_kl_per_nat steers
        self.entropy_start = None  # pi_old's token entropy at the first actor step (caps step_kl_per_nat's budget)
        o = validate_optim_config(actor_opt)  # the actor's schedule relative to its peak, per optimizer update
        self.schedule = make_schedule(1.0, o["warmup_steps"], o["total_steps"], o["schedule"], o["end_lr_ratio"])
        self.actor_count = 0  # actor updates applied so far (the optimizer's step count)

    def policy_state(self):
        """The actor's complete model state (what the Decoder runs)."""
        return full_state(self.graphdef, self.params, self.rest)

    def checkpoint_state(self) -> tuple[dict, dict, dict]:
        """-> (model, trainer, host), what a checkpoint holds of the learner: the policy's complete state as a pure
        dict (a stage checkpoint's "model": init_from, glmjax-generate read a PPO workdir as a stage's); the other
        arrays (the actor's optimizer state, the reference policy, the critic's parameters, frozen part and
        optimizer state); and its host state (JSON: the mini-batch RNG, the step-size multiplier and what steers it,
        the actor's update count)."""
        trainer = {"actor_opt": self.actor_state, "reference": self.ref_params}
        if self.use_critic:
            trainer["critic"] = {"params": self.cparams, "rest": self.crest, "opt": self.critic_state}
        host = {"rng": self.rng.bit_generator.state, "lr_scale": self.lr_scale, "entropy_start": self.entropy_start,
                "actor_count": self.actor_count}
        return self.policy_state().to_pure_dict(), trainer, host

    def load_checkpoint_state(self, model: dict, trainer: dict, host: dict):
        """The inverse of `checkpoint_state` (arrays restored in the shardings of this learner's own)."""
        state = self.policy_state()
        nnx.replace_by_pure_dict(state, model)
        _, self.params, self.rest = nnx.split(nnx.merge(self.graphdef, state), ACTOR_TRAINABLE, ...)
        self.actor_state, self.ref_params = trainer["actor_opt"], trainer["reference"]
        if self.use_critic:
            c = trainer["critic"]
            self.cparams, self.crest, self.critic_state = c["params"], c["rest"], c["opt"]
        self.rng.bit_generator.state = host["rng"]
        self.lr_scale, self.entropy_start, self.actor_count = host["lr_scale"], host["entropy_start"], \
            host["actor_count"]

    def update(self, samples, version: int, rows: int, seq_len: int, train_actor: bool) -> dict:
        p, fns, place = self.p, self.fns, self.placement
        data = pack_samples(samples, rows, seq_len, self.pad_id, p.segment_advantage)
        fwd = {k: data[k] for k in ("tokens", "segment_ids", "positions")}
        data["old_logp"] = forward(fns.logprobs, (self.params, self.rest), fwd, p.micro_batches, place)
        # the starting policy's log-probs: the KL term's reference, and how far RL has moved the policy (metric)
        data["ref_logp"] = forward(fns.logprobs, (self.ref_params, self.rest), fwd, p.micro_batches, place)
        m = mismatch_metrics(data, version)
        m["kl_init"] = kl_init(data)
        m.update(self.advantages(data, fwd))
        keys = ["tokens", "segment_ids", "positions", "old_logp", "rollout_logp", "advantages", "returns",
                "old_values"] + (["ref_logp"] if p.kl_coef else [])
        actor_updates, kl_stopped, kl_seen, entropy_old = 0, False, [], None
        for _ in range(p.ppo_epochs):
            for idx in np.array_split(self.rng.permutation(rows), p.minibatches):
                mb = {k: data[k][idx] for k in keys}
                mb["weights"] = loss_weights(data["mask"][idx], p.loss_agg)
                if not mb["weights"].any():
                    continue  # nothing to learn from (padding rows only)
                if train_actor and not kl_stopped:
                    grads, sums = accumulate(fns.actor_grads, (self.params, self.rest), mb, p.micro_batches, place)
                    sums = {k: float(v) for k, v in sums.items()}
                    if entropy_old is None:  # the first mini-batch at the weights that sampled: pi_old's entropy
                        entropy_old = sums["entropy"]
                    if actor_updates:
                        kl_seen.append(sums["approx_kl_old"])
                    # trust region: this mini-batch's KL(pi_old || pi) at the weights about to be updated; past
                    # target_kl the actor has moved far enough on this batch (its update is not applied)
                    if p.target_kl is not None and sums["approx_kl_old"] > p.target_kl:
                        kl_stopped = True
                    else:
                        self.params, self.actor_state, gnorm = self.apply_actor(self.params, self.actor_state, grads,
                                                                                self.lr_scale)
                        actor_updates += 1
                        m["actor_grad_norm"] = float(gnorm)
                    m.update(sums)
                if self.use_critic:
                    args = (self.cparams[0], self.crest, self.cparams[1])
                    grads, sums = accumulate(fns.critic_grads, args, mb, p.micro_batches, place)
                    self.cparams, self.critic_state, gnorm = self.apply_critic(self.cparams, self.critic_state, grads)
                    m.update({k: float(v) for k, v in sums.items()}, critic_grad_norm=float(gnorm))
        if train_actor:
            m.update(actor_updates=actor_updates, kl_stopped=kl_stopped, actor_lr_scale=self.lr_scale)
            self.adapt_lr(kl_seen, entropy_old, self.schedule_ratio(actor_updates))
            self.actor_count += actor_updates
        m["train_tokens"] = float(np.sum(data["segment_ids"] > 0)) * p.ppo_epochs
        return m

    def schedule_ratio(self, applied: int) -> float:
        """The mean scheduled lr of the `applied` updates this step made over that of the next step's updates (before
        actor_count counts them): during the warm-up the next step's lr is several times this one's."""
        if not applied:
            return 1.0
        n = self.p.ppo_epochs * self.p.minibatches
        now = np.mean([float(self.schedule(self.actor_count + i)) for i in range(applied)])
        nxt = np.mean([float(self.schedule(self.actor_count + applied + i)) for i in range(n)])
        return float(now / nxt) if now > 0 and nxt > 0 else 1.0

    def adapt_lr(self, kl_seen: list[float], entropy: float, schedule_ratio: float = 1.0):
        """ppo.step_kl_per_nat: the actor's lr multiplier for the next steps from the KL(pi_old || pi) this step caused
        (the largest of those measured before each mini-batch after the first update, the one that stopped the step
        included), against a budget of step_kl_per_nat x pi_old's mean token entropy on the step's first mini-batch,
        or x the entropy at the first actor step where that is lower: the same update moves a sharp policy (an SFT
        checkpoint) further, relative to how much it is unsure of, than a diffuse one; and a policy whose entropy
        blows up must not earn a larger budget by it. A small step's KL grows with the square of its size, so
        sqrt(budget / KL) is the factor that would have met the budget, and x schedule_ratio (this step's scheduled
        lr over the next one's) the factor that meets it at the next step's scheduled lr: the schedule's warm-up
        must not hide how far a full-size step moves the policy. The factor is bounded to [1/4, 3/2] per step (one
        noisy step moves the lr by little) and the multiplier never exceeds 1."""
        p = self.p
        if p.step_kl_per_nat is None or not kl_seen:  # kl_seen is measured after the first mini-batch's entropy
            return
        if self.entropy_start is None:
            self.entropy_start = entropy
        budget = p.step_kl_per_nat * max(min(entropy, self.entropy_start), 1e-6)
        factor = math.sqrt(budget / max(max(kl_seen), 1e-12)) * schedule_ratio
        self.lr_scale = min(1.0, self.lr_scale * min(max(factor, 0.25), 1.5))

    def advantages(self, data: dict, fwd: dict) -> dict:
        """Fills data["advantages"], ["returns"], ["old_values"] over the whole batch; -> metrics."""
        p, mask = self.p, data["mask"]
        chains = episode_rows(data["episode"], data["segment"])
        if not self.use_critic:
            adv = episode_grpo(data["score"], data["group"], chains, mask, p.grpo_std)
            data["returns"] = data["old_values"] = np.zeros_like(mask)
            data["advantages"] = adv
            return {"adv_abs_mean": float(np.sum(np.abs(adv) * mask) / max(mask.sum(), 1))}
        after = forward(self.fns.values, (self.cparams[0], self.crest, self.cparams[1]), fwd, p.micro_batches,
                        self.placement)
        if p.segment_advantage == "independent":
            chains = np.arange(len(mask))[:, None]
        elif p.context_budget:  # one shape for every step: [rows, max_sub_trajectories] (no recompiles)
            chains = np.pad(chains, ((0, len(mask) - len(chains)), (0, p.max_sub_trajectories - chains.shape[1])),
                            constant_values=-1)
        values, adv, returns = (np.asarray(x) for x in _gae_both(
            data["rewards"], after, mask, data["last"], data["truncated"] * (p.truncation == "bootstrap"), chains,
            p.gamma, p.lam_actor, p.lam_critic))
        n = max(mask.sum(), 1)
        m = {"explained_variance": float(explained_variance(values, returns, mask)),
             "value_mean": float(np.sum(values * mask) / n), "return_mean": float(np.sum(returns * mask) / n),
             "adv_mean_raw": float(np.sum(adv * mask) / n),
             "adv_std_raw": float(np.sqrt(np.sum((adv - np.sum(adv * mask) / n) ** 2 * mask) / n))}
        if p.whiten_advantages:
            adv = np.asarray(masked_whiten(adv, mask))
        data["advantages"], data["returns"], data["old_values"] = adv, returns, values
        return m


class PPORun:
    """One PPO run's parts, built in this order (the random streams depend on it): the task and its environments,
    the initial policy (`initial_policy`), the learner, the samplers, the held-out problems. `produce` makes one
    rollout batch, `evaluate` measures the policy, `step` is one PPO step."""

    def __init__(self, config, workdir: str, load_params: LoadParams | None, progress: bool, fresh: bool = True):
        """fresh=False: a checkpoint will replace the weights (`restore`): the initial policy is not loaded or
        warmed up."""
        self.cfg, p = validate_ppo_config(config), config.ppo
        self.config, self.p, self.task = config, p, build_task(p)
        self.text = build_text(p, self.cfg.vocab_size)
        if isinstance(self.task, PromptsTask):
            self.task.check_prompts(self.text, p.tokenizer, p.max_prompt_len)
        reward_fn = resolve_callable(p.reward, REWARDS, "reward")
        judge = resolve_callable(p.judge, {}, "judge") if p.judge else None
        tools = resolve_tools(p.tools) if p.tools else None
        interceptor = Interceptor(judge=judge) if p.interceptor else None
        self.make_env = env_factory(p, reward_fn, interceptor, self.text, tools)
        # evaluation and demonstrations run without the simulated crashes (they exercise the rollout dropping rule)
        self.make_clean_env = env_factory(p, reward_fn, interceptor, self.text, tools, crash_prob=0.0)
        self.make_demo_env = env_factory(p, reward_fn, interceptor, self.text, tools, 0.0, compaction=False)
        if p.init_checkpoint is not None and load_params is None:
            raise ConfigError(f"ppo.init_checkpoint={p.init_checkpoint!r}: needs a params loader (train_ppo(..., "
                              "load_params=...))")
        updates_per_step = p.ppo_epochs * p.minibatches
        optim = config.optim.to_dict()
        actor_opt = {**optim, "total_steps": (p.steps - p.critic_warmup_steps) * updates_per_step}
        critic_opt = {**optim, **p.critic_optim.to_dict(), "total_steps": p.steps * updates_per_step}
        validate_optim_config(actor_opt)
        validate_optim_config(critic_opt)
        self.B, self.L = p.prompts_per_step * p.group_size, p.max_prompt_len + p.max_response_len
        os.makedirs(workdir, exist_ok=True)
        self.summary: dict = {}
        self.totals = dict.fromkeys(["wait_s", "step_s", "rollout_tokens", "rollout_s", "train_tokens", "train_s",
                                     "steps"], 0.0)  # of the timed steps (not a launch's first: it compiles)
        model = self.initial_policy(load_params, optim, progress) if fresh else GLM(self.cfg, nnx.Rngs(p.seed))
        self.learner = Learner(model, p, actor_opt, critic_opt, self.text.pad_id)
        print(f"ppo: {p.task} ({p.env}), {self.B} rollouts/step ({p.prompts_per_step} prompts x {p.group_size}), "
              f"{p.steps} steps, {p.advantage} + {p.policy_loss}, {'async' if p.async_rollout else 'sync'} rollouts")
        print(self.learner.table)
        rows = self.B * (p.max_sub_trajectories if p.context_budget else 1) // (p.minibatches * p.micro_batches)
        print("\n".join(mla_paths.describe(self.cfg, p.mode, max(1, rows), self.L)))  # a learner minibatch's
        # rollouts: the sampler runs on a device of its own when the trainer leaves one free
        devices = jax.devices()
        self.rollout_device = devices[p.data_parallel] if len(devices) > p.data_parallel else devices[0]
        decoder = Decoder(model, p.mode)  # the model object only gives the structure; weights are passed per call
        self.sampler = Sampler(decoder, self.B, p.max_prompt_len, p.max_response_len, p.temperature, p.top_p,
                               self.text.pad_id)
        self.gen_rng, self.gen_key = np.random.default_rng(p.seed + 1), jax.random.key(p.seed + 1)
        self.eval_problems = self.task.eval_set(p.eval_problems)
        self.greedy = Sampler(decoder, self.B, p.max_prompt_len, p.max_response_len, 0.0, 1.0, self.text.pad_id)
        self.version = 0
        self.rng_after = self.rollout_rng()  # the rollout streams after the last batch trained on (checkpointed)

    def initial_policy(self, load_params: LoadParams | None, optim: dict, progress: bool) -> GLM:
        """A checkpoint through the loader, or a supervised warm-up, or the random init."""
        p = self.p
        model = GLM(self.cfg, nnx.Rngs(p.seed))
        if p.init_checkpoint is not None:
            nnx.update(model, load_params(p.init_checkpoint, nnx.state(model)))
        elif p.sft_steps:
            script = SCRIPTS[p.sft_script]

            def demo(rng):
                problem = self.task.sample(rng)
                return run_script(self.make_demo_env(problem, rng), script(problem))  # whole episodes

            losses = supervised_warmup(model, demo, p.sft_steps, p.sft_batch_size, self.L, optim, p.sft_lr, p.mode,
                                       self.text.pad_id, p.seed, progress)
            self.summary["sft_first_loss"], self.summary["sft_last_loss"] = losses[0], losses[-1]
        return model

    def sampler_state(self):
        return jax.device_put(self.learner.policy_state(), self.rollout_device)

    def produce(self, state, version) -> RolloutBatch:
        p, t = self.p, time.perf_counter()
        problems = [self.task.sample(self.gen_rng) for _ in range(p.prompts_per_step)]
        envs = [self.make_env(pr, self.gen_rng) for pr in problems for _ in range(p.group_size)]
        groups = [g for g in range(p.prompts_per_step) for _ in range(p.group_size)]
        self.gen_key, sub = jax.random.split(self.gen_key)
        samples = self.sampler.play_episodes(state, envs, groups, version, sub, p.max_sub_trajectories) \
            if p.context_budget else self.sampler.rollout(state, envs, groups, version, sub)
        return RolloutBatch(samples, version, time.perf_counter() - t, sum(len(s.response) for s in samples),
                            self.rollout_rng())

    def rollout_rng(self) -> dict:
        """The rollout's random streams (problems and environments; the sampling key) as JSON."""
        return {"problems": self.gen_rng.bit_generator.state,
                "key": np.asarray(jax.random.key_data(self.gen_key)).tolist()}

    def save(self, ckpt: Checkpoints, step: int):
        """Checkpoint `step` (asynchronously): the learner's state, the weight version, the rollout streams after the
        last batch trained on, the summary so far."""
        model, trainer, host = self.learner.checkpoint_state()
        data = {"learner": host, "version": self.version, "rollout_rng": self.rng_after, "totals": self.totals,
                "summary": json.loads(json.dumps(self.summary, default=float))}
        meta = {"step": step, "stage": "ppo", "model": self.cfg.to_json_dict(), "fingerprint": fingerprint(self.config)}
        ckpt.save(step, model, trainer, data, meta)

    def restore(self, ckpt: Checkpoints) -> int:
        """Resume from the newest intact checkpoint (damaged newer ones are set aside, a changed config refused:
        glmjax/train/checkpoint.py, resume.py) -> its step."""
        model, trainer, _ = self.learner.checkpoint_state()
        now = fingerprint(self.config)
        restored = ckpt.restore_latest(model, trainer, lambda meta, step: check_resume(meta, step, now,
                                                                                       ckpt.directory, PPO_DEFAULTS))
        if restored is None:
            raise CheckpointError(f"{ckpt.directory}: the checkpoint seen at start is gone; nothing was resumed")
        step, model, trainer, data, _ = restored
        self.learner.load_checkpoint_state(model, trainer, data["learner"])
        self.version, self.rng_after, self.totals = data["version"], data["rollout_rng"], data["totals"]
        self.gen_rng.bit_generator.state = self.rng_after["problems"]
        self.gen_key = jax.random.wrap_key_data(jnp.asarray(self.rng_after["key"], jnp.uint32))
        self.summary.update(data["summary"])
        print(f"resumed from {ckpt.step_dir(step)} (stage ppo, weight version {self.version})")
        return step

    def evaluate(self) -> dict:
        """Held-out problems: greedy accuracy (reward 1) and mean reward, and the solve rate of `eval_samples` sampled
        episodes per problem at the rollout temperature (smoother: it moves with the whole sampling distribution),
        and their mean reward. The policy is measured
        without simulated crashes (ppo.env_crash_prob); an episode whose environment really crashes is not the
        policy's fault and is left out (NaN if every episode crashed)."""
        p, B = self.p, self.B
        state, out = self.learner.policy_state(), {}
        for name, smp, reps in (("eval_accuracy", self.greedy, 1), ("eval_sampled_accuracy", self.sampler,
                                                                      p.eval_samples)):
            problems = [pr for pr in self.eval_problems for _ in range(reps)]
            rewards = []
            for i in range(0, len(problems), B):
                chunk = problems[i:i + B]
                envs = [self.make_clean_env(pr, np.random.default_rng([p.seed, i, j])) for j, pr in enumerate(chunk)]
                key = jax.random.key(i)
                samples = smp.play_episodes(state, envs, list(range(len(chunk))), -1, key, p.max_sub_trajectories) \
                    if p.context_budget else smp.rollout(state, envs, list(range(len(chunk))), -1, key)
                rewards += [s.reward for s in samples if s.status not in ("env_crash", "compacted")]  # per episode
            out[name] = float(np.mean(np.asarray(rewards) == 1.0)) if rewards else float("nan")
            out[name.replace("accuracy", "reward")] = float(np.mean(rewards)) if rewards else float("nan")
        return out

    def step(self, step: int, worker: RolloutWorker | None, interceptions, start: float) -> tuple[dict, RolloutBatch]:
        """One PPO step: a rollout batch (from the worker, or generated here), its interceptions logged, stale and
        broken groups filtered, the learner's update, the new weights handed to the worker. -> (metrics, batch);
        start: when the loop started (for metrics["wall_s"])."""
        p, version = self.p, self.version
        ts = time.perf_counter()
        batch = worker.get() if worker else self.produce(self.sampler_state(), version)
        self.rng_after = batch.rng_after
        wait = time.perf_counter() - ts
        m = {"step": step, "version": version, **rollout_metrics(batch, version)}
        for b, s in enumerate(batch.samples):
            for r in s.info.get("interceptions", ()) if s.status != "compacted" else ():  # once per episode
                interceptions.write(json.dumps({"step": step, "sample": b, "group": s.group, **r}) + "\n")
        interceptions.flush()
        samples, counts = filter_groups(batch.samples, version, p.max_staleness, p.group_size)
        m.update(counts)
        tt = time.perf_counter()
        train_actor = step > p.critic_warmup_steps
        if samples:
            rows = self.B * (p.max_sub_trajectories if p.context_budget else 1)
            m.update(self.learner.update(samples, version, rows, self.L, train_actor))
            if train_actor:
                self.version += 1
                if worker:
                    worker.set_weights(self.sampler_state(), self.version)
        now = time.perf_counter()
        m.update(wait_s=wait, train_s=now - tt, step_s=now - ts, wait_share=wait / max(now - ts, 1e-9),
                 wall_s=now - start)
        return m, batch


def train_ppo(config, workdir: str, progress: bool = True, load_params: LoadParams | None = None) -> dict:
    """Run (or resume) the PPO stage in workdir -> summary dict. Writes workdir/{config.json, metrics.jsonl,
    interceptions.jsonl (both appended across restarts), checkpoints/, summary.json (when the run completes)} and,
    with ppo.save_policy, the final policy to workdir/policy.

    Like an LM stage (glmjax/train/loop.py): the same call on a workdir with checkpoints resumes from the newest intact
    one (with synchronous rollouts, bitwise as if never interrupted); SIGTERM / SIGINT finish the step, checkpoint and
    return (summary["interrupted"]); a changed config is refused (ppo.on_config_change); a finished run is not rerun.
    """
    t0 = time.perf_counter()
    validate_ppo_config(config)
    p = config.ppo
    resuming = settle_checkpoints(config, workdir)  # before config.json is written: a refusal leaves it as it was
    finished = prepare_workdir(workdir, config, p.on_config_change)
    if finished is not None:
        return finished
    run = PPORun(config, workdir, load_params, progress, fresh=not resuming)
    ckpt = Checkpoints(workdir, p.keep_checkpoints, p.async_checkpoints)
    try:
        start_step = run.restore(ckpt) if resuming else 0
    except BaseException:
        ckpt.close()
        raise
    summary, worker = run.summary, None
    start = time.perf_counter()
    summary.update({"setup_s": start - t0, "steps": p.steps, "start_step": start_step})
    with stop_signals() as stop, MetricsLog(os.path.join(workdir, "metrics.jsonl"), "a", total=p.steps,
                                            initial=start_step, disable=not progress, desc="ppo") as log, \
            open(os.path.join(workdir, "interceptions.jsonl"), "a") as icpt:
        try:
            if p.async_rollout:
                worker = RolloutWorker(run.produce, p.rollout_ahead)
                worker.set_weights(run.sampler_state(), run.version)
                worker.start()
            if start_step == 0:
                e = run.evaluate()
                log.write({"step": 0, **e})
                summary.update({k + "_start": v for k, v in e.items()})
                log.message(f"step 0: eval accuracy {e['eval_accuracy']:.3f} "
                            f"(sampled {e['eval_sampled_accuracy']:.3f})")
            evals = EvalHook(run.evaluate, p.eval_every, p.steps, log, summary, eval_line)
            checkpoints = CheckpointHook(lambda step: run.save(ckpt, step), p.checkpoint_every, p.steps, stop, log)
            for step in range(start_step + 1, p.steps + 1):
                m, batch = run.step(step, worker, icpt, start)
                if step > start_step + 1:  # a launch's first step compiles everything: reported, not averaged
                    for k, v in (("wait_s", m["wait_s"]), ("step_s", m["step_s"]), ("train_s", m["train_s"]),
                                 ("rollout_tokens", batch.tokens), ("rollout_s", batch.generate_s),
                                 ("train_tokens", m.get("train_tokens", 0.0)), ("steps", 1)):
                        run.totals[k] += v
                else:
                    summary["first_step_s"] = m["step_s"]
                if due(step, p.log_every, p.steps):
                    log.write(m)
                evals(step, m)
                log.bar.update(1)
                log.bar.set_postfix(reward=f"{m['reward_mean']:.2f}", wait=f"{m['wait_share']:.2f}")
                summary["last"] = m
                signame = checkpoints(step)
                if signame:
                    summary["interrupted"] = signame
                    break
        finally:
            if worker:
                worker.stop()
            ckpt.close()
    if not summary.get("interrupted") and p.save_policy:
        write_import(os.path.join(workdir, "policy"), run.learner.policy_state(), run.cfg)  # glmjax/resolve.py
    totals = run.totals
    summary.update(wait_share=totals["wait_s"] / max(totals["step_s"], 1e-9),
                   step_s=totals["step_s"] / max(totals["steps"], 1),
                   rollout_tokens_per_s=totals["rollout_tokens"] / max(totals["rollout_s"], 1e-9),
                   trainer_tokens_per_s=totals["train_tokens"] / max(totals["train_s"], 1e-9),
                   final_version=run.version, wall_s=time.perf_counter() - t0)
    if not summary.get("interrupted"):
        with open(os.path.join(workdir, "summary.json"), "w") as f:
            json.dump(summary, f, indent=2, default=float)
    print("done: " + ", ".join(f"{k} {v:.4g}" for k, v in summary.items() if isinstance(v, float)))
    return summary


def settle_checkpoints(config, workdir: str) -> bool:
    """Before anything is built: whether workdir holds a checkpoint to resume. One written with another config is
    refused (ConfigMismatch, nothing touched) or, with ppo.on_config_change="fresh", moved with the old run's other
    outputs to workdir/archive/<time>/."""
    found = newest_meta(workdir)
    if found is None:
        return False
    try:
        check_resume(found[1], found[0], fingerprint(config), os.path.join(os.path.abspath(workdir), "checkpoints"),
                     PPO_DEFAULTS)
    except ConfigMismatch as e:
        if config.ppo.on_config_change == "error":
            raise
        print(f"ppo.on_config_change='fresh': {e}\n-> the old run was moved to {archive_run(workdir)}; starting at "
              "step 0")
        return False
    return True


def eval_line(step: int, e: dict, m: dict) -> str:
    ev = m.get("explained_variance")
    return (f"step {step}: eval accuracy {e['eval_accuracy']:.3f} (sampled {e['eval_sampled_accuracy']:.3f}), "
            f"reward {m['reward_mean']:.3f}" + (f", explained variance {ev:.3f}" if ev is not None else ""))


def rollout_metrics(batch: RolloutBatch, version: int) -> dict:
    """Per episode (the last sub-trajectory of a compacted one) for rewards and outcomes; with compaction, also
    sub-trajectories per episode, their lengths (prompt + response: mean, std) and the compactions."""
    episodes = [s for s in batch.samples if s.status != "compacted"]  # one per episode (its info is the episode's)
    ok = [s for s in episodes if s.status != "env_crash"]
    rewards = np.array([s.reward for s in ok]) if ok else np.zeros(1)
    hacked = [s.reward for s in ok if s.intercepted]
    clean = [s.reward for s in ok if not s.intercepted]
    m = {"reward_mean": float(rewards.mean()), "solved": float(np.mean(rewards == 1.0)),
         "response_tokens": float(np.mean([s.loss_mask.sum() for s in ok])) if ok else 0.0,
         "truncated": sum(s.status == "truncated" for s in batch.samples),
         "staleness": float(np.mean([version - s.version for s in batch.samples])),
         "interceptions": sum(sum(r["blocked"] for r in s.info.get("interceptions", ())) for s in episodes),
         "intercepted_samples": len(hacked), "reward_intercepted": float(np.mean(hacked)) if hacked else None,
         "reward_not_intercepted": float(np.mean(clean)) if clean else None,
         "tool_calls": float(np.mean([s.info.get("tool_calls", 0) for s in episodes])),
         "rollout_tokens_per_s": batch.tokens / max(batch.generate_s, 1e-9)}
    pieces = [s for s in batch.samples if s.episode >= 0]
    if pieces:
        per = np.bincount([s.episode for s in pieces])
        per = per[per > 0]
        lengths = np.array([len(s.prompt) + len(s.response) for s in pieces], np.float64)
        m.update(sub_trajectories_per_episode=float(per.mean()), sub_trajectory_len_mean=float(lengths.mean()),
                 sub_trajectory_len_std=float(lengths.std()), compactions=int(per.sum() - len(per)))
    return m


def kl_init(data: dict) -> float:
    """Mean k3 estimate of KL(pi || pi_start) on the batch's policy tokens (pi: the trainer's weights before this
    step's updates; pi_start: the policy PPO started from)."""
    mask = data["mask"]
    r = data["ref_logp"] - data["old_logp"]
    return float(np.sum((np.exp(r) - r - 1.0) * mask) / max(mask.sum(), 1.0))


def mismatch_metrics(data: dict, version: int) -> dict:
    """Rollout vs trainer log-probs on policy tokens: over samples generated by the trainer's current weights (pure
    engine mismatch: decode path vs training forward) and over all samples (adds staleness)."""
    out = {}
    delta = data["old_logp"] - data["rollout_logp"]  # log pi_train - log pi_rollout
    for name, rows in (("", data["version"] == version), ("_all", data["version"] >= 0)):
        mask = data["mask"] * rows[:, None]
        n = mask.sum()
        if n:
            out["logp_mismatch" + name] = float(np.sum(np.abs(delta) * mask) / n)
            out["logp_kl" + name] = float(np.sum((np.exp(-delta) - 1 + delta) * mask) / n)  # KL(rollout || train)
    return out
