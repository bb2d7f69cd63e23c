"""The `train` section of an experiment config and the top-level stage fields: defaults and up-front validation.

Top level of an experiment config (besides `model`, `optim`, `data`, `train`):
  stage      one of glmjax.train.stages.STAGES, or "recipe" = run `recipe`'s stages in order, each in
             workdir/<stage>, each initialised from the previous one
  recipe     tuple of stage names (stage="recipe")
  init_from  workdir of a previous stage to start from (parameter surgery by layer), or None = fresh init
  stages     per-stage overrides: {stage name: {"train": {...}, "optim": {...}, "model": {...}}}, applied on top of
             the base sections when that stage runs
"""
from __future__ import annotations

import math

import ml_collections

from glmjax.config import ConfigError
from glmjax.train.resume import ON_CONFIG_CHANGE

MODES = ("dense", "sparse")
NAN_POLICIES = ("skip", "stop")


def default_train_config(**overrides) -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.seed = 0
    c.seq_len = 128
    c.batch_size = 8
    c.steps = 300
    c.mode = "sparse"  # attention mode: "dense" | "sparse" (DSA top-k)
    c.bias_update_rate = 1e-3  # aux-loss-free balancing: bias += rate * sign(mean load - load); 0 disables
    c.log_every = 10
    c.eval_every = 100  # 0 disables periodic eval (a final eval still runs when eval_batches > 0)
    c.eval_batches = 4
    c.index_loss_weight = 1.0  # sparse stages: weight of the indexer KL (reaches only indexer weights)
    c.checkpoint_every = 100  # steps between (asynchronous) checkpoints; one is always written at the end
    c.keep_checkpoints = 3
    c.async_checkpoints = True
    c.nan_policy = "skip"  # non-finite loss/grad: "skip" the update (counted) or "stop" the run with diagnostics
    c.inject_nan_at_step = ml_collections.config_dict.placeholder(int)  # tests: make this step's loss NaN
    c.tensorboard = True  # also write TensorBoard event files to workdir/tb
    # resuming a workdir whose checkpoints were written with another config: "error" (stop, list the fields),
    # "fresh" (archive the old run, start at step 0) or "weights" (archive it, start from its weights); see resume.py
    c.on_config_change = "error"
    c.update(overrides)
    return c


def validate_train_config(t, model_cfg) -> None:
    """t: the train ConfigDict; model_cfg: the validated ModelConfig."""
    def fail(field, rule):
        raise ConfigError(f"train.{field}={t[field]!r}: {rule}")

    for name in ("seq_len", "batch_size", "steps", "log_every", "checkpoint_every", "keep_checkpoints"):
        if not isinstance(t[name], int) or t[name] < 1:
            fail(name, "must be an integer >= 1")
    for name in ("eval_every", "eval_batches"):
        if not isinstance(t[name], int) or t[name] < 0:
            fail(name, "must be an integer >= 0")
    if isinstance(t.seed, bool) or not isinstance(t.seed, int) or not 0 <= t.seed < 2 ** 32:
        fail("seed", "must be an integer in [0, 2**32)")
    for name in ("bias_update_rate", "index_loss_weight"):
        v = t[name]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
            fail(name, "must be a finite number >= 0")
    if t.mode not in MODES:
        fail("mode", f"must be one of {MODES}")
    if t.nan_policy not in NAN_POLICIES:
        fail("nan_policy", f"must be one of {NAN_POLICIES}")
    if t.on_config_change not in ON_CONFIG_CHANGE:
        fail("on_config_change", f"must be one of {ON_CONFIG_CHANGE}")
    if t.seq_len > model_cfg.max_position_embeddings:
        fail("seq_len", f"must be <= model.max_position_embeddings={model_cfg.max_position_embeddings}")
    if t.seq_len < 2:
        fail("seq_len", "must be >= 2 (the LM loss predicts the next token)")
    if model_cfg.has_mtp and t.seq_len <= model_cfg.mtp_depth:
        fail("seq_len", f"must be > model.mtp_depth={model_cfg.mtp_depth} (MTP depth k predicts k+1 tokens ahead)")
    if model_cfg.index_topk > t.seq_len:
        raise ConfigError(f"model.index_topk={model_cfg.index_topk}: must be <= train.seq_len={t.seq_len} (the "
                          "indexer selects top-k keys of one sequence)")


def experiment_fields(c: ml_collections.ConfigDict, stage: str = "pretrain", recipe=(), stages=None):
    """Adds the top-level stage fields to an experiment config (see the module docstring) -> c."""
    c.stage = stage
    c.recipe = tuple(recipe)
    c.init_from = ml_collections.config_dict.placeholder(str)
    c.stages = ml_collections.ConfigDict(stages or {})
    return c


def stage_config(config: ml_collections.ConfigDict, name: str) -> ml_collections.ConfigDict:
    """The config a stage runs with: `config` with stage=name and config.stages[name]'s overrides applied."""
    from glmjax.train.stages import STAGES

    if name not in STAGES:
        raise ConfigError(f"stage={name!r}: must be one of {sorted(STAGES)} (or 'recipe')")
    c = ml_collections.ConfigDict(config.to_dict())
    c.stage = name
    overrides = config.stages.get(name, {}) if "stages" in config else {}
    for section, values in dict(overrides).items():
        if section not in c or not isinstance(c[section], ml_collections.ConfigDict):
            raise ConfigError(f"stages.{name}.{section}: not a config section (model, optim, data, train)")
        for key, value in dict(values).items():
            if key not in c[section]:
                raise ConfigError(f"stages.{name}.{section}.{key}: unknown field of {section}")
            c[section][key] = value
    return c


def validate_stage(config, model_cfg) -> None:
    """The stage fields of a single-stage config (after stage_config)."""
    from glmjax.train.stages import STAGES

    stage = STAGES[config.stage]
    if stage.index_loss and "full" not in model_cfg.layer_indexer_types:
        raise ConfigError(f"stage={config.stage!r}: the model has no indexer (model.indexer_types)")
    if config.stage == "indexshare" and "shared" not in model_cfg.layer_indexer_types:
        raise ConfigError("model.indexer_types: stage 'indexshare' needs at least one 'shared' layer "
                          f"(got {model_cfg.layer_indexer_types})")
    if config.stage in ("dense_warmup", "indexshare") and not config.init_from:
        raise ConfigError(f"init_from=None: stage {config.stage!r} starts from a trained model "
                          "(the workdir of the previous stage)")


def validate_recipe(config) -> None:
    from glmjax.train.stages import STAGES

    if not config.recipe:
        raise ConfigError("recipe=(): stage='recipe' needs a tuple of stage names")
    for name in config.recipe:
        if name not in STAGES:
            raise ConfigError(f"recipe={tuple(config.recipe)!r}: unknown stage {name!r}; stages: {sorted(STAGES)}")
    for name in config.stages:
        if name not in STAGES:
            raise ConfigError(f"stages.{name}: unknown stage; stages: {sorted(STAGES)}")
