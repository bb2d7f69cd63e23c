"""One run per workdir, and only workdirs glmjax wrote (issue 45, glmjax/train/claim.py): a second train.py on a busy
workdir stops at start in one line naming the holder and touches nothing of the first run's; after a kill -9 of the
holder the next run takes the stale lock over and resumes; a folder of the user's own files is refused and left
byte-identical."""
import json
import os
import signal
import subprocess
import sys
import time
import zlib

import pytest

from glmjax.train.claim import LOCK, MARK, is_glmjax_workdir
from glmjax.workdir import intact_steps
from test_reliability import FLAGS, ROOT, finish, launch, wait_for_step
from xla_flags import xla_flags


def files(workdir):
    """{relative path: crc32} of every file under workdir."""
    out = {}
    for d, _, names in os.walk(workdir):
        for n in names:
            p = os.path.join(d, n)
            out[os.path.relpath(p, workdir)] = zlib.crc32(open(p, "rb").read())
    return out


def stopped(pid, timeout=60):
    """Wait until every thread of pid is stopped (SIGSTOP is delivered asynchronously: a checkpoint thread may still
    be writing when send_signal returns)."""
    t0 = time.time()
    while time.time() - t0 < timeout:
        tasks = os.listdir(f"/proc/{pid}/task")
        states = [open(f"/proc/{pid}/task/{t}/stat").read().rsplit(")", 1)[1].split()[0] for t in tasks]
        if all(st in "tT" for st in states):
            time.sleep(0.2)  # and what the kernel still had queued for its files
            return
        time.sleep(0.01)
    raise AssertionError(f"process {pid} did not stop")


def one_line(out, *words):
    lines = [ln for ln in out.splitlines() if ln.strip() and "TPU" not in ln and "libtpu" not in ln
             and "Source Location" not in ln and not ln.startswith("===") and "InitGoogle" not in ln]
    assert len(lines) == 1 and all(w in lines[0] for w in words), out[-3000:]


@pytest.mark.slow
def test_a_busy_workdir_is_refused_and_a_killed_holder_is_taken_over(tmp_path):
    workdir = str(tmp_path / "run")
    first = launch(workdir)
    wait_for_step(first, workdir, 2)
    t0 = time.time()
    while not intact_steps(os.path.join(workdir, "checkpoints")) and time.time() - t0 < 300:
        time.sleep(0.05)  # a sealed checkpoint to resume from
    first.send_signal(signal.SIGSTOP)  # the holder stays alive while the second run tries
    stopped(first.pid)
    try:
        holder = json.load(open(os.path.join(workdir, LOCK)))
        assert holder["pid"] == first.pid and {"host", "since"} <= set(holder)
        before = files(workdir)
        second = launch(workdir, stderr=subprocess.PIPE)
        _, err = second.communicate(timeout=600)
        assert second.returncode == 2
        one_line(err, "config error: workdir", "is in use by another run", f"pid {first.pid}", holder["since"])
        assert files(workdir) == before  # nothing written, nothing changed
    finally:
        first.send_signal(signal.SIGKILL)  # kill -9: the lock stays behind, its pid gone
        first.send_signal(signal.SIGCONT)
        first.wait()
    assert os.path.exists(os.path.join(workdir, LOCK))
    rc, out = finish(launch(workdir))
    assert rc == 0 and "taking over the stale lock" in out and "resumed from" in out, out[-3000:]
    assert not os.path.exists(os.path.join(workdir, LOCK))  # released at the end
    assert os.path.exists(os.path.join(workdir, "summary.json"))


def test_a_folder_of_the_users_own_files_is_refused_and_left_as_it_was(tmp_path):
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "config.json").write_text('{"learning_rate": 0.1}')
    (folder / "metrics.jsonl").write_text('{"step": 1, "acc": 0.5}\n')
    (folder / "notes.txt").write_text("my notes")
    before = files(str(folder))
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=xla_flags())
    p = subprocess.run([sys.executable, "train.py", *FLAGS, f"--workdir={folder}", "--compilation_cache="], cwd=ROOT,
                       env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 2, p.stdout[-2000:] + p.stderr[-2000:]
    one_line(p.stderr, "config error: workdir", "holds files glmjax did not write", "config.json")
    assert files(str(folder)) == before and sorted(os.listdir(folder)) == sorted(before)


def test_which_folders_count_as_glmjax_workdirs(tmp_path):
    """Missing, empty, marked, or written before the marker existed: a glmjax config.json, sealed checkpoints, or a
    recipe's root of stage workdirs; a user's own config.json or a stray file is not."""
    assert is_glmjax_workdir(str(tmp_path / "missing")) and is_glmjax_workdir(str(tmp_path))
    cases = {
        "marked": {MARK: ""},
        "old_stage": {"config.json": json.dumps({"model": {}, "train": {}, "stage": "pretrain"})},
        "old_ppo": {"config.json": json.dumps({"model": {}, "ppo": {}})},
        "old_checkpoints": {"checkpoints/4/manifest.json": "{}"},
        "old_recipe_root": {"pretrain/config.json": json.dumps({"model": {}, "train": {}}), f"sparse_adapt/{MARK}": ""},
    }
    foreign = {
        "user_config": {"config.json": json.dumps({"lr": 0.1})},
        "stray_file": {"pretrain/config.json": json.dumps({"model": {}, "train": {}}), "notes.txt": "x"},
        "user_subdir": {"data/a.txt": "x"},
    }
    for name, tree in {**cases, **foreign}.items():
        for rel, text in tree.items():
            os.makedirs(os.path.dirname(str(tmp_path / name / rel)), exist_ok=True)
            (tmp_path / name / rel).write_text(text)
        assert is_glmjax_workdir(str(tmp_path / name)) == (name in cases), name
