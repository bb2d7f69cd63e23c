"""Pre-tokenized records, for datasets tokenized once: token ids and optionally a 0/1 loss mask per token
(`data.tokens_field`, `data.loss_mask_field`), in Parquet (list columns), JSONL or ArrayRecord of JSON objects
(`format="arrayrecord_json"`). `write_tokens` writes such a file.

A record with a mask is a conversation: token t is a target iff mask[t] is 1 (and t is not the first token of its
row segment), and it is never cut (data.too_long). Without a mask it is a pretraining document (every token a
target, cut into seq_len pieces like text). Ids outside [0, tokenizer vocab_size), an empty list, or a mask of
another length make the record a counted skip: ids from another tokenizer never train silently.
"""
from __future__ import annotations

import json
from typing import Iterable

import numpy as np

from glmjax.data.sources import Skip


def parse_tokens(record, tokens_field: str, mask_field: str | None,
                 vocab_size: int) -> tuple[np.ndarray, np.ndarray | None] | Skip:
    """A decoded record (dict) -> (ids int32 [n], mask bool [n] or None), or Skip."""
    if not isinstance(record, dict):
        return Skip("malformed", "a plain-text record has no token ids")
    values = []
    for f in (tokens_field, mask_field):
        v = record.get(f) if f else None
        if v is None:
            if f == tokens_field:
                return Skip("malformed", f"field {f!r} is missing")
            values.append(None)
            continue
        try:
            a = np.asarray(v)
        except ValueError as e:
            return Skip("malformed", f"field {f!r} is not a list of integers ({e})")
        if a.ndim != 1 or not (a.size == 0 or np.issubdtype(a.dtype, np.integer) or a.dtype == bool):
            return Skip("malformed", f"field {f!r} is not a list of integers ({a.dtype}, {a.ndim}-d)")
        values.append(a)
    ids, mask = values
    if not ids.size:
        return Skip("empty", f"field {tokens_field!r} is an empty list")
    if ids.min() < 0 or ids.max() >= vocab_size:
        return Skip("malformed", f"field {tokens_field!r}: ids {ids.min()}..{ids.max()} outside the tokenizer's "
                                 f"[0, {vocab_size})")
    if mask is None:
        return ids.astype(np.int32), None
    if len(mask) != len(ids) or (mask.size and (mask.min() < 0 or mask.max() > 1)):
        return Skip("malformed", f"field {mask_field!r}: {len(mask)} values in {{0, 1}} needed, one per token "
                                 f"({len(ids)})")
    return ids.astype(np.int32), mask.astype(bool)


def write_tokens(path: str, docs: Iterable[tuple[np.ndarray, np.ndarray | None]], tokens_field: str = "input_ids",
                 mask_field: str = "loss_mask") -> int:
    """Write (ids, mask or None) records to path (.parquet: list<int32> / list<int8> columns; .array_record /
    .arrayrecord: one JSON object per record) -> number of records."""
    rows = [([int(x) for x in ids], None if mask is None else [int(x) for x in mask]) for ids, mask in docs]
    if path.endswith(".parquet"):
        import pyarrow as pa
        import pyarrow.parquet as pq

        table = {tokens_field: pa.array([r for r, _ in rows], pa.list_(pa.int32()))}
        if any(m is not None for _, m in rows):
            table[mask_field] = pa.array([m for _, m in rows], pa.list_(pa.int8()))
        pq.write_table(pa.table(table), path)
    elif path.endswith((".array_record", ".arrayrecord")):
        from array_record.python.array_record_module import ArrayRecordWriter

        w = ArrayRecordWriter(path, "group_size:1")
        for ids, mask in rows:
            w.write(json.dumps({tokens_field: ids, **({} if mask is None else {mask_field: mask})}).encode())
        w.close()
    else:
        raise ValueError(f"write_tokens: {path!r} must end in .parquet, .array_record or .arrayrecord")
    return len(rows)
