"""Fault injection: kill -9 train.py at random moments, resume, and check the losses are bitwise those of an
uninterrupted run.

    python bench/fault_injection.py [--kills 10] [--seed 0] [--steps 30] [--checkpoint-every 3] [--dir DIR]
    python bench/fault_injection.py --stage ppo [--kills 10] [--steps 12] [--checkpoint-every 2]

One uninterrupted run of configs/tiny.py (tiny: seq 32, batch 2, `--steps` steps, a checkpoint every
`--checkpoint-every` steps, keeping 2) is the reference; `--reference DIR` reuses a finished one. Then, until
`--kills` kills have been made: a fresh workdir gets between 1 and `--max-kills-per-workdir` kills (drawn from the
seeded RNG); each launch of the same command is sent SIGKILL a delay after it logs its first training step, the
delay drawn uniformly over the reference's training time (so kills land mid-training and mid-checkpoint-write, not
during start-up; a launch that finishes first is simply done), and the same command is started again until it
exits by itself. Every workdir must then end with exit status 0, summary.json, and every loss record in
metrics.jsonl (the re-logged steps after each resume included) bitwise equal to the reference's loss of that step,
for all steps. `--stage ppo` does the same with a small PPO run (PPO_FLAGS: synchronous rollouts), comparing every
value of each step record but the timings (losses, rewards, KL, lr multiplier, ...).

Prints one row per kill (kill #, delay, the last step that launch logged before the kill or "setup", the step the
next launch resumed from: "0 (fresh)" without a checkpoint, "complete" if the kill came after summary.json, "-"
if that launch was itself killed before restoring; whether
the workdir ended identical) and exits 1 on any mismatch or failed launch.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from glmjax.train.loop import loss_records  # noqa: E402


def flags(stage: str, steps: int, every: int) -> list[str]:
    if stage == "ppo":
        return PPO_FLAGS + [f"--config.ppo.steps={steps}", f"--config.ppo.checkpoint_every={every}",
                            "--config.ppo.keep_checkpoints=2"]
    return ["--config=configs/tiny.py", f"--config.train.steps={steps}", "--config.train.seq_len=32",
            "--config.train.batch_size=2", "--config.train.log_every=1", "--config.train.eval_batches=0",
            f"--config.train.checkpoint_every={every}", "--config.train.keep_checkpoints=2",
            "--config.optim.warmup_steps=2", "--config.data.max_docs=50"]


# configs/ppo_tiny.py made small, with synchronous rollouts (with asynchronous ones a resumed run's next batch comes
# from the restored weights, not the previous version's: not bitwise); 2 epochs x 2 mini-batches exercise the
# mini-batch RNG, a critic warm-up step both learners' states; the supervised warm-up is long enough that rewards
# (and so advantages and gradients) are not all 0; the model at 2 layers and 8 experts (a launch takes half the time
# of the 6-layer one's, cold or from the compilation cache; the tests' small PPO model)
SMALL_PPO_MODEL = dict(num_hidden_layers=2, indexer_types=("full", "shared"), n_routed_experts=8, num_experts_per_tok=2)
PPO_FLAGS = ["--config=configs/ppo_tiny.py", *(f"--config.model.{k}={v}" for k, v in SMALL_PPO_MODEL.items()),
             "--config.ppo.sft_steps=30", "--config.ppo.sft_batch_size=32", "--config.ppo.prompts_per_step=4",
             "--config.ppo.group_size=2", "--config.ppo.eval_every=0", "--config.ppo.eval_problems=8",
             "--config.ppo.eval_samples=1", "--config.ppo.async_rollout=False", "--config.ppo.critic_warmup_steps=1",
             "--config.ppo.log_every=1", "--config.optim.warmup_steps=4"]
TIMING = ("wait_s", "train_s", "step_s", "wait_share", "wall_s", "rollout_tokens_per_s")  # PPO records: not compared


def launch(workdir: str, args) -> subprocess.Popen:
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=args.xla_flags)
    log = open(os.path.join(os.path.dirname(workdir), os.path.basename(workdir) + ".log"), "a")
    log.write(f"\n=== launch {time.strftime('%H:%M:%S')}\n")
    log.flush()
    return subprocess.Popen([sys.executable, "train.py", *flags(args.stage, args.steps, args.checkpoint_every),
                             *args.set,
                             f"--workdir={workdir}", f"--compilation_cache={args.cache}"],
                            cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)


def records(workdir: str) -> tuple[list[tuple[int, float | str]], int]:
    """(step, loss) of every loss record of the workdir's metrics.jsonl, and the number of unreadable lines; for a
    PPO workdir (step, every value of a step record but the timings, as sorted JSON: floats exact, NaN equal)."""
    path = os.path.join(workdir, "metrics.jsonl")
    if not os.path.exists(os.path.join(workdir, "config.json")) or '"ppo"' not in open(
            os.path.join(workdir, "config.json")).read():
        return loss_records(path)
    out, bad = [], 0
    for line in open(path) if os.path.exists(path) else ():
        try:
            r = json.loads(line)
        except ValueError:
            bad += 1
            continue
        if "reward_mean" in r:
            out.append((r["step"], json.dumps({k: v for k, v in r.items() if k not in TIMING}, sort_keys=True)))
    return out, bad


def last_log(workdir: str) -> str:
    with open(workdir + ".log") as f:
        return f.read().rsplit("=== launch", 1)[-1]


def resumed_from(workdir: str) -> int | str:
    """The step the latest launch resumed from (0: started fresh; "complete": found summary.json), or "-" if it
    was killed before it got that far."""
    log = last_log(workdir)
    m = re.search(r"resumed from \S*/checkpoints/(\d+)", log)
    if m:
        return int(m.group(1))
    return "complete" if "already complete" in log else (0 if re.search(r"^(pretrain|ppo): ", log, re.M) else "-")


def compare(workdir: str, ref: dict[int, float]) -> str | None:
    """None if every loss record matches the reference bitwise and all steps are present, else what differs."""
    recs, bad = records(workdir)
    if bad:
        return f"{bad} unreadable line(s) in metrics.jsonl"
    for step, loss in recs:
        if step not in ref or loss != ref[step]:  # floats compared exactly
            return f"step {step}: {loss!r}, reference {ref.get(step)!r}"
    missing = sorted(set(ref) - {s for s, _ in recs})
    if missing:
        return f"steps {missing[:5]} missing"
    if not os.path.exists(os.path.join(workdir, "summary.json")):
        return "no summary.json"
    return None


def first_new_step(p: subprocess.Popen, workdir: str, before: int, timeout: float) -> bool:
    """Wait until launch p logs a loss record beyond the first `before` (it is training) -> True, or until it
    exits -> False (a launch resumed at the end finishes without training); raises TimeoutExpired after timeout."""
    t0 = time.perf_counter()
    while len(records(workdir)[0]) <= before:
        if p.poll() is not None:
            return False
        if time.perf_counter() - t0 > timeout:
            raise subprocess.TimeoutExpired(p.args, timeout)
        time.sleep(0.02)
    return True


def run_to_end(workdir: str, args) -> tuple[int, float]:
    t0 = time.perf_counter()
    p = launch(workdir, args)
    rc = p.wait(timeout=args.timeout)
    return rc, time.perf_counter() - t0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kills", type=int, default=10, help="number of kill -9 in all")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--checkpoint-every", type=int, default=3)
    ap.add_argument("--stage", default="pretrain", choices=("pretrain", "ppo"),
                    help="pretrain: configs/tiny.py; ppo: configs/ppo_tiny.py made small, synchronous rollouts "
                    "(PPO_FLAGS); every value of its step records but the timings is compared")
    ap.add_argument("--max-kills-per-workdir", type=int, default=3)
    ap.add_argument("--dir", default=None, help="where the workdirs go (default: a new temporary directory)")
    ap.add_argument("--reference", default=None, help="a finished reference workdir of the same command to reuse")
    ap.add_argument("--cache", default=os.environ.get("GLMJAX_TEST_CACHE", "/tmp/glmjax_jax_cache"),
                    help="JAX compilation cache directory")
    ap.add_argument("--xla-flags", default="", help="XLA_FLAGS of every launch (a reused --reference must have had "
                    "the same: they change the float rounding)")
    ap.add_argument("--set", action="append", default=[], metavar="--config.FIELD=VALUE",
                    help="a further flag of every launch (the reference's too), e.g. a smaller model; written "
                    "--set=--config.FIELD=VALUE (with '=': the value starts with --)")
    ap.add_argument("--timeout", type=float, default=600, help="seconds a launch may run")
    ap.add_argument("--keep", action="store_true", help="keep the workdirs of runs that matched")
    args = ap.parse_args(argv)
    rng = random.Random(args.seed)
    base = args.dir or tempfile.mkdtemp(prefix="fault_injection_")
    os.makedirs(base, exist_ok=True)

    ref_dir = args.reference or os.path.join(base, "reference")
    if not os.path.exists(os.path.join(ref_dir, "summary.json")):
        rc, _ = run_to_end(ref_dir, args)
        if rc != 0:
            print(f"reference run failed (exit {rc}); see {ref_dir}.log", file=sys.stderr)
            return 1
    ref = dict(records(ref_dir)[0])
    if sorted(ref) != list(range(1, args.steps + 1)):
        print(f"reference {ref_dir} does not have the losses of steps 1..{args.steps}", file=sys.stderr)
        return 1
    summary = json.load(open(os.path.join(ref_dir, "summary.json")))
    train_s = summary["wall_s"] - summary["setup_s"]  # from the first training step to the end
    if args.stage == "ppo":  # PPO's first step (its compilation) is not in setup_s: kills come after it
        train_s -= summary["first_step_s"]
    print(f"reference: {ref_dir}, {args.steps} steps, training {train_s:.1f} s; each kill comes a delay drawn "
          f"over (0, {train_s:.1f}) s after the launch logs its first step, seed {args.seed}")

    rows, failures, kills, w = [], [], 0, 0
    while kills < args.kills:
        w += 1
        workdir = os.path.join(base, f"run{w}")
        shutil.rmtree(workdir, ignore_errors=True)
        budget = min(rng.randint(1, args.max_kills_per_workdir), args.kills - kills)
        mine = []
        while True:
            before = len(records(workdir)[0])
            p = launch(workdir, args)
            if mine:
                mine[-1]["pending"] = True
            delay = rng.uniform(0.0, train_s) if budget else None
            try:
                if budget and not first_new_step(p, workdir, before, args.timeout):
                    rc = p.wait()  # exited without training a step (it resumed at the end)
                else:
                    rc = p.wait(timeout=delay if budget else args.timeout)
            except subprocess.TimeoutExpired:
                p.send_signal(signal.SIGKILL)
                p.wait()
                rc = None
            if mine and mine[-1].pop("pending", False):
                mine[-1]["resumed"] = resumed_from(workdir)
            if rc is not None:  # exited by itself
                break
            kills += 1
            budget -= 1
            new = records(workdir)[0][before:]  # what this launch logged: its last step, or "setup" if none
            mine.append({"kill": kills, "workdir": w, "delay": delay, "step": new[-1][0] if new else "setup",
                         "resumed": None})
        problem = compare(workdir, ref) if rc == 0 else f"exit status {rc}: {last_log(workdir)[-2000:]}"
        for row in mine:
            row["identical"] = problem is None
        rows += mine
        if problem:
            failures.append(f"run{w}: {problem}")
        elif not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)

    print(f"{'kill':>4}  {'workdir':>7}  {'delay s':>7}  {'step at kill':>12}  {'resumed from':>12}  identical")
    for r in rows:
        resumed = "0 (fresh)" if r["resumed"] == 0 else str(r["resumed"])
        print(f"{r['kill']:>4}  {'run' + str(r['workdir']):>7}  {r['delay']:>7.2f}  {r['step']:>12}  "
              f"{resumed:>12}  {'yes' if r['identical'] else 'NO'}")
    ok = not failures
    what = "losses" if args.stage == "pretrain" else "losses and rewards"
    print(f"{len(rows)} kills in {w} workdirs: " + (f"all {what} bitwise identical to the reference" if ok else
                                                   "MISMATCH\n" + "\n".join(failures)))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
