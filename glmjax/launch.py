"""train.py's entry point: `run(config, workdir)` runs config.stage -- an LM stage or the recipe (glmjax.train) or
PPO post-training (glmjax.rl, its init_checkpoint read by glmjax.train's loader) -- after starting multi-host JAX
when config.parallel / the environment asks for it (glmjax.parallel.mesh).

Layering, bottom to top (imports only go down): glmjax.config / hardware -> model, optim, data, parallel -> train
-> rl -> launch -> train.py."""
from __future__ import annotations

from glmjax.config import ModelConfig
from glmjax.parallel import initialize_distributed
from glmjax.rl import train_ppo
from glmjax.train import run as run_lm
from glmjax.train.claim import claim
from glmjax.train.hooks import stop_signals
from glmjax.train.init_from import checkpoint_loader


def run(config, workdir: str, progress: bool = True) -> dict:
    """-> the summary (per stage for a recipe). The workdir is held for the run (glmjax/train/claim.py): a busy or
    foreign one is refused before anything is written."""
    with stop_signals():  # SIGTERM / SIGINT from here on: a clean stop (glmjax/train/hooks.py), in set-up too
        initialize_distributed(config.parallel if "parallel" in config else None)
        with claim(workdir):
            if config.stage == "ppo":
                return train_ppo(config, workdir, progress,
                                 load_params=checkpoint_loader(ModelConfig.from_dict(config.model)))
            return run_lm(config, workdir, progress)
