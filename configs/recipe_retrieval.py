"""Long-context retrieval through the GLM-5 DSA recipe at CPU scale: a micro model pretrained densely on generated
RULER tasks as bytes (glmjax/eval/retrieval.py: passkey and NIAH documents of 256-512 bytes, the needle at a uniform
depth, the plain LM loss), then dense_warmup -> sparse_adapt -> indexshare as configs/recipe_tiny.py runs them, with
index_topk 64: 1/9 of the training context, 1/64 of the longest evaluated prompt.

  python train.py --config=configs/recipe_retrieval.py --workdir=runs/retrieval
  glmjax-eval --checkpoint runs/retrieval/sparse_adapt --lengths 512 1024 2048 4096
  python bench/long_context_quality.py --workdir runs/retrieval     # every stage's row, the table and the figure

The training documents are written on first use to ~/.cache/glmjax/data ($GLMJAX_DATA_DIR; 20,000 documents, about
8 MB), with answers from the training pool only (glmjax-eval asks test answers). The micro model is configs/tiny.py's
structure (MLA, a DSA indexer per full layer, a dense first layer then MoE with a shared expert, the MTP layer) at 2
layers with MTP depth 1.

Not yet a recipe that learns the task: 1,000 pretrain steps of this model (14 min on 2 cores, 0.83 s per step) fit
the filler and the prompts' fixed text (loss 6.9 -> 0.11) but copy no digit: the pass key's repetition inside its
own needle and the answer cost 11.5 nats per 5 digits, chance (no induction formed), 0 of 60 passkey test prompts at
256-512 bytes; the same with variable-tracking documents mixed in (2026-12-08).
"""
from configs import tiny
from glmjax.eval.retrieval import training_file
from glmjax.train.config import experiment_fields

TASKS = ("passkey", "niah_single")
LENGTHS = (256, 512)  # prompt bytes of the training documents: L_train = 512
SEQ_LEN = 576  # a 512-byte prompt + BOS + its answer + EOS fits one row whole
PRETRAIN_STEPS = 1000


def get_config():
    c = tiny.get_config()
    c.model.update(num_hidden_layers=2, indexer_types=("full", "full"), mtp_depth=1, index_topk=64,
                   max_position_embeddings=4096)
    c.train.update(seq_len=SEQ_LEN, batch_size=8, steps=PRETRAIN_STEPS, mode="dense", log_every=50, eval_every=500,
                   eval_batches=4, checkpoint_every=250)
    c.data.path = training_file(TASKS, 20_000, LENGTHS, seed=0)
    return experiment_fields(
        c, stage="recipe", recipe=("pretrain", "dense_warmup", "sparse_adapt", "indexshare"),
        stages={
            "pretrain": {"train": {"steps": PRETRAIN_STEPS}},
            "dense_warmup": {"train": {"steps": 150, "eval_every": 75},
                             "optim": {"indexer_lr": 5e-3, "warmup_steps": 10, "schedule": "constant"}},
            "sparse_adapt": {"train": {"steps": 150, "eval_every": 75},
                             "optim": {"lr": 1e-3, "indexer_lr": 5e-3, "warmup_steps": 10}},
            "indexshare": {"model": {"indexer_types": ("full", "shared")}, "train": {"steps": 150, "eval_every": 75},
                           "optim": {"lr": 1e-3, "indexer_lr": 5e-3, "warmup_steps": 10}},
        })
