"""Batches prepared ahead in a thread that can never hold the run hostage.

`ReadAhead(it, depth)` wraps a checkpointable iterator (`next`, `get_state`, `set_state`): a daemon thread keeps up
to `depth` batches ready, each with the iterator's state after it. The consumer's state is the state after the last
batch it took, so a checkpoint never includes what was only read ahead. The consumer waits in short slices and asks
`interrupt()` in between: a caught SIGTERM / SIGINT ends the wait with `Interrupted` within a fraction of a second,
whatever the thread is doing (reading a file that hangs, skipping bad records). An error in the thread (a DataError)
is raised in the consumer, at the batch it would have produced. `latest_state` is the thread's newest state: its
counters include the batches read ahead.

`close()` stops the thread and waits for it to finish the batch it is preparing (at most JOIN_S, or three times the
slowest batch so far if longer; a read that hangs longer is left behind, a daemon, with a warning), and every thread
still alive at interpreter exit is stopped and waited for again (atexit). The thread must not outlive the
interpreter's shutdown: a daemon thread inside C++ code that released the GIL (grain's index shuffle, the
tokenizers) is ended by Python's finalization with pthread_exit, whose forced unwinding through a noexcept C++ frame
calls std::terminate ("terminate called without an active exception", exit -6).
"""
from __future__ import annotations

import atexit
import copy
import queue
import sys
import threading
import time
from typing import Any, Callable

POLL_S = 0.1  # how often a waiting consumer asks interrupt()
JOIN_S = 5.0  # how long close() waits at least for the thread to finish its batch (a hung read: no longer)
_ALIVE: dict[threading.Thread, threading.Event] = {}  # read-ahead threads not yet seen ended -> their stop events


class Interrupted(Exception):
    """A caught signal ended the wait for the next batch; args[0] is the signal's name."""


class ReadAhead:
    def __init__(self, it, depth: int):
        self.it, self.depth = it, depth
        self.state = copy.deepcopy(it.get_state())  # after the last batch taken
        self.latest_state = self.state  # after the last batch read (ahead)
        self.interrupt: Callable[[], str | None] = lambda: None
        self._queue: queue.Queue | None = None
        self._stop: threading.Event | None = None
        self._thread: threading.Thread | None = None
        self._slowest = 0.0  # seconds of the slowest batch the thread prepared

    def start(self) -> None:
        """Start the thread now (at the latest on the first `next`)."""
        if self._queue is not None:
            return
        self._queue, self._stop = queue.Queue(self.depth), threading.Event()
        self._thread = threading.Thread(target=self._fill, args=(self._queue, self._stop), name="glmjax-read-ahead",
                                        daemon=True)
        _ALIVE[self._thread] = self._stop
        self._thread.start()

    def _fill(self, q: queue.Queue, stop: threading.Event) -> None:
        while not stop.is_set():
            t = time.perf_counter()
            try:
                item = ("batch", next(self.it), copy.deepcopy(self.it.get_state()))
                self.latest_state = item[2]
                self._slowest = max(self._slowest, time.perf_counter() - t)
            except StopIteration:
                item = ("end", None, None)
            except BaseException as e:  # noqa: BLE001 -- raised in the consumer
                item = ("error", e, None)
            while not stop.is_set():
                try:
                    q.put(item, timeout=POLL_S)
                    break
                except queue.Full:
                    pass
            if item[0] != "batch":
                return

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        self.start()
        while True:
            signame = self.interrupt()
            if signame:
                raise Interrupted(signame)
            try:
                kind, value, state = self._queue.get(timeout=POLL_S)
                break
            except queue.Empty:
                pass
        if kind == "error":
            self._queue.put((kind, value, state))  # every later `next` raises it too
            raise value
        if kind == "end":
            self._queue.put((kind, value, state))
            raise StopIteration
        self.state = state
        return value

    def get_state(self) -> dict[str, Any]:
        return copy.deepcopy(self.state)

    def set_state(self, state: dict[str, Any]) -> None:
        """Continue after `state`: what was read ahead is dropped (the thread is stopped, after the batch it is
        reading; a new one starts at the next `next`)."""
        self.close(timeout=None)  # never two threads reading the iterator
        self.it.set_state(copy.deepcopy(state))
        self.state = self.latest_state = copy.deepcopy(self.it.get_state())

    def close(self, timeout: float | None = JOIN_S) -> None:
        """Stop the thread and wait until it has finished the batch it is preparing: at most `timeout` s or three
        times the slowest batch so far, whichever is longer (None: for as long as it takes); a thread still blocked
        after that (a read that hangs) is left behind, a daemon, with a warning, and waited for once more at exit."""
        thread, stop = self._thread, self._stop
        self._queue = self._stop = self._thread = None
        if thread is not None:
            _stop_and_wait(thread, stop, None if timeout is None else max(timeout, 3 * self._slowest))


def _stop_and_wait(thread: threading.Thread, stop: threading.Event, timeout: float | None) -> None:
    """Tell `thread` to stop after its batch and wait for it (None: without a bound)."""
    stop.set()
    thread.join(timeout)
    if thread.is_alive():
        print(f"data: the read-ahead thread is still reading after {timeout:g} s (a read that hangs?); left behind",
              file=sys.stderr)
    else:
        _ALIVE.pop(thread, None)


@atexit.register
def _stop_all() -> None:
    """At exit, before the interpreter's finalization ends daemon threads: no read-ahead thread still running (one
    whose close() was cut short, or never called, included)."""
    for thread, stop in list(_ALIVE.items()):
        _stop_and_wait(thread, stop, JOIN_S)
