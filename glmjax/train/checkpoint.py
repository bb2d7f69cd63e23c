"""Orbax checkpoints of a training run: model state (the nnx state as a plain nested dict of arrays), optimizer
state, data-iterator state and run metadata (step, stage, model config, the run's config fingerprint).

workdir/checkpoints/<step>/{model, opt_state, data, meta, manifest.json}. Saves are asynchronous (training
continues while the previous step's arrays are written) and atomic (orbax writes into a temporary directory and
commits it by rename), so a crash mid-save leaves the previous checkpoints intact. Once orbax has committed a step,
`manifest.json` (size and CRC-32 of every file of the step, the data-iterator state included) is written next to
it, atomically (temporary file + rename).

Restoring walks the steps from the newest down. A step is *damaged* when a file differs from its manifest or
cannot be read; damaged steps newer than the one restored are moved to workdir/corrupt_checkpoints/ (kept for
inspection) so the run can write those steps again, and so are never-sealed steps (below), whenever a run opens the
checkpoints. Nothing else is ever moved: a `check_meta` callback sees each
step's metadata before its arrays are read and may refuse it (a changed config), which stops the restore with
that error. When every step is damaged, `CheckpointError` is raised and all of them stay where they are.
A step counts as committed once sealed: before saving it the writer marks it (workdir/.unsealed/<step>) and
removes the mark with the manifest, so a step whose run was killed between orbax's commit and its manifest is
damaged (never trusted unverified). Only a step without a manifest or a mark (written before manifests existed) is
read without checksum verification, with a warning. A restored step whose weights or optimizer state hold a NaN
or an infinity is damaged too, the tensor named.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import time
import warnings

import jax
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

from glmjax.orbax_noise import OrbaxNoise, quiet_orbax
# the read side (manifests, the newest intact model state) is glmjax/workdir.py's; re-exported for its users here
from glmjax.workdir import (MANIFEST, NEVER_SEALED, CheckpointError, file_crc32, first_non_finite,  # noqa: F401
                            intact_steps, load_model_state, never_sealed, newest_meta, short_error, step_files,
                            unsealed_marker, verify_manifest, write_manifest)

ITEMS = ("model", "opt_state", "data", "meta")


class Checkpoints:
    def __init__(self, workdir: str, keep: int = 3, async_save: bool = True):
        self.directory = os.path.join(os.path.abspath(workdir), "checkpoints")
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=async_save, create=True)
        quiet_orbax()
        self.manager = ocp.CheckpointManager(self.directory, options=options, item_names=ITEMS)
        self._unsealed: list[int] = []
        self._closed = False
        self._set_aside_never_sealed()

    def _set_aside_never_sealed(self) -> None:
        """Steps whose run was killed between orbax's commit and the seal never counted: process 0 moves them to
        corrupt_checkpoints/ (the run writes those steps again), the others wait for it and reload."""
        if jax.process_index() == 0:
            for step in self.steps():
                if never_sealed(self.step_dir(step)):  # (no checksums: the sealed steps are read when used)
                    warnings.warn(f"checkpoint {self.step_dir(step)} was {NEVER_SEALED}; it does not count",
                                  stacklevel=3)
                    self._set_aside(step)
        if jax.process_count() > 1:
            multihost_utils.sync_global_devices("glmjax: never-sealed checkpoints set aside")
            self.manager.reload()

    def save(self, step: int, model_state, opt_state, data_state: dict, meta: dict) -> None:
        if jax.process_index() == 0:  # the step counts as committed once sealed: until then it is never trusted
            marker = unsealed_marker(self.step_dir(step))
            os.makedirs(os.path.dirname(marker), exist_ok=True)
            open(marker, "w").close()
        self.manager.save(step, force=True, args=ocp.args.Composite(
            model=ocp.args.StandardSave(model_state), opt_state=ocp.args.StandardSave(opt_state),
            data=ocp.args.JsonSave(data_state), meta=ocp.args.JsonSave(meta)))
        self._unsealed.append(step)
        self._seal(pending_ok=True)

    def _seal(self, pending_ok: bool = False) -> None:
        """Write the manifest of every step this process saved whose files orbax has committed."""
        if pending_ok and self._unsealed and self.manager.is_saving_in_progress():
            steps, self._unsealed = self._unsealed[:-1], self._unsealed[-1:]  # the last is still being written
        else:
            steps, self._unsealed = self._unsealed, []
        existing = set(self.manager.all_steps())
        for step in steps:
            if step in existing and jax.process_index() == 0:
                write_manifest(self.step_dir(step))
                self._unmark(step)

    def wait(self) -> None:
        self.manager.wait_until_finished()
        self._seal()

    def steps(self) -> list[int]:
        return sorted(self.manager.all_steps())

    def step_dir(self, step: int) -> str:
        return os.path.join(self.directory, str(step))

    def restore_latest(self, model_state, opt_state, check_meta=None):
        """Newest intact checkpoint -> (step, model_state, opt_state, data_state, meta), or None if there is none.
        model_state / opt_state: templates (arrays or jax.ShapeDtypeStruct) giving structure, dtypes, shardings.
        check_meta(meta, step): called before a step's arrays are read; raise to refuse the run's checkpoints
        (the error propagates, nothing is moved). Raises CheckpointError when checkpoints exist but all are
        damaged."""
        damaged = []
        for step in reversed(self.steps()):
            problem = verify_manifest(self.step_dir(step))
            if problem == "unsealed":
                warnings.warn(f"checkpoint {self.step_dir(step)} has no {MANIFEST} (the run stopped before writing "
                              "it, or an older glmjax wrote the step): read without checksum verification",
                              stacklevel=2)
                problem = None
            if problem is None:
                try:
                    meta = self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta
                except Exception as e:  # noqa: BLE001 -- an unreadable step is damaged, never fatal by itself
                    problem = f"meta unreadable ({short_error(e)})"
            if problem is None:
                if check_meta is not None:
                    check_meta(meta, step)
                try:
                    r = self.manager.restore(step, args=ocp.args.Composite(
                        model=ocp.args.StandardRestore(_abstract(model_state)),
                        opt_state=ocp.args.StandardRestore(_abstract(opt_state)),
                        data=ocp.args.JsonRestore(), meta=ocp.args.JsonRestore()))
                    bad = first_non_finite({"model": r.model, "opt_state": r.opt_state})
                    problem = None if bad is None else f"tensor {bad} holds non-finite values"
                except Exception as e:  # noqa: BLE001
                    problem = f"unreadable ({short_error(e)})"
            if problem is not None:
                OrbaxNoise.count = 0  # the reports of this read error: it is named in the warning below
                warnings.warn(f"checkpoint {self.step_dir(step)} is damaged: {problem}", stacklevel=2)
                damaged.append((step, problem))
                continue
            for bad, _ in damaged:
                self._set_aside(bad)
            return step, r.model, r.opt_state, r.data, r.meta
        if damaged:
            raise CheckpointError(
                f"all {len(damaged)} checkpoints in {self.directory} are damaged (left in place): "
                + "; ".join(f"step {s}: {p}" for s, p in damaged)
                + ". Nothing was resumed. Restore them from a backup, or start over in a new --workdir")
        return None

    def _set_aside(self, step: int) -> None:
        if jax.process_index() == 0:
            aside = os.path.join(os.path.dirname(self.directory), "corrupt_checkpoints")
            os.makedirs(aside, exist_ok=True)
            target = os.path.join(aside, f"{step}.{time.time():.0f}")
            shutil.move(self.step_dir(step), target)
            self._unmark(step)
            warnings.warn(f"checkpoint step {step} moved to {target}", stacklevel=3)
        self.manager.reload()

    def _unmark(self, step: int) -> None:
        marker = unsealed_marker(self.step_dir(step))
        with contextlib.suppress(FileNotFoundError):
            os.remove(marker)
        with contextlib.suppress(OSError):  # the folder exists only while a step is unsealed
            os.rmdir(os.path.dirname(marker))

    def close(self) -> None:
        """Wait for the saves, write their manifests and close; a second call does nothing."""
        if self._closed:
            return
        self._closed = True
        self.manager.wait_until_finished()
        self._seal()
        self.manager.close()


def _abstract(tree):
    return jax.tree.map(ocp.utils.to_shape_dtype_struct, tree)
