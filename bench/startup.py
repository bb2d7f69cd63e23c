"""Time to first step of each stage of the tiny recipe, cold (empty compilation cache) and warm (the same command
again in a new workdir: every program comes from the per-user persistent cache, glmjax/cli/runtime.py).

    python bench/startup.py [--config configs/recipe_tiny.py] [--out bench/results/startup.json]

Each stage is one `python train.py --config=... --config.stage=STAGE` process as a user starts it (no JAX_PLATFORMS,
default cache settings except $GLMJAX_CACHE_DIR pointing at a fresh directory of this benchmark), the stages after
pretrain initialised from the previous stage's workdir (`--config.init_from`). Time to first step: from starting the
process to the first training record (step 1) in its metrics.jsonl. The cold pass runs first, then the warm pass
in new workdirs; wall and CPU seconds of the whole process beside it, the 1-minute load average before and after.
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STAGES = ("pretrain", "dense_warmup", "sparse_adapt", "indexshare")
FLAGS = ["--config.train.steps=2", "--config.train.log_every=1", "--config.train.eval_every=0",
         "--config.train.eval_batches=0", "--config.train.checkpoint_every=1000"]
WARMUP = "warmup_steps=1"  # the optimizer's warm-up must be shorter than the 2 steps


def first_record(path: str) -> bool:
    if not os.path.exists(path):
        return False
    with open(path) as f:
        return any('"loss"' in line for line in f)


def stage_flags(config: str, stage: str) -> list[str]:
    """FLAGS, plus the same values for the fields the config sets per stage (`stages.<stage>.train.steps` would
    win over `train.steps`)."""
    sys.path.insert(0, ROOT)
    module = importlib.import_module(os.path.splitext(config)[0].replace(os.sep, "."))
    own = module.get_config().get("stages", {}).get(stage, {})
    extra = [f"--config.stages.{stage}.train.{f[len('--config.train.'):]}" for f in FLAGS
             if f[len("--config.train."):].split("=")[0] in own.get("train", {})]
    extra += [f"--config.optim.{WARMUP}"] + ([f"--config.stages.{stage}.optim.{WARMUP}"]
                                             if "warmup_steps" in own.get("optim", {}) else [])
    return FLAGS + extra


def run_stage(config: str, stage: str, workdir: str, init_from: str | None, env: dict) -> dict:
    cmd = [sys.executable, "train.py", f"--config={config}", f"--config.stage={stage}", *stage_flags(config, stage),
           f"--workdir={workdir}"] + ([f"--config.init_from={init_from}"] if init_from else [])
    cpu0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    metrics, first = os.path.join(workdir, "metrics.jsonl"), None
    while p.poll() is None:
        if first is None and first_record(metrics):
            first = time.perf_counter() - t0
        time.sleep(0.02)
    wall = time.perf_counter() - t0
    out = p.stdout.read()
    if p.returncode != 0:
        sys.exit(f"{stage}: exit status {p.returncode}\n{out[-3000:]}")
    if first is None:  # the process ended between two polls
        first = wall if first_record(metrics) else float("nan")
    cpu1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    return {"stage": stage, "first_step_s": first, "process_wall_s": wall,
            "process_cpu_s": (cpu1.ru_utime - cpu0.ru_utime) + (cpu1.ru_stime - cpu0.ru_stime)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="configs/recipe_tiny.py")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "startup.json"))
    args = ap.parse_args()
    root = tempfile.mkdtemp(prefix="glmjax_startup_")
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "XLA_FLAGS", "JAX_COMPILATION_CACHE_DIR")}
    env["GLMJAX_CACHE_DIR"] = os.path.join(root, "cache")
    load_before = os.getloadavg()[0]
    rows = []
    for temperature in ("cold", "warm"):
        previous = None
        for stage in STAGES:
            workdir = os.path.join(root, temperature, stage)
            r = run_stage(args.config, stage, workdir, previous, env)
            rows.append({"cache": temperature, **r})
            previous = workdir
            print(f"{temperature:4s} {stage:13s} first step {r['first_step_s']:6.1f} s   process "
                  f"{r['process_wall_s']:6.1f} s wall, {r['process_cpu_s']:6.1f} s CPU", flush=True)
    result = {"config": args.config, "load_before": load_before, "load_after": os.getloadavg()[0], "rows": rows}
    print(f"load average (1 min) {result['load_before']:.2f} before, {result['load_after']:.2f} after")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
