"""Training: config sections, the GLM-5 stages and their surgery, optimizer + jitted steps, aux-loss-free router-bias
updates, orbax checkpoints, the loop (`run` = train.py's entry point)."""
from glmjax.train.config import default_train_config, experiment_fields, stage_config, validate_train_config
from glmjax.train.loop import run, train
from glmjax.train.stages import STAGES

__all__ = ["STAGES", "default_train_config", "experiment_fields", "run", "stage_config", "train",
           "validate_train_config"]
