"""GLM-5 (zai-org/GLM-5, `glm_moe_dsa`): real shapes, docs/model.md A.1. ~754B parameters incl. MTP -- not for CPU.

The `train` section is a placeholder shape for a sparse-stage run; stage recipes (dense warm-up, sparse
adaptation, ...) are separate configs.
"""
import ml_collections

from glmjax.config import model_config_dict
from glmjax.data import default_data_config
from glmjax.optim.config import default_optim_config
from glmjax.parallel import default_parallel_config
from glmjax.train.config import default_train_config, experiment_fields


def get_config():
    c = ml_collections.ConfigDict()
    # the other fields are ModelConfig's defaults, which are GLM-5's: no expert groups, 1 shared expert, routed
    # scaling 2.5, indexer_types derived (index_topk_freq=1: all 78 layers "full"), interleaved RoPE, no rope
    # scaling, eps 1e-5 (indexer k_norm 1e-6), one MTP layer at depth 3
    c.model = model_config_dict(
        vocab_size=154880,
        hidden_size=6144,
        intermediate_size=12288,
        moe_intermediate_size=2048,
        num_hidden_layers=78,
        first_k_dense_replace=3,
        num_attention_heads=64,
        q_lora_rank=2048,
        kv_lora_rank=512,
        qk_nope_head_dim=192,
        qk_rope_head_dim=64,
        v_head_dim=256,
        n_routed_experts=256,
        num_experts_per_tok=8,
        index_n_heads=32,
        index_head_dim=128,
        index_topk=2048,
        rope_theta=1e6,
        max_position_embeddings=202752,
        dtype="bfloat16",
    )
    # GLM-5 trains with Muon Split (docs/model.md E.6); the numbers are placeholders for a user's own run.
    c.optim = default_optim_config(name="muon_split", lr=2e-4, warmup_steps=500)  # total_steps := train.steps
    c.train = default_train_config(seq_len=4096, batch_size=256, steps=10000,
                                   mode="sparse", log_every=10, eval_every=500, eval_batches=8)
    c.data = default_data_config()  # None path: the embedded stdlib corpus
    c.parallel = default_parallel_config()  # mesh: data=-1 (all devices) x fsdp x expert x context x tensor
    return experiment_fields(c)  # stage: pretrain
