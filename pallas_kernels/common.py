"""Helpers shared by the Pallas kernels: interpret-mode selection and calling, padding, and the VMEM limit."""
from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
from jax.experimental.pallas import tpu as pltpu


INTERPRET_ENV = "GLMJAX_PALLAS_INTERPRET"


def interpret_params(interpret: bool | str | None):
    """The `interpret=` argument of `pl.pallas_call`.

    None: compiled (Mosaic) when `jax.default_backend()` is "tpu", otherwise interpreted in the mode named by
    $GLMJAX_PALLAS_INTERPRET (default "checked"). True: that off-TPU mode. False: compiled (what AOT compilation
    for a TPU topology from a CPU host passes). Modes:
      "checked": Pallas' TPU interpreter (`pltpu.InterpretParams`): simulated HBM/VMEM/SMEM, DMAs and semaphores,
                 out-of-bounds reads raise, uninitialised memory reads NaN, DMA race detection on. About 10 ms per
                 DMA on CPU: for small shapes.
      "fast":    the discharge interpreter (`interpret=True`): the kernel becomes plain XLA ops and DMAs become
                 copies; no checks, but fast enough to train a tiny model.
    Both work under `jax.checkpoint` (see `call`).
    """
    if interpret is None:
        interpret = jax.default_backend() != "tpu"
    if interpret is False:
        return False
    mode = os.environ.get(INTERPRET_ENV, "checked") if interpret is True else interpret
    if mode == "checked":
        return pltpu.InterpretParams(detect_races=True, out_of_bounds_reads="raise", uninitialized_memory="nan")
    if mode == "fast":
        return True
    raise ValueError(f"Pallas interpret mode {mode!r} (${INTERPRET_ENV} or interpret=): must be 'checked' or 'fast'")


def call(kernel, mode, *args):
    """kernel(*args) for a `pl.pallas_call` built with interpret=`mode` (from `interpret_params`). The "checked"
    interpreter runs the kernel through ordered io_callbacks, effects that `jax.checkpoint` cannot partially evaluate
    ("Effects not supported in partial-eval of checkpoint/remat"); the kernel is a pure function of its operands, so
    in that mode it runs inside a `jax.pure_callback` (the interpreter, checks included, executes on the host when
    the callback fires) and remat may recompute it like any other op. Compiled and "fast" kernels are called as
    they are."""
    if not isinstance(mode, pltpu.InterpretParams):
        return kernel(*args)
    return jax.pure_callback(jax.jit(kernel), jax.eval_shape(kernel, *args), *args, vmap_method="sequential")


def round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def pad_axis(a, axis: int, size: int, value=0):
    """Pad `a` along `axis` at the end to `size` with `value` (no copy when already that size)."""
    if a.shape[axis] == size:
        return a
    widths = [(0, 0)] * a.ndim
    widths[axis] = (0, size - a.shape[axis])
    return jnp.pad(a, widths, constant_values=value)


def vmem_limit(nbytes: int) -> int:
    """Scoped-VMEM request for a kernel whose buffers need about `nbytes`: 1.5x headroom for Mosaic's temporaries,
    at least 32 MiB, at most 60 MiB (v5p has 64 MiB of VMEM per TensorCore, v5e 128 MiB)."""
    return int(min(max(1.5 * nbytes, 32 * 2 ** 20), 60 * 2 ** 20))


def lane_padded(rows: int, cols: int, itemsize: int) -> int:
    """Bytes of a [rows, cols] VMEM array in (8, 128) tiles of 32-bit words (16 sublanes for 16-bit types)."""
    sub = 8 * (4 // itemsize) if itemsize < 4 else 8
    return round_up(rows, sub) * round_up(cols, 128) * itemsize


def sparse_mla_vjp(forward, backward):
    """The custom-VJP function of a sparse MLA kernel pair: forward(q, kv, indices, scale, R, blocks, interpret) ->
    (out, lse); backward(q, kv, indices, dout, lse, dterm, scale, R, blocks, interpret) -> (dq, dkv), where
    dterm = sum(dout * out) - dlse per query and head (the softmax backward's delta, with the lse's cotangent)."""
    @functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
    def fn(q, kv, indices, scale, R, blocks, interpret):
        return forward(q, kv, indices, scale, R, blocks, interpret)

    def fwd(q, kv, indices, scale, R, blocks, interpret):
        out, lse = forward(q, kv, indices, scale, R, blocks, interpret)
        return (out, lse), (q, kv, indices, out, lse)

    def bwd(scale, R, blocks, interpret, res, cts):
        q, kv, indices, out, lse = res
        dout, dlse = cts
        dterm = jnp.sum(dout.astype(jnp.float32) * out.astype(jnp.float32), axis=-1) - dlse
        dq, dkv = backward(q, kv, indices, dout, lse, dterm, scale, R, blocks, interpret)
        return dq, dkv, None

    fn.defvjp(fwd, bwd)
    return fn
