"""From a dense MLA checkpoint to DSA (GLM-5 / DeepSeek-V3.2's continued training, docs/model.md E): dense_warmup (the
fresh lightning indexers learn the dense attention, everything else frozen) -> sparse_adapt (top-k sparse attention,
every weight). The model and the starting weights are those of a `glmjax-hf import` of a dense MLA checkpoint
(transformers' `deepseek_v3`; the indexers' shape is chosen at import, e.g. --set index_topk=2048):

  glmjax-hf import path/to/DeepSeek-V3 ckpt/dsv3 --set index_topk=2048
  python train.py --config=configs/dsa_from_dense.py:ckpt/dsv3 --workdir=runs/dsa \\
      --config.data.tokenizer=hf:path/to/DeepSeek-V3 --config.data.path=my_corpus.jsonl

IndexShare (docs/model.md E.4) after them: --config.recipe="('dense_warmup', 'sparse_adapt', 'indexshare')" (GLM-5.2's
uniform pattern: every 4th layer from layer 3 keeps its indexer). Its result has shared layers, which transformers'
deepseek_v32 cannot express: it stays a glmjax checkpoint (generate, PPO, init_from).

Without a checkpoint argument the tiny model is used (a plain check of the config). Train and data sections are
tiny.py's (CPU scale: seq 128, batch 8); a real model needs its own (seq_len, batch_size, mesh: `parallel`).
"""
import json
import os

import ml_collections

from configs import tiny
from glmjax.config import default_indexer_types


def get_config(ckpt_dir: str = ""):
    c = tiny.get_config()
    if ckpt_dir:
        with open(os.path.join(ckpt_dir, "model_config.json")) as f:
            c.model = ml_collections.ConfigDict(json.load(f))
        c.init_from = ckpt_dir
    c.stage, c.recipe = "recipe", ("dense_warmup", "sparse_adapt")
    c.train.update(eval_every=0, eval_batches=2, checkpoint_every=50)
    c.stages = ml_collections.ConfigDict({
        # E.2: only the indexers learn, at their own lr (GLM-5: 5e-3, constant)
        "dense_warmup": {"train": {"steps": 60}, "optim": {"indexer_lr": 5e-3, "warmup_steps": 5,
                                                           "schedule": "constant"}},
        # E.3: every weight, sparse attention; a low lr for the pretrained main model
        "sparse_adapt": {"train": {"steps": 60}, "optim": {"lr": 1e-4, "indexer_lr": 5e-3, "warmup_steps": 5}},
        # E.4 (only when the recipe names it): the shared layers reuse the top-k of the full layer before them
        "indexshare": {"model": {"indexer_types": default_indexer_types(c.model.num_hidden_layers, 4, 3)},
                       "train": {"steps": 60}, "optim": {"lr": 1e-4, "indexer_lr": 5e-3, "warmup_steps": 5}},
    })
    return c
