"""glmjax/train/hlo_cost.py: loop-trip-aware FLOPs / bytes from compiled TPU HLO (v5p, compiled on this CPU host),
against closed forms and against XLA's own cost analysis of the same program written without loops."""
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.compilation_cache.compilation_cache import reset_cache
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from glmjax.train import aot, hlo_cost

os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
M, K, TRIPS = 256, 512, 6


@pytest.fixture(scope="module")
def arg():
    sharding = NamedSharding(Mesh(aot.topology_devices("v5p:2x2x1")[:1], ("x",)), P())
    return lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32, sharding=sharding)


def compiled_text(f, *args):
    c = aot.compile_uncached(jax.jit(f).lower(*args))
    ca = c.cost_analysis()
    return c.as_text(), ca[0] if isinstance(ca, (list, tuple)) else ca


def scanned(x, w):
    return jnp.sum(jax.lax.scan(lambda h, wi: (jnp.tanh(h @ wi), None), x, w)[0])


def unrolled(x, w):
    for i in range(w.shape[0]):
        x = jnp.tanh(x @ w[i])
    return jnp.sum(x)


def test_loops_count_once_per_trip_as_the_unrolled_program(arg):
    """Forward and backward of a 6-step scan of [256,512] @ [512,512]: each loop's trip count is read from the HLO,
    its FLOPs count 6 times (closed form: 3 matmuls per step), as XLA counts the unrolled program; counted once
    per body (per_trip=False) they are XLA's count of the scanned program."""
    x, w = arg(M, K), arg(TRIPS, K, K)
    text, xla = compiled_text(jax.grad(scanned, argnums=1), x, w)
    once, per_trip = hlo_cost.count(text, per_trip=False), hlo_cost.count(text)
    assert sorted(loop["trips"] for loop in per_trip["loops"]) == [TRIPS, TRIPS] and not per_trip["unknown_trips"]
    assert once["flops"] == pytest.approx(xla["flops"], rel=1e-6)  # XLA's rules where nothing repeats
    matmuls = 3 * TRIPS * 2 * M * K * K  # h @ w forward; dh and dw backward
    assert matmuls <= per_trip["flops"] < 1.1 * matmuls
    assert once["flops"] < matmuls / TRIPS * 1.1  # the negative control: one trip of each loop
    text_u, xla_u = compiled_text(jax.grad(unrolled, argnums=1), x, w)
    assert per_trip["flops"] == pytest.approx(xla_u["flops"], rel=0.1)
    scaled = xla["bytes accessed"] * per_trip["bytes"] / once["bytes"]  # aot.cost's per-trip HBM bytes
    assert scaled == pytest.approx(xla_u["bytes accessed"], rel=0.25)


def test_conditional_branches_are_kept_apart_and_scale(arg):
    """A scan whose step runs a matmul only under lax.cond: the branch counts every trip (XLA's rule: the costlier
    branch), is reported as cond_flops, and scale_conditionals(f) keeps f of it."""
    def f(x, w):
        def step(h, wi):
            return jax.lax.cond(jnp.sum(wi) > 0, lambda h: h @ wi, lambda h: h, h), None
        return jnp.sum(jax.lax.scan(step, x, w)[0])

    c = hlo_cost.count(compiled_text(f, arg(M, K), arg(TRIPS, K, K))[0])
    matmuls = TRIPS * 2 * M * K * K
    assert matmuls <= c["cond_flops"] <= c["flops"] < 1.1 * matmuls
    half = hlo_cost.scale_conditionals(c, 0.5)
    assert half["flops"] == pytest.approx(c["flops"] - 0.5 * c["cond_flops"])


def test_convolution_windows_count_only_positions_that_land():
    """A batched matmul as TPU writes it: the batch is a window of size 32 with lhs_dilate 32, of which one
    position lands per output -> 2 x output x contraction, not x 32."""
    line = ("%c = f32[32,256,64]{1,2,0} convolution(%a, %b), window={size=32 stride=31 lhs_dilate=32}, "
            "dim_labels=0bf_0io->0bf")
    inst = hlo_cost._parse_inst(line)
    shapes = {"a": "f32[32,256,128]{2,1,0}", "b": "f32[32,128,64]{2,1,0}"}
    assert hlo_cost.conv_flops(inst, shapes) == 2 * 32 * 256 * 64 * 128


@pytest.mark.parametrize("layout, shards", [("zigzag", 1), ("zigzag", 4), ("contiguous", 4)])
def test_needed_block_fraction_matches_a_brute_force_count(layout, shards):
    """aot.needed_block_fraction against counting (query block, key block) pairs with a visible key, query by
    query, on the busiest shard (S = 1,536 tokens, blocks of 128; one document)."""
    from glmjax.model.context import Layout
    S, b = 1536, 128
    slots = Layout(layout, shards).perm(S) if shards > 1 else np.arange(S)
    n = S // shards
    worst = 0.0
    for i in range(shards):
        mine = slots[i * n:(i + 1) * n]
        pairs = [any(t0 <= s for s in mine[q:q + b]) for q in range(0, n, b) for t0 in range(0, S, b)]
        worst = max(worst, np.mean(pairs))
    assert aot.needed_block_fraction(S, b, shards, layout) == pytest.approx(worst)
    if layout == "zigzag" and shards == 1:
        assert worst == pytest.approx((S // b + 1) / (2 * (S // b)))  # causal: (n+1)/2n of the n^2 pairs


def test_topology_compiles_bypass_the_cache_this_process_already_uses(arg, tmp_path):
    """An executable compiled for a described TPU topology cannot be loaded back from the persistent cache (JAX
    warns "PjRtCompiler must be constructed with a Client", an error in this suite), so `compile_uncached` must
    neither write nor read it -- also after this process has compiled (and cached) a CPU program, when JAX has
    already decided the cache is on -- and leaves the cache on for what follows. A cache directory of its own:
    the other xdist worker writes to the suite's."""
    saved = {k: getattr(jax.config, k) for k in ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs")}
    files = lambda: set(os.listdir(tmp_path))  # noqa: E731
    jax.config.update("jax_compilation_cache_dir", str(tmp_path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    reset_cache()  # JAX opens the cache directory once per process
    try:
        jax.jit(lambda v: v * 3.0)(np.float32(1.0)).block_until_ready()  # the cache is on in this process
        before = files()
        assert len(before) == 1
        for _ in range(2):
            aot.compile_uncached(jax.jit(lambda v: jnp.sum(jnp.cos(v))).lower(arg(8, 128)))
        assert files() == before
        jax.jit(lambda v: v - 3.0)(np.float32(1.0)).block_until_ready()
        assert len(files() - before) == 1  # on again
    finally:
        for k, v in saved.items():
            jax.config.update(k, v)
        reset_cache()
