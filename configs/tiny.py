"""The docs/model.md A.5 tiny model (~3M parameters), trained on the embedded stdlib corpus in a few minutes on CPU.

seq_len 128 > index_topk 16, so sparse (DSA) attention really selects keys; layers 0-1 and 4 are "full"
(own indexer), 2-3 and 5 "shared" (reuse the previous full layer's top-k); group-limited routing 4 groups / top-2.
"""
import ml_collections

from glmjax.config import model_config_dict
from glmjax.data import default_data_config
from glmjax.optim.config import default_optim_config
from glmjax.parallel import default_parallel_config
from glmjax.train.config import default_train_config, experiment_fields


def get_config():
    c = ml_collections.ConfigDict()
    # ModelConfig's defaults are docs/model.md A.5's shapes (vocab 512 >= 259 for the byte tokenizer, 6 layers,
    # hidden 128, 16 experts, 4 per token, MTP depth 3); A.5's expert groups and IndexShare pattern are given here, and
    # index_topk 16 (A.5: 8) for seq_len 128
    c.model = model_config_dict(n_group=4, topk_group=2, index_topk=16,
                                indexer_types=("full", "full", "shared", "shared", "full", "shared"))
    c.optim = default_optim_config(name="adamw", lr=3e-3, warmup_steps=30)  # total_steps := train.steps
    c.train = default_train_config(seq_len=128, batch_size=8, steps=300,
                                   mode="sparse", log_every=10, eval_every=100, eval_batches=4)
    c.data = default_data_config()  # None path: the embedded stdlib corpus
    c.parallel = default_parallel_config()  # mesh: data=-1 (all devices) x fsdp x expert x context x tensor
    return experiment_fields(c)  # stage: pretrain
