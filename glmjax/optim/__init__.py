"""Optimizers: Muon / Muon-Split (on optax.contrib.scale_by_muon) for matrices, AdamW for the rest, explicit
path-based groups with their own learning rates, warmup + cosine/constant schedules, per-group gradient clipping."""
from glmjax.optim.config import default_optim_config, validate_optim_config
from glmjax.optim.grouping import RULES, GroupTable, ParamInfo
from glmjax.optim.muon import GroupedState
from glmjax.optim.optimizer import build_optimizer
from glmjax.optim.schedules import make_schedule

__all__ = ["RULES", "GroupTable", "GroupedState", "ParamInfo", "build_optimizer", "default_optim_config",
           "make_schedule", "validate_optim_config"]
