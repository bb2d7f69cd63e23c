"""Hugging Face tokenizers, chat data and pre-tokenized data against transformers as the independent reference:
`AutoTokenizer.from_pretrained(dir)` encodings, `apply_chat_template(..., return_assistant_tokens_mask=True)` ids and
masks, packing counts for too-long conversations, the pre-tokenized round trip and exact resume."""
import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hf_tokenizer_fixture import CHAT_TEMPLATE, PLAIN_TEMPLATE, conversations, corpus_lines, write_tokenizer

from glmjax.config import ConfigError
from glmjax.data import default_data_config, make_pipeline, make_tokenizer, validate_data_config
from glmjax.data.chat import ChatTemplate, assistant_mask, conversation
from glmjax.data.hf_tokenizer import HFTokenizer
from glmjax.data.pipeline import KEYS
from glmjax.data.pretokenized import write_tokens
from glmjax.data.sources import DataError, Skip


@pytest.fixture(scope="module")
def hf(tok_dir):
    return make_tokenizer("hf:" + tok_dir)


def reference_chat(ref, record):
    out = ref.apply_chat_template(record["messages"], tools=record.get("tools"), tokenize=True, return_dict=True,
                                  return_assistant_tokens_mask=True)
    return list(out["input_ids"]), list(out["assistant_masks"])


def chat_cfg(path, tok_dir, **kw):
    return default_data_config(**{"path": str(path), "eval_fraction": 0.0, "prefetch": 0, "tokenizer": "hf:" + tok_dir,
                                  "messages_field": "messages", "shuffle_window_tokens": 1 << 12, **kw})


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
    return path


def take_all(pipe, limit=1000):
    out = []
    for b in pipe:
        out.append(b)
        assert len(out) < limit
    return out


def segments(batches):
    """(tokens, loss_mask) of every packed segment."""
    out = []
    for b in batches:
        for r in range(len(b["tokens"])):
            for s in range(1, b["segment_ids"][r].max() + 1):
                at = b["segment_ids"][r] == s
                out.append((b["tokens"][r][at].tolist(), b["loss_mask"][r][at].tolist()))
    return out


def many_conversations(n, seed=0):
    rng = np.random.default_rng(seed)
    lines = corpus_lines()
    recs = []
    for _ in range(n):
        msgs = [{"role": "system", "content": lines[rng.integers(len(lines))]}] if rng.random() < 0.3 else []
        for _ in range(int(rng.integers(1, 4))):
            msgs += [{"role": "user", "content": lines[rng.integers(len(lines))]},
                     {"role": "assistant", "content": lines[rng.integers(len(lines))]}]
        recs.append({"messages": msgs})
    return recs


# ------------------------------------------------------------------------------------------------ tokenizer


def test_hf_tokenizer_encodes_like_transformers(hf, ref):
    assert (hf.vocab_size, hf.bos_id, hf.eos_id, hf.pad_id) == (len(ref), ref.bos_token_id, ref.eos_token_id,
                                                                ref.pad_token_id)
    texts = corpus_lines()[:50] + ["naïve café — 東京 🚀", "<|user|>hi<|assistant|>yo<|eos|>", "", "  \t\n x"]
    for t in texts:
        plain = ref(t, add_special_tokens=False)["input_ids"]
        assert hf.encode(t, bos=False, eos=False).tolist() == plain
        assert hf.encode(t, bos=True, eos=False).tolist() == ref(t)["input_ids"]  # its post-processor adds BOS
        assert hf.encode(t).tolist() == ref(t)["input_ids"] + [ref.eos_token_id]
        assert hf.decode(hf.encode(t)) == ref.decode(plain, skip_special_tokens=True)
    assert [x.tolist() for x in hf.encode_batch(texts, bos=False)] == \
        [x + [ref.eos_token_id] for x in ref(texts, add_special_tokens=False)["input_ids"]]
    with pytest.raises(ValueError, match="out of range"):
        hf.decode([hf.vocab_size])


def test_hf_tokenizer_errors_name_the_file(tmp_path, tok_dir):
    with pytest.raises(DataError, match="has no tokenizer.json"):
        HFTokenizer(str(tmp_path))
    with pytest.raises(ConfigError, match=r"data.tokenizer='hf:.*': '.*' has no tokenizer.json"):
        validate_data_config({"tokenizer": f"hf:{tmp_path}"})
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(DataError, match="tokenizer.json' cannot be loaded"):
        HFTokenizer(str(tmp_path))
    bad = write_tokenizer(tmp_path / "bad")
    cfg = json.loads(open(f"{bad}/tokenizer_config.json").read())
    json.dump({**cfg, "eos_token": "<|nope|>"}, open(f"{bad}/tokenizer_config.json", "w"))
    with pytest.raises(DataError, match=r"eos_token='<\|nope\|>' is not a token of tokenizer.json"):
        HFTokenizer(bad)
    del cfg["eos_token"], cfg["pad_token"]
    json.dump(cfg, open(f"{bad}/tokenizer_config.json", "w"))
    with pytest.raises(DataError, match="no eos_token"):
        HFTokenizer(bad)
    # special_tokens_map.json fills what tokenizer_config.json lacks; PAD falls back to EOS
    json.dump({"eos_token": {"content": "<|eos|>"}}, open(f"{bad}/special_tokens_map.json", "w"))
    t = HFTokenizer(bad)
    assert t.eos_id == t.pad_id == HFTokenizer(tok_dir).eos_id


# ------------------------------------------------------------------------------------------------ chat rendering


def test_chat_ids_and_mask_equal_apply_chat_template(hf, ref):
    tpl = ChatTemplate(hf.chat_template, hf.chat_template_file, hf.special_tokens)
    for rec in conversations() + many_conversations(10):
        r = tpl.render(conversation(rec, "messages", "tools"))
        assert r.text == ref.apply_chat_template(rec["messages"], tools=rec.get("tools"), tokenize=False)
        (ids, offsets), = hf.encode_with_offsets([r.text])
        want_ids, want_mask = reference_chat(ref, rec)
        assert ids.tolist() == want_ids
        assert assistant_mask(offsets, r.spans).astype(int).tolist() == want_mask
        assert 0 < sum(want_mask) < len(want_ids)


def test_template_without_generation_markers_is_refused(tmp_path, hf):
    with pytest.raises(DataError, match=r"has no \{% generation %\}.*set data.chat_template"):
        ChatTemplate(PLAIN_TEMPLATE, "x/tokenizer_config.json", hf.special_tokens)
    plain = write_tokenizer(tmp_path / "plain", chat_template=PLAIN_TEMPLATE)
    data = write_jsonl(tmp_path / "c.jsonl", conversations())
    with pytest.raises(DataError, match=r"plain/tokenizer_config.json' has no \{% generation %\}"):
        make_pipeline(chat_cfg(data, plain), 512, 1, seed=0)
    # the user's own marked template replaces the checkpoint's
    (tmp_path / "marked.jinja").write_text(CHAT_TEMPLATE)
    pipe = make_pipeline(chat_cfg(data, plain, chat_template=str(tmp_path / "marked.jinja")), 512, 1, seed=0)
    assert pipe.take(1)[0]["loss_mask"].sum() > 0
    with pytest.raises(DataError, match="does not compile"):
        ChatTemplate("{% for %}{% generation %}{% endgeneration %}", "t.jinja", {})
    with pytest.raises(ConfigError, match="chat needs a Hugging Face tokenizer"):
        make_pipeline({**chat_cfg(data, plain).to_dict(), "tokenizer": "byte"}, 512, 1, seed=0)


def test_bad_conversations_are_skipped_and_counted(tmp_path, tok_dir):
    good = conversations()
    bad = [{"text": "no messages"},
           {"messages": []},
           {"messages": [{"role": "narrator", "content": "x"}, {"role": "assistant", "content": "y"}]},
           {"messages": [{"role": "user", "content": 5}, {"role": "assistant", "content": "y"}]},
           {"messages": "[not json"},
           {"messages": [{"role": "user", "content": "only a question"}]},  # nothing to learn
           {"messages": [{"role": "user", "content": "x\ue000"}, {"role": "assistant", "content": "y"}]}]
    path = write_jsonl(tmp_path / "c.jsonl", good[:2] + bad + good[2:])
    strict = "{% if messages[0].role == 'assistant' %}{{ raise_exception('must start with a user turn') }}{% endif %}"
    (tmp_path / "strict.jinja").write_text(strict + CHAT_TEMPLATE)
    with open(path, "a") as f:
        f.write(json.dumps({"messages": [{"role": "assistant", "content": "hi"}]}) + "\n")
    pipe = make_pipeline(chat_cfg(path, tok_dir, chat_template=str(tmp_path / "strict.jinja")), 512, 2, seed=0,
                         num_epochs=1)
    assert len(segments(take_all(pipe))) == len(good)
    assert pipe.stats == {**pipe.stats, "docs_read": len(good) + len(bad) + 1, "docs_used": len(good),
                          "skipped": len(bad) + 1, "skipped_malformed": 6, "skipped_empty": 2}
    details = [pipe._prepare_record(i).detail for i in range(len(pipe.source))
               if isinstance(pipe._prepare_record(i), Skip)]
    assert details == ["c.jsonl:3: field 'messages' is missing or not a list (NoneType)",
                       "c.jsonl:4: field 'messages' is an empty list",
                       "c.jsonl:5: field 'messages'[0].role='narrator': unknown role (known: system, developer, "
                       "user, assistant, tool)",
                       "c.jsonl:6: field 'messages'[0].content is a int, not a string or a list",
                       details[4], "c.jsonl:8: the rendered conversation has no assistant (generation) text",
                       "c.jsonl:9: the conversation contains U+E000 / U+E001 (reserved for the generation markers)",
                       details[7]]
    assert details[4].startswith("c.jsonl:7: field 'messages' is a string but not JSON")
    assert "strict.jinja' failed on this conversation (TemplateError: must start with a user turn)" in details[7]
    (tmp_path / "bad.jsonl").write_text(json.dumps({"messages": [{"role": "bot", "content": "x"}]}) + "\n")
    with pytest.raises(DataError, match=r"none of the 1 train records .*bad.jsonl:1: field 'messages'\[0\].role"):
        make_pipeline(chat_cfg(tmp_path / "bad.jsonl", tok_dir), 512, 1, seed=0)


# ------------------------------------------------------------------------------------------------ chat pipeline


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_chat_pipeline_rows_are_the_reference_conversations(tmp_path, tok_dir, ref, fmt):
    recs = conversations() + many_conversations(20, seed=1)
    if fmt == "jsonl":
        path = write_jsonl(tmp_path / "c.jsonl", recs)
    else:  # messages as a list of structs (absent keys read back as None), tools as a JSON string column
        path = tmp_path / "c.parquet"
        pq.write_table(pa.table({"messages": [r["messages"] for r in recs],
                                 "tools": [json.dumps(r["tools"]) if "tools" in r else None for r in recs]}), path)
    S = 256
    pipe = make_pipeline(chat_cfg(path, tok_dir), S, 2, seed=0, num_epochs=1)
    got = sorted(segments(take_all(pipe)))
    want = []
    for r in recs:
        ids, mask = reference_chat(ref, r)
        want.append((ids, [0] + mask[1:]))  # a segment's first token is never a target
    assert got == sorted(want) and len(got) == len(recs)  # every conversation whole, in one segment
    assert pipe.stats["target_tokens"] == sum(sum(m) for _, m in want) and pipe.stats["truncated"] == 0


def test_too_long_conversations_are_never_cut_silently(tmp_path, tok_dir, ref):
    recs = conversations() + many_conversations(12, seed=2)
    lens = [len(reference_chat(ref, r)[0]) for r in recs]
    S = sorted(lens)[len(lens) // 2]  # about half the conversations are longer than a row
    long = [r for r, n in zip(recs, lens) if n > S]
    assert long
    path = write_jsonl(tmp_path / "c.jsonl", recs)
    pipe = make_pipeline(chat_cfg(path, tok_dir), S, 2, seed=0, num_epochs=1)
    segs = segments(take_all(pipe))
    fits = sorted(reference_chat(ref, r)[0] for r, n in zip(recs, lens) if n <= S)
    assert sorted(t for t, _ in segs) == fits  # only whole conversations; the long ones left out ...
    assert pipe.stats["skipped_too_long"] == pipe.stats["skipped"] == len(long)  # ... and counted
    assert pipe.stats["truncated"] == 0

    pipe = make_pipeline(chat_cfg(path, tok_dir, too_long="truncate"), S, 2, seed=0, num_epochs=1)
    segs = segments(take_all(pipe))
    want = []
    for r in recs:  # the stated rule: the first S tokens, with their mask
        ids, mask = reference_chat(ref, r)
        want.append((ids[:S], [0] + mask[1:S]))
    assert sorted(segs) == sorted(want) and len(segs) == len(recs)
    assert pipe.stats["truncated"] == len(long) and pipe.stats["skipped"] == 0
    assert pipe.stats["truncated_tokens"] == sum(n - S for n in lens if n > S)

    # negative control: the same conversations as plain SFT-free text documents ARE cut into S-token pieces
    texts = tmp_path / "t.jsonl"
    write_jsonl(texts, [{"text": ref.apply_chat_template(r["messages"], tools=r.get("tools"), tokenize=False)}
                        for r in recs])
    plain = default_data_config(path=str(texts), eval_fraction=0.0, prefetch=0, tokenizer="hf:" + tok_dir)
    pieces = segments(take_all(make_pipeline(plain, S, 2, seed=0, num_epochs=1)))
    assert len(pieces) > len(recs)


def test_chat_pipeline_resumes_exactly(tmp_path, tok_dir):
    path = write_jsonl(tmp_path / "c.jsonl", many_conversations(40, seed=3))
    data = chat_cfg(path, tok_dir, too_long="truncate", shuffle_window_tokens=4 * 200)
    run = make_pipeline(data, 96, 4, seed=1)
    run.take(7)
    state = json.loads(json.dumps(run.get_state()))
    stats = run.stats
    tail = run.take(25)  # crosses blocks and epochs
    resumed = make_pipeline(data, 96, 4, seed=1)
    resumed.set_state(state)
    assert resumed.stats == stats
    again = resumed.take(25)
    for a, b in zip(again, tail):
        for k in KEYS:
            np.testing.assert_array_equal(a[k], b[k])
    assert resumed.stats == run.stats and run.stats["truncated"] > 0


def test_hf_tokenizer_text_documents(tmp_path, tok_dir, ref):
    texts = corpus_lines()[:30]
    path = write_jsonl(tmp_path / "t.jsonl", [{"text": t} for t in texts])
    data = default_data_config(path=str(path), eval_fraction=0.0, prefetch=0, tokenizer="hf:" + tok_dir)
    segs = segments(take_all(make_pipeline(data, 4096, 2, seed=0, num_epochs=1)))
    want = [ref(t)["input_ids"] + [ref.eos_token_id] for t in texts]  # BOS (the post-processor's) ... EOS
    assert sorted(t for t, _ in segs) == sorted(want)
    assert all(m == [0] + [1] * (len(t) - 1) for t, m in segs)


# ------------------------------------------------------------------------------------------------ pre-tokenized


@pytest.mark.parametrize("ext", ["parquet", "array_record"])
def test_pretokenized_round_trip_gives_the_same_batches(tmp_path, tok_dir, ref, hf, ext):
    recs = conversations() + many_conversations(15, seed=4)
    chat = chat_cfg(write_jsonl(tmp_path / "c.jsonl", recs), tok_dir, shuffle_window_tokens=2 * 300)
    docs = [(np.array(i), np.array(m)) for i, m in (reference_chat(ref, r) for r in recs)]
    path = str(tmp_path / f"t.{ext}")
    assert write_tokens(path, docs) == len(recs)
    tokens = default_data_config(path=path, eval_fraction=0.0, prefetch=0, tokenizer="hf:" + tok_dir,
                                 tokens_field="input_ids", shuffle_window_tokens=2 * 300)
    a = make_pipeline(chat, 128, 2, seed=5).take(30)
    pipe = make_pipeline(tokens, 128, 2, seed=5)
    b = pipe.take(30)
    for x, y in zip(a, b):
        for k in KEYS:
            np.testing.assert_array_equal(x[k], y[k])
    assert pipe.stats["skipped_too_long"] > 0 and pipe.stats["docs_used"] > 10
    bad = str(tmp_path / f"bad.{ext}")
    write_tokens(bad, docs[:2] + [(np.array([1, 2, hf.vocab_size]), np.array([0, 1, 1])),  # another tokenizer's ids
                                  (np.array([5, 6, 7]), np.array([0, 1]))])  # a mask of the wrong length
    pipe = make_pipeline({**tokens.to_dict(), "path": bad}, 512, 1, seed=0, num_epochs=1)
    assert len(segments(take_all(pipe))) == 2 and pipe.stats["skipped_malformed"] == 2
    # without a mask a record is a pretraining document: every token but a segment's first is a target
    plain = str(tmp_path / f"p.{ext}")
    write_tokens(plain, [(d, None) for d, _ in docs[:3]])
    segs = segments(take_all(make_pipeline({**tokens.to_dict(), "path": plain}, 512, 1, seed=0, num_epochs=1)))
    assert sorted(segs) == sorted((d.tolist(), [0] + [1] * (len(d) - 1)) for d, _ in docs[:3])


def test_chat_and_token_config_rules(tmp_path, tok_dir):
    (tmp_path / "x.jsonl").write_text("{}\n")
    p = str(tmp_path / "x.jsonl")
    with pytest.raises(ConfigError, match="data.too_long='cut': must be one of"):
        validate_data_config({"too_long": "cut"})
    with pytest.raises(ConfigError, match="data.tokens_field='input_ids': records are of one kind"):
        validate_data_config({"path": p, "messages_field": "messages", "tokens_field": "input_ids"})
    with pytest.raises(ConfigError, match="data.messages_field='m': needs a data.path"):
        validate_data_config({"messages_field": "m"})
    with pytest.raises(ConfigError, match="data.format='arrayrecord': plain-text records have no messages"):
        validate_data_config({"path": p, "messages_field": "m", "format": "arrayrecord"})
    with pytest.raises(ConfigError, match="data.chat_template='/no/such.jinja': must be None or an existing"):
        validate_data_config({"path": p, "messages_field": "m", "chat_template": "/no/such.jinja"})
    with pytest.raises(ConfigError, match="data.chat_template=.*: is used only for chat records"):
        validate_data_config({"path": p, "chat_template": p})
    with pytest.raises(ConfigError, match="data.tokenizer=3: must be one of"):
        validate_data_config({"tokenizer": 3})
    validate_data_config(chat_cfg(p, tok_dir))
