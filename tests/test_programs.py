"""glmjax/train/programs.py: a compiled program written by one call is read back by the next with the same key (no
lowering: the jitted function's `lower` is made to fail), computes what the compiled program computes, and any
change of key -- arguments' shapes, the caller's fields, the source of the packages -- is a miss; a damaged file
is replaced with a warning, and one whose first call fails is removed; an executable JAX read from its own cache
is not written (it does not reload), nor one traced while the source files changed."""
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from glmjax.train import programs


@pytest.fixture
def cache(tmp_path):
    programs.enable(str(tmp_path / "programs"))
    yield tmp_path / "programs"
    programs.enable(None)


class NoLowering:
    """A jitted function that must not be lowered (a read from the program cache does not lower)."""

    def lower(self, *args):
        raise AssertionError("lowered: the program was not read from the cache")


def fresh_fn():
    """A function whose HLO no earlier process compiled (JAX's own persistent cache misses it: a random constant),
    and the constant."""
    c = float(np.random.default_rng().uniform(1, 2))
    return jax.jit(lambda x, y: (jnp.sin(x) * c + y.sum(), x.mean()), donate_argnums=0), c


def files(cache):
    return sorted(os.listdir(cache)) if cache.exists() else []


def test_a_program_is_written_once_and_read_back_with_the_same_results(cache, monkeypatch):
    fn, c = fresh_fn()
    x, y = jnp.arange(6.0).reshape(2, 3), jnp.ones(4)
    args = (jax.ShapeDtypeStruct(x.shape, x.dtype), jax.ShapeDtypeStruct(y.shape, y.dtype))
    want = jax.device_get(programs.load_or_compile(fn, args, {"name": "f"})(x.copy(), y))
    assert len(files(cache)) == 1
    got = jax.device_get(programs.load_or_compile(NoLowering(), args, {"name": "f"})(x.copy(), y))
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)))
    np.testing.assert_allclose(got[0], np.sin(np.arange(6.0).reshape(2, 3)) * c + 4, rtol=1e-6)
    assert len(files(cache)) == 1

    # a miss for other argument shapes, other caller fields, other source code: each compiles and writes its own
    with pytest.raises(AssertionError, match="lowered"):
        programs.load_or_compile(NoLowering(), (args[0], jax.ShapeDtypeStruct((5,), y.dtype)), {"name": "f"})
    with pytest.raises(AssertionError, match="lowered"):
        programs.load_or_compile(NoLowering(), args, {"name": "g"})
    monkeypatch.setattr(programs, "_DIGEST", "an edited glmjax")
    with pytest.raises(AssertionError, match="lowered"):
        programs.load_or_compile(NoLowering(), args, {"name": "f"})


def test_a_damaged_program_is_replaced_and_a_cache_loaded_one_is_not_written(cache):
    fn, _ = fresh_fn()
    x, y = jnp.ones((2, 3)), jnp.ones(4)
    args = (jax.ShapeDtypeStruct(x.shape, x.dtype), jax.ShapeDtypeStruct(y.shape, y.dtype))
    want = jax.device_get(programs.load_or_compile(fn, args, {})(x.copy(), y))
    (name,) = files(cache)
    with open(cache / name, "wb") as f:
        f.write(b"not a program")
    with pytest.warns(UserWarning, match="not used"):
        got = jax.device_get(programs.load_or_compile(fresh_again(fn), args, {})(x.copy(), y))
    assert np.array_equal(got[0], want[0])
    assert os.path.getsize(cache / name) > 1000  # rewritten from the compile

    os.remove(cache / name)  # JAX's persistent cache (tests/conftest.py) holds this HLO: read back, not written
    jax.clear_caches()  # no executable in memory
    programs.load_or_compile(fresh_again(fn), args, {})
    assert files(cache) == []


def test_a_program_whose_first_call_fails_is_removed_and_one_traced_from_changed_files_is_not_written(
        cache, monkeypatch):
    path = cache / "x.program"
    cache.mkdir()
    path.write_bytes(b"x")

    def broken(*args):
        raise RuntimeError("INTERNAL: Function wrapped_broadcast.1 not found")

    with pytest.raises(RuntimeError, match="not found"):
        programs.FirstCallGuard(broken, str(path))(1)
    assert not path.exists()
    path.write_bytes(b"x")
    guarded = programs.FirstCallGuard(lambda v: v + 1, str(path))
    assert guarded(1) == 2 and guarded(2) == 3 and path.exists()

    fn, _ = fresh_fn()
    args = (jax.ShapeDtypeStruct((3,), jnp.float32), jax.ShapeDtypeStruct((2,), jnp.float32))
    monkeypatch.setattr(programs, "source_digest", lambda: "files edited after the start")
    programs.load_or_compile(fn, args, {})
    assert files(cache) == ["x.program"]


def fresh_again(fn):
    """The same function under a new jit (no in-memory executable: the compile goes to JAX's persistent cache)."""
    return jax.jit(fn.__wrapped__, donate_argnums=0)


def test_source_digest_covers_every_python_file(tmp_path, monkeypatch):
    pkg = tmp_path / "digest_pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "m.py").write_text("A = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(programs, "PACKAGES", ("digest_pkg",))
    digest = programs.source_digest
    first = digest()
    (pkg / "sub" / "m.py").write_text("A = 2\n")
    assert digest() != first
    (pkg / "sub" / "m.py").write_text("A = 1\n")
    assert digest() == first
    sys.modules.pop("digest_pkg", None)
