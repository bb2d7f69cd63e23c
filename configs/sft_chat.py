"""Supervised fine-tuning on chat data, starting from an imported Hugging Face checkpoint (README walkthrough):

    glmjax-hf import GLM-5.1/ ckpt/glm51
    glmjax-train --config=configs/sft_chat.py:ckpt/glm51 --workdir=runs/sft \\
        --config.data.path=chat.jsonl --config.data.tokenizer=hf:GLM-5.1/

The argument is the `glmjax-hf import` directory: its model_config.json is the model, and the stage starts from its
weights (init_from). Rows of data.path hold `messages` (docs/data.md "Chat"); the loss covers assistant tokens.
Without an argument: configs/tiny.py's model from scratch (for --help and the config tests).
"""
import json
import os

import ml_collections

from configs import tiny
from glmjax.data import default_data_config
from glmjax.optim.config import default_optim_config
from glmjax.parallel import default_parallel_config
from glmjax.train.config import default_train_config, experiment_fields


def get_config(ckpt_dir: str = ""):
    c = ml_collections.ConfigDict()
    if ckpt_dir:
        with open(os.path.join(ckpt_dir, "model_config.json")) as f:
            c.model = ml_collections.ConfigDict(json.load(f))
    else:
        c.model = tiny.get_config().model
    c.optim = default_optim_config(name="adamw", lr=1e-5, warmup_steps=20, weight_decay=0.0)
    c.train = default_train_config(seq_len=min(4096, c.model.max_position_embeddings), batch_size=8, steps=500,
                                   log_every=10, eval_every=100, eval_batches=4, checkpoint_every=100)
    c.data = default_data_config(messages_field="messages", eval_fraction=0.02)
    c.parallel = default_parallel_config()
    experiment_fields(c, stage="sft")
    c.init_from = ckpt_dir or None
    return c
