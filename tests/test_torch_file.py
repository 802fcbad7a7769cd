"""dlmjax.io.torch_file reads what torch.save writes and writes what torch.load reads, without torch."""

from __future__ import annotations

import pickle
import zipfile

import ml_dtypes
import numpy as np
import pytest
import torch

from dlmjax.io.safetensors import CheckpointError
from dlmjax.io.torch_file import read_pt, write_pt


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_reads_tensors_as_torch_saves_them(tmp_path, dtype):
    """Views (a row of a table, a transpose) are saved with their whole storage, an offset and
    strides; a scalar and an empty tensor too."""
    table = torch.randn(5, 6).to(dtype)
    cases = {"row": table[3], "transposed": table.T, "bare": table, "scalar": table[1, 2], "empty": table[:0]}
    for name, tensor in cases.items():
        torch.save({"mask_token_id": 7, "embedding": tensor}, tmp_path / f"{name}.pt")
        got = read_pt(tmp_path / f"{name}.pt")
        assert got["mask_token_id"] == 7
        want = tensor.float().numpy()
        assert got["embedding"].shape == want.shape, name
        np.testing.assert_array_equal(got["embedding"].astype(np.float32), want, err_msg=name)


def test_writes_what_torch_loads(tmp_path):
    bf16 = np.random.RandomState(0).randn(3, 4).astype(ml_dtypes.bfloat16)
    value = {"mask_token_id": 151669, "big": 2**40, "negative": -3, "name": "mask", "flag": True,
             "embedding": bf16, "half": np.arange(5, dtype=np.float16), "single": np.float32([1.5])}
    write_pt(tmp_path / "out.pt", value)
    loaded = torch.load(tmp_path / "out.pt", weights_only=True)
    assert {k: loaded[k] for k in ("mask_token_id", "big", "negative", "name", "flag")} == {
        "mask_token_id": 151669, "big": 2**40, "negative": -3, "name": "mask", "flag": True}
    assert loaded["embedding"].dtype == torch.bfloat16 and loaded["half"].dtype == torch.float16
    np.testing.assert_array_equal(loaded["embedding"].float().numpy(), bf16.astype(np.float32))
    np.testing.assert_array_equal(loaded["half"].numpy(), value["half"])
    np.testing.assert_array_equal(read_pt(tmp_path / "out.pt")["embedding"], bf16)
    write_pt(tmp_path / "bare.pt", np.float32([[1, 2], [3, 4]]))
    assert torch.equal(torch.load(tmp_path / "bare.pt", weights_only=True), torch.tensor([[1.0, 2.0], [3.0, 4.0]]))


def test_reads_parameters_and_integer_tensors_as_torch_load_does(tmp_path):
    """`torch.save(nn.Parameter)` and a mask id saved as a 0-d tensor: torch.load(weights_only=True)
    reads both, so a DFlash trainer's mask_embedding.pt may hold either."""
    row = torch.randn(8).to(torch.bfloat16)
    torch.save(torch.nn.Parameter(row), tmp_path / "param.pt")
    np.testing.assert_array_equal(read_pt(tmp_path / "param.pt").astype(np.float32), row.float().numpy())
    torch.save({"mask_token_id": torch.tensor(7), "ids": torch.arange(3, dtype=torch.int32)}, tmp_path / "ints.pt")
    got = read_pt(tmp_path / "ints.pt")
    assert got["mask_token_id"].dtype == np.int64 and int(got["mask_token_id"]) == 7
    assert got["ids"].dtype == np.int32 and got["ids"].tolist() == [0, 1, 2]


def test_a_damaged_file_is_named_as_damaged(tmp_path):
    torch.save({"mask_token_id": 7, "embedding": torch.randn(64)}, tmp_path / "ok.pt")
    raw = (tmp_path / "ok.pt").read_bytes()
    with zipfile.ZipFile(tmp_path / "ok.pt") as archive:
        names = archive.namelist()
        members = {name: archive.read(name) for name in names}
        storage_offset = archive.getinfo(next(n for n in names if n.endswith("data/0"))).header_offset
    flipped = bytearray(raw)
    flipped[storage_offset + 200] ^= 0xFF  # a byte of the storage: its CRC no longer matches
    (tmp_path / "bitflip.pt").write_bytes(bytes(flipped))
    for name, edit in {"nostorage": lambda n, b: None if n.endswith("data/0") else b,
                       "shortpkl": lambda n, b: b[:-5] if n.endswith("data.pkl") else b}.items():
        with zipfile.ZipFile(tmp_path / f"{name}.pt", "w") as archive:
            for member, data in members.items():
                if (data := edit(member, data)) is not None:
                    archive.writestr(member, data)
    for name in ("bitflip", "nostorage", "shortpkl"):
        with pytest.raises(CheckpointError, match=f"{name}.pt is damaged .*; re-download or re-save it"):
            read_pt(tmp_path / f"{name}.pt")


def test_a_crafted_pickle_that_calls_what_it_names_wrongly_is_named_as_damaged(tmp_path):
    """Each raised a bare TypeError (a bug report) instead of naming the file."""
    g = lambda module, name: pickle.GLOBAL + f"{module}\n{name}\n".encode()  # noqa: E731
    one = pickle.BININT + (1).to_bytes(4, "little")
    for name, body in {"od_of_an_int": g("collections", "OrderedDict") + pickle.MARK + one + pickle.TUPLE,
                       "storage_called": g("torch", "FloatStorage") + pickle.EMPTY_TUPLE,
                       "parameter_without_args": g("torch._utils", "_rebuild_parameter") + pickle.EMPTY_TUPLE}.items():
        with zipfile.ZipFile(tmp_path / f"{name}.pt", "w") as archive:
            archive.writestr("archive/data.pkl", pickle.PROTO + b"\x02" + body + pickle.REDUCE + pickle.STOP)
            archive.writestr("archive/byteorder", "little")
        with pytest.raises(CheckpointError, match=f"{name}.pt is damaged"):
            read_pt(tmp_path / f"{name}.pt")


def test_refuses_what_it_does_not_read_and_never_runs_code(tmp_path):
    torch.save({"flags": torch.tensor([True, False])}, tmp_path / "bool.pt")
    with pytest.raises(CheckpointError, match="torch.BoolStorage, which dlmjax does not read"):
        read_pt(tmp_path / "bool.pt")

    class Exploit:
        def __reduce__(self):
            return (open, (str(tmp_path / "pwned"), "w"))

    with zipfile.ZipFile(tmp_path / "evil.pt", "w") as archive:
        archive.writestr("archive/data.pkl", pickle.dumps(Exploit(), protocol=2))
    with pytest.raises(CheckpointError, match=r"holds io.open, which dlmjax does not read"):
        read_pt(tmp_path / "evil.pt")
    assert not (tmp_path / "pwned").exists()

    (tmp_path / "legacy.pt").write_bytes(pickle.dumps({"a": 1}))
    with pytest.raises(CheckpointError, match="is not a PyTorch zip file"):
        read_pt(tmp_path / "legacy.pt")


def _one_tensor_file(path, *, offset, size, stride, numel=4):
    """A .pt file whose one tensor is `_rebuild_tensor_v2(storage of numel floats, offset, size,
    stride)` as written by hand: what a crafted file can say."""
    from dlmjax.io.torch_file import _global, _int, _int_tuple, _str

    storage = (pickle.MARK + _str("storage") + _global("torch", "FloatStorage") + _str("0") + _str("cpu")
               + _int(numel) + pickle.TUPLE + pickle.BINPERSID)
    hooks = _global("collections", "OrderedDict") + pickle.EMPTY_TUPLE + pickle.REDUCE
    args = (pickle.MARK + storage + _int(offset) + _int_tuple(size) + _int_tuple(stride) + pickle.NEWFALSE + hooks
            + pickle.TUPLE)
    data = (pickle.PROTO + bytes([2]) + _global("torch._utils", "_rebuild_tensor_v2") + args + pickle.REDUCE
            + pickle.STOP)
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("archive/data.pkl", data)
        archive.writestr("archive/byteorder", "little")
        archive.writestr("archive/data/0", np.arange(numel, dtype=np.float32).tobytes())


@pytest.mark.parametrize("offset,size,stride", [
    (0, (4,), (-1,)),  # before the storage: read heap memory into the tensor
    (0, (2,), (-(1 << 44),)),  # far before it: a segfault
    (-1, (4,), (1,)),  # a negative offset: past the end
    (0, (2, 2), (1,)),  # sizes and strides of different lengths
    (2, (4,), (1,)),  # runs past the storage
])
def test_a_crafted_layout_is_refused_and_never_reads_outside_its_storage(tmp_path, offset, size, stride):
    _one_tensor_file(tmp_path / "crafted.pt", offset=offset, size=size, stride=stride)
    with pytest.raises(CheckpointError, match="is not a valid layout|runs past its storage"):
        read_pt(tmp_path / "crafted.pt")
    _one_tensor_file(tmp_path / "fine.pt", offset=1, size=(3,), stride=(1,))
    np.testing.assert_array_equal(read_pt(tmp_path / "fine.pt"), [1.0, 2.0, 3.0])
