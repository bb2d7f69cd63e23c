"""The dense causal self-attention kernels behind `flash_attention.flash_attention`, and the choice of implementation.

    "splash": JAX's Pallas TPU splash attention (`jax.experimental.pallas.ops.tpu.splash_attention`): a causal mask
              with per-row segment ids, forward and backward kernels (separate dq and dkv kernels), blocks with no
              visible key skipped from the mask's block map. Different qk / v head dims are fine (GLM-5 256 / 256,
              DeepSeek 192 / 128). Its causal mask is static -- query s sees key slots t <= s -- so it serves
              self-attention over the sequence itself (`q_idx` None, S == T) with keys per head ([B,T,H,d]).
    "pallas_gpu": JAX's Pallas GPU (Triton) flash attention (`jax.experimental.pallas.ops.gpu.attention`): causal,
              per-row segment ids, forward and fused dq / dkv backward kernels, its log-sum-exp returned (base 2,
              converted here). It wants one head dim for q, k and v: the narrower are zero-padded (no change to the
              scores; the padded output columns are dropped). Same reach as splash: self-attention, keys per head.
    "xla":    the blocked online-softmax attention of flash_attention.py (any q_idx, MQA keys, any platform).

`choose` picks: "auto" -> splash on TPU, pallas_gpu on an NVIDIA GPU, where they apply, else XLA; "splash" /
"pallas_gpu" -> that kernel where it applies, on any platform (interpreted elsewhere: how the tests run them on CPU),
else XLA; "xla" -> XLA. Where the kernels do not apply -- queries at explicit key slots (context-parallel shards,
cached prefill / decode), keys shared by the heads (the absorbed MQA form, qk 576 / v 512 with q_idx) -- the XLA
flash is used. The platform is the one the code is traced for: the abstract mesh's devices (so an AOT compile for a
TPU topology from a CPU host picks the kernel), else the default backend.

GPU, not chosen: `jax.nn.dot_product_attention(implementation="cudnn")` takes a causal flag and per-row lengths but
no packed segment ids (its mask argument would be a [B,H,S,T] array), and training batches are packed.

The kernels return no row max: `flash_attention` computes it (the max_attn_logit metric of every dense training
step) in a forward-only blocked XLA pass of QK^T, an extra score computation per step on top of the kernel's. Splash
has no softmax scale (queries are scaled before the kernel). The kernels' backwards are called through their own
backward functions so the forward can return the log-sum-exp the streamed indexer losses need (the public kernels
with residuals are not differentiable). Splash's mask preprocessing runs on the host at trace time,
O((S / block)^2), cached per shape (its cost: docs/benchmarks.md, measurements behind the model code's choices).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.gpu import attention as gpu_flash
from jax.experimental.pallas.ops.tpu import splash_attention as splash
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash_kernel

from glmjax import hardware
from glmjax.model import context

DENSE_IMPLS = ("auto", "xla", "splash", "pallas_gpu")
KERNELS = {"tpu": "splash", **dict.fromkeys(hardware.GPU_PLATFORMS, "pallas_gpu")}  # "auto"'s kernel per platform
LANES = 128  # splash blocks are multiples of this


def kernel_misfit(q, k, q_idx) -> str | None:
    """Why the kernels (causal self-attention, keys per head) cannot compute this attention (None: they can)."""
    if q_idx is not None:
        return "queries at explicit key slots (q_idx)"
    if k.ndim != 4:
        return "keys shared by the heads (MQA form)"
    if q.shape[1] != k.shape[1]:
        return f"S {q.shape[1]} != T {k.shape[1]}"
    return None


def choose(impl: str, q, k, q_idx) -> str:
    """-> "splash" | "pallas_gpu" | "xla" for `impl` (one of DENSE_IMPLS) on the traced-for platform."""
    if impl not in DENSE_IMPLS:
        raise ValueError(f"dense attention impl {impl!r}: must be one of {DENSE_IMPLS}")
    if impl == "auto":
        impl = KERNELS.get(hardware.platform(), "xla")
    return impl if impl != "xla" and kernel_misfit(q, k, q_idx) is None else "xla"


def kernel_attention(kind: str, q, k, v, q_seg, k_seg, scale: float, block: int):
    """Causal self-attention by the kernel `kind` ("splash" | "pallas_gpu"): q [B,S,H,d], k [B,S,H,d], v [B,S,H,e],
    q_seg / k_seg [B,S] (visible: t <= s and equal segment ids) -> (out [B,S,H,e] in v's dtype, lse [B,S,H] f32).
    Differentiable in q, k, v; interpreted off its platform. On a mesh of several devices the kernel runs inside
    `jax.shard_map` (Pallas kernels cannot be partitioned by XLA)."""
    local = {"splash": _splash_local, "pallas_gpu": _gpu_local}[kind]
    interpret = KERNELS.get(hardware.platform()) != kind
    if not context.needs_shard_map(jax.sharding.get_abstract_mesh()):
        return local(q, k, v, q_seg, k_seg, scale, block, interpret)
    one = context.Layout("contiguous", 1)  # nothing gathered: each shard holds whole sequences
    return context.local_queries(one, local, *_KERNEL_AXES)(q, k, v, q_seg, k_seg, scale, block, interpret)


def splash_block(block: int, S: int) -> int:
    """The splash block for `block` (model.block_q): a multiple of 128, no larger than S rounded up to 128."""
    up = lambda n: -(-n // LANES) * LANES  # noqa: E731
    return min(up(block), up(S))


# rows over the batch axes, heads over tensor, each shard's sequences whole (the causal mask is over the positions
# the kernel sees; a sequence split over context is gathered -- the model itself never sends one here: its context
# shards pass explicit key slots, which run the XLA flash)
_BSH, _BS = ("batch", None, "heads"), ("batch", None)
_KERNEL_AXES = ((_BSH, _BSH, _BSH, _BS, _BS, None, None, None), (_BSH, _BSH))


def _splash_local(q, k, v, q_seg, k_seg, scale: float, block: int, interpret: bool):
    """`kernel_attention` by splash on this device's rows: S padded to a multiple of the block (padded keys are
    causally after every real query)."""
    B, S, H = q.shape[:3]
    b = splash_block(block, S)
    pad = -S % b
    fn = _splash_fn(H, S + pad, b, interpret)

    def heads_first(a, fill=0):  # [B,S,H,.] -> [B,H,S+pad,.] (or [B,S] -> [B,S+pad])
        a = jnp.pad(a, [(0, 0), (0, pad)] + [(0, 0)] * (a.ndim - 2), constant_values=fill)
        return jnp.swapaxes(a, 1, 2) if a.ndim == 4 else a

    q = (q.astype(jnp.float32) * scale).astype(q.dtype)  # the exact scale, one rounding (the XLA flash's scores)
    out, lse = jax.vmap(fn)(heads_first(q), heads_first(k), heads_first(v),
                            heads_first(q_seg.astype(jnp.int32)), heads_first(k_seg.astype(jnp.int32)))
    return jnp.swapaxes(out, 1, 2)[:, :S].astype(v.dtype), jnp.swapaxes(lse, 1, 2)[:, :S].astype(jnp.float32)


@functools.lru_cache(maxsize=16)
def _splash_fn(H: int, S: int, b: int, interpret: bool):
    """(q [H,S,d], k [H,S,d], v [H,S,e], q_seg [S], k_seg [S]) -> (out [H,S,e], lse [H,S]); custom VJP = splash's."""
    sizes = splash.BlockSizes(block_q=b, block_kv=b, block_kv_compute=b, block_q_dkv=b, block_kv_dkv=b,
                              block_kv_dkv_compute=b, block_q_dq=b, block_kv_dq=b)
    mask = splash.MultiHeadMask([splash.CausalMask((S, S))] * H)
    with jax.ensure_compile_time_eval():  # its mask tables are constants, not values of the trace that builds it
        kernel = splash.make_splash_mha(mask, block_sizes=sizes, head_shards=1, q_seq_shards=1, save_residuals=True,
                                        interpret=interpret)
    kw = kernel.kwargs

    def fwd(q, k, v, q_seg, k_seg):
        seg = splash.SegmentIds(q_seg, k_seg)
        out, (lse,) = kernel(q, k, v, segment_ids=seg)
        return (out, lse), (q, k, v, seg, out, lse)

    def bwd(res, cts):
        q, k, v, seg, out, lse = res
        grads = splash_kernel._splash_attention_bwd(
            False, kw["mask_value"], kw["is_mqa"], kw["block_sizes"], None, kw["mask_function"],
            kw["attn_logits_soft_cap"], kw["interpret"],
            (q, k, v, seg, None, out, lse, kernel.dq_mask_info, kernel.dkv_mask_info), cts[0])
        dq, dk, dv = grads[3:6]
        return dq, dk, dv, None, None

    f = jax.custom_vjp(lambda *a: fwd(*a)[0])
    f.defvjp(fwd, bwd)
    return f


GPU_BACKWARD_BLOCK = 32  # the Pallas GPU kernel's dq / dkv blocks (its defaults)


def gpu_block(d: int, S: int) -> int:
    """The Pallas GPU kernel's forward query / key block for head dim d: 128 up to d = 128, 64 beyond (its q, k and
    v tiles live in on-chip memory), no larger than S rounded up to a power of two (Triton's tiles) of at least the
    backward block (which must divide it)."""
    return min(128 if d <= 128 else 64, max(GPU_BACKWARD_BLOCK, 1 << (S - 1).bit_length()))


def _gpu_local(q, k, v, q_seg, k_seg, scale: float, block: int, interpret: bool):
    """`kernel_attention` by the Pallas GPU flash kernel on this device's rows. Head dims zero-padded to one width,
    S padded to a multiple of the block with segment id -1 (padded queries see only padded keys, which come causally
    after every real query). k_seg is q_seg here (self-attention: `kernel_misfit`)."""
    del k_seg, block  # one segment-id array for queries and keys; the kernel's blocks follow the head dim
    B, S, H, e = v.shape
    d = max(q.shape[-1], e, 16)  # (Triton's dots want 16 at least)
    b = gpu_block(d, S)
    pad = -S % b
    fit = lambda a: jnp.pad(a, [(0, 0), (0, pad), (0, 0), (0, d - a.shape[-1])])  # noqa: E731
    seg = jnp.pad(q_seg.astype(jnp.int32), [(0, 0), (0, pad)], constant_values=-1)
    out, lse2 = _gpu_fn(float(scale), b, interpret)(fit(q), fit(k), fit(v), seg)
    lse = jnp.swapaxes(lse2, 1, 2)[:, :S] * jnp.log(2.0)  # base 2 -> natural
    return out[:, :S, :, :e].astype(v.dtype), lse.astype(jnp.float32)


@functools.lru_cache(maxsize=16)
def _gpu_fn(scale: float, b: int, interpret: bool):
    """(q, k, v [B,S,H,d], seg [B,S]) -> (out [B,S,H,d], lse [B,H,S] base 2); custom VJP = the kernel's backward."""
    bb = GPU_BACKWARD_BLOCK
    sizes = gpu_flash.BlockSizes(block_q=b, block_k=b, block_q_dkv=bb, block_kv_dkv=bb, block_q_dq=bb, block_kv_dq=bb)
    kw = dict(sm_scale=scale, causal=True, block_sizes=sizes, interpret=interpret)

    def fwd(q, k, v, seg):
        out, lse = gpu_flash.mha(q, k, v, seg, return_residuals=True, **kw)
        return (out, lse), (q, k, v, seg, out, lse)

    def bwd(res, cts):
        dq, dk, dv, _ = gpu_flash._mha_backward(scale, True, sizes, "triton", None, 2, None, interpret, False, False,
                                                res, cts[0])
        return dq, dk, dv, None

    f = jax.custom_vjp(lambda *a: fwd(*a)[0])
    f.defvjp(fwd, bwd)
    return f
