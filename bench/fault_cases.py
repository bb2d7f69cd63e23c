"""Every failure a run is known to meet, through the commands a user types: what happens and the exit status.

    python bench/fault_cases.py [--dir DIR] [--only SUBSTRING]     # about 3 minutes on 2 CPU cores

Each case sets up a tiny run (configs/tiny.py, seq 32, batch 2, as bench/fault_injection.py), breaks one thing,
and runs train.py, glmjax-generate or glmjax-hf as a user would. A row: the case, what the program did (the last
line it printed on stderr, shortened), its exit status, and whether that is clean: the expected status, no
traceback, no "Event loop is closed" report, and (for an error) exactly one line that is not a warning. Exits 1 if
any row is not clean. Kill -9 at random moments is bench/fault_injection.py's (bitwise resumes).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ.setdefault("JAX_PLATFORMS", "cpu")  # this process reads a checkpoint (a case's set-up): no TPU probing
sys.path.insert(0, os.path.join(ROOT, "bench"))

from fault_injection import PPO_FLAGS, flags  # noqa: E402

CACHE = os.environ.get("GLMJAX_TEST_CACHE", "/tmp/glmjax_jax_cache")
ENV = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="")
TINY = flags("pretrain", 12, 2)
STREAM = ["--config.data.shuffle_window_tokens=64", "--config.train.steps=60", "--config.data.max_docs=1000000"]


def command(args, workdir=None, program="train.py") -> list[str]:
    if program == "train.py":
        return [sys.executable, "train.py", *args, f"--workdir={workdir}", f"--compilation_cache={CACHE}"]
    return [sys.executable, "-m", program, *args, "--compilation-cache", CACHE]


def run(args, workdir=None, program="train.py", timeout=600) -> tuple[int, str]:
    p = subprocess.run(command(args, workdir, program), cwd=ROOT, env=ENV, capture_output=True, text=True,
                       timeout=timeout)
    return p.returncode, p.stderr + p.stdout


def start(args, workdir) -> subprocess.Popen:
    return subprocess.Popen(command(args, workdir), cwd=ROOT, env=ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def wait_step(workdir: str, step: int, p: subprocess.Popen, timeout=300) -> None:
    t = time.time()
    path = os.path.join(workdir, "metrics.jsonl")
    while time.time() - t < timeout and p.poll() is None:
        if os.path.exists(path) and any(json.loads(x).get("step", 0) >= step for x in open(path) if x.strip()):
            return
        time.sleep(0.05)
    raise RuntimeError(f"{workdir}: step {step} never came")


def corpus(path: str, n: int = 400) -> str:
    words = ["alpha", "beta", "gamma", "delta", "epsilon"]
    with open(path, "w") as f:
        for i in range(n):
            f.write(json.dumps({"text": " ".join(words[(i + k) % 5] for k in range(5))}) + "\n")
    return path


def trained(d: str) -> str:
    """A finished tiny run (checkpoints 2..12), made once beside the cases' directories and copied."""
    ref = os.path.join(os.path.dirname(d), "reference")
    if not os.path.exists(os.path.join(ref, "summary.json")):
        rc, out = run(TINY, ref)
        assert rc == 0, out[-2000:]
    return ref


def copy_run(d: str, name: str) -> str:
    target = os.path.join(d, name)
    shutil.copytree(trained(d), target)
    os.remove(os.path.join(target, "summary.json"))
    return target


def largest(directory: str) -> str:
    return max((os.path.join(r, f) for r, _, fs in os.walk(directory) for f in fs), key=os.path.getsize)


def flip(path: str, n: int = 64) -> None:
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        data = f.read(n)
        f.seek(os.path.getsize(path) // 2)
        f.write(bytes(b ^ 0xFF for b in data))


# ------------------------------------------------------------------------------------------------ the cases


def data_changed(how):
    def case(d):
        data, work = corpus(os.path.join(d, "d.jsonl")), os.path.join(d, "run")
        p = start(TINY + STREAM + [f"--config.data.path={data}"], work)
        wait_step(work, 2, p)
        how(data)
        out, _ = p.communicate(timeout=300)
        return p.returncode, out
    return case


def replaced(data):
    with open(data + ".new", "w") as f:
        f.write("garbage\n" * 400)
    os.replace(data + ".new", data)


def truncated(data):
    with open(data, "r+b") as f:
        f.truncate(os.path.getsize(data) // 3)


def emptied(data):
    open(data, "w").close()


def data_thread_hangs(d):
    data, work = corpus(os.path.join(d, "d.jsonl")), os.path.join(d, "run")
    p = start(TINY + STREAM + [f"--config.data.path={data}"], work)
    wait_step(work, 2, p)
    os.remove(data)
    os.mkfifo(data)  # open() blocks: a hung network filesystem
    time.sleep(3)
    p.send_signal(signal.SIGTERM)
    t = time.time()
    out, _ = p.communicate(timeout=120)
    return p.returncode, out + f"\n[exited {time.time() - t:.1f} s after SIGTERM]"


def sigterm_training(d):
    work = os.path.join(d, "run")
    p = start(TINY, work)
    wait_step(work, 3, p)
    p.send_signal(signal.SIGTERM)
    out, _ = p.communicate(timeout=120)
    return p.returncode, out


def sigterm_setup(d):
    p = start(TINY, os.path.join(d, "run"))
    for line in p.stdout:
        if line.startswith("data: "):
            break
    p.send_signal(signal.SIGTERM)
    out, _ = p.communicate(timeout=120)
    return p.returncode, out


def unsealed_flipped(d):
    work = copy_run(d, "run")
    step = os.path.join(work, "checkpoints", "12")
    os.remove(os.path.join(step, "manifest.json"))
    os.makedirs(os.path.join(work, ".unsealed"), exist_ok=True)
    open(os.path.join(work, ".unsealed", "12"), "w").close()  # what a kill -9 before the seal leaves
    flip(largest(os.path.join(step, "model")))
    return run(TINY + ["--config.train.steps=14"], work)


def nan_weights(d):
    import numpy as np
    import orbax.checkpoint as ocp

    work = copy_run(d, "run")
    step = os.path.join(work, "checkpoints", "12")
    with ocp.StandardCheckpointer() as ck:
        model = ck.restore(os.path.join(step, "model"))
    model["embed_tokens"] = np.asarray(model["embed_tokens"]).copy()
    model["embed_tokens"][0, 0] = np.nan
    shutil.rmtree(os.path.join(step, "model"))
    with ocp.StandardCheckpointer() as ck:
        ck.save(os.path.join(step, "model"), model)
    from glmjax.workdir import write_manifest
    write_manifest(step)  # sealed: its bytes are what was written, a NaN among them
    return run(TINY + ["--config.train.steps=14"], work)


def truncated_checkpoint(d):
    work = copy_run(d, "run")
    path = largest(os.path.join(work, "checkpoints", "12", "model"))
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 3)
    return run(TINY + ["--config.train.steps=14"], work)


def half_written(d) -> str:
    work = copy_run(d, "half")
    for s in os.listdir(os.path.join(work, "checkpoints")):
        step = os.path.join(work, "checkpoints", s)
        os.remove(os.path.join(step, "manifest.json"))
        shutil.rmtree(os.path.join(step, "model", "d"))
    return work


def tmp_only(d) -> str:
    work = os.path.join(d, "tmp_only")
    os.makedirs(os.path.join(work, "checkpoints"))
    shutil.copytree(os.path.join(trained(d), "checkpoints", "12"),
                    os.path.join(work, "checkpoints", "12.orbax-checkpoint-tmp-17"))
    return work


def truncated_hf(d) -> str:
    hf = os.path.join(d, "hf")
    rc, out = run(["export", trained(d), hf, "--dtype", "F32"], program="glmjax.cli.hf")
    assert rc == 0, out[-2000:]
    shard = next(os.path.join(hf, f) for f in os.listdir(hf) if f.endswith(".safetensors"))
    with open(shard, "r+b") as f:
        f.truncate(os.path.getsize(shard) // 3)
    return hf


def init_from(make):
    return lambda d: run(TINY + [f"--config.init_from={make(d)}"], os.path.join(d, "run"))


def reward(d, body: str):
    with open(os.path.join(d, "user_reward.py"), "w") as f:
        f.write(body)
    env = dict(ENV, PYTHONPATH=d)
    p = subprocess.run(command(PPO_FLAGS + ["--config.ppo.steps=6", "--config.ppo.reward=user_reward:score"],
                               os.path.join(d, "run")), cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    return p.returncode, p.stderr + p.stdout


def busy(d):
    work = copy_run(d, "run")
    with open(os.path.join(work, ".glmjax.lock"), "w") as f:
        json.dump({"host": os.uname().nodename, "pid": os.getpid(), "since": "now"}, f)
    return run(TINY, work)


def foreign(d):
    work = os.path.join(d, "mine")
    os.makedirs(work)
    with open(os.path.join(work, "config.json"), "w") as f:
        f.write('{"my": "settings"}')
    return run(TINY, work)


CASES = [  # (case, expected exit status, run(dir) -> (status, output))
    ("data file replaced by garbage mid-run", 2, data_changed(replaced)),
    ("data file truncated to a third mid-run", 2, data_changed(truncated)),
    ("data file emptied mid-run", 2, data_changed(emptied)),
    ("data read hangs (a FIFO), then SIGTERM", 0, data_thread_hangs),
    ("SIGTERM mid-training", 0, sigterm_training),
    ("SIGTERM during set-up", 0, sigterm_setup),
    ("newest step unsealed (killed before its manifest), 64 bytes flipped", 0, unsealed_flipped),
    ("newest step sealed, a NaN in its weights", 0, nan_weights),
    ("newest step's model file truncated", 0, truncated_checkpoint),
    ("init_from a half-written checkpoint", 3, init_from(half_written)),
    ("init_from a workdir holding only *.orbax-checkpoint-tmp", 3, init_from(tmp_only)),
    ("init_from a truncated safetensors file", 3, init_from(truncated_hf)),
    ("glmjax-hf inspect of a truncated safetensors file", 3,
     lambda d: run(["inspect", truncated_hf(d)], program="glmjax.cli.hf")),
    ("glmjax-hf import of a truncated safetensors file", 3,
     lambda d: run(["import", truncated_hf(d), os.path.join(d, "imp")], program="glmjax.cli.hf")),
    ("glmjax-generate of a half-written checkpoint", 3,
     lambda d: run(["--checkpoint", half_written(d), "--prompt", "x"], program="glmjax.cli.generate")),
    ("glmjax-hf export of a half-written checkpoint", 3,
     lambda d: run(["export", half_written(d), os.path.join(d, "out")], program="glmjax.cli.hf")),
    ("--config=configs/tiy.py (a typo)", 2, lambda d: run(["--config=configs/tiy.py"], os.path.join(d, "run"))),
    ("train.eval_batches=2 with data.eval_fraction=0.0", 2,
     lambda d: run(TINY + ["--config.train.eval_batches=2", "--config.data.eval_fraction=0.0"],
                   os.path.join(d, "run"))),
    ("a reward that raises on some rows", 2,
     lambda d: reward(d, "def score(response, problem):\n    return 1 / (int(problem.answer) % 2)\n")),
    ("a reward module that fails at import", 2, lambda d: reward(d, "def score(r, p):\n    return 1.0\nx = y\n")),
    ("a second run on a busy workdir", 2, busy),
    ("a workdir glmjax did not write", 2, foreign),
]


ERRORS = ("flag error", "config error", "data error", "checkpoint error", "error", "stopped")
NOTABLE = ("warning:", "resumed from", "SIGTERM", "[exited")


def verdict(expected: int, rc: int, out: str) -> tuple[str, bool]:
    """-> (what happened: the error line, or the notable lines of a run that went on; clean)."""
    lines = [x.split("\r")[-1].strip() for x in out.splitlines()]
    errors = [x for x in lines if x.split(":")[0] in ERRORS]
    notable = [x for x in lines if x.startswith(NOTABLE)]
    what = errors[-1] if expected and errors else " / ".join(notable[:1] + notable[-1:] if len(notable) > 1 else
                                                            notable) or (lines or [""])[-1]
    clean = rc == expected and "Traceback" not in out and "Event loop is closed" not in out
    if expected:
        clean = clean and len(errors) == 1
    return what, clean


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default=None, help="where the runs go (default: a new temporary directory)")
    ap.add_argument("--only", default="", help="run the cases whose name contains this")
    args = ap.parse_args(argv)
    root = args.dir or tempfile.mkdtemp(prefix="glmjax_faults_")
    print(f"runs under {root}; load average {os.getloadavg()[0]:.2f}\n")
    print("| case | what happens (last line) | exit | clean |\n|---|---|---:|---|", flush=True)
    bad = 0
    for i, (name, expected, fn) in enumerate(CASES):
        if args.only not in name:
            continue
        d = os.path.join(root, f"case{i:02d}")
        os.makedirs(d, exist_ok=True)
        t = time.time()
        try:
            rc, out = fn(d)
        except Exception as e:  # noqa: BLE001 -- the harness itself: reported as a row
            rc, out = -1, f"harness: {type(e).__name__}: {e}"
        with open(os.path.join(d, "output.txt"), "w") as f:
            f.write(out)
        what, clean = verdict(expected, rc, out)
        bad += not clean
        shown = what if len(what) <= 220 else what[:217] + "..."
        print(f"| {name} | `{shown.replace('|', '/')}` | {rc} | {'yes' if clean else 'NO'} ({time.time() - t:.0f} s) |",
              flush=True)
    print(f"\n{bad} case(s) not clean; load average {os.getloadavg()[0]:.2f}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
