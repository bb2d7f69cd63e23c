"""Minimal safetensors reader/writer on numpy + ml_dtypes (bf16 and float8 included), memory-mapped.

Format: 8-byte little-endian header length N, N bytes of JSON header
`{key: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}`, then the raw little-endian data.
Reading maps the file and returns views (no copy); writing streams one tensor at a time, so neither side ever
holds more than one tensor beyond what the caller keeps.
"""
from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping

import ml_dtypes
import numpy as np

from glmjax.workdir import CheckpointError

DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}
DTYPE_NAMES: dict[np.dtype, str] = {v: k for k, v in DTYPES.items()}


class SafetensorsFormatError(CheckpointError, ValueError):
    """A file that is not valid safetensors (the message names the file and the problem)."""


@dataclass(frozen=True)
class TensorInfo:
    file: str
    dtype: str  # safetensors dtype name, e.g. "BF16"
    shape: tuple[int, ...]
    begin: int  # byte offsets inside the data section
    end: int


def read_header(path: str) -> tuple[dict[str, TensorInfo], dict]:
    """-> ({key: TensorInfo}, metadata). Validates offsets against the file size and the dtype/shape sizes."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise SafetensorsFormatError(f"{path}: too short for a safetensors file")
        (n,) = struct.unpack("<Q", raw)
        if n > size - 8:
            raise SafetensorsFormatError(f"{path}: header length {n} exceeds the file size {size}")
        try:
            header = json.loads(f.read(n))
        except json.JSONDecodeError as e:
            raise SafetensorsFormatError(f"{path}: header is not JSON ({e})") from None
    metadata = header.pop("__metadata__", None) or {}
    data_len = size - 8 - n
    out = {}
    for key, e in header.items():
        dt = e.get("dtype")
        if dt not in DTYPES:
            raise SafetensorsFormatError(f"{path}: tensor {key!r} has unsupported dtype {dt!r}")
        shape = tuple(int(s) for s in e["shape"])
        begin, end = (int(x) for x in e["data_offsets"])
        nbytes = int(np.prod(shape, dtype=np.int64)) * DTYPES[dt].itemsize
        if not 0 <= begin <= end <= data_len or end - begin != nbytes:
            raise SafetensorsFormatError(f"{path}: tensor {key!r} has bad data_offsets [{begin}, {end}] for dtype "
                                         f"{dt} shape {list(shape)} (data section {data_len} bytes)")
        out[key] = TensorInfo(path, dt, shape, begin, end)
    return out, metadata


class Reader:
    """Memory-maps safetensors files on demand; `get(info)` returns a read-only view of one tensor."""

    def __init__(self):
        self._maps: dict[str, tuple[np.memmap, int]] = {}

    def get(self, info: TensorInfo) -> np.ndarray:
        if info.file not in self._maps:
            with open(info.file, "rb") as f:
                (n,) = struct.unpack("<Q", f.read(8))
            self._maps[info.file] = (np.memmap(info.file, np.uint8, mode="r"), 8 + n)
        mm, start = self._maps[info.file]
        dt = DTYPES[info.dtype]
        buf = mm[start + info.begin:start + info.end]
        return buf.view(dt).reshape(info.shape)

    def close(self, file: str | None = None):
        for f in ([file] if file else list(self._maps)):
            self._maps.pop(f, None)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def write_file(path: str, entries: Iterable[tuple[str, str, tuple[int, ...]]],
               produce: Callable[[str], np.ndarray], metadata: Mapping[str, str] | None = None) -> int:
    """Write one safetensors file. `entries` = (key, dtype name, shape) in file order; `produce(key)` returns the
    tensor (cast to exactly that dtype and shape) when its turn comes, so only one tensor is live at a time.
    The header is padded with spaces to a multiple of 8 bytes. Returns the data size in bytes."""
    entries = list(entries)
    header: dict = {"__metadata__": dict(metadata or {"format": "pt"})}
    offset = 0
    for key, dt, shape in entries:
        nbytes = int(np.prod(shape, dtype=np.int64)) * DTYPES[dt].itemsize
        header[key] = {"dtype": dt, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for key, dt, shape in entries:
            a = np.asarray(produce(key))
            if a.dtype != DTYPES[dt] or a.shape != tuple(shape):
                raise ValueError(f"{key}: produced {a.dtype}{list(a.shape)}, header says {dt}{list(shape)}")
            f.write(np.ascontiguousarray(a).tobytes())
    os.replace(tmp, path)
    return offset
