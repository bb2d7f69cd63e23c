"""PPO learning curves of the documented demo (`configs/ppo_tiny.py`, or any PPO config) over several seeds: one
PNG with training reward, held-out accuracy (greedy and sampled), value loss, entropy and KL to the starting
policy, plus a table of start -> end numbers per seed.

    python bench/ppo_curves.py [--config configs/ppo_tiny.py] [--seeds 0 1 2] [--out docs/ppo_curves.png]
    XLA_FLAGS=--xla_cpu_multi_thread_eigen=false taskset -c 0 python bench/ppo_curves.py   # one CPU thread

Each seed changes ppo.seed, which seeds the model's initialisation, the supervised warm-up's demonstrations and
the rollouts. Runs go to --workdir/seed<N> (metrics.jsonl as train.py writes it); --reuse plots existing runs.
"""
from __future__ import annotations

import argparse
import json
import os
import runpy
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from glmjax.rl import train_ppo  # noqa: E402

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


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="configs/ppo_tiny.py")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--workdir", default="runs/ppo_curves")
    ap.add_argument("--out", default="docs/ppo_curves.png")
    ap.add_argument("--reuse", action="store_true", help="plot the runs already in --workdir")
    args = ap.parse_args()
    runs = {}
    for seed in args.seeds:
        wd = os.path.join(args.workdir, f"seed{seed}")
        if not args.reuse:
            c = runpy.run_path(args.config)["get_config"]()
            c.ppo.seed = seed
            train_ppo(c, wd, progress=True)
        runs[seed] = read(wd)
    plot(runs, args.out, f"{args.config}, seeds {args.seeds}")
    print(table(runs))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
