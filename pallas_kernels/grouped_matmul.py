"""Grouped matmul for NVIDIA GPUs (Pallas, Triton backend): rows sorted by group in a padded block layout (every
block of `bm` rows belongs to one group), each block times its group's matrix read in place -- no per-block copy
of the weights -- and the weight gradient of each group summed over its blocks by one program -- no scatter.

    gmm(xp [nb*bm, D], w [E,D,F], block_group [nb], group_blocks [E+1]) -> [nb*bm, F]
        block j: xp[j*bm:(j+1)*bm] @ w[block_group[j]]; group_blocks[e]..group_blocks[e+1]-1 are group e's blocks,
        blocks from group_blocks[E] on hold no rows (their outputs are 0, nothing computed)
    backward: dxp = dy @ w[g]^T per block (the same kernel reading w transposed in place), dw[e] = sum over group
              e's blocks of xp_j^T dy_j (`_tgmm`; a group without blocks gets 0)

The layout is `glmjax.model.moe.block_layout`'s; padding rows are zero in, and their outputs are not read. Tiles:
bn output columns and bk contracted columns per step (powers of two of at least 16 dividing F and D, as Triton
wants them). Its XLA formula is `glmjax.model.moe.block_matmul` (tests/test_moe.py compares them). Off a GPU the
kernels run in Pallas' interpret mode (how the tests run them).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

f32 = jnp.float32


def tile(n: int, most: int = 64) -> int:
    """The largest power of two <= most dividing n (Triton tiles are powers of two; its dots want 16 at least)."""
    t = most
    while n % t:
        t //= 2
    if t < 16:
        raise ValueError(f"grouped matmul: dimension {n} is not a multiple of 16")
    return t


def _gmm_kernel(group_ref, off_ref, x_ref, w_ref, o_ref, *, bk: int, transpose: bool):
    j, E = pl.program_id(0), off_ref.shape[0] - 1
    g = group_ref[j]
    bn = o_ref.shape[-1]
    cols = pl.ds(pl.program_id(1) * bn, bn)

    def step(k, acc):
        ks = pl.ds(k * bk, bk)
        w = w_ref[g, cols, ks].T if transpose else w_ref[g, ks, cols]  # [bk, bn]
        return acc + jnp.dot(x_ref[:, ks], w, preferred_element_type=f32)

    @pl.when(j < off_ref[E])
    def _():
        acc = jax.lax.fori_loop(0, x_ref.shape[-1] // bk, step, jnp.zeros(o_ref.shape, f32))
        o_ref[...] = acc.astype(o_ref.dtype)

    @pl.when(j >= off_ref[E])
    def _():
        o_ref[...] = jnp.zeros(o_ref.shape, o_ref.dtype)


def _gmm(xp, w, block_group, group_blocks, interpret: bool, transpose: bool = False):
    """xp [nb*bm, K] times w [E,K,N] (transpose: w [E,N,K], read as its transpose) per block -> [nb*bm, N]."""
    nb, E = block_group.shape[0], w.shape[0]
    bm, K = xp.shape[0] // nb, xp.shape[1]
    N = w.shape[1] if transpose else w.shape[2]
    bn, bk = tile(N), tile(K, 32)
    return pl.pallas_call(
        functools.partial(_gmm_kernel, bk=bk, transpose=transpose), grid=(nb, N // bn),
        in_specs=[pl.BlockSpec((nb,), lambda j, n: (0,)), pl.BlockSpec((E + 1,), lambda j, n: (0,)),
                  pl.BlockSpec((bm, K), lambda j, n: (j, 0)), pl.BlockSpec(w.shape, lambda j, n: (0, 0, 0))],
        out_specs=pl.BlockSpec((bm, bn), lambda j, n: (j, n)),
        out_shape=jax.ShapeDtypeStruct((xp.shape[0], N), xp.dtype), interpret=interpret, name="gmm")(
            block_group, group_blocks, xp, w)


def _tgmm_kernel(off_ref, x_ref, dy_ref, o_ref, *, bm: int):
    e = pl.program_id(0)
    bd, bf = o_ref.shape
    rows_d, rows_f = pl.ds(pl.program_id(1) * bd, bd), pl.ds(pl.program_id(2) * bf, bf)

    def step(j, acc):
        rows = pl.ds(j * bm, bm)
        return acc + jnp.dot(x_ref[rows, rows_d].T, dy_ref[rows, rows_f], preferred_element_type=f32)

    acc = jax.lax.fori_loop(off_ref[e], off_ref[e + 1], step, jnp.zeros(o_ref.shape, f32))
    o_ref[...] = acc.astype(o_ref.dtype)


def _tgmm(xp, dy, group_blocks, nb: int, dtype, interpret: bool):
    """[E,D,F]: per group, the sum over its blocks of xp_j^T dy_j."""
    (M, D), F, E = xp.shape, dy.shape[-1], group_blocks.shape[0] - 1
    bd, bf = tile(D), tile(F)
    return pl.pallas_call(
        functools.partial(_tgmm_kernel, bm=M // nb), grid=(E, D // bd, F // bf),
        in_specs=[pl.BlockSpec((E + 1,), lambda e, i, n: (0,)), pl.BlockSpec((M, D), lambda e, i, n: (0, 0)),
                  pl.BlockSpec((M, F), lambda e, i, n: (0, 0))],
        out_specs=pl.BlockSpec((None, bd, bf), lambda e, i, n: (e, i, n)),
        out_shape=jax.ShapeDtypeStruct((E, D, F), dtype), interpret=interpret, name="tgmm")(group_blocks, xp, dy)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def gmm(xp, w, block_group, group_blocks, interpret: bool = False):
    """xp [nb*bm, D] (rows in the padded block layout), w [E,D,F], block_group [nb] int32 (non-decreasing),
    group_blocks [E+1] int32 (group e's blocks: group_blocks[e] .. group_blocks[e+1]-1) -> [nb*bm, F] in xp's
    dtype, f32 accumulation. Differentiable in xp and w."""
    return _gmm(xp, w, block_group, group_blocks, interpret)


def _gmm_fwd(xp, w, block_group, group_blocks, interpret):
    return _gmm(xp, w, block_group, group_blocks, interpret), (xp, w, block_group, group_blocks)


def _gmm_bwd(interpret, res, dy):
    xp, w, block_group, group_blocks = res
    dx = _gmm(dy, w, block_group, group_blocks, interpret, transpose=True)
    dw = _tgmm(xp, dy, group_blocks, block_group.shape[0], w.dtype, interpret)
    return dx, dw, None, None


gmm.defvjp(_gmm_fwd, _gmm_bwd)
