"""Train a glmjax model, one stage or a whole recipe:

  python train.py --config=configs/recipe_tiny.py --workdir=runs/x            # the stages of config.recipe
  python train.py --config=configs/tiny.py --workdir=runs/y --config.train.steps=100
  python train.py --config=configs/recipe_tiny.py --config.stage=sparse_adapt --config.init_from=runs/x/dense_warmup \\
      --workdir=runs/z

Running the same command again resumes from the newest checkpoint in workdir (finished stages are skipped).
"""
import sys

import jax
from absl import app, flags, logging
from ml_collections import config_flags

from glmjax.config import ConfigError
from glmjax.train import run

config_flags.DEFINE_config_file("config", "configs/tiny.py", "experiment config file (ML-collections)")
flags.DEFINE_string("workdir", "runs/default", "output directory: config.json, metrics.jsonl, tb/, checkpoints/")
flags.DEFINE_string("compilation_cache", None, "directory for JAX's persistent compilation cache (off if unset); "
                    "saves the compile time of repeated runs")
FLAGS = flags.FLAGS


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    logging.set_verbosity(logging.WARNING)  # orbax logs every checkpoint file at INFO
    if FLAGS.compilation_cache:
        jax.config.update("jax_compilation_cache_dir", FLAGS.compilation_cache)
    try:
        run(FLAGS.config, FLAGS.workdir)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    except FloatingPointError as e:
        print(f"stopped: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    app.run(main)
