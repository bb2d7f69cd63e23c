"""Document sources: random-access records from text files, JSONL, Parquet and ArrayRecord, or the embedded default
corpus, and the parsing of one raw record into a document or a counted skip reason.

A `Source` is a grain random-access data source (`len`, `[i]`) over all records of a path, in a fixed order
(files sorted by relative path, then line / row order). Opening one reads only metadata, except JSONL, whose line
offsets are found once by scanning the bytes (no decoding). Each record has a stable 64-bit key hash (from its
file's relative path and its line / row number) so that the train / held-out split does not depend on the seed,
on the order of files or on other files in the directory.

Formats (`data.format`; "auto" picks one per file by extension: .jsonl, .parquet, .array_record / .arrayrecord,
anything else is text):
- text: one document per file (UTF-8);
- jsonl: one JSON object per line; the document is its `text_field` (or `prompt_field` + `response_field` for SFT,
  or `messages_field` for chat, chat.py, or `tokens_field` for pre-tokenized records, pretokenized.py);
- parquet: one row per document, same fields (string or binary columns; lists / structs for messages and tokens);
- arrayrecord: one UTF-8 document per record; arrayrecord_json: one JSON object per record, same fields as JSONL
  ("auto" reads ArrayRecord files as arrayrecord_json when messages_field or tokens_field is set).
The embedded default corpus (no path) is the `.py` sources of the running interpreter's standard library
(site-packages, caches and test directories excluded), as text documents.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import mmap
import os
import sysconfig
import time
from typing import NamedTuple

import numpy as np

FORMATS = ("auto", "text", "jsonl", "parquet", "arrayrecord", "arrayrecord_json")
SKIP_REASONS = ("empty", "undecodable", "too_long", "malformed")
NOT_STDLIB = {"site-packages", "dist-packages", "__pycache__"}
TEST_DIRS = {"test", "tests", "idle_test"}
EXTENSIONS = {".jsonl": "jsonl", ".parquet": "parquet", ".array_record": "arrayrecord", ".arrayrecord": "arrayrecord"}


@dataclasses.dataclass(frozen=True)
class Fields:
    """How a record becomes a document: which fields to read and the length limit (chars)."""
    text_field: str = "text"
    prompt_field: str | None = None  # SFT: prompt_field and response_field both set
    response_field: str | None = None
    max_doc_chars: int | None = None
    messages_field: str | None = None  # chat: a list of messages (chat.py)
    tools_field: str | None = None  # chat: the tools offered to the model (optional per record)
    tokens_field: str | None = None  # pre-tokenized: a list of token ids (pretokenized.py)
    loss_mask_field: str | None = None  # pre-tokenized: a list of 0/1 per token (optional per record)

    @property
    def sft(self) -> bool:
        return self.response_field is not None

    @property
    def columns(self) -> tuple[str, ...]:
        """The fields every record needs (Parquet: the columns that must exist)."""
        if self.messages_field:
            return (self.messages_field,)
        if self.tokens_field:
            return (self.tokens_field,)
        return (self.prompt_field, self.response_field) if self.sft else (self.text_field,)

    @property
    def optional_columns(self) -> tuple[str, ...]:
        return tuple(f for f in (self.tools_field if self.messages_field else None,
                                 self.loss_mask_field if self.tokens_field else None) if f)


class Doc(NamedTuple):
    prompt: str  # "" unless SFT
    text: str  # the document (pretraining) or the response (SFT)


class DataError(ValueError):
    """A data file that cannot be used (unreadable, wrong format, missing column, no usable records): the message
    names the file and the problem."""


class Skip(NamedTuple):
    reason: str  # one of SKIP_REASONS
    detail: str


# ------------------------------------------------------------------------------------------------ readers (one file)


class Watched:
    """A data file's identity (size, modification time, inode), taken when it is opened and checked at each read:
    a file changed under a running job (rewritten, truncated, replaced) is a DataError naming it, never records read
    from other bytes than those indexed at start."""

    def watch(self, path: str, st: os.stat_result | None = None) -> None:
        self.path, self.stamp = path, _stamp(st or os.stat(path))

    def check(self, st: os.stat_result | None = None) -> None:
        try:
            now = _stamp(st or os.stat(self.path))
        except FileNotFoundError:
            now = None
        if now != self.stamp:
            (size, mtime, ino), what = self.stamp, "it was removed"
            if now is not None:
                what = (f"{size:,} -> {now[0]:,} bytes" if now[0] != size else "replaced by another file"
                        if now[2] != ino else f"rewritten at {time.strftime('%H:%M:%S', time.localtime(now[1] / 1e9))}")
            raise DataError(f"data file {self.path!r} changed while the run reads it ({what}); a run reads its data "
                            "as it was when it started: restore the file or start a new run")


def _stamp(st: os.stat_result) -> tuple[int, int, int]:
    return st.st_size, st.st_mtime_ns, st.st_ino


class TextFile(Watched):
    kind = "text"

    def __init__(self, path: str):
        self.watch(path)
        self.sizes = np.array([self.stamp[0]], np.int64)

    def __len__(self):
        return 1

    def read(self, i: int) -> bytes:
        with open(self.path, "rb") as f:
            self.check(os.fstat(f.fileno()))
            return f.read()


class JsonlFile(Watched):
    """Lines with at least one byte other than the line break are records; numbered by their line in the file."""
    kind = "json"

    def __init__(self, path: str):
        with open(path, "rb") as f:
            self.watch(path, os.fstat(f.fileno()))
            size = self.stamp[0]
            if size:
                with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
                    data = np.frombuffer(m, np.uint8)
                    ends = np.flatnonzero(data == 10)
                    cr = data[np.maximum(ends - 1, 0)] == 13  # CRLF line ends
                    del data
            else:
                ends, cr = np.zeros(0, np.int64), np.zeros(0, bool)
        if not len(ends) or ends[-1] != size - 1:  # last line without a line break
            ends, cr = np.append(ends, size), np.append(cr, False)
        starts = np.concatenate([[0], ends[:-1] + 1])
        stops = ends - cr
        keep = stops > starts
        self.rows = np.flatnonzero(keep)  # 0-based line numbers of the records
        self.starts, self.stops = starts[keep], stops[keep]
        self.sizes = (self.stops - self.starts).astype(np.int64)

    def __len__(self):
        return len(self.starts)

    def read(self, i: int) -> bytes:
        with open(self.path, "rb") as f:
            self.check(os.fstat(f.fileno()))
            f.seek(int(self.starts[i]))
            return f.read(int(self.stops[i] - self.starts[i]))


class ParquetFile(Watched):
    """Rows of the needed columns. Parquet has no random access below a row group, and documents are read in a
    shuffled order, so the needed columns of the whole file are read on first use and kept (as Arrow arrays: about
    the size of the text). For corpora larger than memory use ArrayRecord, which reads single records."""
    kind = "row"

    def __init__(self, path: str, columns: tuple[str, ...], optional: tuple[str, ...] = ()):
        import pyarrow.parquet as pq

        self.watch(path)
        self.file = pq.ParquetFile(path)
        names = self.file.schema_arrow.names
        missing = [c for c in columns if c not in names]
        if missing:
            raise DataError(f"parquet file {path!r} has no column(s) {missing} (columns: {names}); set "
                            "data.text_field (or prompt_field / response_field) to one of its columns")
        md = self.file.metadata
        counts = [md.row_group(g).num_rows for g in range(md.num_row_groups)]
        per_row = [md.row_group(g).total_byte_size / max(n, 1) for g, n in enumerate(counts)]
        self.sizes = np.repeat(np.array(per_row, np.float64), counts).astype(np.int64)
        self.columns, self._table = columns + tuple(c for c in optional if c in names), None

    def __len__(self):
        return self.file.metadata.num_rows

    def read(self, i: int) -> dict:
        if self._table is None:  # read whole once: what changes later is not read
            self.check()
            self._table = self.file.read(columns=list(self.columns))
        return {c: self._table.column(c)[i].as_py() for c in self.columns}


class ArrayRecordFile(Watched):
    def __init__(self, path: str, kind: str):
        import grain

        self.watch(path)
        self.kind, self.source = kind, grain.sources.ArrayRecordDataSource([path])
        n = len(self.source)
        self.sizes = np.full(n, os.path.getsize(path) // max(n, 1), np.int64)

    def __len__(self):
        return len(self.source)

    def read(self, i: int) -> bytes:
        self.check()
        return self.source[i]


# ------------------------------------------------------------------------------------------------ the source


class Source:
    """All records below a path (or of the default corpus), indexed 0..n-1 across files. source[i] -> (kind, raw)
    with kind "text" (UTF-8 bytes), "json" (a JSON object's bytes) or "row" (a dict of column values)."""

    def __init__(self, name: str, files: list[tuple[str, object]]):
        self.name = name
        self.readers = [r for _, r in files]
        self.offsets = np.cumsum([0] + [len(r) for r in self.readers])
        self._relnames = [n for n, _ in files]

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def __getitem__(self, i: int):
        f = int(np.searchsorted(self.offsets, i, side="right") - 1)
        r = self.readers[f]
        return r.kind, r.read(int(i - self.offsets[f]))

    def key(self, i: int) -> str:
        f = int(np.searchsorted(self.offsets, i, side="right") - 1)
        r = self.readers[f]
        local = int(i - self.offsets[f])
        row = int(r.rows[local]) + 1 if isinstance(r, JsonlFile) else local
        return self._relnames[f] if isinstance(r, TextFile) else f"{self._relnames[f]}:{row}"

    def key_hashes(self) -> np.ndarray:
        """uint64 [n]: a hash of (file relative path, line / row number) per record."""
        out = []
        for name, r in zip(self._relnames, self.readers):
            base = np.uint64(int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little"))
            rows = r.rows if isinstance(r, JsonlFile) else np.arange(len(r))
            out.append(_splitmix64(base + rows.astype(np.uint64)))
        return np.concatenate(out) if out else np.zeros(0, np.uint64)

    def approx_bytes(self) -> np.ndarray:
        """int64 [n]: bytes per record (exact for text files and JSONL lines; an average for Parquet/ArrayRecord)."""
        return np.concatenate([r.sizes for r in self.readers]) if self.readers else np.zeros(0, np.int64)


def _splitmix64(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        z = x + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def stdlib_files(include_tests: bool = False) -> tuple[str, list[str]]:
    """(root, sorted relative paths of the standard library's .py files)."""
    root = sysconfig.get_paths()["stdlib"]
    skip = NOT_STDLIB | (set() if include_tests else TEST_DIRS)
    names = []
    for d, dirs, files in os.walk(root):
        dirs[:] = [x for x in dirs if x not in skip]
        names += [os.path.relpath(os.path.join(d, f), root) for f in files if f.endswith(".py")]
    return root, sorted(names)


def file_format(path: str, fmt: str) -> str:
    return EXTENSIONS.get(os.path.splitext(path)[1].lower(), "text") if fmt == "auto" else fmt


def open_source(path: str | None, fmt: str = "auto", fields: Fields = Fields()) -> Source:
    """The records of a file or of every file below a directory (hidden and '_'-prefixed names skipped), or of
    the embedded stdlib corpus when path is None."""
    if path is None:
        root, names = stdlib_files()
        return Source(f"stdlib:{root}", [(n, TextFile(os.path.join(root, n))) for n in names])
    if not os.path.exists(path):
        raise FileNotFoundError(f"data path {path!r} does not exist")
    if os.path.isdir(path):
        names = []
        for d, dirs, files in os.walk(path):
            dirs[:] = [x for x in dirs if not x.startswith((".", "_"))]
            names += [os.path.relpath(os.path.join(d, f), path) for f in files if not f.startswith((".", "_"))]
        files = [(n, os.path.join(path, n)) for n in sorted(names)]
    else:
        files = [(os.path.basename(path), path)]
    readers = []
    for name, p in files:
        kind = file_format(p, fmt)
        if kind == "arrayrecord" and fmt == "auto" and (fields.messages_field or fields.tokens_field):
            kind = "arrayrecord_json"  # chat and token records are JSON objects
        if kind not in FORMATS[1:]:
            raise ValueError(f"unknown data format {fmt!r} (known: {FORMATS})")
        readers.append((name, open_reader(p, kind, fields.columns, fields.optional_columns)))
    return Source(path, readers)


def open_reader(p: str, kind: str, columns: tuple[str, ...], optional: tuple[str, ...] = ()):
    """One file's reader; any failure to open it -> DataError naming the file."""
    if os.path.islink(p) and not os.path.exists(p):
        raise DataError(f"data file {p!r} is a dangling symlink (its target {os.readlink(p)!r} does not exist)")
    try:
        if kind == "text":
            return TextFile(p)
        if kind == "jsonl":
            return JsonlFile(p)
        if kind == "parquet":
            return ParquetFile(p, columns, optional)
        return ArrayRecordFile(p, "json" if kind == "arrayrecord_json" else "text")
    except DataError:
        raise
    except Exception as e:  # noqa: BLE001 -- OSError, pyarrow's ArrowInvalid, grain's errors ...
        raise DataError(f"data file {p!r} cannot be read as {kind} ({type(e).__name__}: "
                        f"{str(e).splitlines()[0][:200] if str(e) else ''})") from e


# ------------------------------------------------------------------------------------------------ parsing


def record(kind: str, raw) -> str | dict | Skip:
    """One raw record -> its text (kind "text"), its fields (a dict), or Skip for undecodable / malformed bytes."""
    if kind in ("text", "json"):
        try:
            raw = bytes(raw).decode("utf-8")
        except UnicodeDecodeError as e:
            return Skip("undecodable", str(e))
    if kind == "json":
        try:
            raw = json.loads(raw)
        except json.JSONDecodeError as e:
            return Skip("malformed", f"invalid JSON: {e}")
        if not isinstance(raw, dict):
            return Skip("malformed", f"a JSON {type(raw).__name__}, not an object")
    return raw


def parse(kind: str, raw, fields: Fields) -> Doc | Skip:
    """One raw record -> Doc, or Skip(reason, detail) for an undecodable, malformed, empty or too long record."""
    raw = record(kind, raw)
    if isinstance(raw, Skip):
        return raw
    if kind == "text":
        if fields.sft:
            return Skip("malformed", "a plain-text record has no prompt/response fields")
        doc = Doc("", raw)
    else:
        values = []
        for f in ((fields.prompt_field, fields.response_field) if fields.sft else (fields.text_field,)):
            v = raw.get(f)
            if isinstance(v, bytes):
                try:
                    v = v.decode("utf-8")
                except UnicodeDecodeError as e:
                    return Skip("undecodable", f"field {f!r}: {e}")
            if not isinstance(v, str):
                return Skip("malformed", f"field {f!r} is missing or not a string ({type(v).__name__})")
            values.append(v)
        doc = Doc(*values) if fields.sft else Doc("", values[0])
    if not doc.text.strip():
        return Skip("empty", "no text" if not fields.sft else "empty response")
    n = len(doc.prompt) + len(doc.text)
    if fields.max_doc_chars is not None and n > fields.max_doc_chars:
        return Skip("too_long", f"{n:,} chars > max_doc_chars={fields.max_doc_chars:,}")
    return doc
