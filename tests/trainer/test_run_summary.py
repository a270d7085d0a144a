"""What a run says when it ends or is run again, and where ``stapo convert`` sends a run directory,
on crafted run directories (checkpoints with real checksums, a metrics file), in one process."""

from __future__ import annotations

import json

import pytest

from stapo_megatron.checkpoint.cli import newest_intact_checkpoint
from stapo_megatron.checkpoint.integrity import HASH, record_files
from stapo_megatron.checkpoint.marker import COMPLETE_MARKER
from stapo_megatron.cli import main
from stapo_megatron.runtime import console
from stapo_megatron.trainer.launcher import _already_complete, load_train_config, run_summary
from stapo_megatron.trainer.run_directory import mark_run_directory


def _checkpoint(run_dir, step: int, damaged: bool = False):
    directory = run_dir / "checkpoints" / f"iter_{step:07d}"
    directory.mkdir(parents=True)
    (directory / "common.pt").write_bytes(b"c" * 100)
    (directory / "__0_0.distcp").write_bytes(b"d" * 1000)
    (directory / COMPLETE_MARKER).write_text(json.dumps({"hash": HASH, "files": record_files(directory)}))
    if damaged:
        (directory / "__0_0.distcp").write_bytes(b"d" * 999)
    return directory


def _run(tmp_path, steps: int = 5):
    cfg = load_train_config(None, [f"run.output_dir={tmp_path / 'run'}", f"run.steps={steps}"])
    rows = [
        {"step": s, "reward/accuracy": s / 10, "policy/entropy": 2.0 - s / 10, "s2t/masked_fraction": 0.01}
        for s in range(1, steps + 1)
    ]
    cfg.run.directory.mkdir(parents=True)
    mark_run_directory(cfg.run.directory)
    (cfg.run.directory / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    (cfg.run.directory / "spurious").mkdir()
    (cfg.run.directory / "spurious" / "step_0000005.jsonl").write_text("")
    return cfg


def test_the_newest_intact_checkpoint_passes_over_damaged_ones(tmp_path):
    run_dir = tmp_path / "run"
    assert newest_intact_checkpoint(run_dir) == (None, [])
    older = _checkpoint(run_dir, 3)
    _checkpoint(run_dir, 5, damaged=True)
    (run_dir / "checkpoints" / "iter_0000007").mkdir()  # a write that never completed
    newest, skipped = newest_intact_checkpoint(run_dir)
    assert newest == older
    assert skipped[0] == f"{run_dir}/checkpoints/iter_0000007: not a complete stapo checkpoint (no {COMPLETE_MARKER})"
    assert skipped[1] == (
        f"{run_dir}/checkpoints/iter_0000005/__0_0.distcp: 999 bytes, "
        "but the checkpoint recorded 1000 (truncated or replaced)"
    )


def test_convert_given_a_run_directory_names_its_newest_intact_checkpoint(tmp_path, capsys):
    run_dir = tmp_path / "run"
    _checkpoint(run_dir, 3)
    _checkpoint(run_dir, 5, damaged=True)
    for given in (run_dir, run_dir / "checkpoints"):
        assert main(["convert", "megatron-to-hf", "--ckpt", str(given), "--out", str(tmp_path / "hf")]) == 2
        assert capsys.readouterr().err == (
            f"stapo: error: --ckpt: {given} is a run directory, not a checkpoint; its checkpoints are "
            f"{run_dir}/checkpoints/iter_*: the newest intact one is {run_dir}/checkpoints/iter_0000003 "
            f"(pass --ckpt {run_dir}/checkpoints/iter_0000003)\n"
        )
    assert not (tmp_path / "hf").exists()
    broken = tmp_path / "broken"
    _checkpoint(broken, 2, damaged=True)
    assert main(["convert", "megatron-to-hf", "--ckpt", str(broken), "--out", str(tmp_path / "hf")]) == 2
    assert capsys.readouterr().err.endswith(
        f"its checkpoints are {broken}/checkpoints/iter_*, and none is intact "
        f"(newest: {broken}/checkpoints/iter_0000002/__0_0.distcp: 999 bytes, "
        "but the checkpoint recorded 1000 (truncated or replaced))\n"
    )


def test_the_summary_of_a_finished_run(tmp_path):
    cfg = _run(tmp_path)
    run_dir = cfg.run.directory
    _checkpoint(run_dir, 5)
    assert run_summary(cfg).splitlines() == [
        f"[stapo] run complete: step 5/5 in {run_dir}",
        "  last 5 steps: accuracy 0.3, entropy 1.7, masked fraction 0.01",
        f"  checkpoint  {run_dir}/checkpoints/iter_0000005",
        f"  metrics     {run_dir}/metrics.jsonl",
        f"  plots       {run_dir}/curves.png (drawn by stapo plot)",
        f"  spurious    {run_dir}/spurious/ (1 dumps; logging.inspect_every sets how often)",
        "next:",
        f"  stapo plot {run_dir}",
        f"  stapo inspect {run_dir}",
        f"  stapo convert megatron-to-hf --ckpt {run_dir}/checkpoints/iter_0000005 --out {run_dir}/hf",
    ]


def test_a_stopped_run_says_how_far_it_got(tmp_path):
    cfg = _run(tmp_path, steps=8)
    _checkpoint(cfg.run.directory, 5)
    _checkpoint(cfg.run.directory, 8, damaged=True)  # resume would fall back to step 5 too
    assert run_summary(cfg).splitlines()[0] == (
        f"[stapo] run stopped at step 5/8 in {cfg.run.directory}; the same `stapo train` resumes it"
    )
    assert not _already_complete(cfg)


def test_a_complete_run_is_not_trained_again(tmp_path, capsys):
    cfg = _run(tmp_path)
    _checkpoint(cfg.run.directory, 5)
    console.configure(rank=0)  # as `stapo` does
    assert _already_complete(cfg)
    captured = capsys.readouterr()
    # The message on the console's stderr, the summary (the command's product) alone on stdout.
    assert f"[stapo] {cfg.run.directory}: already complete (step 5/5), nothing to train" in captured.err
    assert captured.out == run_summary(cfg) + "\n"
    # starting afresh is another matter: --overwrite (resume never) is not stopped here
    fresh = load_train_config(None, [f"run.output_dir={cfg.run.directory}", "run.steps=5", "checkpoint.resume=never"])
    assert not _already_complete(fresh)
    # nor is a run asked to go further
    assert not _already_complete(load_train_config(None, [f"run.output_dir={cfg.run.directory}", "run.steps=6"]))


@pytest.mark.parametrize("command", [["train"], ["train", "--resume"]])
def test_stapo_train_on_a_complete_run_starts_nothing(tmp_path, capsys, command):
    cfg = _run(tmp_path)
    _checkpoint(cfg.run.directory, 5)
    assert main([*command, f"run.output_dir={cfg.run.directory}", "run.steps=5"]) == 0
    captured = capsys.readouterr()
    assert "already complete (step 5/5)" in captured.err and captured.out == run_summary(cfg) + "\n"
    assert not (cfg.run.directory / "config.yaml").exists()  # nothing was started, nothing rewritten
