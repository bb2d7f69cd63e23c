"""Compiled train steps kept across processes: a rerun of a stage loads its train step's executable from disk instead
of tracing, lowering and then fetching it from JAX's compilation cache (about 1.6 s of single-threaded Python for the
tiny model, minutes for a large one on a pod).

    step = load_or_compile(jitted_step, abstract_args, key_parts)   # -> a jax.stages.Compiled

JAX's persistent compilation cache keys an executable by the program's HLO, so it must trace and lower the program
before it can look it up. This cache keys it by what the program is traced from instead, all of it:
- the source of every module of glmjax and pallas_kernels (a sha256 over their bytes when the cache is enabled, at
  the start: any edit is a miss; a program is not written if the files changed while it was traced);
- the versions of Python, jax, jaxlib, flax and optax;
- every JAX config value (matmul precision, PRNG implementation, x64, ...; not the logging and cache settings),
  $XLA_FLAGS, $LIBTPU_INIT_ARGS and every $GLMJAX_* (e.g. GLMJAX_PALLAS_INTERPRET) but the cache's own;
- the backend's platform version (libtpu, CUDA), the devices (platform, kind, id, process), this process's index
  and count;
- the caller's `key_parts` (for the train loop: the stage's config, every field that reaches the step);
- the arguments' tree structure, shapes, dtypes and shardings (mesh axes, device order, partition specs).
A load that fails (a corrupt or foreign file, an incompatible jaxlib) falls back to compiling, with one warning; a
loaded program whose first call fails is removed (the next run compiles). Entries are pickles, read with the trust
given to JAX's own cache directory: keep it private.

Only a freshly compiled executable is written: one that JAX read from its own cache serializes incompletely on the
CPU backend (jaxlib 0.10.2: reloading it fails at the first call, "Function ... not found"), so after an edit of
glmjax that leaves the program's HLO unchanged the step keeps coming from JAX's cache (traced and lowered each run)
until its HLO changes. Single-process runs only (in a multi-process run one process may receive the others'
binary, `jax_share_binary_between_hosts`).

It is on only where an entry point turns it on (`enable`, from `glmjax-train` / train.py with the compilation
cache on: a `programs/` directory inside it). A program traced with code that does not come from these files -- a
test's monkeypatch, a library user's subclass -- would not be seen by the key, so library use of `train()` in the
same process never reads it.
"""
from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import os
import pickle
import sys
import threading
import warnings

import jax
from jax.experimental import serialize_executable

_DIR: str | None = None
_DIGEST: str | None = None  # source_digest() when the cache was enabled (before the code it covers is traced)
PACKAGES = ("glmjax", "pallas_kernels")
# JAX config values that do not change a program (logging, the persistent cache's own settings)
UNRELATED = ("jax_log_compiles", "jax_logging_level", "jax_explain_cache_misses", "jax_compilation_cache_dir",
             "jax_enable_compilation_cache", "jax_persistent_cache_min_compile_time_secs",
             "jax_persistent_cache_min_entry_size_bytes", "jax_compilation_cache_max_size",
             "jax_raise_persistent_cache_errors")
_HITS = threading.local()  # .count: JAX persistent-cache hits in this thread


def enable(directory: str | None) -> None:
    """Keep compiled train steps in `directory` (None: off)."""
    global _DIR, _DIGEST
    if directory is not None and not getattr(enable, "listening", False):
        jax.monitoring.register_event_listener(_count_hit)
        enable.listening = True
    _DIR, _DIGEST = directory, source_digest() if directory is not None else None


def _count_hit(event: str, **_):
    if event == "/jax/compilation_cache/cache_hits":
        _HITS.count = getattr(_HITS, "count", 0) + 1


def source_digest() -> str:
    """sha256 over the path and bytes of every .py file of glmjax and pallas_kernels."""
    h = hashlib.sha256()
    for name in PACKAGES:
        root = os.path.dirname(importlib.import_module(name).__file__)
        for folder, dirs, files in sorted(os.walk(root)):
            dirs.sort()
            for f in sorted(files):
                if f.endswith(".py"):
                    path = os.path.join(folder, f)
                    h.update(os.path.relpath(path, root).encode() + b"\0")
                    with open(path, "rb") as fh:
                        h.update(fh.read() + b"\0")
    return h.hexdigest()


def describe_sharding(s) -> str:
    if isinstance(s, jax.sharding.NamedSharding):
        m = s.mesh
        return repr((m.axis_names, m.devices.shape, [d.id for d in m.devices.flat], str(m.axis_types), str(s.spec),
                     s.memory_kind))
    return repr(s)


def program_key(args, key_parts) -> str:
    """sha256 of everything the module docstring lists."""
    leaves, tree = jax.tree.flatten(args)
    versions = [sys.version] + [importlib.metadata.version(p) for p in ("jax", "jaxlib", "flax", "optax")]
    config = sorted((k, repr(v)) for k, v in jax.config.values.items() if k not in UNRELATED)
    env = sorted((k, v) for k, v in os.environ.items()
                 if k in ("XLA_FLAGS", "LIBTPU_INIT_ARGS") or (k.startswith("GLMJAX_") and k != "GLMJAX_CACHE_DIR"))
    backend = jax.devices()[0].client
    devices = [(d.platform, d.device_kind, d.id, d.process_index) for d in jax.devices()]
    parts = [_DIGEST or source_digest(), versions, backend.platform_version, config, env, devices,
             jax.process_index(), jax.process_count(), key_parts, str(tree),
             [(tuple(x.shape), str(x.dtype), describe_sharding(getattr(x, "sharding", None))) for x in leaves]]
    return hashlib.sha256(repr(parts).encode()).hexdigest()


def load_or_compile(jitted, args, key_parts):
    """jitted.lower(*args).compile(), or the same executable read from the program cache (written there after a
    compile). args: arrays or ShapeDtypeStructs with shardings."""
    if _DIR is None or jax.process_count() > 1:
        return jitted.lower(*args).compile()
    try:
        path = os.path.join(_DIR, program_key(args, key_parts) + ".program")
    except Exception as e:  # noqa: BLE001 -- e.g. a package without metadata: no cache, still trains
        warnings.warn(f"program cache: no key ({type(e).__name__}: {e}); compiling", stacklevel=2)
        return jitted.lower(*args).compile()
    if os.path.exists(path):
        try:
            return FirstCallGuard(read(path, args), path)
        except Exception as e:  # noqa: BLE001 -- any unreadable entry: compile instead
            warnings.warn(f"program cache: {path} not used ({type(e).__name__}: {e}); compiling", stacklevel=2)
    hits = getattr(_HITS, "count", 0)
    compiled = jitted.lower(*args).compile()
    if getattr(_HITS, "count", 0) == hits and source_digest() == _DIGEST:  # fresh, from the code the key names
        write(compiled, path)  # (one read from JAX's cache does not serialize: module docstring)
    return compiled


def read(path: str, args):
    with open(path, "rb") as f:
        (payload, in_tree, out_tree), device_ids = pickle.load(f)
    by_id = {d.id: d for d in jax.devices()}
    compiled = serialize_executable.deserialize_and_load(payload, in_tree, out_tree,
                                                         execution_devices=[by_id[i] for i in device_ids])
    if jax.tree.structure(compiled.args_info) != jax.tree.structure((args, {})):
        raise ValueError("its arguments differ")
    return compiled


def write(compiled, path: str):
    try:
        device_ids = [d.id for d in compiled.runtime_executable().local_devices()]  # in the program's order
        blob = pickle.dumps((serialize_executable.serialize(compiled), device_ids))
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "wb") as f:
            f.write(blob)
        os.replace(tmp, path)
    except Exception as e:  # noqa: BLE001 -- a step that cannot be kept (e.g. host callbacks) still trains
        warnings.warn(f"program cache: not kept, a rerun traces it again ({type(e).__name__}: {e})", stacklevel=2)


class FirstCallGuard:
    """A program read from the cache; if its first call fails (an executable that loads but does not run), its
    file is removed so that the next run compiles, and the error is raised."""

    def __init__(self, compiled, path: str):
        self.compiled, self.path = compiled, path

    def __call__(self, *args):
        if self.path is None:
            return self.compiled(*args)
        try:
            out = self.compiled(*args)
        except Exception:
            with contextlib.suppress(OSError):
                os.remove(self.path)
            raise
        self.path = None
        return out
