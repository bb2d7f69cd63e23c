"""The previous in-memory text loader, kept only while glmjax/train/loop.py imports it (the grain pipeline in
pipeline.py / sources.py replaces it). Each yields documents (name, text) in a deterministic order.

- the embedded default corpus: the `.py` sources of the running interpreter's standard library
  (site-packages excluded; test directories excluded unless asked), sorted by relative path;
- plain-text files (one document per file) and JSONL files (one document per line, its "text" field),
  given as a file or a directory (all files below it, sorted).

Undecodable or empty documents and malformed JSONL lines are skipped, counted and logged -- never silently.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os

from glmjax.data.sources import stdlib_files

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Document:
    name: str
    text: str


@dataclasses.dataclass
class Corpus:
    source: str
    documents: list[Document]
    skipped: int = 0  # undecodable / empty files, malformed JSONL lines

    def __len__(self) -> int:
        return len(self.documents)


def load_corpus(path: str | None = None, max_docs: int | None = None, include_tests: bool = False) -> Corpus:
    """path None -> the stdlib corpus; else a text/JSONL file or a directory of them. Keeps the first max_docs."""
    if path is None:
        corpus = stdlib_corpus(include_tests)
    else:
        corpus = file_corpus(path)
    if max_docs is not None:
        corpus.documents = corpus.documents[:max_docs]
    if not corpus.documents:
        raise ValueError(f"corpus {corpus.source!r} has no usable documents ({corpus.skipped} skipped)")
    if corpus.skipped:
        log.warning("corpus %s: skipped %d empty/undecodable/malformed documents", corpus.source, corpus.skipped)
    return corpus


def stdlib_corpus(include_tests: bool = False) -> Corpus:
    root, names = stdlib_files(include_tests)
    corpus = Corpus(f"stdlib:{root}", [])
    for name in names:
        _add(corpus, name, _read_bytes(os.path.join(root, name)))
    return corpus


def file_corpus(path: str) -> Corpus:
    if not os.path.exists(path):
        raise FileNotFoundError(f"data path {path!r} does not exist")
    corpus = Corpus(path, [])
    if os.path.isdir(path):
        files = sorted(os.path.relpath(os.path.join(d, f), path) for d, _, fs in os.walk(path) for f in fs)
        for f in files:
            _read_file(corpus, os.path.join(path, f), f)
    else:
        _read_file(corpus, path, os.path.basename(path))
    return corpus


def _read_file(corpus: Corpus, path: str, name: str) -> None:
    if path.endswith(".jsonl"):
        with open(path, "rb") as fh:
            for i, line in enumerate(fh):
                if line.strip():
                    _add(corpus, f"{name}:{i + 1}", line, jsonl=True)
    else:
        _add(corpus, name, _read_bytes(path))


def _read_bytes(path: str) -> bytes:
    with open(path, "rb") as fh:
        return fh.read()


def _add(corpus: Corpus, name: str, data: bytes, jsonl: bool = False) -> None:
    try:
        text = data.decode("utf-8")
        if jsonl:
            text = json.loads(text)["text"]
            if not isinstance(text, str):
                raise TypeError("'text' is not a string")
    except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as e:
        if corpus.skipped < 5:
            log.warning("skipping %s: %s: %s", name, type(e).__name__, e)
        corpus.skipped += 1
        return
    if not text.strip():
        corpus.skipped += 1
        return
    corpus.documents.append(Document(name, text))
