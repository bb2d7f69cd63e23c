"""Stop paths under stress: SIGTERM and SIGINT sent to train.py during set-up, a training step, a checkpoint save and
an evaluation, and to a PPO run during its set-up and a step, each case `--repeats` times in a row.

    python bench/stop_paths.py [--repeats 10] [--cases lm-setup,lm-step,lm-save,lm-eval,ppo-setup,ppo-step]
                               [--signals TERM,INT] [--out stop_paths.jsonl]

Every launch must end as documented (glmjax/cli/train.py): exit status 0 and, during set-up of an LM stage, the
one line "stopped: SIG... during set-up, before step 1: ..."; after the first step (LM or PPO, a PPO set-up
included: its signal waits for the end of the first step) "SIG...: checkpoint written at step N; stopping" with
that step's checkpoint on disk. Never an abort (exit -6, "terminate called", "Fatal Python error") or a traceback.

Where the signal landed is read off the process itself, not guessed from timing: train.py runs under a small
wrapper (WRAPPER) that wraps the handlers train.py installs for SIGTERM / SIGINT and prints the main thread's
Python stack at the moment the handler ran; the row reports the phase that stack was in (set-up, step, save, eval).
A case's trigger (which output or file to wait for, then a random delay of up to 0.3 s) makes its phase the likely
one; the table shows how many of the signals landed there. Exits 1 if any launch ended otherwise than documented.
"""
from __future__ import annotations

import argparse
import collections
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
sys.path.insert(0, os.path.join(ROOT, "bench"))

from fault_injection import PPO_FLAGS  # noqa: E402

# runs train.py with its SIGTERM / SIGINT handlers wrapped: each prints where the main thread was when it ran
WRAPPER = r"""
import runpy, signal, sys, traceback
_install = signal.signal
def _wrapped(signum, handler):
    if callable(handler) and signum in (signal.SIGTERM, signal.SIGINT):
        def traced(s, frame, h=handler):
            names = [f.name for f in traceback.extract_stack(frame)]
            print("stop_paths: landed in " + ">".join(names), file=sys.stderr, flush=True)
            return h(s, frame)
        return _install(signum, traced)
    return _install(signum, handler)
signal.signal = _wrapped
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""

ENDINGS = (r"{sig}: (checkpoint written at step \d+; stopping|the next batch was not ready; (checkpoint at step \d+|"
           r"no step trained since step \d+); stopping)")
LM = ["--config=configs/tiny.py", "--config.train.seq_len=32", "--config.train.batch_size=2",
      "--config.train.log_every=1", "--config.optim.warmup_steps=2", "--config.data.max_docs=50"]
CASES = {  # name -> (flags, trigger)
    "lm-setup": (LM + ["--config.train.steps=20", "--config.train.eval_batches=0"], "data-line"),
    "lm-step": (LM + ["--config.train.steps=400", "--config.train.eval_batches=0",
                      "--config.train.checkpoint_every=1000"], "step-3"),
    "lm-save": (LM + ["--config.train.steps=400", "--config.train.eval_batches=0",
                      "--config.train.checkpoint_every=1", "--config.train.keep_checkpoints=2"], "step-3"),
    "lm-eval": (LM + ["--config.train.steps=400", "--config.train.eval_batches=32", "--config.train.eval_every=1",
                      "--config.train.checkpoint_every=1000"], "step-3"),
    "ppo-setup": (PPO_FLAGS + ["--config.ppo.steps=6", "--config.ppo.checkpoint_every=100"], "config-json"),
    "ppo-step": (PPO_FLAGS + ["--config.ppo.steps=60", "--config.ppo.checkpoint_every=100"], "step-2"),
}


def phase(stack: str) -> str:
    """The phase of a 'landed in' stack (function names, outermost first): a checkpoint save, an evaluation (PPO's
    step-0 evaluation included), the step loop (LM: `iterate`; PPO: its `step`), else set-up."""
    names = stack.split(">")
    if "save" in names:
        return "save"
    if "evaluate" in names:
        return "eval"
    ppo_loop = "train_ppo" in names and names[names.index("train_ppo") + 1:][:1] == ["step"]
    if "iterate" in names or ppo_loop:
        return "step"
    return "set-up"


def last_step(workdir: str) -> int:
    path = os.path.join(workdir, "metrics.jsonl")
    if not os.path.exists(path):
        return 0
    steps = [0]
    for line in open(path):
        try:
            r = json.loads(line)
        except ValueError:
            continue
        if "loss" in r or "reward_mean" in r:
            steps.append(int(r["step"]))
    return max(steps)


def one(case: str, signame: str, workdir: str, cache: str, rng: random.Random, timeout: float = 300) -> dict:
    flags, trigger = CASES[case]
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")  # the trigger lines as they are printed
    log_path = workdir + ".log"
    with open(log_path, "w") as log:
        p = subprocess.Popen([sys.executable, "-c", WRAPPER, "train.py", *flags, f"--workdir={workdir}",
                              f"--compilation_cache={cache}"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                             stderr=log, text=True)
        out, t0 = [], time.time()
        if trigger == "data-line":  # the LM stage's data pipeline is built: its step compiles next
            for line in p.stdout:
                out.append(line)
                if line.startswith("data: "):
                    break
        elif trigger == "config-json":  # PPO: the workdir is prepared, the warm-up and the learner come next
            while not os.path.exists(os.path.join(workdir, "config.json")) and p.poll() is None \
                    and time.time() - t0 < timeout:
                time.sleep(0.02)
        else:
            want = int(trigger.split("-")[1])
            while last_step(workdir) < want and p.poll() is None and time.time() - t0 < timeout:
                time.sleep(0.02)
        time.sleep(rng.uniform(0, 0.3))
        if p.poll() is None:
            p.send_signal(getattr(signal, "SIG" + signame))
        try:
            rest, _ = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            rest, _ = p.communicate()
    stdout = "".join(out) + rest
    stderr = open(log_path).read()
    landed = [line.split("landed in ", 1)[1].strip() for line in stderr.splitlines() if "stop_paths: landed in" in line]
    lines = [x.strip() for x in (stdout + stderr).splitlines() if x.strip() and not x.startswith("stop_paths:")]
    sig = "SIG" + signame
    abort = p.returncode == -signal.SIGABRT or "terminate called" in stderr or "Fatal Python error" in stderr
    # the documented endings: before step 1 of an LM stage one line; after a step, that step's checkpoint named
    ending = [x for x in lines if x.startswith(f"stopped: {sig} during set-up, before step 1: nothing new to "
                                               "checkpoint") or re.match(ENDINGS.format(sig=sig), x)]
    named = [int(m.group(1)) for x in ending for m in [re.search(r"(?:at|since) step (\d+)", x)] if m]
    written = sorted(int(d) for d in os.listdir(os.path.join(workdir, "checkpoints"))
                     if d.isdigit()) if os.path.isdir(os.path.join(workdir, "checkpoints")) else []
    step = last_step(workdir)
    ok_line = len(ending) == 1 and all(n == step and (n in written or "no step trained" in ending[0]) for n in named)
    ok = p.returncode == 0 and ok_line and not abort and "Traceback" not in stdout + stderr
    return {"case": case, "signal": sig, "rc": p.returncode, "landed": phase(landed[0]) if landed else "none",
            "stack": landed[0] if landed else "", "abort": abort, "ok": ok, "last_step": step,
            "s": round(time.time() - t0, 1),
            "tail": "" if ok else (stdout + stderr)[-1500:]}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--signals", default="TERM,INT")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cache", default=os.environ.get("GLMJAX_CACHE_DIR",
                                                      os.path.expanduser("~/.cache/glmjax/jax_cache")))
    ap.add_argument("--out", default=None, help="JSONL of every launch")
    args = ap.parse_args()
    rng = random.Random(args.seed)
    root = tempfile.mkdtemp(prefix="stop_paths_")
    rows, t_all = [], time.time()
    print(f"load average before: {os.getloadavg()[0]:.2f}")
    print(f"{'case':<10} {'signal':<8} {'runs':>4} {'exit statuses':<14} {'landed in':<34} {'aborts':>6} "
          f"{'as documented':>13} {'s/run':>6}")
    for case in args.cases.split(","):
        for signame in args.signals.split(","):
            results = []
            for i in range(args.repeats):
                workdir = os.path.join(root, f"{case}-{signame}-{i}")
                r = one(case, signame, workdir, args.cache, rng)
                results.append(r)
                if args.out:
                    with open(args.out, "a") as f:
                        f.write(json.dumps(r) + "\n")
                if not r["ok"]:
                    print(f"  {case} SIG{signame} run {i}: rc {r['rc']}, landed in {r['landed']}\n{r['tail']}")
                shutil.rmtree(workdir, ignore_errors=True)
            rows += results
            rcs = collections.Counter(r["rc"] for r in results)
            landed = collections.Counter(r["landed"] for r in results)
            print(f"{case:<10} SIG{signame:<5} {len(results):>4} "
                  f"{', '.join(f'{k} x{v}' for k, v in sorted(rcs.items())):<14} "
                  f"{', '.join(f'{k} {v}' for k, v in landed.most_common()):<34} "
                  f"{sum(r['abort'] for r in results):>6} {sum(r['ok'] for r in results):>9}/{len(results):<3} "
                  f"{sum(r['s'] for r in results) / len(results):>6.1f}", flush=True)
    shutil.rmtree(root, ignore_errors=True)
    bad = [r for r in rows if not r["ok"]]
    cpu = os.times()
    print(f"{len(rows)} launches, {len(bad)} not as documented, {sum(r['abort'] for r in rows)} aborts; "
          f"{time.time() - t_all:.0f} s wall, {cpu.children_user + cpu.children_system:.0f} s CPU of the launches; "
          f"load average after: {os.getloadavg()[0]:.2f}")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
