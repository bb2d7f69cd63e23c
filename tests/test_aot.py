"""AOT compilation of the sharded train step for a real TPU topology (v5p:2x2x2, 8 chips) from this CPU host, with
expert and tensor parallelism: the TPU dispatch (ragged all-to-all + ragged_dot) compiles, the state is split
across chips, and the compiler's memory / cost estimates are sane. Needs libtpu (jax[tpu], in the test extras)."""
import os

import jax
import pytest
from jax.sharding import PartitionSpec as P

from glmjax import parallel as par
from glmjax.optim.config import default_optim_config
from glmjax.hardware import CHIPS
from glmjax.train import aot
from sharded_training import small_cfg

os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # other test workers / engineers may hold libtpu


@pytest.fixture(scope="module")
def devices():
    return aot.topology_devices("v5p:2x2x2")  # jax[tpu] is a test dependency: no libtpu is an error, not a skip


@pytest.mark.slow  # one TPU compile: ~1-2 min on 2 shared CPU cores (the compilation cache does not keep it)
def test_train_step_compiles_for_v5p_with_expert_and_tensor_parallelism(devices):
    cfg = small_cfg()
    mesh = par.make_mesh(dict(data=1, fsdp=2, expert=2, tensor=2), devices)
    assert mesh.abstract_mesh.abstract_device.platform == "tpu"
    compiled = aot.lower_train_step(cfg, default_optim_config(name="adamw", warmup_steps=0), mesh, batch=8,
                                    seq=64).compile()
    hlo = compiled.as_text()
    assert hlo.count(" ragged-all-to-all(") >= 3  # the TPU dispatch: rows, their expert ids, results back
    assert " ragged-dot(" in hlo or "ragged_dot" in hlo  # grouped matmul on the MXU, not the dense fallback

    specs = {sh.spec for sh in jax.tree.leaves(compiled.input_shardings[0][0])}  # the parameters' layouts
    assert P(None, "expert", "fsdp", "tensor") in specs  # stacked routed experts: all three axes split them
    mem = aot.memory_per_chip(compiled)
    assert mem["alias"] > 0.9 * mem["output"]  # the donated state is updated in place
    assert 0 < mem["argument"] and 0 < mem["total"] < CHIPS["v5p"].hbm_bytes
    c = aot.cost(compiled)
    assert c["flops"] > 0 and c["bytes"] > 0 and c["comm_bytes"] > 0  # expert all-to-alls, gradient reduces
    t = aot.roofline(c, "v5p")
    assert 0 < t["fast"] <= t["slow"] == pytest.approx(t["compute"] + t["memory"] + t["network"])
