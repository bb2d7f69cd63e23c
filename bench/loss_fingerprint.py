"""Per-step losses of short runs of every training stage, as exact float hex, for refactors that must not change
numbers: 10 steps of each stage of configs/recipe_tiny.py (each stage starting from the previous one) and 5 PPO
steps of configs/ppo_tiny.py. f32, CPU, one process.

  python bench/loss_fingerprint.py --out /tmp/before.json
  python bench/loss_fingerprint.py --out /tmp/after.json --compare /tmp/before.json   # exit 1 on any difference
"""
import argparse
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def losses(path: str, keys=("loss",)) -> list:
    """[step, key=hex, ...] of every step record with at least one of `keys` (the others absent, e.g. the policy
    loss during PPO's critic warm-up)."""
    out = []
    for line in open(path):
        rec = json.loads(line)
        if "step" in rec and any(k in rec for k in keys):
            out.append([rec["step"]] + [f"{k}={float(rec[k]).hex()}" for k in keys if k in rec])
    return out


def fingerprint(workdir: str) -> dict:
    from configs import ppo_tiny, recipe_tiny
    from glmjax.rl import train_ppo
    from glmjax.train import run

    c = recipe_tiny.get_config()
    c.optim.warmup_steps = 3  # pretrain's 30 would exceed 10 steps
    for stage in c.recipe:
        c.stages[stage].train.update(steps=10, eval_every=0, checkpoint_every=10, log_every=1)
    run(c, os.path.join(workdir, "recipe"), progress=False)
    result = {stage: losses(os.path.join(workdir, "recipe", stage, "metrics.jsonl")) for stage in c.recipe}
    p = ppo_tiny.get_config()
    p.optim.warmup_steps = 2
    p.ppo.update(steps=5, critic_warmup_steps=2, sft_steps=10, eval_every=0, eval_problems=8, eval_samples=2)
    train_ppo(p, os.path.join(workdir, "ppo"), progress=False)
    result["ppo"] = losses(os.path.join(workdir, "ppo", "metrics.jsonl"),
                           ("reward_mean", "value_loss", "policy_loss", "entropy"))
    return result


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--compare", help="a previous --out file; exit 1 unless every loss is bitwise equal")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        result = fingerprint(d)
    json.dump(result, open(args.out, "w"), indent=1)
    for name, rows in result.items():
        print(f"{name}: {len(rows)} steps, last {rows[-1] if rows else None}")
    if args.compare:
        before = json.load(open(args.compare))
        diff = [k for k in before if before[k] != result.get(k) or not before[k]]
        print("bitwise identical" if not diff else f"DIFFERENT: {diff}")
        sys.exit(1 if diff else 0)


if __name__ == "__main__":
    main()
