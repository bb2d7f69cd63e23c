"""What a resumed run must share with its checkpoints, and what to do when it does not.

Every checkpoint's meta holds the run's config fingerprint (`fingerprint`: the flattened config, JSON values).
On resume the current config's fingerprint is compared with the newest checkpoint's, ignoring the fields that may
change between restarts (FREE: logging, eval and checkpoint cadence, the step count, the mesh, kernel choices).
Any other difference stops the run with a `ConfigMismatch` listing the fields, unless train.on_config_change says
otherwise:
  "error"    (default) stop, nothing touched;
  "fresh"    move checkpoints/, metrics.jsonl and summary.json to workdir/archive/<time>/ and start at step 0;
  "weights"  the same, then initialise the model from the archived run's newest checkpoint (parameter surgery,
             as init_from); optimizer, data iterator and step start fresh.
Both act only when the checkpoints do not match, so rerunning the same command later resumes normally. The PPO stage
(glmjax/rl/resume.py) follows the same rules with ppo.on_config_change ("error" or "fresh").
"""
from __future__ import annotations

import json
import os
import shutil
import time

from glmjax.config import ConfigError, ModelConfig

ON_CONFIG_CHANGE = ("error", "fresh", "weights")
FREE_PREFIXES = ("parallel.", "stages.")
FREE = {"train.steps", "train.log_every", "train.eval_every", "train.eval_batches", "train.checkpoint_every",
        "train.keep_checkpoints", "train.async_checkpoints", "train.tensorboard", "train.nan_policy",
        "train.inject_nan_at_step", "train.on_config_change", "data.prefetch", "init_from", "recipe",
        "model.attention_impl", "model.dense_attention_impl", "model.moe_impl", "model.moe_dispatch", "model.remat",
        "model.block_q", "model.loss_chunk", "model.context_layout", "optim.total_steps",
        # the PPO stage's (glmjax/rl/config.py) equivalents
        "ppo.steps", "ppo.log_every", "ppo.eval_every", "ppo.eval_problems", "ppo.eval_samples", "ppo.save_policy",
        "ppo.checkpoint_every", "ppo.keep_checkpoints", "ppo.async_checkpoints", "ppo.on_config_change"}
RUN_FILES = ("checkpoints", ".unsealed", "metrics.jsonl", "summary.json", "interceptions.jsonl", "policy")


class ConfigMismatch(ConfigError):
    """The config differs from the one the workdir's checkpoints were written with."""


def fingerprint(config) -> dict:
    """Flattened config (a ConfigDict, or a dict as read from config.json) {"section.field": JSON value}."""
    out = {}

    def walk(prefix, node):
        for k, v in node.items():
            if isinstance(v, dict):
                walk(f"{prefix}{k}.", v)
            else:
                out[prefix + k] = v

    walk("", json.loads(config.to_json()) if hasattr(config, "to_json") else config)
    return out


def config_diff(saved: dict, now: dict, defaults: dict | None = None) -> list[str]:
    """'field: saved -> now' for every field that must match on resume. A model field absent on one side counts as
    its ModelConfig default (configs written before every model field was in the config left defaults out), and so
    does a field of `defaults` (a stage's section defaults: fields added since the checkpoint was written)."""
    defaults = {**fingerprint({"model": ModelConfig().to_json_dict()}), **(defaults or {})}
    out = []
    for k in sorted(set(saved) | set(now)):
        old, new = saved.get(k, defaults.get(k, "<absent>")), now.get(k, defaults.get(k, "<absent>"))
        if k in FREE or k.startswith(FREE_PREFIXES) or old == new:
            continue
        out.append(f"{k}: {old!r} -> {new!r}")
    return out


def check_resume(meta: dict, step: int, now: dict, directory: str, defaults: dict | None = None) -> None:
    """Raises ConfigMismatch if checkpoint `step` (its meta) was written with a config that differs from `now`
    (`config_diff`'s defaults)."""
    saved = meta.get("fingerprint")
    if saved is None:  # an older checkpoint: only the model config was recorded
        saved = {f"model.{k}": v for k, v in meta.get("model", {}).items()}
        both = set(saved) & set(now)
        saved, now = {k: saved[k] for k in both}, {k: now[k] for k in both}
    diff = config_diff(saved, now, defaults)
    if diff:
        raise ConfigMismatch(
            f"workdir {os.path.dirname(directory)}: checkpoint step {step} was written with a different config "
            f"({len(diff)} field(s): {'; '.join(diff)}). Nothing was changed. To continue that run, rerun without "
            "these changes; to start over, use a new --workdir, or add "
            + ("--config.ppo.on_config_change=fresh (archive the old run's checkpoints and metrics, start at step 0)"
               if any(k.startswith("ppo.") for k in now) else
               "--config.train.on_config_change=fresh (archive the old run's checkpoints and metrics, start at step "
               "0) or =weights (the same, but start from the old run's model weights)"))


def archive_run(workdir: str) -> str:
    """Move the run's outputs (RUN_FILES) to workdir/archive/<time>/ -> that directory."""
    target = os.path.join(workdir, "archive", time.strftime("%Y%m%d-%H%M%S"))
    n = 0
    while os.path.exists(target + (f"-{n}" if n else "")):
        n += 1
    target += f"-{n}" if n else ""
    os.makedirs(target)
    for name in RUN_FILES:
        if os.path.exists(os.path.join(workdir, name)):
            shutil.move(os.path.join(workdir, name), os.path.join(target, name))
    return target
