"""Two processes x 4 CPU devices on 127.0.0.1 (gloo collectives): sharded, expert-parallel training, an orbax
checkpoint written and restored by both processes, and the same losses as one process on one device; context
parallelism with the sequence split across the processes (context=4 x tensor=2): the sparse stages' (sparse_adapt,
indexshare) loss and gradients equal one device's (every stage on 8 devices in one process: test_context_parallel),
and so do the Decoder's logits and greedy tokens on that mesh, its caches split over context across the processes
(one process: test_decode_sharded); process 0 alone holds a workdir's lock and both stop on a busy one."""
import json
import os
import socket
import subprocess
import sys

import jax
import numpy as np
import pytest

from sharded_training import (MULTIHOST_GROUPS, STEPS_AFTER, STEPS_BEFORE, assert_equal_to_reference, context_npz,
                              context_reference, decode_npz, reference_losses)
from test_decode_sharded import assert_close, decode_run
from xla_flags import xla_flags

HERE = os.path.dirname(os.path.abspath(__file__))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_processes_train_checkpoint_restore_and_match_single_process(tmp_path):
    port, out = free_port(), str(tmp_path / "losses.json")
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": xla_flags(devices=4, worker=True)}
    procs = [subprocess.Popen([sys.executable, os.path.join(HERE, "sharded_training.py"), str(i), "2", str(port),
                               str(tmp_path / "ckpt"), out], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for i in range(2)]
    logs = []
    for p in procs:
        try:
            logs.append(p.communicate(timeout=900)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
    for p, log in zip(procs, logs):
        assert p.returncode == 0, log[-4000:]
    with open(out) as f:
        got = json.load(f)
    assert got["rows"] == [0, 1, 2, 3]  # process 0 loaded only its half of the batch
    assert len(got["losses"]) == STEPS_BEFORE + STEPS_AFTER
    ref = reference_losses(STEPS_BEFORE + STEPS_AFTER)
    np.testing.assert_allclose(got["losses"], ref, rtol=1e-4)  # float summation order differs
    assert ref[-1] < ref[0] - 1.0  # it learns (the sequences are predictable)

    want = context_reference(MULTIHOST_GROUPS)[-1]
    with np.load(context_npz(out)) as f:
        leaves = [f[f"arr_{i}"] for i in range(len(f.files))]
    assert_equal_to_reference(jax.tree.unflatten(jax.tree.structure(want), leaves), want)

    logits, tokens, logprobs = decode_run()  # one device
    with np.load(decode_npz(out)) as f:
        assert_close(f["logits"], logits)  # prefill, extend and decode steps, the caches split across processes
        np.testing.assert_array_equal(f["tokens"], tokens)  # greedy generate
        np.testing.assert_allclose(f["logprobs"], logprobs, rtol=1e-5, atol=1e-6)


def test_a_coordinator_without_process_count_or_id_is_a_config_error(monkeypatch):
    """The multi-host start names the missing field (config or environment) before JAX's distributed client starts."""
    from glmjax.config import ConfigError
    from glmjax.parallel import initialize_distributed

    for name in ("GLMJAX_COORDINATOR_ADDRESS", "GLMJAX_NUM_PROCESSES", "GLMJAX_PROCESS_ID"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ConfigError, match="also needs parallel.num_processes \\(or \\$GLMJAX_NUM_PROCESSES\\)"):
        initialize_distributed({"coordinator_address": "127.0.0.1:1234"})
    with pytest.raises(ConfigError, match="also needs parallel.process_id"):
        initialize_distributed({"coordinator_address": "127.0.0.1:1234", "num_processes": 2})
    assert initialize_distributed({}) is False  # nothing asked: one process, nothing started
