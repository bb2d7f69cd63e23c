"""DeepSeek-V3.2 (`deepseek_v32`): real shapes, docs/model.md A.3. ~685B parameters incl. MTP -- not for CPU.

Differences from GLM-5 that matter: YaRN RoPE (factor 40 from 4096), group-limited routing (8 groups, top-4),
half-split indexer RoPE, 64 indexer heads, eps 1e-6.
"""
import ml_collections

from glmjax.config import model_config_dict
from glmjax.data import default_data_config
from glmjax.optim.config import default_optim_config
from glmjax.parallel import default_parallel_config
from glmjax.train.config import default_train_config, experiment_fields


def get_config():
    c = ml_collections.ConfigDict()
    # the other fields are ModelConfig's defaults, which are DeepSeek-V3.2's: 1 shared expert, routed scaling 2.5,
    # every layer "full", interleaved RoPE, theta 1e4, indexer k_norm eps 1e-6, one MTP layer
    c.model = model_config_dict(
        vocab_size=129280,
        hidden_size=7168,
        intermediate_size=18432,
        moe_intermediate_size=2048,
        num_hidden_layers=61,
        first_k_dense_replace=3,
        num_attention_heads=128,
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        n_routed_experts=256,
        num_experts_per_tok=8,
        n_group=8,
        topk_group=4,
        index_n_heads=64,
        index_head_dim=128,
        index_topk=2048,
        indexer_rope_interleave=False,  # half-split
        rope_scaling=dict(rope_type="yarn", factor=40.0, original_max_position_embeddings=4096, beta_fast=32.0,
                          beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0),
        max_position_embeddings=163840,
        rms_norm_eps=1e-6,
        latent_norm_eps=1e-6,
        mtp_depth=1,
        dtype="bfloat16",
    )
    c.optim = default_optim_config(name="muon_split", lr=2e-4, warmup_steps=500)  # total_steps := train.steps
    c.train = default_train_config(seq_len=4096, batch_size=256, steps=10000,
                                   mode="sparse", log_every=10, eval_every=500, eval_batches=8)
    c.data = default_data_config()  # None path: the embedded stdlib corpus
    c.parallel = default_parallel_config()  # mesh: data=-1 (all devices) x fsdp x expert x context x tensor
    return experiment_fields(c)  # stage: pretrain
