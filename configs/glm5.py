"""GLM-5 (zai-org/GLM-5, `glm_moe_dsa`): real shapes, SPEC.md A.1. ~754B parameters incl. MTP -- not for CPU.

The `train` section is a placeholder shape for a sparse-stage run; stage recipes (dense warm-up, sparse
adaptation, ...) are separate configs.
"""
import ml_collections

from glmjax.data import default_data_config
from glmjax.optim.config import default_optim_config
from glmjax.parallel import default_parallel_config
from glmjax.train.config import default_train_config, experiment_fields


def get_config():
    c = ml_collections.ConfigDict()
    c.model = ml_collections.ConfigDict(dict(
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
        n_shared_experts=1,
        num_experts_per_tok=8,
        n_group=1,
        topk_group=1,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        index_n_heads=32,
        index_head_dim=128,
        index_topk=2048,
        indexer_types=None,  # absent in GLM-5 -> derived: index_topk_freq=1 makes all 78 layers "full"
        index_topk_freq=1,
        index_skip_topk_offset=2,
        rope_interleave=True,
        indexer_rope_interleave=True,
        rope_theta=1e6,
        rope_scaling=None,
        max_position_embeddings=202752,
        rms_norm_eps=1e-5,
        latent_norm_eps=1e-5,
        indexer_norm_eps=1e-6,
        num_nextn_predict_layers=1,
        mtp_depth=3,
        mtp_loss_weight=0.1,
        dtype="bfloat16",
        param_dtype="float32",
    ))
    # GLM-5 trains with Muon Split (SPEC E.6); the numbers are placeholders for a user's own run.
    c.optim = default_optim_config(name="muon_split", lr=2e-4, warmup_steps=500)  # total_steps := train.steps
    c.train = default_train_config(seq_len=4096, batch_size=256, steps=10000,
                                   mode="sparse", log_every=10, eval_every=500, eval_batches=8)
    c.data = default_data_config()  # None path: the embedded stdlib corpus
    c.parallel = default_parallel_config()  # mesh: data=-1 (all devices) x fsdp x expert x tensor
    return experiment_fields(c)  # stage: pretrain
