"""Minimal safetensors reader/writer over numpy memory maps, with errors that name the file.

The format is an 8-byte little-endian header length, a JSON header
`{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}`, then the
raw little-endian bytes. Reading through `np.memmap` keeps host memory at one tensor at a time
and gives bfloat16 via ml_dtypes (numpy has no native bf16).
"""

from __future__ import annotations

import json
import math
import os
import struct
from pathlib import Path

import ml_dtypes
import numpy as np

from dlmjax.io.files import atomic_file
from dlmjax.validation import InputError, is_count

SAFETENSORS_DTYPES = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
}
_CODES = {v: k for k, v in SAFETENSORS_DTYPES.items()}


class CheckpointError(InputError):
    """A checkpoint file that cannot be read as it stands."""


GIT_LFS_POINTER = b"version https://git-lfs.github.com/spec/"  # how a Git LFS pointer file starts


def refuse_git_lfs_pointer(path: Path, error: type[Exception]) -> None:
    """`error` where the file at `path` is a Git LFS pointer (a repository cloned without git-lfs)."""
    with open(path, "rb") as f:
        if f.read(len(GIT_LFS_POINTER)) == GIT_LFS_POINTER:
            raise error(f"{path} is a Git LFS pointer, not the file: the repository was cloned without git-lfs; "
                        "run `git lfs pull` in it (or download it with huggingface_hub)")


class SafetensorsFile:
    """Lazy view of one .safetensors file: `keys()`, `get(name)` -> np.ndarray.

    `get` returns a read-only memory map: copy it (`np.array`) before the file is rewritten.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        size = self.path.stat().st_size
        refuse_git_lfs_pointer(self.path, CheckpointError)
        with open(self.path, "rb") as f:
            raw_len = f.read(8)
            if len(raw_len) < 8:
                raise CheckpointError(f"{self.path}: truncated shard ({size} bytes, no safetensors header)")
            (header_len,) = struct.unpack("<Q", raw_len)
            if 8 + header_len > size:
                raise CheckpointError(
                    f"{self.path}: truncated shard: header claims {header_len} bytes but the file has {size}; "
                    "re-download or re-export this file"
                )
            try:
                header = json.loads(f.read(header_len))
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise CheckpointError(f"{self.path}: corrupt safetensors header ({e})") from e
        if not isinstance(header, dict):
            raise CheckpointError(f"{self.path}: corrupt safetensors header (a JSON {type(header).__name__}, not an "
                                  "object); re-download or re-export this file")
        self.metadata = header.pop("__metadata__", {}) or {}
        if not (isinstance(self.metadata, dict) and all(isinstance(v, str) for v in self.metadata.values())):
            raise CheckpointError(f"{self.path}: corrupt safetensors header: __metadata__ is {self.metadata!r}, not an "
                                  "object of strings; re-download or re-export this file")
        for name, entry in header.items():
            problem = _entry_problem(entry)
            if problem:
                raise CheckpointError(f"{self.path}: corrupt safetensors header: tensor {name!r} {problem}; "
                                      "re-download or re-export this file")
        self._entries = header
        self._data_start = 8 + header_len
        end = max((e["data_offsets"][1] for e in header.values()), default=0)
        if self._data_start + end > size:
            raise CheckpointError(
                f"{self.path}: truncated shard: tensors need {self._data_start + end} bytes, the file has {size}; "
                "re-download or re-export this file"
            )

    def keys(self) -> list[str]:
        return list(self._entries)

    def stored_dtype(self, name: str) -> str:
        """The dtype code tensor `name` is stored in (F32, BF16, ...), read from the header alone."""
        return self._entries[name]["dtype"]

    def nbytes(self, name: str) -> int:
        begin, end = self._entries[name]["data_offsets"]
        return end - begin

    def get(self, name: str) -> np.ndarray:
        entry = self._entries[name]
        code = entry["dtype"]
        if code not in SAFETENSORS_DTYPES:
            raise CheckpointError(
                f"{self.path}: tensor {name!r} has dtype {code!r}, which dlmjax cannot load; "
                f"supported: {', '.join(SAFETENSORS_DTYPES)}"
            )
        dtype = SAFETENSORS_DTYPES[code]
        begin, end = entry["data_offsets"]
        shape = tuple(entry["shape"])
        if end - begin != math.prod(shape) * dtype.itemsize:  # Python ints: a huge shape cannot wrap to 0
            raise CheckpointError(f"{self.path}: tensor {name!r}: byte range does not match shape {shape} {code}")
        if 0 in shape:
            return np.zeros(shape, dtype)
        return np.memmap(self.path, dtype=dtype, mode="r", offset=self._data_start + begin,
                         shape=shape or (1,)).reshape(shape)  # a memmap cannot be 0-d: a scalar reads as [1]


def _entry_problem(entry) -> str | None:
    """What is wrong with one tensor's header entry (None: nothing). Offsets are checked to be
    ordered here; that the ranges fit the file, `SafetensorsFile` checks."""
    if not isinstance(entry, dict):
        return f"is {entry!r}, not an object"
    if not isinstance(entry.get("dtype"), str):
        return f"has no dtype string ({entry.get('dtype')!r})"
    shape, offsets = entry.get("shape"), entry.get("data_offsets")
    if not (isinstance(shape, list) and all(map(is_count, shape))):
        return f"has shape {shape!r}, not a list of non-negative integers"
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(map(is_count, offsets))
            and offsets[0] <= offsets[1]):
        return f"has data_offsets {offsets!r}, not [begin, end] with 0 <= begin <= end"
    return None


def save_file(tensors: dict[str, np.ndarray], path: str | os.PathLike, metadata: dict | None = None) -> None:
    """Write tensors (float64/32/16, bfloat16) to one safetensors file (under a temporary name,
    renamed into place when complete: a killed write leaves the previous file whole)."""
    header, offset = {}, 0
    arrays = {}
    for name, arr in tensors.items():
        arr = np.ascontiguousarray(arr).reshape(np.shape(arr))  # ascontiguousarray makes a scalar [1]
        if arr.dtype not in _CODES:
            raise CheckpointError(f"cannot save {name!r} with dtype {arr.dtype}; supported: {list(_CODES)}")
        arrays[name] = arr
        header[name] = {"dtype": _CODES[arr.dtype], "shape": list(arr.shape), "data_offsets": [offset, offset + arr.nbytes]}
        offset += arr.nbytes
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # align the data section to 8 bytes
    with atomic_file(path) as tmp, open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for arr in arrays.values():
            f.write(arr.tobytes())
