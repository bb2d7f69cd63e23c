"""PPO learning curves of the documented demo (`configs/ppo_tiny.py`, or any PPO config) over several seeds: one
PNG with training reward, held-out accuracy (greedy and sampled), value loss, entropy and KL to the starting
policy, plus a table of start -> end numbers per seed.

    python bench/ppo_curves.py [--config configs/ppo_tiny.py] [--seeds 0 1 2] [--out docs/ppo_curves.png]
    XLA_FLAGS=--xla_cpu_multi_thread_eigen=false taskset -c 0 python bench/ppo_curves.py   # one CPU thread

Each seed changes ppo.seed, which seeds the model's initialisation, the supervised warm-up's demonstrations and
the rollouts. Runs go to --workdir/seed<N> (metrics.jsonl as train.py writes it); --reuse plots existing runs.

    python bench/ppo_curves.py --tasks arith rle tool [--steps 100] [--seeds 0 1 2] [--actor-lr 2e-5]
        [--set ppo.step_kl_per_nat=None ...]
    # -> docs/ppo_<task>.png

--tasks runs the user's path on each task of bench/rl_tasks.py (SFT JSONL through stage sft, then PPO and GRPO
on its prompts file from that checkpoint), plots both methods' seeds per task, and prints one table row per task,
method and seed with the bar of issue 41 at the end of the run (held-out greedy and sampled +0.10, training reward
+0.15) and the lowest evaluation against the start.
"""
from __future__ import annotations

import argparse
import ast
import json
import os
import runpy
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # rl_tasks

from glmjax.rl import train_ppo  # noqa: E402
from rl_tasks import TASKS  # noqa: E402

PANELS = (("reward_mean", "training reward (mean)"), ("eval", "held-out accuracy"), ("value_loss", "value loss"),
          ("entropy", "policy entropy (nats)"), ("kl_init", "KL(pi || starting policy)"))


def read(workdir: str) -> list[dict]:
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def smooth(x, n: int = 5):
    x = np.asarray(x, float)
    return np.convolve(x, np.ones(n) / n, "valid") if len(x) >= n else x


def plot(runs: dict[int, list[dict]], out: str, title: str):
    fig, grid = plt.subplots(2, 3, figsize=(13, 7))
    axes, legend_ax = grid.flat[:len(PANELS)], grid.flat[len(PANELS)]
    for (key, label), ax in zip(PANELS, axes):
        for i, (seed, rows) in enumerate(sorted(runs.items())):
            color = f"C{i}"
            if key == "eval":
                ev = [r for r in rows if "eval_accuracy" in r]
                steps = [r["step"] for r in ev]
                ax.plot(steps, [r["eval_sampled_accuracy"] for r in ev], "-o", color=color, ms=3,
                        label=f"seed {seed} sampled")
                ax.plot(steps, [r["eval_accuracy"] for r in ev], "--", color=color, alpha=0.6,
                        label=f"seed {seed} greedy")
            else:
                pts = [(r["step"], r[key]) for r in rows if r.get(key) is not None and "reward_mean" in r]
                if pts:
                    s, v = zip(*pts)
                    ax.plot(s[len(s) - len(smooth(v)):], smooth(v), color=color, label=f"seed {seed}")
        ax.set_title(label, fontsize=10)
        ax.set_xlabel("PPO step")
        ax.grid(alpha=0.3)
    legend_ax.axis("off")
    legend_ax.legend(*axes[1].get_legend_handles_labels(), loc="center", fontsize=9)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def table(runs: dict[int, list[dict]]) -> str:
    lines = ["| seed | held-out sampled | held-out greedy | training reward (steps 1-10 -> last 20) | "
             "explained variance (last 20) |", "|---:|---|---|---|---:|"]
    for seed, rows in sorted(runs.items()):
        ev = [r for r in rows if "eval_accuracy" in r]
        tr = [r for r in rows if "reward_mean" in r]
        evar = [r["explained_variance"] for r in tr[-20:] if r.get("explained_variance") is not None]
        lines.append(f"| {seed} | {ev[0]['eval_sampled_accuracy']:.3f} -> {ev[-1]['eval_sampled_accuracy']:.3f} | "
                     f"{ev[0]['eval_accuracy']:.3f} -> {ev[-1]['eval_accuracy']:.3f} | "
                     f"{np.mean([r['reward_mean'] for r in tr[:10]]):.3f} -> "
                     f"{np.mean([r['reward_mean'] for r in tr[-20:]]):.3f} | {np.nanmean(evar):.3f} |")
    return "\n".join(lines)


def overrides(config, sets: list[str]):
    """--set ppo.step_kl_per_nat=0.1 optim.lr=2e-5 ...: each dotted field of `config` set to the Python literal (or the
    string) after '='."""
    for item in sets:
        key, _, text = item.partition("=")
        try:
            value = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            value = text
        *path, leaf = key.split(".")
        node = config
        for part in path:
            node = node[part]
        if leaf not in node:
            raise SystemExit(f"--set {item}: the config has no field {key}")
        node[leaf] = value
    return config


def task_runs(task: str, root: str, seeds, steps: int | None, actor_lr: float | None = None, sets=()
              ) -> dict[str, dict[int, list[dict]]]:
    """The user's path on one task of bench/rl_tasks.py: its files, `train.py` stage sft (once), then PPO (gae) and
    GRPO from that checkpoint for every seed (the actor's lr: configs/ppo_tiny.py's, or `actor_lr`) -> {method:
    {seed: metrics rows}}. The SFT stage resumes or is reused as train.py's stages are; a PPO workdir whose metrics
    reach the configured steps is reused, any other resumes from its newest checkpoint (from the start without one)."""
    from glmjax.launch import run
    from rl_tasks import ppo_config, sft_config, write_task

    paths = write_task(task, os.path.join(root, "data"))
    sft = os.path.join(root, "sft")
    run(sft_config(task, paths), sft)
    out = {}
    for method in ("gae", "grpo"):
        out[method] = {}
        for seed in seeds:
            wd = os.path.join(root, f"{method}_seed{seed}" + (f"_lr{actor_lr:g}" if actor_lr else "")
                              + "".join(f"_{s}" for s in sets))
            c = overrides(ppo_config(task, paths, sft, method, seed, steps), sets)
            if actor_lr:
                c.optim.lr = actor_lr
            if not finished(wd, c.ppo.steps):
                run(c, wd)
            out[method][seed] = read(wd)
    return out


def finished(workdir: str, steps: int) -> bool:
    """Whether a PPO run in `workdir` logged its last step."""
    path = os.path.join(workdir, "metrics.jsonl")
    return os.path.exists(path) and any(r.get("step") == steps and "reward_mean" in r for r in read(workdir))


TASK_PANELS = (("reward_mean", "training reward (mean, 5-step average)"), ("eval_accuracy", "held-out greedy"),
               ("eval_sampled_accuracy", "held-out sampled"), ("kl_init", "KL(pi || SFT policy)"),
               ("entropy", "policy entropy (nats)"), ("value_loss", "value loss (PPO)"))
METHODS = {"gae": ("PPO", "-"), "grpo": ("GRPO", "--")}


def last(rows: list[dict]) -> dict[int, dict]:
    """{step: record} keeping a step's later line (a resumed run re-logs the steps after its last checkpoint)."""
    out: dict[int, dict] = {}
    for r in rows:
        out.setdefault(("eval" if "eval_accuracy" in r else "train", r["step"]), {}).update(r)
    return out


def series(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    kind = "eval" if key.startswith("eval") else "train"
    pts = sorted((s, r[key]) for (k, s), r in last(rows).items() if k == kind and r.get(key) is not None)
    return [s for s, _ in pts], [v for _, v in pts]


def plot_task(task: str, runs: dict, out: str, title: str):
    fig, grid = plt.subplots(2, 3, figsize=(14, 7.5))
    for (key, label), ax in zip(TASK_PANELS, grid.flat):
        for method, by_seed in runs.items():
            name, style = METHODS[method]
            for i, (seed, rows) in enumerate(sorted(by_seed.items())):
                s, v = series(rows, key)
                if not v:
                    continue
                if not key.startswith("eval"):
                    v = smooth(v)
                    s = s[len(s) - len(v):]
                ax.plot(s, v, style, color=f"C{i}", label=f"{name} seed {seed}", lw=1.2)
        ax.set_title(label, fontsize=10)
        ax.set_xlabel("PPO step")
        ax.grid(alpha=0.3)
    grid.flat[0].legend(fontsize=7, ncol=2)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=100)


def task_table(task: str, runs: dict) -> tuple[str, bool]:
    """Rows task | method | seed with start -> end and the issue's bar at the end of the run: greedy and sampled
    +0.10, training reward (first 10 -> last 20 steps) +0.15; beside it the lowest held-out eval against the start
    (a dip on the way) -> (markdown, all met)."""
    lines, ok_all = [], True
    for method, by_seed in runs.items():
        for seed, rows in sorted(by_seed.items()):
            _, g = series(rows, "eval_accuracy")
            _, sa = series(rows, "eval_sampled_accuracy")
            _, r = series(rows, "reward_mean")
            _, kl = series(rows, "kl_init")
            dr = np.mean(r[-20:]) - np.mean(r[:10])
            floor = min(min(gi - g[0] for gi in g), min(si - sa[0] for si in sa))
            ok = g[-1] - g[0] >= 0.10 and sa[-1] - sa[0] >= 0.10 and dr >= 0.15
            ok_all &= ok
            lines.append(f"| {task} | {METHODS[method][0]} | {seed} | {g[0]:.2f} -> {g[-1]:.2f} | "
                         f"{sa[0]:.2f} -> {sa[-1]:.2f} | {np.mean(r[:10]):.2f} -> {np.mean(r[-20:]):.2f} | "
                         f"{floor:+.2f} | {kl[-1]:.3f} | {'yes' if ok else 'no'} |")
    return "\n".join(lines), ok_all


TASK_HEADER = ("| task | method | seed | held-out greedy | held-out sampled | training reward (first 10 -> last 20) | "
               "lowest eval - start | KL to SFT (end) | bar at the end |\n|---|---|---:|---|---|---|---:|---:|---|")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="configs/ppo_tiny.py")
    ap.add_argument("--tasks", nargs="+", default=None, choices=tuple(TASKS),
                    help="instead of --config: the bench/rl_tasks.py tasks, SFT by train.py then PPO and GRPO")
    ap.add_argument("--steps", type=int, default=None, help="PPO steps of the task runs (default: ppo_tiny's)")
    ap.add_argument("--actor-lr", type=float, default=None, help="with --tasks: the actor's lr (default: ppo_tiny's)")
    ap.add_argument("--set", nargs="*", default=[], metavar="FIELD=VALUE",
                    help="config overrides of every PPO run, e.g. ppo.step_kl_per_nat=None (and its workdir's name)")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--workdir", default="runs/ppo_curves")
    ap.add_argument("--out", default="docs/ppo_curves.png", help="with --tasks: docs/ppo_<task>.png")
    ap.add_argument("--reuse", action="store_true", help="plot the runs already in --workdir")
    args = ap.parse_args()
    if args.tasks:
        tables, ok = [], True
        for task in args.tasks:
            runs = task_runs(task, os.path.join(args.workdir, task), args.seeds, args.steps, args.actor_lr, args.set)
            out = os.path.join(os.path.dirname(args.out) or ".", f"ppo_{task}.png")
            plot_task(task, runs, out, f"task {task}: SFT (train.py) then PPO / GRPO, seeds {args.seeds}")
            t, met = task_table(task, runs)
            tables.append(t)
            ok &= met
            print(f"wrote {out}")
        print(TASK_HEADER + "\n" + "\n".join(tables))
        print("bar met on every run" if ok else "bar NOT met on every run")
        return
    runs = {}
    for seed in args.seeds:
        wd = os.path.join(args.workdir, f"seed{seed}" + "".join(f"_{s}" for s in args.set))
        if not args.reuse:
            c = overrides(runpy.run_path(args.config)["get_config"](), args.set)
            c.ppo.seed = seed
            train_ppo(c, wd, progress=True)
        runs[seed] = read(wd)
    plot(runs, args.out, f"{args.config}, seeds {args.seeds}")
    print(table(runs))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
