"""train.py's loop on a device mesh: the same losses as on one device (the sharded state, step and data path)."""
import json
import os
import sys

import numpy as np
import pytest

from glmjax.train import run

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from configs import tiny  # noqa: E402


def losses(workdir):
    return [json.loads(line)["loss"] for line in open(os.path.join(workdir, "metrics.jsonl"))
            if '"loss"' in line]


@pytest.mark.slow
def test_sharded_training_matches_one_device(tmp_path):
    """data=2 x fsdp=2 x tensor=2 on 8 CPU devices vs one device, 4 steps: losses agree to 2e-4 (relative;
    float32 reductions are split differently)."""
    def config(**parallel):
        c = tiny.get_config()
        c.model.update(num_hidden_layers=3, indexer_types=("full", "shared", "full"), mtp_depth=1)
        c.train.update(steps=4, batch_size=8, seq_len=32, log_every=1, eval_batches=0, checkpoint_every=4)
        c.optim.warmup_steps = 1
        c.data.max_docs = 50
        c.parallel.update(parallel)
        return c

    one = run(config(num_devices=1), str(tmp_path / "one"), progress=False)
    mesh = run(config(data=2, fsdp=2, tensor=2), str(tmp_path / "mesh"), progress=False)
    a, b = losses(tmp_path / "one"), losses(tmp_path / "mesh")
    assert len(a) == len(b) == 4 and a[-1] < a[0]
    records = [json.loads(line) for line in open(tmp_path / "mesh" / "metrics.jsonl")]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert all(np.isfinite(r["grad_norm"]) and r["tokens_per_s"] > 0 and "lr_adamw" in r for r in records)
    assert json.load(open(tmp_path / "mesh" / "config.json"))["parallel"]["fsdp"] == 2
    np.testing.assert_allclose(b, a, rtol=2e-4)
    assert mesh["skipped_steps"] == one["skipped_steps"] == 0


def test_a_mesh_that_does_not_use_the_devices_is_a_config_error(tmp_path):
    """A mesh whose axes multiply to more devices than the run has stops before anything is built or written."""
    from glmjax.config import ConfigError

    c = tiny.get_config()
    c.parallel.update(num_devices=4, data=2, fsdp=2, tensor=2)
    with pytest.raises(ConfigError, match="parallel: mesh .* has 8 devices, there are 4"):
        run(c, str(tmp_path / "mesh"), progress=False)
    assert not os.path.exists(tmp_path / "mesh" / "checkpoints")
