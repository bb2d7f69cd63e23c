"""The grain data pipeline against independent references: a naive Python packer, hand-built files in every source
format, hand-counted bad records, exact state restore, process shards that add up to the one-process batches."""
import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from array_record.python.array_record_module import ArrayRecordWriter

from glmjax.config import ConfigError
from glmjax.data import ByteTokenizer, default_data_config, make_pipeline, validate_data_config
from glmjax.data.packing import Block, next_fit
from glmjax.data.pipeline import KEYS, split_indices
from glmjax.data.sources import Doc, Fields, Skip, open_source, parse

TOK = ByteTokenizer()
PAD = TOK.PAD


def cfg(path, **kw):
    return default_data_config(**{"path": str(path), "eval_fraction": 0.0, "prefetch": 0, **kw})


def words(rng, n):
    return " ".join("".join(chr(c) for c in rng.integers(97, 123, size=rng.integers(1, 8))) for _ in range(n))


def write_texts(d, texts):
    d.mkdir(parents=True, exist_ok=True)
    for i, t in enumerate(texts):
        (d / f"doc{i:03d}.txt").write_text(t)
    return d


def naive_rows(docs, S):
    """Reference packer: docs [(token list, response_start)] cut into S-token pieces, next fit, plain Python lists."""
    rows, cur = [], []

    def close():
        tok, seg, pos, mask = [], [], [], []
        for k, (piece, m) in enumerate(cur):
            tok += piece
            seg += [k + 1] * len(piece)
            pos += list(range(len(piece)))
            mask += m
        pad = S - len(tok)
        rows.append({"tokens": tok + [PAD] * pad, "segment_ids": seg + [0] * pad, "positions": pos + [0] * pad,
                     "loss_mask": mask + [0] * pad})

    for toks, rs in docs:
        toks = list(toks)
        for s in range(0, len(toks), S):
            piece = toks[s:s + S]
            if sum(len(p) for p, _ in cur) + len(piece) > S:
                close()
                cur = []
            cur.append((piece, [int(i > 0 and s + i >= rs) for i in range(len(piece))]))
    if cur:
        close()
    return rows


def block_rows(block):
    out = []
    for j in range(block.num_rows):
        row = {"tokens": np.full(block.seq_len, PAD, np.int32),
               **{k: np.zeros(block.seq_len, np.int32) for k in KEYS[1:]}}
        block.fill(j, *(row[k] for k in KEYS))
        out.append(row)
    return out


def rows_of(batches):
    return [{k: b[k][i] for k in KEYS} for b in batches for i in range(len(b["tokens"]))]


def segments(batches):
    """The token arrays of all segments, in batch / row / segment order."""
    out = []
    for r in rows_of(batches):
        for s in range(1, r["segment_ids"].max() + 1):
            out.append(r["tokens"][r["segment_ids"] == s])
    return out


def assert_batches_equal(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert set(x) == set(y) == set(KEYS)
        for k in KEYS:
            np.testing.assert_array_equal(x[k], y[k], err_msg=k)


def take_all(pipe, limit=10_000):
    out = []
    for b in pipe:
        out.append(b)
        assert len(out) < limit
    return out


# ------------------------------------------------------------------------------------------------ packing


def test_next_fit():
    assert next_fit([3, 4, 2, 5, 5, 1], 6).tolist() == [0, 1, 3, 4, 6]  # rows [3] [4 2] [5] [5 1]
    assert next_fit([], 6).tolist() == [0]


def test_block_matches_naive_packer():
    rng = np.random.default_rng(0)
    S = 16
    docs = [(rng.integers(0, 256, size=n).astype(np.int32), int(rng.integers(0, n)) if i % 3 == 0 else 0)
            for i, n in enumerate([1, 5, 15, 16, 17, 40, 3, 3, 9, 32, 2, 7, 33])]
    got = block_rows(Block(docs, S))
    want = naive_rows(docs, S)
    assert len(got) == len(want) > 5
    for g, w in zip(got, want):
        for k in KEYS:
            assert g[k].tolist() == w[k], k

    # shuffled pieces: the same pieces, each row next-fit packed in the block's order (reference on that order)
    block = Block(docs, S, np.random.default_rng(1))
    order = [(docs[d][0][s:s + S], docs[d][1] - s) for d, s in zip(block.doc, block.start)]
    assert [x.tolist() for x, _ in order] != [x.tolist() for x, _ in naive_pieces(docs, S)]
    assert sorted(x.tolist() for x, _ in order) == sorted(x.tolist() for x, _ in naive_pieces(docs, S))
    got = block_rows(block)
    want = naive_rows([(t, max(rs, 0)) for t, rs in order], S)  # each piece as a document
    assert [g["tokens"].tolist() for g in got] == [w["tokens"] for w in want]
    assert [g["loss_mask"].tolist() for g in got] == [w["loss_mask"] for w in want]


def naive_pieces(docs, S):
    return [(t[s:s + S], rs - s) for t, rs in docs for s in range(0, len(t), S)]


# ------------------------------------------------------------------------------------------------ pipeline vs naive


def test_unshuffled_pipeline_equals_naive_packing_per_slot(tmp_path):
    """shuffle=False, B=2: slot r packs documents r, r+2, ... in file order; a slot that ends gives padding rows."""
    rng = np.random.default_rng(2)
    texts = [words(rng, int(n)) for n in rng.integers(1, 30, size=11)]
    S = 48
    pipe = make_pipeline(cfg(write_texts(tmp_path / "d", texts), shuffle=False), S, 2, seed=0, num_epochs=1)
    got = take_all(pipe)
    slot_rows = [naive_rows([(TOK.encode(t), 0) for t in texts[r::2]], S) for r in range(2)]
    n = max(map(len, slot_rows))
    assert len(got) == n
    empty = {"tokens": [PAD] * S, **{k: [0] * S for k in KEYS[1:]}}
    for j, b in enumerate(got):
        for r in range(2):
            want = slot_rows[r][j] if j < len(slot_rows[r]) else empty
            for k in KEYS:
                assert b[k][r].tolist() == want[k], (j, r, k)
                assert b[k].dtype == np.int32
    st = pipe.stats
    assert st["docs_read"] == st["docs_used"] == 11 and st["skipped"] == 0
    assert st["tokens"] == sum(len(TOK.encode(t)) for t in texts)
    assert st["target_tokens"] == sum(int(b["loss_mask"].sum()) for b in got)
    assert st["rows"] == sum(map(len, slot_rows)) and st["batches"] == n
    # the pad-after-the-end view
    again = make_pipeline(cfg(tmp_path / "d", shuffle=False), S, 2, seed=0, num_epochs=1).take(n + 2)
    assert_batches_equal(again[:n], got)
    assert all((b["segment_ids"] == 0).all() and (b["tokens"] == PAD).all() for b in again[n:])


# ------------------------------------------------------------------------------------------------ sources


FORMAT_TEXTS = ["first document", "naïve café — 東京 🚀", "def f(x):\n    return x ** 2\n", "x" * 100]


def write_all_formats(d):
    d.mkdir()
    (d / "docs.jsonl").write_text("".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(FORMAT_TEXTS)))
    pq.write_table(pa.table({"text": FORMAT_TEXTS, "n": list(range(4))}), d / "docs.parquet", row_group_size=3)
    w = ArrayRecordWriter(str(d / "docs.array_record"), "group_size:1")
    for t in FORMAT_TEXTS:
        w.write(t.encode())
    w.close()
    w = ArrayRecordWriter(str(d / "json.ar"), "group_size:1")
    for t in FORMAT_TEXTS:
        w.write(json.dumps({"text": t}).encode())
    w.close()
    texts = d / "texts"
    texts.mkdir()
    for i, t in enumerate(FORMAT_TEXTS):
        (texts / f"{i}.md").write_text(t)
    (texts / ".hidden").write_text("never read")


@pytest.mark.parametrize("name,fmt", [("docs.jsonl", "auto"), ("docs.parquet", "auto"), ("docs.parquet", "parquet"),
                                      ("docs.array_record", "auto"), ("json.ar", "arrayrecord_json"),
                                      ("texts", "auto"), ("texts", "text")])
def test_every_source_format_reads_back(tmp_path, name, fmt):
    write_all_formats(tmp_path / "d")
    path = tmp_path / "d" / name
    src = open_source(str(path), fmt)
    assert len(src) == 4
    assert [parse(*src[i], Fields()) for i in range(4)] == [Doc("", t) for t in FORMAT_TEXTS]
    # through the pipeline: every document once, as BOS + UTF-8 bytes + EOS
    pipe = make_pipeline(cfg(path, format=fmt), 128, 2, seed=5, num_epochs=1)
    segs = segments(take_all(pipe))
    assert sorted(s.tolist() for s in segs) == sorted(TOK.encode(t).tolist() for t in FORMAT_TEXTS)
    assert pipe.num_docs == 4 and pipe.num_tokens >= sum(len(t.encode()) for t in FORMAT_TEXTS)


def test_mixed_directory_auto_format_and_keys(tmp_path):
    write_all_formats(tmp_path / "d")
    src = open_source(str(tmp_path / "d"))  # docs.array_record, docs.jsonl, docs.parquet, json.ar (text!), texts/*
    assert len(src) == 4 * 4 + 1  # json.ar has no known extension: one text document
    assert src.key(0) == "docs.array_record:0" and src.key(4) == "docs.jsonl:1" and src.key(16) == "texts/3.md"
    assert len(set(src.key_hashes().tolist())) == 17


def test_default_corpus_is_the_stdlib():
    pipe = make_pipeline(default_data_config(prefetch=0), 64, 4, seed=0)
    assert pipe.source_name.startswith("stdlib:") and pipe.num_docs > 300 and pipe.num_tokens > 2_000_000
    b = next(pipe)
    assert set(b) == set(KEYS) and all(v.shape == (4, 64) and v.dtype == np.int32 for v in b.values())
    assert (b["segment_ids"] > 0).all()  # code files are long: rows are full
    keys = [pipe.source.key(int(i)) for i in pipe.indices]
    assert all(k.endswith(".py") and not k.startswith(("site-packages", "test/")) for k in keys)
    files = b"\0".join(pipe.source[int(i)][1] for i in pipe.indices)
    for seg in segments([b]):  # every packed piece is a stretch of a stdlib file
        assert seg[seg < 256].astype(np.uint8).tobytes() in files


# ------------------------------------------------------------------------------------------------ bad records


def test_bad_records_are_skipped_and_counted(tmp_path):
    d = tmp_path / "d"
    d.mkdir()
    lines = [b'{"text": "good one"}', b'{"text": ""}', b'{"text": "   "}', b"not json", b"[1, 2]", b'{"body": "x"}',
             b'{"text": 7}', b'{"text": "\xff\xfe"}', b'{"text": "' + b"y" * 60 + b'"}', b'{"text": "good two"}', b"",
             b"\r"]
    (d / "a.jsonl").write_bytes(b"\n".join(lines) + b"\n")  # the two blank lines are not records
    (d / "b.txt").write_bytes(b"\xff\xfe not utf-8")
    (d / "c.txt").write_text("   \n")
    (d / "e.txt").write_text("good three")
    pq.write_table(pa.table({"text": ["good four", None, ""]}), d / "f.parquet")
    pipe = make_pipeline(cfg(d, max_doc_chars=50), 64, 2, seed=0, num_epochs=1)
    segs = segments(take_all(pipe))
    assert sorted(TOK.decode(s) for s in segs) == ["good four", "good one", "good three", "good two"]
    assert pipe.stats == {**pipe.stats, "docs_read": 16, "docs_used": 4, "skipped": 12, "skipped_empty": 4,
                          "skipped_undecodable": 2, "skipped_too_long": 1, "skipped_malformed": 5}


def test_unusable_data_fails_at_start(tmp_path):
    (tmp_path / "a.jsonl").write_text('{"body": "x"}\n{"body": "y"}\n')
    with pytest.raises(ValueError, match=r"none of the 2 train records .*malformed.*'text'"):
        make_pipeline(cfg(tmp_path / "a.jsonl"), 16, 1, seed=0)
    assert make_pipeline(cfg(tmp_path / "a.jsonl", text_field="body"), 16, 1, seed=0).num_docs == 2


# ------------------------------------------------------------------------------------------------ SFT


def test_sft_loss_mask_covers_exactly_the_response(tmp_path):
    rng = np.random.default_rng(3)
    pairs = [(words(rng, int(rng.integers(0, 6))), words(rng, int(rng.integers(1, 6)))) for _ in range(30)]
    path = tmp_path / "sft.jsonl"
    path.write_text("".join(json.dumps({"q": p, "a": r}) + "\n" for p, r in pairs))
    data = cfg(path, prompt_field="q", response_field="a")
    # S large: every document is one segment; mask = 1 exactly on the response bytes and the closing EOS
    batches = take_all(make_pipeline(data, 256, 4, seed=1, num_epochs=1))
    seen = []
    for r in rows_of(batches):
        for s in range(1, r["segment_ids"].max() + 1):
            toks, mask = r["tokens"][r["segment_ids"] == s], r["loss_mask"][r["segment_ids"] == s]
            prompt = [p for p, a in pairs if TOK.encode(p + a).tolist() == toks.tolist()]
            assert prompt, "the segment is BOS + prompt + response + EOS"
            n_prompt = 1 + len(prompt[0].encode())
            assert mask.tolist() == [0] * n_prompt + [1] * (len(toks) - n_prompt)
            assert TOK.decode(toks[mask == 1]) == TOK.decode(toks[n_prompt:])
            seen.append(toks.tolist())
    assert sorted(seen) == sorted(TOK.encode(p + a).tolist() for p, a in pairs)
    # S small: documents are cut; the mask is the naive packer's (response part, never a segment's first token)
    S = 8
    batches = take_all(make_pipeline({**data.to_dict(), "shuffle": False}, S, 1, seed=1, num_epochs=1))
    docs = [(TOK.encode(p + a), 1 + len(p.encode())) for p, a in pairs]
    want = naive_rows(docs, S)
    assert [r["loss_mask"].tolist() for r in rows_of(batches)] == [w["loss_mask"] for w in want]
    assert [r["tokens"].tolist() for r in rows_of(batches)] == [w["tokens"] for w in want]


def test_pretraining_mask_is_every_token_but_segment_starts(tmp_path):
    rng = np.random.default_rng(4)
    d = write_texts(tmp_path / "d", [words(rng, int(n)) for n in rng.integers(1, 40, size=20)])
    for b in take_all(make_pipeline(cfg(d), 32, 4, seed=0, num_epochs=1)):
        np.testing.assert_array_equal(b["loss_mask"], (b["segment_ids"] > 0) & (b["positions"] > 0))


# ------------------------------------------------------------------------------------------------ order, state, shards


@pytest.fixture
def corpus(tmp_path):
    rng = np.random.default_rng(5)
    return write_texts(tmp_path / "c", [f"<{i}> " + words(rng, int(n)) for i, n in enumerate(rng.integers(1, 60, 40))])


def small(corpus, **kw):
    return cfg(corpus, shuffle_window_tokens=4 * 64 * 3, **kw)  # a few documents per block: many blocks


def test_same_seed_same_batches_other_seed_other_order(corpus):
    a = make_pipeline(small(corpus), 64, 4, seed=7).take(30)
    b = make_pipeline(small(corpus), 64, 4, seed=7).take(30)
    c = make_pipeline(small(corpus), 64, 4, seed=8).take(30)
    assert_batches_equal(a, b)
    assert not all(np.array_equal(x["tokens"], y["tokens"]) for x, y in zip(a, c))
    one = [sorted(s.tolist() for s in segments(take_all(make_pipeline(small(corpus), 64, 4, seed=s, num_epochs=1))))
           for s in (7, 8)]
    assert one[0] == one[1]  # one epoch: the same pieces in another order


def recording(pipe):
    """Record the source indices the pipeline reads (after construction)."""
    src, seen = pipe.source, []

    class Recorder:
        def __getitem__(self, i):
            seen.append(i)
            return src[i]

        def __getattr__(self, name):
            return getattr(src, name)

    pipe.source = Recorder()
    return pipe, seen


def test_epochs_repeat_every_document_with_a_new_order(corpus):
    texts = [p.read_text() for p in sorted(corpus.iterdir())]
    pipe, reads = recording(make_pipeline(cfg(corpus, shuffle_window_tokens=1), 512, 1, seed=3, num_epochs=2))
    segs = segments(take_all(pipe))
    assert sorted(TOK.decode(s) for s in segs) == sorted(texts * 2)
    first, second = reads[:len(texts)], reads[len(texts):]
    assert sorted(first) == sorted(second) == list(range(len(texts)))
    assert first != second and first != sorted(first)


def test_documents_are_tokenized_in_batches_once_each(corpus):
    calls = []

    class Counting(ByteTokenizer):
        def encode_batch(self, texts, bos=True, eos=True):
            calls.append(len(texts))
            return super().encode_batch(texts, bos, eos)

    data = cfg(corpus, shuffle_window_tokens=2 * 1000)
    pipe = make_pipeline(data, 64, 2, seed=4, num_epochs=1, tokenizer=Counting())
    calls.clear()  # the start-up check encodes one document
    got = take_all(pipe)
    assert sum(calls) == 40 and len(calls) < 40 / 2 and max(calls) > 2  # each document once, several per call
    assert_batches_equal(got, take_all(make_pipeline(data, 64, 2, seed=4, num_epochs=1)))


@pytest.mark.parametrize("prefetch", [0, 2])
def test_state_restore_mid_epoch_gives_identical_batches(corpus, prefetch):
    data = small(corpus, prefetch=prefetch)
    run = make_pipeline(data, 64, 4, seed=1)
    head = run.take(13)
    state = json.loads(json.dumps(run.get_state()))
    stats = run.stats
    tail = run.take(40)  # crosses blocks and epochs (40 documents, ~3 rows per slot per block)
    resumed = make_pipeline(data, 64, 4, seed=1)
    resumed.set_state(state)
    assert resumed.stats == stats
    assert_batches_equal(resumed.take(40), tail)
    assert resumed.stats == run.stats
    assert state["slots"] != [[0, 0, 0]] * 4 and len(head) == 13
    # negative controls: a state from another seed / batch size is refused, not silently misused
    for other in (make_pipeline(data, 64, 4, seed=2), make_pipeline(data, 64, 2, seed=1)):
        with pytest.raises(ValueError, match="different pipeline"):
            other.set_state(state)
    run.close()
    resumed.close()


def test_process_shards_are_disjoint_and_add_up_to_the_global_batch(corpus):
    data = small(corpus)
    glob = make_pipeline(data, 64, 4, seed=3, num_epochs=1).take(60)
    for P in (2, 4):
        parts, reads = zip(*(recording(make_pipeline(data, 64, 4, seed=3, process_index=p, process_count=P,
                                                   num_epochs=1)) for p in range(P)))
        shards = [p.take(60) for p in parts]
        assert all(b["tokens"].shape == (4 // P, 64) for s in shards for b in s)
        assert_batches_equal([{k: np.concatenate([s[i][k] for s in shards]) for k in KEYS} for i in range(60)], glob)
        reads = [set(r) for r in reads]
        assert sum(map(len, reads)) == len(set().union(*reads)) == 40  # each document read by one process
    assert (glob[-1]["segment_ids"] == 0).all()  # 60 batches cover the epoch
    with pytest.raises(ValueError, match="divisible"):
        make_pipeline(data, 64, 4, seed=3, process_count=3)


# ------------------------------------------------------------------------------------------------ split, config


def test_split_is_a_stable_partition_by_document(tmp_path, corpus):
    data = cfg(corpus, eval_fraction=0.25)
    tr = make_pipeline(data, 64, 2, seed=0)
    ev = make_pipeline(data, 64, 2, seed=9, split="eval")
    keys = lambda p: {p.source.key(int(i)) for i in p.indices}  # noqa: E731
    k_tr, k_ev = keys(tr), keys(ev)
    assert not k_tr & k_ev and len(k_tr | k_ev) == 40 and 3 <= len(k_ev) <= 20
    assert keys(make_pipeline(data, 64, 2, seed=5, split="eval")) == k_ev  # independent of the seed
    (corpus / "zzz_new.txt").write_text("a new document")
    (corpus / "aaa_new.txt").write_text("another new document")
    grown = keys(make_pipeline(data, 64, 2, seed=0, split="eval"))
    assert grown - {"zzz_new.txt", "aaa_new.txt"} == k_ev  # other files do not move documents across the split
    # eval is a finite pass over exactly the held-out documents
    segs = segments(take_all(make_pipeline({**data.to_dict(), "shuffle_window_tokens": 1 << 20}, 4096, 2, seed=0,
                                           split="eval")))
    assert sorted(TOK.decode(s) for s in segs) == sorted((corpus / k).read_text() for k in grown)
    # tiny corpora: at least one document on each side
    h = np.array([5, 9], np.uint64) << np.uint64(60)
    assert split_indices(h, 0.01, "eval").tolist() == [0] and split_indices(h, 0.01, "train").tolist() == [1]
    assert split_indices(h, 0.0, "eval").tolist() == [] and split_indices(h, 0.99, "train").tolist() == [1]


@pytest.mark.parametrize("field,value,match", [
    ("format", "csv", "data.format='csv': must be one of"),
    ("path", "/nonexistent/x", "data.path='/nonexistent/x': does not exist"),
    ("text_field", "", "data.text_field='': must be a non-empty string"),
    ("prompt_field", "q", "data.response_field=None: SFT needs both"),
    ("max_doc_chars", 0, "data.max_doc_chars=0: must be an integer >= 1"),
    ("max_docs", 1, "data.max_docs=1: must be >= 2 when eval_fraction > 0"),
    ("eval_fraction", 1.0, "data.eval_fraction=1.0: must be a number in"),
    ("shuffle", "yes", "data.shuffle='yes': must be True or False"),
    ("shuffle_window_tokens", -1, "data.shuffle_window_tokens=-1"),
    ("prefetch", 1.5, "data.prefetch=1.5"),
    ("tokenizer", "gpt2", "data.tokenizer='gpt2': must be one of .*'byte'.* or 'hf:DIR'"),
    ("too_long", "cut", "data.too_long='cut': must be one of .*'skip', 'truncate'"),
])
def test_invalid_data_configs_name_the_field(field, value, match):
    with pytest.raises(ConfigError, match=match.replace("(", r"\(").replace("[", r"\[")):
        validate_data_config({field: value})


def test_more_config_rules(tmp_path):
    validate_data_config(default_data_config())
    with pytest.raises(ConfigError, match="data.colour: unknown field"):
        validate_data_config({"colour": 1})
    with pytest.raises(ConfigError, match="data.prompt_field='q': SFT needs a data.path"):
        validate_data_config({"prompt_field": "q", "response_field": "a"})
    (tmp_path / "x.txt").write_text("x")
    with pytest.raises(ConfigError, match="data.format='text': plain-text records have no prompt/response"):
        validate_data_config({"path": str(tmp_path), "format": "text", "prompt_field": "q", "response_field": "a"})
    with pytest.raises(ValueError, match="no held-out documents, and evaluation needs some"):
        make_pipeline(cfg(tmp_path), 16, 1, seed=0, split="eval")


def test_parse_reports_reasons():
    f = Fields(max_doc_chars=5)
    assert parse("text", b"abc", f) == Doc("", "abc")
    assert parse("text", b"abcdef", f).reason == "too_long"
    assert parse("row", {"text": b"\xff"}, f).reason == "undecodable"
    assert parse("row", {"text": None}, f).reason == "malformed"
    assert isinstance(parse("json", b"{", f), Skip)
    sft = Fields(prompt_field="q", response_field="a")
    assert parse("json", b'{"q": "", "a": "yes"}', sft) == Doc("", "yes")
    assert parse("json", b'{"q": "hi", "a": " "}', sft).reason == "empty"
