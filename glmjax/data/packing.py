"""Packing tokenized documents into fixed-length rows.

A row is {tokens, segment_ids, positions, loss_mask}, each [S] int32: the documents in a row are numbered 1, 2, ...,
positions restart at 0 for each document, and the unused tail is padding (PAD token, segment 0, position 0, mask 0).
A document longer than S is cut into S-token pieces; each piece is its own document (positions from 0).
Packing is greedy (next fit): a piece that does not fit in the current row closes it and starts the next one.
loss_mask[t] = 1 where token t is a training target, i.e. may be predicted from the tokens before it in its
segment: every token but the first of its segment, and for SFT documents only response tokens (and the closing EOS),
for conversations only the tokens their own mask marks (assistant tokens, chat.py).

`Block` is what the grain pipeline (pipeline.py) uses.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np


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

    docs: [(tokens int32 [n], targets)]: targets is an int response_start (tokens before it are never targets; 0 = all
    may be) or a bool [n] array of the tokens that may be targets. Further tuple items are ignored.
    Only the plan is kept (piece -> document, offset, length); `fill(j, ...)` writes row j on demand.
    """

    def __init__(self, docs: Sequence[tuple[np.ndarray, int]], seq_len: int, rng: np.random.Generator | None = None):
        self.docs, self.seq_len = docs, seq_len
        lens = np.array([len(d[0]) for d in docs], np.int64)
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
            toks, targets = self.docs[self.doc[p]][:2]
            s, n = int(self.start[p]), int(self.length[p])
            tokens[at:at + n] = toks[s:s + n]
            segment_ids[at:at + n] = seg
            positions[at:at + n] = np.arange(n)
            if isinstance(targets, np.ndarray):
                loss_mask[at:at + n] = targets[s:s + n]
            else:
                loss_mask[at:at + n] = np.arange(s, s + n) >= targets
            loss_mask[at] = 0  # a segment's first token has nothing before it to be predicted from
            at += n


# ------------------------------------------------------------------------------------------------ legacy


Batch = dict  # {"tokens", "segment_ids", "positions"}: np.int32 [B,S]
