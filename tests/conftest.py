import os
import sys
import tempfile

# Tests run on CPU; several virtual devices for the sharding tests (must be set before jax is imported).
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import pytest  # noqa: E402

# A persistent compilation cache shared by the xdist workers and by reruns: compiling dominates CPU test time.
jax.config.update("jax_compilation_cache_dir", os.environ.get("GLMJAX_TEST_CACHE",
                                                              os.path.join(tempfile.gettempdir(), "glmjax_jax_cache")))
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    """A small BPE tokenizer with a chat template, saved as a Hugging Face checkpoint's tokenizer files."""
    from hf_tokenizer_fixture import write_tokenizer

    return write_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def ref(tok_dir):
    """transformers' tokenizer of tok_dir: the independent reference."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tok_dir)


def pytest_collection_modifyitems(config, items):
    """Modules with a `slow` test run first (each module's tests stay together, in order, so module fixtures are
    built once): the two xdist workers start on the long tests and finish together on the short ones."""
    slow = {item.module.__name__ for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.module.__name__ not in slow)  # stable
