"""stapo plan against Megatron: meta-device parameter counts, optimizer bytes, measured activation peaks."""

from __future__ import annotations

import json

import pytest

from stapo_megatron.cli import main
from stapo_megatron.config import ConfigError, build, load_config
from stapo_megatron.launch import plan
from stapo_megatron.launch.plan import Layout, Workload
from stapo_megatron.launch.plan_command import format_stages
from stapo_megatron.models.qwen3.config import Qwen3Config
from stapo_megatron.runtime.launch import spawn_ranks
from stapo_megatron.trainer.config import TrainConfig
from tests.helpers import REPO_ROOT
from tests.launch import _workers

TOLERANCE = 0.25


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    """Everything the 2-process world measures (rank 0's file, and rank 1's)."""
    out = tmp_path_factory.mktemp("plan_world")
    spawn_ranks(_workers.measure_all, 2, str(out))
    return [json.loads((out / f"{rank}.json").read_text()) for rank in range(2)]


def planned_signature(arch: Qwen3Config, tp: int, pp: int, stage: int, kernels: str = "local") -> list[list]:
    """The planner's parameters as the meta model reports them (name, numel, shared embedding, bytes)."""
    norm_bytes = 4 if kernels == "local" else 2  # the local spec's RMSNorm weights are fp32
    return [
        [p.name, p.numel, p.shared_embedding, norm_bytes if p.name.endswith("layernorm.weight") else 2]
        for p in plan.stage_parameters(arch, tp, pp, stage)
    ]


def test_parameters_per_stage_equal_the_meta_model(measured):
    meta = measured[0]["meta"]
    assert len(meta) == sum(pp for layouts in _workers.META_LAYOUTS.values() for _, pp in layouts)
    for key, signature in meta.items():
        preset, tp, pp, stage = key.split("/")
        arch = build(Qwen3Config, preset)
        assert planned_signature(arch, int(tp), int(pp), int(stage)) == signature, key


def test_optimizer_bytes_per_rank_from_the_meta_model(measured):
    """Optimizer and buffer bytes of each DP rank, from the meta model's own parameter list
    (order, dtypes, shared-embedding buckets), equal the planner's, for 14B and 32B layouts."""
    for key, signature in measured[0]["meta"].items():
        preset, tp, pp, stage = key.split("/")
        if preset not in ("qwen3_14b", "qwen3_32b"):
            continue
        arch = build(Qwen3Config, preset)
        for dp in (1, 2, 4, 8):
            groups: dict[int, list] = {}
            for name, numel, shared, nbytes in signature:
                groups.setdefault(nbytes, []).append(plan.Param(name, numel, shared))
            shards = [0] * dp
            buffer = 0
            for nbytes, params in groups.items():
                numel, group_shards = plan.buffer_layout(params, dp, True)
                buffer += numel
                for rank, n in enumerate(group_shards):
                    shards[rank] += (12 if nbytes == 2 else 8) * n
            st = plan.stage_memory(arch, Layout(int(tp), int(pp), dp), Workload(seq_len=8, kernels="local"), int(stage))
            assert st.optimizer_by_dp_rank == shards, (key, dp)
            assert st.grads == 4 * buffer and st.params == sum(row[1] for row in signature)


def test_stand_in_groups_build_what_real_groups_build(measured):
    cases = [case for rank in measured for case in rank["real_meta"]]
    assert {(c["preset"], c["stage"]) for c in cases} >= {("qwen3_14b", 0), ("qwen3_32b", 0), ("qwen3_32b", 1)}
    for case in cases:
        assert case["real"] == case["stand_in"], (case["preset"], case["stage"])


def test_optimizer_bytes_equal_megatrons_distributed_optimizer(measured):
    for rank in measured:
        for found in rank["optimizer"]:
            layout = Layout(found["tp"], found["pp"], found["dp"])
            work = Workload(seq_len=8, kernels="local", params_dtype=found["dtype"])
            st = plan.stage_memory(_workers.OPT_ARCH, layout, work, found["stage"])
            assert st.params == found["params"], found
            assert st.grads == 4 * found["buffer_numel"], found
            assert st.optimizer_by_dp_rank[found["dp_rank"]] == found["optimizer_bytes"], found
            # the alternation model: with offload the rollout phase keeps nothing of the trainer but
            # its weights while syncing; the trainer's offload moves exactly the planned bytes
            offloaded = found["offloaded_bytes"]
            assert offloaded["params"] == st.weights, found
            assert (
                offloaded["optimizer"]
                == st.grads + st.optimizer_by_dp_rank[found["dp_rank"]] + found["adam_step_bytes"]
            ), found


def test_activation_estimate_within_25_percent_of_the_measured_peak(measured):
    rows = []
    for case in measured[0]["activations"]:
        work = Workload(
            seq_len=_workers.ACT_SEQ,
            micro_batch=_workers.ACT_BATCH,
            recompute=case["recompute"],
            sequence_parallel=case["sequence_parallel"],
            kernels="local",
            params_dtype="float32",
            logits_chunk=_workers.ACT_CHUNK,
        )
        st = plan.stage_memory(_workers.ACT_ARCH, Layout(case["tp"], 1, 1), work, 0)
        error = (st.peak_activations - case["peak"]) / case["peak"]
        rows.append(
            f"TP{case['tp']}{' SP' if case['sequence_parallel'] else ''} {case['recompute']}: measured "
            f"{case['peak'] / 2**20:.1f} MiB, "
            f"estimated {st.peak_activations / 2**20:.1f} MiB ({100 * error:+.1f}%)"
        )
        assert abs(error) < TOLERANCE, rows[-1]
    print("\n".join(rows))
    # the cases differ enough to test the terms: recompute and TP must move the peak
    peaks = {(c["tp"], c["recompute"], c["sequence_parallel"]): c["peak"] for c in measured[0]["activations"]}
    assert peaks[(1, "full", False)] < peaks[(1, "selective", False)] < peaks[(1, "none", False)]
    assert peaks[(2, "none", False)] < 0.7 * peaks[(1, "none", False)]
    # sequence parallelism splits the norm/residual activations over TP
    assert peaks[(2, "none", True)] < 0.95 * peaks[(2, "none", False)]


def test_buffer_layout_pads_like_megatron():
    # params start at multiples of 64, the bucket ends at a multiple of lcm(dp, 128)
    params = [plan.Param("a", 10), plan.Param("b", 100)]
    numel, shards = plan.buffer_layout(params, 2, True)
    assert numel == 256 and sum(shards) == 110
    assert plan.buffer_layout(params, 3, False) == (110, [110, 110, 110])


def test_layouts_smallest_first_and_only_buildable():
    arch = build(Qwen3Config, "qwen3_14b")
    layouts = plan.candidate_layouts(arch, 32)
    sizes = [(lay.tp * lay.pp, lay.pp, lay.tp) for lay in layouts]
    assert sizes == sorted(sizes) and layouts[0] == Layout(1, 1, 32)
    assert all(40 % lay.tp == 0 and 8 % lay.tp == 0 and lay.pp <= 40 and lay.tp <= 8 for lay in layouts)
    assert Layout(4, 2, 4) in layouts and all(lay.gpus == 32 for lay in layouts)
    assert Layout(1, 16, 2) in layouts  # 40 layers over 16 stages: an uneven split


def test_plan_command_lists_fitting_layouts(capsys):
    assert (
        main(
            [
                "plan",
                "--model",
                "qwen3_32b",
                "--gpus",
                "64",
                "--seq-len",
                "17408",
                "--micro-batch",
                "1",
                "--recompute",
                "full",
                "--gpu-memory-gb",
                "80",
                "--colocate-fraction",
                "0.35",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line.strip() and line.split()[0].isdigit()]
    assert rows and all(row[-1] == "yes" for row in rows)
    assert ["8", "2", "4"] == rows[[r[:3] for r in rows].index(["8", "2", "4"])][:3]
    mp = [int(r[0]) * int(r[1]) for r in rows]
    assert mp == sorted(mp)
    assert all(float(r[-2]) <= 80 for r in rows)


def test_plan_command_details_one_layout(capsys):
    assert (
        main(
            [
                "plan",
                "--model",
                "qwen3_14b",
                "--gpus",
                "32",
                "--seq-len",
                "17408",
                "--tp",
                "4",
                "--pp",
                "2",
                "--recompute",
                "full",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "TP=4 PP=2 DP=4" in out and "1,846,359,040" in out and "fits" in out


def test_plan_command_errors_are_one_line(capsys):
    for argv, message in (
        (["plan", "--model", "qwen3_99b", "--gpus", "8", "--seq-len", "4096"], "unknown model preset 'qwen3_99b'"),
        (["plan", "--model", "qwen3_8b", "--gpus", "0", "--seq-len", "4096"], "--gpus: must be >= 1"),
        (["plan", "--gpus", "8"], "--model: give a model preset (e.g. qwen3_32b), or a training config (--config)"),
        (["plan", "--model", "qwen3_8b"], "--gpus: required without a training config (--config)"),
        (
            ["plan", "--model", "qwen3_8b", "--gpus", "8", "--seq-len", "4096", "--tp", "3"],
            "--gpus: 8 is not a multiple of TP x PP = 3",
        ),
        (
            ["plan", "--model", "qwen3_8b", "--gpus", "12", "--seq-len", "4096", "--tp", "3"],
            "TP 3 does not divide the 32 attention heads",
        ),
        (
            ["plan", "--model", "qwen3_8b", "--gpus", "8", "--seq-len", "4096", "--colocate-fraction", "1.5"],
            "--colocate-fraction: must be in [0, 1)",
        ),
    ):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and message in err, err


@pytest.mark.parametrize("size", ["1.7b", "8b", "14b", "32b"])
def test_example_configs_fit_80_gb(size):
    cfg = load_config(TrainConfig, REPO_ROOT / "configs" / f"qwen3_{size}_stapo.yaml")
    p = cfg.parallel
    work = Workload(
        seq_len=cfg.batch.max_tokens_per_microbatch,
        micro_batch=1,
        sequences_per_minibatch=cfg.batch.prompts_per_minibatch * cfg.batch.group_size,
        recompute=cfg.compute.recompute,
        sequence_parallel=p.sequence_parallel,
        logits_chunk=cfg.compute.logits_chunk_size,
    )
    offload = cfg.compute.offload_while_generating
    est = plan.estimate(
        cfg.model,
        Layout(p.tensor_parallel, p.pipeline_parallel, p.data_parallel),
        work,
        gpu_memory_gb=80,
        colocate_fraction=cfg.rollout.sglang.mem_fraction_static,
        sglang_released=offload or cfg.rollout.release_memory_between_steps,
        offload=offload,
    )
    assert est.fits, format_stages(est)


def test_estimate_rejects_unbuildable_layouts():
    with pytest.raises(ConfigError, match="PP 41 is more than the 40 layers"):
        plan.estimate(build(Qwen3Config, "qwen3_14b"), Layout(1, 41, 1), Workload(seq_len=16))


def test_released_sglang_share_takes_turns_with_activations():
    arch = build(Qwen3Config, "qwen3_32b")
    work = Workload(seq_len=17408, recompute="full")
    held = plan.estimate(arch, Layout(8, 2, 4), work, colocate_fraction=0.6)
    released = plan.estimate(arch, Layout(8, 2, 4), work, colocate_fraction=0.6, sglang_released=True)
    worst = held.worst
    static = worst.weights + worst.grads + worst.optimizer
    share, reserve = 0.6 * plan.USABLE_GPU_MEMORY_GB * plan.GIB, held.reserve
    assert held.total == static + worst.peak_activations + share + reserve
    # the two phases' worst stages may differ: the rollout phase counts the largest static state
    largest_static = max(st.weights + st.grads + st.optimizer for st in released.stages)
    assert released.total == max(static + worst.peak_activations, largest_static + share) + reserve
    assert not held.fits and released.fits


def test_the_reserve_counts_contexts_communicators_and_nvls():
    """R of a GPU of the 32B paper layout (TP8 PP2 DP4, untied): the trainer rank's communicators
    (world 64, TP 8, DP 4, model parallel 16, one pipeline neighbour) and a colocated TP8 server's,
    two CUDA contexts and the fragmentation; NVLS adds to every communicator of 4+ ranks."""
    arch = build(Qwen3Config, "qwen3_32b")
    layout, work = Layout(8, 2, 4), Workload(seq_len=17408, recompute="full")
    assert plan.trainer_communicators(layout, tied_embeddings=False) == [64, 8, 4, 16, 2]
    assert plan.trainer_communicators(Layout(2, 3, 1), tied_embeddings=True) == [6, 2, 6, 2, 2, 2]
    colocated = plan.estimate(arch, layout, work, colocate_fraction=0.75, server_tp=8)
    alone = plan.estimate(arch, layout, work)
    assert colocated.reserve == pytest.approx((2 * 0.6 + 6 * 0.4 + 2.0) * plan.GIB)
    assert alone.reserve == pytest.approx((0.6 + 5 * 0.4 + 2.0) * plan.GIB)
    nvls = plan.estimate(arch, layout, work, colocate_fraction=0.75, server_tp=8, costs=plan.DeviceCosts(nvls=True))
    assert nvls.reserve == pytest.approx(colocated.reserve + 5 * 1.6 * plan.GIB)  # all but the 2-rank one


def test_offload_alternation_per_gpu_phases():
    """Train phase: the trainer alone (servers released); rollout phase: the servers' share plus what
    the trainer keeps, its weights (for the sync) with offload, its whole static state without."""
    arch = build(Qwen3Config, "qwen3_32b")
    work = Workload(seq_len=17408, recompute="full")
    layout = Layout(8, 2, 4)
    released = plan.estimate(arch, layout, work, colocate_fraction=0.8, sglang_released=True)
    offloaded = plan.estimate(arch, layout, work, colocate_fraction=0.8, sglang_released=True, offload=True)
    share, reserve = 0.8 * plan.USABLE_GPU_MEMORY_GB * plan.GIB, offloaded.reserve
    worst = offloaded.worst
    assert offloaded.train_phase == released.train_phase == worst.trainer + reserve
    assert offloaded.rollout_phase == max(st.weights for st in offloaded.stages) + share + reserve
    assert (
        released.rollout_phase == max(st.weights + st.grads + st.optimizer for st in released.stages) + share + reserve
    )
    assert offloaded.total == max(offloaded.train_phase, offloaded.rollout_phase) == offloaded.rollout_phase
    # at mem_fraction_static 0.8 on 80 GiB only the offloaded trainer leaves the servers room
    assert offloaded.fits and not released.fits
    # the servers held through training (no release): the old sum, unchanged
    held = plan.estimate(arch, layout, work, colocate_fraction=0.35)
    assert held.total == held.train_phase == worst.trainer + 0.35 * plan.USABLE_GPU_MEMORY_GB * plan.GIB + reserve


def test_kv_cache_bytes_per_token_split_over_server_tp():
    arch = build(Qwen3Config, "qwen3_32b")  # 64 layers, 8 key/value heads of 128
    assert plan.kv_bytes_per_token(arch, 1) == 2 * 64 * 8 * 128 * 2 == 262_144
    assert plan.kv_bytes_per_token(arch, 8) == 2 * 64 * 1 * 128 * 2 == 32_768
    # past the head count SGLang replicates the heads: no further saving
    assert plan.kv_bytes_per_token(arch, 16) == plan.kv_bytes_per_token(arch, 8)


def test_rollout_capacity_of_each_placement():
    arch = build(Qwen3Config, "qwen3_32b")
    assert arch.num_parameters() == 32_762_123_264
    colocated = plan.rollout_capacity(
        arch, placement="colocated", servers=8, server_tp=8, mem_fraction=0.8, gpu_memory_gb=80, max_seq_len=17408
    )
    weights_per_gpu = 32_762_123_264 * 2 // 8  # 8,190,530,816 bytes
    assert colocated.kv_cache_per_gpu == 0.8 * 80 * 2**30 - weights_per_gpu == 60_528_945_920
    assert colocated.tokens_per_server == 60_528_945_920 // 32_768 == 1_847_196
    assert colocated.sequences_per_server == 1_847_196 // 17_408 == 106
    assert colocated.sequences == 848
    # the old layout: one server on the first node at 0.35
    dedicated = plan.rollout_capacity(
        arch, placement="disaggregated", servers=1, server_tp=8, mem_fraction=0.35, gpu_memory_gb=80, max_seq_len=17408
    )
    assert dedicated.tokens_per_server == int((0.35 * 80 * 2**30 - weights_per_gpu) // 32_768) == 667_548
    assert dedicated.sequences == 667_548 // 17_408 == 38
    # a share smaller than the weights leaves no KV cache, not a negative one
    assert (
        plan.rollout_capacity(
            arch, placement="colocated", servers=1, server_tp=1, mem_fraction=0.5, gpu_memory_gb=80, max_seq_len=17408
        ).tokens_per_server
        == 0
    )


def test_plan_command_reports_phases_and_rollout_capacity(capsys):
    argv = [
        "plan",
        "--model",
        "qwen3_32b",
        "--gpus",
        "64",
        "--gpu-memory-gb",
        "80",
        "--seq-len",
        "17408",
        "--recompute",
        "full",
        "--colocate-fraction",
        "0.8",
        "--server-tp",
        "8",
        "--tp",
        "8",
        "--pp",
        "2",
    ]
    assert main([*argv, "--offload"]) == 0
    out = capsys.readouterr().out
    assert "trainer offloaded while generating" in out
    assert (
        "rollout colocated: 8 server(s) x TP 8 at mem_fraction_static 0.8: KV cache 56.4 GiB per GPU "
        "(32,768 bytes per token) = 1,847,196 tokens per server = 106 sequences of 17,408 tokens per server, "
        "848 at once"
    ) in out
    assert "rollout disaggregated: 1 server(s) x TP 8" in out and "106 at once" in out
    assert "rollout phase: sglang 64.0 + trainer weights (the rest offloaded)" in out and ": fits" in out
    assert main([*argv, "--sglang-released"]) == 0
    assert "does not fit" in capsys.readouterr().out
    assert main([*argv[:-4], "--server-tp", "3"]) == 2
    assert "--server-tp: must be >= 1 and divide the 64 GPUs, got 3" in capsys.readouterr().err
