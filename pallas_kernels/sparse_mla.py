"""Sparse MLA attention in MQA form (docs/model.md B.7, D.2) as Pallas TPU kernels, forward and backward.

Same contract as the XLA reference `sparse_mla_reference` below (and `glmjax.model.sparse_attention.sparse_mla_xla`,
the model's XLA path):
q [B,S,H,C] (absorbed nope part R + rope part, C = R + d_r = 576 for GLM-5), kv [B,T,C] latent cache,
indices [B,S,k] int32 (-1 = ignore) -> out [B,S,H,R] (dtype of q), lse [B,S,H] f32 (-inf for a query with no
valid index). Every head of a query attends over the same k gathered rows; values are the first R columns.

Gather. The k rows of each query are copied from HBM into VMEM by k single-row DMAs whose addresses come from the
query block's indices, held in SMEM. Rows go into a two-slot buffer: while query t is computed from one slot, the
DMAs of query t+1 fill the other (double buffering across the queries of a grid step). Each slot is split into
chunks of kc rows with one DMA semaphore per chunk, so the softmax of chunk c starts as soon as its rows landed.
-1 indices fetch row 0 and are masked. Mosaic cannot DMA a single row into a 16-bit VMEM array (two rows share a
sublane word), so the wrapper gathers from a float32 copy of the cache (B·T·C·4 bytes) and the kernel casts the
rows back to q's dtype for the MXU.

Forward. Per query: online softmax over the chunks in float32 (running max m, sum l, accumulator [H,R]);
lse = m + log l.

Backward (`jax.custom_vjp`). Per query the rows are gathered again, p = exp(s - lse) is rebuilt from the saved
lse, ds = p·(dp - delta + dlse) with delta = Σ do·out. dq = scale·ds @ rows goes straight to the output. The
row gradients scale·dsᵀ @ q (+ pᵀ @ do on the first R columns) are added into a float32 [T,C] accumulator that
lives in VMEM for the whole batch row: one read-modify-write per selected row, executed in program order by a
single TensorCore, so no two updates race (a query's k indices are distinct; -1 slots are skipped). The query
blocks of a batch row are split into P = 2 groups, each a "parallel" grid slice with its own accumulator and its
own HBM output slab [P,B,T,C]; the wrapper sums the P slabs. On a megacore chip (v4, v5p) the two TensorCores
take one group each; on single-core chips the groups run one after the other. The accumulator bounds T: T·C·4
bytes must fit VMEM next to the gather buffers (T ≤ ~16K at C = 576 within the 60 MiB we request); longer
contexts raise a clear error.

Block sizes (queries per grid step bq, gathered rows per chunk kc), chosen by `block_sizes`:

    | pass     | bq                      | kc                                              |
    |----------|-------------------------|-------------------------------------------------|
    | forward  | min(16, S rounded to 8) | k split into ceil(k/512) equal chunks, each     |
    | backward | min(8,  S rounded to 8) | rounded up to 128 (to 8 when k < 128)           |

bq is further capped by the caller's block_q. GLM-5 (k = 2048, S = T = 8192, bf16): kc = 512, 4 chunks; Mosaic
reports 15.2 MiB of VMEM used forward (mostly the 2·2048·576·4-byte gather buffer), 36.3 MiB backward (+ the
8192·576·4-byte accumulator) (bench/pallas_aot.py, docs/benchmarks.md).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.common import interpret_params, lane_padded, pad_axis, round_up, vmem_limit

f32 = jnp.float32
SPLITS = 2  # independent dkv accumulators (= TensorCores per megacore chip)
MAX_ACC_BYTES = 40 * 2 ** 20  # VMEM for the backward's [T, C] float32 accumulator


def block_sizes(S: int, K: int, block_q: int, backward: bool, block_k: int | None = None) -> tuple[int, int, int]:
    """-> (bq, kc, padded k) from the table in the module docstring; block_k (a multiple of 8) overrides kc."""
    bq = min(8 if backward else 16, round_up(S, 8), round_up(max(block_q, 1), 8))
    if block_k is not None:
        if block_k < 8 or block_k % 8:
            raise ValueError(f"sparse_mla: block_k={block_k} must be a positive multiple of 8")
        return bq, block_k, round_up(K, block_k)
    chunks = -(-K // 512)
    kc = round_up(-(-K // chunks), 128 if K >= 128 else 8)
    return bq, kc, kc * chunks


def sparse_mla(q, kv, indices, *, scale: float, kv_lora_rank: int, block_q: int = 256,
               interpret: bool | str | None = None, block_k: int | None = None):
    """Pallas sparse MLA attention; the signature of `sparse_mla_reference`, plus interpret (None = auto, see
    `common.interpret_params`) and block_k (rows per gathered chunk, default from the table). Differentiable in q
    and kv, through out and lse."""
    B, S, H, C = q.shape
    if kv.ndim != 3 or kv.shape[0] != B or kv.shape[2] != C:
        raise ValueError(f"sparse_mla: kv {kv.shape} must be [B={B}, T, C={C}] to match q {q.shape}")
    if indices.shape[:2] != (B, S) or indices.ndim != 3 or indices.dtype != jnp.int32:
        raise ValueError(f"sparse_mla: indices {indices.shape} {indices.dtype} must be int32 [B={B}, S={S}, k]")
    if not 0 < kv_lora_rank <= C:
        raise ValueError(f"sparse_mla: kv_lora_rank={kv_lora_rank} must be in (0, {C}]")
    if kv.shape[1] * round_up(C, 128) * 4 > MAX_ACC_BYTES:
        raise ValueError(f"sparse_mla: T={kv.shape[1]} too long for the VMEM dkv accumulator "
                         f"(T*{round_up(C, 128)}*4 bytes must be <= {MAX_ACC_BYTES})")
    blocks = (int(block_q), None if block_k is None else int(block_k))
    return _sparse_mla(q, kv, indices, float(scale), int(kv_lora_rank), blocks, interpret)


def sparse_mla_reference(q, kv, indices, *, scale: float, kv_lora_rank: int, block_q: int = 256):
    """The XLA reference: every query at once, its k rows gathered ([B,S,k,C]), a masked softmax (block_q is
    unused). Differentiable by JAX."""
    rows = jax.vmap(lambda cache, ids: cache[ids])(kv, jnp.maximum(indices, 0))  # [B,S,k,C]
    s = jnp.einsum("bshc,bskc->bshk", q, rows, preferred_element_type=f32) * scale
    s = jnp.where((indices >= 0)[:, :, None, :], s, -jnp.inf)
    m = jnp.max(s, axis=-1)
    m = jnp.where(jnp.isfinite(m), m, 0.0)  # [B,S,H]; 0 for a query with no valid index
    p = jnp.exp(s - m[..., None])
    l = jnp.sum(p, axis=-1)
    l_safe = jnp.where(l > 0, l, 1.0)
    out = jnp.einsum("bshk,bskr->bshr", p.astype(q.dtype), rows[..., :kv_lora_rank], preferred_element_type=f32)
    out = out / l_safe[..., None]
    lse = jnp.where(l > 0, m + jnp.log(l_safe), -jnp.inf)
    return out.astype(q.dtype), lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def _sparse_mla(q, kv, indices, scale, R, blocks, interpret):
    return _forward(q, kv, indices, scale, R, blocks, interpret)


def _sparse_mla_fwd(q, kv, indices, scale, R, blocks, interpret):
    out, lse = _forward(q, kv, indices, scale, R, blocks, interpret)
    return (out, lse), (q, kv, indices, out, lse)


def _sparse_mla_bwd(scale, R, blocks, interpret, res, cts):
    q, kv, indices, out, lse = res
    dout, dlse = cts
    dterm = jnp.sum(dout.astype(f32) * out.astype(f32), axis=-1) - dlse  # delta - dlse, [B,S,H]
    dq, dkv = _backward(q, kv, indices, dout, lse, dterm, scale, R, blocks, interpret)
    return dq, dkv, None


_sparse_mla.defvjp(_sparse_mla_fwd, _sparse_mla_bwd)


# ------------------------------------------------------------------------------------------------ the gather


def _gather(idx_smem, kv_hbm, rows, sems, b, kc: int, nc: int, unroll: int):
    """(start(t, slot), wait(slot, c)): DMA the k rows of query t into rows[slot]; wait for chunk c of a slot."""

    def start(t, slot):
        for c in range(nc):
            def one(j, carry, c=c):
                r = jnp.maximum(idx_smem[0, t, c * kc + j], 0)
                pltpu.make_async_copy(kv_hbm.at[b, pl.ds(r, 1)], rows.at[slot, pl.ds(c * kc + j, 1)],
                                      sems.at[slot, c]).start()
                return carry
            jax.lax.fori_loop(0, kc, one, 0, unroll=min(unroll, kc))

    def wait(slot, c):
        def one(j, carry):  # each wait consumes one row's bytes from the chunk's semaphore
            pltpu.make_async_copy(kv_hbm.at[b, pl.ds(0, 1)], rows.at[slot, pl.ds(c * kc + j, 1)],
                                  sems.at[slot, c]).wait()
            return carry
        jax.lax.fori_loop(0, kc, one, 0, unroll=min(unroll, kc))

    return start, wait


def _mm(a, b, dims):
    """MXU matmul with float32 accumulation; float32 operands at full precision (not one bf16 pass)."""
    precision = jax.lax.Precision.HIGHEST if a.dtype == f32 else None
    return jax.lax.dot_general(a, b, (dims, ((), ())), precision=precision, preferred_element_type=f32)


def _dot_nt(a, b):  # a [M,C] . b [N,C] -> [M,N]
    return _mm(a, b, ((1,), (1,)))


def _dot_tn(a, b):  # a [K,M] . b [K,N] -> [M,N]
    return _mm(a, b, ((0,), (0,)))


def _dot(a, b):  # a [M,K] . b [K,N] -> [M,N]
    return _mm(a, b, ((1,), (0,)))


def _transpose_vec(x):
    """[H,1] <-> [1,H] through an identity mask and a reduction: per-head softmax statistics are columns (one
    per sublane) while lse / delta are stored as lane rows, so no [B,S,H,1] array (128x lane padding) is needed."""
    n = max(x.shape)
    eye = jax.lax.broadcasted_iota(jnp.int32, (n, n), 0) == jax.lax.broadcasted_iota(jnp.int32, (n, n), 1)
    return jnp.sum(jnp.where(eye, x, 0.0), axis=0 if x.shape[1] == 1 else 1, keepdims=True)


# ------------------------------------------------------------------------------------------------ forward


def _fwd_kernel(idx_smem, idx_ref, q_ref, kv_hbm, o_ref, lse_ref, rows, sems, *, scale, R, kc, nc, unroll):
    b = pl.program_id(0)
    bq, H = q_ref.shape[1], q_ref.shape[2]
    dt = q_ref.dtype
    start, wait = _gather(idx_smem, kv_hbm, rows, sems, b, kc, nc, unroll)

    def query(t, carry):
        slot = t % 2

        @pl.when(t + 1 < bq)
        def _():
            start(t + 1, 1 - slot)

        q_t = q_ref[0, t]  # [H, C]
        m = jnp.full((H, 1), -jnp.inf, f32)
        l = jnp.zeros((H, 1), f32)
        acc = jnp.zeros((H, R), f32)
        for c in range(nc):
            wait(slot, c)
            blk = rows[slot, c * kc:(c + 1) * kc, :].astype(dt)  # [kc, C]
            valid = idx_ref[0, pl.ds(t, 1), c * kc:(c + 1) * kc] >= 0  # [1, kc]
            s = jnp.where(valid, _dot_nt(q_t, blk) * scale, -jnp.inf)  # [H, kc]
            m_new = jnp.maximum(m, jnp.max(s, axis=1, keepdims=True))
            m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
            alpha = jnp.exp(m - m_safe)
            p = jnp.exp(s - m_safe)
            l = alpha * l + jnp.sum(p, axis=1, keepdims=True)
            acc = alpha * acc + _dot(p.astype(dt), blk[:, :R])
            m = m_new
        ok = l > 0
        o_ref[0, t] = (acc / jnp.where(ok, l, 1.0)).astype(o_ref.dtype)
        lse_ref[0, pl.ds(t, 1), :] = _transpose_vec(jnp.where(ok, m + jnp.log(jnp.where(ok, l, 1.0)), -jnp.inf))
        return carry

    start(0, 0)
    jax.lax.fori_loop(0, bq, query, 0)


def _forward(q, kv, indices, scale, R, blocks, interpret):
    B, S, H, C = q.shape
    K = indices.shape[2]
    bq, kc, Kp = block_sizes(S, K, blocks[0], backward=False, block_k=blocks[1])
    mode = interpret_params(interpret)
    nc, Sp = Kp // kc, round_up(S, bq)
    idx = pad_axis(pad_axis(indices, 2, Kp, -1), 1, Sp, -1)
    qp = pad_axis(q, 1, Sp)
    kv32 = kv.astype(f32)
    isz = q.dtype.itemsize
    need = (2 * lane_padded(Kp, C, 4)  # gather slots
            + 2 * (bq * (lane_padded(H, C, isz) + lane_padded(H, R, isz)) + lane_padded(bq, H, 4)
                   + lane_padded(bq, Kp, 4))  # double-buffered blocks
            + 6 * lane_padded(H, kc, 4) + 2 * lane_padded(H, R, 4))  # temporaries
    flops = 2 * B * Sp * H * Kp * (C + R)
    nbytes = qp.size * isz + B * Sp * Kp * (C * 4 + 8) + B * Sp * H * (R * isz + 4)
    row_spec = lambda *shape: pl.BlockSpec((1, bq) + shape, lambda b, i: (b, i) + (0,) * len(shape))
    out, lse = pl.pallas_call(
        functools.partial(_fwd_kernel, scale=scale, R=R, kc=kc, nc=nc, unroll=1 if mode else 8),
        grid=(B, Sp // bq),
        in_specs=[pl.BlockSpec((1, bq, Kp), lambda b, i: (b, i, 0), memory_space=pltpu.SMEM),
                  row_spec(Kp), row_spec(H, C), pl.BlockSpec(memory_space=pl.ANY)],
        out_specs=[row_spec(H, R), row_spec(H)],
        out_shape=[jax.ShapeDtypeStruct((B, Sp, H, R), q.dtype), jax.ShapeDtypeStruct((B, Sp, H), f32)],
        scratch_shapes=[pltpu.VMEM((2, Kp, C), f32), pltpu.SemaphoreType.DMA((2, nc))],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel"),
                                             vmem_limit_bytes=vmem_limit(need)),
        cost_estimate=pl.CostEstimate(flops=flops, transcendentals=B * Sp * H * Kp, bytes_accessed=nbytes),
        interpret=mode,
        name="sparse_mla_fwd",
    )(idx, idx, qp, kv32)
    return out[:, :S], lse[:, :S]


# ------------------------------------------------------------------------------------------------ backward


def _bwd_kernel(idx_smem, idx_ref, q_ref, do_ref, lse_ref, dt_ref, kv_hbm, dq_ref, dkv_hbm, rows, sems, acc, drows,
                out_sem, *, scale, R, kc, nc, unroll):
    split, b, i, last = pl.program_id(0), pl.program_id(1), pl.program_id(2), pl.num_programs(2) - 1
    bq, H, C = q_ref.shape[1], q_ref.shape[2], q_ref.shape[3]
    dt = q_ref.dtype
    start, wait = _gather(idx_smem, kv_hbm, rows, sems, b, kc, nc, unroll)

    @pl.when(i == 0)
    def _():
        acc[...] = jnp.zeros_like(acc)

    def scatter(t, c):  # acc[idx[t, j]] += drows[j] for the chunk's valid slots, one row at a time
        def one(j, carry):
            r = idx_smem[0, t, c * kc + j]

            @pl.when(r >= 0)
            def _():
                acc[pl.ds(r, 1), :] += drows[pl.ds(j, 1), :]
            return carry
        jax.lax.fori_loop(0, kc, one, 0, unroll=min(unroll, kc))

    def query(t, carry):
        slot = t % 2

        @pl.when(t + 1 < bq)
        def _():
            start(t + 1, 1 - slot)

        q_t, do_t = q_ref[0, t], do_ref[0, t]  # [H, C], [H, R]
        lse_t = _transpose_vec(lse_ref[0, pl.ds(t, 1), :])  # [H, 1]
        dterm_t = _transpose_vec(dt_ref[0, pl.ds(t, 1), :])
        dq = jnp.zeros((H, C), f32)
        for c in range(nc):
            wait(slot, c)
            blk = rows[slot, c * kc:(c + 1) * kc, :].astype(dt)
            valid = idx_ref[0, pl.ds(t, 1), c * kc:(c + 1) * kc] >= 0
            p = jnp.where(valid, jnp.exp(_dot_nt(q_t, blk) * scale - lse_t), 0.0)  # [H, kc]
            ds = p * (_dot_nt(do_t, blk[:, :R]) - dterm_t)
            dq = dq + _dot(ds.astype(dt), blk)
            drows[...] = _dot_tn(ds.astype(dt), q_t) * scale  # [kc, C]
            drows[:, :R] += _dot_tn(p.astype(dt), do_t)
            scatter(t, c)
        dq_ref[0, t] = (dq * scale).astype(dq_ref.dtype)
        return carry

    start(0, 0)
    jax.lax.fori_loop(0, bq, query, 0)

    @pl.when(i == last)
    def _():
        copy = pltpu.make_async_copy(acc, dkv_hbm.at[split, b], out_sem.at[0])
        copy.start()
        copy.wait()


def _backward(q, kv, indices, dout, lse, dterm, scale, R, blocks, interpret):
    B, S, H, C = q.shape
    T, K = kv.shape[1], indices.shape[2]
    bq, kc, Kp = block_sizes(S, K, blocks[0], backward=True, block_k=blocks[1])
    mode = interpret_params(interpret)
    nc = Kp // kc
    P = min(SPLITS, -(-S // bq))
    Sp, Tp = round_up(S, bq * P), round_up(T, 8)
    nq = Sp // (bq * P)  # query blocks per split
    idx = pad_axis(pad_axis(indices, 2, Kp, -1), 1, Sp, -1)
    qp, dop = pad_axis(q, 1, Sp), pad_axis(dout.astype(q.dtype), 1, Sp)
    lsep = pad_axis(lse, 1, Sp, -jnp.inf)
    dtp = pad_axis(dterm, 1, Sp)
    kv32 = kv.astype(f32)
    isz = q.dtype.itemsize
    need = (2 * lane_padded(Kp, C, 4) + lane_padded(Tp, C, 4) + lane_padded(kc, C, 4)  # gather, dkv, row grads
            + 2 * (bq * (2 * lane_padded(H, C, isz) + lane_padded(H, R, isz)) + 2 * lane_padded(bq, H, 4)
                   + lane_padded(bq, Kp, 4))  # double-buffered blocks
            + 6 * lane_padded(H, kc, 4) + 2 * lane_padded(H, C, 4))  # temporaries
    flops = 2 * B * Sp * H * Kp * (3 * C + 2 * R)
    nbytes = 2 * qp.size * isz + dop.size * isz + B * Sp * Kp * (C * 4 + 8) + P * B * Tp * C * 4
    spec = lambda *shape: pl.BlockSpec((1, bq) + shape, lambda p, b, i: (b, p * nq + i) + (0,) * len(shape))
    dq, dkv = pl.pallas_call(
        functools.partial(_bwd_kernel, scale=scale, R=R, kc=kc, nc=nc, unroll=1 if mode else 8),
        grid=(P, B, nq),
        in_specs=[pl.BlockSpec((1, bq, Kp), lambda p, b, i: (b, p * nq + i, 0), memory_space=pltpu.SMEM),
                  spec(Kp), spec(H, C), spec(H, R), spec(H), spec(H), pl.BlockSpec(memory_space=pl.ANY)],
        out_specs=[spec(H, C), pl.BlockSpec(memory_space=pl.ANY)],
        out_shape=[jax.ShapeDtypeStruct((B, Sp, H, C), q.dtype), jax.ShapeDtypeStruct((P, B, Tp, C), f32)],
        scratch_shapes=[pltpu.VMEM((2, Kp, C), f32), pltpu.SemaphoreType.DMA((2, nc)), pltpu.VMEM((Tp, C), f32),
                        pltpu.VMEM((kc, C), f32), pltpu.SemaphoreType.DMA((1,))],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary"),
                                             vmem_limit_bytes=vmem_limit(need)),
        cost_estimate=pl.CostEstimate(flops=flops, transcendentals=B * Sp * H * Kp, bytes_accessed=nbytes),
        interpret=mode,
        name="sparse_mla_bwd",
    )(idx, idx, qp, dop, lsep, dtp, kv32)
    return dq[:, :S], jnp.sum(dkv, axis=0)[:, :T].astype(kv.dtype)
