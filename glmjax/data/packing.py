"""Packing tokenized documents into fixed-length rows.

A row is {tokens, segment_ids, positions, loss_mask}, each [S] int32: the documents in a row are numbered 1, 2, ...,
positions restart at 0 for each document, and the unused tail is padding (PAD token, segment 0, position 0, mask 0).
A document longer than S is cut into S-token pieces; each piece is its own document (positions from 0).
Packing is greedy (next fit): a piece that does not fit in the current row closes it and starts the next one.
loss_mask[t] = 1 where token t is a training target, i.e. may be predicted from the tokens before it in its
segment: every token but the first of its segment, and for SFT documents only response tokens (and the closing EOS).

`Block` is what the grain pipeline (pipeline.py) uses. `pack_rows`, `stack_rows`, `split_documents` and `Packer`
below are the previous in-memory pipeline, kept only while glmjax/train/loop.py still imports them.
"""
from __future__ import annotations

import itertools
from typing import Iterable, Iterator, Sequence

import numpy as np

from glmjax.data.tokenizer import ByteTokenizer


def next_fit(lengths: Sequence[int], capacity: int) -> np.ndarray:
    """Greedy next-fit bins for items of the given lengths (each <= capacity), in order -> bounds [rows + 1]:
    row j holds items bounds[j]:bounds[j+1]."""
    bounds, fill = [0], 0
    for i, n in enumerate(lengths):
        if fill + n > capacity:
            bounds.append(i)
            fill = 0
        fill += n
    if len(lengths):
        bounds.append(len(lengths))
    return np.asarray(bounds, np.int64)


class Block:
    """Documents cut into S-token pieces, the pieces optionally shuffled, packed next-fit into rows.

    docs: [(tokens int32 [n], response_start)]: tokens before response_start are never targets (0 = all may be).
    Only the plan is kept (piece -> document, offset, length); `fill(j, ...)` writes row j on demand.
    """

    def __init__(self, docs: Sequence[tuple[np.ndarray, int]], seq_len: int, rng: np.random.Generator | None = None):
        self.docs, self.seq_len = docs, seq_len
        lens = np.array([len(t) for t, _ in docs], np.int64)
        n_pieces = -(-lens // seq_len)
        doc = np.repeat(np.arange(len(docs)), n_pieces)
        first = np.cumsum(n_pieces) - n_pieces
        start = (np.arange(len(doc)) - first[doc]) * seq_len
        order = rng.permutation(len(doc)) if rng is not None else np.arange(len(doc))
        self.doc, self.start = doc[order], start[order]
        self.length = np.minimum(seq_len, lens[self.doc] - self.start)
        self.bounds = next_fit(self.length, seq_len)

    @property
    def num_rows(self) -> int:
        return len(self.bounds) - 1

    def fill(self, j: int, tokens: np.ndarray, segment_ids: np.ndarray, positions: np.ndarray,
             loss_mask: np.ndarray) -> None:
        """Write row j into [S] arrays that hold padding (the caller's PAD / 0 fill)."""
        at = 0
        for seg, p in enumerate(range(self.bounds[j], self.bounds[j + 1]), start=1):
            toks, response_start = self.docs[self.doc[p]]
            s, n = int(self.start[p]), int(self.length[p])
            tokens[at:at + n] = toks[s:s + n]
            segment_ids[at:at + n] = seg
            positions[at:at + n] = np.arange(n)
            loss_mask[at:at + n] = np.arange(s, s + n) >= response_start
            loss_mask[at] = 0  # a segment's first token has nothing before it to be predicted from
            at += n


# ------------------------------------------------------------------------------------------------ legacy


Batch = dict  # {"tokens", "segment_ids", "positions"}: np.int32 [B,S]


def chunks(ids: np.ndarray, seq_len: int) -> Iterator[np.ndarray]:
    for start in range(0, len(ids), seq_len):
        yield ids[start:start + seq_len]


def pack_rows(documents: Iterable[np.ndarray], seq_len: int, pad_id: int = ByteTokenizer.PAD) -> Iterator[dict]:
    """Greedily pack token arrays into rows of length seq_len (see the module docstring)."""

    def empty():
        return {"tokens": np.full(seq_len, pad_id, np.int32), "segment_ids": np.zeros(seq_len, np.int32),
                "positions": np.zeros(seq_len, np.int32)}

    row, fill, n = empty(), 0, 0
    for ids in documents:
        for piece in chunks(np.asarray(ids, np.int32), seq_len):
            if fill + len(piece) > seq_len:
                yield row
                row, fill, n = empty(), 0, 0
            n += 1
            end = fill + len(piece)
            row["tokens"][fill:end] = piece
            row["segment_ids"][fill:end] = n
            row["positions"][fill:end] = np.arange(len(piece))
            fill = end
    if fill:
        yield row


def stack_rows(rows: Sequence[dict], batch_size: int, pad_id: int = ByteTokenizer.PAD) -> Batch:
    """Stack rows into a batch [B,S]; a short last batch is filled with all-padding rows."""
    S = len(rows[0]["tokens"])
    out = {k: np.stack([r[k] for r in rows]) for k in rows[0]}
    missing = batch_size - len(rows)
    if missing:
        out = {k: np.concatenate([v, np.full((missing, S), pad_id if k == "tokens" else 0, np.int32)])
               for k, v in out.items()}
    return out


def split_documents(docs: Sequence, eval_fraction: float, seed: int) -> tuple[list, list]:
    """Deterministic held-out split by document: (train, eval). eval gets round(n * eval_fraction) docs, at least
    one when eval_fraction > 0; train keeps at least one."""
    n = len(docs)
    n_eval = 0 if eval_fraction <= 0 else min(max(1, round(n * eval_fraction)), n - 1)
    perm = np.random.default_rng(seed).permutation(n)
    eval_idx = set(perm[:n_eval].tolist())
    return [d for i, d in enumerate(docs) if i not in eval_idx], [d for i, d in enumerate(docs) if i in eval_idx]


class Packer:
    """Tokenizes texts once and serves batches of packed rows.

    Documents are cut into S-token chunks up front; training shuffles the chunks (seeded, reshuffled every epoch)
    before packing, so a batch mixes many documents. Iterating is endless (epoch after epoch); `batches(n)` gives the
    first n batches in corpus order without shuffling (the eval set).
    """

    def __init__(self, texts: Sequence[str], tokenizer: ByteTokenizer, seq_len: int, batch_size: int, seed: int = 0):
        self.tokenizer, self.seq_len, self.batch_size, self.seed = tokenizer, seq_len, batch_size, seed
        self.docs = [tokenizer.encode(t) for t in texts]
        self.pieces = np.array([(d, s) for d, ids in enumerate(self.docs) for s in range(0, len(ids), seq_len)],
                               np.int64).reshape(-1, 2)
        self.num_tokens = sum(len(d) for d in self.docs)

    def _rows(self, order: np.ndarray) -> Iterator[dict]:
        S = self.seq_len
        return pack_rows((self.docs[d][s:s + S] for d, s in self.pieces[order]), S, self.tokenizer.PAD)

    def __iter__(self) -> Iterator[Batch]:
        def all_rows():
            for epoch in itertools.count():
                rng = np.random.default_rng([self.seed, epoch])
                yield from self._rows(rng.permutation(len(self.pieces)))

        rows = all_rows()
        while True:
            yield stack_rows(list(itertools.islice(rows, self.batch_size)), self.batch_size)

    def batches(self, n: int | None = None) -> list[Batch]:
        rows = self._rows(np.arange(len(self.pieces)))
        out = []
        while n is None or len(out) < n:
            group = list(itertools.islice(rows, self.batch_size))
            if not group:
                break
            out.append(stack_rows(group, self.batch_size, self.tokenizer.PAD))
        return out
