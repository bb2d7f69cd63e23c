"""The one table of logical-axis rules: every logical axis name a parameter (`out_sharding` metadata, see
`glmjax/model/layers.py::param`) or an activation carries -> the mesh axes that shard it.

Mesh axes (see `glmjax/parallel/mesh.py`):
  data    pure data parallelism: parameters replicated, batch split
  fsdp    batch split *and* parameters / optimizer state split along their "embed" dimension (ZeRO-3)
  expert  batch split; routed experts split along "experts" (tokens travel by all-to-all, `glmjax/model/moe.py`);
          every other weight is split along "embed" over it as well, so it acts as a second FSDP axis for them
  context the sequence of every activation split (context parallelism): each shard holds S / context tokens of
          every row (in the model's zig-zag layout: chunks i and 2N-1-i of 2N, equal causal work); every
          sequence-blocked function runs with the shard's queries and all-gathers the keys it needs (MLA latent
          rows, indexer keys, per-head K/V; `glmjax/model/context.py`). Parameters and optimizer state are split
          over it like over fsdp ("embed", "q_lora", "kv_lora"): context ranks, like fsdp ranks, see different
          tokens, so the gradients must be reduced over the axis anyway (a reduce-scatter instead of an all-reduce:
          no extra traffic) and the weights are already all-gathered layer by layer for FSDP (the gather group
          just grows); replicated, parameters + optimizer state would take `context` times the memory per chip,
          at the long sequences where activations already fill it. The routed experts are split over it along
          "experts" instead (expert parallelism over context, before the expert axis): their tokens travel, not
          their weights
  tensor  Megatron-style: attention heads, MLP / expert hidden and vocabulary split; the batch is *not* split

A dimension takes the mesh axes of its rule, left to right over the array's dimensions, skipping mesh axes that an
earlier dimension already took and stopping before an axis whose size would not divide the dimension (that part of
the dimension stays replicated). E.g. experts_gate [E, D, I] ("experts", "embed", "expert_mlp") -> P("expert",
"fsdp", "tensor"): "embed" asks for (fsdp, expert) but "experts" took expert first; with context 256 x expert 2 and
E = 256, "experts" takes context (256 | 256) and stops before expert (512 does not divide 256), so "embed" takes
expert: P("context", "expert", None).
"""
from __future__ import annotations

import math
from typing import Any, Callable, Mapping, Sequence

import jax
from jax.sharding import NamedSharding, PartitionSpec as P

MESH_AXES = ("data", "fsdp", "expert", "context", "tensor")

LOGICAL_RULES: dict[str, tuple[str, ...]] = {
    # activations
    "batch": ("data", "fsdp", "expert"),  # every axis that splits rows; tensor ranks share their tokens
    "sequence": ("context",),  # [B,S,...]: the sequence; with "batch", every axis that splits tokens
    # the queries of the indexer top-k kernel: it sums over its heads inside (the top-k of a head sum cannot be
    # assembled from per-head partial sums without the [S,T] scores crossing devices), so tensor ranks split the
    # queries instead of the heads rather than all computing the same top-k
    "index_queries": ("context", "tensor"),
    # parameters
    "vocab": ("tensor",),  # embed_tokens [V, D], lm_head [D, V]
    "embed": ("fsdp", "expert", "context"),  # the model width D of every weight: the FSDP dimension
    "heads": ("tensor",),  # MLA q_b_proj, kv_b_proj, o_proj
    "head_dim": (),
    "q_lora": ("fsdp", "expert", "context"),  # q_b_proj / indexer wq_b have no model width: FSDP over the rank
    "kv_lora": ("fsdp", "expert", "context"),  # kv_b_proj likewise (kv_a_proj's rank stays whole: "embed" took them)
    "index_heads": ("tensor",),
    "index_head_dim": (),
    "mlp": ("tensor",),  # dense MLP and shared-expert hidden
    # routed experts [E, ...]: context first -- at long sequences context is the large axis and a context shard's
    # tokens are few (GLM-5 at 202,752 on 256 context shards: 5,544 per chip) while one layer's experts are 19 GB
    # in bf16: moving the tokens to the experts costs far less than gathering the experts' model width over
    # context (the "embed" rule) layer by layer; expert joins where context x expert divides E
    "experts": ("context", "expert"),
    "expert_mlp": ("tensor",),  # routed-expert hidden I
    "experts_router": (),  # router gate [D, E] and correction bias [E]: every rank routes its own tokens
    "mtp_in": (),  # MTP eh_proj input [2D]
    "norm": (),
    "layers": (),  # the scanned stack axis: one layer's weights are gathered at a time
}


def _as_tuple(m) -> tuple[str, ...]:
    return (m,) if isinstance(m, str) else tuple(m or ())


def logical_spec(axes: Sequence[str | None] | None, shape: Sequence[int], mesh,
                 rules: Mapping[str, Any] | None = None) -> P:
    """Logical axis names + shape -> PartitionSpec on `mesh` (a Mesh or AbstractMesh) by the rules (see module doc).
    A name without a rule, and a mesh axis the mesh lacks, are replicated (tests check that every name the model
    uses has a rule in LOGICAL_RULES)."""
    rules = LOGICAL_RULES if rules is None else rules
    axes = tuple(axes) if axes is not None else (None,) * len(shape)
    if len(axes) != len(shape):
        raise ValueError(f"logical axes {axes} do not match shape {tuple(shape)}")
    sizes = dict(mesh.shape)
    used: set[str] = set()
    spec = []
    for dim, name in zip(shape, axes):
        took, size = [], 1
        for m in _as_tuple(rules.get(name) if name is not None else None):
            if m not in sizes or m in used or sizes[m] == 1:
                continue
            if dim % (size * sizes[m]):
                break
            took.append(m)
            size *= sizes[m]
        used.update(took)
        spec.append(None if not took else took[0] if len(took) == 1 else tuple(took))
    return P(*spec)


def logical_sharding(mesh: jax.sharding.Mesh, rules: Mapping[str, Any] | None = None) -> Callable:
    """A `sharding=` callable for `glmjax.interop.load_hf`: (path, logical axes, shape) -> NamedSharding."""

    def fn(path, axes, shape):
        del path
        return NamedSharding(mesh, logical_spec(axes, shape, mesh, rules))

    return fn


def batch_axes(mesh, rules: Mapping[str, Any] | None = None) -> tuple[str, ...]:
    """The mesh axes (size > 1) that split the batch (the "batch" rule)."""
    rules = LOGICAL_RULES if rules is None else rules
    return tuple(a for a in _as_tuple(rules["batch"]) if dict(mesh.shape).get(a, 1) > 1)


def sequence_axes(mesh, rules: Mapping[str, Any] | None = None) -> tuple[str, ...]:
    """The mesh axes (size > 1) that split the sequence (the "sequence" rule)."""
    rules = LOGICAL_RULES if rules is None else rules
    return tuple(a for a in _as_tuple(rules["sequence"]) if dict(mesh.shape).get(a, 1) > 1)


def token_axes(mesh, rules: Mapping[str, Any] | None = None) -> tuple[str, ...]:
    """Every mesh axis that splits the tokens of a [B,S] batch: the batch axes, then the sequence axes (the order in
    which [B,S] -> [B*S] flattens them)."""
    return batch_axes(mesh, rules) + sequence_axes(mesh, rules)


def batch_spec(mesh, rules: Mapping[str, Any] | None = None) -> P:
    """PartitionSpec of [B, S, ...] inputs: B split over the batch axes, and S over the sequence axes when the mesh
    has any (context > 1)."""
    ax, seq = batch_axes(mesh, rules), sequence_axes(mesh, rules)
    return P(ax if ax else None, seq) if seq else P(ax if ax else None)


def num_batch_shards(mesh, rules: Mapping[str, Any] | None = None) -> int:
    return math.prod(dict(mesh.shape)[a] for a in batch_axes(mesh, rules))
