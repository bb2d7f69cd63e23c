"""Every config file loads (as train.py loads it), has every ModelConfig field and validates; invalid model configs
fail naming the field."""
import dataclasses
import json
import os
import sys

import jax
import pytest
from absl import flags
from flax import nnx
from ml_collections import config_flags

from glmjax.config import ConfigError, ModelConfig, model_config_dict
from glmjax.data import ByteTokenizer
from glmjax.model.moe import RouterBias
from glmjax.model.transformer import GLM
from glmjax.train.config import stage_config, validate_train_config
from glmjax.train.loop import check_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # configs/glm52.py imports configs.glm5, as under `python train.py` from the repo root
CONFIGS = ["glm5", "glm52", "deepseek_v32", "tiny", "small", "recipe_tiny", "glm5_recipe"]


def load(name, *overrides):
    """Parse `--config=configs/<name>.py [overrides]` through ml_collections' config_flags, like train.py."""
    argv = ["train.py", f"--config={os.path.join(ROOT, 'configs', name + '.py')}", *overrides]
    fv = flags.FlagValues()
    config_flags.DEFINE_config_file("config", None, "config file", flag_values=fv, sys_argv=argv)
    fv(argv)
    return fv.config


def param_count(cfg):
    """Parameters (nnx.Param + the router correction biases) of the model, from abstract shapes only."""
    model = nnx.eval_shape(lambda: GLM(cfg, nnx.Rngs(0)))
    return sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Any(nnx.Param, RouterBias))))


@pytest.mark.parametrize("name", CONFIGS)
def test_config_loads_and_validates(name):
    c = load(name)
    assert set(c.model) == {f.name for f in dataclasses.fields(ModelConfig)}  # every field, so every one overridable
    cfg = ModelConfig.from_dict(c.model)
    assert ModelConfig.from_dict(json.loads(json.dumps(cfg.to_json_dict()))) == cfg  # checkpoint meta round trip
    validate_train_config(c.train, cfg)
    assert c.train.mode in ("dense", "sparse")
    for stage in c.recipe:  # a recipe: every stage's merged config is valid too (as run() checks it)
        sc = stage_config(c, stage)
        sc.init_from = sc.init_from or "runs/previous_stage"
        check_config(sc, init_exists=False)


def test_overrides_from_the_command_line():
    c = load("tiny", "--config.model.index_topk=4", "--config.train.steps=7", "--config.train.mode=dense")
    assert (c.model.index_topk, c.train.steps, c.train.mode) == (4, 7, "dense")
    assert ModelConfig.from_dict(c.model).index_topk == 4


def test_none_fields_are_overridable():
    """indexer_types / rope_scaling are None in glm5.py: typed placeholders parse a tuple / a dict."""
    c = load("glm5", "--config.model.num_hidden_layers=3", "--config.model.indexer_types=('full', 'shared', 'full')",
             "--config.model.rope_scaling={'rope_type': 'yarn', 'factor': 4.0, 'original_max_position_embeddings': 32}")
    cfg = ModelConfig.from_dict(c.model)
    assert cfg.layer_indexer_types == ("full", "shared", "full") and cfg.yarn and cfg.rope_scaling["factor"] == 4.0
    assert load("deepseek_v32", "--config.model.rope_scaling.factor=20.0").model.rope_scaling.factor == 20.0


def test_stage_overrides_reach_every_model_field():
    c = load("recipe_tiny")
    with c.unlocked():  # block_q: not in recipe_tiny.py's delta, but a field of its model section
        c.stages.sparse_adapt.model = {"block_q": 32}
    assert ModelConfig.from_dict(stage_config(c, "sparse_adapt").model).block_q == 32
    assert ModelConfig.from_dict(stage_config(c, "pretrain").model).block_q == 256


def test_model_config_dict_rejects_unknown_fields():
    with pytest.raises(ConfigError, match=r"model\.hidden_sizee\b"):
        model_config_dict(hidden_sizee=128)


# keymap.model_config_json's output before ModelConfig.to_json_dict existed (checkpoint meta, model_config.json), for
# deepseek_v32.py with 4 layers F S F S
OLD_META = (
    '{"vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048, '
    '"num_hidden_layers": 4, "first_k_dense_replace": 1, "num_attention_heads": 128, "q_lora_rank": 1536, '
    '"kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "n_routed_experts": 256, '
    '"n_shared_experts": 1, "num_experts_per_tok": 8, "n_group": 8, "topk_group": 4, "routed_scaling_factor": 2.5, '
    '"norm_topk_prob": true, "index_n_heads": 64, "index_head_dim": 128, "index_topk": 2048, "indexer_types": '
    '["full", "shared", "full", "shared"], "index_topk_freq": 1, "index_skip_topk_offset": 2, "rope_interleave": true, '
    '"indexer_rope_interleave": false, "rope_theta": 10000.0, "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, '
    '"factor": 40.0, "mscale": 1.0, "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096, "rope_type": '
    '"yarn"}, "max_position_embeddings": 163840, "rms_norm_eps": 1e-06, "latent_norm_eps": 1e-06, "indexer_norm_eps": '
    '1e-06, "num_nextn_predict_layers": 1, "mtp_depth": 1, "mtp_loss_weight": 0.1, "init_std": 0.02, "dtype": '
    '"bfloat16", "param_dtype": "float32", "moe_impl": "auto", "moe_dispatch": "auto", "moe_capacity_factor": 0.0, '
    '"attention_impl": "xla", "block_q": 256, "loss_chunk": 512, "scan_layers": true, "remat": "none"}')


def test_old_checkpoint_meta_loads_and_is_written_the_same():
    c = load("deepseek_v32", "--config.model.num_hidden_layers=4", "--config.model.first_k_dense_replace=1",
             "--config.model.indexer_types=('full', 'shared', 'full', 'shared')")
    cfg = ModelConfig.from_dict(c.model)
    assert ModelConfig.from_dict(json.loads(OLD_META)) == cfg
    added = {"context_layout": "zigzag", "dense_attention_impl": "auto",  # fields added since: at their defaults
             "scoring_func": "sigmoid", "topk_method": "noaux_tc"}
    assert cfg.to_json_dict() == {**json.loads(OLD_META), **added}


def test_glm5_matches_spec():
    cfg = ModelConfig.from_dict(load("glm5").model)
    assert cfg.layer_indexer_types == ("full",) * 78
    assert cfg.qk_head_dim == 256 and cfg.softmax_scale == 0.0625
    # docs/model.md A.1: 753,864,139,008 parameters including the MTP layer (e_score_correction_bias included)
    assert param_count(cfg) == 753_864_139_008


def test_glm52_index_share():
    cfg = ModelConfig.from_dict(load("glm52").model)
    full = [i for i, t in enumerate(cfg.layer_indexer_types) if t == "full"]
    assert full == [0, 1, 2] + list(range(6, 78, 4))
    assert len(full) == 21 and full[-1] == 74
    assert (cfg.rope_theta, cfg.max_position_embeddings) == (8e6, 1048576)
    # docs/model.md A.2: the 57 shared layers carry no indexer weights: 5.1 total - 57 * 9,371,904
    assert param_count(cfg) == 753_864_139_008 - 57 * 9_371_904


def test_deepseek_v32_matches_spec():
    cfg = ModelConfig.from_dict(load("deepseek_v32").model)
    assert cfg.yarn and cfg.n_group == 8 and cfg.topk_group == 4 and not cfg.indexer_rope_interleave
    assert cfg.softmax_scale == pytest.approx(0.135234, abs=1e-6)  # docs/model.md A.4
    # docs/model.md A.3: 685.4B including an MTP layer with its own embedding/head copies (ours shares them)
    total = param_count(cfg) + 2 * cfg.vocab_size * cfg.hidden_size
    assert total == pytest.approx(685.4e9, rel=1e-3)


def test_tiny_and_small_exercise_sparse_attention():
    for name in ("tiny", "small"):
        c = load(name)
        assert c.train.mode == "sparse" and c.train.seq_len > c.model.index_topk
        assert c.model.vocab_size >= ByteTokenizer.vocab_size
    assert 10e6 <= param_count(ModelConfig.from_dict(load("small").model)) <= 30e6


TINY = load("tiny").model.to_dict()
INVALID = [
    ("index_topk", {"index_topk": 0}),
    ("num_attention_heads", {"num_attention_heads": 0}),
    ("vocab_size", {"vocab_size": 0}),
    ("n_routed_experts", {"n_routed_experts": 18}),  # not divisible by n_group=4
    ("n_group", {"n_group": 16}),  # one expert per group
    ("topk_group", {"topk_group": 5}),  # > n_group
    ("num_experts_per_tok", {"num_experts_per_tok": 9}),  # > topk_group * experts per group = 8
    ("indexer_types", {"indexer_types": ["shared", "full", "full", "shared", "full", "shared"]}),
    ("indexer_types", {"indexer_types": ["full", "shared", "full"]}),  # wrong length
    ("indexer_types", {"indexer_types": ["full", "fulll", "shared", "shared", "full", "shared"]}),
    ("indexer_types", {"indexer_types": None, "index_topk_freq": 2, "index_skip_topk_offset": 0}),  # layer 0 shared
    ("index_topk_freq", {"index_topk_freq": 0}),
    ("index_skip_topk_offset", {"index_skip_topk_offset": -1}),
    ("qk_rope_head_dim", {"qk_rope_head_dim": 15}),  # odd
    ("qk_rope_head_dim", {"qk_rope_head_dim": 64}),  # > index_head_dim=32
    ("dtype", {"dtype": "float64"}),
    ("param_dtype", {"param_dtype": "float16"}),
    ("attention_impl", {"attention_impl": "cuda"}),
    ("remat", {"remat": "sometimes"}),
    ("hidden_sizee", {"hidden_sizee": 128}),  # unknown field
    ("mtp_depth", {"mtp_depth": -1}),
    ("mtp_loss_weight", {"mtp_loss_weight": -0.1}),
    ("num_nextn_predict_layers", {"num_nextn_predict_layers": 2}),
    ("first_k_dense_replace", {"first_k_dense_replace": 7}),
    ("rope_scaling", {"rope_scaling": {"rope_type": "yarn", "original_max_position_embeddings": 32}}),  # no factor
    ("rope_scaling", {"rope_scaling": {"rope_type": "yarn", "factor": 0.5, "original_max_position_embeddings": 32}}),
    ("rope_scaling", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}),
    ("rms_norm_eps", {"rms_norm_eps": 0.0}),
    ("rope_theta", {"rope_theta": -1.0}),
    ("routed_scaling_factor", {"routed_scaling_factor": 0}),
    ("hidden_size", {"hidden_size": 128.0}),  # not an integer
    ("norm_topk_prob", {"norm_topk_prob": "yes"}),
    ("moe_impl", {"moe_impl": "einsum"}),
    ("rope_scaling", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 0}}),
    ("rope_scaling", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32,
                                       "beta_fsat": 32}}),  # typo'd key
    ("rope_scaling", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32,
                                       "beta_fast": 1, "beta_slow": 32}}),
    ("rope_scaling", {"rope_scaling": {"rope_type": "default", "factor": 4.0}}),  # factor would be ignored
    ("indexer_types", {"index_topk_freq": 2, "index_skip_topk_offset": 1}),  # disagrees with the explicit list
]


@pytest.mark.parametrize("field,change", INVALID, ids=[f"{f}-{i}" for i, (f, _) in enumerate(INVALID)])
def test_invalid_model_config_names_the_field(field, change):
    with pytest.raises(ConfigError, match=rf"model\.{field}\b"):
        ModelConfig.from_dict({**TINY, **change})


@pytest.mark.parametrize("field,value", [("mode", "fast"), ("seq_len", 0), ("batch_size", 0),
                                         ("bias_update_rate", -1.0), ("nan_policy", "ignore"), ("seq_len", 512)])
def test_invalid_train_config_names_the_field(field, value):
    c = load("tiny")
    c.train[field] = value
    with pytest.raises(ConfigError, match=rf"train\.{field}\b"):
        validate_train_config(c.train, ModelConfig.from_dict(c.model))


def test_seq_len_not_divisible_by_the_context_axis_is_refused_up_front():
    from glmjax.train.loop import check_config
    c = load("tiny")
    c.parallel.context = 3
    with pytest.raises(ConfigError, match=r"train\.seq_len=128: must be a multiple of 6 \(parallel\.context=3, "
                                          r"model\.context_layout='zigzag'"):
        check_config(c)
    c.parallel.context = 4
    check_config(c)


@pytest.mark.parametrize("field,value", [("warmup_steps", 300), ("lr", 0.0), ("name", "sgd"), ("b2", 1.0)])
def test_invalid_optim_config_names_the_field(field, value):
    from glmjax.optim import validate_optim_config
    c = load("tiny")
    c.optim[field] = value
    with pytest.raises(ConfigError, match=rf"optim\.{field}\b"):
        validate_optim_config({**c.optim.to_dict(), "total_steps": c.train.steps})
