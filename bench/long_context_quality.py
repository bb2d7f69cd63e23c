"""DSA's purpose, measured: long-context retrieval of the dense model and of its sparse descendants, as GLM-5's
Table 6 in miniature (the GLM-5 report: RULER of a warmup-only variant, which trains only the indexer, vs full DSA).

    python bench/long_context_quality.py --workdir runs/retrieval [--lengths 512 1024 2048 4096] [--samples 8]
    python bench/long_context_quality.py --workdir runs/retrieval --reuse      # evaluate existing stages only
    python bench/long_context_quality.py --workdir runs/retrieval_s1 --set=--config.train.seed=1   # another seed

Trains configs/recipe_retrieval.py with train.py (the user's path; a finished stage is skipped, an interrupted one
resumes), then evaluates each row on the test prompts of glmjax/eval/retrieval.py (RULER's synthetic tasks as bytes,
test answers never trained on) with glmjax/eval/harness.py:

  dense         the pretrain stage's model, dense attention
  warmup-only   dense_warmup's (indexers trained on the frozen dense model, the main model untouched), sparse
  full DSA      sparse_adapt's (all weights adapted to top-k attention), sparse
  IndexShare    indexshare's (every 2nd layer reuses the previous layer's top-k), sparse

Columns: task x length (accuracy by RULER's string match, mean over the depths), and the needle recall of the
indexers (mean over the layers with one). Writes <workdir>/quality.json, quality.md and quality.png (accuracy vs
length per row and task; the recall beside it) and prints the table with the wall time and the load.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

ROWS = (("dense", "pretrain", "dense"), ("warmup-only", "dense_warmup", "sparse"),
        ("full DSA", "sparse_adapt", "sparse"), ("IndexShare", "indexshare", "sparse"))


def train(workdir: str, extra: list[str]) -> int:
    cmd = [sys.executable, "train.py", "--config=configs/recipe_retrieval.py", f"--workdir={workdir}", *extra]
    print("+", " ".join(cmd), flush=True)
    return subprocess.run(cmd, cwd=ROOT).returncode


def table(rows: dict, lengths, tasks) -> str:
    cols = [(t, L) for t in tasks for L in lengths]
    lines = ["| row | " + " | ".join(f"{t} {L}" for t, L in cols) + " |", "|---|" + "---:|" * len(cols)]
    for name, r in rows.items():
        lines.append(f"| {name} | " + " | ".join(f"{r['accuracy'][t][str(L)]:.2f}" for t, L in cols) + " |")
    for name, r in rows.items():
        lines.append(f"| {name}: needle recall | " + " | ".join(f"{r['recall'][t][str(L)]:.2f}" for t, L in cols)
                     + " |")
    return "\n".join(lines) + "\n"


def plot(rows: dict, lengths, tasks, path: str, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(tasks) + 1, figsize=(4.2 * (len(tasks) + 1), 3.8), squeeze=False)
    for i, (name, r) in enumerate(rows.items()):
        for ax, t in zip(axes[0], tasks):
            ax.plot(lengths, [r["accuracy"][t][str(L)] for L in lengths], "o-", color=f"C{i}", label=name)
        axes[0, -1].plot(lengths, [np.mean([r["recall"][t][str(L)] for t in tasks]) for L in lengths], "o-",
                         color=f"C{i}", label=name)
    for ax, t in zip(axes[0], tasks):
        ax.set_title(f"{t}: accuracy", fontsize=10)
    axes[0, -1].set_title("needle recall of the indexers", fontsize=10)
    for ax in axes[0]:
        ax.set_xscale("log", base=2)
        ax.set_xticks(lengths, [str(L) for L in lengths])
        ax.set_ylim(-0.03, 1.03)
        ax.set_xlabel("prompt length (bytes = tokens)")
        ax.grid(alpha=0.3)
    axes[0, 0].legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workdir", default="runs/retrieval")
    ap.add_argument("--tasks", nargs="+", default=["passkey", "niah_single"])
    ap.add_argument("--lengths", nargs="+", type=int, default=[512, 1024, 2048, 4096])
    ap.add_argument("--depths", nargs="+", type=float, default=[0.0, 0.25, 0.5, 0.75, 1.0])
    ap.add_argument("--samples", type=int, default=8, help="test prompts per task x length x depth")
    ap.add_argument("--reuse", action="store_true", help="evaluate the stages already trained, train nothing")
    ap.add_argument("--set", action="append", default=[], metavar="FLAG",
                    help="an extra train.py flag, repeatable: --set=--config.train.seed=1")
    args = ap.parse_args(argv)
    t0, load0 = time.time(), os.getloadavg()[0]
    if not args.reuse and (rc := train(args.workdir, args.set)):
        print(f"train.py exited {rc}: nothing evaluated", file=sys.stderr)
        return rc
    trained = time.time() - t0

    from glmjax.cli.runtime import configure_jax
    configure_jax()
    from glmjax.eval.harness import evaluate
    from glmjax.resolve import load_model

    rows = {}
    for name, stage, mode in ROWS:
        path = os.path.join(args.workdir, stage)
        if not os.path.isdir(path):
            print(f"{name}: no {path}, left out")
            continue
        model, loaded = load_model(path, "--workdir")
        r = evaluate(model, args.tasks, args.lengths, args.depths, args.samples, (mode,))
        recall = {t: {L: float(np.mean([r["needle_recall"][layer][t][L] for layer in r["needle_recall"]]))
                      for L in r["accuracy"][mode][t]} for t in args.tasks}
        rows[name] = {"stage": loaded.where, "mode": mode, "accuracy": r["accuracy"][mode], "recall": recall,
                      "by_depth": r["by_depth"][mode], "needle_recall": r["needle_recall"]}
        print(f"{name} ({loaded.where}, {mode}): " + json.dumps(r["accuracy"][mode]), flush=True)
    wall, load1 = time.time() - t0, os.getloadavg()[0]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    md = table(rows, args.lengths, args.tasks)
    note = (f"configs/recipe_retrieval.py at {commit}: {args.samples} test prompts per task x length x depth "
            f"({len(args.depths)} depths); wall {wall / 60:.1f} min (training {trained / 60:.1f}), load average "
            f"{load0:.2f} before, {load1:.2f} after")
    print(md + "\n" + note)
    with open(os.path.join(args.workdir, "quality.json"), "w") as f:
        json.dump({"rows": rows, "lengths": args.lengths, "tasks": args.tasks, "depths": args.depths,
                   "samples": args.samples, "commit": commit, "wall_s": wall, "train_s": trained,
                   "load": [load0, load1]}, f, indent=1)
    with open(os.path.join(args.workdir, "quality.md"), "w") as f:
        f.write(md + "\n" + note + "\n")
    plot(rows, args.lengths, args.tasks, os.path.join(args.workdir, "quality.png"), note)
    return 0


if __name__ == "__main__":
    sys.exit(main())
