import os
import sys
import tempfile

# Tests run on CPU; several virtual devices for the sharding tests (must be set before jax is imported).
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402

# A persistent compilation cache shared by the xdist workers and by reruns: compiling dominates CPU test time.
jax.config.update("jax_compilation_cache_dir", os.environ.get("GLMJAX_TEST_CACHE",
                                                              os.path.join(tempfile.gettempdir(), "glmjax_jax_cache")))
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
