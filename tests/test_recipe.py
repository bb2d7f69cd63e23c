"""End to end: the tiny GLM-5 DSA recipe, pretrain -> dense_warmup -> sparse_adapt -> indexshare, chained through
checkpoints by train.py's `run` (docs/model.md E.2-E.4)."""
import json
import os
import sys

import numpy as np
import pytest
from flax import traverse_util

from glmjax.config import ModelConfig
from glmjax.train import run
from glmjax.train.checkpoint import load_model_state
from glmjax.train.stages import layer_names

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from configs import recipe_tiny  # noqa: E402

SPARSE_MARGIN = 0.10  # nats: sparse_adapt's held-out loss may exceed the dense model's by at most this


def records(workdir):
    return [json.loads(line) for line in open(os.path.join(workdir, "metrics.jsonl"))]


def series(workdir, key):
    return [r[key] for r in records(workdir) if key in r]


def state(workdir):
    s, meta, _ = load_model_state(workdir)
    return layer_names(ModelConfig.from_dict(meta["model"]), traverse_util.flatten_dict(s))


@pytest.mark.slow
def test_tiny_recipe_chains_all_four_stages(tmp_path):
    """configs/recipe_tiny.py at 2 layers without MTP (its 6 layers with MTP compile three layer stacks and the MTP
    layer: 191 s of the cold suite; 4 layers: 72 s alone, 2 layers: 38 s), layer 1 sharing layer 0's top-k in
    indexshare. Measured for train.seed 0 and 1 (2026-12-08): pretrain loss -3.86 / -3.84, dense_warmup KL x0.21 /
    x0.11, top-k recall 0.82 / 0.84, sparse_adapt -0.030 / -0.019 nats against the dense model, indexshare KL x0.47 /
    x0.59 and -0.131 / -0.122 nats (at 4 layers: -3.86 / -3.81, x0.16 / x0.18, 0.78 / 0.80, +0.020 / +0.046, x0.65 /
    x0.58, -0.083 / -0.072)."""
    c = recipe_tiny.get_config()
    c.model.update(num_hidden_layers=2, indexer_types=("full", "full"), num_nextn_predict_layers=0)
    c.stages.indexshare.model = {**c.stages.indexshare.model, "indexer_types": ("full", "shared")}
    c.data.max_docs = 200
    c.parallel.num_devices = 1  # one device (the 8 virtual CPU devices: tests/test_parallel.py)
    c.train.update(seq_len=64, batch_size=8, log_every=1, eval_batches=2, checkpoint_every=1000)
    c.optim.warmup_steps = 3
    c.stages.pretrain.train.steps = 60
    for name, steps in (("dense_warmup", 20), ("sparse_adapt", 8), ("indexshare", 25)):
        c.stages[name].train.steps = steps
        c.stages[name].train.eval_every = 0
    out = run(c, str(tmp_path), progress=False)
    d = {name: str(tmp_path / name) for name in c.recipe}

    # pretrain: the dense model learns
    assert out["pretrain"]["last_loss"] < out["pretrain"]["first_loss"] - 2.0

    # dense_warmup: the indexer KL falls; every non-indexer tensor (incl. router biases) is bit-identical
    kl = series(d["dense_warmup"], "index_kl")
    assert np.mean(kl[-5:]) < 0.5 * np.mean(kl[:3]), kl
    before, after = state(d["pretrain"]), state(d["dense_warmup"])
    assert before.keys() == after.keys()
    changed = {n for n in before if not np.array_equal(before[n], after[n])}
    assert changed and all("indexer" in "/".join(n) for n in changed), sorted(changed)[:5]
    assert out["dense_warmup"]["eval_topk_recall"] > 0.5

    # sparse_adapt: top-k attention keeps the dense model's held-out loss (within the margin)
    assert out["sparse_adapt"]["eval_loss"] < out["pretrain"]["eval_loss"] + SPARSE_MARGIN, out

    # indexshare: shared layers own no indexer; the kept indexers' multi-layer KL falls
    final = state(d["indexshare"])
    for i in range(2):
        has = any(n[:2] == ("layers", str(i)) and "indexer" in n for n in final)
        assert has == (i == 0), i
    kl = series(d["indexshare"], "index_kl")
    assert np.mean(kl[-5:]) < 0.8 * np.mean(kl[:3]), kl
    assert out["indexshare"]["eval_loss"] < out["pretrain"]["eval_loss"] + SPARSE_MARGIN, out

    # finished stages are skipped when the command runs again
    again = run(c, str(tmp_path), progress=False)
    assert again["indexshare"]["step"] == 25


def test_a_bad_later_stage_stops_the_recipe_before_its_first_stage_runs(tmp_path):
    """Every stage's config is checked before anything runs: an index_topk beyond indexshare's sequence fails up
    front, naming the field, and no stage has written anything."""
    from glmjax.config import ConfigError

    c = recipe_tiny.get_config()
    c.stages.indexshare.model = {**c.stages.indexshare.model, "index_topk": 10_000}
    with pytest.raises(ConfigError, match="index_topk"):
        run(c, str(tmp_path), progress=False)
    assert os.listdir(tmp_path) == []
