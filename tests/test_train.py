"""The byte tokenizer, the router-bias row mapping, the chip table and the loop hooks' schedule (training runs:
test_recipe.py, test_train_sharded.py, test_reliability.py, test_resume.py)."""
import json
import os
import sys

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from glmjax.config import ModelConfig
from glmjax.data import ByteTokenizer
from glmjax.hardware import GiB, chip_of_device, chip_of_topology
from glmjax.model.transformer import GLM, Batch
from glmjax.train.hooks import CheckpointHook, due
from glmjax.train.router_bias import router_bias_slots, update_router_bias

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from configs import tiny  # noqa: E402

TOK = ByteTokenizer()


# ------------------------------------------------------------------------------------------------ tokenizer


@pytest.mark.parametrize("text", ["", "hello world\n", "naïve café — 東京 🚀", "def f(x):\n\treturn x ** 2\n"])
def test_tokenizer_round_trip(text):
    ids = TOK.encode(text)
    assert ids.dtype == np.int32 and ids[0] == TOK.BOS and ids[-1] == TOK.EOS
    assert len(ids) == len(text.encode("utf-8")) + 2
    assert TOK.decode(ids) == text
    assert TOK.decode(TOK.encode(text, bos=False, eos=False)) == text
    assert TOK.decode(np.append(ids, TOK.PAD)) == text  # special tokens are dropped


def test_tokenizer_rejects_out_of_range_ids():
    with pytest.raises(ValueError, match="out of range"):
        TOK.decode([65, 300])


# ------------------------------------------------------------------------------------------------ router bias

# 8 layers: 0 dense; units (F S) x3 = layers 1..6 in one stack of 3 units; layer 7 (F) a stack of its own; + MTP.
BIAS_CFG = dict(tiny.get_config().model.to_dict(), num_hidden_layers=8, n_group=1, topk_group=1, mtp_depth=2,
                indexer_types=["full", "full", "shared", "full", "shared", "full", "shared", "full"])


def forced(layer, E=16, K=4):
    return set((layer + np.arange(K)) % E)


@pytest.mark.slow
def test_router_bias_slots_follow_the_expert_load_rows():
    cfg = ModelConfig.from_dict(BIAS_CFG)
    model = GLM(cfg, nnx.Rngs(0))
    slots = router_bias_slots(model)
    # reference order of the expert_load rows: MoE layers by increasing index, then one row per MTP depth
    reference = [i for i in range(cfg.num_hidden_layers) if i >= cfg.first_k_dense_replace] + [8] * cfg.mtp_depth
    rows = np.concatenate([s[1].reshape(-1) for s in slots])
    assert sorted(rows.tolist()) == list(range(len(reference)))
    for var, r, layers in slots:
        for idx in np.ndindex(layers.shape):
            assert all(reference[row] == layers[idx] for row in r[idx])
    # force each layer to route every token to its own 4 experts, through the slot; the forward pass must agree
    for var, r, layers in slots:
        bias = np.zeros(var[...].shape, np.float32)
        for idx in np.ndindex(layers.shape):
            bias[idx][list(forced(int(layers[idx])))] = 100.0
        var[...] = jnp.asarray(bias)
    B, S = 2, 16
    batch = Batch(jnp.arange(B * S, dtype=jnp.int32).reshape(B, S) % 256, jnp.ones((B, S), jnp.int32),
                  jnp.tile(jnp.arange(S, dtype=jnp.int32), (B, 1)))
    load = np.asarray(nnx.jit(lambda m, b: m.loss(b, "dense")[1]["expert_load"])(model, batch))
    assert load.shape == (len(reference), 16)
    for row, layer in enumerate(reference):
        assert set(np.flatnonzero(load[row])) == forced(layer), (row, layer)
        assert load[row].sum() == B * S * 4


@pytest.mark.slow
def test_update_router_bias_sign_rule():
    cfg = ModelConfig.from_dict(BIAS_CFG)
    model = GLM(cfg, nnx.Rngs(0))
    n_rows = 7 + cfg.mtp_depth
    load = np.random.default_rng(0).integers(0, 20, size=(n_rows, 16))
    load[0] = [10, 0, 2, 0] + [3] * 12  # mean 3: experts 0 (over) -1, 1/2/3 (under) +1, the rest 0
    update_router_bias(model, jnp.asarray(load), rate=0.5)
    bias = {}
    for var, rows, layers in router_bias_slots(model):
        for idx in np.ndindex(layers.shape):
            bias[int(layers[idx])] = np.asarray(var[...])[idx]
            total = load[rows[idx]].sum(0)
            np.testing.assert_allclose(bias[int(layers[idx])], 0.5 * np.sign(total.mean() - total))
    np.testing.assert_allclose(bias[1], [-0.5, 0.5, 0.5, 0.5] + [0.0] * 12)
    np.testing.assert_allclose(bias[8], 0.5 * np.sign(load[7:].sum(0).mean() - load[7:].sum(0)))  # MTP: depths summed
    with pytest.raises(ValueError, match="rows"):
        update_router_bias(model, jnp.asarray(load[:-1]), rate=0.5)


# ------------------------------------------------------------------------------------------------ chips, hooks


@pytest.mark.parametrize("kind, chip", [("TPU v5 lite", "v5e"), ("TPU v5", "v5p"), ("TPU v5p", "v5p"),
                                        ("TPU v6 lite", "v6e"), ("NVIDIA H200", "h200"), ("cpu", None)])
def test_chip_of_device_takes_the_longest_device_kind_prefix(kind, chip):
    found = chip_of_device(type("Device", (), {"device_kind": kind})())
    assert (found.name if found else None) == chip


def test_chip_of_topology():
    assert chip_of_topology("v5p:2x2x2").hbm_bytes == 95 * GiB and chip_of_topology("V5E:2x4").name == "v5e"
    with pytest.raises(ValueError, match="unknown chip 'h200'.*v5p"):
        chip_of_topology("h200:8")  # a GPU has no TPU topology


class Messages:
    def __init__(self):
        self.lines = []

    def message(self, text):
        self.lines.append(text)


def test_hook_schedule_and_checkpoint_on_a_caught_signal():
    assert [s for s in range(1, 11) if due(s, 4, 10)] == [4, 8, 10] and [s for s in range(1, 6) if due(s, 0, 5)] == [5]
    saved, stop, log = [], {"signal": None}, Messages()
    hook = CheckpointHook(saved.append, 4, 10, stop, log)
    assert [hook(s) for s in (1, 2, 3, 4)] == [None] * 4 and saved == [4]
    stop["signal"] = "SIGTERM"
    assert hook(5) == "SIGTERM" and saved == [4, 5]  # the step the signal came in is saved, once
    assert hook(8) == "SIGTERM" and saved == [4, 5, 8]
    assert hook(10) is None and saved == [4, 5, 8, 10]  # the last step: the run is complete, nothing to stop
    assert log.lines == ["SIGTERM: checkpoint written at step 5; stopping", "SIGTERM: checkpoint written at step 8; "
                         "stopping"]


def read_scalars(directory: str) -> list[tuple[str, int, float]]:
    """(tag, step, value) of every scalar in the TensorBoard event files of `directory`: TFRecord framing (u64 length,
    u32 crc, data, u32 crc) of Event protos, read here without TensorBoard."""
    import struct

    from tensorboardX.proto.event_pb2 import Event

    out = []
    for name in sorted(os.listdir(directory)):
        with open(os.path.join(directory, name), "rb") as f:
            data = f.read()
        at = 0
        while at < len(data):
            (n,) = struct.unpack("<Q", data[at:at + 8])
            event = Event.FromString(data[at + 12:at + 12 + n])
            at += 12 + n + 4
            out += [(v.tag, event.step, v.simple_value) for v in event.summary.value]
    return out


def test_metrics_log_writes_jsonl_and_tensorboard_scalars_without_importing_torch(tmp_path):
    """Every record is one metrics.jsonl line and, but for "step", TensorBoard scalars at its step; tensorboardX
    would import torch (seconds per run) if it were let."""
    import subprocess

    records = [{"step": 1, "loss": 2.5, "lr": 0.001}, {"step": 2, "loss": 1.25, "lr": 0.002}]
    code = ("import json, sys; from glmjax.train.hooks import MetricsLog\n"
            f"with MetricsLog({str(tmp_path / 'm.jsonl')!r}, 'w', {str(tmp_path / 'tb')!r}, disable=True) as log:\n"
            f"    [log.write(r) for r in {records!r}]\n"
            "print('torch' in sys.modules)")
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and p.stdout.split() == ["False"], p.stdout + p.stderr
    assert [json.loads(line) for line in open(tmp_path / "m.jsonl")] == records
    got = sorted(read_scalars(str(tmp_path / "tb")))
    # TensorBoard scalars are float32
    assert got == sorted((k, r["step"], float(np.float32(v))) for r in records for k, v in r.items() if k != "step")
