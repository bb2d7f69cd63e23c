"""A run whose data changes or stalls under it (issue 46): the read-ahead thread never holds a signal back, a data file
changed while the run reads it stops the run with one line naming it (its checkpoints intact), and every skip read
ahead is in the summary."""
import json
import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from glmjax.data import make_pipeline
from glmjax.data.read_ahead import Interrupted, ReadAhead
from glmjax.data.sources import DataError, Watched
from glmjax.train.checkpoint import Checkpoints, intact_steps
from test_reliability import FLAGS, finish, launch, losses, wait_for_step


class Counter:
    """A checkpointable iterator of 0, 1, 2, ...; `block` (an Event) makes `next` wait for it once it is cleared."""

    def __init__(self, fail_at=None):
        self.i, self.fail_at, self.block = 0, fail_at, threading.Event()
        self.block.set()

    def __next__(self):
        self.block.wait()
        if self.i == self.fail_at:
            raise DataError("record 3 is bad")
        self.i += 1
        return self.i - 1

    def get_state(self):
        return {"i": self.i}

    def set_state(self, s):
        self.i = s["i"]


def test_read_ahead_state_is_the_consumers_and_errors_arrive_at_their_batch():
    r = ReadAhead(Counter(fail_at=3), depth=2)
    assert [next(r) for _ in range(2)] == [0, 1]
    time.sleep(0.3)  # the thread has read ahead
    assert r.get_state() == {"i": 2} and r.latest_state["i"] > 2
    assert next(r) == 2
    with pytest.raises(DataError, match="record 3"):
        next(r)
    with pytest.raises(DataError):  # and at every later batch
        next(r)
    r.set_state({"i": 1})
    r.it.fail_at = None
    assert [next(r) for _ in range(3)] == [1, 2, 3] and r.get_state() == {"i": 4}
    r.close()


def test_a_stalled_read_ahead_thread_never_holds_a_signal_back():
    it = Counter()
    r = ReadAhead(it, depth=2)
    assert next(r) == 0
    it.block.clear()  # the thread now hangs in a read, forever
    time.sleep(0.3)
    caught = {}
    r.interrupt = lambda: caught.get("signal")
    threading.Timer(0.5, lambda: caught.update(signal="SIGTERM")).start()
    t = time.perf_counter()
    with pytest.raises(Interrupted, match="SIGTERM"):
        while True:
            next(r)  # the batches read before the hang, then the wait
    assert time.perf_counter() - t < 2.0
    it.block.set()
    r.close()


def test_close_waits_for_the_thread_a_hung_read_at_most_its_timeout(capfd):
    r = ReadAhead(Counter(), depth=2)
    assert next(r) == 0
    thread = r._thread
    r.close()
    assert not thread.is_alive()  # joined: it finished the batch it was preparing
    it = Counter()
    it.block.clear()  # the thread's first read hangs
    r = ReadAhead(it, depth=2)
    r.start()
    time.sleep(0.3)
    thread, t = r._thread, time.perf_counter()
    r.close(timeout=0.5)
    assert 0.4 < time.perf_counter() - t < 2.0 and thread.is_alive()
    assert "read-ahead thread is still reading after 0.5 s" in capfd.readouterr().err  # warned, left behind
    it.block.set()
    thread.join(5)


# A process that leaves a read-ahead thread running inside grain's C++ index shuffle (GIL released) and exits:
# Python's finalization would end that daemon thread by pthread_exit -> std::terminate, exit -6 (every time, with
# ~0.3 s batches); read_ahead's atexit stops it and waits for it first.
LEFT_RUNNING = """
import sys, time
from grain._src.python.experimental.index_shuffle.python import index_shuffle_module as m
from glmjax.data.read_ahead import ReadAhead

class Shuffles:
    i = 0
    def __next__(self):
        self.i += 1
        return sum(m.index_shuffle(j, max_index=10**9, seed=self.i, rounds=1000) for j in range(2000))
    def get_state(self):
        return {"i": self.i}

ReadAhead(Shuffles(), 2).start()
time.sleep(0.1)
sys.exit(0)
"""


def test_a_read_ahead_thread_left_running_does_not_abort_the_exit():
    for _ in range(3):
        p = subprocess.run([sys.executable, "-c", LEFT_RUNNING], capture_output=True, text=True, timeout=60)
        assert p.returncode == 0 and "terminate called" not in p.stderr, p.stderr[-2000:]


def write_jsonl(path, n, words=40, seed=0):
    rng = np.random.default_rng(seed)
    vocab = ["alpha", "beta", "gamma", "delta", "epsilon"]
    with open(path, "w") as f:
        for _ in range(n):
            f.write(json.dumps({"text": " ".join(rng.choice(vocab, words))}) + "\n")


def test_a_changed_file_is_a_data_error_and_a_never_ending_skip_run_too(tmp_path, monkeypatch):
    path = str(tmp_path / "d.jsonl")
    write_jsonl(path, 40)
    cfg = {"path": path, "shuffle_window_tokens": 32, "prefetch": 0}
    pipe = make_pipeline(cfg, 32, 2, 0)
    next(pipe)
    replaced = str(tmp_path / "new.jsonl")
    with open(replaced, "w") as f:
        f.write("garbage\n" * 40)
    os.replace(replaced, path)
    with pytest.raises(DataError, match=r"d.jsonl' changed while the run reads it \(10,\d+ -> 320 bytes\)"):
        for _ in range(50):
            next(pipe)
    # a change the check cannot see (the same size, time and inode): the run still ends, with a DataError
    write_jsonl(path, 40)
    pipe = make_pipeline(cfg, 32, 2, 0)
    next(pipe)
    monkeypatch.setattr(Watched, "check", lambda self, st=None: None)
    with open(replaced, "w") as f:
        f.write("garbage\n" * 40)
    os.replace(replaced, path)
    with pytest.raises(DataError, match="records in a row are unusable"):
        for _ in range(50):
            next(pipe)


def test_the_summary_counts_the_skips_read_ahead(tmp_path):
    path = str(tmp_path / "d.jsonl")
    write_jsonl(path, 40, words=5)  # a document fills about one row: the thread reads at nearly every batch
    with open(path, "a") as f:
        f.write("not json\n" * 10)
    pipe = make_pipeline({"path": path, "shuffle": False, "shuffle_window_tokens": 32, "prefetch": 3}, 32, 2, 0)
    pipe.start()
    next(pipe)
    time.sleep(1.0)  # the thread reads ahead
    got, total = pipe.stats, pipe.totals
    assert total["read_ahead"] == total["docs_read"] - got["docs_read"] > 0
    for _ in range(60):
        next(pipe)
    time.sleep(1.0)
    assert pipe.totals["skipped_malformed"] == 10 and pipe.totals["skipped"] >= pipe.stats["skipped"]
    pipe.close()


DATA_FLAGS = [f for f in FLAGS if not f.startswith("--config.data.max_docs")] + [
    "--config.data.shuffle_window_tokens=64", "--config.train.steps=30", "--config.train.checkpoint_every=100"]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_sigterm_while_the_data_thread_hangs_checkpoints_and_exits_0(tmp_path):
    """The data file is replaced by a FIFO after step 1: the read-ahead thread blocks in open() forever (a hung
    network filesystem). SIGTERM still checkpoints the last step trained and exits 0 within seconds; with the file
    back, the same command resumes."""
    data, work = str(tmp_path / "d.jsonl"), str(tmp_path / "run")
    write_jsonl(data, 200, words=5)  # a document fills about one row: the thread reads at nearly every step
    os.link(data, data + ".orig")
    p = launch(work, f"--config.data.path={data}", flags=DATA_FLAGS)
    wait_for_step(p, work, 1)
    fifo = str(tmp_path / "fifo")
    os.mkfifo(fifo)
    os.replace(fifo, data)
    time.sleep(3.0)  # the batches read before the hang are trained on, then the loop waits
    trained = max(losses(work))
    assert trained < 30
    t = time.time()
    p.send_signal(signal.SIGTERM)
    rc, out = finish(p, timeout=60)
    assert rc == 0 and time.time() - t < 30, out[-3000:]
    assert "SIGTERM: the next batch was not ready; checkpoint at step" in out, out[-3000:]
    ck = Checkpoints(work)
    assert max(ck.steps()) == max(losses(work)) == trained
    ck.close()
    os.replace(data + ".orig", data)
    rc, out = finish(launch(work, f"--config.data.path={data}", flags=DATA_FLAGS))
    assert rc == 0 and max(losses(work)) == 30, out[-3000:]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_data_file_replaced_mid_run_stops_it_in_one_line_with_its_checkpoints_intact(tmp_path):
    data, work = str(tmp_path / "d.jsonl"), str(tmp_path / "run")
    write_jsonl(data, 200)
    p = launch(work, f"--config.data.path={data}", "--config.train.checkpoint_every=2", flags=DATA_FLAGS,
               stderr=subprocess.PIPE)
    wait_for_step(p, work, 3)
    with open(data + ".new", "w") as f:
        f.write("garbage\n" * 200)
    os.replace(data + ".new", data)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 2, (out[-2000:], err[-2000:])
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"data error: data file {data!r} changed while the run reads it ("), err[-2000:]
    assert "Traceback" not in err, err[-3000:]
    ck = Checkpoints(work)
    steps = ck.steps()
    ck.close()
    assert steps and intact_steps(os.path.join(work, "checkpoints")) == steps
