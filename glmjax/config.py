"""Model configuration: one frozen dataclass, built from an ML-collections dict and validated up front.

Field names follow the Hugging Face `glm_moe_dsa` / `deepseek_v32` configs (docs/model.md A) so that a
config.json maps onto them directly. Every validation error names the field, the value and the rule.
The defaults are docs/model.md A.5's tiny shapes (without its expert groups and IndexShare pattern). A config file's `model`
section is `model_config_dict(**delta)`: every field (so that each can be overridden from the command line), the
dataclass defaults replaced by the delta.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

import ml_collections
from flax.core import FrozenDict


class ConfigError(ValueError):
    """An invalid configuration value: the message names the field, the value and the rule."""


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 512
    hidden_size: int = 128
    intermediate_size: int = 256
    moe_intermediate_size: int = 64
    num_hidden_layers: int = 6
    first_k_dense_replace: int = 1
    num_attention_heads: int = 4
    q_lora_rank: int = 64  # 0: no query LoRA (DeepSeek-V2-Lite, Moonlight): q_proj [D, H, d_qk] (docs/model.md B.4)
    kv_lora_rank: int = 32
    qk_nope_head_dim: int = 32
    qk_rope_head_dim: int = 16
    v_head_dim: int = 24
    n_routed_experts: int = 16
    n_shared_experts: int = 1
    num_experts_per_tok: int = 4
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 2.5
    norm_topk_prob: bool = True
    # the router (docs/model.md B.9): "sigmoid" with "noaux_tc" (GLM-5, DeepSeek-V3/V3.2), or "softmax" with "greedy"
    # / "group_limited_greedy" (DeepSeek-V2: a group scores by its best expert)
    scoring_func: str = "sigmoid"
    topk_method: str = "noaux_tc"
    index_n_heads: int = 4
    index_head_dim: int = 32
    index_topk: int = 8
    # Per-layer "full"/"shared"; None -> derived from index_topk_freq / index_skip_topk_offset (docs/model.md B.8).
    indexer_types: tuple[str, ...] | None = None
    index_topk_freq: int = 1
    index_skip_topk_offset: int = 2
    rope_interleave: bool = True
    indexer_rope_interleave: bool = True
    rope_theta: float = 10000.0
    # None, or {"rope_type": "yarn", "factor", "original_max_position_embeddings", "beta_fast",
    # "beta_slow", "mscale", "mscale_all_dim"} (docs/model.md B.5).
    rope_scaling: Mapping[str, Any] | None = None
    max_position_embeddings: int = 256
    rms_norm_eps: float = 1e-5
    latent_norm_eps: float = 1e-5  # q_a_layernorm / kv_a_layernorm (docs/model.md F-4: HF 1e-6, Megatron rms_norm_eps)
    indexer_norm_eps: float = 1e-6  # indexer k_norm LayerNorm (docs/model.md F-5)
    num_nextn_predict_layers: int = 1  # 0 or 1: the (parameter-shared) MTP layer
    mtp_depth: int = 3  # D: depths the one MTP layer is applied for in training (docs/model.md E.5)
    mtp_loss_weight: float = 0.1  # lambda in L = L_main + lambda/D * sum_k CE_k
    init_std: float = 0.02
    dtype: str = "float32"  # compute dtype of matmuls; softmax/norm stats/router/indexer weights/losses are f32
    param_dtype: str = "float32"
    moe_impl: str = "auto"  # "auto" (ragged_dot on TPU, pallas_gpu on NVIDIA GPUs, blocked elsewhere) | "ragged_dot"
    # | "blocked" | "pallas_gpu" (interpreted off a GPU)
    moe_dispatch: str = "auto"  # expert parallelism: "auto" (ragged on TPU) | "all_to_all" | "ragged_all_to_all"
    moe_capacity_factor: float = 0.0  # expert parallelism: 0 = dropless; f > 0 = f x the mean rows per expert shard
    attention_impl: str = "xla"  # "xla": top-k + gathered attention in XLA; "pallas": pallas_kernels/ (the TPU
    # kernels, interpreted off TPU; on an NVIDIA GPU XLA's top-k and the GPU sparse MLA): glmjax/model/backends.py
    dense_attention_impl: str = "auto"  # dense causal training attention: "auto" (splash kernel on TPU, Pallas GPU
    # flash on NVIDIA GPUs, XLA flash elsewhere) | "xla" | "splash" | "pallas_gpu" (a kernel named: also off its
    # platform, interpreted; always blocked); context shards (explicit key slots) always run the XLA flash; see
    # glmjax/model/dense_kernels.py
    block_q: int = 256  # query block of the indexer top-k and the sparse attention (bounds [bq, T] / [bq, k] temps)
    loss_chunk: int = 512  # sequence chunk of the LM-head loss (never [B, S, V] at once)
    # context parallelism (a mesh `context` axis > 1): "zigzag" (shard i holds chunks i and 2N-1-i of 2N: equal causal
    # work) | "contiguous"; glmjax/model/context.py
    context_layout: str = "zigzag"
    scan_layers: bool = True
    remat: str = "none"  # "none" | "full" | "save_dots"

    # ----- derived -----
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def layer_indexer_types(self) -> tuple[str, ...]:
        if self.indexer_types is not None:
            return tuple(self.indexer_types)
        return default_indexer_types(self.num_hidden_layers, self.index_topk_freq, self.index_skip_topk_offset)

    @property
    def full_layers(self) -> list[int]:
        """The decoder layers with their own indexer, in order (Aux.index_topk's first axis)."""
        return [i for i, t in enumerate(self.layer_indexer_types) if t == "full"]

    @property
    def yarn(self) -> bool:
        return bool(self.rope_scaling) and self.rope_scaling.get("rope_type", self.rope_scaling.get("type")) == "yarn"

    @property
    def softmax_scale(self) -> float:
        scale = self.qk_head_dim ** -0.5
        if self.yarn:
            m = yarn_mscale(self.rope_scaling["factor"], self.rope_scaling.get("mscale_all_dim", 0.0))
            scale *= m * m
        return scale

    @property
    def has_mtp(self) -> bool:
        return self.num_nextn_predict_layers > 0 and self.mtp_depth > 0

    # ----- construction -----
    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "ModelConfig":
        d = dict(d.to_dict() if hasattr(d, "to_dict") else d)
        reject_unknown_fields(d)
        if d.get("indexer_types") is not None:
            d["indexer_types"] = tuple(d["indexer_types"])
        if d.get("rope_scaling") is not None:
            d["rope_scaling"] = FrozenDict(dict(d["rope_scaling"]))
        cfg = cls(**d)
        cfg.validate()
        return cfg

    def to_json_dict(self) -> dict:
        """Every field as a JSON value (checkpoint meta, model_config.json); from_dict reads it back."""
        d = dataclasses.asdict(self)
        if d["rope_scaling"] is not None:
            d["rope_scaling"] = dict(d["rope_scaling"])
        if d["indexer_types"] is not None:
            d["indexer_types"] = list(d["indexer_types"])
        return d

    def replace(self, **kw) -> "ModelConfig":
        cfg = dataclasses.replace(self, **kw)
        cfg.validate()
        return cfg

    def validate(self) -> None:
        def fail(field, rule):
            raise ConfigError(f"model.{field}={getattr(self, field)!r}: {rule}")

        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.type == "int" and (not isinstance(v, int) or isinstance(v, bool)):
                fail(f.name, "must be an integer")
            if f.type == "float" and (not isinstance(v, (int, float)) or isinstance(v, bool)):
                fail(f.name, "must be a number")
            if f.type == "float" and not math.isfinite(v):
                fail(f.name, "must be a finite number")
            if f.type == "bool" and not isinstance(v, bool):
                fail(f.name, "must be True or False")
        positive = ["vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
                    "num_attention_heads", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                    "v_head_dim", "n_routed_experts", "num_experts_per_tok", "n_group", "topk_group",
                    "index_n_heads", "index_head_dim", "index_topk", "index_topk_freq", "max_position_embeddings",
                    "block_q", "loss_chunk"]
        for name in positive:
            if getattr(self, name) < 1:
                fail(name, "must be >= 1")
        for name in ["q_lora_rank", "n_shared_experts", "first_k_dense_replace", "num_nextn_predict_layers",
                     "mtp_depth", "index_skip_topk_offset"]:
            if getattr(self, name) < 0:
                fail(name, "must be >= 0")
        for name in ["rms_norm_eps", "latent_norm_eps", "indexer_norm_eps", "init_std", "rope_theta",
                     "routed_scaling_factor"]:
            if not getattr(self, name) > 0:
                fail(name, "must be > 0")
        if self.mtp_loss_weight < 0:
            fail("mtp_loss_weight", "must be >= 0")
        if self.first_k_dense_replace > self.num_hidden_layers:
            fail("first_k_dense_replace", f"must be <= num_hidden_layers={self.num_hidden_layers}")
        if self.num_nextn_predict_layers > 1:
            fail("num_nextn_predict_layers", "must be 0 or 1 (GLM-5 shares one MTP layer over mtp_depth depths)")
        if self.qk_rope_head_dim % 2:
            fail("qk_rope_head_dim", "must be even (RoPE rotates pairs)")
        if self.qk_rope_head_dim > self.index_head_dim:
            fail("qk_rope_head_dim", f"must be <= index_head_dim={self.index_head_dim} (the indexer ropes its first "
                 "qk_rope_head_dim dims)")
        if self.n_routed_experts % self.n_group:
            fail("n_routed_experts", f"must be divisible by n_group={self.n_group}")
        if self.n_group > 1 and self.n_routed_experts // self.n_group < 2:
            fail("n_group", "group-limited routing scores a group by its top-2 experts: need >= 2 experts per group")
        if self.topk_group > self.n_group:
            fail("topk_group", f"must be <= n_group={self.n_group}")
        if self.num_experts_per_tok > self.topk_group * (self.n_routed_experts // self.n_group):
            fail("num_experts_per_tok", f"must be <= topk_group * experts per group = "
                 f"{self.topk_group * (self.n_routed_experts // self.n_group)}")
        methods = {"sigmoid": ("noaux_tc",), "softmax": ("greedy", "group_limited_greedy")}
        if self.scoring_func not in methods:
            fail("scoring_func", f"must be one of {tuple(methods)}")
        if self.topk_method not in methods[self.scoring_func]:
            fail("topk_method", f"must be one of {methods[self.scoring_func]} with scoring_func={self.scoring_func!r}")
        if self.index_n_heads * self.index_head_dim < 1:
            fail("index_n_heads", "must be >= 1")
        if self.indexer_types is not None and (self.index_topk_freq, self.index_skip_topk_offset) != (1, 2) and \
                tuple(self.indexer_types) != default_indexer_types(self.num_hidden_layers, self.index_topk_freq,
                                                                   self.index_skip_topk_offset):
            fail("indexer_types", f"disagrees with index_topk_freq={self.index_topk_freq} / index_skip_topk_offset="
                 f"{self.index_skip_topk_offset}: give one of the two")
        types = self.layer_indexer_types
        if len(types) != self.num_hidden_layers:
            fail("indexer_types", f"needs one entry per layer: got {len(types)}, num_hidden_layers="
                 f"{self.num_hidden_layers}")
        bad = [t for t in types if t not in ("full", "shared")]
        if bad:
            fail("indexer_types", f"entries must be 'full' or 'shared', got {bad[0]!r}")
        if types[0] != "full":
            fail("indexer_types", "layer 0 must be 'full': a shared layer reuses the indices of the nearest "
                 "previous full layer and layer 0 has none")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            fail("dtype", "must be one of float32, bfloat16, float16")
        if self.param_dtype not in ("float32", "bfloat16"):
            fail("param_dtype", "must be float32 or bfloat16")
        if self.attention_impl not in ATTENTION_IMPLS:
            fail("attention_impl", f"must be one of {sorted(ATTENTION_IMPLS)}")
        if self.context_layout not in ("zigzag", "contiguous"):
            fail("context_layout", "must be 'zigzag' or 'contiguous'")
        if self.dense_attention_impl not in ("auto", "xla", "splash", "pallas_gpu"):
            fail("dense_attention_impl", "must be one of auto, xla, splash, pallas_gpu")
        if self.moe_impl not in ("auto", "ragged_dot", "blocked", "pallas_gpu"):
            fail("moe_impl", "must be one of auto, ragged_dot, blocked, pallas_gpu")
        if self.moe_dispatch not in ("auto", "all_to_all", "ragged_all_to_all"):
            fail("moe_dispatch", "must be one of auto, all_to_all, ragged_all_to_all")
        if self.moe_capacity_factor < 0:
            fail("moe_capacity_factor", "must be >= 0 (0 = dropless)")
        if self.remat not in REMAT_POLICIES:
            fail("remat", f"must be one of {list(REMAT_POLICIES)}")
        if self.rope_scaling:
            rs = dict(self.rope_scaling)
            rtype = rs.get("rope_type", rs.get("type"))
            if rtype not in ("yarn", "default"):
                fail("rope_scaling", "rope_type must be 'yarn' or 'default'")
            known = {"rope_type", "type", "rope_theta", "factor", "original_max_position_embeddings", "beta_fast",
                     "beta_slow", "mscale", "mscale_all_dim", "attention_factor"}
            unknown = sorted(set(rs) - known)
            if unknown:
                fail("rope_scaling", f"unknown key {unknown[0]!r} (known: {', '.join(sorted(known))})")
            if rtype == "default" and set(rs) - {"rope_type", "type", "rope_theta"}:
                fail("rope_scaling", "rope_type 'default' takes no scaling parameters (use 'yarn')")
            if rtype == "yarn":
                missing = [k for k in ("factor", "original_max_position_embeddings") if k not in rs]
                if missing:
                    fail("rope_scaling", f"yarn needs {missing}")
                if not rs["factor"] >= 1:
                    fail("rope_scaling", "yarn factor must be >= 1")
                if not rs["original_max_position_embeddings"] >= 1:
                    fail("rope_scaling", "yarn original_max_position_embeddings must be >= 1")
                if not rs.get("beta_fast", 32) > rs.get("beta_slow", 1) > 0:
                    fail("rope_scaling", "yarn needs beta_fast > beta_slow > 0")


def reject_unknown_fields(names) -> None:
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    unknown = sorted(set(names) - known)
    if unknown:
        raise ConfigError(f"model.{unknown[0]}: unknown field (known fields: {', '.join(sorted(known))})")


# The type a command-line override of a field whose value is None is parsed as (ML-collections infers the type of
# every other field from its value); a new field that may be None needs an entry here.
NONE_FIELD_TYPES = {"indexer_types": tuple, "rope_scaling": ml_collections.ConfigDict}


def model_config_dict(**delta) -> ml_collections.ConfigDict:
    """The `model` section of a config file: every ModelConfig field, its default replaced by `delta`'s value.

    None-valued fields become typed placeholders (NONE_FIELD_TYPES), so that `--config.model.indexer_types=
    "('full', 'shared')"` or `--config.model.rope_scaling="{'rope_type': 'yarn', ...}"` parse where the value is None.
    Values are not validated here (ModelConfig.from_dict does that when the config is used).
    """
    reject_unknown_fields(delta)
    c = ml_collections.ConfigDict()
    for name, value in {**{f.name: f.default for f in dataclasses.fields(ModelConfig)}, **delta}.items():
        c[name] = ml_collections.config_dict.placeholder(NONE_FIELD_TYPES[name]) if value is None else value
    return c


ATTENTION_IMPLS = {"xla", "pallas"}
REMAT_POLICIES = ("none", "full", "save_dots")


def default_indexer_types(num_layers: int, freq: int, offset: int) -> tuple[str, ...]:
    """HF's IndexShare rule (docs/model.md B.8): layer i is full iff max(i - offset + 1, 0) % freq == 0."""
    return tuple("full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(num_layers))


def yarn_mscale(factor: float, mscale: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0
