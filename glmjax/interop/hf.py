"""Hugging Face checkpoint import/export for GLM-5 (`glm_moe_dsa`) and DeepSeek-V3.2 (`deepseek_v32`); import of the
dense MLA `deepseek_v3` with fresh lightning indexers (`fresh_init`), exported as `deepseek_v32`.

    model, layout = load_hf("path/to/GLM-5")              # config.json + *.safetensors (+ index json)
    save_hf(model, "out/", layout, max_shard_size="5GB")  # same key names, dtypes and expert layout

Import never materialises the model twice: the model is built abstractly (`nnx.eval_shape`), each target leaf is
allocated once directly in its target sharding, and the checkpoint is streamed shard by shard, tensor by tensor
(memory-mapped), each tensor written into its slot (unit / expert) of the target leaf with a donated in-place
update. Export streams the other way, one tensor at a time. Every missing, unexpected or mis-shaped tensor is
reported by name in one `HFCheckpointError`.

Handled: per-expert (`mlp.experts.{e}.*_proj.weight`, the hub layout) and fused (`mlp.experts.gate_up_proj`,
`mlp.experts.down_proj`, transformers-v5 layout) experts; bf16 / fp16 / fp32; FP8 e4m3 block-scaled weights with
`weight_scale_inv` (dequantised on import: each [128,128] block times its scale; exported dequantised, see
`save_hf`); IndexShare "shared" layers with no indexer weights (GLM-5.2) or with them (5.0/5.1-style weights under a
shared schedule: ignored with a note); the MTP layer at index num_hidden_layers (embedding/head shared with the
main model; DeepSeek's private `embed_tokens` / `shared_head.head` copies are verified against the shared weights).

CLI: glmjax-hf (glmjax/cli/hf.py) {inspect,import,export}.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import glob
import json
import logging
import math
import os
import re
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from glmjax.config import ConfigError, ModelConfig
from glmjax.interop import keymap
from glmjax.interop.keymap import Spec, config_from_hf, config_to_hf, plan_keys, to_hf, to_ours
from glmjax.interop.safetensors_io import DTYPES, Reader, TensorInfo, read_header, write_file
from glmjax.model import GLM
from glmjax.parallel.rules import logical_sharding  # noqa: F401  (re-exported: `sharding=` for load_hf)

log = logging.getLogger("glmjax.interop")

INDEX_FILE = "model.safetensors.index.json"
FLOAT_DTYPES = ("F32", "BF16", "F16", "F64")
_ROTARY = re.compile(r"(^|\.)rotary_emb\.inv_freq$")


class HFCheckpointError(ValueError):
    """A checkpoint that does not match the model: lists every missing, unexpected and mis-shaped tensor."""

    def __init__(self, missing: list[str], unexpected: list[str], mismatched: list[str], where: str = ""):
        self.missing, self.unexpected, self.mismatched = missing, unexpected, mismatched
        lines = [f"checkpoint {where} does not match the model:"]
        for title, items in (("missing", missing), ("unexpected", unexpected), ("mis-shaped / bad dtype", mismatched)):
            if items:
                lines.append(f"  {len(items)} {title}:")
                lines += [f"    {x}" for x in items]
        super().__init__("\n".join(lines))


@dataclasses.dataclass
class HFLayout:
    """What `load_hf` saw, so that `save_hf` writes the same layout back (JSON-serialisable)."""
    model_type: str
    config: dict  # the raw config.json
    keys: list  # [[key, dtype], ...] in source order (what export writes; excludes scales and ignored tensors)
    expert_layouts: dict  # layer index (str) -> "per_expert" | "fused" | "fused.weight"
    copies: dict = dataclasses.field(default_factory=dict)  # MTP private copy key -> shared key
    dequantized: list = dataclasses.field(default_factory=list)  # FP8 keys (exported dequantised)
    ignored: list = dataclasses.field(default_factory=list)  # present in the source, not loaded, not exported
    latent_norm_eps: float | None = keymap.HF_LATENT_NORM_EPS
    honour_rope_flags: bool = False
    overrides: dict = dataclasses.field(default_factory=dict)
    notes: list = dataclasses.field(default_factory=list)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=1)

    @classmethod
    def from_json(cls, s: str) -> "HFLayout":
        return cls(**json.loads(s))


# ------------------------------------------------------------------------------------------ shardings


ShardingSpec = Callable[[tuple, tuple | None, tuple], jax.sharding.Sharding] | jax.sharding.Sharding | None


def _resolve_sharding(sharding: ShardingSpec, path, var) -> jax.sharding.Sharding:
    if sharding is None:
        return jax.sharding.SingleDeviceSharding(jax.devices()[0])
    if isinstance(sharding, jax.sharding.Sharding):
        return sharding
    return sharding(path, var.get_metadata().get("out_sharding"), tuple(var.shape))


def _explicit_axes(x) -> tuple[str, ...]:
    mesh = jax.typeof(x).sharding.mesh
    return tuple(n for n, t in zip(mesh.axis_names, mesh.axis_types) if t == jax.sharding.AxisType.Explicit)


def _mesh_ctx(arr):
    """`auto_axes` needs the mesh in context: enter it for leaves on a mesh with Explicit axes."""
    sh = arr.sharding
    if isinstance(sh, jax.sharding.NamedSharding) and _explicit_axes(arr):
        return jax.set_mesh(sh.mesh)
    return contextlib.nullcontext()


def _in_auto_mode(fn, x, out_spec):
    """Run fn(x, ...) with x's Explicit mesh axes switched to Auto (slicing / updating one unit or expert of a
    sharded leaf has no sharding-in-types rule), producing out_spec."""
    axes = _explicit_axes(x)
    return jax.sharding.auto_axes(fn, axes=axes, out_sharding=out_spec) if axes else fn


@functools.lru_cache(maxsize=None)
def _put_fn(sharding):
    def put(buf, val, start):
        def dus(b, v):
            return jax.lax.dynamic_update_slice(b, v.astype(b.dtype), tuple(start[i] for i in range(b.ndim)))

        return _in_auto_mode(dus, buf, jax.typeof(buf).sharding.spec)(buf, val)

    return jax.jit(put, donate_argnums=0, out_shardings=sharding)


@functools.partial(jax.jit, static_argnums=2)
def _take(buf, start, sizes):
    def ds(b):
        return jax.lax.dynamic_slice(b, tuple(start[i] for i in range(b.ndim)), sizes)

    return _in_auto_mode(ds, buf, jax.sharding.PartitionSpec())(buf)


def _read_slab(arr: jax.Array, index: tuple[int, ...]) -> np.ndarray:
    sizes = (1,) * len(index) + tuple(arr.shape[len(index):])
    start = np.array(index + (0,) * (arr.ndim - len(index)), np.int32)
    with _mesh_ctx(arr):
        out = _take(arr, start, sizes)
    return np.asarray(jax.device_get(out)).reshape(sizes[len(index):])


# -------------------------------------------------------------------------------------------- reading


def scan_checkpoint(path: str) -> dict[str, TensorInfo]:
    """{key: TensorInfo} over the checkpoint's shards (index json if present, else every *.safetensors), in
    file then offset order. Headers only: nothing is loaded."""
    idx_path = os.path.join(path, INDEX_FILE)
    if os.path.exists(idx_path):
        with open(idx_path) as f:
            weight_map = json.load(f)["weight_map"]
        files = list(dict.fromkeys(weight_map.values()))
    else:
        weight_map = None
        files = sorted(os.path.basename(p) for p in glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"{path}: no *.safetensors files")
    out: dict[str, TensorInfo] = {}
    problems = []
    for fname in files:
        full = os.path.join(path, fname)
        if not os.path.exists(full):
            problems.append(f"{fname}: listed in {INDEX_FILE} but absent")
            continue
        entries, _ = read_header(full)
        for key, info in sorted(entries.items(), key=lambda kv: kv[1].begin):
            if key in out:
                problems.append(f"{key}: in both {os.path.basename(out[key].file)} and {fname}")
            elif weight_map is not None and weight_map.get(key) != fname:
                problems.append(f"{key}: in {fname} but {INDEX_FILE} maps it to {weight_map.get(key)!r}")
            else:
                out[key] = info
    if weight_map is not None:
        problems += [f"{k}: listed in {INDEX_FILE} ({f}) but not in that file"
                     for k, f in weight_map.items() if k not in out and os.path.exists(os.path.join(path, f))]
    if problems:
        raise HFCheckpointError([], [], problems, path)
    return out


def dequantize_fp8(w: np.ndarray, scale_inv: np.ndarray, block: tuple[int, int]) -> np.ndarray:
    """FP8 block-scaled weight [out, in] + scales [ceil(out/bo), ceil(in/bi)] -> float32: every bo x bi block times
    its scale (DeepSeek's `weight_dequant` multiplies, despite the name)."""
    bo, bi = block
    out_f, in_f = w.shape
    ob, ib = scale_inv.shape
    x = np.zeros((ob * bo, ib * bi), np.float32)
    x[:out_f, :in_f] = w.astype(np.float32)
    x = x.reshape(ob, bo, ib, bi) * scale_inv.astype(np.float32)[:, None, :, None]
    return x.reshape(ob * bo, ib * bi)[:out_f, :in_f]


def _abstract_model(cfg: ModelConfig):
    model = nnx.eval_shape(lambda: GLM(cfg, nnx.Rngs(0)))
    graphdef, state = nnx.split(model)
    return graphdef, dict(nnx.to_flat_state(state))


def fresh_init(cfg: ModelConfig, paths) -> dict:
    """The model initialiser's values (seed 0) of the leaves `paths` only: one jitted initialiser whose other outputs
    XLA drops, so the rest of the model is never created."""
    if not paths:
        return {}

    paths = sorted(paths, key=str)

    def init():
        flat = dict(nnx.to_flat_state(nnx.state(GLM(cfg, nnx.Rngs(0)))))
        return [flat[p].get_value() for p in paths]

    return dict(zip(paths, jax.jit(init)()))


def _classify(cfg: ModelConfig, tensors: Mapping[str, TensorInfo], specs: Mapping[str, Spec],
              block: tuple[int, int] | None):
    """-> (missing, unexpected, mismatched, ignored (key, reason), scales {weight key: scale key}, copies)."""
    N = cfg.num_hidden_layers
    types = cfg.layer_indexer_types
    missing = [k for k in specs if k not in tensors]
    unexpected, mismatched, ignored, scales, copies = [], [], [], {}, {}
    for key, info in tensors.items():
        if key in specs:
            spec = specs[key]
            if info.shape != spec.shape:
                mismatched.append(f"{key}: shape {list(info.shape)}, expected {list(spec.shape)}")
            if info.dtype == "F8_E4M3":
                skey = key[:-len("weight")] + "weight_scale_inv" if key.endswith(".weight") else None
                if block is None or skey not in tensors or len(info.shape) != 2:
                    mismatched.append(f"{key}: float8 weight without a 2-D block scale `weight_scale_inv` and a "
                                      "quantization_config.weight_block_size")
                else:
                    want = tuple(-(-n // b) for n, b in zip(info.shape, block))
                    if tensors[skey].shape != want:
                        mismatched.append(f"{skey}: shape {list(tensors[skey].shape)}, expected {list(want)} "
                                          f"(blocks {list(block)} of {list(info.shape)})")
                    scales[key] = skey
            elif info.dtype not in FLOAT_DTYPES:
                mismatched.append(f"{key}: dtype {info.dtype} (expected a float type)")
            continue
        base = key[:-len("_scale_inv")]
        if key.endswith(".weight_scale_inv") and base in specs and base in tensors \
                and tensors[base].dtype == "F8_E4M3":
            continue  # consumed with its weight
        m = re.match(r"model\.layers\.(\d+)\.(.*)$", key)
        li, rest = (int(m.group(1)), m.group(2)) if m else (None, None)
        if _ROTARY.search(key):
            ignored.append((key, "rotary buffer"))
        elif li is not None and li < N and types[li] == "shared" and rest.startswith(keymap.INDEXER_SUFFIX):
            ignored.append((key, f"indexer weights of IndexShare 'shared' layer {li} (5.0/5.1-style checkpoint)"))
        elif li == N and not cfg.has_mtp:
            ignored.append((key, "MTP layer weights, but the model has no MTP layer"))
        elif li == N and rest in keymap.MTP_COPIES:
            src = keymap.MTP_COPIES[rest]
            if info.shape != specs[src].shape:
                mismatched.append(f"{key}: shape {list(info.shape)}, expected {list(specs[src].shape)} (copy of {src})")
            else:
                copies[key] = src
        else:
            unexpected.append(key)
    return missing, unexpected, mismatched, ignored, scales, copies


def _read_checkpoint(path, latent_norm_eps, honour_rope_flags, overrides):
    """config.json + the tensor index of a checkpoint directory -> (raw config, ModelConfig, notes, tensors).
    A config with an MTP layer but no model.layers.{N}.* tensors (e.g. from save_pretrained) gives no MTP."""
    with open(os.path.join(path, "config.json")) as f:
        raw = json.load(f)
    cfg, notes = config_from_hf(raw, latent_norm_eps=latent_norm_eps, honour_rope_flags=honour_rope_flags,
                                overrides=overrides)
    tensors = scan_checkpoint(path)
    N = cfg.num_hidden_layers
    if cfg.has_mtp and not any(k.startswith(keymap.layer_prefix(N)) for k in tensors):
        cfg = cfg.replace(num_nextn_predict_layers=0)
        notes.append(f"config has num_nextn_predict_layers=1 but the checkpoint has no model.layers.{N}.* tensors: "
                     "model built without the MTP layer")
    return raw, cfg, notes, tensors


def load_hf(path: str, *, sharding: ShardingSpec = None, latent_norm_eps: float | None = keymap.HF_LATENT_NORM_EPS,
            honour_rope_flags: bool = False, overrides: Mapping[str, Any] | None = None) -> tuple[GLM, HFLayout]:
    """Import an HF checkpoint directory into a GLM model -> (model, layout).

    sharding: None (first device), one Sharding for every leaf, or `fn(path, logical_axes, shape) -> Sharding`
      (e.g. `logical_sharding(mesh, rules)`); each leaf is allocated once in it and filled slice by slice.
    latent_norm_eps: eps of q_a_layernorm / kv_a_layernorm. Default 1e-6 = HF transformers' value (it builds these
      norms with the RMSNorm default, docs/model.md F-4), so imported models reproduce `from_pretrained`; pass None for
      rms_norm_eps (Megatron / vLLM / SGLang; 1e-5 for GLM-5).
    honour_rope_flags: False (default) -> the RoPE layouts transformers computes, which ignores config.json's
      `rope_interleave` / `indexer_rope_interleave` (a warning names each flag overruled); True -> the flags as
      written, for checkpoints trained with them honoured (vLLM / SGLang read them; docs/model.md F-1).
    overrides: ModelConfig fields set after mapping config.json (dtype, param_dtype, mtp_depth, block_q, ...).
    """
    raw, cfg, notes, tensors = _read_checkpoint(path, latent_norm_eps, honour_rope_flags, overrides)
    N = cfg.num_hidden_layers
    graphdef, leaves = _abstract_model(cfg)
    leaf_shapes = {p: tuple(v.shape) for p, v in leaves.items()}
    n_layers = N + (1 if cfg.has_mtp else 0)
    layouts = {i: keymap.detect_expert_layout(tensors, i) for i in range(cfg.first_k_dense_replace, n_layers)}
    specs = plan_keys(cfg, leaf_shapes, layouts)
    block = keymap.fp8_block(raw)
    missing, unexpected, mismatched, ignored, scales, copies = _classify(cfg, tensors, specs, block)
    fresh = [k for k in missing if keymap.INDEXER_SUFFIX in k] if raw["model_type"] in keymap.DENSE_MLA else []
    unbiased = [k for k in missing if k.endswith(keymap.ROUTER_BIAS)] if cfg.scoring_func == "softmax" else []
    missing = [k for k in missing if k not in fresh and k not in unbiased]
    if missing or unexpected or mismatched:
        raise HFCheckpointError(missing, unexpected, mismatched, path)
    if unbiased:
        notes.append(f"{len(unbiased)} router correction biases start at 0 ({cfg.scoring_func} routing has none in "
                     f"the checkpoint), e.g. {unbiased[0]}")
    fresh_leaves = {part.leaf for k in fresh for part in specs[k].parts}
    if fresh:
        notes.append(f"{len(fresh)} indexer tensors ({len(fresh_leaves)} stacked parameters) are fresh (not in this "
                     f"dense checkpoint: the model's initialiser, seed 0), e.g. {fresh[0]}")
    if ignored:
        reasons = dict.fromkeys(r for _, r in ignored)
        for r in reasons:
            ks = [k for k, rr in ignored if rr == r]
            notes.append(f"ignored {len(ks)} tensors ({r}), e.g. {ks[0]}")
    covered = {p: 0 for p in leaves}
    for spec in specs.values():
        for part in spec.parts:
            covered[part.leaf] += math.prod(keymap.slab_shape(leaf_shapes[part.leaf], part))
    short = [p for p, n in covered.items() if n != math.prod(leaf_shapes[p])]
    assert not short, f"key map does not cover the model exactly: {short}"  # internal consistency

    # allocate every leaf once, in its target sharding (the fresh ones initialised)
    init = fresh_init(cfg, fresh_leaves)
    arrays = {}
    for p, v in leaves.items():
        arrays[p] = jax.device_put(init[p], _resolve_sharding(sharding, p, v)) if p in init else \
            jnp.zeros(v.shape, v.dtype, device=_resolve_sharding(sharding, p, v))
    lossy = set()
    by_file: dict[str, list[str]] = {}
    for key, info in tensors.items():
        if key in specs:
            by_file.setdefault(info.file, []).append(key)
    with Reader() as reader:
        for fname, keys in by_file.items():
            for key in keys:
                spec, info = specs[key], tensors[key]
                x = reader.get(info)
                if key in scales:
                    x = dequantize_fp8(x, reader.get(tensors[scales[key]]), block)
                for part in spec.parts:
                    slab = keymap.slab_shape(leaf_shapes[part.leaf], part)
                    val = np.ascontiguousarray(to_ours(x, part, slab))
                    tgt = arrays[part.leaf]
                    if not _exact(val.dtype, np.dtype(tgt.dtype)):
                        lossy.add(key)
                    start = np.array(part.index + (0,) * len(slab), np.int32)
                    val = val.reshape((1,) * len(part.index) + slab)
                    with _mesh_ctx(tgt):
                        arrays[part.leaf] = _put_fn(tgt.sharding)(tgt, val, start)
                del x
            reader.close(fname)
        for ckey, src in copies.items():
            diff = _compare_copy(reader.get(tensors[ckey]), specs[src], arrays, leaf_shapes)
            if diff:
                notes.append(f"{ckey} differs from {src} ({diff}); the model shares {src}; export writes it as the "
                             "copy")
            else:
                notes.append(f"{ckey}: identical copy of {src} (shared in the model, re-exported as a copy)")
    if lossy:
        notes.append(f"{len(lossy)} tensors were rounded to param_dtype={cfg.param_dtype} (export will not be "
                     f"bit-exact), e.g. {sorted(lossy)[0]}")
    state = nnx.from_flat_state([(p, v.replace(arrays[p])) for p, v in leaves.items()])
    model = nnx.merge(graphdef, state)
    for n in notes:
        log.info("%s", n)
    fp8_out = "BF16"
    layout = HFLayout(
        model_type=raw["model_type"], config=raw,
        keys=[[k, fp8_out if k in scales else tensors[k].dtype] for k in tensors if k in specs or k in copies],
        expert_layouts={str(i): v for i, v in layouts.items()}, copies=copies, dequantized=sorted(scales),
        ignored=[k for k, _ in ignored], latent_norm_eps=latent_norm_eps, honour_rope_flags=honour_rope_flags,
        overrides=dict(overrides or {}),
        notes=notes)
    return model, layout


def _exact(src: np.dtype, dst: np.dtype) -> bool:
    """Every value of src is representable in dst."""
    return src == dst or (dst == np.float32 and src in (DTYPES["BF16"], DTYPES["F16"]))


def _compare_copy(copy: np.ndarray, spec: Spec, arrays, leaf_shapes, rows: int = 4096) -> str:
    """'' if an MTP private copy [V, D] equals the shared tensor, else a description. Row-chunked."""
    part = spec.parts[0]
    arr = arrays[part.leaf]
    V = copy.shape[0]
    worst = 0.0
    for r0 in range(0, V, rows):
        r1 = min(V, r0 + rows)
        with _mesh_ctx(arr):
            if part.kind == "copy":  # embed [V, D]
                ours = np.asarray(_take(arr, np.array([r0, 0], np.int32), (r1 - r0, arr.shape[1])))
            else:  # lm_head kernel [D, V]
                ours = np.asarray(_take(arr, np.array([0, r0], np.int32), (arr.shape[0], r1 - r0))).T
        ref = copy[r0:r1].astype(ours.dtype)
        if not np.array_equal(ours, ref):
            worst = max(worst, float(np.max(np.abs(ours.astype(np.float32) - ref.astype(np.float32)))))
    return f"max abs diff {worst:g}" if worst else ""


def check_hf(path: str, *, latent_norm_eps: float | None = keymap.HF_LATENT_NORM_EPS, honour_rope_flags: bool = False,
             overrides: Mapping[str, Any] | None = None) -> tuple[ModelConfig, list[str]]:
    """Validate names, shapes and dtypes without loading anything -> (ModelConfig, notes); raises
    HFCheckpointError listing every problem. Arguments as in `load_hf`."""
    raw, cfg, notes, tensors = _read_checkpoint(path, latent_norm_eps, honour_rope_flags, overrides)
    N = cfg.num_hidden_layers
    _, leaves = _abstract_model(cfg)
    n_layers = N + (1 if cfg.has_mtp else 0)
    layouts = {i: keymap.detect_expert_layout(tensors, i) for i in range(cfg.first_k_dense_replace, n_layers)}
    specs = plan_keys(cfg, {p: tuple(v.shape) for p, v in leaves.items()}, layouts)
    missing, unexpected, mismatched, ignored, _, _ = _classify(cfg, tensors, specs, keymap.fp8_block(raw))
    if missing or unexpected or mismatched:
        raise HFCheckpointError(missing, unexpected, mismatched, path)
    return cfg, notes + [f"ignored {k} ({r})" for k, r in ignored]


# -------------------------------------------------------------------------------------------- writing


def parse_size(s: int | str) -> int:
    """5000000, "5GB" (10^9), "5GiB" (2^30), "200KB", "1.5MB"."""
    if isinstance(s, int):
        return s
    m = re.fullmatch(r"\s*([\d.]+)\s*([KMGT]?)(i?)B?\s*", str(s), re.IGNORECASE)
    if not m:
        raise ValueError(f"max_shard_size={s!r}: expected bytes or e.g. '5GB', '500MiB'")
    base = 1024 if m.group(3) else 1000
    return int(float(m.group(1)) * base ** "_KMGT".index((m.group(2) or "_").upper()))


def save_hf(model: GLM, path: str, layout: HFLayout | None = None, *, model_type: str = "glm_moe_dsa",
            dtype: str = "BF16", max_shard_size: int | str = "5GB", overwrite: bool = False) -> list[str]:
    """Export to an HF checkpoint directory -> list of files written.

    With the `layout` returned by `load_hf`: the same key names, order, dtypes, expert layout, MTP copies and
    config.json as the source, so export(import(x)) reproduces every bf16/fp16/fp32 tensor of x bit-exactly
    (with param_dtype float32, or param_dtype equal to the source dtype). FP8 sources are exported *dequantised*
    (bf16, no weight_scale_inv, no quantization_config). Tensors the import ignored are not written.
    Without a layout: canonical order, `dtype` for every tensor (e_score_correction_bias float32), per-expert
    experts, config.json generated for `model_type`.
    Files are written under temporary names and renamed; an existing checkpoint is never overwritten unless
    overwrite=True. Shards hold at most max_shard_size bytes (a larger single tensor gets its own shard).
    """
    cfg = model.cfg
    graphdef, state = nnx.split(model)
    arrays = {p: v[...] for p, v in nnx.to_flat_state(state)}
    leaf_shapes = {p: tuple(a.shape) for p, a in arrays.items()}
    os.makedirs(path, exist_ok=True)
    existing = glob.glob(os.path.join(path, "*.safetensors")) + glob.glob(os.path.join(path, INDEX_FILE))
    if existing and not overwrite:
        raise FileExistsError(f"{path} already holds a checkpoint ({os.path.basename(existing[0])}); pass "
                              "overwrite=True to replace it")
    notes = []
    if layout is not None:
        layouts = {int(i): v for i, v in layout.expert_layouts.items()}
        specs = plan_keys(cfg, leaf_shapes, layouts)
        order = [(k, dt) for k, dt in layout.keys]
        copies = dict(layout.copies)
        wanted = set(specs) | set(copies)
        known = {k for k, _ in order}
        if known != wanted:
            notes.append(f"model differs from the layout ({len(wanted - known)} new, {len(known - wanted)} gone "
                         "tensors): new ones appended in canonical order, in the source's dtype")
            source_dtype = dict(order).get("model.embed_tokens.weight", dtype)
            order = [(k, dt) for k, dt in order if k in wanted] + [
                (k, _default_dtype(k, source_dtype)) for k in specs if k not in known]
        hf_config = _layout_config(layout, cfg, notes)
    else:
        specs = plan_keys(cfg, leaf_shapes, {})
        order = [(k, _default_dtype(k, dtype)) for k in specs]
        copies = {}
        hf_config = config_to_hf(cfg, model_type, dtype={"BF16": "bfloat16", "F32": "float32",
                                                         "F16": "float16"}[dtype])
    if abs(cfg.latent_norm_eps - keymap.HF_LATENT_NORM_EPS) > 0:
        notes.append(f"latent_norm_eps={cfg.latent_norm_eps}: HF transformers builds q_a/kv_a_layernorm with "
                     f"eps {keymap.HF_LATENT_NORM_EPS} (config.json cannot express it)")

    def shape_of(k):
        return specs[copies.get(k, k)].shape

    def produce(k, dt):
        spec = specs[copies.get(k, k)]
        pieces = [_read_slab(arrays[p.leaf], p.index) for p in spec.parts]
        x = to_hf(pieces, spec.parts)
        return np.ascontiguousarray(x.astype(DTYPES[dt]))

    limit = parse_size(max_shard_size)
    shards, cur, size = [], [], 0
    for k, dt in order:
        nbytes = math.prod(shape_of(k)) * DTYPES[dt].itemsize
        if cur and size + nbytes > limit:
            shards.append(cur)
            cur, size = [], 0
        cur.append((k, dt))
        size += nbytes
    if cur:
        shards.append(cur)
    names = (["model.safetensors"] if len(shards) == 1 else
             [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
    weight_map, total = {}, 0
    dts = dict(order)
    for name, shard in zip(names, shards):
        total += write_file(os.path.join(path, name), [(k, dt, shape_of(k)) for k, dt in shard],
                            lambda k: produce(k, dts[k]), {"format": "pt"})
        weight_map.update({k: name for k, _ in shard})
    written = list(names)
    if len(shards) > 1:
        _write_json(os.path.join(path, INDEX_FILE), {"metadata": {"total_size": total}, "weight_map": weight_map})
        written.append(INDEX_FILE)
    _write_json(os.path.join(path, "config.json"), hf_config)
    written.append("config.json")
    for n in notes:
        log.info("%s", n)
    return written


def _default_dtype(key: str, dtype: str) -> str:
    return "F32" if key.endswith("e_score_correction_bias") else dtype


def _layout_config(layout: HFLayout, cfg: ModelConfig, notes: list) -> dict:
    """The source config.json, unless the model's architecture changed since import (then a generated one); a dense
    MLA source (keymap.DENSE_MLA) is written in its family's DSA format, with the model's indexers."""
    raw = dict(layout.config)
    if layout.dequantized:
        raw.pop("quantization_config", None)
        notes.append("FP8 source: weights exported dequantised (bf16); quantization_config removed")
    if layout.model_type in keymap.DENSE_MLA:
        target = keymap.DENSE_MLA[layout.model_type]
        if target is None:
            raise ConfigError(f"{layout.model_type} source: no DSA format in transformers has its router "
                              f"(scoring_func={cfg.scoring_func!r}, topk_method={cfg.topk_method!r}); nothing written")
        notes.append(f"{layout.model_type} source: written as {target} (the DSA format of its family), with the "
                     "indexers")
        return config_to_hf(cfg, target, dtype=raw.get("dtype") or raw.get("torch_dtype") or "bfloat16")
    src, _, _ = keymap.map_config(layout.config, latent_norm_eps=layout.latent_norm_eps,
                                  honour_rope_flags=layout.honour_rope_flags, overrides=layout.overrides)
    ignore = {"num_nextn_predict_layers"}  # an absent MTP layer is recorded by the keys, not the config
    diff = [f.name for f in dataclasses.fields(ModelConfig)
            if f.name not in ignore and getattr(src, f.name) != getattr(cfg, f.name)]
    if diff:
        notes.append(f"model config differs from the source config.json in {diff}: config.json regenerated")
        return config_to_hf(cfg, layout.model_type)
    return raw


def _write_json(path: str, obj) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=2)
        f.write("\n")
    os.replace(tmp, path)
