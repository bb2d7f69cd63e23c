"""A Hugging Face tokenizer from a checkpoint directory (`data.tokenizer = "hf:DIR"`), read with the `tokenizers`
library (transformers is not needed).

DIR holds tokenizer.json (the vocabulary, merges, normalizer, pre-tokenizer and added tokens) and optionally
tokenizer_config.json / special_tokens_map.json (the named special tokens and the chat template) and
chat_template.jinja (the chat template, as transformers >= 4.43 saves it; it wins over tokenizer_config.json's).

Special tokens: each of bos/eos/unk/sep/pad/cls/mask_token is read from tokenizer_config.json, else from
special_tokens_map.json (a string, or an added-token object with a "content" string); its id is looked up in
tokenizer.json. PAD falls back to EOS when the checkpoint names no pad token (padding is never a target).

Encoding is transformers' `tokenizer(text, add_special_tokens=False)`: the post-processor's special tokens are not
added; `encode(text, bos, eos)` wraps the ids in BOS ... EOS itself (BOS only where the checkpoint has one). Special
tokens written in the text (e.g. "<|user|>") become their ids, as in transformers. `vocab_size` is one more than the
largest id (added tokens included): the model's vocab_size must be at least that.
"""
from __future__ import annotations

import json
import os

import numpy as np

from glmjax.data.sources import DataError

SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
PREFIX = "hf:"


def _read_json(path: str) -> dict:
    if not os.path.exists(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            out = json.load(f)
    except (OSError, ValueError) as e:
        raise DataError(f"tokenizer file {path!r} is not valid JSON ({type(e).__name__}: {e})") from e
    if not isinstance(out, dict):
        raise DataError(f"tokenizer file {path!r} holds a JSON {type(out).__name__}, not an object")
    return out


def _token_text(value, path: str, name: str) -> str | None:
    if isinstance(value, dict):
        value = value.get("content")
    if value is not None and not isinstance(value, str):
        raise DataError(f"tokenizer file {path!r}: {name} must be a string or an object with a 'content' string, "
                        f"not {type(value).__name__}")
    return value


class HFTokenizer:
    """tokenizer.json + the special tokens and chat template of a checkpoint directory (see the module docstring).

    Attributes: directory, vocab_size, bos_id (None where the checkpoint has no BOS), eos_id, pad_id,
    special_tokens ({"bos_token": "<s>", ...}: the named tokens the checkpoint defines, as the chat template sees
    them), chat_template (the Jinja source, or None), chat_template_file (where it was read from).
    """

    def __init__(self, directory: str):
        from tokenizers import Tokenizer

        self.directory = directory
        path = os.path.join(directory, "tokenizer.json")
        if not os.path.isfile(path):
            raise DataError(f"tokenizer directory {directory!r} has no tokenizer.json (a Hugging Face fast "
                            "tokenizer file is needed)")
        try:
            self.tokenizer = Tokenizer.from_file(path)
        except Exception as e:  # noqa: BLE001 -- the Rust library raises plain Exception
            raise DataError(f"tokenizer file {path!r} cannot be loaded ({type(e).__name__}: "
                            f"{str(e).splitlines()[0][:200] if str(e) else ''})") from e
        config_path = os.path.join(directory, "tokenizer_config.json")
        map_path = os.path.join(directory, "special_tokens_map.json")
        config, special_map = _read_json(config_path), _read_json(map_path)

        self.special_tokens = {}
        for name in SPECIAL_TOKENS:
            text = _token_text(config.get(name), config_path, name)
            if text is None:
                text = _token_text(special_map.get(name), map_path, name)
            if text is not None:
                self.special_tokens[name] = text
        ids = {}
        for name, text in self.special_tokens.items():
            ids[name] = self.tokenizer.token_to_id(text)
            if ids[name] is None:
                raise DataError(f"tokenizer directory {directory!r}: {name}={text!r} is not a token of tokenizer.json")
        self.bos_id = ids.get("bos_token")
        self.eos_id = ids.get("eos_token")
        self.pad_id = ids.get("pad_token", self.eos_id)
        if self.eos_id is None:
            raise DataError(f"tokenizer directory {directory!r}: no eos_token in tokenizer_config.json or "
                            "special_tokens_map.json (documents and conversations need an end token)")
        self.vocab_size = max(self.tokenizer.get_vocab(with_added_tokens=True).values()) + 1

        template_path = os.path.join(directory, "chat_template.jinja")
        if os.path.isfile(template_path):
            with open(template_path, encoding="utf-8") as f:
                self.chat_template, self.chat_template_file = f.read(), template_path
        else:
            self.chat_template, self.chat_template_file = _default_template(config.get("chat_template"),
                                                                            config_path), config_path

    def encode(self, text: str, bos: bool = True, eos: bool = True) -> np.ndarray:
        """text -> int32 ids [n], optionally wrapped in BOS ... EOS."""
        return self.encode_batch([text], bos, eos)[0]

    def encode_batch(self, texts: list[str], bos: bool = True, eos: bool = True) -> list[np.ndarray]:
        """texts -> [int32 ids [n_i]], encoded in parallel by the Rust library."""
        head = [self.bos_id] if bos and self.bos_id is not None else []
        tail = [self.eos_id] if eos else []
        return [np.array(head + e.ids + tail, np.int32)
                for e in self.tokenizer.encode_batch_fast(list(texts), add_special_tokens=False)]

    def encode_with_offsets(self, texts: list[str]) -> list[tuple[np.ndarray, np.ndarray]]:
        """texts -> [(int32 ids [n], int64 character offsets [n, 2])], no special tokens added."""
        return [(np.array(e.ids, np.int32), np.array(e.offsets, np.int64).reshape(-1, 2))
                for e in self.tokenizer.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids) -> str:
        """ids -> text (special tokens dropped)."""
        ids = np.asarray(ids).reshape(-1)
        if ids.size and (ids.min() < 0 or ids.max() >= self.vocab_size):
            raise ValueError(f"token id out of range [0, {self.vocab_size}): {ids.min()}..{ids.max()}")
        return self.tokenizer.decode(ids.tolist(), skip_special_tokens=True)

    def __repr__(self):
        return f"HFTokenizer({self.directory!r}, vocab_size={self.vocab_size})"


def _default_template(value, path: str) -> str | None:
    """tokenizer_config.json's chat_template: a string, or a list of {name, template} (the one named "default")."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        if isinstance(named.get("default"), str):
            return named["default"]
        raise DataError(f"tokenizer file {path!r}: chat_template is a list without a 'default' template "
                        f"(names: {sorted(map(str, named))})")
    raise DataError(f"tokenizer file {path!r}: chat_template must be a string or a list, not {type(value).__name__}")
