"""Orbax checkpoints of a training run: model state (the nnx state as a plain nested dict of arrays), optimizer
state, data-iterator state and run metadata (step, stage, model config).

workdir/checkpoints/<step>/{model, opt_state, data, meta}. Saves are asynchronous (training continues while
the previous step's arrays are written) and atomic (orbax writes into a temporary directory and commits it by
rename), so a crash mid-save leaves the previous checkpoints intact. Restoring walks the steps from the newest
down and skips any it cannot read (truncated or corrupt files), with a warning.
"""
from __future__ import annotations

import os
import shutil
import time
import warnings

import jax
import orbax.checkpoint as ocp

ITEMS = ("model", "opt_state", "data", "meta")


class Checkpoints:
    def __init__(self, workdir: str, keep: int = 3, async_save: bool = True):
        self.directory = os.path.join(os.path.abspath(workdir), "checkpoints")
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=async_save, create=True)
        self.manager = ocp.CheckpointManager(self.directory, options=options, item_names=ITEMS)

    def save(self, step: int, model_state, opt_state, data_state: dict, meta: dict) -> None:
        self.manager.save(step, force=True, args=ocp.args.Composite(
            model=ocp.args.StandardSave(model_state), opt_state=ocp.args.StandardSave(opt_state),
            data=ocp.args.JsonSave(data_state), meta=ocp.args.JsonSave(meta)))

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def steps(self) -> list[int]:
        return sorted(self.manager.all_steps())

    def restore_latest(self, model_state, opt_state):
        """Newest readable checkpoint -> (step, model_state, opt_state, data_state, meta), or None if there is none.
        model_state / opt_state: templates (arrays or jax.ShapeDtypeStruct) giving structure, dtypes, shardings.
        Unreadable newer checkpoints are moved to workdir/corrupt_checkpoints/ (kept for inspection), so the
        resumed run can write those steps again."""
        for step in reversed(self.steps()):
            try:
                r = self.manager.restore(step, args=ocp.args.Composite(
                    model=ocp.args.StandardRestore(_abstract(model_state)),
                    opt_state=ocp.args.StandardRestore(_abstract(opt_state)),
                    data=ocp.args.JsonRestore(), meta=ocp.args.JsonRestore()))
                return step, r.model, r.opt_state, r.data, r.meta
            except Exception as e:  # noqa: BLE001 -- any unreadable checkpoint is skipped, never fatal
                warnings.warn(f"checkpoint {self.directory}/{step} is unreadable and was skipped: "
                              f"{type(e).__name__}: {str(e)[:300]}", stacklevel=2)
                self._set_aside(step)
        return None

    def _set_aside(self, step: int) -> None:
        if jax.process_index() == 0:
            aside = os.path.join(os.path.dirname(self.directory), "corrupt_checkpoints")
            os.makedirs(aside, exist_ok=True)
            shutil.move(os.path.join(self.directory, str(step)), os.path.join(aside, f"{step}.{time.time():.0f}"))
        self.manager.reload()

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()


def _abstract(tree):
    return jax.tree.map(ocp.utils.to_shape_dtype_struct, tree)


def load_model_state(workdir: str) -> tuple[dict, dict, int]:
    """The model state (nested dict of arrays) and meta of the newest readable checkpoint of a finished or running
    stage, for initialising the next stage. -> (state, meta, step)."""
    directory = os.path.join(os.path.abspath(workdir), "checkpoints")
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"init_from={workdir!r}: no checkpoints directory {directory}")
    manager = ocp.CheckpointManager(directory, item_names=("model", "meta"))
    try:
        for step in sorted(manager.all_steps(), reverse=True):
            try:
                r = manager.restore(step, args=ocp.args.Composite(model=ocp.args.StandardRestore(),
                                                                  meta=ocp.args.JsonRestore()))
                return r.model, r.meta, step
            except Exception as e:  # noqa: BLE001
                warnings.warn(f"checkpoint {directory}/{step} is unreadable and was skipped: {e}", stacklevel=2)
    finally:
        manager.close()
    raise FileNotFoundError(f"init_from={workdir!r}: no readable checkpoint in {directory}")
