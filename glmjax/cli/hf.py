"""glmjax-hf (or `python -m glmjax.cli.hf`): Hugging Face checkpoints in and out (glmjax/interop/hf.py does the work).

  glmjax-hf inspect HF_DIR            # validate names / shapes / dtypes, print the ModelConfig; loads nothing
  glmjax-hf import  HF_DIR CKPT_DIR   # -> CKPT_DIR/{state/ (orbax), model_config.json, hf_layout.json}
  glmjax-hf export  SRC HF_DIR        # SRC: an import, a stage or PPO workdir, a PPO run's policy/ (glmjax/resolve.py)

export writes the source's key names, dtypes and config.json when it has an hf_layout.json (an import), or those of
--layout IMPORT_DIR (e.g. the import a training run started from). Errors end in one line on stderr (a checkpoint
that does not match the model: one line per tensor) and exit status 2 (3: no intact checkpoint, a damaged file).
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys

from flax import nnx

from glmjax.cli.runtime import configure_jax
from glmjax.config import ConfigError
from glmjax.interop import keymap
from glmjax.interop.hf import HFLayout, check_hf, load_hf, save_hf
from glmjax.model import GLM
from glmjax.resolve import build, load, write_import
from glmjax.workdir import CheckpointError


def _parse_overrides(items: list[str]) -> dict:
    out = {}
    for item in items or []:
        k, _, v = item.partition("=")
        try:
            out[k] = json.loads(v)
        except json.JSONDecodeError:
            out[k] = v
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="glmjax-hf", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--latent-norm-eps", default=str(keymap.HF_LATENT_NORM_EPS),
                        help="eps of q_a/kv_a_layernorm: a number (default 1e-6 = HF) or 'rms_norm_eps'")
    common.add_argument("--set", action="append", metavar="FIELD=VALUE",
                        help="override a ModelConfig field (JSON value), e.g. --set param_dtype=bfloat16")
    common.add_argument("--honour-rope-flags", action="store_true",
                        help="use config.json's rope_interleave / indexer_rope_interleave (vLLM / SGLang) instead of "
                             "the layouts transformers computes, which ignores them")
    p = sub.add_parser("inspect", parents=[common], help="validate names/shapes/dtypes, print the ModelConfig")
    p.add_argument("hf_dir")
    p = sub.add_parser("import", parents=[common], help="HF checkpoint -> glmjax checkpoint (orbax + json)")
    p.add_argument("hf_dir")
    p.add_argument("out_dir")
    p.add_argument("--overwrite", action="store_true", help="replace an import already in out_dir")
    p = sub.add_parser("export", help="glmjax checkpoint (from `import` or training) -> HF checkpoint")
    p.add_argument("ckpt_dir", help="a directory from `import` (model_config.json, state/, hf_layout.json), a "
                   "stage or PPO workdir (its newest intact checkpoint; a PPO workdir without checkpoints/: its "
                   "policy/) or a PPO run's policy/ (glmjax/resolve.py)")
    p.add_argument("hf_dir")
    p.add_argument("--layout", default=None, metavar="IMPORT_DIR",
                   help="write the key names, dtypes and config.json of this import's source (its hf_layout.json); "
                   "a deepseek_v3 source is written as deepseek_v32")
    p.add_argument("--model-type", default="glm_moe_dsa", choices=keymap.MODEL_TYPES,
                   help="without hf_layout.json")
    p.add_argument("--dtype", default="BF16", choices=("BF16", "F32", "F16"), help="without hf_layout.json")
    p.add_argument("--max-shard-size", default="5GB")
    p.add_argument("--overwrite", action="store_true")
    for sp in sub.choices.values():
        sp.add_argument("--compilation-cache", default=None, help="JAX's persistent compilation cache (default: "
                        "~/.cache/glmjax/jax_cache, see glmjax/cli/runtime.py); empty = off")
    args = ap.parse_args(argv)
    configure_jax(args.compilation_cache)
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    try:
        return run(args)
    except CheckpointError as e:  # SafetensorsFormatError (a damaged file) is one
        print(f"checkpoint error: {e}", file=sys.stderr)
        return 3
    except (FileNotFoundError, ValueError) as e:  # ConfigError, HFCheckpointError
        print(f"error: {e}", file=sys.stderr)
        return 2


def run(args) -> int:
    """The parsed command -> exit status."""
    if args.cmd == "export":
        model, layout = export_model(args.ckpt_dir, args.layout)
        files = save_hf(model, args.hf_dir, layout, model_type=args.model_type, dtype=args.dtype,
                        max_shard_size=args.max_shard_size, overwrite=args.overwrite)
        print(f"exported {args.ckpt_dir} -> {args.hf_dir}: {', '.join(files)}")
        return 0
    eps = None if args.latent_norm_eps == "rms_norm_eps" else float(args.latent_norm_eps)
    overrides = _parse_overrides(args.set)
    if args.cmd == "inspect":
        cfg, notes = check_hf(args.hf_dir, latent_norm_eps=eps, honour_rope_flags=args.honour_rope_flags,
                              overrides=overrides)
        print(json.dumps(cfg.to_json_dict(), indent=1))
        for n in notes:
            print("note:", n)
        return 0
    if os.path.exists(os.path.join(args.out_dir, "state")) and not args.overwrite:
        raise ConfigError(f"{args.out_dir} already holds an import (state/); --overwrite replaces it")
    model, layout = load_hf(args.hf_dir, latent_norm_eps=eps, honour_rope_flags=args.honour_rope_flags,
                            overrides=overrides)
    write_import(args.out_dir, nnx.state(model), model.cfg, layout)
    print(f"imported {args.hf_dir} -> {args.out_dir}")
    return 0


def export_model(path: str, layout_dir: str | None = None) -> tuple[GLM, HFLayout | None]:
    """What `export` writes for `path` (any directory `glmjax.resolve.locate` knows) -> (model, layout): an import's
    hf_layout.json, else none. layout_dir: an import directory whose hf_layout.json (the source's key names, dtypes,
    expert layout, config.json) is used instead, e.g. the import a training run started from."""
    loaded = load(path, "ckpt_dir")
    layout = loaded.layout
    if layout_dir is not None:
        lpath = os.path.join(layout_dir, "hf_layout.json")
        if not os.path.exists(lpath):
            raise FileNotFoundError(f"--layout {layout_dir}: no hf_layout.json (written by `glmjax-hf import`)")
        with open(lpath) as f:
            layout = HFLayout.from_json(f.read())
    return build(loaded), layout


if __name__ == "__main__":
    sys.exit(main())
