"""PPO stage throughput on CPU: rollout tokens/s, trainer tokens/s, and how much of the trainer's time is spent
waiting for rollouts, with the asynchronous rollout worker and without it.

    python bench/rl.py [--config configs/ppo_tiny.py] [--steps 40] [--sft-steps 30] [--json out.json]
    python bench/rl.py --sft-steps 0 --max-response-len 32 --epochs 1 --minibatches 1   # rollout-heavy

Runs `train_ppo` twice with the same config (ppo.async_rollout False, then True), each after the same short
supervised warm-up; the first PPO step (compilation) is excluded from every average. rollout tokens/s counts the
response tokens a rollout batch contains (policy + tool tokens) over the wall time of generating it; trainer
tokens/s counts the non-padding tokens of the PPO batch (x ppo_epochs) over the trainer's own time (step time
minus waiting); wait share = time blocked on rollouts / step time.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import runpy
import sys
import tempfile
import time

import jax

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from glmjax.rl import train_ppo  # noqa: E402


def load_config(path: str):
    return runpy.run_path(path)["get_config"]()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="configs/ppo_tiny.py")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--sft-steps", type=int, default=30)
    ap.add_argument("--max-response-len", type=int, default=None, help="override ppo.max_response_len")
    ap.add_argument("--epochs", type=int, default=None, help="override ppo.ppo_epochs")
    ap.add_argument("--minibatches", type=int, default=None, help="override ppo.minibatches")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    rows = []
    for use_async in (False, True):
        c = load_config(args.config)
        c.ppo.steps, c.ppo.sft_steps, c.ppo.async_rollout = args.steps, args.sft_steps, use_async
        c.ppo.eval_every, c.ppo.critic_warmup_steps = 0, 0
        for field, value in (("max_response_len", args.max_response_len), ("ppo_epochs", args.epochs),
                             ("minibatches", args.minibatches)):
            if value is not None:
                c.ppo[field] = value
        c.optim.warmup_steps = min(c.optim.warmup_steps, args.steps - 1)
        with tempfile.TemporaryDirectory() as wd:
            t0 = time.perf_counter()
            s = train_ppo(c, wd, progress=False)
            wall = time.perf_counter() - t0
        rows.append({"async": use_async, "rollout_tokens_per_s": s["rollout_tokens_per_s"],
                     "response_tokens": s["last"]["response_tokens"],
                     "trainer_tokens_per_s": s["trainer_tokens_per_s"], "wait_share": s["wait_share"],
                     "step_s": s["step_s"], "steps": args.steps, "wall_s": wall})
    print(f"\nconfig {args.config}: {c.ppo.prompts_per_step} prompts x {c.ppo.group_size} samples, "
          f"{c.ppo.max_prompt_len}+{c.ppo.max_response_len} tokens, {c.ppo.ppo_epochs} epochs x "
          f"{c.ppo.minibatches} mini-batches, {args.steps} PPO steps, {args.sft_steps} warm-up steps; "
          f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, jax {jax.__version__}")
    print("| rollouts | policy tokens/response | rollout tokens/s | trainer tokens/s | trainer wait share | "
          "mean step s |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {'async' if r['async'] else 'sync'} | {r['response_tokens']:.1f} | "
              f"{r['rollout_tokens_per_s']:,.0f} | {r['trainer_tokens_per_s']:,.0f} | {r['wait_share']:.1%} | "
              f"{r['step_s']:.3f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
