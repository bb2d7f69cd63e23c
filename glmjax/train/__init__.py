"""Training: the train config section, optimizer + jitted steps, aux-loss-free router-bias updates, the loop."""
from glmjax.train.config import default_train_config, validate_train_config
from glmjax.train.loop import train

__all__ = ["default_train_config", "train", "validate_train_config"]
