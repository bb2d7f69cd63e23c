"""Explicit, path-based parameter grouping.

Every parameter is looked up by its name (the last component of its path) in `RULES`; a parameter without a rule is
an error, never a silent default. A rule says what the tensor is (a matrix with named reduction / output axes, an
embedding, a norm scale, the router, ...). The optimizer name then maps kinds to groups:

  group          optimizer  parameters
  muon           Muon       attention / MLP / expert / MTP matrices            (name = muon, muon_split)
  adamw          AdamW      embeddings, LM head, norms, router gate           (every non-indexer param for name=adamw)
  indexer        AdamW      lightning-indexer params (own lr, own grad clip): k_norm, weights_proj (+ wq_b, wk)
  indexer_muon   Muon       indexer wq_b, wk                                   (only with indexer_optimizer = muon)

Matrices are described by *logical axis names* (the `out_sharding` metadata every nnx.Param carries), not by
positions: `reduce` axes are contracted with the layer input, `output` axes index the layer output, and every other
axis is a batch axis -- each slice along it is orthogonalised on its own (optax's MuonDimensionNumbers convention).
That is how the stacked-layer axis ("layers") and the expert axis ("experts") stay batch axes, and how split mode
works: dropping "heads" from a rule's output axes turns heads into a batch axis.

Split mode (docs/model.md E.6, "Muon Split"):
  q_b_proj  [r_q, H, d_nope + d_rope]  per head. split_rope = "together" (default): each head's [r_q, d_nope+d_rope]
            block is one matrix; "separate": its nope and rope columns are two matrices. (q_proj [D, H, ..], the
            query weight without a query LoRA, likewise.)
  kv_b_proj [r_kv, H, d_nope + d_v]   per head, W_UK = [.., :d_nope] and W_UV = [.., d_nope:] orthogonalised apart.
  o_proj    [H, d_v, D]               per head when split_o_proj (a head's [d_v, D] block).
Unsplit Muon ("muon") orthogonalises each of the three as one matrix over all heads (r_q x H*(d_nope+d_rope), ...).

Why rope "together" is the default (the sources leave it open, docs/model.md E.6): the paper splits W^UQ "by head", and
a head's query q_h = c_q W^UQ_h feeds one attention logit q_h . k_h = q_nope . k_nope + q_rope . k_rope. Orthogonalising
the whole [r_q, d_nope + d_rope] block bounds the spectral norm of that head's query update, which is what bounds the
change of the head's logits -- the quantity Muon-Split is reported to keep stable. Orthogonalising nope and rope apart
gives each part spectral norm ~1, so the head's query update can reach ~sqrt(2) of it and the rope part (64 of 256
columns in GLM-5) moves as much as the nope part. It is also the GQA analogue the paper compares with: a GQA head's W_Q
slice contains its rotary dimensions. "separate" stays available for ablation. W_UK and W_UV are always apart: they are
two different maps (key vs value) that merely share a storage tensor.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
from flax import nnx

# Logical axes that may be batch axes of a Muon matrix. Anything else left over by a rule is a mistake in the rule.
BATCH_AXES = {"layers", "experts", "heads", "index_heads"}


@dataclasses.dataclass(frozen=True)
class Rule:
    kind: str  # "matrix" | "embedding" | "lm_head" | "norm" | "router" | "indexer_weights"
    reduce: tuple[str, ...] = ()  # matrices: the logical axes contracted with the input
    output: tuple[str, ...] = ()  # matrices: the logical axes of the output
    expect: tuple[str, ...] = ()  # other kinds: the logical axes the tensor must have (besides a "layers" axis)

    @property
    def decay(self) -> bool:  # decoupled weight decay on matrices, embeddings and the router; never on norms
        return self.kind != "norm"


def _m(reduce, output):
    return Rule("matrix", tuple(reduce), tuple(output))


RULES: dict[str, Rule] = {
    "embed_tokens": Rule("embedding", expect=("vocab", "embed")),
    "lm_head": Rule("lm_head", expect=("embed", "vocab")),
    "weight": Rule("norm", expect=("norm",)),  # RMSNorm / LayerNorm scale
    "bias": Rule("norm", expect=("norm",)),  # LayerNorm bias (indexer k_norm)
    "gate": Rule("router", expect=("embed", "experts_router")),  # MoE router [D, E] (f32 compute; AdamW)
    "q_a_proj": _m(["embed"], ["q_lora"]),
    "kv_a_proj_with_mqa": _m(["embed"], ["kv_lora"]),
    "q_b_proj": _m(["q_lora"], ["heads", "head_dim"]),
    "q_proj": _m(["embed"], ["heads", "head_dim"]),  # q_lora_rank 0: the queries straight from x
    "kv_b_proj": _m(["kv_lora"], ["heads", "head_dim"]),
    "o_proj": _m(["heads", "head_dim"], ["embed"]),
    "gate_proj": _m(["embed"], ["mlp"]),
    "up_proj": _m(["embed"], ["mlp"]),
    "down_proj": _m(["mlp"], ["embed"]),
    "experts_gate": _m(["embed"], ["expert_mlp"]),
    "experts_up": _m(["embed"], ["expert_mlp"]),
    "experts_down": _m(["expert_mlp"], ["embed"]),
    "eh_proj": _m(["mtp_in"], ["embed"]),
    "wq_b": _m(["q_lora"], ["index_heads", "index_head_dim"]),
    "wq": _m(["embed"], ["index_heads", "index_head_dim"]),  # q_lora_rank 0
    "wk": _m(["embed"], ["index_head_dim"]),
    "weights_proj": Rule("indexer_weights", expect=("embed", "index_heads")),  # per-head weights (f32; AdamW)
}
INDEXER_ONLY = {"wq_b", "wq", "wk", "weights_proj"}  # names that must sit under an `indexer` module
NOT_OPTIMIZED = {"e_score_correction_bias"}  # RouterBias: updated from expert load, never by an optimizer


@dataclasses.dataclass(frozen=True)
class Segment:
    """One matrix (batched over the remaining axes) handed to Newton-Schulz: the slice [start:stop] of the parameter
    along `axis`, or the whole parameter when axis is None."""
    name: str  # "" for the whole parameter, else e.g. "uk", "uv", "nope", "rope"
    axis: int | None  # axis the parameter is sliced along
    start: int
    stop: int
    reduction_axis: tuple[int, ...]
    output_axis: tuple[int, ...]
    fan_in: int
    fan_out: int


@dataclasses.dataclass(frozen=True)
class ParamInfo:
    path: str
    shape: tuple[int, ...]
    axes: tuple[str | None, ...]
    rule: Rule
    group: str
    decay: bool
    segments: tuple[Segment, ...] = ()  # Muon groups only

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def matrices(self) -> int:
        """How many separate matrices Newton-Schulz orthogonalises for this parameter (0 for AdamW)."""
        n = 0
        for s in self.segments:
            n += math.prod(d for i, d in enumerate(self.shape) if i not in s.reduction_axis + s.output_axis)
        return n

    def describe(self) -> str:
        if not self.segments:
            return ""
        parts = []
        for s in self.segments:
            red = ",".join(self.axes[i] for i in s.reduction_axis)
            out = ",".join(self.axes[i] for i in s.output_axis)
            batch = [a for i, a in enumerate(self.axes) if i not in s.reduction_axis + s.output_axis]
            tag = f"{s.name}[{s.start}:{s.stop}] " if s.name else ""
            parts.append(f"{tag}({red})x({out}) {s.fan_in}x{s.fan_out}" + (f" per {','.join(batch)}" if batch else ""))
        return "; ".join(parts)


# ------------------------------------------------------------------------------------------- paths and metadata


def path_key(path) -> str:
    """'stacks.0.units.layers.1.self_attn.q_b_proj' from a jax key path (a trailing Variable `.value` dropped)."""
    parts = []
    for k in path:
        if isinstance(k, jax.tree_util.DictKey):
            parts.append(str(k.key))
        elif isinstance(k, jax.tree_util.SequenceKey):
            parts.append(str(k.idx))
        elif isinstance(k, jax.tree_util.GetAttrKey):
            parts.append(k.name)
        elif isinstance(k, jax.tree_util.FlattenedIndexKey):
            parts.append(str(k.key))
        else:
            parts.append(str(k))
    if path and isinstance(path[-1], jax.tree_util.GetAttrKey) and path[-1].name == "value":
        parts = parts[:-1]
    return ".".join(parts)


def variables_by_path(params) -> dict[str, Any]:
    """{path key: leaf} with nnx.Variables kept whole (their metadata holds the logical axes)."""
    flat = jax.tree_util.tree_flatten_with_path(params, is_leaf=lambda x: isinstance(x, nnx.Variable))[0]
    return {path_key(p): leaf for p, leaf in flat}


def leaves_by_path(tree) -> tuple[dict[str, Any], Any]:
    """-> ({path key: array leaf}, treedef) for any pytree of the parameters' structure (grads, params, updates)."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
    out = {}
    for p, leaf in flat:
        k = path_key(p)
        if k in out:
            raise ValueError(f"two leaves map to the same parameter path {k!r}")
        out[k] = leaf
    return out, treedef


# ------------------------------------------------------------------------------------------------ assignment


def _fail(path, shape, axes, msg):
    raise ValueError(f"parameter {path} (shape {tuple(shape)}, axes {axes}): {msg}")


def _matrix_rule(name: str, rule: Rule, o: dict) -> tuple[Rule, list[tuple[str, str, int]]]:
    """The rule after split mode -> (rule, segments as [(segment name, split axis name, size)])."""
    if o["name"] != "muon_split":
        return rule, []
    if name in ("q_b_proj", "q_proj"):
        r = Rule("matrix", rule.reduce, ("head_dim",))
        if o["split_rope"] == "separate":
            return r, [("nope", "head_dim", o["_d_nope"]), ("rope", "head_dim", o["_d_rope"])]
        return r, []
    if name == "kv_b_proj":
        return Rule("matrix", rule.reduce, ("head_dim",)), [("uk", "head_dim", o["_d_nope"]),
                                                             ("uv", "head_dim", o["_d_v"])]
    if name == "o_proj" and o["split_o_proj"]:
        return Rule("matrix", ("head_dim",), rule.output), []
    return rule, []


def _segments(path, shape, axes, rule: Rule, split) -> tuple[Segment, ...]:
    for a in rule.reduce + rule.output:
        if axes.count(a) != 1:
            _fail(path, shape, axes, f"the Muon rule needs exactly one axis named {a!r}")
    red = tuple(axes.index(a) for a in rule.reduce)
    out = tuple(axes.index(a) for a in rule.output)
    batch = [a for i, a in enumerate(axes) if i not in red + out]
    bad = [a for a in batch if a not in BATCH_AXES]
    if bad:
        _fail(path, shape, axes, f"axes {bad} are neither reduction {rule.reduce} nor output {rule.output} axes and "
              f"not known batch axes {sorted(BATCH_AXES)}")
    fan_in = math.prod(shape[i] for i in red)
    fan_out = math.prod(shape[i] for i in out)
    if not split:
        return (Segment("", None, 0, 0, red, out, fan_in, fan_out),)
    ax = axes.index(split[0][1])
    total = sum(size for _, _, size in split)
    if total != shape[ax]:
        _fail(path, shape, axes, f"split {[(n, s) for n, _, s in split]} covers {total} of axis {axes[ax]!r} "
              f"(size {shape[ax]})")
    segs, start = [], 0
    for seg_name, _, size in split:
        f_in = fan_in // shape[ax] * size if ax in red else fan_in
        f_out = fan_out // shape[ax] * size if ax in out else fan_out
        segs.append(Segment(seg_name, ax, start, start + size, red, out, f_in, f_out))
        start += size
    return tuple(segs)


def assign_groups(params, o: dict) -> list[ParamInfo]:
    """Group every parameter of `params` (nnx.State of nnx.Param, concrete or abstract) for the validated optim
    config `o` (with the model dims `_d_nope`, `_d_rope`, `_d_v` filled in for muon_split)."""
    variables = variables_by_path(params)
    if not variables:
        raise ValueError("the parameter tree is empty")
    infos = []
    for path, var in variables.items():
        name = path.split(".")[-1]
        if name in NOT_OPTIMIZED or (isinstance(var, nnx.Variable) and not isinstance(var, nnx.Param)):
            raise ValueError(f"{path} is a {type(var).__name__}, not a trainable nnx.Param: no optimizer may touch it "
                             "(pass nnx.state(model, nnx.Param), not the whole model state)")
        if not isinstance(var, nnx.Variable):
            raise ValueError(f"{path}: leaves must be nnx.Param variables carrying logical axis names (out_sharding); "
                             f"got {type(var).__name__} -- pass nnx.state(model, nnx.Param)")
        shape = tuple(var.shape) if hasattr(var, "shape") else tuple(var.get_value().shape)
        axes = tuple(var.get_metadata().get("out_sharding") or ())
        if len(axes) != len(shape):
            _fail(path, shape, axes, "needs one logical axis name per dimension (nnx.Param out_sharding metadata)")
        rule = RULES.get(name)
        if rule is None:
            _fail(path, shape, axes, f"no grouping rule for the name {name!r}; add one to glmjax/optim/grouping.py "
                  "RULES")
        if rule.kind != "matrix" and tuple(a for a in axes if a != "layers") != rule.expect:
            _fail(path, shape, axes, f"a {rule.kind} parameter must have logical axes {rule.expect} (plus 'layers')")
        in_indexer = "indexer" in path.split(".")
        if name in INDEXER_ONLY and not in_indexer:
            _fail(path, shape, axes, f"{name!r} is an indexer parameter but its path has no 'indexer' component")
        segments = ()
        if in_indexer:
            muon = rule.kind == "matrix" and o["indexer_optimizer"] == "muon"
            group = "indexer_muon" if muon else "indexer"
            if muon:
                segments = _segments(path, shape, axes, rule, [])
        elif rule.kind == "matrix" and o["name"] in ("muon", "muon_split"):
            group = "muon"
            rule2, split = _matrix_rule(name, rule, o)
            segments = _segments(path, shape, axes, rule2, split)
        else:
            group = "adamw"
        infos.append(ParamInfo(path, shape, axes, rule, group, rule.decay, segments))
    return infos


# ------------------------------------------------------------------------------------------------- the table

GROUP_ORDER = ("muon", "adamw", "indexer_muon", "indexer")
GROUP_OPTIMIZER = {"muon": "Muon", "adamw": "AdamW", "indexer_muon": "Muon", "indexer": "AdamW"}


@dataclasses.dataclass
class GroupTable:
    """What `build_optimizer` did with every parameter; `str(table)` is the start-up table."""
    name: str
    infos: list[ParamInfo]
    lrs: dict[str, float]  # peak lr per group
    schedules: dict[str, Any]  # optax schedule per group
    clip: dict[str, float]  # clip group ("lm" | "indexer") -> max global norm (0 = off)
    options: dict[str, Any]

    @property
    def groups(self) -> dict[str, str]:
        return {i.path: i.group for i in self.infos}

    def rows(self) -> list[dict]:
        out = []
        for g in GROUP_ORDER:
            members = [i for i in self.infos if i.group == g]
            if members:
                out.append(dict(group=g, optimizer=GROUP_OPTIMIZER[g], lr=self.lrs[g], count=len(members),
                                params=sum(i.size for i in members), matrices=sum(i.matrices for i in members),
                                no_decay=sum(i.size for i in members if not i.decay),
                                clip="indexer" if g.startswith("indexer") else "lm"))
        return out

    def __str__(self) -> str:
        rows = self.rows()
        total = sum(r["params"] for r in rows)
        head = f"{'group':<13} {'optimizer':<9} {'peak lr':>9} {'tensors':>8} {'params':>17} {'share':>7} " \
               f"{'no decay':>12} {'NS matrices':>12}  clip"
        lines = [f"optimizer {self.name}: " + ", ".join(f"{k}={v}" for k, v in self.options.items()), head,
                 "-" * len(head)]
        for r in rows:
            matrices = format(r["matrices"], ",") if r["matrices"] else "-"
            lines.append(f"{r['group']:<13} {r['optimizer']:<9} {r['lr']:>9.3g} {r['count']:>8,} {r['params']:>17,} "
                         f"{r['params'] / total:>7.2%} {r['no_decay']:>12,} {matrices:>12}  {r['clip']} "
                         f"(max norm {self.clip[r['clip']] or 'off'})")
        lines.append(f"{'total':<13} {'':<9} {'':>9} {sum(r['count'] for r in rows):>8,} {total:>17,}")
        return "\n".join(lines)

    def details(self) -> str:
        """One line per parameter: path, shape, group, and for Muon the orthogonalised matrices."""
        w = max(len(i.path) for i in self.infos)
        return "\n".join(f"{i.path:<{w}} {str(i.shape):<24} {i.group:<12} {i.describe()}" for i in self.infos)
