"""Tokenizers. The pipeline needs only the `Tokenizer` protocol, so any tokenizer with these members plugs in;
`make_tokenizer(name)` builds the named one: "byte", or "hf:DIR" (a Hugging Face tokenizer.json in the checkpoint
directory DIR, hf_tokenizer.py).

ByteTokenizer: ids 0..255 are the UTF-8 bytes, then BOS, EOS, PAD. Lossless for any text.
"""
from __future__ import annotations

from typing import Protocol

import numpy as np

from glmjax.data.hf_tokenizer import PREFIX, HFTokenizer


class Tokenizer(Protocol):
    vocab_size: int
    bos_id: int | None  # None: no BOS (encode(bos=True) adds nothing)
    eos_id: int
    pad_id: int

    def encode(self, text: str, bos: bool = True, eos: bool = True) -> np.ndarray:
        """text -> int32 ids [n], optionally wrapped in BOS ... EOS."""

    def encode_batch(self, texts: list[str], bos: bool = True, eos: bool = True) -> list[np.ndarray]:
        """[encode(t, bos, eos) for t in texts], possibly faster."""

    def decode(self, ids) -> str:
        """ids -> text (special tokens dropped)."""


class ByteTokenizer:
    BOS = 256
    EOS = 257
    PAD = 258
    vocab_size = 259  # the model's vocab_size must be at least this
    bos_id, eos_id, pad_id = BOS, EOS, PAD

    def encode(self, text: str | bytes, bos: bool = True, eos: bool = True) -> np.ndarray:
        """text -> int32 ids [n] (UTF-8 bytes, optionally wrapped in BOS ... EOS)."""
        data = text.encode("utf-8") if isinstance(text, str) else bytes(text)
        ids = np.frombuffer(data, dtype=np.uint8).astype(np.int32)
        parts = ([np.array([self.BOS], np.int32)] if bos else []) + [ids]
        parts += [np.array([self.EOS], np.int32)] if eos else []
        return np.concatenate(parts)

    def encode_batch(self, texts: list[str | bytes], bos: bool = True, eos: bool = True) -> list[np.ndarray]:
        return [self.encode(t, bos, eos) for t in texts]

    def decode(self, ids) -> str:
        """ids -> text; special tokens are dropped, invalid UTF-8 (e.g. a cut multi-byte char) becomes U+FFFD."""
        ids = np.asarray(ids).reshape(-1)
        if ids.size and (ids.min() < 0 or ids.max() >= self.vocab_size):
            raise ValueError(f"token id out of range [0, {self.vocab_size}): {ids.min()}..{ids.max()}")
        return ids[ids < 256].astype(np.uint8).tobytes().decode("utf-8", errors="replace")


TOKENIZERS = {"byte": ByteTokenizer}


def make_tokenizer(name: str = "byte") -> Tokenizer:
    """"byte" or "hf:DIR"."""
    if name.startswith(PREFIX):
        return HFTokenizer(name[len(PREFIX):])
    if name not in TOKENIZERS:
        raise ValueError(f"unknown tokenizer {name!r} (known: {', '.join(TOKENIZERS)}, {PREFIX}DIR)")
    return TOKENIZERS[name]()
