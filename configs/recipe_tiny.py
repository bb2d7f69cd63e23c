"""The GLM-5 DSA recipe at CPU scale (docs/model.md E): pretrain (dense MLA) -> dense_warmup (indexers distil the dense
attention, everything else frozen) -> sparse_adapt (top-k sparse attention, all weights; indexers distil over the
selected keys) -> indexshare (every 2nd layer reuses the previous layer's top-k; the kept indexers distil toward the
mean attention of the layers they serve). The tiny model (docs/model.md A.5 shapes), sequence 128 > index_topk 16 so the
indexer really selects; about 10 minutes on a 2-core CPU for all four stages.

  python train.py --config=configs/recipe_tiny.py --workdir=runs/recipe_tiny
  python train.py --config=configs/recipe_tiny.py --config.stage=sparse_adapt \
      --config.init_from=runs/recipe_tiny/dense_warmup ...
"""
from configs import tiny
from glmjax.train.config import experiment_fields

ALL_FULL = ("full",) * 6
SHARE_2 = ("full", "shared") * 3


def get_config():
    c = tiny.get_config()
    c.model.indexer_types = ALL_FULL
    c.train.update(steps=200, eval_every=100, checkpoint_every=50, mode="dense")
    return experiment_fields(
        c, stage="recipe", recipe=("pretrain", "dense_warmup", "sparse_adapt", "indexshare"),
        stages={
            "pretrain": {"train": {"steps": 200}},
            # E.2: main model frozen, only the indexers learn (GLM-5: max lr 5e-3, 1000 steps); constant lr
            "dense_warmup": {"train": {"steps": 60, "eval_every": 30},
                             "optim": {"indexer_lr": 5e-3, "warmup_steps": 5, "schedule": "constant"}},
            # E.3: all weights, sparse attention; a lower lr for the already-trained main model
            "sparse_adapt": {"train": {"steps": 60, "eval_every": 30},
                             "optim": {"lr": 1e-3, "indexer_lr": 5e-3, "warmup_steps": 5}},
            # E.4: IndexShare every 2nd layer
            "indexshare": {"model": {"indexer_types": SHARE_2}, "train": {"steps": 60, "eval_every": 30},
                           "optim": {"lr": 1e-3, "indexer_lr": 5e-3, "warmup_steps": 5}},
        })
