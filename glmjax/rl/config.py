"""The `ppo` section of an RL experiment config: defaults and up-front validation (errors name field, value, rule).

A PPO config has `model` (glmjax.config.ModelConfig fields), `optim` (the actor's optimizer, glmjax.optim; its
`total_steps` is derived: PPO steps x ppo_epochs x minibatches) and `ppo` (below). The critic uses `optim` with
`ppo.critic_optim` overriding fields (by default only its learning rate).
"""
from __future__ import annotations

import math

import jax
import ml_collections

from glmjax.config import ConfigError, ModelConfig
from glmjax.rl.compaction import ASK, make_budget
from glmjax.rl.env import ENVS
from glmjax.rl.losses import AGGREGATIONS, POLICY_LOSSES
from glmjax.rl.prompts import TASKS

ADVANTAGES = ("gae", "grpo")
SEGMENT_ADVANTAGES = ("episode", "independent")
MODES = ("dense", "sparse")
PPO_ON_CONFIG_CHANGE = ("error", "fresh")  # the stages' "weights": start PPO from the old run with ppo.init_checkpoint


def default_ppo_config(**overrides) -> ml_collections.ConfigDict:
    placeholder = ml_collections.config_dict.placeholder
    c = ml_collections.ConfigDict()
    c.seed = 0
    c.steps = 100  # PPO steps: one rollout batch each, then ppo_epochs x minibatches optimizer updates
    # ----- task and environment
    c.task = "arithmetic"  # arithmetic | reverse | sort (demos, glmjax/rl/tasks.py) | prompts (your JSONL file)
    c.task_args = ml_collections.ConfigDict()  # constructor arguments of the task (e.g. low=0, high=9, ops="+";
    # prompts: path="prompts.jsonl", fields=("answer",): glmjax/rl/prompts.py)
    c.tokenizer = "byte"  # byte | "hf:DIR": prompts rendered by DIR's chat template, responses decoded by it
    c.env = "single_turn"  # single_turn | tool (multi-turn calculator / file / web tools, tool outputs loss-masked)
    c.reward = "exact"  # exact | partial | "package.module:function" -- fn(response_text, problem) -> float
    c.tools = placeholder(str)  # optional "package.module:NAME": a dict {tool name: fn(argument, problem) -> str}
    c.heldout_fraction = 0.2  # share of problems held out (by hash) for evaluation
    c.max_tool_calls = 3
    # compaction (glmjax/rl/compaction.py, docs/ppo.md "Compaction"; env "tool"): a sub-trajectory
    # holds at most context_budget tokens (0: off); when a tool's output would leave fewer than compaction_headroom
    # for the next turn, the episode goes on in a new sub-trajectory whose prompt is the compacted conversation
    c.context_budget = 0
    c.compaction = "keep_last:2"  # "keep_last:K" (the task, a summary line written by a rule, the last K turns),
    # "policy_summary:K" (the summary written by the policy itself, as policy tokens) or "pkg.mod:fn"
    c.compaction_headroom = 16
    c.max_sub_trajectories = 4  # per episode; the learner's rows hold prompts_per_step x group_size x this
    c.env_crash_prob = 0.0  # simulated environment crashes per tool call (exercises the dropping rule)
    c.interceptor = True  # block tool calls that read protected answers / fetch reference solutions
    c.judge = placeholder(str)  # optional "package.module:function" judge(call, rule) -> bool confirming a block
    # ----- rollouts
    c.prompts_per_step = 16
    c.group_size = 4  # samples per prompt (a group); B = prompts_per_step * group_size rows per step
    c.max_prompt_len = 16
    c.max_response_len = 16
    c.temperature = 1.0
    c.top_p = 1.0
    c.mode = "sparse"  # attention in sampler and trainer alike: "sparse" (DSA, deterministic top-k) | "dense"
    c.async_rollout = True  # a rollout thread generates the next batch while the trainer trains
    c.rollout_ahead = 1  # batches the worker may finish ahead of the trainer (1: the trainer at v trains on v-1)
    c.max_staleness = 2  # drop samples generated more than this many weight versions ago
    # ----- advantages
    c.advantage = "gae"  # gae (critic) | grpo (group-relative, no critic)
    c.gamma = 1.0
    c.lam_actor = 0.95
    c.lam_critic = 1.0
    c.whiten_advantages = True  # global masked whitening (GAE)
    # a row cut at max_response_len (GAE): "terminal" -- the episode ended there and the environment scored it (an
    # unfinished answer scores 0); "bootstrap" -- it would have gone on, V at the cut stands for the rest. Bootstrap
    # only where the cut is not the end (the reward is not final): where it is, a truncated row's return is V,
    # above a wrong answer's 0, and PPO learns not to finish (docs/ppo.md "From an SFT checkpoint")
    c.truncation = "terminal"
    c.grpo_std = True  # GRPO: divide by the group std (False = Dr.GRPO)
    # an episode compacted into several sub-trajectories (samples sharing an episode id, docs/ppo.md "Compaction"):
    # "episode" -- GAE runs along the whole episode (a sub-trajectory's last policy token bootstraps from V at the
    # next one's first), the reward on the last one's last policy token; "independent" -- each sub-trajectory its own
    # GAE, nothing carried across, the episode's reward split evenly over the sub-trajectories' last policy tokens
    # (what public RL frameworks do). GRPO: one baseline per episode either way
    c.segment_advantage = "episode"
    # ----- losses
    c.policy_loss = "ppo_clip"  # ppo_clip | async_two_sided | icepop
    c.clip_low = 0.2
    c.clip_high = 0.28
    c.dual_clip = ml_collections.FieldReference(3.0, field_type=float)  # c > 1 bounds -rho*A for A < 0; or None
    c.icepop_low = 0.5
    c.icepop_high = 2.0
    c.value_clip = 0.2  # 0 disables value clipping
    c.entropy_coef = 0.0
    c.kl_coef = 0.0  # KL(pi || reference policy) in the loss; the reference is the policy PPO starts from
    c.loss_agg = "token_mean"  # token_mean (global) | seq_mean_token_mean
    # ----- optimisation
    c.ppo_epochs = 1
    c.minibatches = 1  # optimizer updates per epoch
    c.micro_batches = 1  # gradient accumulation inside one update
    c.data_parallel = 1  # devices the trainer shards each micro-batch over
    c.critic_optim = ml_collections.ConfigDict(dict(lr=1e-3))  # overrides of `optim` for the critic
    c.critic_warmup_steps = 0  # first PPO steps train only the critic
    # trust region: a PPO step stops updating the actor once the mean approximate KL(pi_old || pi) of a
    # mini-batch, measured before its update, exceeds this (None = never; the critic keeps training)
    c.target_kl = ml_collections.FieldReference(0.05, field_type=float)
    # the actor's step size follows the KL it causes: after each PPO step a multiplier of the actor's learning rate
    # is scaled by sqrt(budget / the step's measured KL(pi_old || pi)) (a small step's KL grows with its square) x
    # this step's scheduled lr / the next step's (the warm-up must not hide a full step's size), by 1/4 to 3/2 per
    # step and never above 1 (the configured lr is the ceiling); budget = step_kl_per_nat x pi_old's mean token
    # entropy, capped at the first actor step's. One update at a fixed lr moves a sharp (SFT) policy far more, for
    # what it is unsure of, than a diffuse one: docs/ppo.md "From an SFT checkpoint". None = a fixed lr.
    c.step_kl_per_nat = ml_collections.FieldReference(0.05, field_type=float)
    c.freeze_indexer = True  # DSA indexer frozen during RL (GLM-5)
    c.logprob_chunk = 512  # sequence chunk of the log-prob / entropy computation (never [B, S, V] at once)
    # ----- initialisation, evaluation, logging
    c.init_checkpoint = placeholder(str)  # loaded by the `load_params` function train_ppo is given
    c.sft_steps = 0  # supervised warm-up on task demonstrations before PPO (when no checkpoint is given)
    c.sft_batch_size = 64
    c.sft_lr = 3e-3
    c.sft_script = "direct"  # demonstrations: direct (answer at once) | calc (tool env: calculator, then answer)
    c.eval_every = 10  # held-out greedy accuracy every N steps (and before / after); 0 = only before / after
    c.eval_problems = 64  # held-out problems (fewer if the held-out split is smaller)
    c.eval_samples = 4  # sampled episodes per held-out problem (at `temperature`) for eval_sampled_accuracy
    c.log_every = 1
    c.save_policy = True  # write the final policy to workdir/policy (model_config.json + state/, as glmjax-hf import)
    # ----- checkpoints (the stages' machinery, glmjax/train/checkpoint.py): the same command resumes a killed run
    c.checkpoint_every = 10  # PPO steps between (asynchronous) checkpoints; one is always written at the end
    c.keep_checkpoints = 3
    c.async_checkpoints = True
    # resuming a workdir whose checkpoints were written with another config: "error" (stop, list the fields) or
    # "fresh" (move the old run to workdir/archive/<time>/, start at step 0); glmjax/train/resume.py
    c.on_config_change = "error"
    c.update(overrides)
    return c


def validate_ppo_config(config) -> ModelConfig:
    """Check config.model and config.ppo (and their consistency). Raises ConfigError; -> the ModelConfig."""
    model_cfg = ModelConfig.from_dict(config.model)
    p = config.ppo
    known = set(default_ppo_config().keys())
    unknown = sorted(set(p.keys()) - known)
    if unknown:
        raise ConfigError(f"ppo.{unknown[0]}: unknown field (known fields: {', '.join(sorted(known))})")

    def fail(field, rule):
        raise ConfigError(f"ppo.{field}={p[field]!r}: {rule}")

    def integer(field, minimum):
        v = p[field]
        if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
            fail(field, f"must be an integer >= {minimum}")

    def number(field, low=None, high=None, low_open=False, allow_none=False):
        v = p[field]
        if v is None and allow_none:
            return
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            fail(field, "must be a finite number" + (" or None" if allow_none else ""))
        if low is not None and (v <= low if low_open else v < low):
            fail(field, f"must be {'>' if low_open else '>='} {low}")
        if high is not None and v > high:
            fail(field, f"must be <= {high}")

    def choice(field, options):
        if p[field] not in options:
            fail(field, f"must be one of {list(options)}")

    def boolean(field):
        if not isinstance(p[field], bool):
            fail(field, "must be True or False")

    for f in ("steps", "prompts_per_step", "group_size", "max_prompt_len", "max_response_len", "rollout_ahead",
              "ppo_epochs", "minibatches", "micro_batches", "data_parallel", "eval_problems", "eval_samples",
              "log_every", "sft_batch_size", "logprob_chunk", "keep_checkpoints"):
        integer(f, 1)
    for f in ("context_budget", "compaction_headroom", "max_sub_trajectories"):
        integer(f, 1 if f == "max_sub_trajectories" else 0)
    for f in ("seed", "max_staleness", "critic_warmup_steps", "sft_steps", "eval_every", "max_tool_calls",
              "checkpoint_every"):
        integer(f, 0)
    choice("task", tuple(TASKS))
    choice("env", ENVS)
    choice("mode", MODES)
    choice("advantage", ADVANTAGES)
    choice("truncation", ("terminal", "bootstrap"))
    choice("segment_advantage", SEGMENT_ADVANTAGES)
    choice("policy_loss", POLICY_LOSSES)
    choice("loss_agg", AGGREGATIONS)
    choice("sft_script", ("direct", "calc"))
    choice("on_config_change", PPO_ON_CONFIG_CHANGE)
    for f in ("async_rollout", "whiten_advantages", "grpo_std", "interceptor", "freeze_indexer", "save_policy",
              "async_checkpoints"):
        boolean(f)
    if not p.freeze_indexer:
        fail("freeze_indexer", "must be True: PPO's losses never reach the indexer (top-k is not differentiable) "
             "and no indexer KL loss runs during RL, so an unfrozen indexer would only feel weight decay")
    if not isinstance(p.reward, str) or not p.reward:
        fail("reward", "must be a reward name or 'package.module:function'")
    for f in ("judge", "tools"):
        if p[f] is not None and (not isinstance(p[f], str) or ":" not in p[f]):
            fail(f, "must be None or 'package.module:name'")
    if not isinstance(p.tokenizer, str) or not (p.tokenizer == "byte" or p.tokenizer.startswith("hf:")):
        fail("tokenizer", "must be 'byte' or 'hf:DIR' (a directory with tokenizer.json)")
    if p.tokenizer != "byte" and p.sft_steps:
        fail("sft_steps", "the supervised warm-up's demonstrations are byte-tokenized: with ppo.tokenizer "
             f"{p.tokenizer!r} start from an SFT checkpoint (ppo.init_checkpoint) instead")
    if p.tools is not None and p.env != "tool":
        fail("tools", "tools are offered in the tool environment: needs env='tool'")
    if p.env_crash_prob and p.env != "tool":
        fail("env_crash_prob", "simulated crashes happen in tool calls: needs env='tool'")
    if p.sft_script == "calc" and p.env != "tool":
        fail("sft_script", "'calc' demonstrations need env='tool'")
    number("heldout_fraction", 0, 1, low_open=True)
    if p.heldout_fraction >= 1:
        fail("heldout_fraction", "must be < 1 (some problems must remain for training)")
    number("env_crash_prob", 0, 1)
    number("temperature", 0, low_open=True)
    number("top_p", 0, 1, low_open=True)
    number("gamma", 0, 1)
    number("lam_actor", 0, 1)
    number("lam_critic", 0, 1)
    number("clip_low", 0, 1, low_open=True)
    number("clip_high", 0, low_open=True)
    number("dual_clip", allow_none=True)
    if p.dual_clip is not None and not p.dual_clip > 1:
        fail("dual_clip", "must be > 1 (or None)")
    number("target_kl", 0, low_open=True, allow_none=True)
    number("step_kl_per_nat", 0, low_open=True, allow_none=True)
    number("icepop_low", 0, low_open=True)
    number("icepop_high")
    if not p.icepop_high > p.icepop_low:
        fail("icepop_high", f"must be > icepop_low={p.icepop_low}")
    number("value_clip", 0)
    number("entropy_coef", 0)
    number("kl_coef", 0)
    number("sft_lr", 0, low_open=True)
    B = p.prompts_per_step * p.group_size
    if B % (p.minibatches * p.micro_batches * p.data_parallel):
        fail("prompts_per_step", f"x group_size = {B} rows per step must be divisible by minibatches x micro_batches "
             f"x data_parallel = {p.minibatches * p.micro_batches * p.data_parallel}")
    if p.advantage == "grpo" and p.group_size < 2:
        fail("group_size", "GRPO needs groups of >= 2 samples")
    if p.advantage == "grpo" and p.critic_warmup_steps:
        fail("critic_warmup_steps", "GRPO trains no critic")
    if p.critic_warmup_steps >= p.steps:
        fail("critic_warmup_steps", f"must be < steps={p.steps} (the actor must train at some point)")
    if p.sft_steps and p.init_checkpoint is not None:
        fail("sft_steps", "a supervised warm-up and init_checkpoint exclude each other")
    if not hasattr(p.critic_optim, "keys"):
        fail("critic_optim", "must be a dict of optim overrides, e.g. {'lr': 1e-3}")
    if p.context_budget:
        if p.env != "tool":
            fail("context_budget", "compaction is for multi-turn episodes: env='tool'")
        if p.max_prompt_len < p.context_budget - p.compaction_headroom:
            fail("max_prompt_len", f"must hold a compacted prompt: >= context_budget - compaction_headroom = "
                 f"{p.context_budget - p.compaction_headroom}")
        if not 0 < p.compaction_headroom < p.context_budget:
            fail("compaction_headroom", f"must be in (0, context_budget={p.context_budget})")
        if p.context_budget > p.max_response_len:
            fail("context_budget", f"must be <= max_response_len={p.max_response_len} (a sub-trajectory's response "
                 "must be able to fill it, or its rows are cut before compaction)")
        if p.compaction.startswith("policy_summary:") and p.compaction_headroom <= len(ASK):
            fail("compaction_headroom", f"must hold the cue ({len(ASK)} tokens) and the policy's summary "
                 "(compaction='policy_summary:K')")
        make_budget(p.compaction, p.context_budget, p.compaction_headroom)
        if p.compaction.startswith("policy_summary:") and p.tokenizer != "byte":
            fail("compaction", "a summary written by the policy is for byte tokens (the chat template's is not yet)")
    max_pos = model_cfg.max_position_embeddings
    if p.max_prompt_len + p.max_response_len > max_pos:
        fail("max_response_len", f"max_prompt_len + max_response_len = {p.max_prompt_len + p.max_response_len} "
             f"must be <= model.max_position_embeddings={max_pos}")
    if p.data_parallel > 1:
        if jax.device_count() < p.data_parallel:
            fail("data_parallel", f"needs that many devices, {jax.device_count()} available")
    return model_cfg
