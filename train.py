"""Train a glmjax model: python train.py --config=configs/tiny.py --workdir=runs/x [--config.train.steps=100]"""
import jax
from absl import app, flags
from ml_collections import config_flags

from glmjax.train import train

config_flags.DEFINE_config_file("config", "configs/tiny.py", "experiment config file (ML-collections)")
flags.DEFINE_string("workdir", "runs/default", "output directory: config.json, metrics.jsonl")
flags.DEFINE_string("compilation_cache", None, "directory for JAX's persistent compilation cache (off if unset); "
                    "saves the compile time of repeated runs")
FLAGS = flags.FLAGS


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    if FLAGS.compilation_cache:
        jax.config.update("jax_compilation_cache_dir", FLAGS.compilation_cache)
    train(FLAGS.config, FLAGS.workdir)


if __name__ == "__main__":
    app.run(main)
