"""Context parallelism: the sequence split over the `context` mesh axis, with local queries and gathered keys.

Inside `jax.jit` on a mesh whose `context` axis has N > 1 devices, every [B,S,...] activation is split along S
into N equal pieces (glmjax/parallel/rules.py "sequence"). XLA's partitioner keeps that split through per-token
ops, but every function that loops over blocks of the sequence (`lax.map` / `lax.scan` over `to_blocks`: flash
attention, the indexer top-k, sparse MLA, the streamed indexer losses, the chunked LM loss) turns the split axis
into the loop axis, which it cannot keep split: it all-gathers the operands and every context shard runs every
block (N x the work and the whole sequence's activations on each chip). `local_queries` runs such a function
inside `jax.shard_map` instead: each shard passes its own queries with their global key slots, the keys (MLA latent
rows, indexer keys, per-head K/V, key segment ids) are all-gathered along context inside, so the results are those
of one device; the backward reduce-scatters the key gradients (the transpose of the all-gather).

Layout (`Layout`, `model.context_layout`): with causal attention a query's work grows with its slot, so the
contiguous split gives the last shard 2N-1 times the work of the first. "zigzag" cuts each row into 2N chunks and
gives shard i chunks i and 2N-1-i: every shard has the same causal work (c = S/2N: c^2 (2N-1) + c(c+1) query-key
pairs). The batch stays in natural order outside the model; `GLM` permutes its [B,S] int inputs (tokens, segment
ids, positions, the shifted targets and their validity, computed in natural order first) into the layout at its
entry, queries carry their natural slots (`Layout.slots`) and gathered keys are put back in natural slot order, so
causality, block skipping, the top-k tie rule (lowest key index) and the returned key indices are those of one
device; per-token outputs a caller reads (hidden states, top-k diagnostics) are permuted back.

    layout = context.layout("zigzag", S)        # None unless the mesh in context splits the sequence
    ids, _ = local_queries(layout, index_topk, *INDEX_TOPK)(q, k, w, q_seg, k_seg, topk, block_q,
                                                            None if layout is None else layout.slots(q_seg.shape))

Axes: each argument of the wrapped function gets logical axis names for its leading dimensions (resolved by the
logical-axis rules, `glmjax.parallel.rules.logical_spec`), "keys" marks the key dimension (split over context
outside, gathered inside), None a static argument passed through; outputs likewise, SUM a scalar partial sum over
the local queries (summed over the shards outside).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from glmjax.parallel.rules import logical_spec

LAYOUTS = ("zigzag", "contiguous")
AXIS = "context"
KEYS = "keys"  # logical name of a key dimension: split over context outside, gathered in natural order inside
SUM = "sum"  # an output that is a scalar sum over the local queries


@dataclasses.dataclass(frozen=True)
class Layout:
    """How a row's S tokens sit on the `shards` context shards (module doc). shards = 1: keys arrive whole."""
    kind: str  # "zigzag" | "contiguous"
    shards: int

    def perm(self, S: int) -> np.ndarray:
        """[S] int32: layout position j holds natural slot perm[j]; shard i holds positions i*S/N .. (i+1)*S/N-1."""
        pieces = self.shards * (2 if self.kind == "zigzag" else 1)
        if S % pieces:
            raise ValueError(f"sequence length {S}: model.context_layout={self.kind!r} on {self.shards} context shards "
                             f"needs a multiple of {pieces}")
        if self.kind == "contiguous" or self.shards == 1:
            return np.arange(S, dtype=np.int32)
        c = S // pieces
        chunks = [(i, 2 * self.shards - 1 - i)[j] for i in range(self.shards) for j in range(2)]
        return np.concatenate([np.arange(k * c, (k + 1) * c) for k in chunks]).astype(np.int32)

    def slots(self, shape) -> jax.Array:
        """[B,S] int32: the natural slot of each layout position (the queries' global key slots, q_idx)."""
        return jnp.broadcast_to(jnp.asarray(self.perm(shape[1])), shape)

    def to_layout(self, x, axis: int = 1):
        """x with its natural-order sequence axis put in layout order (identity for contiguous)."""
        return x if self.kind == "contiguous" else jnp.take(x, self.perm(x.shape[axis]), axis=axis)

    def to_natural(self, x, axis: int = 1):
        """Inverse of `to_layout`."""
        return x if self.kind == "contiguous" else jnp.take(x, np.argsort(self.perm(x.shape[axis])), axis=axis)


def context_size(mesh=None) -> int:
    """Devices on the `context` axis of the mesh in context (1: none, or inside a shard_map where it is manual)."""
    mesh = jax.sharding.get_abstract_mesh() if mesh is None else mesh
    if mesh.empty or AXIS not in mesh.axis_names:
        return 1
    if dict(zip(mesh.axis_names, mesh.axis_types))[AXIS] == jax.sharding.AxisType.Manual:
        return 1
    return mesh.shape[AXIS]


def needs_shard_map(mesh) -> bool:
    """Must a Mosaic kernel traced under `mesh` (the abstract mesh in context) be wrapped in `jax.shard_map`? No
    without a mesh, on one device, or inside a region where every mesh axis is already manual."""
    return not (mesh.empty or mesh.size == 1 or all(t == jax.sharding.AxisType.Manual for t in mesh.axis_types))


def layout(kind: str, S: int) -> Layout | None:
    """The layout of a length-S sequence on the mesh in context; None when nothing splits the sequence. Errors name
    the field (model.context_layout) and the rule."""
    if kind not in LAYOUTS:
        raise ValueError(f"model.context_layout={kind!r}: must be one of {LAYOUTS}")
    n = context_size()
    if n == 1:
        return None
    Layout(kind, n).perm(S)  # checks S
    return Layout(kind, n)


# in_axes / out_axes of the wrapped functions (see `local_queries`)
Q = ("batch", "sequence")  # [B,S] per-query arrays: segment ids, key slots, top-k indices
QH = ("batch", "sequence", "heads")  # [B,S,H,...] attention queries and outputs, heads over tensor
IQ = ("batch", "index_queries")  # [B,S,...] queries of the head-summing indexer functions (context x tensor)
K = ("batch", KEYS)  # [B,T,...] keys shared by the heads: latent rows, indexer keys, key segment ids
W = (None, "heads")  # [r,H,...] weights with a head axis (the latent up-projections)
# mla_variants.flash_from_latent: per-head keys / values are expanded from the gathered 576-wide latent rows on each
# shard
LATENT_FLASH = ((QH, QH, K, K, W, W, Q, K, Q, None, None), (QH, QH, QH))
INDEX_TOPK = ((IQ, K, IQ, IQ, K, None, None, IQ), (IQ, IQ))  # Backend.index_topk
SPARSE_MLA = ((QH, K, Q), (QH, QH))  # Backend.sparse_mla
GATHERED_INDEX_LOGITS = ((IQ, K, IQ, IQ, None), (IQ,))  # Backend.gathered_index_logits
SPARSE_PROBS = ((IQ, K, IQ, IQ), (IQ,))  # sparse_attention.sparse_attention_probs (head mean: heads whole)


def target_axes(target):
    """in_axes of an index_loss.DenseTarget: its queries and log-sum-exps like the indexer's queries, keys gathered
    (the streamed losses average over the heads, so tensor ranks split queries, not heads)."""
    return dataclasses.replace(target, q=IQ, k=K, lse=IQ)


def _is_axes(a) -> bool:
    return isinstance(a, tuple) and all(isinstance(e, str) or e is None for e in a)


def _map_axes(f, axes, arg):
    """f(names, leaf) over every array leaf of `arg`, names from the matching leaf of the prefix tree `axes`."""
    return jax.tree.map(lambda ax, sub: jax.tree.map(lambda x: f(ax, x), sub), axes, arg, is_leaf=_is_axes)


def local_queries(layout: Layout | None, fn, in_axes: tuple, out_axes: tuple, auto: tuple[str, ...] = ()):
    """fn(*args, **static) run with each shard's local queries (module doc) on the mesh in context; `fn` itself when
    layout is None. in_axes: per positional argument the logical axis names of its leading dimensions (a tuple; or
    a pytree prefix of the argument with such tuples at its leaves; KEYS marks the gathered key dimension) or None
    (a static argument); out_axes: per output of fn (a tuple of outputs, or one array) a tuple of names, split like
    the arguments that carry the same names, or SUM. `auto`: mesh axes left to XLA inside (e.g. ("tensor",),
    so the LM head's vocabulary split survives). With layout.shards == 1 the keys enter whole (nothing gathered)."""
    if layout is None:
        return fn

    def wrapped(*args, **static):
        mesh = jax.sharding.get_abstract_mesh()
        dyn = [i for i, ax in enumerate(in_axes) if ax is not None]
        gather = layout.shards > 1
        resolved: dict[str, object] = {}  # logical name -> the mesh axes the query arguments got for it

        def spec(ax, x):
            names = tuple(("sequence" if gather else None) if a == KEYS else a for a in ax)
            s = logical_spec(names + (None,) * (x.ndim - len(names)), x.shape, mesh)
            if KEYS not in ax:
                for name, entry in zip(names, s):
                    resolved.setdefault(name, entry)
            return s

        in_specs = tuple(_map_axes(spec, in_axes[i], args[i]) for i in dyn)
        split = tuple(a for a in mesh.axis_names if any(a == e or (isinstance(e, tuple) and a in e)
                                                        for e in resolved.values()))
        out_specs = tuple(P(split) if ax == SUM else P(*(resolved.get(a) for a in ax)) for ax in out_axes)

        returns_tuple = []

        def body(*dyn_args):
            full = list(args)
            for i, a in zip(dyn, dyn_args):
                full[i] = _map_axes(lambda ax, x: _gather_keys(x, layout) if gather and KEYS in ax else x,
                                    in_axes[i], a)
            out = fn(*full, **static)
            returns_tuple.append(isinstance(out, tuple))
            out = out if isinstance(out, tuple) else (out,)
            return tuple(jnp.reshape(o, (1,)) if ax == SUM else o for o, ax in zip(out, out_axes))

        out = jax.shard_map(body, in_specs=in_specs, out_specs=out_specs,
                            axis_names=frozenset(mesh.axis_names) - frozenset(auto),
                            check_vma=False)(*[args[i] for i in dyn])
        out = tuple(jnp.sum(o) if ax == SUM else o for o, ax in zip(out, out_axes))
        return out if returns_tuple[0] else out[0]

    return wrapped


def _gather_keys(x, layout: Layout):
    """This shard's piece of a key array [B,T/N,...] (layout order) -> all T keys [B,T,...] in natural slot order."""
    return layout.to_natural(jax.lax.all_gather(x, AXIS, axis=1, tiled=True))
