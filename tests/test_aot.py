"""AOT compilation of the sharded train step for a real TPU topology (v5p:2x2x2, 8 chips) from this CPU host, with
expert and tensor parallelism, through the dry run of train.py (`--dry-run --topology`): the TPU dispatch (ragged
all-to-all + ragged_dot) compiles, the state is split across chips, and the compiler's memory / cost estimates are
sane. Needs libtpu (jax[tpu], in the test extras)."""
import os
import subprocess
import sys

import jax
import pytest
from jax.sharding import PartitionSpec as P

from glmjax import parallel as par
from glmjax.optim.config import default_optim_config
from glmjax.hardware import CHIPS
from glmjax.train import aot, dry_run
from helpers import tiny_config_file
from sharded_training import small_cfg

os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # other test workers / engineers may hold libtpu


@pytest.fixture(scope="module")
def devices():
    return aot.topology_devices("v5p:2x2x2")  # jax[tpu] is a test dependency: no libtpu is an error, not a skip


@pytest.mark.slow  # one TPU compile: ~1-2 min on 2 shared CPU cores (the compilation cache does not keep it)
def test_train_step_compiles_for_v5p_with_expert_and_tensor_parallelism(devices):
    c = tiny_config_file.get_config()
    c.model.update(small_cfg().to_json_dict())
    c.optim = default_optim_config(name="adamw", warmup_steps=0)
    c.train.update(batch_size=8, seq_len=64)
    c.parallel.update(data=1, fsdp=2, expert=2, tensor=2)
    result, compiled = dry_run.compile_stage(c, "sparse_adapt", devices)
    assert result["mesh"] == dict(data=1, fsdp=2, expert=2, context=1, tensor=2) and result["mode"] == "sparse"
    hlo = compiled.as_text()
    assert hlo.count(" ragged-all-to-all(") >= 3  # the TPU dispatch: rows, their expert ids, results back
    assert " ragged-dot(" in hlo or "ragged_dot" in hlo  # grouped matmul on the MXU, not the dense fallback

    specs = {sh.spec for sh in jax.tree.leaves(compiled.input_shardings[0][0])}  # the parameters' layouts
    assert P(None, "expert", "fsdp", "tensor") in specs  # stacked routed experts: all three axes split them
    mem = result["memory"]
    assert mem == aot.memory_per_chip(compiled)
    assert "total %.2f GiB of 95 GiB HBM: fits" % (mem["total"] / 2 ** 30) in dry_run.describe({**result, "fits": True},
                                                                                      CHIPS["v5p"].hbm_bytes)
    assert mem["alias"] > 0.9 * mem["output"]  # the donated state is updated in place
    assert 0 < mem["argument"] and 0 < mem["total"] < CHIPS["v5p"].hbm_bytes
    c = aot.cost(compiled)
    assert c["flops"] > 0 and c["bytes"] > 0 and c["comm_bytes"] > 0  # expert all-to-alls, gradient reduces
    t = aot.roofline(c, "v5p")
    assert 0 < t["fast"] <= t["slow"] == pytest.approx(t["compute"] + t["memory"] + t["network"])


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ONE_LAYER = ["--config.model.num_hidden_layers=1", "--config.model.first_k_dense_replace=1",
             "--config.model.num_nextn_predict_layers=0", "--config.model.indexer_types=('full',)"]


def train_py(*flags):
    return subprocess.run([sys.executable, "train.py", "--config=configs/tiny.py", *flags], capture_output=True,
                          text=True, timeout=300, cwd=ROOT)


def test_dry_run_says_when_a_stage_does_not_fit():
    """A million 128-token rows on 4 chips: the TPU compiler refuses the program; exit status 1, its message shown."""
    out = train_py("--dry-run", "--topology=v5p:2x2x1", "--config.train.batch_size=1048576",
                   "--config.train.mode=dense", *ONE_LAYER)
    assert out.returncode == 1, out.stderr[-2000:]
    assert "stage pretrain: dense attention (xla), batch 1048576 x seq 128, mesh {'data': 4}" in out.stdout
    assert "does NOT fit: RESOURCE_EXHAUSTED" in out.stdout


def test_dense_stage_compiles_for_v5p_with_the_splash_kernel_on_a_sharded_mesh(devices):
    """The pretrain (dense) stage on 8 chips (data, fsdp, tensor): the splash kernel ("auto" on TPU) runs inside a
    shard_map (Mosaic cannot be partitioned by XLA), heads split over tensor; its kernels are in the program."""
    c = tiny_config_file.get_config()
    c.model.update(num_hidden_layers=1, first_k_dense_replace=1, num_nextn_predict_layers=0, indexer_types=("full",),
                   dense_attention_impl="splash")  # "auto" would keep this small a layer materialised
    c.train.update(batch_size=4, seq_len=256, mode="dense")
    c.parallel.update(data=2, fsdp=2, tensor=2)
    result, compiled = dry_run.compile_stage(c, "pretrain", devices)
    assert result["mode"] == "dense" and result["mesh"]["tensor"] == 2
    assert compiled.as_text().count("tpu_custom_call") >= 3  # splash forward, dq, dkv
    c = aot.cost(compiled)
    assert c["uncounted"] == c["custom_calls"] >= 3  # splash declares no cost estimate: its FLOPs are not counted


@pytest.mark.parametrize("flags, message", [
    (["--dry-run"], "--dry-run needs --topology"),
    (["--dry-run", "--topology=v9x:2x2"], "unknown chip 'v9x'"),
])
def test_dry_run_flag_errors_are_one_line(flags, message):
    out = train_py(*flags)
    assert out.returncode == 2 and message in out.stderr and "Traceback" not in out.stderr, out.stderr[-2000:]
