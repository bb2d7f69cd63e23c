"""Silencing orbax's and tensorstore's copies of a failure that reaches the caller anyway (`quiet_orbax`), for every
reader and writer of checkpoints (glmjax/workdir.py, glmjax/train/checkpoint.py)."""
from __future__ import annotations

import logging
import os
import sys


class OrbaxNoise(logging.Filter):
    """Silences the failure reports orbax and tensorstore print while a save or restore fails, and counts them.

    When one array of an orbax read or write fails (a damaged file, a full disk), orbax closes its asyncio loop and
    re-raises; tensorstore's completion callbacks of the other arrays then call `loop.call_soon_threadsafe` on the
    closed loop and print a "RuntimeError: Event loop is closed" traceback each (sys.unraisablehook, one per
    array: hundreds), and orbax logs the failure with its traceback at ERROR. The failure itself still reaches the
    caller as an exception (named in one warning for a damaged step, in one line for a full disk), so these
    copies are dropped (counted in `count`)."""

    count = 0

    def filter(self, record: logging.LogRecord) -> bool:
        orbax = f"{os.sep}orbax{os.sep}" in (record.pathname or "")
        # asyncio: the failed sibling writes
        orphan = record.name == "asyncio" and "exception was never retrieved" in str(record.msg)
        if record.levelno < logging.CRITICAL and (orbax or orphan):
            OrbaxNoise.count += 1
            return False
        return True


def _closed_loop_hook(previous):
    def hook(kind, value, tb):
        if kind is RuntimeError and str(value) == "Event loop is closed":
            OrbaxNoise.count += 1
            return
        previous(kind, value, tb)
    hook.glmjax_quiet = True
    return hook


def _raised_in_orbax(tb) -> bool:
    while tb is not None:
        if f"{os.sep}orbax{os.sep}" in tb.tb_frame.f_code.co_filename:
            return True
        tb = tb.tb_next
    return False


def _closed_loop_unraisable(previous):
    """Drops the closed-loop reports, and the failed sibling reads' own errors: an orbax coroutine that raised and
    was never awaited once the restore had failed ("Exception ignored in: <coroutine object
    _read_array_index_and_device_put>", printed when it is garbage-collected: timing-dependent)."""
    def hook(unraisable):
        closed = isinstance(unraisable.exc_value, RuntimeError) and str(unraisable.exc_value) == "Event loop is closed"
        if closed or _raised_in_orbax(unraisable.exc_traceback):
            OrbaxNoise.count += 1
            return
        previous(unraisable)
    hook.glmjax_quiet = True
    return hook


def quiet_orbax() -> None:
    if not getattr(sys.excepthook, "glmjax_quiet", False):
        sys.excepthook = _closed_loop_hook(sys.excepthook)
    if not getattr(sys.unraisablehook, "glmjax_quiet", False):  # tensorstore reports callback errors as unraisable
        sys.unraisablehook = _closed_loop_unraisable(sys.unraisablehook)
    for logger in (logging.getLogger("absl"), logging.getLogger("asyncio")):
        if not any(isinstance(f, OrbaxNoise) for f in logger.filters):
            logger.addFilter(OrbaxNoise())
