"""Hugging Face <-> glmjax: config.json fields and the tensor-name / layout map (docs/model.md A, C).

HF stores `nn.Linear` weights as [out, in]; our kernels are [in, out] with the head axes split out
(e.g. q_b_proj [H*d_qk, r_q] -> [r_q, H, d_qk], o_proj [D, H*d_v] -> [H, d_v, D]). Decoder layer i lives at
`stacks[s].units.layers[j]` with unit index u on the leading axis (`layer_slots`); layer `num_hidden_layers`
is the MTP layer (`mtp.*`).
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np

from glmjax.config import ConfigError, ModelConfig

MODEL_TYPES = ("glm_moe_dsa", "deepseek_v32")  # what export writes (DSA checkpoints)
# Dense MLA checkpoints import reads too: every layer gets a fresh lightning indexer (trained by dense_warmup); the
# value is the DSA format of the same family, which export of the result writes.
DENSE_MLA = {"deepseek_v3": "deepseek_v32", "deepseek_v2": None}  # None: no DSA format has DeepSeek-V2's router
IMPORT_TYPES = MODEL_TYPES + tuple(DENSE_MLA)
ARCHITECTURES = {"glm_moe_dsa": "GlmMoeDsaForCausalLM", "deepseek_v32": "DeepseekV32ForCausalLM"}
HF_LATENT_NORM_EPS = 1e-6  # HF builds q_a_layernorm / kv_a_layernorm with the RMSNorm default eps (docs/model.md F-4)
# The RoPE layouts transformers 5.24 computes whatever config.json says: its modeling files hard-code them and never
# read `rope_interleave` / `indexer_rope_interleave` (docs/model.md F-1). Also the defaults when a flag is absent.
HF_ROPE_LAYOUT = {"glm_moe_dsa": dict(rope_interleave=True, indexer_rope_interleave=True),
                  "deepseek_v32": dict(rope_interleave=True, indexer_rope_interleave=False),
                  "deepseek_v3": dict(rope_interleave=True, indexer_rope_interleave=False),
                  "deepseek_v2": dict(rope_interleave=True, indexer_rope_interleave=False)}  # V2: complex pairs
# ... except the flags transformers does read (deepseek_v3's attention honours `rope_interleave`; its fresh indexers
# take deepseek_v32's layout, which export writes)
HF_READS = {"deepseek_v3": ("rope_interleave",)}
log = logging.getLogger("glmjax.interop")

# HF defaults where they differ by model type (configuration_{glm_moe_dsa,deepseek_v32}.py).
_DEFAULTS = {
    "glm_moe_dsa": dict(n_group=1, topk_group=1, rms_norm_eps=1e-5, index_n_heads=32),
    "deepseek_v32": dict(n_group=8, topk_group=4, rms_norm_eps=1e-6, index_n_heads=64),
    "deepseek_v3": dict(n_group=8, topk_group=4, rms_norm_eps=1e-6, index_n_heads=64),  # the indexer: DSV3.2's
    "deepseek_v2": dict(n_group=1, topk_group=1, rms_norm_eps=1e-6, index_n_heads=64, n_shared_experts=2,
                        norm_topk_prob=False, routed_scaling_factor=1.0, first_k_dense_replace=0,
                        scoring_func="softmax", topk_method="greedy"),
}
_COMMON_DEFAULTS = dict(n_shared_experts=1, norm_topk_prob=True, routed_scaling_factor=2.5, first_k_dense_replace=3,
                        index_topk=2048, index_head_dim=128, scoring_func="sigmoid", topk_method="noaux_tc")
# the routers each model type has: (scoring_func, topk_methods)
ROUTERS = {"deepseek_v2": ("softmax", ("greedy", "group_limited_greedy"))}
_REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
             "num_attention_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
             "v_head_dim", "n_routed_experts", "num_experts_per_tok", "max_position_embeddings")
_COPIED = _REQUIRED + ("n_group", "topk_group", "rms_norm_eps", "index_n_heads", "n_shared_experts", "norm_topk_prob",
                       "routed_scaling_factor", "index_topk", "index_head_dim", "rope_interleave",
                       "indexer_rope_interleave", "scoring_func", "topk_method")
_YARN_KEYS = ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale", "mscale_all_dim",
              "attention_factor")


def config_from_hf(hf: Mapping[str, Any], *, latent_norm_eps: float | None = HF_LATENT_NORM_EPS,
                   honour_rope_flags: bool = False,
                   overrides: Mapping[str, Any] | None = None) -> tuple[ModelConfig, list[str]]:
    """config.json (glm_moe_dsa / deepseek_v32) -> (ModelConfig, notes). Every unsupported or missing field is
    reported at once in one ConfigError.

    latent_norm_eps: eps of q_a_layernorm / kv_a_layernorm. Default 1e-6 = what HF transformers builds
    (docs/model.md F-4), which is what `from_pretrained` models compute; None -> rms_norm_eps (what
    Megatron/vLLM/SGLang use).
    honour_rope_flags: False (default) -> the RoPE layouts transformers computes (HF_ROPE_LAYOUT), logging one
    warning per `rope_interleave` / `indexer_rope_interleave` in config.json that says otherwise; True -> the flags
    as written (what vLLM / SGLang do, docs/model.md F-1).
    overrides: ModelConfig fields applied last (e.g. dtype, param_dtype, mtp_depth).
    """
    cfg, notes, ignored = map_config(hf, latent_norm_eps=latent_norm_eps, honour_rope_flags=honour_rope_flags,
                                     overrides=overrides)
    for line in ignored:
        log.warning("%s", line)
    return cfg, notes


def map_config(hf: Mapping[str, Any], *, latent_norm_eps: float | None, honour_rope_flags: bool,
               overrides: Mapping[str, Any] | None) -> tuple[ModelConfig, list[str], list[str]]:
    """`config_from_hf` without logging -> (ModelConfig, notes, one line per RoPE flag of config.json ignored)."""
    errors, notes, ignored = [], [], []
    mt = hf.get("model_type")
    if mt not in IMPORT_TYPES:
        raise ConfigError(f"config.json model_type={mt!r}: must be one of {list(IMPORT_TYPES)}")
    defaults = {**_COMMON_DEFAULTS, **_DEFAULTS[mt], **HF_ROPE_LAYOUT[mt]}
    d: dict[str, Any] = {}
    for name in _COPIED:
        if hf.get(name) is not None:
            d[name] = hf[name]
        elif name == "q_lora_rank" and name in hf:  # null: MLA without a query LoRA (DeepSeek-V2-Lite, Moonlight)
            d[name] = 0
        elif name in defaults:
            d[name] = defaults[name]
        else:
            errors.append(f"{name}: missing (required)")
    for name in ("rope_interleave", "indexer_rope_interleave", "norm_topk_prob"):
        d[name] = bool(d.get(name))
    for name, used in HF_ROPE_LAYOUT[mt].items():
        if not honour_rope_flags and d[name] != used and name not in HF_READS.get(mt, ()):
            ignored.append(f"config.json {name}={hf[name]!r} ignored, using {used}: transformers 5.24 ignores it "
                           f"({mt} hard-codes this RoPE layout); honour_rope_flags=True uses the file's value")
            d[name] = used
    for name in ("rms_norm_eps", "routed_scaling_factor"):
        if name in d:
            d[name] = float(d[name])

    # unsupported variants
    def want(field, ok, rule):
        if field in hf and hf[field] is not None and not ok(hf[field]):
            errors.append(f"{field}={hf[field]!r}: {rule}")

    want("hidden_act", lambda v: v == "silu", "only 'silu' (SwiGLU) is supported")
    scoring, methods = ROUTERS.get(mt, ("sigmoid", ("noaux_tc",)))
    want("scoring_func", lambda v: v == scoring, f"only {scoring!r} routing is supported for {mt}")
    want("topk_method", lambda v: v in methods, f"must be one of {list(methods)} for {mt}")
    if mt == "deepseek_v2" and d.get("norm_topk_prob"):  # transformers' DeepseekV2TopkRouter never normalises
        notes.append("deepseek_v2: norm_topk_prob=true in config.json ignored (transformers never normalises the "
                     "DeepSeek-V2 router's weights)")
        d["norm_topk_prob"] = False
    want("attention_bias", lambda v: not v, "attention biases are not supported")
    want("mlp_bias", lambda v: not v, "MLP biases are not supported")
    want("tie_word_embeddings", lambda v: not v, "tied embeddings are not supported (GLM-5 / DSV3.2 are untied)")
    want("moe_layer_freq", lambda v: v == 1, "only moe_layer_freq=1 is supported")
    want("num_nextn_predict_layers", lambda v: v in (0, 1), "at most one MTP layer is supported")
    if "qk_head_dim" in hf and "qk_nope_head_dim" in d and "qk_rope_head_dim" in d:
        want("qk_head_dim", lambda v: v == d["qk_nope_head_dim"] + d["qk_rope_head_dim"],
             "must equal qk_nope_head_dim + qk_rope_head_dim")
    if d.get("q_lora_rank") == 0 and mt not in DENSE_MLA:
        errors.append(f"q_lora_rank=None: {mt} needs a query LoRA (its indexer reads the q latent)")
    elif d.get("q_lora_rank") == 0:
        notes.append(f"{mt}: no query LoRA (q_lora_rank=null): the queries come from q_proj, and the fresh "
                     "indexers' queries from the normed hidden state through wq [D, H_I, d_I]")

    # dense / MoE layer pattern
    L = d.get("num_hidden_layers", 0)
    k = int(hf.get("first_k_dense_replace", defaults["first_k_dense_replace"]))
    mlp_types = hf.get("mlp_layer_types")
    if mlp_types is not None:
        k = sum(1 for t in mlp_types if t == "dense")
        if list(mlp_types) != ["dense"] * k + ["sparse"] * (len(mlp_types) - k) or len(mlp_types) != L:
            errors.append(f"mlp_layer_types={list(mlp_types)!r}: must be {L} entries, 'dense' layers first, then "
                          "'sparse' (MoE)")
        elif "first_k_dense_replace" in hf and hf["first_k_dense_replace"] != k:
            notes.append(f"first_k_dense_replace={hf['first_k_dense_replace']} disagrees with mlp_layer_types "
                         f"({k} dense); using mlp_layer_types as HF does")
    d["first_k_dense_replace"] = min(k, L) if L else k

    # IndexShare schedule (docs/model.md B.8): explicit list > pattern string > freq/offset rule
    freq = max(int(hf.get("index_topk_freq", 1) or 1), 1)
    offset = int(hf.get("index_skip_topk_offset", 2))
    d["index_topk_freq"], d["index_skip_topk_offset"] = freq, offset
    if mt == "deepseek_v32":
        if hf.get("indexer_types") and "shared" in hf["indexer_types"]:
            notes.append("deepseek_v32: indexer_types in config.json ignored (every DSV3.2 layer has an indexer)")
        types = ["full"] * L
    elif mt in DENSE_MLA:
        types = ["full"] * L
    elif hf.get("indexer_types") is not None:
        types = list(hf["indexer_types"])
    elif hf.get("index_topk_pattern") is not None:
        pat = hf["index_topk_pattern"]
        types = [{"F": "full", "S": "shared"}.get(c, c) for c in pat] if isinstance(pat, str) else list(pat)
    else:
        types = ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(L)]
    d["indexer_types"] = tuple(types)

    # RoPE: v5 `rope_parameters` or legacy `rope_theta` + `rope_scaling`
    rp = dict(hf.get("rope_parameters") or {})
    legacy = dict(hf.get("rope_scaling") or {})
    merged = {**legacy, **rp}
    theta = merged.get("rope_theta", hf.get("rope_theta"))
    if theta is None:
        theta = 10000.0
        notes.append("rope_theta absent: using HF's default 10000")
    d["rope_theta"] = float(theta)
    rtype = merged.get("rope_type", merged.get("type")) or "default"
    if rtype == "yarn":
        rs = {"rope_type": "yarn"}
        for key in _YARN_KEYS:
            if merged.get(key) is not None:
                rs[key] = float(merged[key])
        if "original_max_position_embeddings" not in rs:
            errors.append("rope_parameters: yarn needs original_max_position_embeddings")
        elif "factor" not in rs:
            rs["factor"] = d.get("max_position_embeddings", 0) / rs["original_max_position_embeddings"]
            notes.append(f"yarn factor absent: max_position_embeddings / original = {rs['factor']} (as HF)")
        if merged.get("truncate", True) is not True:
            errors.append("rope_parameters.truncate=false: not supported (HF/DeepSeek truncate the YaRN ramp)")
        d["rope_scaling"] = rs
    elif rtype != "default":
        errors.append(f"rope_parameters.rope_type={rtype!r}: only 'default' and 'yarn' are supported")

    d["num_nextn_predict_layers"] = int(hf.get("num_nextn_predict_layers") or 0)
    d["latent_norm_eps"] = float(d.get("rms_norm_eps", 1e-6) if latent_norm_eps is None else latent_norm_eps)
    d["indexer_norm_eps"] = 1e-6
    q = hf.get("quantization_config")
    if q is not None and not _is_fp8_block(q):
        errors.append(f"quantization_config={dict(q)!r}: only fp8 (e4m3) with weight_block_size is supported")
    if errors:
        raise ConfigError("config.json: " + "; ".join(errors))
    d.update(dict(overrides or {}))
    cfg = ModelConfig.from_dict(d)
    if mt in DENSE_MLA:
        notes.append(f"{mt}: a dense MLA checkpoint; every layer gets a fresh lightning indexer (index_n_heads="
                     f"{cfg.index_n_heads}, index_head_dim={cfg.index_head_dim}, index_topk={cfg.index_topk}; the "
                     "model's initialiser): train them with the dense_warmup stage")
    return cfg, notes, ignored


def _is_fp8_block(q: Mapping) -> bool:
    return q.get("quant_method") == "fp8" and len(q.get("weight_block_size") or []) == 2


def fp8_block(hf: Mapping) -> tuple[int, int] | None:
    q = hf.get("quantization_config")
    return tuple(int(b) for b in q["weight_block_size"]) if q is not None and _is_fp8_block(q) else None


def config_to_hf(cfg: ModelConfig, model_type: str = "glm_moe_dsa", dtype: str = "bfloat16") -> dict:
    """ModelConfig -> a config.json dict that transformers (and config_from_hf) read back to the same model.
    A RoPE layout transformers cannot compute (HF_ROPE_LAYOUT) is written as is, with a warning: config_from_hf
    with honour_rope_flags=True, vLLM and SGLang read it back, transformers does not."""
    if model_type not in MODEL_TYPES:
        raise ConfigError(f"model_type={model_type!r}: must be one of {list(MODEL_TYPES)}")
    if (cfg.scoring_func, cfg.topk_method) != ("sigmoid", "noaux_tc"):
        raise ConfigError(f"scoring_func={cfg.scoring_func!r} / topk_method={cfg.topk_method!r} (DeepSeek-V2's "
                          f"router): no DSA format in transformers has it ({model_type} routes by sigmoid + "
                          "noaux_tc), so the model cannot be exported as one")
    for name, hf_value in HF_ROPE_LAYOUT[model_type].items():
        if getattr(cfg, name) != hf_value:
            log.warning("%s=%s written to config.json: transformers 5.24 ignores it and computes %s (%s), so its "
                        "logits will differ", name, getattr(cfg, name), hf_value, model_type)
    if not cfg.q_lora_rank:
        raise ConfigError(f"q_lora_rank=0 (MLA without a query LoRA): {model_type} in transformers has none (its "
                          "indexer reads the q latent), so the model cannot be exported as one")
    types = list(cfg.layer_indexer_types)
    if model_type == "deepseek_v32" and "shared" in types:
        raise ConfigError("model_type='deepseek_v32' cannot express IndexShare 'shared' layers: export as glm_moe_dsa")
    out = {"architectures": [ARCHITECTURES[model_type]], "model_type": model_type}
    for name in _COPIED:
        out[name] = getattr(cfg, name)
    L, k = cfg.num_hidden_layers, cfg.first_k_dense_replace
    out.update(first_k_dense_replace=k, mlp_layer_types=["dense"] * k + ["sparse"] * (L - k),
               num_key_value_heads=cfg.num_attention_heads, qk_head_dim=cfg.qk_head_dim,
               head_dim=cfg.qk_rope_head_dim, hidden_act="silu",
               attention_bias=False, tie_word_embeddings=False, moe_layer_freq=1,
               num_nextn_predict_layers=cfg.num_nextn_predict_layers, dtype=dtype)
    rope = {"rope_theta": cfg.rope_theta, "rope_type": "default"}
    if cfg.yarn:
        rope.update({k_: v for k_, v in dict(cfg.rope_scaling).items() if k_ in _YARN_KEYS})
        rope["rope_type"] = "yarn"
    out["rope_parameters"] = rope
    if model_type == "glm_moe_dsa":
        out["indexer_types"] = types
    return out


# ------------------------------------------------------------------------------------------- tensor map


@dataclass(frozen=True)
class Part:
    """One piece of an HF tensor: where it lives in our state and how it is laid out there.

    kind "copy": same layout; "linear": HF [out, in] -> our slab = transpose, reshaped (the first `n_in` slab axes
    are HF's input features); "experts": HF fused [E, rows, D] (or [E, D, I]) -> our [E, D, I] (or [E, I, D]) by
    swapping the last two axes, `rows` selecting the gate or the up half of gate_up_proj.
    """
    leaf: tuple  # flat nnx state path
    index: tuple[int, ...]  # leading indices into the leaf (unit, expert)
    kind: str
    n_in: int = 1
    rows: tuple[int, int] | None = None


@dataclass(frozen=True)
class Spec:
    key: str
    shape: tuple[int, ...]  # HF shape
    parts: tuple[Part, ...]


def slab_shape(leaf_shape, part: Part) -> tuple[int, ...]:
    return tuple(leaf_shape[len(part.index):])


def hf_piece_shape(slab: tuple[int, ...], part: Part) -> tuple[int, ...]:
    if part.kind == "copy":
        return slab
    if part.kind == "linear":
        return (math.prod(slab[part.n_in:]), math.prod(slab[:part.n_in]))
    if part.kind == "experts":
        return (slab[0], slab[2], slab[1])
    raise ValueError(part.kind)


def to_ours(x: np.ndarray, part: Part, slab: tuple[int, ...]) -> np.ndarray:
    """HF tensor (the whole key) -> this part's slab."""
    if part.kind == "copy":
        return x.reshape(slab)
    if part.kind == "linear":
        return x.T.reshape(slab)
    if part.rows is not None:
        x = x[:, part.rows[0]:part.rows[1], :]
    return np.swapaxes(x, 1, 2)


def to_hf(pieces: list[np.ndarray], parts: tuple[Part, ...]) -> np.ndarray:
    """Our slabs (one per part) -> the HF tensor."""
    outs = []
    for y, part in zip(pieces, parts):
        if part.kind == "copy":
            outs.append(y)
        elif part.kind == "linear":
            outs.append(y.reshape(math.prod(y.shape[:part.n_in]), -1).T)
        else:
            outs.append(np.swapaxes(y, 1, 2))
    return outs[0] if len(outs) == 1 else np.concatenate(outs, axis=1)


_ATTN = [
    ("input_layernorm.weight", ("input_layernorm", "weight"), "copy", 1),
    ("self_attn.q_a_proj.weight", ("self_attn", "q_a_proj"), "linear", 1),
    ("self_attn.q_a_layernorm.weight", ("self_attn", "q_a_layernorm", "weight"), "copy", 1),
    ("self_attn.q_b_proj.weight", ("self_attn", "q_b_proj"), "linear", 1),
    ("self_attn.kv_a_proj_with_mqa.weight", ("self_attn", "kv_a_proj_with_mqa"), "linear", 1),
    ("self_attn.kv_a_layernorm.weight", ("self_attn", "kv_a_layernorm", "weight"), "copy", 1),
    ("self_attn.kv_b_proj.weight", ("self_attn", "kv_b_proj"), "linear", 1),
    ("self_attn.o_proj.weight", ("self_attn", "o_proj"), "linear", 2),
]
_INDEXER = [
    ("self_attn.indexer.wq_b.weight", ("self_attn", "indexer", "wq_b"), "linear", 1),
    ("self_attn.indexer.wk.weight", ("self_attn", "indexer", "wk"), "linear", 1),
    ("self_attn.indexer.k_norm.weight", ("self_attn", "indexer", "k_norm", "weight"), "copy", 1),
    ("self_attn.indexer.k_norm.bias", ("self_attn", "indexer", "k_norm", "bias"), "copy", 1),
    ("self_attn.indexer.weights_proj.weight", ("self_attn", "indexer", "weights_proj"), "linear", 1),
]
# without a query LoRA (q_lora_rank 0): q_proj replaces q_a_proj .. q_b_proj, and the indexer's wq replaces wq_b (no
# HF format has such an indexer: its key only names the tensor that import fills fresh)
_Q_PROJ = ("self_attn.q_proj.weight", ("self_attn", "q_proj"), "linear", 1)
_INDEXER_WQ = ("self_attn.indexer.wq.weight", ("self_attn", "indexer", "wq"), "linear", 1)
_POST = [("post_attention_layernorm.weight", ("post_attention_layernorm", "weight"), "copy", 1)]
_DENSE = [(f"mlp.{n}.weight", ("mlp", n), "linear", 1) for n in ("gate_proj", "up_proj", "down_proj")]
_ROUTER = [
    ("mlp.gate.weight", ("mlp", "gate"), "linear", 1),
    ("mlp.gate.e_score_correction_bias", ("mlp", "e_score_correction_bias"), "copy", 1),
]
_SHARED = [(f"mlp.shared_experts.{n}.weight", ("mlp", "shared_experts", n), "linear", 1)
           for n in ("gate_proj", "up_proj", "down_proj")]
_MTP = [
    ("enorm.weight", ("mtp", "enorm", "weight"), "copy", 1),
    ("hnorm.weight", ("mtp", "hnorm", "weight"), "copy", 1),
    ("eh_proj.weight", ("mtp", "eh_proj"), "linear", 1),
    ("shared_head.norm.weight", ("mtp", "shared_head_norm", "weight"), "copy", 1),
]
INDEXER_SUFFIX = "self_attn.indexer."
ROUTER_BIAS = "mlp.gate.e_score_correction_bias"
MTP_COPIES = {"embed_tokens.weight": "model.embed_tokens.weight", "shared_head.head.weight": "lm_head.weight"}
EXPERT_LAYOUTS = ("per_expert", "fused", "fused.weight")  # fused keys: mlp.experts.gate_up_proj[.weight]


def layer_prefix(i: int) -> str:
    return f"model.layers.{i}."


def plan_keys(cfg: ModelConfig, leaf_shapes: Mapping[tuple, tuple], expert_layouts: Mapping[int, str]) -> dict:
    """-> {hf key: Spec} for every tensor the model holds, in canonical order (embed, layers 0..L(-MTP), norm,
    head). expert_layouts: layer -> one of EXPERT_LAYOUTS (default per_expert)."""
    from glmjax.model.transformer import layer_slots

    specs: dict[str, Spec] = {}

    def add(key, leaf, index, kind, n_in=1, rows=None, extra_parts=()):
        parts = (Part(leaf, index, kind, n_in, rows),) + tuple(extra_parts)
        shapes = [hf_piece_shape(slab_shape(leaf_shapes[p.leaf], p), p) for p in parts]
        shape = shapes[0] if len(shapes) == 1 else (shapes[0][0], sum(s[1] for s in shapes), shapes[0][2])
        specs[key] = Spec(key, tuple(shape), parts)

    def layer(i, leaf_prefix, index, moe, has_indexer):
        p = layer_prefix(i)
        if cfg.q_lora_rank:
            table = _ATTN + (_INDEXER if has_indexer else [])
        else:
            table = _ATTN[:1] + [_Q_PROJ] + _ATTN[4:] + ([_INDEXER_WQ] + _INDEXER[1:] if has_indexer else [])
        table += _POST
        table += (_ROUTER + (_SHARED if cfg.n_shared_experts else [])) if moe else _DENSE
        for suffix, leaf, kind, n_in in table:
            add(p + suffix, leaf_prefix + leaf, index, kind, n_in)
        if not moe:
            return
        lay = expert_layouts.get(i, "per_expert")
        g, u, dn = (leaf_prefix + ("mlp", n) for n in ("experts_gate", "experts_up", "experts_down"))
        if lay == "per_expert":
            for e in range(cfg.n_routed_experts):
                q = f"{p}mlp.experts.{e}."
                add(q + "gate_proj.weight", g, index + (e,), "linear")
                add(q + "up_proj.weight", u, index + (e,), "linear")
                add(q + "down_proj.weight", dn, index + (e,), "linear")
        elif lay in ("fused", "fused.weight"):
            sfx = ".weight" if lay == "fused.weight" else ""
            I = cfg.moe_intermediate_size
            add(f"{p}mlp.experts.gate_up_proj{sfx}", g, index, "experts", rows=(0, I),
                extra_parts=(Part(u, index, "experts", 1, (I, 2 * I)),))
            add(f"{p}mlp.experts.down_proj{sfx}", dn, index, "experts")
        else:
            raise ValueError(f"expert layout {lay!r}: must be one of {EXPERT_LAYOUTS}")

    add("model.embed_tokens.weight", ("embed_tokens",), (), "copy")
    types = cfg.layer_indexer_types
    for i, (s, u, j) in enumerate(layer_slots(cfg)):
        layer(i, ("stacks", s, "units", "layers", j), (u,), i >= cfg.first_k_dense_replace, types[i] == "full")
    if cfg.has_mtp:
        N = cfg.num_hidden_layers
        layer(N, ("mtp", "layer"), (), True, True)
        for suffix, leaf, kind, n_in in _MTP:
            add(layer_prefix(N) + suffix, leaf, (), kind, n_in)
    add("model.norm.weight", ("norm", "weight"), (), "copy")
    add("lm_head.weight", ("lm_head",), (), "linear")
    return specs


def detect_expert_layout(keys, i: int) -> str:
    p = f"{layer_prefix(i)}mlp.experts."
    if p + "gate_up_proj" in keys:
        return "fused"
    if p + "gate_up_proj.weight" in keys:
        return "fused.weight"
    return "per_expert"

