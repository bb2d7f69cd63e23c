"""The GLM-5 training stages (docs/model.md E) and the parameter surgery between them.

A stage is: which parameters train, the attention mode, the loss weights, and whether the MoE router bias moves.

  stage          attention  trains                     loss
  pretrain       dense*     everything but indexers    LM + MTP
  dense_warmup   dense      indexers only              indexer KL vs dense attention (E.2)
  sparse_adapt   sparse     everything                 LM + MTP + indexer KL over the selected keys (E.3)
  indexshare     sparse     everything                 as sparse_adapt; a full layer's indexer distils toward the
                                                       mean attention of the layers it serves (E.4)
  sft            train.mode everything but indexers    LM + MTP on response tokens (loss_mask from the data)

  * pretrain honours train.mode; "dense" is the GLM-5 recipe.

Stages hand over through checkpoints: a stage starts from `init_from` (a previous stage's workdir) with
`surgery`, which matches parameters by *layer*, not by storage slot, so it works across IndexShare patterns
(stacked storage differs): parameters the new model has but the checkpoint lacks keep their fresh
initialisation (e.g. indexers added to a dense checkpoint), parameters of the checkpoint the new model lacks are
dropped (e.g. the indexers of layers that became "shared"). Both are listed in the log.
"""
from __future__ import annotations

import dataclasses

import numpy as np
from flax import nnx
from flax import traverse_util

from glmjax.config import ConfigError, ModelConfig
from glmjax.model.transformer import plan_stacks


@dataclasses.dataclass(frozen=True)
class Stage:
    name: str
    mode: str | None  # attention mode; None = train.mode
    trainable: str  # "model" (all but indexers) | "indexer" | "all"
    lm_weight: float
    index_loss: bool
    moves_router_bias: bool


STAGES = {
    "pretrain": Stage("pretrain", None, "model", 1.0, False, True),
    "dense_warmup": Stage("dense_warmup", "dense", "indexer", 0.0, True, False),
    "sparse_adapt": Stage("sparse_adapt", "sparse", "all", 1.0, True, True),
    "indexshare": Stage("indexshare", "sparse", "all", 1.0, True, True),
    "sft": Stage("sft", None, "model", 1.0, False, True),
}

TRAINABLE = {
    "model": nnx.All(nnx.Param, nnx.Not(nnx.PathContains("indexer"))),
    "indexer": nnx.All(nnx.Param, nnx.PathContains("indexer")),
    "all": nnx.Param,
}


def layer_names(cfg: ModelConfig, flat: dict) -> dict:
    """Flat state {path: array} (stacked storage) -> {name: array} with one entry per decoder layer:
    ("layers", i, ...) for layer i's tensors, other paths unchanged. Path elements become strings."""
    plans = plan_stacks(cfg)
    out = {}
    for path, value in flat.items():
        path = tuple(str(p) for p in path)
        if path[0] == "stacks":
            s, j, rest = int(path[1]), int(path[4]), path[5:]
            host = np.asarray(value)  # sliced on the host: no program compiled per slice shape
            for u, start in enumerate(plans[s].starts):
                out[("layers", str(start + j)) + rest] = host[u]
        else:
            out[path] = value
    return out


def surgery(model, source: dict, source_cfg: ModelConfig) -> list[str]:
    """Overwrite `model`'s state (params and router biases) with the matching tensors of `source` (a restored state
    as a nested dict, e.g. from a checkpoint of a model with config `source_cfg`). -> log lines (what was added
    fresh / dropped). Raises ValueError on a shape mismatch."""
    src = layer_names(source_cfg, traverse_util.flatten_dict(source))
    state = nnx.state(model)
    target = traverse_util.flatten_dict(state.to_pure_dict())
    plans = plan_stacks(model.cfg)
    used, fresh = set(), []
    new = {}
    for path, value in target.items():
        spath = tuple(str(p) for p in path)
        if spath[0] == "stacks":
            s, j, rest = int(spath[1]), int(spath[4]), spath[5:]
            names = [("layers", str(start + j)) + rest for start in plans[s].starts]
            # fresh layers keep this model's slices, taken on the host (no program compiled per slice shape)
            host = np.asarray(value) if any(name not in src for name in names) else None
            slices = []
            for u, name in enumerate(names):
                if name in src:
                    slices.append(_checked(src[name], value.shape[1:], name))
                    used.add(name)
                else:
                    slices.append(host[u])
                    fresh.append(name)
            new[path] = np.stack(slices).astype(value.dtype)
        elif spath in src:
            new[path] = _checked(src[spath], value.shape, spath).astype(value.dtype)
            used.add(spath)
        else:
            new[path] = value
            fresh.append(spath)
    nnx.replace_by_pure_dict(state, traverse_util.unflatten_dict(new))
    nnx.update(model, state)
    dropped = sorted(set(src) - used, key=_order)
    return [f"kept {len(used)} tensors", _summary("fresh (not in the checkpoint)", sorted(fresh, key=_order)),
            _summary("dropped (not in this model)", dropped)]


def _checked(x, shape, name):
    x = np.asarray(x)
    if x.shape != tuple(shape):
        raise ConfigError(f"init checkpoint tensor {'.'.join(name)} has shape {x.shape}, this model needs {shape}")
    return x


def _order(name):
    return tuple((0, int(p), "") if p.isdigit() else (1, 0, p) for p in name)


def _summary(what: str, names: list) -> str:
    if not names:
        return f"{what}: none"
    shown = ", ".join(".".join(n) for n in names[:8])
    return f"{what}: {len(names)} tensors: {shown}{' ...' if len(names) > 8 else ''}"
