"""GLM-5's DSA adaptation recipe at full scale (docs/model.md E), starting from a dense-attention MLA base checkpoint
(`--config.init_from=<HF or imported checkpoint dir>`; indexers absent there are freshly initialised and logged).

  dense_warmup  docs/model.md E.2 / GLM-5 report: 1000 steps x 14 sequences x 202,752 tokens, max lr 5e-3, base frozen
  sparse_adapt  docs/model.md E.3: "the training data and hyperparameters of mid-training", 20B tokens
                -> 20e9 / (14 x 202,752) = 7,046 steps at the same batch; lr: not given in the sources, the
                mid-training value is the user's (placeholder 2e-4, Muon Split)
  indexshare    GLM-5.2's uniform pattern (every 4th layer from layer 3 keeps its indexer, docs/model.md B.8 / E.4); the
                length of this stage is not published: 1000 steps is a placeholder

Needs a TPU pod; the numbers are docs/model.md E's, the placeholders are marked.

Mesh: check it ahead of time on any host (docs/benchmarks.md "Whole training step on TPU pods"):
  python train.py --config=configs/glm5_recipe.py --dry-run --topology=v5p:8x8x8
The batch of 14 sequences splits over the batch axes (data x fsdp x expert) only 1, 2, 7 or 14 ways, and fsdp cannot
shard the model width (6144 = 2^11 x 3) 7 ways, so: expert=2 (7 sequences per expert shard) and the sequence over
`context` (parameters FSDP-sharded over it too, the routed experts split over it: one per chip,
glmjax/parallel/rules.py); tensor=1 (the residual stream is not split over tensor, so every tensor rank would hold
all its tokens' activations). Fits 512 chips (docs/benchmarks.md): dense_warmup 32.5 GiB, sparse_adapt 62.7 GiB
per chip of v5p's 95; indexshare at GLM-5.2's 1,048,576 tokens (batch 2: --config.train.seq_len=1048576
--config.model.max_position_embeddings=1048576 --config.train.batch_size=2) 86.9 GiB; indexshare at this config's
14 x 202,752 needs 100.4 GiB and does NOT fit 512 chips.
"""
from configs import glm5
from glmjax.parallel import default_parallel_config
from glmjax.train.config import experiment_fields

SEQ, BATCH = 202752, 14


def get_config():
    c = glm5.get_config()
    c.train.update(seq_len=SEQ, batch_size=BATCH, steps=1000, checkpoint_every=100, eval_every=250,
                   index_loss_weight=1.0)
    # expert parallelism over context x expert (256 ways: one expert per chip); dropless would size every receive
    # buffer for all of a group's tokens landing on one chip (256 x 5,544 rows x 6144 x 2 B = 17 GB per layer), so a
    # chip takes at most twice its mean load (glmjax/model/moe.py; pairs past it contribute zero)
    c.model.update(attention_impl="pallas", remat="full", moe_capacity_factor=2.0)
    c.parallel = default_parallel_config(data=1, expert=2, context=256)  # v5p:8x8x8, 512 chips (docstring)
    return experiment_fields(
        c, stage="recipe", recipe=("dense_warmup", "sparse_adapt", "indexshare"),
        stages={
            "dense_warmup": {"train": {"steps": 1000},
                             "optim": {"indexer_lr": 5e-3, "warmup_steps": 50, "schedule": "constant"}},
            "sparse_adapt": {"train": {"steps": 7046}, "optim": {"lr": 2e-4, "indexer_lr": 5e-3}},
            "indexshare": {"model": {"index_topk_freq": 4, "index_skip_topk_offset": 3},
                           "train": {"steps": 1000}, "optim": {"lr": 2e-4, "indexer_lr": 5e-3}},
        })
