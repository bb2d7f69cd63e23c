"""What every entry point (glmjax-train / train.py, glmjax-generate, glmjax-hf) sets up before JAX starts a backend.

  configure_jax(compilation_cache=None)   # the per-user persistent cache; "" turns it off; a path uses that path

- **Persistent compilation cache, on by default**: `default_cache_dir()` (`$GLMJAX_CACHE_DIR`, else
  `$XDG_CACHE_HOME/glmjax/jax_cache`, else `~/.cache/glmjax/jax_cache`). A rerun of the same stage loads its
  executables instead of compiling them. Safe to share between glmjax versions, JAX versions and meshes: JAX keys
  each entry by the program's HLO, the compile options (device assignment and mesh included), the XLA flags, the
  backend and the jax / jaxlib versions, so a changed program, mesh or version is a miss, never a wrong executable.
  No size limit is set: JAX's LRU eviction (`jax_compilation_cache_max_size`) is not safe for several processes
  sharing the directory (seen: "Error writing persistent compilation cache entry ... -atime: No such file"); delete
  the directory to reclaim the space.
- **Compiled train steps beside it** (`glmjax-train` / train.py only): `<cache>/programs/` holds the train step and
  the initialiser of each stage run, keyed by the code and config they are traced from, so a rerun skips tracing and
  lowering them as well (glmjax/train/programs.py says what the key covers).
  Executables compiled for a described TPU topology bypass it (`pallas_kernels.aot.compile_uncached`).
- **No libtpu start-up noise on a machine without a TPU**: with `jax[tpu]` installed (the test extra brings it),
  JAX tries its TPU backend on every machine, and libtpu prints initialisation errors ("Failed to find host bounds
  for accelerator type", "INVALID_ARGUMENT: Error: unexpected worker hostname ...") before falling back to the CPU.
  Where no TPU and no GPU is attached and no platform was asked for, JAX is told to use the CPU. Ahead-of-time
  compiles for a TPU topology (`--dry-run --topology=...`) still load libtpu when they ask for it.
- **Warnings in one line**: `warning: <message>`, not Python's file:line and source line (a damaged checkpoint
  skipped, a deprecation), so that an error ends a run's output in one line of its own.
"""
from __future__ import annotations

import os
import warnings


def default_cache_dir() -> str:
    if os.environ.get("GLMJAX_CACHE_DIR"):
        return os.environ["GLMJAX_CACHE_DIR"]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "glmjax", "jax_cache")


def configure_jax(compilation_cache: str | None = None) -> str | None:
    """Call before the first `jax.devices()` / jit. `compilation_cache`: None = the directory JAX already has
    (JAX_COMPILATION_CACHE_DIR, or set by a program calling this main()), else `default_cache_dir()`; "" = off; else
    that directory. -> the cache directory in use (None if off)."""
    import jax

    warnings.formatwarning = lambda message, *_, **__: f"warning: {message}\n"
    cpu_unless_accelerator()
    if compilation_cache is None and jax.config.jax_compilation_cache_dir:
        return jax.config.jax_compilation_cache_dir
    path = default_cache_dir() if compilation_cache is None else compilation_cache
    if not path:
        jax.config.update("jax_enable_compilation_cache", False)
        return None
    jax.config.update("jax_compilation_cache_dir", os.path.abspath(os.path.expanduser(path)))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)  # model set-up's many small programs too
    return path


def cpu_unless_accelerator() -> None:
    """Use the CPU backend only, unless a TPU or GPU is attached or a platform was chosen (JAX_PLATFORMS, or JAX
    itself on a TPU VM). Must run before the first backend use (a later update has no effect)."""
    import jax

    if os.environ.get("JAX_PLATFORMS") or jax.config.jax_platforms or "JAX_FORCE_TPU_INIT" in os.environ:
        return
    try:
        from jax._src import hardware_utils as hw  # JAX's own PCI / device-node checks (cloud_tpu_init uses them)
        if (hw.num_available_tpu_chips_and_device_id()[0] or hw.has_visible_nvidia_gpu()
                or hw.num_available_amd_gpus(stop_at=1)):
            return
    except Exception:  # noqa: BLE001  (moved in a later JAX: keep JAX's own platform discovery)
        return
    jax.config.update("jax_platforms", "cpu")
