"""Which variant of MLA's attention a layer call runs: the one place of the choice rules, and their start-up report.

    dense, training  "materialised" (latent_attention.dense_mla, the plain path) while the [B,H,S,T] scores stay
                     within Limits.materialise_scores, unless context parallelism splits the sequence or
                     model.dense_attention_impl names a kernel; else "blocked" (flash attention: JAX's splash or
                     Pallas GPU kernel, or the XLA flash: `dense_kernels.choose`), as "head_groups" (one
                     rematerialised step per group of heads) past Limits.head_group_rows of S x heads
    dense, cached    "absorbed" (materialised MQA over the latent rows) while its scores stay small, and always on a
                     cache split over context (decode); else "absorbed_blocked" (flash in MQA form)
    sparse           "sparse": the backend's (model.attention_impl) indexer top-k and sparse MLA over the whole
                     sequence; in training "sparse_chunks" (rematerialised query chunks) past Limits.sparse_chunk_rows
                     of S x H
Under context parallelism every variant runs on each shard's local queries (`context.local_queries`). `describe`
prints the choice for a training run's shapes once at start-up; the variants themselves are in mla_variants.py.
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import NamedTuple

import jax

from glmjax.model import context, dense_kernels


@dataclasses.dataclass(frozen=True)
class Limits:
    """The sizes at which the choice changes (tests and benchmarks replace `LIMITS` to move them)."""
    materialise_scores: float = 2 ** 24  # B·H·S·T: dense attention's scores materialised up to 64 MiB in f32
    head_group_rows: float = 2 ** 20  # S·(heads per group): blocked training attention takes all heads at once
    sparse_chunk_rows: float = 2 ** 18  # S·H: sparse training attention takes the whole sequence at once


LIMITS = Limits()


class Path(NamedTuple):
    """One layer call's attention variant and why it was chosen."""
    kind: str  # materialised | blocked | head_groups | absorbed | absorbed_blocked | sparse | sparse_chunks
    why: str
    groups: int = 1  # head groups (head_groups)
    chunk: int | None = None  # queries per chunk (sparse_chunks)


def materialise(B: int, H: int, S: int, T: int) -> bool:
    """Dense attention's cost rule: the [B,H,S,T] scores stay small enough to materialise (exact, one fused
    softmax); beyond it the blocked (flash) path, O(S) memory."""
    return B * H * S * T <= LIMITS.materialise_scores


def head_groups(S: int, H: int) -> int:
    """Head groups of blocked training attention: the fewest (a divisor of H) with S·H/groups <= head_group_rows."""
    return next(g for g in range(1, H + 1) if H % g == 0 and (S * H // g <= LIMITS.head_group_rows or g == H))


def sparse_chunk(S: int, H: int) -> int | None:
    """Queries per rematerialised chunk of sparse training attention: None (the whole sequence at once) while
    S·H <= sparse_chunk_rows, else c = sparse_chunk_rows // H, or the largest divisor of S in [c/2, c] if there is
    one (whole chunks only: no remainder call, whose concatenation would copy the [B,S,D] output)."""
    if S * H <= LIMITS.sparse_chunk_rows:
        return None
    c = max(1, int(LIMITS.sparse_chunk_rows // H))
    return next((d for d in range(c, (c + 1) // 2 - 1, -1) if S % d == 0), c)


def dense_training(B: int, S: int, H: int, impl: str, context_parallel: bool) -> Path:
    """The dense path of a training call (no cache) over B rows of S tokens with H heads."""
    scores = f"B·H·S·T = {B * H * S * S:,}"
    if context_parallel:
        why = "context parallelism splits the sequence"
    elif impl not in ("auto", "xla"):  # a kernel named
        why = f"model.dense_attention_impl={impl!r}"
    elif materialise(B, H, S, S):
        return Path("materialised", f"{scores} <= {LIMITS.materialise_scores:,.0f} (Limits.materialise_scores)")
    else:
        why = f"{scores} > {LIMITS.materialise_scores:,.0f} (Limits.materialise_scores)"
    groups = head_groups(S, H)
    if groups > 1:
        return Path("head_groups", f"{why}; S·H = {S * H:,} > {LIMITS.head_group_rows:,.0f} (Limits.head_group_rows)"
                    f": {groups} groups of {H // groups} heads", groups=groups)
    return Path("blocked", why)


def dense_cached(B: int, S: int, H: int, T: int, split_cache: bool) -> Path:
    """The dense path against a cache of T rows (prefill, decode); split_cache: the cache is split over context."""
    if split_cache:
        return Path("absorbed", "the cache is split over context (scores split with it)")
    if materialise(B, H, S, T):
        return Path("absorbed", f"B·H·S·T = {B * H * S * T:,} <= {LIMITS.materialise_scores:,.0f} "
                    "(Limits.materialise_scores)")
    return Path("absorbed_blocked", f"B·H·S·T = {B * H * S * T:,} > {LIMITS.materialise_scores:,.0f} "
                "(Limits.materialise_scores)")


def sparse(S: int, H: int, cached: bool) -> Path:
    """The sparse path of S queries with H heads (against a cache: never chunked)."""
    chunk = None if cached else sparse_chunk(S, H)
    if chunk is None:
        return Path("sparse", "against a cache" if cached else
                    f"S·H = {S * H:,} <= {LIMITS.sparse_chunk_rows:,.0f} (Limits.sparse_chunk_rows)")
    return Path("sparse_chunks", f"S·H = {S * H:,} > {LIMITS.sparse_chunk_rows:,.0f} (Limits.sparse_chunk_rows): "
                f"chunks of {chunk} queries", chunk=chunk)


def dense_kernel(impl: str, B: int, S: int, H: int, context_parallel: bool) -> str:
    """The blocked dense path's kernel on the platform traced for (`dense_kernels.choose`)."""
    q = jax.ShapeDtypeStruct((B, S, H, 1), "float32")
    return dense_kernels.choose(impl, q, q, "slots" if context_parallel else None)


def describe(cfg, mode: str, B: int, S: int, mesh=None) -> list[str]:
    """Lines naming the attention path every layer of a training step over B x S tokens on `mesh` takes, and why
    (printed once at start-up)."""
    H = cfg.num_attention_heads
    context_parallel = mesh is not None and context.context_size(mesh) > 1
    layers = f"layers 0-{cfg.num_hidden_layers - 1}" + (" and MTP" if cfg.has_mtp else "")
    cp = "; each context shard's local queries" if context_parallel else ""
    if mode == "dense":
        path = dense_training(B, S, H, cfg.dense_attention_impl, context_parallel)
        if path.kind == "materialised":
            kernel = ""
        else:
            with contextlib.nullcontext() if mesh is None else jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
                kernel = dense_kernel(cfg.dense_attention_impl, B, S, H, context_parallel)
            kernel = {"splash": " (splash kernel)", "pallas_gpu": " (Pallas GPU flash)"}.get(kernel, " (XLA flash)")
        return [f"attention: {layers} dense, {path.kind}{kernel}: {path.why}{cp}"]
    path = sparse(S, H, cached=False)
    kinds = cfg.layer_indexer_types
    full = [i for i, t in enumerate(kinds) if t == "full"]
    shared = [i for i, t in enumerate(kinds) if t != "full"]
    lines = [f"attention: {layers} sparse, {path.kind} ({cfg.attention_impl} backend): {path.why}{cp}",
             f"  top-{cfg.index_topk} keys: own indexer on layers {_ranges(full)}"
             + (" and MTP" if cfg.has_mtp else "")]
    if shared:
        lines.append(f"  IndexShare: layers {_ranges(shared)} reuse the previous full layer's top-k")
    return lines


def _ranges(ids: list[int]) -> str:
    """[0, 1, 2, 5, 7, 8] -> '0-2, 5, 7-8'."""
    runs, start = [], None
    for i, n in enumerate(ids):
        start = n if start is None else start
        if i + 1 == len(ids) or ids[i + 1] != n + 1:
            runs.append(str(n) if n == start else f"{start}-{n}")
            start = None
    return ", ".join(runs)
