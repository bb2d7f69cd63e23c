"""Sparse MLA attention in MQA form (docs/model.md B.7, D.2) as Pallas TPU kernels, forward and backward.

Same contract as the XLA reference `sparse_mla_reference` below (and `glmjax.model.sparse_attention.sparse_mla_xla`,
the model's XLA path):
q [B,S,H,C] (absorbed nope part R + rope part, C = R + d_r = 576 for GLM-5), kv [B,T,C] latent cache,
indices [B,S,k] int32 (-1 = ignore) -> out [B,S,H,R] (dtype of q), lse [B,S,H] f32 (-inf for a query with no
valid index). Every head of a query attends over the same k gathered rows; values are the first R columns. No
buffer depends on T except the cache (its packed copy for "packed") and, backward, dkv: any T < 2^31.

Gather. The k rows of each query are copied from HBM into VMEM by k row DMAs whose addresses come from the query
block's indices, held in SMEM. Rows go into a two-slot buffer: while query t is computed from one slot, the DMAs of
query t+1 fill the other (double buffering across the queries of a grid step). Each slot is split into chunks of
kc rows with one DMA semaphore per chunk, so the softmax of chunk c starts as soon as its rows landed. -1 indices
fetch row 0 and are masked. Mosaic cannot DMA one row of a 16-bit array (two rows share each 32-bit sublane word
of its (16,128) tiles), so the cache is read in one of three layouts (`cache_layout`), chosen by bytes moved:

    | layout   | cache                       | HBM array the DMAs read           | bytes per row | extra pass  |
    |----------|-----------------------------|-----------------------------------|---------------|-------------|
    | "f32"    | float32 (others: f32 copy)  | kv itself                         | 4·C           | none        |
    | "packed" | bf16, S·k > 2·T             | [B,T,ceil(C/2)] uint32 words      | 2·C           | 4·T·C bytes |
    | "pairs"  | bf16, S·k <= 2·T, T even    | kv itself, the row's aligned pair | 4·C           | none        |

"packed" (training, prefill): word w of a row holds column w in its low 16 bits and column W + w in its high 16
bits (W = ceil(C/2)), built by one elementwise XLA pass (a copy of the bf16 cache's size: 1.2x in HBM at C = 576,
where 288 words pad to 384 lanes against 576 columns to 640; no float32 copy); the kernel splits a [kc, W] block of
words into two float32 halves by a shift and a mask (a bf16 is the high half of its float32) and joins them into
[kc, C]. "pairs" (decode: few queries against a long cache): no copy at all; the DMA reads rows 2⌊r/2⌋ and 2⌊r/2⌋+1
(whole 32-bit words), the block is viewed as uint32 words (`pltpu.bitcast`: row 2i in the low, row 2i+1 in the
high halves) and each gathered row keeps the half its index's parity names.
Packing costs 4·T·C bytes once per call and saves 2·C bytes per gathered row, so it pays when S·k > 2·T.

Forward. Per query: online softmax over the chunks in float32 (running max m, sum l, accumulator [H,R]);
lse = m + log l.

Backward (`jax.custom_vjp`). Per query the rows are gathered again, p = exp(s - lse) is rebuilt from the saved
lse, ds = p·(dp - delta + dlse) with delta = Σ do·out. dq = scale·ds @ rows goes straight to the output. The
row gradients drows = scale·dsᵀ @ q (+ pᵀ @ do on the first R columns) [kc, C] f32 are added into dkv rows:

  * VMEM accumulator (T·C'·4 <= 40 MiB with C' = C padded to 128 lanes, i.e. T <= 16,384 at C = 576): a float32 [T,C] accumulator lives in VMEM
    for the whole batch row, one read-modify-write per selected row, in program order, copied out at the end.
  * HBM accumulator (longer caches): dkv rows are read-modify-written in HBM. Per query, the k reads of its rows
    (one DMA each, into a [k, C] f32 VMEM buffer) start when the query starts, overlapping its matmuls; chunk c
    waits for its reads, adds drows, and starts the writes back. A query's k rows are distinct, so its own reads
    and writes never touch a row twice; consecutive queries do select the same rows (causal attention makes
    recent keys popular), so before query t+1 starts its reads the kernel waits for every write of query t
    (otherwise t+1 could read a row before t's update landed and one update would be lost). The same wait frees
    the VMEM buffer, and the grid step drains its last query's writes before it ends.
  Alternatives, by cost at GLM-5 (k = 2048, C = 576): this moves 2·k·C·4 = 9.4 MB more per query than the VMEM
  accumulator (3 row DMAs per selected row instead of 1) and recomputes nothing. Splitting T into VMEM-sized key
  ranges (16K rows) would repeat the gather and the backward matmuls once per range (13x at 202,752, 64x at 1M)
  unless the (query, row) pairs were sorted by row, and a sorted segment reduction then needs each pair's q and do
  (H·(C+R)·2 = 140 KB per pair against 2.3 KB per row) or the [S,k,C] row gradients in HBM (38 GB at S = 8192).
The query blocks of a batch row are split into P = 2 groups, each a "parallel" grid slice with its own
accumulator and its own f32 HBM output slab [P,B,T,C] (zero-initialised for the HBM accumulator); the wrapper sums
the P slabs. On a megacore chip (v4, v5p) the two TensorCores take one group each, so their updates never meet;
on single-core chips the groups run one after the other.

Block sizes (queries per grid step bq, gathered rows per chunk kc), chosen by `block_sizes`:

    | pass     | bq                      | kc                                              |
    |----------|-------------------------|-------------------------------------------------|
    | forward  | min(16, S rounded to 8) | k split into ceil(k/512) equal chunks, each     |
    | backward | min(8,  S rounded to 8) | rounded up to 128 (to 8 when k < 128)           |

bq is further capped by the caller's block_q. GLM-5 (H = 64, C = 576, k = 2048, bf16): kc = 512, 4 chunks. VMEM
Mosaic reports on v5p (bench/pallas_aot.py, docs/benchmarks.md), whatever T: forward 11.6 MiB ("packed", mostly
the 2·2048·288·4-byte gather slots), 12.3 / 13.5 MiB at S = 1 / 16 ("pairs"); backward 32.4 MiB with the VMEM
accumulator at T = 8192 (+ its 8192·640·4 bytes), 17.4 MiB with the HBM accumulator (+ the 2048·640·4-byte
read-modify-write buffer) at T = 202,752 or any other length.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.common import (call, interpret_params, lane_padded, pad_axis, round_up, sparse_mla_vjp,
                                   vmem_limit)

f32, u32 = jnp.float32, jnp.uint32
SPLITS = 2  # independent dkv accumulators (= TensorCores per megacore chip)
MAX_ACC_BYTES = 40 * 2 ** 20  # VMEM for the backward's [T, C] float32 accumulator; longer caches accumulate in HBM
HIGH = np.uint32(0xFFFF0000)  # the high 16 bits of a uint32 word


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


def cache_layout(dtype, S: int, T: int, K: int) -> str:
    """The layout the kernels gather the cache in (the table in the module docstring)."""
    if jnp.dtype(dtype) != jnp.bfloat16:
        return "f32"
    return "packed" if S * K > 2 * T or T % 2 else "pairs"


def sparse_mla(q, kv, indices, *, scale: float, kv_lora_rank: int, block_q: int = 256,
               interpret: bool | str | None = None, block_k: int | None = None, layout: str | None = None,
               dkv_in_vmem: bool | None = None):
    """Pallas sparse MLA attention; the signature of `sparse_mla_reference`, plus interpret (None = auto, see
    `common.interpret_params`), block_k (rows per gathered chunk, default from the table), layout (how a bf16
    cache is gathered, "packed" or "pairs"; default `cache_layout`) and dkv_in_vmem (the backward's accumulator;
    default: VMEM when T·C·4 <= MAX_ACC_BYTES). Differentiable in q and kv, through out and lse."""
    B, S, H, C = q.shape
    if kv.ndim != 3 or kv.shape[0] != B or kv.shape[2] != C:
        raise ValueError(f"sparse_mla: kv {kv.shape} must be [B={B}, T, C={C}] to match q {q.shape}")
    if indices.shape[:2] != (B, S) or indices.ndim != 3 or indices.dtype != jnp.int32:
        raise ValueError(f"sparse_mla: indices {indices.shape} {indices.dtype} must be int32 [B={B}, S={S}, k]")
    if not 0 < kv_lora_rank <= C:
        raise ValueError(f"sparse_mla: kv_lora_rank={kv_lora_rank} must be in (0, {C}]")
    T = kv.shape[1]
    if layout is None:
        layout = cache_layout(kv.dtype, S, T, indices.shape[2])
    allowed = ("packed", "pairs") if kv.dtype == jnp.bfloat16 else ("f32",)
    if layout not in allowed:
        raise ValueError(f"sparse_mla: layout={layout!r} for a {kv.dtype} cache: must be one of {allowed}")
    if layout == "pairs" and T % 2:
        raise ValueError(f"sparse_mla: layout='pairs' reads aligned row pairs: T={T} must be even")
    if dkv_in_vmem is None:
        dkv_in_vmem = T * round_up(C, 128) * 4 <= MAX_ACC_BYTES
    blocks = (int(block_q), None if block_k is None else int(block_k), layout, bool(dkv_in_vmem))
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


# ------------------------------------------------------------------------------------------------ the gather


def pack_bf16(kv):
    """[B,T,C] bf16 -> [B,T,W] uint32, W = ceil(C/2): word w holds column w in its low 16 bits and column W + w
    (0 past C) in its high 16 bits. The "packed" layout's HBM array, the byte size of the bf16 cache."""
    W = -(-kv.shape[2] // 2)
    bits = lambda half: jax.lax.bitcast_convert_type(half, jnp.uint16).astype(u32)  # (slices first: one fusion)
    return bits(kv[..., :W]) | (bits(pad_axis(kv[..., W:], 2, W)) << 16)


def _cache_operand(kv, layout: str):
    """-> (the HBM array the kernels gather from, its VMEM row buffer shape per slot [rows, words], its dtype)."""
    T, C = kv.shape[1:]
    if layout == "packed":
        return pack_bf16(kv), (-(-C // 2)), u32
    if layout == "pairs":
        return kv, C, kv.dtype
    return kv.astype(f32), C, f32


def _gather(idx_smem, idx_ref, kv_hbm, rows, sems, b, kc: int, nc: int, unroll: int, layout: str, C: int):
    """(start(t, slot), wait(slot, c), load(t, slot, c)): DMA the k rows of query t into rows[slot]; wait for chunk c
    of a slot; read chunk c of a slot as float32 [kc, C] (query t's indices give the "pairs" halves)."""
    n = 2 if layout == "pairs" else 1  # cache rows per DMA

    def src(r):
        if n == 1:
            return kv_hbm.at[b, pl.ds(r, 1)]
        return kv_hbm.at[b, pl.ds(pl.multiple_of(r - r % 2, 2), 2)]

    def start(t, slot):
        for c in range(nc):
            def one(j, carry, c=c):
                r = jnp.maximum(idx_smem[0, t, c * kc + j], 0)
                pltpu.make_async_copy(src(r), rows.at[slot, pl.ds(n * (c * kc + j), n)], sems.at[slot, c]).start()
                return carry
            jax.lax.fori_loop(0, kc, one, 0, unroll=min(unroll, kc))

    def wait(slot, c):
        def one(j, carry):  # each wait consumes one DMA's bytes from the chunk's semaphore
            pltpu.make_async_copy(src(0), rows.at[slot, pl.ds(n * (c * kc + j), n)], sems.at[slot, c]).wait()
            return carry
        jax.lax.fori_loop(0, kc, one, 0, unroll=min(unroll, kc))

    def load(t, slot, c):
        blk = rows[slot, n * c * kc:n * (c + 1) * kc, :]
        if layout == "f32":
            return blk
        if layout == "packed":  # [kc, W] words -> columns [0, W) from the low halves, [W, C) from the high halves
            lo = jax.lax.bitcast_convert_type(blk << 16, f32)
            hi = jax.lax.bitcast_convert_type(blk & HIGH, f32)
            return jnp.concatenate([lo, hi[:, :C - blk.shape[1]]], axis=1)
        words = pltpu.bitcast(blk, u32)  # [kc, C]: row 2i+1 of the pair in the high halves
        odd = _transpose_vec((idx_ref[0, pl.ds(t, 1), c * kc:(c + 1) * kc] & 1).astype(f32)) > 0  # [kc, 1]
        return jax.lax.bitcast_convert_type(jnp.where(odd, words & HIGH, words << 16), f32)

    return start, wait, load


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


def _row_bytes(layout: str, C: int) -> int:
    """HBM bytes one gathered row moves."""
    return {"f32": 4 * C, "packed": 4 * -(-C // 2), "pairs": 4 * C}[layout]


def _rows_buffer(layout: str, Kp: int, words: int, dtype):
    """The two-slot VMEM gather buffer and its estimated bytes."""
    n = 2 if layout == "pairs" else 1
    return pltpu.VMEM((2, n * Kp, words), dtype), 2 * lane_padded(n * Kp, words, jnp.dtype(dtype).itemsize)


# ------------------------------------------------------------------------------------------------ forward


def _fwd_kernel(idx_smem, idx_ref, q_ref, kv_hbm, o_ref, lse_ref, rows, sems, *, scale, R, kc, nc, unroll, layout):
    b = pl.program_id(0)
    bq, H, C = q_ref.shape[1], q_ref.shape[2], q_ref.shape[3]
    dt = q_ref.dtype
    start, wait, load = _gather(idx_smem, idx_ref, kv_hbm, rows, sems, b, kc, nc, unroll, layout, C)

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
            blk = load(t, slot, c).astype(dt)  # [kc, C]
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
    layout = blocks[2]
    bq, kc, Kp = block_sizes(S, K, blocks[0], backward=False, block_k=blocks[1])
    mode = interpret_params(interpret)
    nc, Sp = Kp // kc, round_up(S, bq)
    idx = pad_axis(pad_axis(indices, 2, Kp, -1), 1, Sp, -1)
    qp = pad_axis(q, 1, Sp)
    cache, words, wdtype = _cache_operand(kv, layout)
    rows, rows_bytes = _rows_buffer(layout, Kp, words, wdtype)
    isz = q.dtype.itemsize
    need = (rows_bytes + 2 * (bq * (lane_padded(H, C, isz) + lane_padded(H, R, isz)) + lane_padded(bq, H, 4)
                              + lane_padded(bq, Kp, 4))  # double-buffered blocks
            + 2 * lane_padded(kc, C, 4) + 6 * lane_padded(H, kc, 4) + 2 * lane_padded(H, R, 4))  # temporaries
    flops = 2 * B * Sp * H * Kp * (C + R)
    nbytes = qp.size * isz + B * Sp * Kp * (_row_bytes(layout, C) + 8) + B * Sp * H * (R * isz + 4)
    row_spec = lambda *shape: pl.BlockSpec((1, bq) + shape, lambda b, i: (b, i) + (0,) * len(shape))
    kernel = pl.pallas_call(
        functools.partial(_fwd_kernel, scale=scale, R=R, kc=kc, nc=nc, unroll=1 if mode else 8, layout=layout),
        grid=(B, Sp // bq),
        in_specs=[pl.BlockSpec((1, bq, Kp), lambda b, i: (b, i, 0), memory_space=pltpu.SMEM),
                  row_spec(Kp), row_spec(H, C), pl.BlockSpec(memory_space=pl.ANY)],
        out_specs=[row_spec(H, R), row_spec(H)],
        out_shape=[jax.ShapeDtypeStruct((B, Sp, H, R), q.dtype), jax.ShapeDtypeStruct((B, Sp, H), f32)],
        scratch_shapes=[rows, pltpu.SemaphoreType.DMA((2, nc))],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel"),
                                             vmem_limit_bytes=vmem_limit(need)),
        cost_estimate=pl.CostEstimate(flops=flops, transcendentals=B * Sp * H * Kp, bytes_accessed=nbytes),
        interpret=mode,
        name="sparse_mla_fwd",
    )
    out, lse = call(kernel, mode, idx, idx, qp, cache)
    return out[:, :S], lse[:, :S]


# ------------------------------------------------------------------------------------------------ backward


def _bwd_kernel(idx_smem, idx_ref, q_ref, do_ref, lse_ref, dt_ref, kv_hbm, *refs, scale, R, kc, nc, unroll,
                layout, in_vmem):
    if in_vmem:
        dq_ref, dkv_hbm, rows, sems, drows, acc, out_sem = refs
    else:  # refs[0]: the zero slabs the wrapper aliases to dkv_hbm
        dq_ref, dkv_hbm, rows, sems, drows, rmw, read_sems, write_sem = refs[1:]
    split, b, i, last = pl.program_id(0), pl.program_id(1), pl.program_id(2), pl.num_programs(2) - 1
    bq, H, C = q_ref.shape[1], q_ref.shape[2], q_ref.shape[3]
    Kp = nc * kc
    dt = q_ref.dtype
    start, wait, load = _gather(idx_smem, idx_ref, kv_hbm, rows, sems, b, kc, nc, unroll, layout, C)

    def each_row(t, lo, hi, fn):  # fn(j, r) for the slots j in [lo, hi) of query t that hold a row r >= 0
        def one(j, carry):
            r = idx_smem[0, t, j]

            @pl.when(r >= 0)
            def _():
                fn(j, r)
            return carry
        jax.lax.fori_loop(lo, hi, one, 0, unroll=min(unroll, hi - lo))

    if in_vmem:
        @pl.when(i == 0)
        def _():
            acc[...] = jnp.zeros_like(acc)

        def add_rows(t, c):  # acc[idx[t, j]] += drows[j] for the chunk's valid slots, one row at a time
            def one(j, r):
                acc[pl.ds(r, 1), :] += drows[pl.ds(j - c * kc, 1), :]
            each_row(t, c * kc, (c + 1) * kc, one)
    else:
        def dma(j, r, c=0, read=True):  # slot j of rmw <-> dkv row r
            row = dkv_hbm.at[split, b, pl.ds(r, 1)]
            if read:
                return pltpu.make_async_copy(row, rmw.at[pl.ds(j, 1)], read_sems.at[c])
            return pltpu.make_async_copy(rmw.at[pl.ds(j, 1)], row, write_sem.at[0])

        def wait_writes(t):
            each_row(t, 0, Kp, lambda j, r: dma(j, r, read=False).wait())

        def start_reads(t):
            for c in range(nc):
                each_row(t, c * kc, (c + 1) * kc, lambda j, r, c=c: dma(j, r, c).start())

        def add_rows(t, c):
            each_row(t, c * kc, (c + 1) * kc, lambda j, r: dma(j, r, c).wait())
            rmw[c * kc:(c + 1) * kc, :] += drows[...]
            each_row(t, c * kc, (c + 1) * kc, lambda j, r: dma(j, r, read=False).start())

    def query(t, carry):
        slot = t % 2

        @pl.when(t + 1 < bq)
        def _():
            start(t + 1, 1 - slot)

        if not in_vmem:
            @pl.when(t > 0)
            def _():
                wait_writes(t - 1)  # the hazard: query t reads rows that query t-1 may still be writing
            start_reads(t)

        q_t, do_t = q_ref[0, t], do_ref[0, t]  # [H, C], [H, R]
        lse_t = _transpose_vec(lse_ref[0, pl.ds(t, 1), :])  # [H, 1]
        dterm_t = _transpose_vec(dt_ref[0, pl.ds(t, 1), :])
        dq = jnp.zeros((H, C), f32)
        for c in range(nc):
            wait(slot, c)
            blk = load(t, slot, c).astype(dt)
            valid = idx_ref[0, pl.ds(t, 1), c * kc:(c + 1) * kc] >= 0
            p = jnp.where(valid, jnp.exp(_dot_nt(q_t, blk) * scale - lse_t), 0.0)  # [H, kc]
            ds = p * (_dot_nt(do_t, blk[:, :R]) - dterm_t)
            dq = dq + _dot(ds.astype(dt), blk)
            drows[...] = _dot_tn(ds.astype(dt), q_t) * scale  # [kc, C]
            drows[:, :R] += _dot_tn(p.astype(dt), do_t)
            add_rows(t, c)
        dq_ref[0, t] = (dq * scale).astype(dq_ref.dtype)
        return carry

    start(0, 0)
    jax.lax.fori_loop(0, bq, query, 0)

    if in_vmem:
        @pl.when(i == last)
        def _():
            copy = pltpu.make_async_copy(acc, dkv_hbm.at[split, b], out_sem.at[0])
            copy.start()
            copy.wait()
    else:
        wait_writes(bq - 1)


def _backward(q, kv, indices, dout, lse, dterm, scale, R, blocks, interpret):
    B, S, H, C = q.shape
    T, K = kv.shape[1], indices.shape[2]
    layout, in_vmem = blocks[2], blocks[3]
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
    cache, words, wdtype = _cache_operand(kv, layout)
    rows, rows_bytes = _rows_buffer(layout, Kp, words, wdtype)
    isz = q.dtype.itemsize
    acc_bytes = lane_padded(Tp, C, 4) if in_vmem else lane_padded(Kp, C, 4)  # dkv accumulator / RMW buffer
    need = (rows_bytes + acc_bytes + lane_padded(kc, C, 4)  # gather, dkv, row grads
            + 2 * (bq * (2 * lane_padded(H, C, isz) + lane_padded(H, R, isz)) + 2 * lane_padded(bq, H, 4)
                   + lane_padded(bq, Kp, 4))  # double-buffered blocks
            + 2 * lane_padded(kc, C, 4) + 6 * lane_padded(H, kc, 4) + 2 * lane_padded(H, C, 4))  # temporaries
    flops = 2 * B * Sp * H * Kp * (3 * C + 2 * R)
    rmw_bytes = 0 if in_vmem else B * Sp * Kp * C * 8 + P * B * Tp * C * 4  # row reads + writes, zeroing
    nbytes = (2 * qp.size * isz + dop.size * isz + B * Sp * Kp * (_row_bytes(layout, C) + 8) + P * B * Tp * C * 4
              + rmw_bytes)
    spec = lambda *shape: pl.BlockSpec((1, bq) + shape, lambda p, b, i: (b, p * nq + i) + (0,) * len(shape))
    hbm = pl.BlockSpec(memory_space=pl.ANY)
    in_specs = [pl.BlockSpec((1, bq, Kp), lambda p, b, i: (b, p * nq + i, 0), memory_space=pltpu.SMEM),
                spec(Kp), spec(H, C), spec(H, R), spec(H), spec(H), hbm]
    operands = [idx, idx, qp, dop, lsep, dtp, cache]
    if in_vmem:
        scratch = [pltpu.VMEM((Tp, C), f32), pltpu.SemaphoreType.DMA((1,))]
        aliases = {}
    else:
        scratch = [pltpu.VMEM((Kp, C), f32), pltpu.SemaphoreType.DMA((nc,)), pltpu.SemaphoreType.DMA((1,))]
        in_specs.append(hbm)
        operands.append(jnp.zeros((P, B, Tp, C), f32))
        aliases = {len(operands) - 1: 1}
    kernel = pl.pallas_call(
        functools.partial(_bwd_kernel, scale=scale, R=R, kc=kc, nc=nc, unroll=1 if mode else 8, layout=layout,
                          in_vmem=in_vmem),
        grid=(P, B, nq),
        in_specs=in_specs,
        out_specs=[spec(H, C), hbm],
        out_shape=[jax.ShapeDtypeStruct((B, Sp, H, C), q.dtype), jax.ShapeDtypeStruct((P, B, Tp, C), f32)],
        scratch_shapes=[rows, pltpu.SemaphoreType.DMA((2, nc)), pltpu.VMEM((kc, C), f32)] + scratch,
        input_output_aliases=aliases,
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary"),
                                             vmem_limit_bytes=vmem_limit(need)),
        cost_estimate=pl.CostEstimate(flops=flops, transcendentals=B * Sp * H * Kp, bytes_accessed=nbytes),
        interpret=mode,
        name="sparse_mla_bwd",
    )
    dq, dkv = call(kernel, mode, *operands)
    return dq[:, :S], jnp.sum(dkv, axis=0)[:, :T].astype(kv.dtype)


_sparse_mla = sparse_mla_vjp(_forward, _backward)  # what `sparse_mla` calls
