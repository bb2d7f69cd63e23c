"""Every ModelConfig field can be overridden on train.py's command line (`--config.model.<field>=<value>`)."""
import dataclasses
import json
import os
import subprocess
import sys

from configs import tiny
from glmjax.config import ModelConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A valid non-default value for every field, all valid together on top of configs/tiny.py.
VALUES = dict(
    vocab_size=1024, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=4,
    first_k_dense_replace=2, num_attention_heads=2, q_lora_rank=48, kv_lora_rank=16, qk_nope_head_dim=16,
    qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8, n_shared_experts=2, num_experts_per_tok=2, n_group=2,
    topk_group=1, routed_scaling_factor=1.5, norm_topk_prob=False, scoring_func="softmax",
    topk_method="group_limited_greedy", index_n_heads=2, index_head_dim=16, index_topk=4,
    indexer_types=("full", "shared", "full", "shared"), index_topk_freq=2, index_skip_topk_offset=1,
    rope_interleave=False, indexer_rope_interleave=False, rope_theta=50000.0,
    rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    max_position_embeddings=512, rms_norm_eps=1e-6, latent_norm_eps=1e-6, indexer_norm_eps=1e-5,
    num_nextn_predict_layers=0, mtp_depth=2, mtp_loss_weight=0.2, init_std=0.01, dtype="bfloat16",
    param_dtype="bfloat16", moe_impl="blocked", moe_dispatch="all_to_all", moe_capacity_factor=1.25,
    attention_impl="pallas", dense_attention_impl="splash", block_q=64, loss_chunk=128, context_layout="contiguous",
    scan_layers=False, remat="full")

# train.py's own flag parsing, in a subprocess (absl's FLAGS is global): prints the ModelConfig the flags give.
PARSE = ("import json, sys, train\n"
         "from glmjax.config import ModelConfig\n"
         "train.parse_flags(sys.argv)\n"
         "print(json.dumps(ModelConfig.from_dict(train.FLAGS.config.model).to_json_dict()))")


def test_every_model_field_is_overridable_from_the_command_line():
    fields = [f.name for f in dataclasses.fields(ModelConfig)]
    assert sorted(VALUES) == sorted(fields), "every ModelConfig field needs a test value here"
    argv = ["--config=configs/tiny.py"] + [f"--config.model.{k}={v!r}" if isinstance(v, (tuple, dict)) else
                                           f"--config.model.{k}={v}" for k, v in VALUES.items()]
    out = subprocess.run([sys.executable, "-c", PARSE, *argv], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.splitlines()[-1])
    base = tiny.get_config().model
    for name in fields:
        assert VALUES[name] != base[name], f"{name}: the test value is the config's own"
        assert got[name] == json.loads(json.dumps(VALUES[name])), name
