"""The SPEC.md A.5 tiny model (~3M parameters), trained on the embedded stdlib corpus in a few minutes on CPU.

seq_len 128 > index_topk 16, so sparse (DSA) attention really selects keys; layers 0-1 and 4 are "full"
(own indexer), 2-3 and 5 "shared" (reuse the previous full layer's top-k); group-limited routing 4 groups / top-2.
"""
import ml_collections

from glmjax.data import default_data_config
from glmjax.optim.config import default_optim_config
from glmjax.parallel import default_parallel_config
from glmjax.train.config import default_train_config, experiment_fields


def get_config():
    c = ml_collections.ConfigDict()
    c.model = ml_collections.ConfigDict(dict(
        vocab_size=512,  # >= 259 for the byte tokenizer
        hidden_size=128,
        intermediate_size=256,
        moe_intermediate_size=64,
        num_hidden_layers=6,
        first_k_dense_replace=1,
        num_attention_heads=4,
        q_lora_rank=64,
        kv_lora_rank=32,
        qk_nope_head_dim=32,
        qk_rope_head_dim=16,
        v_head_dim=24,
        n_routed_experts=16,
        n_shared_experts=1,
        num_experts_per_tok=4,
        n_group=4,
        topk_group=2,
        index_n_heads=4,
        index_head_dim=32,
        index_topk=16,
        indexer_types=("full", "full", "shared", "shared", "full", "shared"),
        rope_theta=10000.0,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        num_nextn_predict_layers=1,
        mtp_depth=3,
    ))
    c.optim = default_optim_config(name="adamw", lr=3e-3, warmup_steps=30)  # total_steps := train.steps
    c.train = default_train_config(seq_len=128, batch_size=8, steps=300,
                                   mode="sparse", log_every=10, eval_every=100, eval_batches=4)
    c.data = default_data_config()  # None path: the embedded stdlib corpus
    c.parallel = default_parallel_config()  # mesh: data=-1 (all devices) x fsdp x expert x tensor
    return experiment_fields(c)  # stage: pretrain
