"""Training: config sections, the GLM-5 stages and their surgery, optimizer + the train / eval steps, aux-loss-free
router-bias updates, orbax checkpoints, the loop's hooks, the LM loop (`run`: a stage or the recipe; train.py
reaches it through glmjax.launch), AOT compilation of the train step (glmjax/train/aot.py)."""
from glmjax.train.config import default_train_config, experiment_fields, stage_config, validate_train_config
from glmjax.train.loop import run, train
from glmjax.train.stages import STAGES

__all__ = ["STAGES", "default_train_config", "experiment_fields", "run", "stage_config", "train",
           "validate_train_config"]
