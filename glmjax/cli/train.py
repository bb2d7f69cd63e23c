"""Train a glmjax model, one stage or a whole recipe (`glmjax-train`, or `python train.py` from the repo root):

  python train.py --config=configs/recipe_tiny.py --workdir=runs/x            # the stages of config.recipe
  python train.py --config=configs/tiny.py --workdir=runs/y --config.train.steps=100
  python train.py --config=configs/recipe_tiny.py --config.stage=sparse_adapt --config.init_from=runs/x/dense_warmup \\
      --workdir=runs/z

  python train.py --config=configs/glm5_recipe.py --dry-run --topology=v5p:8x8x4   # fits? memory per chip

Running the same command again resumes from the newest checkpoint in workdir (finished stages are skipped). A
changed config stops with the list of changed fields (see glmjax/train/resume.py for train.on_config_change).
Errors in the config, the flags, the data or the checkpoints end in one line on stderr and a non-zero exit status
(2: config / flags / data, 3: no usable checkpoint, 1: stopped on a non-finite loss or a full disk); --debug adds
the traceback. SIGTERM / SIGINT checkpoint the last step trained and exit 0 (in set-up: one line, exit 0).
"""
import os
import re
import sys

from absl import app, flags, logging
from ml_collections import config_flags

config_flags.DEFINE_config_file("config", "configs/tiny.py", "experiment config file (ML-collections)")
flags.DEFINE_string("workdir", "runs/default", "output directory: config.json, metrics.jsonl, tb/, checkpoints/")
flags.DEFINE_string("compilation_cache", None, "directory of JAX's persistent compilation cache (default: "
                    "$GLMJAX_CACHE_DIR, else ~/.cache/glmjax/jax_cache); --compilation_cache= turns it off. A rerun of "
                    "a stage loads its compiled steps instead of compiling them (glmjax/cli/runtime.py)")
flags.DEFINE_bool("dry_run", False, "compile every stage's train step ahead of time for --topology and print "
                  "whether it fits a chip and its memory per chip; trains nothing (also --dry-run)")
flags.DEFINE_string("topology", None, "TPU topology for --dry-run, e.g. v5p:8x8x4 (256 v5p chips), v5e:2x4")
flags.DEFINE_integer("num_slices", 1, "slices of --topology for --dry-run (multi-slice pods)")
flags.DEFINE_bool("debug", False, "print the full traceback of an error (by default one line)")
FLAGS = flags.FLAGS


def parse_flags(argv):
    """absl's parsing, with a config override of an unknown field reported in one line, not a traceback; --help
    prints this module's docstring and flags and exits 0."""
    spelled = {"--dry-run": "--dry_run", "--num-slices": "--num_slices"}  # the dashed spellings of two flags
    argv = [spelled.get(name, name) + eq + value for name, eq, value in (a.partition("=") for a in argv)]
    if any(a in ("-h", "--help", "-help", "--helpshort", "-?") for a in argv[1:]):
        print(__doc__)
        print(FLAGS.module_help(__name__))
        sys.exit(0)
    try:
        rest = FLAGS(argv)
        "stage" in FLAGS.config  # noqa: B015 -- a config file that did not load fails here, not at first use
        return rest
    except flags.Error as e:
        if raised_in_config_file(e, argv):
            config_file_error(e, argv)
        fail(f"flag error: {e}", 2)
    except OSError as e:  # ml_collections: the file is missing, or failed to load
        config_file_error(e, argv)
    except (KeyError, AttributeError, TypeError, ValueError) as e:
        if "--debug" in argv:
            raise
        if raised_in_config_file(e, argv):
            config_file_error(e, argv)
        inner = e.args[0] if e.args else e
        text = str(inner.args[0] if isinstance(inner, KeyError) and inner.args else inner)
        text = text.replace("\\'", "'")
        quoted = re.search(r"'([^'\n]+)'", text)
        name = quoted.group(1) if quoted else text.split("\n")[0].strip("'\"")
        culprit = next((a for a in argv[1:] if name in a), "a --config override")
        fail(f"flag error: {culprit}: no field {name!r} in this config"
             + (f" ({text.splitlines()[-1]})" if "Did you mean" in text else ""), 2)
    except Exception as e:  # noqa: BLE001 -- raised by the config file's own code
        config_file_error(e, argv)


def raised_in_config_file(e: BaseException, argv: list[str]) -> bool:
    """Whether `e` (or an exception it was raised from) came out of the --config file's own code."""
    given = next((a.partition("=")[2] for a in argv[1:] if a.startswith("--config=")), "configs/tiny.py")
    path = os.path.abspath(given.partition(".py:")[0] + (".py" if ".py:" in given else ""))
    seen, todo = set(), [e]
    while todo:
        x = todo.pop()
        if x is None or id(x) in seen:
            continue
        seen.add(id(x))
        tb = x.__traceback__
        while tb is not None:
            if os.path.abspath(tb.tb_frame.f_code.co_filename) == path:
                return True
            tb = tb.tb_next
        todo += [x.__cause__, x.__context__]
    return False


def config_file_error(e: Exception, argv: list[str]):
    """A --config file that does not load (missing, or its code raised): one line naming it and the first cause."""
    if "--debug" in argv:
        raise e
    root = e
    while root.__cause__ or root.__context__:
        root = root.__cause__ or root.__context__
    given = next((a for a in argv[1:] if a.startswith("--config=")), "--config")
    text = [x.strip() for x in str(root).strip().splitlines()]
    fail(f"flag error: {given}: the config file does not load ({type(root).__name__}: {text[-1] if text else ''})", 2)


def fail(message: str, code: int):
    print(message, file=sys.stderr)
    sys.exit(code)


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    logging.set_verbosity(logging.WARNING)  # orbax logs every checkpoint file at INFO
    from glmjax.cli.runtime import configure_jax

    cache = configure_jax(FLAGS.compilation_cache)
    from glmjax.train import programs

    programs.enable(os.path.join(cache, "programs") if cache else None)  # compiled train steps, beside the cache
    from glmjax.config import ConfigError
    from glmjax.data.read_ahead import Interrupted
    from glmjax.data.sources import DataError
    from glmjax.launch import run
    from glmjax.train.checkpoint import CheckpointError
    from glmjax.train.loop import DiskFull

    errors = {ConfigError: ("config error", 2), DataError: ("data error", 2), CheckpointError: ("checkpoint error", 3),
              FloatingPointError: ("stopped", 1), DiskFull: ("stopped", 1), Interrupted: ("stopped", 0)}
    try:
        if FLAGS.dry_run:
            return dry_run(FLAGS.config)
        if FLAGS.topology:
            raise ConfigError(f"--topology={FLAGS.topology!r} is for --dry-run only (training runs on this host's "
                              "devices)")
        run(FLAGS.config, FLAGS.workdir)
    except tuple(errors) as e:
        if FLAGS.debug:
            raise
        what, code = next(v for k, v in errors.items() if isinstance(e, k))
        fail(f"{what}: {e}", code)
    return 0


def dry_run(config) -> int:
    """--dry-run: exit status 0 if every stage fits, 1 if one does not (2 for a config error, raised)."""
    from glmjax.config import ConfigError
    from glmjax.train.dry_run import dry_run as compile_stages

    if not FLAGS.topology:
        raise ConfigError("--dry-run needs --topology, e.g. --topology=v5p:8x8x4")
    results = compile_stages(config, FLAGS.topology, FLAGS.num_slices)
    return 0 if all(r["fits"] for r in results) else 1


def cli():
    """The `glmjax-train` entry point."""
    app.run(main, flags_parser=parse_flags)


if __name__ == "__main__":
    cli()
