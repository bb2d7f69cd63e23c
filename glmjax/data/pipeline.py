"""The grain input pipeline: documents -> tokens -> packed rows [S] -> batches [B,S]; deterministic, sharded by
process, checkpointable.

    pipe = make_pipeline(config.data, seq_len, batch_size, seed, split="train", process_index, process_count)
    batch = next(pipe)              # {tokens, segment_ids, positions, loss_mask}: np.int32 [batch_size / P, S]
    state = pipe.get_state()        # JSON-able; pipe.set_state(state) continues bitwise identically
    pipe.stats                      # documents read / used / skipped by reason, rows, tokens, target tokens

How. The split's documents are visited in a global order: the grain MapDataset `range(n).shuffle(seed).repeat()`
(a new permutation each epoch; identity when data.shuffle is False). A global batch has `batch_size` row slots;
slot r owns the documents at positions r, r+B, r+2B, ... of that order and packs them on its own: it reads its
next documents into a block until the block holds `shuffle_window_tokens / B` tokens (at least S), cuts them into
S-token pieces, shuffles the pieces (seeded by seed, slot and block) and packs them next-fit into rows
(packing.Block). Batch k is row k of every slot. Hence:
- process p of P owns slots [p B/P, (p+1) B/P), reads only their documents, and its rows are exactly its part of
  the one-process global batch, for any P;
- the state is per slot (first document of the current block, rows emitted from it) plus the counters; restoring
  re-reads that one block and continues exactly where the run was.
A finite pipeline (eval, or num_epochs set) ends when all of this process's slots are exhausted; a slot that runs
out earlier contributes all-padding rows. `take(n)` always gives n batches (padding after the end), so every
process of a multi-process eval runs the same number of steps.

Tokenization is batched: a block's documents are parsed (chat: rendered) one by one and encoded a chunk at a time
(`Tokenizer.encode_batch`; the Rust library of an HF tokenizer encodes a chunk in parallel), each chunk about as many
documents as the block still needs; what the block does not take is kept for the next one (not part of the state:
a restored iterator reads it again, with the same result).

Records are of one kind per pipeline: text documents (text_field), SFT pairs (prompt_field + response_field), chat
conversations (messages_field, chat.py: rendered with the checkpoint's chat template, loss on assistant tokens), or
pre-tokenized records (tokens_field, pretokenized.py). Conversations (chat, and pre-tokenized records with a loss
mask) are never cut into pieces: one longer than seq_len tokens is skipped (data.too_long="skip", counted in
skipped_too_long) or keeps its first seq_len tokens (data.too_long="truncate", counted in `truncated` and the
tokens dropped in `truncated_tokens`). Text documents and SFT pairs longer than seq_len are cut into seq_len pieces.

Bad records (undecodable, malformed, empty, longer than data.max_doc_chars) are skipped, counted in `stats` once
each (in the first epoch; later epochs skip them silently) and the first few logged. Unusable files (unreadable,
wrong format, a missing column, no usable record) raise `DataError` naming the file, and so does a file that
changes while the run reads it (sources.py `Watched`). Train batches are prepared ahead in a thread that never holds
a signal back (read_ahead.py). The train / held-out split is by a stable hash of each record's key (file and line /
row): `eval_fraction` of the documents, at least one of each side; if no held-out record is usable, train records move
over (lowest hash first) until one is, so a bad line never leaves eval empty.
"""
from __future__ import annotations

import copy
import logging
import os
from typing import Any, Mapping

import grain
import ml_collections
import numpy as np

from glmjax.config import ConfigError
from glmjax.data.chat import ChatTemplate, Rendered, assistant_mask, conversation
from glmjax.data.hf_tokenizer import PREFIX
from glmjax.data.packing import Block
from glmjax.data.pretokenized import parse_tokens
from glmjax.data.read_ahead import ReadAhead
from glmjax.data.sources import FORMATS, SKIP_REASONS, DataError, Doc, Fields, Skip, open_source, parse, record
from glmjax.data.tokenizer import TOKENIZERS, Tokenizer, make_tokenizer

log = logging.getLogger(__name__)

KEYS = ("tokens", "segment_ids", "positions", "loss_mask")
SPLITS = ("train", "eval")
LOGGED_SKIPS = 5  # bad records logged individually per process; all of them are counted
TOO_LONG = ("skip", "truncate")
MAX_CHUNK = 256  # documents tokenized in one batch


def default_data_config(**overrides) -> ml_collections.ConfigDict:
    """The `data` section of an experiment config (the fields and rules: docs/data.md).

    Chat (messages_field set): records hold a list of messages {role, content, tool_calls ...}, rendered with the
    chat template of the hf tokenizer's checkpoint (or data.chat_template) and tokenized; the loss mask is the
    template's {% generation %} stretches (transformers' assistant-token mask). Pre-tokenized (tokens_field set):
    records hold token ids and optionally a 0/1 loss mask. Conversations longer than seq_len follow data.too_long.
    """
    c = ml_collections.ConfigDict()
    c.path = ml_collections.config_dict.placeholder(str)  # None -> the embedded stdlib corpus; a file or directory
    c.format = "auto"  # auto (by extension) | text | jsonl | parquet | arrayrecord | arrayrecord_json
    c.text_field = "text"  # JSONL / Parquet / ArrayRecord-JSON field holding the document
    c.prompt_field = ml_collections.config_dict.placeholder(str)  # SFT: set both; loss on response tokens only
    c.response_field = ml_collections.config_dict.placeholder(str)
    c.max_doc_chars = 1_000_000  # longer documents are skipped (and counted)
    c.max_docs = ml_collections.config_dict.placeholder(int)  # None -> all; else the first max_docs records
    c.eval_fraction = 0.02  # share of documents held out (split="eval")
    c.shuffle = True  # document order per epoch and piece order within a shuffle window
    c.shuffle_window_tokens = 1 << 23  # tokens buffered for piece shuffling, over all batch rows (memory bound)
    c.prefetch = 2  # train batches prepared ahead in a background thread (0: none; eval never prefetches)
    c.tokenizer = "byte"  # "byte" | "hf:DIR": tokenizer.json (+ tokenizer_config.json) of a checkpoint directory
    c.messages_field = ml_collections.config_dict.placeholder(str)  # chat: the list of messages (e.g. "messages")
    c.tools_field = "tools"  # chat: the tools offered in the conversation (optional per record)
    c.chat_template = ml_collections.config_dict.placeholder(str)  # chat: a .jinja file replacing the checkpoint's
    c.tokens_field = ml_collections.config_dict.placeholder(str)  # pre-tokenized: the token ids (e.g. "input_ids")
    c.loss_mask_field = "loss_mask"  # pre-tokenized: 0/1 per token (optional per record; absent: a plain document)
    c.too_long = "skip"  # conversations longer than seq_len: "skip" or "truncate" to the first seq_len (counted)
    c.update(overrides)
    return c


def _resolve(data_cfg) -> dict:
    d = data_cfg.to_dict() if isinstance(data_cfg, ml_collections.ConfigDict) else dict(data_cfg or {})
    known = default_data_config().to_dict()
    unknown = sorted(set(d) - set(known))
    if unknown:
        raise ConfigError(f"data.{unknown[0]}: unknown field (known fields: {', '.join(sorted(known))})")
    return {**known, **d}


def validate_data_config(data_cfg) -> None:
    """Raises ConfigError('data.<field>=<value>: rule') for the first invalid field (missing fields take defaults)."""
    d = _resolve(data_cfg)

    def fail(field, rule):
        raise ConfigError(f"data.{field}={d[field]!r}: {rule}")

    def is_int(v):
        return isinstance(v, (int, np.integer)) and not isinstance(v, bool)

    if d["path"] is not None:
        if not isinstance(d["path"], str) or not d["path"]:
            fail("path", "must be a non-empty string or None (the embedded stdlib corpus)")
        if not os.path.exists(d["path"]):
            fail("path", "does not exist")
    if d["format"] not in FORMATS:
        fail("format", f"must be one of {FORMATS}")
    for f in ("text_field", "prompt_field", "response_field", "messages_field", "tools_field", "tokens_field",
              "loss_mask_field"):
        if d[f] is not None and (not isinstance(d[f], str) or not d[f]):
            fail(f, "must be a non-empty string" + ("" if f == "text_field" else " or None"))
    if d["text_field"] is None:
        fail("text_field", "must be a non-empty string")
    if (d["prompt_field"] is None) != (d["response_field"] is None):
        fail("prompt_field" if d["prompt_field"] is None else "response_field",
             "SFT needs both prompt_field and response_field (or neither)")
    if d["prompt_field"] is not None:
        if d["prompt_field"] == d["response_field"]:
            fail("response_field", "must differ from prompt_field")
        if d["path"] is None:
            fail("prompt_field", "SFT needs a data.path with prompt/response records (the stdlib corpus is plain text)")
        if d["format"] in ("text", "arrayrecord"):
            fail("format", "plain-text records have no prompt/response fields; use jsonl, parquet or arrayrecord_json")
    kinds = [f for f in ("prompt_field", "messages_field", "tokens_field") if d[f] is not None]
    if len(kinds) > 1:
        fail(kinds[1], f"records are of one kind: set only one of prompt_field, messages_field, tokens_field "
                       f"(also set: {kinds[0]})")
    for f in ("messages_field", "tokens_field"):
        if d[f] is not None and d["path"] is None:
            fail(f, "needs a data.path with such records (the stdlib corpus is plain text)")
        if d[f] is not None and d["format"] in ("text", "arrayrecord"):
            fail("format", f"plain-text records have no {f.split('_')[0]}; use jsonl, parquet or arrayrecord_json")
    if d["chat_template"] is not None:
        if not isinstance(d["chat_template"], str) or not os.path.isfile(d["chat_template"]):
            fail("chat_template", "must be None or an existing Jinja template file")
        if d["messages_field"] is None:
            fail("chat_template", "is used only for chat records (set data.messages_field)")
    if d["too_long"] not in TOO_LONG:
        fail("too_long", f"must be one of {TOO_LONG}")
    if not is_int(d["max_doc_chars"]) or d["max_doc_chars"] < 1:
        fail("max_doc_chars", "must be an integer >= 1")
    if d["max_docs"] is not None and (not is_int(d["max_docs"]) or d["max_docs"] < 1):
        fail("max_docs", "must be an integer >= 1 or None")
    if isinstance(d["eval_fraction"], bool) or not isinstance(d["eval_fraction"], (int, float)) \
            or not 0 <= d["eval_fraction"] < 1:
        fail("eval_fraction", "must be a number in [0, 1)")
    if d["eval_fraction"] > 0 and d["max_docs"] is not None and d["max_docs"] < 2:
        fail("max_docs", "must be >= 2 when eval_fraction > 0 (one train and one held-out document)")
    if not isinstance(d["shuffle"], bool):
        fail("shuffle", "must be True or False")
    if not is_int(d["shuffle_window_tokens"]) or d["shuffle_window_tokens"] < 1:
        fail("shuffle_window_tokens", "must be an integer >= 1")
    if not is_int(d["prefetch"]) or d["prefetch"] < 0:
        fail("prefetch", "must be an integer >= 0")
    tok = d["tokenizer"]
    if not isinstance(tok, str) or (tok not in TOKENIZERS and not tok.startswith(PREFIX)):
        fail("tokenizer", f"must be one of {tuple(TOKENIZERS)} or '{PREFIX}DIR' (a checkpoint directory)")
    if tok.startswith(PREFIX) and not os.path.isfile(os.path.join(tok[len(PREFIX):], "tokenizer.json")):
        fail("tokenizer", f"{tok[len(PREFIX):]!r} has no tokenizer.json")


def split_indices(key_hashes: np.ndarray, eval_fraction: float, split: str) -> np.ndarray:
    """Record indices of one side of the stable split: a record is held out iff its key hash, as a number in
    [0, 1), is below eval_fraction; if that leaves a side empty (and n >= 2), the extreme hash moves over."""
    u = (key_hashes >> np.uint64(11)).astype(np.float64) / 2.0 ** 53
    held = u < eval_fraction
    if eval_fraction > 0 and len(u) >= 2:
        if not held.any():
            held[np.argmin(u)] = True
        if held.all():
            held[np.argmax(u)] = False
    return np.flatnonzero(held if split == "eval" else ~held)


class Pipeline:
    """Batches of packed rows for this process (see the module docstring). Iterate it, or `take(n)`.

    Attributes: tokenizer, seq_len, batch_size (global), local_batch_size, split, source_name, num_docs (documents
    in this split, all processes), num_tokens (approximate tokens in this split: bytes + BOS/EOS per document),
    dataset (the grain IterDataset).
    """

    def __init__(self, cfg: dict, seq_len: int, batch_size: int, seed: int, split: str, process_index: int,
                 process_count: int, num_epochs: int | None, tokenizer: Tokenizer):
        self.tokenizer, self.seq_len, self.batch_size, self.split = tokenizer, seq_len, batch_size, split
        self.process_index, self.process_count = process_index, process_count
        self.local_batch_size = batch_size // process_count
        self.fields = Fields(cfg["text_field"], cfg["prompt_field"], cfg["response_field"], cfg["max_doc_chars"],
                             cfg["messages_field"], cfg["tools_field"], cfg["tokens_field"], cfg["loss_mask_field"])
        self.too_long = cfg["too_long"]
        self.chat_template = self._chat_template(cfg) if self.fields.messages_field else None
        self.source = open_source(cfg["path"], cfg["format"], self.fields)
        n = len(self.source) if cfg["max_docs"] is None else min(len(self.source), cfg["max_docs"])
        self.source_name = self.source.name
        hashes = self.source.key_hashes()[:n]
        held = self._usable_held_out(hashes, split_indices(hashes, cfg["eval_fraction"], "eval"))
        self.indices = held if split == "eval" else np.setdiff1d(np.arange(n), held)
        if not len(self.indices):
            empty = [name for name, r in zip(self.source._relnames, self.source.readers) if not len(r)]
            raise DataError(f"data: no {split} documents in {self.source_name!r} ({n} records, "
                            f"eval_fraction={cfg['eval_fraction']})"
                            + (f"; empty files: {', '.join(empty[:5])}" if empty else ""))
        self._check_usable()
        self.num_docs = len(self.indices)
        self.num_tokens = int(self.source.approx_bytes()[self.indices].sum()) + 2 * self.num_docs

        order = grain.MapDataset.range(self.num_docs)
        if cfg["shuffle"]:
            order = order.shuffle(seed=seed)
        if num_epochs != 1:
            order = order.repeat(num_epochs)
        first = process_index * self.local_batch_size
        slots = list(range(first, first + self.local_batch_size))
        fingerprint = dict(split=split, num_docs=self.num_docs, seq_len=seq_len,
                           batch_size=batch_size, slots=[first, first + len(slots)], seed=seed,
                           shuffle=cfg["shuffle"], window=cfg["shuffle_window_tokens"], num_epochs=num_epochs)
        self.dataset = PackedBatches([order[r::batch_size].map(self._prepare) for r in slots], self._tokenize, slots,
                                     seq_len, max(cfg["shuffle_window_tokens"] // batch_size, seq_len),
                                     seed if cfg["shuffle"] else None, tokenizer.pad_id, fingerprint)
        self._it = iter(self.dataset)
        if cfg["prefetch"] and split == "train":
            self._it = ReadAhead(self._it, cfg["prefetch"])

    def _chat_template(self, cfg: dict) -> ChatTemplate:
        tok = self.tokenizer
        if not hasattr(tok, "encode_with_offsets") or not hasattr(tok, "chat_template"):
            raise ConfigError(f"data.messages_field={cfg['messages_field']!r}: chat needs a Hugging Face tokenizer "
                              f"(data.tokenizer='{PREFIX}DIR'), not {type(tok).__name__}")
        if cfg["chat_template"] is None:
            return ChatTemplate(tok.chat_template, tok.chat_template_file, tok.special_tokens)
        with open(cfg["chat_template"], encoding="utf-8") as f:
            return ChatTemplate(f.read(), cfg["chat_template"], tok.special_tokens)

    def _prepare(self, j: int) -> tuple[int, Doc | Rendered | tuple] | Skip:
        """Document j of the split -> (record index, parsed record: a Doc, a rendered chat or pre-tokenized
        (ids, mask)), or Skip (its detail starting with the record's key)."""
        return self._prepare_record(int(self.indices[j]))

    def _prepare_record(self, i: int) -> tuple[int, Doc | Rendered | tuple] | Skip:
        f = self.fields
        if f.messages_field:
            rec = record(*self.source[i])
            chat = rec if isinstance(rec, Skip) else conversation(rec, f.messages_field, f.tools_field)
            out = chat if isinstance(chat, Skip) else self.chat_template.render(chat)
            if isinstance(out, Rendered) and not (out.spans[:, 1] > out.spans[:, 0]).any():
                out = Skip("empty", "the rendered conversation has no assistant (generation) text")
            if isinstance(out, Rendered) and f.max_doc_chars is not None and len(out.text) > f.max_doc_chars:
                out = Skip("too_long", f"{len(out.text):,} chars rendered > max_doc_chars={f.max_doc_chars:,}")
        elif f.tokens_field:
            rec = record(*self.source[i])
            out = rec if isinstance(rec, Skip) else parse_tokens(rec, f.tokens_field, f.loss_mask_field,
                                                                 self.tokenizer.vocab_size)
        else:
            out = parse(*self.source[i], f)
        if isinstance(out, Skip):
            return Skip(out.reason, f"{self.source.key(i)}: {out.detail}")
        return i, out

    def _tokenize(self, items: list) -> list[tuple[np.ndarray, int | np.ndarray, int] | Skip]:
        """Prepared documents -> (tokens int32 [n], targets: response_start or bool [n], tokens cut off) or Skip;
        the texts of the list are encoded in one batch."""
        out = list(items)
        at = [k for k, x in enumerate(items) if not isinstance(x, Skip)]
        if self.fields.messages_field:
            encoded = self.tokenizer.encode_with_offsets([items[k][1].text for k in at])
            for k, (ids, offsets) in zip(at, encoded):
                out[k] = self._fit(items[k][0], ids, assistant_mask(offsets, items[k][1].spans))
        elif self.fields.tokens_field:
            for k in at:
                i, (ids, mask) = items[k]
                out[k] = (ids, 0, 0) if mask is None else self._fit(i, ids, mask)
        elif self.fields.sft:
            prompts = self.tokenizer.encode_batch([items[k][1].prompt for k in at], bos=True, eos=False)
            responses = self.tokenizer.encode_batch([items[k][1].text for k in at], bos=False, eos=True)
            for k, p, r in zip(at, prompts, responses):
                out[k] = (np.concatenate([p, r]), len(p), 0)
        else:
            for k, ids in zip(at, self.tokenizer.encode_batch([items[k][1].text for k in at])):
                out[k] = (ids, 0, 0)
        return out

    def _fit(self, i: int, ids: np.ndarray, mask: np.ndarray) -> tuple[np.ndarray, np.ndarray, int] | Skip:
        """A conversation within seq_len as it is; a longer one skipped or truncated (data.too_long)."""
        if len(ids) <= self.seq_len:
            return ids, mask, 0
        if self.too_long == "skip":
            return Skip("too_long", f"{self.source.key(i)}: {len(ids):,} tokens > seq_len={self.seq_len} "
                                    "(data.too_long='skip')")
        return ids[:self.seq_len], mask[:self.seq_len], len(ids) - self.seq_len

    def _usable(self, i: int) -> bool:
        return not isinstance(self._prepare_record(int(i)), Skip)

    def _usable_held_out(self, hashes: np.ndarray, held: np.ndarray) -> np.ndarray:
        """The held-out records, with train records moved over (lowest key hash first, at least one record left
        for training) until one of them is usable: a bad line drawn for eval never leaves eval empty. The same
        for both splits, so they never overlap."""
        if not len(held) or any(self._usable(i) for i in held):
            return held
        taken = set(held.tolist())
        extra = [int(i) for i in np.argsort(hashes, kind="stable") if int(i) not in taken][:-1]
        for k, i in enumerate(extra):
            if self._usable(i):
                return np.sort(np.concatenate([held, extra[:k + 1]])).astype(held.dtype)
        return held

    def _check_usable(self) -> None:
        """Fail now, not mid-run, when no document of the split is usable (e.g. a wrong text_field, or every
        conversation too long): prepare and tokenize in order until the first usable one."""
        reasons: dict[str, int] = {}
        first = None
        for i in self.indices:
            doc = self._prepare_record(int(i))
            if not isinstance(doc, Skip):
                doc = self._tokenize([doc])[0]
            if not isinstance(doc, Skip):
                return
            reasons[doc.reason] = reasons.get(doc.reason, 0) + 1
            first = first or doc.detail
        raise DataError(f"data: none of the {len(self.indices)} {self.split} records of {self.source_name!r} is "
                         f"usable ({reasons}); first: {first}")

    def __iter__(self):
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        return next(self._it)

    def take(self, n: int) -> list[dict[str, np.ndarray]]:
        """The next n batches; all-padding batches (loss_mask 0) once the data ends."""
        out = []
        for _ in range(n):
            try:
                out.append(next(self._it))
            except StopIteration:
                out.append(empty_batch(self.local_batch_size, self.seq_len, self.tokenizer.pad_id))
        return out

    def start(self, interrupt=None) -> None:
        """Start preparing batches in the background thread now (with `prefetch` > 0), not at the first `next`: a
        training run calls this once its data position is restored, so that the first batch is ready when the
        step has compiled. A later `set_state` discards what was prepared. interrupt: () -> a signal's name or
        None, asked while `next` waits for the thread (read_ahead.py: `Interrupted`)."""
        if isinstance(self._it, ReadAhead):
            if interrupt is not None:
                self._it.interrupt = interrupt
            self._it.start()

    def get_state(self) -> dict[str, Any]:
        """JSON-able state after the last batch returned."""
        return copy.deepcopy(self._it.get_state())

    def set_state(self, state: Mapping[str, Any]) -> None:
        self._it.set_state(copy.deepcopy(dict(state)))

    @property
    def stats(self) -> dict[str, int]:
        """Counters up to the last batch returned (this process)."""
        return dict(self._it.get_state()["stats"])

    @property
    def totals(self) -> dict[str, int]:
        """`stats` with every record read counted, by the prefetch thread ahead of the last batch returned included
        (docs_read, skips and truncations; `read_ahead`: the documents read past that batch): what the run's
        summary reports, so that no logged skip is missing from it."""
        got = self.stats
        ahead = dict((self._it.latest_state if isinstance(self._it, ReadAhead) else self._it.get_state())["stats"])
        keys = ["docs_read", "skipped", "truncated", "truncated_tokens"] + [f"skipped_{r}" for r in SKIP_REASONS]
        return {**got, **{k: ahead[k] for k in keys}, "read_ahead": ahead["docs_read"] - got["docs_read"]}

    def close(self) -> None:
        """Stops the prefetch thread (if any)."""
        if isinstance(self._it, ReadAhead):
            self._it.close()

    def __repr__(self):
        return (f"Pipeline({self.source_name!r}, split={self.split}, {self.num_docs} docs, ~{self.num_tokens:,} "
                f"tokens, {self.local_batch_size}x{self.seq_len} per batch on process "
                f"{self.process_index}/{self.process_count})")


def make_pipeline(data_cfg, seq_len: int, batch_size: int, seed: int, split: str = "train", process_index: int = 0,
                  process_count: int = 1, *, num_epochs: int | None = None,
                  tokenizer: Tokenizer | None = None) -> Pipeline:
    """data_cfg: the `data` config section (ConfigDict or dict; missing fields take defaults). batch_size is the
    global batch; this process gets rows [process_index * B/P, (process_index + 1) * B/P) of it. num_epochs None:
    endless for "train", one pass for "eval". tokenizer: any `Tokenizer` (default: data.tokenizer)."""
    validate_data_config(data_cfg)
    cfg = _resolve(data_cfg)
    for name, v, lo in (("seq_len", seq_len, 1), ("batch_size", batch_size, 1), ("process_count", process_count, 1),
                        ("seed", seed, 0)):
        if not isinstance(v, (int, np.integer)) or v < lo:
            raise ValueError(f"{name}={v!r}: must be an integer >= {lo}")
    if seed >= 2 ** 32:
        raise ValueError(f"seed={seed}: must be < 2**32")
    if not 0 <= process_index < process_count:
        raise ValueError(f"process_index={process_index}: must be in [0, process_count={process_count})")
    if batch_size % process_count:
        raise ValueError(f"batch_size={batch_size}: must be divisible by process_count={process_count}")
    if split not in SPLITS:
        raise ValueError(f"split={split!r}: must be one of {SPLITS}")
    if split == "eval" and not cfg["eval_fraction"]:
        raise ConfigError(f"data.eval_fraction={cfg['eval_fraction']}: no held-out documents, and evaluation needs "
                          "some (set data.eval_fraction > 0, or train.eval_batches=0)")
    if num_epochs is not None and (not isinstance(num_epochs, int) or num_epochs < 1):
        raise ValueError(f"num_epochs={num_epochs!r}: must be an integer >= 1 or None (endless)")
    if num_epochs is None and split == "eval":
        num_epochs = 1
    return Pipeline(cfg, int(seq_len), int(batch_size), int(seed), split, int(process_index), int(process_count),
                    num_epochs, tokenizer or make_tokenizer(cfg["tokenizer"]))


def empty_batch(rows: int, seq_len: int, pad_id: int) -> dict[str, np.ndarray]:
    b = {k: np.zeros((rows, seq_len), np.int32) for k in KEYS}
    b["tokens"][:] = pad_id
    return b


def new_stats() -> dict[str, int]:
    return {"docs_read": 0, "docs_used": 0, "skipped": 0, **{f"skipped_{r}": 0 for r in SKIP_REASONS},
            "truncated": 0, "truncated_tokens": 0, "batches": 0, "rows": 0, "tokens": 0, "target_tokens": 0}


# ------------------------------------------------------------------------------------------------ grain dataset


class PackedBatches(grain.IterDataset):
    """Batches from per-slot streams of documents (each a grain MapDataset of `Pipeline._prepare` results, turned
    into tokens a chunk at a time by `tokenize`, i.e. `Pipeline._tokenize`)."""

    def __init__(self, slot_docs: list[grain.MapDataset], tokenize, slots: list[int], seq_len: int, window: int,
                 seed: int | None, pad_id: int, fingerprint: dict):
        super().__init__(slot_docs)
        self.slot_docs, self.tokenize, self.slots = slot_docs, tokenize, slots
        self.seq_len, self.window = seq_len, window
        self.seed, self.pad_id, self.fingerprint = seed, pad_id, fingerprint

    def __iter__(self) -> PackedBatchIterator:
        return PackedBatchIterator(self)


class _Slot:
    def __init__(self, docs: grain.MapDataset, index: int):
        self.docs, self.index, self.size = docs, index, len(docs)
        self.start, self.row, self.counted = 0, 0, False  # the state: block start, rows emitted, docs counted
        self.block: Block | None = None
        self.end = 0  # first document after the loaded block
        self.ahead: list = []  # documents from `start` on, tokenized with the previous block's last chunk


class PackedBatchIterator(grain.DatasetIterator):
    def __init__(self, ds: PackedBatches):
        super().__init__()
        self.ds = ds
        self.slots = [_Slot(d, i) for d, i in zip(ds.slot_docs, ds.slots)]
        self.stats = new_stats()
        self._logged = 0

    def __next__(self) -> dict[str, np.ndarray]:
        b = empty_batch(len(self.slots), self.ds.seq_len, self.ds.pad_id)
        rows = sum(self._next_row(s, *(b[k][i] for k in KEYS)) for i, s in enumerate(self.slots))
        if not rows:
            raise StopIteration
        st = self.stats
        st["batches"] += 1
        st["rows"] += rows
        st["tokens"] += int(np.count_nonzero(b["segment_ids"]))
        st["target_tokens"] += int(b["loss_mask"].sum())
        return b

    def _next_row(self, slot: _Slot, *row: np.ndarray) -> bool:
        while True:
            if slot.block is None:
                if slot.start >= slot.size:
                    return False
                self._load_block(slot)
            if slot.row < slot.block.num_rows:
                break
            slot.start, slot.row, slot.counted, slot.block = slot.end, 0, False, None
        slot.block.fill(slot.row, *row)
        slot.row += 1
        return True

    def _load_block(self, slot: _Slot) -> None:
        """Read the slot's documents from slot.start until the block holds `window` tokens (or the data ends);
        count them unless this block was counted before the state was saved. Documents are tokenized a chunk at a
        time, about as many as the block still needs at the mean length so far; the rest of the last chunk is kept
        for the next block."""
        docs, n_tokens, k = [], 0, slot.start
        count = not slot.counted
        fp = self.ds.fingerprint
        chunk, c = slot.ahead, 0
        while k < slot.size and n_tokens < self.ds.window:
            if c == len(chunk):  # about as many documents as the block still needs, at the mean length so far
                read = k - slot.start
                want = 1 if not read else -(-(self.ds.window - n_tokens) * read // max(n_tokens, 1))
                stop = min(k + min(want, MAX_CHUNK), slot.size)
                chunk, c = self.ds.tokenize([slot.docs[x] for x in range(k, stop)]), 0
            d = chunk[c]
            c += 1
            k += 1
            first_epoch = slot.index + (k - 1) * fp["batch_size"] < fp["num_docs"]  # count each record once
            if isinstance(d, Skip):
                # a slot reads every batch_size-th record: 16 x num_docs reads are 16 x batch_size of its epochs, so
                # a few usable records are still met (all unusable is a change the file check did not see)
                if not docs and k - slot.start > 16 * fp["num_docs"]:
                    raise DataError(f"data: {k - slot.start:,} records in a row are unusable (the last: {d.reason}, "
                                    f"{d.detail}); the data has changed since the run started, or holds too few "
                                    "usable records")
                if count and first_epoch:
                    self.stats["skipped"] += 1
                    self.stats[f"skipped_{d.reason}"] += 1
                    if self._logged < LOGGED_SKIPS:
                        self._logged += 1
                        log.warning("data: skipped a record (%s): %s%s", d.reason, d.detail,
                                    " (further skips are only counted)" if self._logged == LOGGED_SKIPS else "")
                continue
            if d[2] and count and first_epoch:
                self.stats["truncated"] += 1
                self.stats["truncated_tokens"] += d[2]
            docs.append(d)
            n_tokens += len(d[0])
        if count:
            self.stats["docs_read"] += k - slot.start
            self.stats["docs_used"] += len(docs)
        rng = None if self.ds.seed is None else np.random.default_rng([self.ds.seed, slot.index, slot.start])
        slot.block, slot.end, slot.counted, slot.ahead = Block(docs, self.ds.seq_len, rng), k, True, chunk[c:]

    def get_state(self) -> dict[str, Any]:
        return {"fingerprint": copy.deepcopy(self.ds.fingerprint),
                "slots": [[s.start, s.row, int(s.counted)] for s in self.slots], "stats": dict(self.stats)}

    def set_state(self, state: dict[str, Any]) -> None:
        want, got = self.ds.fingerprint, state.get("fingerprint", {})
        diff = [k for k in want if want[k] != got.get(k)]
        if diff:
            raise ConfigError("data: the saved iterator state belongs to a different pipeline: "
                             + ", ".join(f"{k} saved {got.get(k)!r} != now {want[k]!r}" for k in diff))
        for s, (start, row, counted) in zip(self.slots, state["slots"]):
            s.start, s.row, s.counted, s.block, s.ahead = int(start), int(row), bool(counted), None, []
        self.stats = {**new_stats(), **state["stats"]}
