"""Long-context retrieval: the generated RULER tasks against hand-written prompts, RULER's string match, the needle
recall against hand-counted cases and two indexers whose answer is known (one that scores the needle highest: 1.0;
random scores: the closed form of a random top-k), and `glmjax-eval` on a briefly trained stage workdir and on an
import."""
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import glmjax.model.indexer as indexer_module
from glmjax.eval import needles, retrieval
from glmjax.eval.retrieval import FILLER, PASSKEY_HEADER, make_example, min_length, string_match_all
from glmjax.model import GLM
from helpers import tiny

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_passkey_is_the_landmark_prompt_at_the_asked_length_and_depth():
    rng = np.random.default_rng(0)
    for length, depth in ((300, 0.0), (400, 1.0), (1000, 0.5)):
        e = make_example("passkey", length, depth, rng)
        (k,) = e.answers
        assert len(k) == 5 and k.isdigit() and e.response == f" {k}."
        needle = f"The pass key is {k}. Remember it. {k} is the pass key. "
        question = "\nWhat is the pass key? The pass key is"
        room = length - len(PASSKEY_HEADER) - len(needle) - len(question)
        filler = (FILLER * 20)[:room]
        # hand-placed: depth 0 right after the header, 1 at the filler's last sentence start, 0.5 at the middle one
        starts = [0] + [i + 2 for i in range(room - 1) if filler[i:i + 2] == ". "]
        at = {0.0: 0, 1.0: starts[-1], 0.5: starts[round((len(starts) - 1) / 2)]}[depth]
        assert e.prompt == PASSKEY_HEADER + filler[:at] + needle + filler[at:] + question
        assert len(e.prompt.encode()) == length
        (span,) = e.needles
        assert e.prompt.encode()[span[0]:span[1]].decode() == needle


def test_niah_vt_and_the_split_pools():
    rng = np.random.default_rng(1)
    e = make_example("niah_multikey", 900, 0.25, rng, "test")
    (value,) = e.answers
    assert e.prompt.count("One of the special magic numbers for ") == 4  # the needle and 3 distractors
    (span,) = e.needles  # the distractors are no needles
    needle = e.prompt.encode()[span[0]:span[1]].decode()
    key = needle.split(" for ")[1].split(" is:")[0]
    assert needle == f"One of the special magic numbers for {key} is: {value}. "
    assert e.prompt.endswith(f"The special magic numbers for {key} mentioned in the provided text are")
    assert retrieval.in_pool(value, "test") and not retrieval.in_pool(value, "train")

    v = make_example("vt", 700, 0.0, rng)
    names = v.answers
    statements = [v.prompt.encode()[s:t].decode() for s, t in v.needles]
    value = statements[0].split("= ")[1].rstrip(". ")
    assert statements == [f"VAR {names[0]} = {value}. "] + [f"VAR {b} = VAR {a}. " for a, b in zip(names, names[1:])]
    assert [s for s, _ in v.needles] == sorted(s for s, _ in v.needles)  # the chain in order
    assert v.prompt.endswith(f"5 variables are assigned the value {value}, they are:")
    assert v.response == " " + ", ".join(names) + "."

    for task in retrieval.TASKS:  # no answer of one split in the other, whatever the seeds
        length = [min_length(task) + 50]
        train = {a for x in retrieval.examples(task, 150, length, [0.5], 7, "train") for a in x.answers}
        test = {a for x in retrieval.examples(task, 150, length, [0.5], 8, "test") for a in x.answers}
        assert train and test and not train & test, task
    with pytest.raises(ValueError, match="needs at least 252 bytes"):
        make_example("passkey", 200, 0.5, rng)
    with pytest.raises(ValueError, match="task 'nope': must be one of"):
        make_example("nope", 500, 0.5, rng)


def test_training_documents_are_whole_examples_of_the_train_pool(tmp_path):
    path = retrieval.training_file(("passkey", "vt"), 20, (256, 512), 3, "prompt_response", str(tmp_path))
    rows = [json.loads(line) for line in open(path)]
    assert len(rows) == 20 and all(set(r) == {"prompt", "response"} for r in rows)
    for i, r in enumerate(rows):
        assert max(256, min_length(("passkey", "vt")[i % 2])) <= len(r["prompt"].encode()) <= 512
        assert all(retrieval.in_pool(a, "train") for a in r["response"].strip(" .").split(", "))
    mtime = os.path.getmtime(path)
    assert retrieval.training_file(("passkey", "vt"), 20, (256, 512), 3, "prompt_response", str(tmp_path)) == path
    assert os.path.getmtime(path) == mtime and os.listdir(tmp_path) == [os.path.basename(path)]  # written once
    text = retrieval.write_jsonl(str(tmp_path / "t.jsonl"), ["passkey"], 3, (300, 300), 0)
    assert text == 307 and all(len(json.loads(x)["text"]) == 307 for x in open(tmp_path / "t.jsonl"))  # + " 12345."


def test_string_match_is_rulers():
    assert string_match_all(" 12345. The pass", ["12345"]) == 1.0
    assert string_match_all(" 1234", ["12345"]) == 0.0
    assert string_match_all(" abcde, FGHIJ.", ["ABCDE", "fghij", "KLMNO", "PQRST"]) == 0.5  # case-insensitive


def test_needle_recall_counts_query_needle_pairs():
    # S = 6, k = 2, a needle at positions [1, 3): the queries from position 2 on (4 of them) x 2 positions = 8 pairs
    topk = np.array([[[0, -1], [1, 0], [2, 1], [1, 2], [0, 4], [2, 5]]])
    assert needles.needle_recall(topk, [[(1, 3)]])[0] == 5 / 8  # q2: 1, 2; q3: 1, 2; q4: neither; q5: 2
    assert needles.needle_recall(topk, [[(1, 3), (4, 5)]])[0] == (5 + 1) / (8 + 2)  # + q4: 4; q5: -
    assert np.isnan(needles.needle_recall(topk, [[]])[0])  # no needle: no pair
    with pytest.raises(ValueError, match="outside"):
        needles.needle_recall(topk, [[(5, 7)]])


@pytest.fixture(scope="module")
def model():
    return GLM(tiny(num_hidden_layers=2, indexer_types=("full", "full"), index_topk=64, max_position_embeddings=512,
                    num_nextn_predict_layers=0), nnx.Rngs(0))


def test_needle_recall_of_known_indexers(model, monkeypatch):
    """An indexer that scores the needle's keys highest finds it for every query after it (1.0, both layers); one
    with random scores, the closed form of a random top-k: min(k, q + 1) / (q + 1) per pair, averaged."""
    exs = retrieval.examples("passkey", 4, [300], [0.1, 0.6], 3)
    ids = np.stack([np.frombuffer(e.prompt.encode(), np.uint8).astype(np.int32) for e in exs])
    spans = [list(e.needles) for e in exs]
    mask = np.zeros(ids.shape, bool)
    for b, row in enumerate(spans):
        for s, t in row:
            mask[b, s:t] = True
    logits = indexer_module.index_logits

    def needle_first(q, k, w):  # key columns are cache slots: the needle's score 1e4 above any other
        return logits(q, k, w) + 1e4 * jnp.asarray(mask)[:, None, :k.shape[1]]

    monkeypatch.setattr(indexer_module, "index_logits", needle_first)
    np.testing.assert_array_equal(needles.needle_recall(needles.index_topk(model, ids)[0], spans), 1.0)
    got = needles.index_topk(model, ids)
    assert got.shape == (2, 4, 300, 64)  # k >= the needle statement (59 bytes): room for all of it
    assert all(np.all(needles.needle_recall(got[f], spans) == 1.0) for f in range(2))

    def random_scores(q, k, w):
        return jax.random.normal(jax.random.key(0), (q.shape[0], q.shape[1], k.shape[1]))

    monkeypatch.setattr(indexer_module, "index_logits", random_scores)
    ids = ids[:, :299]  # another shape: a new trace with the new scores
    got = needles.needle_recall(needles.index_topk(model, ids)[0], spans)
    q = np.arange(299)
    want = [np.mean([min(64, i + 1) / (i + 1) for i in q[t - 1:] for _ in range(t - s)]) for (s, t), in spans]
    np.testing.assert_allclose(got, want, rtol=0.1)
    assert np.all(np.asarray(want) < 0.5)  # far from the needle-first indexer's 1.0


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_glmjax_eval_on_a_stage_workdir_and_an_import(tmp_path, capsys):
    """A micro model trained briefly on passkey documents (train.py's `run`, the dense pretrain stage): glmjax-eval
    writes the accuracy of both modes and each indexer's needle recall for every task x length, as JSON and
    Markdown; on the import of the same weights the same numbers; a bad task and a too short length are one line."""
    from glmjax.cli.eval import main
    from glmjax.train import run
    from test_cli import imported_checkpoint
    sys.path.insert(0, ROOT)
    from configs import tiny as tiny_config

    data = str(tmp_path / "passkey.jsonl")
    retrieval.write_jsonl(data, ["passkey"], 200, (256, 300), 0)
    c = tiny_config.get_config()
    c.model.update(num_hidden_layers=2, indexer_types=("full", "full"), num_nextn_predict_layers=0, index_topk=32,
                   max_position_embeddings=512)
    c.train.update(seq_len=320, batch_size=4, steps=10, mode="dense", eval_batches=0, checkpoint_every=10)
    c.data.update(path=data, eval_fraction=0.0)
    c.optim.warmup_steps = 2
    c.parallel.num_devices = 1  # one device (the 8 virtual CPU devices: tests/test_parallel.py)
    run(c, str(tmp_path / "run"), progress=False)
    capsys.readouterr()

    args = ["--tasks", "passkey", "niah_single", "--lengths", "360", "400", "--depths", "0", "1", "--samples", "1",
            "--no-progress", "--compilation-cache", ""]
    assert main(["--checkpoint", str(tmp_path / "run"), "--out", str(tmp_path / "eval"), *args]) == 0
    table = capsys.readouterr().out
    result = json.load(open(tmp_path / "eval" / "retrieval.json"))
    assert open(tmp_path / "eval" / "retrieval.md").read() == table
    assert "stage pretrain, step 10" in result["checkpoint"]
    for mode in ("dense", "sparse"):
        for task in ("passkey", "niah_single"):
            assert set(result["accuracy"][mode][task]) == {"360", "400"}
            assert all(0 <= a <= 1 for a in result["accuracy"][mode][task].values())
            assert f"| {mode} accuracy | {task} | " in table
    assert set(result["needle_recall"]) == {"layer 0", "layer 1"}
    assert all(0 < r <= 1 for r in result["needle_recall"]["layer 0"]["passkey"].values())

    from glmjax.resolve import load_model
    imported = imported_checkpoint(load_model(str(tmp_path / "run"), "--checkpoint")[0], str(tmp_path / "import"))
    assert main(["--checkpoint", imported, "--out", str(tmp_path / "eval2"), *args]) == 0
    again = json.load(open(tmp_path / "eval2" / "retrieval.json"))
    assert {k: again[k] for k in ("accuracy", "by_depth", "needle_recall")} == \
        {k: result[k] for k in ("accuracy", "by_depth", "needle_recall")}
    capsys.readouterr()

    assert main(["--checkpoint", imported, "--tasks", "haystack"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == \
        [f"error: task 'haystack': must be one of {retrieval.TASKS}"]
    assert main(["--checkpoint", imported, "--lengths", "100"]) == 2
    assert "error: length 100: task 'passkey' needs at least" in capsys.readouterr().err
