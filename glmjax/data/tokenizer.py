"""Byte-level tokenizer: ids 0..255 are the UTF-8 bytes, then BOS, EOS, PAD. Lossless for any text."""
from __future__ import annotations

import numpy as np


class ByteTokenizer:
    BOS = 256
    EOS = 257
    PAD = 258
    vocab_size = 259  # the model's vocab_size must be at least this

    def encode(self, text: str | bytes, bos: bool = True, eos: bool = True) -> np.ndarray:
        """text -> int32 ids [n] (UTF-8 bytes, optionally wrapped in BOS ... EOS)."""
        data = text.encode("utf-8") if isinstance(text, str) else bytes(text)
        ids = np.frombuffer(data, dtype=np.uint8).astype(np.int32)
        parts = ([np.array([self.BOS], np.int32)] if bos else []) + [ids]
        parts += [np.array([self.EOS], np.int32)] if eos else []
        return np.concatenate(parts)

    def decode(self, ids) -> str:
        """ids -> text; special tokens are dropped, invalid UTF-8 (e.g. a cut multi-byte char) becomes U+FFFD."""
        ids = np.asarray(ids).reshape(-1)
        if ids.size and (ids.min() < 0 or ids.max() >= self.vocab_size):
            raise ValueError(f"token id out of range [0, {self.vocab_size}): {ids.min()}..{ids.max()}")
        return ids[ids < 256].astype(np.uint8).tobytes().decode("utf-8", errors="replace")
