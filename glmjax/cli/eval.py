"""Long-context retrieval of a checkpoint, dense and sparse attention (`glmjax-eval`, or `python -m glmjax.cli.eval`):

  glmjax-eval --checkpoint runs/retrieval/sparse_adapt --tasks passkey niah_single --lengths 512 1024 2048 4096 \\
      --out runs/retrieval/eval

--checkpoint is a stage or PPO workdir (its newest intact checkpoint), a directory written by `glmjax-hf import`, or
a Hugging Face checkpoint. For every task x length, --samples test prompts at each of --depths (where the needle sits
in the filler: 0 first, 1 last), RULER's synthetic tasks as bytes (glmjax/eval/retrieval.py), answered greedily by the
decoder of each --modes and scored by RULER's string match; and each indexer's needle recall: the share of queries
after the needle whose top-k holds the needle's positions (glmjax/eval/needles.py). Prints the table and writes
<out>/retrieval.json and <out>/retrieval.md. The prompts are bytes: for a model trained with the byte tokenizer.
Errors end in one line on stderr and exit status 2 (3: no intact checkpoint).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

from glmjax.cli.runtime import configure_jax
from glmjax.workdir import CheckpointError


def main(argv: list[str] | None = None) -> int:
    from glmjax.eval.harness import MODES
    from glmjax.eval.retrieval import TASKS

    ap = argparse.ArgumentParser(prog="glmjax-eval", description=__doc__.split("\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--checkpoint", required=True, help="stage or PPO workdir, imported checkpoint or HF checkpoint")
    ap.add_argument("--tasks", nargs="+", default=["passkey", "niah_single"], help=f"of {', '.join(TASKS)}")
    ap.add_argument("--lengths", nargs="+", type=int, default=[512, 1024, 2048, 4096], help="prompt bytes")
    ap.add_argument("--depths", nargs="+", type=float, default=[0.0, 0.25, 0.5, 0.75, 1.0])
    ap.add_argument("--samples", type=int, default=4, help="prompts per task x length x depth")
    ap.add_argument("--modes", nargs="+", default=list(MODES), help="attention of the decoder")
    ap.add_argument("--seed", type=int, default=0, help="which test prompts")
    ap.add_argument("--batch-size", type=int, default=8, help="prompts decoded together")
    ap.add_argument("--out", default=None, help="directory for retrieval.json and retrieval.md (default: none)")
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument("--compilation-cache", default=None, help="JAX's persistent compilation cache (default: "
                    "~/.cache/glmjax/jax_cache, see glmjax/cli/runtime.py); empty = off")
    args = ap.parse_args(argv)
    configure_jax(args.compilation_cache)
    from glmjax.eval.harness import check, evaluate, markdown
    from glmjax.resolve import load_model
    try:
        check(args.tasks, args.lengths, args.depths, args.samples, args.modes)  # before loading anything
        if args.batch_size < 1:
            raise ValueError(f"--batch-size {args.batch_size}: must be >= 1")
        model, loaded = load_model(args.checkpoint, "--checkpoint")
        result = evaluate(model, args.tasks, args.lengths, args.depths, args.samples, args.modes, args.seed,
                          args.batch_size, progress=not args.no_progress)
    except CheckpointError as e:
        print(f"checkpoint error: {e}", file=sys.stderr)
        return 3
    except (FileNotFoundError, ValueError) as e:  # ConfigError, HFCheckpointError are ValueErrors
        print(f"error: {e}", file=sys.stderr)
        return 2
    result["checkpoint"] = f"{args.checkpoint} ({loaded.where})"
    table = markdown(result, result["checkpoint"])
    print(table, end="")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "retrieval.json"), "w") as f:
            json.dump(result, f, indent=1)
        with open(os.path.join(args.out, "retrieval.md"), "w") as f:
            f.write(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
