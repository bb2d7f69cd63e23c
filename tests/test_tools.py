"""python -m glmjax.tools.topk_overlap on a checkpoint written by the trainer's checkpoint code."""
import json

import matplotlib.image as mpimg
import numpy as np
from flax import nnx
from helpers import tiny

from glmjax.model import GLM
from glmjax.tools import topk_overlap
from glmjax.train.checkpoint import Checkpoints


def test_topk_overlap_tool_writes_the_heatmaps(tmp_path):
    cfg = tiny(init_std=0.1)  # F F S S F S: 6 layers, 3 indexers
    model = GLM(cfg, nnx.Rngs(0))
    ck = Checkpoints(str(tmp_path / "run"))
    ck.save(1, nnx.state(model).to_pure_dict(), {"count": np.zeros(())}, {}, {"step": 1, "stage": "pretrain",
                                                                           "model": cfg.to_json_dict()})
    ck.close()
    out = tmp_path / "overlap.png"
    assert topk_overlap.main(["--checkpoint", str(tmp_path / "run"), "--out", str(out), "--seq_len", "48",
                              "--batch_size", "2", "--batches", "1"]) == 0
    img = mpimg.imread(out)
    assert img.shape[0] > 300 and img.shape[1] > 800 and img[..., :3].std() > 0.05  # a real picture
    m = json.load(open(tmp_path / "overlap.json"))
    attn, index = np.asarray(m["attention"]), np.asarray(m["indexer"])
    assert attn.shape == (6, 6) and index.shape == (3, 3) and m["full_layers"] == [0, 1, 4]
    for a in (attn, index):
        np.testing.assert_allclose(np.diag(a), 1.0)
        np.testing.assert_allclose(a, a.T, atol=1e-6)
        assert (a >= 0).all() and (a <= 1).all()
    assert attn[np.triu_indices(6, 1)].max() < 1.0  # seq 48 > k 8: layers really differ
    assert len(m["recall"]) == 3 and all(0 <= r <= 1 for r in m["recall"])
