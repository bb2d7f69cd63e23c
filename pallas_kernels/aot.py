"""Ahead-of-time compilation of the kernels for TPU topologies at GLM-5 shapes, from any host (no TPU needed).

`jax.experimental.topologies.get_topology_desc` (needs `jax[tpu]`, i.e. libtpu) describes the chips of e.g.
"v5e:2x2"; the kernels are compiled by Mosaic (interpret=False) inside `shard_map` over all of them, one batch row
per chip, and `compiled.memory_analysis()` / `cost_analysis()` report the per-chip numbers. Used by
tests/test_pallas_aot.py and bench/pallas_aot.py.
"""
from __future__ import annotations

import functools
import os

# Several processes (pytest-xdist workers, other jobs) may load libtpu to describe topologies at the same time.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental.compilation_cache.compilation_cache import reset_cache  # noqa: E402
from jax.experimental.layout import Format, Layout  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

from pallas_kernels.indexer import index_topk  # noqa: E402
from pallas_kernels.sparse_mla import sparse_mla  # noqa: E402

# GLM-5 (docs/model.md A.1): 64 heads, latent 512 + rope 64, indexer 32 heads x 128, top-2048; an 8K training sequence.
GLM5 = dict(S=8192, H=64, R=512, d_r=64, H_I=32, d_I=128, k=2048)
SCALE = 256 ** -0.5  # (qk_nope 192 + rope 64)^-0.5


def kernel_flops(kernel: str, S: int, H: int, R: int, d_r: int, H_I: int, d_I: int, k: int, T: int | None = None
                 ) -> int:
    """Matmul FLOPs per batch row that the kernels' cost estimates declare (index_topk: every key tile, no causal
    skipping; sparse_mla: forward + backward; sparse_mla_fwd: forward)."""
    C, T = R + d_r, S if T is None else T
    if kernel == "index_topk":
        return 2 * S * T * H_I * d_I
    fwd = 2 * S * H * k * (C + R)
    return fwd if kernel == "sparse_mla_fwd" else fwd + 2 * S * H * k * (3 * C + 2 * R)


def compile_kernel(topology: str, kernel: str, shapes: dict | None = None):
    """Compile `kernel` for every chip of `topology`: "sparse_mla" (forward + backward), "sparse_mla_fwd" (forward:
    prefill, or decode when S is small) or "index_topk" (forward); shapes override GLM5, with T (the cache length,
    default S; queries sit at the last S slots) and, for sparse_mla, the kernel's keyword arguments under "kw".
    -> (compiled executable, number of chips)."""
    from jax.experimental import topologies

    sh = dict(GLM5, **(shapes or {}))
    S, H, R, C, HI, DI, K = sh["S"], sh["H"], sh["R"], sh["R"] + sh["d_r"], sh["H_I"], sh["d_I"], sh["k"]
    T, kw = sh.get("T", S), sh.get("kw", {})
    devices = np.array(topologies.get_topology_desc(platform="tpu", topology_name=topology).devices).reshape(-1)
    n = devices.size
    mesh = Mesh(devices, ("chips",))

    def row_major(rank):  # operands and results row-major in HBM, as a model step's producers and consumers
        return Format(Layout(tuple(range(rank))), NamedSharding(mesh, P("chips")))  # (not XLA's free choice)

    def arg(shape, dtype):
        return jax.ShapeDtypeStruct((n,) + shape, dtype, sharding=row_major(len(shape) + 1))

    bf16 = jnp.bfloat16
    attend = functools.partial(sparse_mla, scale=SCALE, kv_lora_rank=R, interpret=False, **kw)
    if kernel == "sparse_mla":
        def f(q, kv, idx, ct):
            (out, lse), vjp = jax.vjp(lambda q, kv: attend(q, kv, idx), q, kv)
            dq, dkv = vjp((ct, jnp.zeros_like(lse)))
            return out, lse, dq, dkv
        args = (arg((S, H, C), bf16), arg((T, C), bf16), arg((S, K), jnp.int32), arg((S, H, R), bf16))
    elif kernel == "sparse_mla_fwd":
        f = attend
        args = (arg((S, H, C), bf16), arg((T, C), bf16), arg((S, K), jnp.int32))
    elif kernel == "index_topk":
        def f(q, k, w, seg):
            return index_topk(q, k, w, seg[:, T - S:], seg, K, 256, jnp.arange(T - S, T, dtype=jnp.int32),
                              interpret=False)
        args = (arg((S, HI, DI), bf16), arg((T, DI), bf16), arg((S, HI), jnp.float32), arg((T,), jnp.int32))
    else:
        raise ValueError(f"kernel {kernel!r}: must be 'sparse_mla', 'sparse_mla_fwd' or 'index_topk'")
    body = jax.shard_map(f, mesh=mesh, in_specs=P("chips"), out_specs=P("chips"), check_vma=False)
    outs = jax.tree.map(lambda o: row_major(o.ndim), jax.eval_shape(body, *args))
    fn = jax.jit(body, out_shardings=outs)
    return compile_uncached(fn.lower(*args)), n


def compile_uncached(lowered):
    """`lowered.compile()` with the persistent compilation cache off: an executable compiled for a described
    topology (no chips attached) is written to the cache but cannot be loaded back -- JAX warns "PjRtCompiler must be
    constructed with a Client" and compiles again. JAX decides once per process whether the cache is used, so the
    flag alone changes nothing after the first compile: `reset_cache` makes it decide again, on the way in (off) and
    on the way out (as before)."""
    enabled = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    reset_cache()
    try:
        return lowered.compile()
    finally:
        jax.config.update("jax_enable_compilation_cache", enabled)
        reset_cache()
