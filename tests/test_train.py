"""Data pipeline invariants, the router-bias row mapping, and a short real training run of the tiny config."""
import json
import os
import sys

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from glmjax.config import ModelConfig
from glmjax.data import ByteTokenizer, Packer, load_corpus, pack_rows, split_documents
from glmjax.data.packing import chunks
from glmjax.model.transformer import GLM, Batch
from glmjax.train import train
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


# ------------------------------------------------------------------------------------------------ packing


def check_rows(rows, seq_len):
    """Row invariants; returns the documents (pieces) found in the rows, in order."""
    pieces = []
    for r in rows:
        tok, seg, pos = r["tokens"], r["segment_ids"], r["positions"]
        assert tok.shape == seg.shape == pos.shape == (seq_len,)
        used = seg > 0
        n_used = int(used.sum())
        assert used[:n_used].all() and not used[n_used:].any(), "padding only at the tail"
        assert (tok[~used] == TOK.PAD).all() and (pos[~used] == 0).all()
        assert seg[0] == 1 and (np.diff(seg[:n_used]) >= 0).all() and (np.diff(seg[:n_used]) <= 1).all()
        for s in range(1, seg.max() + 1):
            where = np.flatnonzero(seg == s)
            assert (pos[where] == np.arange(len(where))).all(), "positions restart at 0 for each document"
            pieces.append(tok[where])
    return pieces


def test_pack_rows_invariants_and_no_token_lost():
    rng = np.random.default_rng(0)
    S = 32
    docs = [rng.integers(0, 256, size=n).astype(np.int32) for n in [1, 5, 31, 32, 33, 64, 100, 7, 7, 7, 20, 13, 2]]
    rows = list(pack_rows(docs, S))
    pieces = check_rows(rows, S)
    expected = [c for d in docs for c in chunks(d, S)]
    assert len(pieces) == len(expected) and all(np.array_equal(a, b) for a, b in zip(pieces, expected))
    assert sum(int((r["segment_ids"] > 0).sum()) for r in rows) == sum(len(d) for d in docs)
    assert all(len(p) <= S for p in pieces)
    # greedy: each row was closed only because the next piece did not fit
    for r, nxt in zip(rows, rows[1:]):
        assert (r["segment_ids"] > 0).sum() + (nxt["segment_ids"] == 1).sum() > S


def test_packer_batches_are_deterministic_and_cover_the_corpus():
    rng = np.random.default_rng(1)
    texts = ["".join(chr(c) for c in rng.integers(97, 123, size=n)) for n in rng.integers(1, 300, size=40)]
    p = Packer(texts, TOK, seq_len=64, batch_size=4, seed=3)
    b1 = [b for _, b in zip(range(6), p)]
    b2 = [b for _, b in zip(range(6), Packer(texts, TOK, 64, 4, seed=3))]
    b3 = [b for _, b in zip(range(6), Packer(texts, TOK, 64, 4, seed=4))]
    for a, b in zip(b1, b2):
        assert all(np.array_equal(a[k], b[k]) for k in a)
    assert not all(np.array_equal(a["tokens"], b["tokens"]) for a, b in zip(b1, b3))
    for b in b1:
        assert set(b) == {"tokens", "segment_ids", "positions"}
        assert all(v.shape == (4, 64) and v.dtype == np.int32 for v in b.values())
        check_rows([dict(tokens=b["tokens"][i], segment_ids=b["segment_ids"][i], positions=b["positions"][i])
                    for i in range(4)], 64)
    # the eval view: every token of every document exactly once, in order; a short last batch is padded
    ev = p.batches()
    rows = [{k: b[k][i] for k in b} for b in ev for i in range(4)]
    got = np.concatenate(check_rows(rows, 64))
    assert np.array_equal(got, np.concatenate([TOK.encode(t) for t in texts]))


def test_split_documents_is_a_deterministic_partition():
    docs = [f"doc{i}" for i in range(100)]
    tr, ev = split_documents(docs, 0.1, seed=0)
    assert len(ev) == 10 and len(tr) == 90 and sorted(tr + ev) == sorted(docs)
    assert (tr, ev) == split_documents(docs, 0.1, seed=0)
    assert ev != split_documents(docs, 0.1, seed=1)[1]
    assert split_documents(docs[:3], 0.01, seed=0)[1] and split_documents(docs, 0.0, 0)[1] == []


# ------------------------------------------------------------------------------------------------ corpus


def test_stdlib_corpus():
    c = load_corpus(max_docs=20)
    names = [d.name for d in c.documents]
    assert len(names) == 20 and names == sorted(names) and all(n.endswith(".py") for n in names)
    full = load_corpus()
    assert not any(n.startswith(("site-packages", "test/")) for n in (d.name for d in full.documents))
    assert sum(len(d.text) for d in full.documents) > 1_000_000


def test_file_corpus_text_jsonl_and_skips(tmp_path):
    (tmp_path / "a.txt").write_text("first document")
    (tmp_path / "b.txt").write_bytes(b"\xff\xfe not utf-8")
    (tmp_path / "c.txt").write_text("   \n")
    (tmp_path / "d.jsonl").write_text('{"text": "one"}\nnot json\n{"body": "no text"}\n\n{"text": "two"}\n')
    c = load_corpus(str(tmp_path))
    assert [d.text for d in c.documents] == ["first document", "one", "two"]
    assert c.skipped == 4  # undecodable b.txt, empty c.txt, two malformed JSONL lines
    assert [d.text for d in load_corpus(str(tmp_path / "d.jsonl")).documents] == ["one", "two"]
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_corpus(str(tmp_path / "missing"))


# ------------------------------------------------------------------------------------------------ router bias

# 8 layers: 0 dense; units (F S) x3 = layers 1..6 in one stack of 3 units; layer 7 (F) a stack of its own; + MTP.
BIAS_CFG = dict(tiny.get_config().model.to_dict(), num_hidden_layers=8, n_group=1, topk_group=1, mtp_depth=2,
                indexer_types=["full", "full", "shared", "full", "shared", "full", "shared", "full"])


def forced(layer, E=16, K=4):
    return set((layer + np.arange(K)) % E)


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


# ------------------------------------------------------------------------------------------------ training


@pytest.mark.slow
def test_tiny_training_run_loss_falls(tmp_path):
    """40 steps of the tiny model (sparse attention, MTP, group-limited routing) on the stdlib corpus: the total
    loss (LM + MTP) must fall by at least 2.0 nats from its ~6.9 start, the held-out loss must be below 4.5."""
    c = tiny.get_config()
    c.model.mtp_depth = 1
    c.train.update(steps=40, batch_size=4, seq_len=64, log_every=10, eval_every=0, eval_batches=2, max_docs=100)
    c.optim.warmup_steps = 10
    summary = train(c, str(tmp_path), progress=False)
    assert summary["first_loss"] > 6.0
    assert summary["last_loss"] < summary["first_loss"] - 2.0, summary
    assert summary["eval_loss"] < 4.5, summary
    records = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    steps = [r["step"] for r in records if "loss" in r]
    assert steps == [1, 10, 20, 30, 40]
    assert all(np.isfinite(r["loss"]) and r["tokens_per_s"] > 0 for r in records if "loss" in r)
    assert [r["step"] for r in records if "eval_loss" in r] == [40]
    assert json.load(open(tmp_path / "config.json"))["train"]["steps"] == 40
