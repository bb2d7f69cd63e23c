"""The dense causal self-attention kernel behind `flash_attention.flash_attention`, and the choice of implementation.

    "splash": JAX's Pallas TPU splash attention (`jax.experimental.pallas.ops.tpu.splash_attention`): a causal mask
              with per-row segment ids, forward and backward kernels (separate dq and dkv kernels), blocks with no
              visible key skipped from the mask's block map. Different qk / v head dims are fine (GLM-5 256 / 256,
              DeepSeek 192 / 128). Its causal mask is static -- query s sees key slots t <= s -- so it serves
              self-attention over the sequence itself (`q_idx` None, S == T) with keys per head ([B,T,H,d]).
    "xla":    the blocked online-softmax attention of flash_attention.py (any q_idx, MQA keys, any platform).

`choose` picks: "auto" -> splash on TPU where it applies, else XLA; "splash" -> splash where it applies, on any
platform (interpreted off TPU: how the tests run it on CPU), else XLA; "xla" -> XLA. Where splash does not apply --
queries at explicit key slots (context-parallel shards, cached prefill / decode), keys shared by the heads (the
absorbed MQA form, qk 576 / v 512 with q_idx) -- the XLA flash is used. The platform is the one the code is traced
for: the abstract mesh's devices (so an AOT compile for a TPU topology from a CPU host picks the kernel), else the
default backend.

GPU: `jax.nn.dot_product_attention(implementation="cudnn")` takes a causal flag and per-row lengths but no packed
segment ids (its mask argument would be a [B,H,S,T] array), and training batches are packed; the XLA flash runs
there.

Splash has no softmax scale (queries are scaled before the kernel) and returns no row max: `flash_attention`
computes it (the max_attn_logit metric of every dense training step) in a forward-only blocked XLA pass of QK^T, an
extra score computation per step on top of the kernel's. Its backward is called through `splash_attention_kernel`'s own
backward function so the forward can return the log-sum-exp the streamed indexer losses need (the public kernel
with `save_residuals=True` is not differentiable). Its mask preprocessing runs on the host at trace time,
O((S / block)^2): ~1 s at S = 16K, ~13 s at 64K, ~150 s at 202,752 on a CPU host core (cached per shape).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu import splash_attention as splash
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash_kernel

from glmjax.model import context

DENSE_IMPLS = ("auto", "xla", "splash")
LANES = 128  # splash blocks are multiples of this


def platform() -> str:
    """The platform the code is traced for: the abstract mesh's devices, else the default backend."""
    mesh = jax.sharding.get_abstract_mesh()
    dev = None if mesh.empty else mesh.abstract_device
    return dev.platform if dev is not None else jax.default_backend()


def splash_misfit(q, k, q_idx) -> str | None:
    """Why splash cannot compute this attention (None: it can)."""
    if q_idx is not None:
        return "queries at explicit key slots (q_idx)"
    if k.ndim != 4:
        return "keys shared by the heads (MQA form)"
    if q.shape[1] != k.shape[1]:
        return f"S {q.shape[1]} != T {k.shape[1]}"
    return None


def choose(impl: str, q, k, q_idx) -> str:
    """-> "splash" | "xla" for `impl` (one of DENSE_IMPLS) on the traced-for platform."""
    if impl not in DENSE_IMPLS:
        raise ValueError(f"dense attention impl {impl!r}: must be one of {DENSE_IMPLS}")
    fits = splash_misfit(q, k, q_idx) is None
    if impl == "splash" or (impl == "auto" and platform() == "tpu"):
        return "splash" if fits else "xla"
    return "xla"


def splash_block(block: int, S: int) -> int:
    """The splash block for `block` (model.block_q): a multiple of 128, no larger than S rounded up to 128."""
    up = lambda n: -(-n // LANES) * LANES  # noqa: E731
    return min(up(block), up(S))


# rows over the batch axes, heads over tensor, each shard's sequences whole (the causal mask is over the positions
# the kernel sees; a sequence split over context is gathered -- the model itself never sends one here: its context
# shards pass explicit key slots, which run the XLA flash)
_BSH, _BS = ("batch", None, "heads"), ("batch", None)
_SPLASH_AXES = ((_BSH, _BSH, _BSH, _BS, _BS, None, None, None), (_BSH, _BSH))


def splash_attention(q, k, v, q_seg, k_seg, scale: float, block: int, interpret: bool):
    """Causal self-attention by the splash kernel: q [B,S,H,d], k [B,S,H,d], v [B,S,H,e], q_seg / k_seg [B,S]
    (visible: t <= s and equal segment ids) -> (out [B,S,H,e] in v's dtype, lse [B,S,H] f32). S is padded to a
    multiple of the block (padded keys are causally after every real query). Differentiable in q, k, v. On a mesh
    of several devices the kernel runs inside `jax.shard_map` (Mosaic kernels cannot be partitioned by XLA)."""
    if not context.needs_shard_map(jax.sharding.get_abstract_mesh()):
        return _splash_local(q, k, v, q_seg, k_seg, scale, block, interpret)
    one = context.Layout("contiguous", 1)  # nothing gathered: each shard holds whole sequences
    return context.local_queries(one, _splash_local, *_SPLASH_AXES)(q, k, v, q_seg, k_seg, scale, block, interpret)


def _splash_local(q, k, v, q_seg, k_seg, scale: float, block: int, interpret: bool):
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
