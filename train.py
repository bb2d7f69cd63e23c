"""`python train.py ...` = `glmjax-train ...`: see glmjax/cli/train.py."""
from glmjax.cli.train import FLAGS, cli, parse_flags  # noqa: F401  (FLAGS, parse_flags: tests/test_config_flags.py)

if __name__ == "__main__":
    cli()
