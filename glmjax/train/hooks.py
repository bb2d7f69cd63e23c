"""What a training loop does between steps, shared by the LM stages (glmjax/train/loop.py) and PPO (glmjax/rl/ppo.py):
the metrics log (metrics.jsonl, TensorBoard scalars, the progress bar), periodic evaluation, periodic checkpoints
with a clean stop on SIGTERM / SIGINT. A hook runs every `every` steps and at the last step (`due`); it only reads
the loop's state."""
from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import time
from typing import Callable

from tqdm import tqdm


def due(step: int, every: int, last: int) -> bool:
    """Whether a hook run every `every` steps (0: only at the end) fires at `step` of a loop that ends at `last`."""
    return bool(every) and step % every == 0 or step == last


class MetricsLog:
    """metrics.jsonl (one JSON record per line, flushed at once), TensorBoard scalars of every record (optional,
    into `tensorboard_dir`) and a tqdm progress bar (`bar`: its arguments); a context manager that closes them."""

    def __init__(self, path: str, mode: str, tensorboard_dir: str | None = None, **bar):
        self.path, self.mode, self.tensorboard_dir, self.bar_args = path, mode, tensorboard_dir, bar

    def __enter__(self) -> MetricsLog:
        self.writer = tensorboard_writer(self.tensorboard_dir) if self.tensorboard_dir else None
        self.file = open(self.path, self.mode)
        self.bar = tqdm(dynamic_ncols=True, **self.bar_args)
        return self

    def __exit__(self, *exc):
        self.bar.close()
        self.file.close()
        if self.writer:
            self.writer.close()

    def write(self, record: dict):
        """One metrics.jsonl line (and, with TensorBoard, every value but "step" as a scalar at record["step"])."""
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        if self.writer:
            for k, v in record.items():
                if k != "step":
                    self.writer.add_scalar(k, v, record["step"])

    def message(self, text: str):
        """A console line above the progress bar."""
        self.bar.write(text)


class EvalHook:
    """Every `every` steps and at step `last`: e = evaluate(), written as {"step": step, **e}, the console line
    line(step, e, step_metrics), and merged into `summary`."""

    def __init__(self, evaluate: Callable[[], dict], every: int, last: int, log: MetricsLog, summary: dict,
                 line: Callable[[int, dict, dict], str]):
        self.evaluate, self.every, self.last, self.log, self.summary, self.line = \
            evaluate, every, last, log, summary, line

    def __call__(self, step: int, step_metrics: dict | None = None) -> float:
        """-> the seconds it took (0.0 when not due)."""
        if not due(step, self.every, self.last):
            return 0.0
        t = time.perf_counter()
        e = self.evaluate()
        self.log.write({"step": step, **e})
        self.log.message(self.line(step, e, step_metrics))
        self.summary.update(e)
        return time.perf_counter() - t


_ACTIVE: list[dict] = []  # the entered stop_signals' dict (nested entries share it)


@contextlib.contextmanager
def stop_signals():
    """While entered, SIGTERM and SIGINT do not kill the process: they set stop["signal"] (the signal's name), for
    the loop to stop at the end of its step (`CheckpointHook`). The previous handlers come back on exit. Entered
    again inside (train.py holds it from the start; each stage enters it too), it yields the same dict: a signal
    caught during set-up is seen by the stage. A second signal is not deferred: it gets the previous handler (a
    set-up that hangs can still be stopped)."""
    if _ACTIVE:
        yield _ACTIVE[0]
        return
    stop = {"signal": None}

    def on_signal(signum, frame):
        if stop["signal"]:
            print(f"{signal.Signals(signum).name} again: stopping now, without a checkpoint", file=sys.stderr)
            signal.signal(signum, old[signum])
            os.kill(os.getpid(), signum)
            return
        stop["signal"] = signal.Signals(signum).name

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    _ACTIVE.append(stop)
    try:
        yield stop
    finally:
        _ACTIVE.clear()
        for s, h in old.items():
            signal.signal(s, h)


class CheckpointHook:
    """save(step) every `every` steps and at step `last`; after a caught signal (`stop_signals`) before the last step,
    save the current step (if that has not just happened) and tell the loop to stop."""

    def __init__(self, save: Callable[[int], None], every: int, last: int, stop: dict, log: MetricsLog):
        self.save, self.every, self.last, self.stop, self.log = save, every, last, stop, log

    def __call__(self, step: int) -> str | None:
        """-> the caught signal's name when the loop must stop now, else None."""
        if due(step, self.every, self.last):
            self.save(step)
        if self.stop["signal"] and step < self.last:  # at the last step the run is complete
            if not due(step, self.every, self.last):
                self.save(step)
            self.log.message(f"{self.stop['signal']}: checkpoint written at step {step}; stopping")
            return self.stop["signal"]
        return None


def tensorboard_writer(directory: str):
    # tensorboardX imports torch when it is installed, only to accept torch tensors (we log floats): hiding torch
    # while tensorboardX loads saves ~2 s and ~300 MB per run.
    hide_torch = "torch" not in sys.modules
    if hide_torch:
        sys.modules["torch"] = None  # `import torch` raises ImportError
    try:
        from tensorboardX import SummaryWriter
    except ImportError:  # optional: JSONL metrics are always written
        print("tensorboardX is not installed: TensorBoard logs off", file=sys.stderr)
        return None
    finally:
        if hide_torch:
            del sys.modules["torch"]
    return SummaryWriter(directory)
