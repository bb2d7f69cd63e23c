"""A CPU benchmark model (~20M parameters): 6 layers (1 dense + 5 MoE with 32 experts), hidden 256, 8 heads,
IndexShare every 2nd layer, sequence 256 > index_topk 64."""
import ml_collections

from glmjax.config import model_config_dict
from glmjax.data import default_data_config
from glmjax.optim.config import default_optim_config
from glmjax.parallel import default_parallel_config
from glmjax.train.config import default_train_config, experiment_fields


def get_config():
    c = ml_collections.ConfigDict()
    c.model = model_config_dict(
        hidden_size=256,
        intermediate_size=768,
        moe_intermediate_size=128,
        num_attention_heads=8,
        q_lora_rank=128,
        kv_lora_rank=64,
        v_head_dim=32,
        n_routed_experts=32,
        n_group=4,
        topk_group=2,
        index_topk=64,
        index_topk_freq=2,  # IndexShare: layers 0, 1, 3, 5 full, 2 and 4 shared
        max_position_embeddings=1024,
        mtp_depth=1,
    )
    c.optim = default_optim_config(name="adamw", lr=2e-3, warmup_steps=50)  # total_steps := train.steps
    c.train = default_train_config(seq_len=256, batch_size=8, steps=500,
                                   mode="sparse", log_every=10, eval_every=100, eval_batches=4)
    c.data = default_data_config()  # None path: the embedded stdlib corpus
    c.parallel = default_parallel_config()  # mesh: data=-1 (all devices) x fsdp x expert x context x tensor
    return experiment_fields(c)  # stage: pretrain
