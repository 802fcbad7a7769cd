"""PyTorch `.pt` files (torch.save's zip format) for small tensors, read and written without torch.

Some DFlash drafters ship `mask_embedding.pt` (see `dlmjax.io.dflash`): one tensor, bare or in a
dict `{"mask_token_id": int, "embedding": tensor}`. That is all this module serves: dicts with str
keys, ints, strings and dense tensors of float32, float16 or bfloat16 (read also: int64 and int32
tensors, and a tensor saved as an `nn.Parameter`).

The format: a zip archive under one top folder holding `data.pkl` (a pickle in which each tensor
is `torch._utils._rebuild_tensor_v2(storage, offset, size, stride, ...)` and each storage a
persistent id `("storage", torch.<Type>Storage, key, location, numel)`), the storages' raw
little-endian bytes as `data/<key>`, `byteorder` and `version`. Reading resolves only those
globals (like `torch.load(weights_only=True)`), so a crafted file cannot run code.
"""

from __future__ import annotations

import io
import pickle
import struct
import zipfile
from collections import OrderedDict
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from dlmjax.io.files import atomic_file
from dlmjax.io.safetensors import CheckpointError
from dlmjax.validation import is_count

STORAGE_DTYPES = {
    "FloatStorage": np.dtype(np.float32),
    "HalfStorage": np.dtype(np.float16),
    "BFloat16Storage": np.dtype(ml_dtypes.bfloat16),
}
_STORAGE_NAMES = {dtype: name for name, dtype in STORAGE_DTYPES.items()}
_READ_STORAGE_DTYPES = {**STORAGE_DTYPES, "LongStorage": np.dtype(np.int64), "IntStorage": np.dtype(np.int32)}
_ARCHIVE = "archive"  # the top folder torch.save writes


class _Storage:
    def __init__(self, dtype: np.dtype):
        self.dtype = dtype


def _rebuild_tensor(storage, offset, size, stride, *_unused) -> np.ndarray:
    """The tensor `size` at `offset` with `stride` (elements) in `storage`, copied out. The
    layout is checked first (as torch does: offset, sizes and strides non-negative integers,
    every element inside the storage), so a crafted file cannot make it read other memory."""
    if not (isinstance(storage, np.ndarray) and is_count(offset) and isinstance(size, tuple)
            and isinstance(stride, tuple) and len(size) == len(stride) and all(map(is_count, size + stride))):
        raise CheckpointError(f"a tensor record (offset {offset!r}, size {size!r}, stride {stride!r}) is not a "
                              "valid layout; re-save the file with torch.save")
    if 0 in size:
        return np.zeros(size, storage.dtype)
    end = offset + 1 + sum((n - 1) * s for n, s in zip(size, stride))
    if end > storage.size:
        raise CheckpointError(f"a tensor of size {size} runs past its storage ({storage.size} elements)")
    strides = tuple(s * storage.itemsize for s in stride)
    return np.lib.stride_tricks.as_strided(storage[offset:], shape=size, strides=strides).copy()


def _parameter_data(data, _requires_grad, _hooks, *_state) -> np.ndarray:
    """An `nn.Parameter` (torch._utils._rebuild_parameter[_with_state]): its tensor."""
    return data


class _Unpickler(pickle.Unpickler):
    def __init__(self, data: bytes, read_storage, path: Path):
        super().__init__(io.BytesIO(data))
        self._read_storage = read_storage
        self._path = path

    def find_class(self, module: str, name: str):
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return _rebuild_tensor
        if (module, name) in (("torch._utils", "_rebuild_parameter"), ("torch._utils", "_rebuild_parameter_with_state")):
            return _parameter_data
        if (module, name) == ("collections", "OrderedDict"):
            return OrderedDict
        if module == "torch" and name in _READ_STORAGE_DTYPES:
            return _Storage(_READ_STORAGE_DTYPES[name])
        raise CheckpointError(
            f"{self._path} holds {module}.{name}, which dlmjax does not read from a .pt file "
            "(it reads dicts, ints, strings and tensors of float32, float16, bfloat16, int64 or int32)"
        )

    def persistent_load(self, pid):
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage" and isinstance(pid[1], _Storage)):
            raise CheckpointError(f"{self._path}: unexpected storage record {pid!r}")
        _, storage, key, _location, numel = pid
        return self._read_storage(str(key), storage.dtype, int(numel))


def read_pt(path: str | Path) -> Any:
    """The object in a torch.save file, its tensors as numpy arrays (bfloat16 via ml_dtypes)."""
    path = Path(path)
    try:
        archive = zipfile.ZipFile(path)
    except (OSError, zipfile.BadZipFile) as exc:
        raise CheckpointError(f"{path} is not a PyTorch zip file (torch.save since torch 1.6): {exc}") from None
    try:
        with archive:
            return _read_archive(archive, path)
    except CheckpointError:
        raise
    except (zipfile.BadZipFile, KeyError, EOFError, pickle.UnpicklingError, ValueError, struct.error, TypeError,
            AttributeError, IndexError) as exc:  # a crafted or damaged pickle calls what it names wrongly
        raise CheckpointError(f"{path} is damaged ({type(exc).__name__}: {exc}); re-download or re-save it") from None


def _read_archive(archive: zipfile.ZipFile, path: Path) -> Any:
    """The object pickled in `archive` (a torch.save zip), its storages read from it."""
    names = archive.namelist()
    pickles = [n for n in names if n.endswith("/data.pkl") and n.count("/") == 1]
    if len(pickles) != 1:
        raise CheckpointError(f"{path} has no single <folder>/data.pkl; it is not a torch.save file")
    top = pickles[0][: -len("data.pkl")]
    if f"{top}byteorder" in names and archive.read(f"{top}byteorder") != b"little":
        raise CheckpointError(f"{path} was written big-endian; dlmjax reads little-endian .pt files")

    def read_storage(key: str, dtype: np.dtype, numel: int) -> np.ndarray:
        raw = archive.read(f"{top}data/{key}")
        if len(raw) != numel * dtype.itemsize:
            raise CheckpointError(f"{path}: storage {key} has {len(raw)} bytes, expected {numel} x {dtype}")
        return np.frombuffer(raw, dtype=dtype)

    return _Unpickler(archive.read(pickles[0]), read_storage, path).load()


# ----------------------------------------------------------------------------------------------
# Writing: the pickle is emitted opcode by opcode, since pickle.Pickler would import torch to
# name its globals.


def _str(text: str) -> bytes:
    raw = text.encode()
    return pickle.BINUNICODE + struct.pack("<I", len(raw)) + raw


def _int(value: int) -> bytes:
    if -(2**31) <= value < 2**31:
        return pickle.BININT + struct.pack("<i", value)
    raw = value.to_bytes((value.bit_length() + 8) // 8, "little", signed=True)
    return pickle.LONG1 + bytes([len(raw)]) + raw


def _global(module: str, name: str) -> bytes:
    return pickle.GLOBAL + f"{module}\n{name}\n".encode()


def _int_tuple(values) -> bytes:
    return pickle.MARK + b"".join(_int(int(v)) for v in values) + pickle.TUPLE


def _tensor(array: np.ndarray, key: str) -> bytes:
    strides = [int(np.prod(array.shape[i + 1:])) for i in range(array.ndim)]
    storage = pickle.MARK + _str("storage") + _global("torch", _STORAGE_NAMES[array.dtype]) + _str(key) \
        + _str("cpu") + _int(array.size) + pickle.TUPLE + pickle.BINPERSID
    hooks = _global("collections", "OrderedDict") + pickle.EMPTY_TUPLE + pickle.REDUCE
    args = pickle.MARK + storage + _int(0) + _int_tuple(array.shape) + _int_tuple(strides) + pickle.NEWFALSE \
        + hooks + pickle.TUPLE
    return _global("torch._utils", "_rebuild_tensor_v2") + args + pickle.REDUCE


def _encode(value, storages: list[np.ndarray]) -> bytes:
    if isinstance(value, np.ndarray):
        if value.dtype not in _STORAGE_NAMES:
            raise ValueError(f"cannot write a {value.dtype} tensor to a .pt file; use one of {list(_STORAGE_NAMES)}")
        storages.append(np.ascontiguousarray(value))
        return _tensor(value, str(len(storages) - 1))
    if isinstance(value, dict):
        items = b"".join(_encode(k, storages) + _encode(v, storages) for k, v in value.items())
        return pickle.EMPTY_DICT + (pickle.MARK + items + pickle.SETITEMS if value else b"")
    if isinstance(value, bool):
        return pickle.NEWTRUE if value else pickle.NEWFALSE
    if isinstance(value, int):
        return _int(value)
    if isinstance(value, str):
        return _str(value)
    raise ValueError(f"cannot write {type(value).__name__} to a .pt file (dicts, ints, strings and arrays only)")


def write_pt(path: str | Path, value) -> None:
    """Write `value` (a numpy array, or a dict of str -> int | str | array) as torch.save would,
    so that `torch.load(path, weights_only=True)` gives it back with torch tensors."""
    storages: list[np.ndarray] = []
    data = pickle.PROTO + bytes([2]) + _encode(value, storages) + pickle.STOP
    with atomic_file(path) as tmp, zipfile.ZipFile(tmp, "w", zipfile.ZIP_STORED) as archive:
        archive.writestr(f"{_ARCHIVE}/data.pkl", data)
        archive.writestr(f"{_ARCHIVE}/byteorder", "little")
        for key, array in enumerate(storages):
            archive.writestr(f"{_ARCHIVE}/data/{key}", array.tobytes())
        archive.writestr(f"{_ARCHIVE}/version", "3\n")


__all__ = ["read_pt", "write_pt"]
