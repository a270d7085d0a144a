"""Uneven pipeline splits: any layer count at any PP up to it, for the model, conversion and the planner."""

from __future__ import annotations

import json

import pytest
import torch

from stapo_megatron.checkpoint.convert import convert_hf_to_megatron, convert_megatron_to_hf
from stapo_megatron.cli import main
from stapo_megatron.config import ConfigError, build
from stapo_megatron.launch import plan
from stapo_megatron.models.qwen3.config import (
    Qwen3Config,
    first_and_last_stage_layers,
    first_layer_of_stage,
    pipeline_split,
)
from stapo_megatron.models.qwen3.parallelize import check_layout
from stapo_megatron.runtime.launch import spawn_ranks
from tests.helpers import save_tiny_qwen3
from tests.models import _workers
from tests.models.test_convert import assert_bit_exact

META_PRESET = "qwen3_1.7b"  # 28 layers


def test_split_rule():
    assert pipeline_split(28, 3) == (9, 10, 9)
    assert pipeline_split(3, 2) == (2, 1)
    assert pipeline_split(36, 4) == (9, 9, 9, 9) and first_and_last_stage_layers(36, 4) == (None, None)
    assert pipeline_split(10, 4) == (2, 3, 3, 2) and first_and_last_stage_layers(10, 4) == (2, 2)
    assert pipeline_split(15, 8) == (2, 2, 2, 2, 2, 2, 2, 1) and first_and_last_stage_layers(15, 8) == (2, 1)
    for layers in range(1, 41):
        for stages in range(1, layers + 1):
            split = pipeline_split(layers, stages)
            assert len(split) == stages and sum(split) == layers and min(split) >= 1
            # Megatron's fields can express it: every middle stage holds the same count
            assert len(set(split[1:-1])) <= 1 and split[-1] <= split[0]
            assert first_layer_of_stage(layers, stages, stages - 1) == layers - split[-1]
    with pytest.raises(ConfigError, match="parallel.pipeline_parallel: 4 stages for 3 layers"):
        pipeline_split(3, 4)


def test_layout_checks_accept_uneven_splits():
    arch = Qwen3Config(
        vocab_size=1000,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
    )
    check_layout(arch, 2, 2)
    check_layout(arch, 1, 3)
    with pytest.raises(ConfigError, match="parallel.pipeline_parallel: 4 stages is more than the 3 layers"):
        check_layout(arch, 1, 4)
    assert plan.check_layout_fits_model(arch, 2, 2) is None


def check_uneven_stage(hf_dir: str, reference_file: str, out: str) -> None:
    """PP2 over 3 layers: logits equal transformers', the real stages equal the meta builder's
    stand-in stages, and (rank 0) every stage of 28 layers at PP3 on the meta device."""
    import torch.distributed as dist

    from stapo_megatron.checkpoint.export import stage_layer_offset
    from stapo_megatron.launch.meta import meta_stage
    from stapo_megatron.models.qwen3.parallelize import build_stage

    ctx = _workers.check_logits_match_hf(1, 2, [(hf_dir, reference_file)])
    arch = Qwen3Config.from_hf(hf_dir)
    stage = ctx.pp_rank
    real = build_stage(arch, ctx, perform_initialization=False)
    result = {
        "offset": stage_layer_offset(real),
        "real": [[n, p.numel()] for n, p in real.named_parameters()],
        "stand_in": [[n, p.numel()] for n, p in meta_stage(arch, 1, 2, stage, torch.float32).named_parameters()],
    }
    if dist.get_rank() == 0:
        big = build(Qwen3Config, META_PRESET)
        result["meta28"] = []
        for tp, pp in ((1, 3), (2, 3)):
            for st in range(pp):
                model = meta_stage(big, tp, pp, st)
                assert all(p.device.type == "meta" for p in model.parameters())
                result["meta28"].append(
                    {"tp": tp, "pp": pp, "stage": st, "params": [[n, p.numel()] for n, p in model.named_parameters()]}
                )
    with open(f"{out}/{dist.get_rank()}.json", "w", encoding="utf-8") as f:
        json.dump(result, f)


@pytest.fixture(scope="module")
def three_layers(tmp_path_factory):
    from transformers import Qwen3ForCausalLM

    root = tmp_path_factory.mktemp("uneven")
    hf_dir = save_tiny_qwen3(root / "hf", tie=False, seed=11, num_hidden_layers=3)
    model = Qwen3ForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    torch.manual_seed(4)
    ids = torch.randint(0, model.config.vocab_size, (2, 9))
    with torch.no_grad():
        torch.save({"input_ids": ids, "logits": model(ids).logits}, root / "reference.pt")
    out = root / "world"
    out.mkdir()
    spawn_ranks(check_uneven_stage, 2, str(hf_dir), str(root / "reference.pt"), str(out))
    return hf_dir, [json.loads((out / f"{rank}.json").read_text()) for rank in range(2)]


def test_uneven_pp2_logits_and_stages(three_layers):
    # logits were checked against transformers inside the world (max |diff| <= 1e-4)
    _, ranks = three_layers
    assert [r["offset"] for r in ranks] == [0, 2]
    layers = [{n.split(".")[2] for n, _ in r["real"] if n.startswith("decoder.layers.")} for r in ranks]
    assert layers == [{"0", "1"}, {"0"}]  # two layers on the first stage, one on the last
    for r in ranks:
        assert r["real"] == r["stand_in"]


def test_28_layers_at_pp3_build_on_meta_and_plan(three_layers, capsys):
    _, ranks = three_layers
    arch = build(Qwen3Config, META_PRESET)
    builds = ranks[0]["meta28"]
    assert len(builds) == 6
    for built in builds:
        layers = {n.split(".")[2] for n, _ in built["params"] if n.startswith("decoder.layers.")}
        assert len(layers) == (9, 10, 9)[built["stage"]]
        planned = [[p.name, p.numel] for p in plan.stage_parameters(arch, built["tp"], built["pp"], built["stage"])]
        assert planned == built["params"], (built["tp"], built["stage"])
    assert main(["plan", "--model", META_PRESET, "--gpus", "6", "--seq-len", "4096", "--tp", "2", "--pp", "3"]) == 0
    out = capsys.readouterr().out
    assert "TP=2 PP=3 DP=1, layers per stage 9/10/9" in out
    rows = [line.split() for line in out.splitlines() if line.split() and line.split()[0] in ("0", "1", "2")]
    assert [row[1] for row in rows] == ["9", "10", "9"]
    # the search lists uneven layouts too, with their split
    assert main(["plan", "--model", META_PRESET, "--gpus", "6", "--seq-len", "4096", "--all"]) == 0
    table = [line.split() for line in capsys.readouterr().out.splitlines()]
    assert ["2", "3", "1", "9/10/9"] in [row[:4] for row in table]


def test_conversion_tp2_pp2_of_3_layers_round_trips_bit_exact(three_layers, tmp_path):
    hf_dir, _ = three_layers
    convert_hf_to_megatron(hf_dir, tmp_path / "mg", tp=2, pp=2)
    assert_bit_exact(hf_dir, convert_megatron_to_hf(tmp_path / "mg", tmp_path / "tp2pp2", tp=2, pp=2))
    # the checkpoint's layers are numbered globally: loading at another split gives the same tensors
    assert_bit_exact(hf_dir, convert_megatron_to_hf(tmp_path / "mg", tmp_path / "pp3", tp=1, pp=3))
