"""HF <-> Megatron conversion: bit-exact round trips at any layout, and its errors."""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from stapo_megatron.checkpoint.convert import convert_hf_to_megatron, convert_megatron_to_hf
from stapo_megatron.checkpoint.hf_io import INDEX_FILE
from stapo_megatron.config import ConfigError
from tests.helpers import save_tiny_qwen3


def read_all(directory):
    tensors = {}
    for file in sorted(directory.glob("*.safetensors")):
        tensors.update(load_file(file))
    return tensors


def assert_bit_exact(source, exported):
    a, b = read_all(source), read_all(exported)
    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name].dtype == b[name].dtype, name
        assert torch.equal(a[name], b[name]), f"{name} differs after the round trip"


def test_round_trip_tied_is_bit_exact(tmp_path):
    from transformers import Qwen3ForCausalLM

    hf = save_tiny_qwen3(tmp_path / "hf", tie=True, seed=5)
    (hf / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 256}))
    convert_hf_to_megatron(hf, tmp_path / "mg", tp=2, pp=2)
    assert (tmp_path / "mg" / "hf_assets" / "tokenizer_config.json").is_file()
    out = convert_megatron_to_hf(tmp_path / "mg", tmp_path / "back", tp=1, pp=1)
    assert_bit_exact(hf, out)
    assert json.loads((out / "tokenizer_config.json").read_text()) == {"model_max_length": 256}
    original = Qwen3ForCausalLM.from_pretrained(hf, dtype=torch.float32)
    reloaded = Qwen3ForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert reloaded.config.tie_word_embeddings
    ids = torch.randint(0, 1000, (2, 7))
    with torch.no_grad():
        assert torch.equal(original(ids).logits, reloaded(ids).logits)


def test_round_trip_untied_sharded_is_bit_exact_at_every_export_layout(tmp_path):
    hf = save_tiny_qwen3(tmp_path / "hf", tie=False, seed=6, max_shard_size="150KB")
    assert (hf / INDEX_FILE).is_file()
    convert_hf_to_megatron(hf, tmp_path / "mg", tp=2, pp=2)
    from_tp1 = convert_megatron_to_hf(tmp_path / "mg", tmp_path / "tp1", tp=1, pp=1, max_shard_bytes=100_000)
    assert_bit_exact(hf, from_tp1)
    index = json.loads((from_tp1 / INDEX_FILE).read_text())
    assert set(index["weight_map"]) == set(read_all(hf))
    assert len(set(index["weight_map"].values())) > 1
    # Loaded at TP2 x PP2: each stage writes its own shards, one tensor in memory at a time.
    from_tp2pp2 = convert_megatron_to_hf(tmp_path / "mg", tmp_path / "tp2pp2", tp=2, pp=2, max_shard_bytes=100_000)
    assert_bit_exact(hf, from_tp2pp2)
    # bf16 export
    as_bf16 = convert_megatron_to_hf(tmp_path / "mg", tmp_path / "bf16", tp=1, pp=1, dtype="bfloat16")
    exported = read_all(as_bf16)
    source = read_all(hf)
    assert all(t.dtype == torch.bfloat16 for t in exported.values())
    assert torch.equal(exported["lm_head.weight"], source["lm_head.weight"].to(torch.bfloat16))
    assert json.loads((as_bf16 / "config.json").read_text())["torch_dtype"] == "bfloat16"


def test_existing_output_is_kept_unless_overwrite(tmp_path):
    hf = save_tiny_qwen3(tmp_path / "hf", tie=True)
    out = tmp_path / "mg"
    out.mkdir()
    (out / "keep.txt").write_text("precious")
    with pytest.raises(ConfigError, match="not empty"):
        convert_hf_to_megatron(hf, out, tp=1, pp=1)
    assert (out / "keep.txt").read_text() == "precious"


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory):
    return save_tiny_qwen3(tmp_path_factory.mktemp("errors") / "hf", tie=False)


def _variant(tiny_hf, tmp_path, edit_tensors=None, edit_config=None):
    out = tmp_path / "variant"
    shutil.copytree(tiny_hf, out)
    if edit_config:
        config = json.loads((out / "config.json").read_text())
        edit_config(config)
        (out / "config.json").write_text(json.dumps(config))
    if edit_tensors:
        tensors = read_all(out)
        edit_tensors(tensors)
        save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    return out


@pytest.mark.parametrize(
    "case, kwargs, message",
    [
        ("not_qwen3", {}, r"not a dense Qwen3 model \(model_type='llama'"),
        ("tp_heads", {"tp": 3}, r"parallel.tensor_parallel: 3 does not divide the 4 attention heads"),
        ("tp_groups", {"tp": 4}, r"parallel.tensor_parallel: 4 does not divide the 2 query groups"),
        ("pp_layers", {"pp": 5}, r"parallel.pipeline_parallel: 5 stages is more than the 4 layers"),
        ("missing", {}, r"tensor model.layers.2.mlp.up_proj.weight is missing"),
        ("extra", {}, r"unexpected tensor model.layers.0.self_attn.q_proj.bias"),
        ("shape", {}, r"tensor model.layers.1.self_attn.k_proj.weight has shape \[16, 64\], expected \[32, 64\]"),
    ],
)
def test_conversion_errors_name_the_fault(tiny_hf, tmp_path, case, kwargs, message):
    edits = {
        "not_qwen3": dict(edit_config=lambda c: c.update(model_type="llama", architectures=["LlamaForCausalLM"])),
        "missing": dict(edit_tensors=lambda t: t.pop("model.layers.2.mlp.up_proj.weight")),
        "extra": dict(edit_tensors=lambda t: t.update({"model.layers.0.self_attn.q_proj.bias": torch.zeros(64)})),
        "shape": dict(edit_tensors=lambda t: t.update({"model.layers.1.self_attn.k_proj.weight": torch.zeros(16, 64)})),
    }
    source = _variant(tiny_hf, tmp_path, **edits.get(case, {}))
    with pytest.raises(ConfigError, match=message):
        convert_hf_to_megatron(source, tmp_path / "out", **kwargs)
    assert not (tmp_path / "out").exists()


def test_cli_reports_one_line_error(tiny_hf, tmp_path):
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "stapo_megatron.cli",
            "convert",
            "hf-to-megatron",
            "--hf",
            str(tiny_hf),
            "--out",
            str(tmp_path / "o"),
            "--tp",
            "3",
        ],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "stapo: error: parallel.tensor_parallel: 3 does not divide the 4 attention heads"
    ]


def ranks_see_no_gpu(record_dir: str, convert_rank: str, *args) -> None:
    """A conversion rank (``convert_rank`` of checkpoint/convert.py) that first records what it sees:
    the GPUs its parent hid, and the CPU view."""
    import os

    from stapo_megatron.checkpoint import convert
    from stapo_megatron.runtime.distributed import accelerator_available

    seen = {"CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES"), "cuda": accelerator_available()}
    (Path(record_dir) / f"rank{os.environ['RANK']}.json").write_text(json.dumps(seen))
    getattr(convert, convert_rank)(*args)


@dataclasses.dataclass(frozen=True)
class RecordingRank:
    """A conversion rank function that spawn_ranks can send: :func:`ranks_see_no_gpu` around ``rank_fn``."""

    record_dir: str
    rank_fn: str

    def __call__(self, *args) -> None:
        ranks_see_no_gpu(self.record_dir, self.rank_fn, *args)


@pytest.mark.slow
def test_a_host_with_8_gpus_converts_at_tp8_pp2_on_the_cpu(tmp_path, monkeypatch):
    """16 ranks, 8 GPUs: each rank would take the GPU of its LOCAL_RANK ("invalid device ordinal" from
    rank 8 on); instead every rank runs on the CPU, and the round trip is exact."""
    from stapo_megatron.checkpoint import convert
    from stapo_megatron.runtime import distributed

    hf = save_tiny_qwen3(tmp_path / "hf", tie=False, seed=8, num_attention_heads=8, num_key_value_heads=8, head_dim=8)
    monkeypatch.setattr(distributed, "accelerator_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    records = tmp_path / "ranks"
    records.mkdir()
    monkeypatch.setattr(convert, "hf_to_megatron_rank", RecordingRank(str(records), "hf_to_megatron_rank"))
    convert_hf_to_megatron(hf, tmp_path / "mg", tp=8, pp=2)
    seen = [json.loads((records / f"rank{rank}.json").read_text()) for rank in range(16)]
    assert seen == [{"CUDA_VISIBLE_DEVICES": "", "cuda": False}] * 16
    monkeypatch.undo()  # back to this host as it is, for the way back at another layout
    convert_megatron_to_hf(tmp_path / "mg", tmp_path / "back", tp=2, pp=1)
    assert_bit_exact(hf, tmp_path / "back")
