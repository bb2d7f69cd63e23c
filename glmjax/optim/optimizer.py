"""`build_optimizer`: one optax GradientTransformation for the whole parameter tree.

    tx, table = build_optimizer(nnx.state(model, nnx.Param), opt_cfg)
    print(table)                          # (group, optimizer, lr, tensors, params) -- print it at start-up
    state = tx.init(params); updates, state = tx.update(grads, state, params)

Pipeline of one update (all inside jit; the Python-side bookkeeping happens once, at trace time):

  grads (any pytree of the parameters' structure: nnx.State of Params, pure dict, ...)
   -> {path: array}                       keyed by the parameter path, checked against the built tree
   -> clip per clip group                 "lm" (everything the LM loss trains) and "indexer" (trained only by its
                                          own KL loss, docs/model.md E.3) get separate global norms, so the
                                          indexer's grads never shrink or dominate the LM clipping
   -> cut into parts                      W_UK | W_UV (and nope | rope) of split matrices
   -> per optimizer group                 muon / adamw / indexer / indexer_muon, each with its own schedule
   -> merge parts, back to the input tree structure
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from glmjax.optim.config import validate_optim_config
from glmjax.optim.grouping import GroupTable, ParamInfo, assign_groups, leaves_by_path, variables_by_path
from glmjax.optim.muon import GroupedState, clip_by_group_norm, merge_parts, muon_for_parts, part_key, split_parts
from glmjax.optim.schedules import make_schedule


def _split_dims(params, model_cfg, o) -> dict:
    """d_nope, d_rope, d_v for muon_split: from the model config, or read off the shapes of q_b_proj / kv_b_proj /
    o_proj (o_proj gives d_v, kv_b_proj d_nope + d_v, q_b_proj d_nope + d_rope), checked for consistency."""
    if model_cfg is not None:
        return {"_d_nope": model_cfg.qk_nope_head_dim, "_d_rope": model_cfg.qk_rope_head_dim,
                "_d_v": model_cfg.v_head_dim}
    shapes = {k: tuple(v.shape) for k, v in variables_by_path(params).items()}
    found = set()
    for path, shape in shapes.items():
        if not path.endswith(".kv_b_proj") and path != "kv_b_proj":
            continue
        prefix = path[: -len("kv_b_proj")]
        q = next((prefix + n for n in ("q_b_proj", "q_proj") if prefix + n in shapes), None)
        if prefix + "o_proj" not in shapes or q is None:
            raise ValueError(f"muon_split: cannot infer the head dims at {path!r} (needs its sibling o_proj and "
                             "q_b_proj or q_proj); pass model_cfg to build_optimizer")
        d_v = shapes[prefix + "o_proj"][-2]
        d_nope = shape[-1] - d_v
        d_rope = shapes[q][-1] - d_nope
        found.add((d_nope, d_rope, d_v))
    if len(found) > 1:
        raise ValueError(f"muon_split: inconsistent head dims across attention blocks {sorted(found)}")
    if not found:  # no MLA in the tree (e.g. only the indexer trains): nothing to split
        return {"_d_nope": 0, "_d_rope": 0, "_d_v": 0}
    d_nope, d_rope, d_v = found.pop()
    if d_nope < 1 or d_rope < 0:
        raise ValueError(f"muon_split: inferred head dims d_nope={d_nope}, d_rope={d_rope}, d_v={d_v} are invalid; "
                         "pass model_cfg to build_optimizer")
    return {"_d_nope": d_nope, "_d_rope": d_rope, "_d_v": d_v}


def build_optimizer(params, opt_cfg, model_cfg=None) -> tuple[optax.GradientTransformation, GroupTable]:
    """params: nnx.State of nnx.Param (concrete or abstract, e.g. from nnx.eval_shape) -- the tree the optimizer
    will see. Only shapes and logical axis names are read; nothing is allocated.
    opt_cfg: ConfigDict / dict with the fields of `default_optim_config` (missing fields take the defaults).
    model_cfg: optional ModelConfig; muon_split reads the head dims from it (else from the parameter shapes).
    -> (GradientTransformation over trees of the structure of `params`, GroupTable)."""
    o = validate_optim_config(opt_cfg)
    if o["name"] == "muon_split":
        o.update(_split_dims(params, model_cfg, o))
    infos = assign_groups(params, o)
    by_path = {i.path: i for i in infos}
    order = [i.path for i in infos]

    peak = {"muon": o["muon_lr"], "adamw": o["lr"], "indexer": o["indexer_lr"], "indexer_muon": o["indexer_lr"]}
    present = list(dict.fromkeys(i.group for i in infos))
    schedules = {g: make_schedule(peak[g], o["warmup_steps"], o["total_steps"], o["schedule"], o["end_lr_ratio"])
                 for g in present}
    clip_of = {i.path: "indexer" if i.group.startswith("indexer") else "lm" for i in infos}
    max_norms = {"lm": o["grad_clip"], "indexer": o["indexer_grad_clip"]}

    def group_tx(g: str, members: list[ParamInfo]) -> optax.GradientTransformation:
        if g in ("muon", "indexer_muon"):
            return muon_for_parts(members, schedules[g], momentum=o["momentum"], nesterov=o["nesterov"],
                                  ns_steps=o["ns_steps"], weight_decay=o["weight_decay"],
                                  consistent_rms=o["consistent_rms"], eps=o["eps"])
        mask = {i.path: i.decay for i in members}
        return optax.adamw(schedules[g], b1=o["b1"], b2=o["b2"], eps=o["eps"], weight_decay=o["weight_decay"],
                           mask=mask)

    members = {g: [i for i in infos if i.group == g] for g in present}
    txs = {g: group_tx(g, members[g]) for g in present}
    part_group = {}
    for i in infos:
        for s in (i.segments if len(i.segments) > 1 else [None]):
            part_group[i.path if s is None else part_key(i, s)] = i.group

    def flat_of(tree, what):
        flat, treedef = leaves_by_path(tree)
        if flat.keys() != by_path.keys():
            missing = sorted(set(order) - set(flat))
            extra = sorted(set(flat) - set(order))
            raise ValueError(f"{what} does not match the parameter tree the optimizer was built for: "
                             f"missing {missing[:3]}{'...' if len(missing) > 3 else ''}, "
                             f"unexpected {extra[:3]}{'...' if len(extra) > 3 else ''}")
        return flat, treedef

    def by_group(parts: dict) -> dict:
        out = {g: {} for g in present}
        for k, x in parts.items():
            out[part_group[k]][k] = x
        return out

    def init_fn(params):
        flat, _ = flat_of(params, "params")
        groups = by_group(split_parts(flat, by_path))
        norms = {c: jnp.zeros((), jnp.float32) for c in dict.fromkeys(clip_of.values())}
        return GroupedState(grad_norms=norms, groups={g: txs[g].init(groups[g]) for g in present})

    def grouped_update(flat, state, flat_params):
        flat, norms = clip_by_group_norm(flat, clip_of, max_norms)
        u_groups = by_group(split_parts(flat, by_path))
        p_groups = by_group(split_parts(flat_params, by_path)) if flat_params is not None else None
        new_parts, new_states = {}, {}
        for g in present:
            u, new_states[g] = txs[g].update(u_groups[g], state.groups[g], None if p_groups is None else p_groups[g])
            new_parts.update(u)
        return merge_parts(new_parts, by_path, order), GroupedState(grad_norms=norms, groups=new_states)

    def update_fn(updates, state, params=None):
        flat, treedef = flat_of(updates, "updates")
        flat_params = flat_of(params, "params")[0] if params is not None else None
        # Under a mesh with Explicit axes (jax.make_mesh's default) the shardings are part of the types and the
        # reshapes / slices of the orthogonalisation would need hand-written output shardings: run the update with
        # the mesh axes Auto (XLA propagates shardings) and hand back updates / state sharded as they came in.
        out_specs = jax.tree.map(lambda x: jax.typeof(x).sharding.spec, (flat, state))
        merged, new_state = jax.sharding.auto_axes(grouped_update, out_sharding=out_specs)(flat, state, flat_params)
        return treedef.unflatten([merged[k] for k in flat]), new_state

    options = {k: o[k] for k in ("schedule", "warmup_steps", "total_steps", "weight_decay")}
    if o["name"] != "adamw":
        options.update({k: o[k] for k in ("momentum", "nesterov", "ns_steps", "consistent_rms")})
    if o["name"] == "muon_split":
        options.update({k: o[k] for k in ("split_rope", "split_o_proj")})
    table = GroupTable(o["name"], infos, {g: peak[g] for g in present}, schedules, max_norms, options)
    return optax.GradientTransformation(init_fn, update_fn), table

