"""Reading a training workdir (an LM stage's or a PPO run's): the per-step manifests of its checkpoints (size and
CRC-32 of every file, written once orbax has committed the step), their verification, and the newest intact
model state -- what glmjax/resolve.py reads a workdir with (for init_from, glmjax-generate, glmjax-hf export, the
tools).
Writing and restoring a run's whole state (optimizer, data iterator, damage handling): glmjax/train/checkpoint.py.

workdir/checkpoints/<step>/{model, opt_state, data, meta, manifest.json}; "model" is the model's complete state as
a nested dict of arrays, "meta" holds the step, the stage and the model config.
"""
from __future__ import annotations

import json
import logging
import os
import warnings
import zlib

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp

from glmjax.orbax_noise import OrbaxNoise, quiet_orbax

MANIFEST = "manifest.json"
UNSEALED = ".unsealed"  # workdir/.unsealed/<step>: written before a step is saved, removed once its manifest is
NEVER_SEALED = ("never sealed (the run stopped after orbax committed the step, before its manifest was written): "
                "its bytes cannot be verified")


class CheckpointError(RuntimeError):
    """No usable checkpoint where one is needed; the message names the checkpoints and what is wrong with each."""


def file_crc32(path: str) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            crc = zlib.crc32(chunk, crc)
    return crc


def step_files(step_dir: str) -> list[str]:
    """Relative paths of the files of a step directory (the manifest excluded), sorted."""
    out = []
    for root, _, files in os.walk(step_dir):
        out += [os.path.relpath(os.path.join(root, f), step_dir) for f in files]
    return sorted(p for p in out if p != MANIFEST and not p.startswith(MANIFEST + "."))


def write_manifest(step_dir: str) -> None:
    files = {p: {"size": os.path.getsize(os.path.join(step_dir, p)), "crc32": file_crc32(os.path.join(step_dir, p))}
             for p in step_files(step_dir)}
    tmp = os.path.join(step_dir, f"{MANIFEST}.tmp{os.getpid()}")
    with open(tmp, "w") as f:
        json.dump({"version": 1, "checksum": "crc32", "files": files}, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(step_dir, MANIFEST))


def unsealed_marker(step_dir: str) -> str:
    """workdir/.unsealed/<step> of workdir/checkpoints/<step>."""
    checkpoints = os.path.dirname(os.path.abspath(step_dir))
    return os.path.join(os.path.dirname(checkpoints), UNSEALED, os.path.basename(os.path.abspath(step_dir)))


def never_sealed(step_dir: str) -> bool:
    """Was the step marked by its writer (`unsealed_marker`) and never sealed (no manifest)? No file is read."""
    return not os.path.exists(os.path.join(step_dir, MANIFEST)) and os.path.exists(unsealed_marker(step_dir))


def verify_manifest(step_dir: str, item: str | None = None) -> str | None:
    """None if every file of the step (of its `item` only, e.g. "meta") matches its manifest, else what is wrong
    (naming the file). A step without a manifest: NEVER_SEALED when its writer marked it (`unsealed_marker`: a
    damaged step), else "unsealed" (written before manifests existed: the caller decides)."""
    path = os.path.join(step_dir, MANIFEST)
    if not os.path.exists(path):
        return NEVER_SEALED if never_sealed(step_dir) else "unsealed"
    try:
        with open(path) as f:
            files = json.load(f)["files"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"{MANIFEST} is unreadable ({type(e).__name__}: {e})"
    ours = (lambda rel: True) if item is None else (lambda rel: rel.startswith(item + os.sep))  # noqa: E731
    files = {rel: want for rel, want in files.items() if ours(rel)}
    for rel, want in sorted(files.items()):
        p = os.path.join(step_dir, rel)
        if not os.path.exists(p):
            return f"file {rel} is missing"
        if os.path.getsize(p) != want["size"]:
            return f"file {rel} has {os.path.getsize(p)} bytes, the manifest says {want['size']}"
        if file_crc32(p) != want["crc32"]:
            return f"file {rel} fails its checksum (CRC-32 differs from the manifest)"
    extra = sorted({rel for rel in step_files(step_dir) if ours(rel)} - set(files))
    return f"file {extra[0]} is not in the manifest" if extra else None


def intact_steps(directory: str) -> list[int]:
    """Steps below a checkpoints directory whose files all match their manifest, sorted."""
    steps = sorted(int(n) for n in os.listdir(directory) if n.isdigit()) if os.path.isdir(directory) else []
    return [s for s in steps if verify_manifest(os.path.join(directory, str(s))) is None]


def newest_meta(workdir: str) -> tuple[int, dict] | None:
    """(step, meta) of the newest checkpoint whose meta reads -- its files matching the manifest, when the step has
    one -- without opening any array; None if there is none. (orbax's JsonSave writes an item as <item>/metadata.)"""
    directory = os.path.join(os.path.abspath(workdir), "checkpoints")
    steps = sorted((int(n) for n in os.listdir(directory) if n.isdigit()), reverse=True) \
        if os.path.isdir(directory) else []
    for step in steps:
        step_dir = os.path.join(directory, str(step))
        if verify_manifest(step_dir, "meta") in (None, "unsealed"):
            try:
                with open(os.path.join(step_dir, "meta", "metadata")) as f:
                    return step, json.load(f)
            except (OSError, ValueError):
                pass
    return None


def first_non_finite(tree) -> str | None:
    """The key path of the first floating-point array of `tree` holding a NaN or an infinity, or None."""
    for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
        if jnp.issubdtype(x.dtype, jnp.floating) and not bool(jnp.all(jnp.isfinite(x))):
            return "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)
    return None


def short_error(e: Exception) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"


def on_first_device(abstract):
    """A tree of jax.ShapeDtypeStruct (e.g. an abstract nnx.State) placed on the first local device: an orbax restore
    target that any saved topology restores into."""
    device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device), abstract)


def restore_target(item_dir: str, sharding=None):
    """What a saved tree of arrays (an orbax item: a checkpoint's "model", an import's "state") restores into: a
    nested dict of jax.ShapeDtypeStruct with its shapes and dtypes (orbax's metadata; no array is read), placed by
    `sharding`: None -> the first local device, whatever mesh wrote it (a pod run sampled or exported on a laptop);
    else a callable (key path as a tuple of str, shape) -> jax.sharding.Sharding (e.g. a training mesh's)."""
    absl = logging.getLogger("absl")
    level = absl.level
    absl.setLevel(logging.ERROR)  # orbax warns that an item has no _CHECKPOINT_METADATA of its own
    try:
        with ocp.StandardCheckpointer() as ck:
            tree = ck.metadata(os.path.abspath(item_dir)).item_metadata.tree
    finally:
        absl.setLevel(level)
    if sharding is None:
        return on_first_device(tree)
    return jax.tree_util.tree_map_with_path(lambda path, m: jax.ShapeDtypeStruct(
        m.shape, m.dtype, sharding=sharding(tuple(str(getattr(k, "key", k)) for k in path), m.shape)), tree)


def load_model_state(workdir: str, sharding=None) -> tuple[dict, dict, int]:
    """The model state (nested dict of arrays) and meta of the newest intact checkpoint of a finished or running
    stage, for initialising the next stage. -> (state, meta, step). Damaged steps are skipped (not moved). The
    arrays go where `sharding` says (`restore_target`: by default the first local device), so a checkpoint written
    on any mesh restores on any other."""
    directory = os.path.join(os.path.abspath(workdir), "checkpoints")
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"{workdir}: no checkpoints directory {directory}")
    quiet_orbax()
    manager = ocp.CheckpointManager(directory, item_names=("model", "meta"))
    problems = []
    try:
        for step in sorted(manager.all_steps(), reverse=True):
            problem = verify_manifest(os.path.join(directory, str(step)))
            if problem in (None, "unsealed"):
                try:
                    target = restore_target(os.path.join(directory, str(step), "model"), sharding)
                    r = manager.restore(step, args=ocp.args.Composite(model=ocp.args.StandardRestore(target),
                                                                      meta=ocp.args.JsonRestore()))
                    bad = first_non_finite(r.model)
                    if bad is None:
                        return r.model, r.meta, step
                    problem = f"tensor {bad} holds non-finite values"
                except Exception as e:  # noqa: BLE001
                    problem = f"unreadable ({short_error(e)})"
                    OrbaxNoise.count = 0  # the reports of this read error: it is named in the warning below
            warnings.warn(f"checkpoint {directory}/{step} is damaged and was skipped: {problem}", stacklevel=2)
            problems.append(f"step {step}: {problem}")
    finally:
        manager.close()
    raise CheckpointError(f"{workdir}: no intact checkpoint in {directory}"
                          + (f" ({'; '.join(problems)})" if problems else ""))

