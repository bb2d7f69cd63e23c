"""Where a model's weights come from: the one resolver of a checkpoint directory, for every command that reads one
(train.py's init_from and ppo.init_checkpoint, glmjax-generate, glmjax-hf export, the tools). `locate` names the
kind of a directory, trying in this order:

  workdir  a stage or PPO workdir (checkpoints/): its newest intact checkpoint (glmjax/workdir.py); a PPO run's
           holds its policy
  import   a directory written by `glmjax-hf import` (model_config.json, state/, hf_layout.json), or a PPO run's
           policy/ (also found from the PPO workdir when it has no checkpoints/)
  hf       a Hugging Face checkpoint (config.json with a model_type, safetensors)

`load` reads it onto any device count and mesh, whatever mesh wrote it: `sharding` ((key path, shape) -> Sharding,
e.g. `glmjax.train.init_from.placed_like`) places each tensor as it is read; None -> the first local device.
"""
from __future__ import annotations

import dataclasses
import json
import os

import jax
import orbax.checkpoint as ocp
from flax import nnx

from glmjax.config import ModelConfig
from glmjax.interop.hf import HFLayout, load_hf
from glmjax.model import GLM
from glmjax.workdir import load_model_state, restore_target

KINDS = "a stage or PPO workdir (checkpoints/), a directory from `glmjax-hf import` or a PPO run's policy/ " \
        "(model_config.json), or a Hugging Face checkpoint (config.json)"


@dataclasses.dataclass(frozen=True)
class Source:
    kind: str  # "workdir" | "import" | "hf"
    path: str  # the directory read (a PPO workdir's policy/ for its policy)


@dataclasses.dataclass
class Loaded:
    state: dict  # the model's complete state: a nested dict of arrays (nnx's pure dict), placed by `sharding`
    cfg: ModelConfig
    layout: HFLayout | None  # an import's hf_layout.json (what export writes back); None for the other kinds
    where: str  # for logs: "stage sft, step 40", "imported weights", "a Hugging Face checkpoint"


def locate(path: str, flag: str = "checkpoint") -> Source:
    """The kind of checkpoint directory `path` is (module doc) -> Source. FileNotFoundError naming `flag` (the
    option that gave the path) for anything else."""
    def has(*parts):
        return os.path.exists(os.path.join(path, *parts))

    if not os.path.isdir(path):
        raise FileNotFoundError(f"{flag}={path!r}: no such directory")
    if has("checkpoints"):
        return Source("workdir", path)
    for d in (path, os.path.join(path, "policy")):
        if os.path.exists(os.path.join(d, "model_config.json")):
            return Source("import", d)
    if has("config.json"):
        try:
            with open(os.path.join(path, "config.json")) as f:
                hf = "model_type" in json.load(f)
        except (OSError, ValueError, TypeError):
            hf = False
        if hf:
            return Source("hf", path)
        raise FileNotFoundError(f"{flag}={path!r}: its config.json is not a Hugging Face config (no model_type); a "
                                "training workdir that has written no checkpoint yet has no checkpoints/")
    raise FileNotFoundError(f"{flag}={path!r}: neither {KINDS}")


def load(path: str | Source, flag: str = "checkpoint", *, sharding=None, hf_overrides: dict | None = None) -> Loaded:
    """The model state `path` holds (a Source, or a directory for `locate`), placed by `sharding` (module doc).
    hf_overrides: ModelConfig fields for a Hugging Face checkpoint (`load_hf`'s overrides)."""
    src = path if isinstance(path, Source) else locate(path, flag)
    if src.kind == "workdir":
        state, meta, step = load_model_state(src.path, sharding=sharding)
        return Loaded(state, ModelConfig.from_dict(meta["model"]), None, f"stage {meta.get('stage')}, step {step}")
    if src.kind == "import":
        return _load_import(src.path, sharding)
    put = None if sharding is None else (lambda p, axes, shape: sharding(tuple(map(str, p)), shape))
    model, _ = load_hf(src.path, sharding=put, overrides=hf_overrides)
    return Loaded(nnx.state(model).to_pure_dict(), model.cfg, None, "a Hugging Face checkpoint")


def load_model(path: str | Source, flag: str = "checkpoint") -> tuple[GLM, Loaded]:
    """The model `path` holds, on the first local device -> (model, what `load` read)."""
    loaded = load(path, flag)
    return build(loaded), loaded


def build(loaded: Loaded) -> GLM:
    """A GLM of the checkpoint's own config holding its state (every leaf is in a complete checkpoint)."""
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: GLM(loaded.cfg, nnx.Rngs(0))))
    nnx.replace_by_pure_dict(abstract, loaded.state)
    return nnx.merge(graphdef, abstract)


def _load_import(directory: str, sharding) -> Loaded:
    """model_config.json + state/ (an orbax save of the model's nnx.State: each leaf under a "value" key) +
    hf_layout.json when the directory came from a Hugging Face import."""
    with open(os.path.join(directory, "model_config.json")) as f:
        cfg = ModelConfig.from_dict(json.load(f))
    item = os.path.abspath(os.path.join(directory, "state"))
    rule = None if sharding is None else (lambda p, shape: sharding(p[:-1] if p[-1:] == ("value",) else p, shape))
    with ocp.StandardCheckpointer() as ck:
        state = _pure(ck.restore(item, restore_target(item, rule)))
    layout = None
    if os.path.exists(os.path.join(directory, "hf_layout.json")):
        with open(os.path.join(directory, "hf_layout.json")) as f:
            layout = HFLayout.from_json(f.read())
    return Loaded(state, cfg, layout, "imported weights")


def write_import(directory: str, state, cfg: ModelConfig, layout: HFLayout | None = None) -> None:
    """Write the import kind (module doc): `glmjax-hf import`, a PPO run's policy/. Replaces what is there (a stale
    hf_layout.json included). Every process saves its part of the arrays; process 0 writes the JSON files."""
    os.makedirs(directory, exist_ok=True)
    with ocp.StandardCheckpointer() as ck:
        ck.save(os.path.abspath(os.path.join(directory, "state")), state, force=True)
    if jax.process_index() != 0:
        return
    files = {"model_config.json": json.dumps(cfg.to_json_dict(), indent=1)}
    if layout is not None:
        files["hf_layout.json"] = layout.to_json()
    elif os.path.exists(os.path.join(directory, "hf_layout.json")):
        os.remove(os.path.join(directory, "hf_layout.json"))
    for name, text in files.items():
        tmp = os.path.join(directory, f"{name}.tmp{os.getpid()}")
        with open(tmp, "w") as f:
            f.write(text + "\n")
        os.replace(tmp, os.path.join(directory, name))


def _pure(tree):
    """A restored nnx.State ({"value": leaf} per variable) -> nnx's pure dict (the leaf itself)."""
    if isinstance(tree, dict):
        if tree.keys() == {"value"} and not isinstance(tree["value"], dict):
            return tree["value"]
        return {k: _pure(v) for k, v in tree.items()}
    return tree
