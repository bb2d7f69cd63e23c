"""Initialising a model from another run's weights: any checkpoint directory of glmjax/resolve.py (a stage or PPO
workdir, an import, a Hugging Face checkpoint); the parameter surgery between stages is
`glmjax.train.stages.surgery`."""
from __future__ import annotations

import json
import os

from flax import nnx, traverse_util
from jax.sharding import NamedSharding, PartitionSpec as P

from glmjax.config import ModelConfig
from glmjax.model.transformer import GLM
from glmjax.resolve import load, locate
from glmjax.train.stages import surgery


def init_model(model: GLM, path: str) -> list[str]:
    """Initialise `model` in place from `path`: any checkpoint directory `glmjax.resolve.locate` knows (a stage or
    PPO workdir, an import, a Hugging Face checkpoint), each tensor read into the model's placement. -> log lines."""
    src = locate(path, "init_from")
    overrides = fresh_indexer_shape(src.path, model.cfg) if src.kind == "hf" else None
    loaded = load(src, sharding=placed_like(model), hf_overrides=overrides)
    return [loaded.where] + surgery(model, loaded.state, loaded.cfg)


def placed_like(model: GLM):
    """A `restore_target` sharding rule for a checkpoint that initialises `model` (of any mesh, any device count):
    a tensor at a path of the model with the same shape goes where the model's does (its mesh, its rule), any other
    (one surgery reshapes or drops) replicated on the model's mesh."""
    leaves = {tuple(map(str, k)): x for k, x in traverse_util.flatten_dict(nnx.state(model).to_pure_dict()).items()}
    first = next(iter(leaves.values())).sharding
    other = NamedSharding(first.mesh, P()) if isinstance(first, NamedSharding) else first

    def rule(path, shape):
        x = leaves.get(path)
        return x.sharding if x is not None and tuple(x.shape) == tuple(shape) else other

    return rule


def fresh_indexer_shape(hf_dir: str, cfg: ModelConfig) -> dict | None:
    """A dense MLA checkpoint (keymap.DENSE_MLA: no indexer in it) gets fresh indexers of this model's shape, not
    DeepSeek-V3.2's default: -> the overrides for load_hf (None for a checkpoint with indexers)."""
    from glmjax.interop import keymap

    with open(os.path.join(hf_dir, "config.json")) as f:
        model_type = json.load(f).get("model_type")
    if model_type not in keymap.DENSE_MLA:
        return None
    return {k: getattr(cfg, k) for k in ("index_n_heads", "index_head_dim", "index_topk")}


def checkpoint_loader(cfg: ModelConfig):
    """-> load(path, target_state) -> state: `target_state` (a GLM of `cfg`) overwritten from `path` (see
    `init_model`: a stage workdir, an imported or a Hugging Face checkpoint), for the PPO stage's init_checkpoint."""
    def load(path: str, target_state):
        model = GLM(cfg, nnx.Rngs(0))
        nnx.update(model, target_state)
        for line in init_model(model, path):
            print(f"init_checkpoint {path}: {line}")
        return nnx.state(model)

    return load
