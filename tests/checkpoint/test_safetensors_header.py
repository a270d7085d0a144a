"""The safetensors reader checks every claim of a header against the file: a crafted header is a
one-line ConfigError naming the file and the tensor, never wrong weights or an OverflowError /
MemoryError traceback."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from safetensors.torch import save_file

from stapo_megatron.checkpoint.hf_io import INDEX_FILE, MAX_HEADER_BYTES, HFCheckpoint
from stapo_megatron.config import ConfigError

DATA = bytes(range(32))  # room for 8 float32 values


def write(directory, header, data: bytes = DATA, length: int | None = None):
    """``model.safetensors`` in ``directory`` from a header (a dict, or raw bytes) and data."""
    directory.mkdir(exist_ok=True)
    encoded = header if isinstance(header, bytes) else json.dumps(header).encode()
    path = directory / "model.safetensors"
    path.write_bytes(struct.pack("<Q", len(encoded) if length is None else length) + encoded + data)
    return directory


def tensor(begin, end, shape=None, dtype="F32"):
    return {"dtype": dtype, "shape": [(end - begin) // 4] if shape is None else shape, "data_offsets": [begin, end]}


def refused(directory, pattern: str) -> str:
    with pytest.raises(ConfigError, match=pattern) as err:
        HFCheckpoint(directory)
    message = str(err.value)
    assert "\n" not in message and "model.safetensors" in message, message
    return message


def test_a_well_formed_file_reads_exactly(tmp_path):
    tensors = {
        "a": torch.arange(6, dtype=torch.float32).reshape(2, 3),
        "b": torch.arange(4, dtype=torch.int64),
        "empty": torch.zeros(0, 5, dtype=torch.bfloat16),
        "scalar": torch.tensor(7, dtype=torch.int32),
    }
    (tmp_path / "hf").mkdir()
    save_file(tensors, tmp_path / "hf" / "model.safetensors", metadata={"format": "pt"})
    checkpoint = HFCheckpoint(tmp_path / "hf")
    for name, value in tensors.items():
        assert torch.equal(checkpoint.read(name), value), name
    write(tmp_path / "own", {"a": tensor(0, 16), "b": tensor(16, 32), "z": tensor(16, 16, shape=[0, 3])})
    assert torch.equal(
        HFCheckpoint(tmp_path / "own").read("b"), torch.frombuffer(bytearray(DATA[16:]), dtype=torch.float32)
    )


def test_overlapping_tensors(tmp_path):
    refused(write(tmp_path / "hf", {"a": tensor(0, 16), "b": tensor(8, 24)}), r"tensor b overlaps tensor a")
    refused(write(tmp_path / "same", {"a": tensor(0, 16), "b": tensor(0, 16)}), r"tensor b overlaps tensor a")


def test_offsets_that_run_short_or_long_of_the_shape(tmp_path):
    refused(
        write(tmp_path / "short", {"w": tensor(0, 8, shape=[4])}),
        r"model\.safetensors: tensor w: data_offsets \[0, 8\] hold 8 bytes, but shape \[4\] of F32 needs 16",
    )
    refused(
        write(tmp_path / "long", {"w": tensor(0, 32, shape=[2, 2])}),
        r"tensor w: .* hold 32 bytes, but shape \[2, 2\] of F32 needs 16",
    )
    refused(
        write(tmp_path / "huge", {"w": tensor(0, 16, shape=[2**40, 2**40, 2**40])}),
        r"tensor w: .* needs more than the file holds",
    )


@pytest.mark.parametrize("offsets", [[0, 64], [-4, 12], [16, 8], [40, 48]])
def test_offsets_outside_the_data(tmp_path, offsets):
    header = {"w": {"dtype": "U8", "shape": [max(offsets[1] - offsets[0], 0)], "data_offsets": offsets}}
    refused(
        write(tmp_path / "hf", header),
        rf"tensor w: data_offsets \[{offsets[0]}, {offsets[1]}\] are outside the file's 32 data bytes",
    )


@pytest.mark.parametrize("offsets", [[0], [0, 16, 32], [0, "16"], [0.0, 16.0], [False, 16], "0-16", None])
def test_offsets_that_are_not_two_integers(tmp_path, offsets):
    refused(
        write(tmp_path / "hf", {"w": {"dtype": "F32", "shape": [4], "data_offsets": offsets}}),
        r"tensor w: data_offsets must be two integers",
    )


@pytest.mark.parametrize("shape", [[-1], [2, -2], "4", [4.0], [True], None, [1] * 65])
def test_bad_shapes(tmp_path, shape):
    refused(
        write(tmp_path / "hf", {"w": {"dtype": "F32", "shape": shape, "data_offsets": [0, 16]}}),
        r"tensor w: shape must be a list",
    )


@pytest.mark.parametrize("dtype", ["F8_E4M3X", "float32", 4, None])
def test_unknown_dtypes(tmp_path, dtype):
    refused(
        write(tmp_path / "hf", {"w": {"dtype": dtype, "shape": [4], "data_offsets": [0, 16]}}),
        r"tensor w has unsupported dtype",
    )


def test_entries_that_are_not_tensor_descriptions(tmp_path):
    refused(write(tmp_path / "a", {"w": [0, 16]}), r"tensor w: needs dtype, shape and data_offsets")
    refused(
        write(tmp_path / "b", {"w": {"dtype": "F32", "shape": [4]}}), r"tensor w: needs dtype, shape and data_offsets"
    )
    refused(write(tmp_path / "c", {"__metadata__": [1], "w": tensor(0, 16)}), r"__metadata__ is not an object")


def test_duplicate_tensor_names(tmp_path):
    header = (
        b'{"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}, '
        b'"w": {"dtype": "F32", "shape": [4], "data_offsets": [16, 32]}}'
    )
    refused(write(tmp_path / "hf", header), r"corrupt safetensors header \(tensor w appears twice\)")


@pytest.mark.parametrize("length", [2**64 - 1, 2**63, MAX_HEADER_BYTES + 1, 10_000])
def test_header_lengths_beyond_the_file_or_the_bound(tmp_path, length):
    refused(write(tmp_path / "hf", {"w": tensor(0, 16)}, length=length), r"safetensors header of \d+ bytes claimed")


@pytest.mark.parametrize("header", [b"{not json", b"\xff\xfe{}", b"[1, 2]", b"7", b"[" * 100_000 + b"]" * 100_000])
def test_headers_that_are_not_a_json_object(tmp_path, header):
    refused(write(tmp_path / "hf", header), r"model\.safetensors: corrupt safetensors header")


def test_file_shorter_than_the_length_field(tmp_path):
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "model.safetensors").write_bytes(b"\x01\x02")
    refused(tmp_path / "hf", r"truncated safetensors file")


def test_index_naming_files_elsewhere_or_not_json(tmp_path):
    directory = write(tmp_path / "hf", {"w": tensor(0, 16)})
    (directory / INDEX_FILE).write_text(json.dumps({"weight_map": {"w": "../elsewhere.safetensors"}}))
    with pytest.raises(
        ConfigError, match=r"tensor w is mapped to '\.\./elsewhere\.safetensors', not a file of this directory"
    ):
        HFCheckpoint(directory)
    for text in ("{", "[1]", json.dumps({"weight_map": {"w": 3}})):
        (directory / INDEX_FILE).write_text(text)
        with pytest.raises(ConfigError, match=rf"{INDEX_FILE}: "):
            HFCheckpoint(directory)
