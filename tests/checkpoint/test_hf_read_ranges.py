"""HFCheckpoint.read: row and column ranges, including a range open at its end."""

from __future__ import annotations

import torch
from safetensors.torch import save_file

from stapo_megatron.checkpoint.hf_io import HFCheckpoint


def test_row_and_column_ranges_and_an_open_end(tmp_path):
    value = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    (tmp_path / "hf").mkdir()
    save_file({"w": value}, tmp_path / "hf" / "model.safetensors", metadata={"format": "pt"})
    checkpoint = HFCheckpoint(tmp_path / "hf")
    assert torch.equal(checkpoint.read("w", 0, 1, 3), value[1:3])
    assert torch.equal(checkpoint.read("w", 1, 2, 5), value[:, 2:5])
    # stop None reads to the end of the dimension (it used to fail on None - start)
    assert torch.equal(checkpoint.read("w", 0, 2), value[2:])
    assert torch.equal(checkpoint.read("w", 1, 4), value[:, 4:])
