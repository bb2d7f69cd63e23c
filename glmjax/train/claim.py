"""One run per workdir, and only workdirs glmjax wrote: `claim(workdir)` holds train.py's workdir for the run.

- A lock file (`.glmjax.lock`: host, pid, since) is created atomically (O_EXCL, which shared filesystems honour) by
  process 0 before anything is written; the other processes of a multi-host run learn the outcome from it
  (`broadcast_one_to_all`), so all stop together. A second run on a busy workdir stops at start with one line
  naming the holder (exit 2, `WorkdirBusy`) and writes nothing.
- The holder refreshes the lock's mtime every HEARTBEAT_S seconds and removes it on any exit that runs Python's
  `finally` (an error, SIGTERM / SIGINT, the end). After a crash or kill -9 the lock is stale: on the same host
  its pid no longer runs; on any host (another machine on a shared filesystem) its mtime is older than STALE_S.
  A stale lock is taken over, with a line saying so.
- A workdir is glmjax's when it is missing or empty, holds the marker `.glmjax` (written on every claim) or a lock
  (a run that has not written its marker yet), or was written before the marker existed (a glmjax config.json, a
  checkpoints/ directory with manifests, or stage subdirectories that are glmjax workdirs). Anything else stops
  with one line (exit 2, `ForeignWorkdir`) and is not touched.
"""
from __future__ import annotations

import contextlib
import datetime
import json
import os
import socket
import threading
import time

import jax
import numpy as np

from glmjax.config import ConfigError

LOCK = ".glmjax.lock"
MARK = ".glmjax"
HEARTBEAT_S = 30.0
STALE_S = 120.0


class WorkdirBusy(ConfigError):
    """Another run holds the workdir."""


class ForeignWorkdir(ConfigError):
    """The workdir holds files glmjax did not write."""


def is_glmjax_workdir(path: str) -> bool:
    """Missing, empty, marked or locked, or written by glmjax before the marker existed (module doc)."""
    if not os.path.isdir(path):
        return True
    names = os.listdir(path)
    if not names or MARK in names or LOCK in names or _glmjax_config(os.path.join(path, "config.json")):
        return True
    ckpts = os.path.join(path, "checkpoints")
    if os.path.isdir(ckpts) and any(os.path.exists(os.path.join(ckpts, s, "manifest.json"))
                                    for s in os.listdir(ckpts) if s.isdigit()):
        return True
    stages = [os.path.join(path, n) for n in names if os.path.isdir(os.path.join(path, n))]
    return len(stages) == len(names) and all(  # a recipe's root: stage workdirs only
        MARK in os.listdir(d) or _glmjax_config(os.path.join(d, "config.json")) for d in stages)


def _glmjax_config(path: str) -> bool:
    try:
        with open(path) as f:
            keys = set(json.load(f))
    except (OSError, ValueError, TypeError):
        return False
    return "model" in keys and bool({"train", "ppo"} & keys)


def _holder(path: str) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}  # being written, or damaged: judged by its mtime alone


def _stale(path: str, holder: dict) -> bool:
    try:
        age = time.time() - os.path.getmtime(path)
    except OSError:
        return True  # gone meanwhile
    if age > STALE_S:
        return True
    if holder.get("host") == socket.gethostname() and isinstance(holder.get("pid"), int):
        try:
            os.kill(holder["pid"], 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False  # runs, as another user
    return False


def _take(workdir: str, me: dict) -> str | None:
    """Create the lock for `me` -> None, or the line that refuses this run."""
    path = os.path.join(workdir, LOCK)
    for _ in range(3):
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except OSError as e:
            if not isinstance(e, FileExistsError):
                return f"workdir={workdir!r}: cannot be used as the output directory ({e.strerror or e})"
            holder = _holder(path)
            if not _stale(path, holder):
                who = ", ".join(f"{k} {holder[k]}" for k in ("host", "pid", "since") if k in holder) or "unknown"
                return (f"workdir {workdir} is in use by another run ({who}; lock {path}): wait for it, stop it, or "
                        "use another --workdir")
            print(f"workdir {workdir}: taking over the stale lock of a run that ended without releasing it "
                  f"({json.dumps(holder)})")
            with contextlib.suppress(FileNotFoundError):
                os.replace(path, f"{path}.stale.{os.getpid()}")
                os.remove(f"{path}.stale.{os.getpid()}")
            continue
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(me, f)
        except OSError as e:
            with contextlib.suppress(OSError):
                os.remove(path)
            return f"workdir={workdir!r}: cannot be used as the output directory ({e.strerror or e})"
        return None
    return f"workdir {workdir}: could not take its lock {path} (other runs keep racing for it)"


def _refusal(workdir: str, me: dict) -> ConfigError | None:
    """Take the workdir for `me` -> None, or the error that refuses this run."""
    if not is_glmjax_workdir(workdir):
        names = sorted(os.listdir(workdir))
        return ForeignWorkdir(f"workdir {workdir} holds files glmjax did not write ({', '.join(names[:3])}"
                              f"{', ...' if len(names) > 3 else ''}): use an empty or new --workdir (nothing in it "
                              "was touched)")
    try:
        os.makedirs(workdir, exist_ok=True)
    except OSError as e:
        return WorkdirBusy(f"workdir={workdir!r}: cannot be used as the output directory ({e.strerror or e})")
    busy = _take(workdir, me)
    return None if busy is None else WorkdirBusy(busy)


@contextlib.contextmanager
def claim(workdir: str):
    """Hold `workdir` for this run (module doc); raises WorkdirBusy / ForeignWorkdir before anything is written."""
    me = {"host": socket.gethostname(), "pid": os.getpid(),
          "since": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    lead = jax.process_index() == 0
    refusal = _refusal(workdir, me) if lead else None
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        refused = bool(multihost_utils.broadcast_one_to_all(np.int32(refusal is not None)))
        if refused and refusal is None:
            refusal = WorkdirBusy(f"workdir {workdir}: refused by process 0 (its message says why)")
    if refusal is not None:
        raise refusal
    if not lead:
        yield
        return
    path = os.path.join(workdir, LOCK)
    open(os.path.join(workdir, MARK), "a").close()
    done = threading.Event()

    def beat():
        while not done.wait(HEARTBEAT_S):
            with contextlib.suppress(OSError):
                os.utime(path)

    thread = threading.Thread(target=beat, name="glmjax-workdir-lock", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
        holder = _holder(path)
        if (holder.get("pid"), holder.get("host")) == (me["pid"], me["host"]):
            with contextlib.suppress(OSError):
                os.remove(path)
