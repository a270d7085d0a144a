"""What is around a checkpoint: only regular files are read (a FIFO never waited on), entries of
``checkpoints/`` not named as the trainer names them are ignored, and ``stapo convert --overwrite``
replaces only what ``stapo convert`` wrote, never anything beside it."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from stapo_megatron.checkpoint.cli import newest_intact_checkpoint
from stapo_megatron.checkpoint.convert import EXPORT_MARKER, convert_hf_to_megatron, convert_megatron_to_hf
from stapo_megatron.checkpoint.integrity import verify_checkpoint
from stapo_megatron.config import ConfigError
from tests.checkpoint.crafted import COMMON_FILE, common_state_file, drop_checksums, replace_by_fifo
from tests.helpers import save_tiny_qwen3
from tests.trainer.runs import train_command


def _convert_cli(checkpoint, out, *flags: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """``stapo convert megatron-to-hf``; a hang is a failure, and leaves no process behind."""
    from stapo_megatron.runtime.launch import kill_tree

    command = [sys.executable, "-m", "stapo_megatron.cli", "convert", "megatron-to-hf"]
    process = subprocess.Popen(
        [*command, "--ckpt", str(checkpoint), "--out", str(out), *flags],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    finally:
        kill_tree(process.pid)
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)


def _one_error_line(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("stapo: error: ")]
    assert len(errors) == 1, result.stderr
    return errors[0]


# ---- only regular files ----------------------------------------------------------------------------


def test_stapo_convert_refuses_a_fifo_listed_in_the_marker(checkpoint, tmp_path):
    """The FIFO was opened for hashing: stapo convert waited forever."""
    name = common_state_file(checkpoint)  # common.pt, or under megatron-core 0.19 a .distcp file
    replace_by_fifo(checkpoint, name)
    error = _one_error_line(_convert_cli(checkpoint, tmp_path / "hf"))
    assert f"{checkpoint}/{name}: a FIFO, where a checkpoint holds only regular files" in error
    assert not (tmp_path / "hf").exists()


@pytest.mark.timeout(60)  # the old reader waited on the FIFO for ever
@pytest.mark.parametrize("name", [COMMON_FILE, "metadata.json", ".metadata", "__0_0.distcp"])
def test_a_fifo_in_a_checkpoint_from_before_checksums_is_refused(checkpoint, tmp_path, name):
    if name == COMMON_FILE:
        name = common_state_file(checkpoint)  # under megatron-core 0.19 the common state is in a .distcp file
    drop_checksums(checkpoint)
    replace_by_fifo(checkpoint, name)
    with pytest.raises(ConfigError, match=rf"/{name}: a FIFO, where a checkpoint holds only regular files") as err:
        convert_megatron_to_hf(checkpoint, tmp_path / "hf", tp=1, pp=1)
    assert "\n" not in str(err.value)


def test_a_socket_or_a_link_listed_in_the_marker_is_refused_by_kind(checkpoint, monkeypatch):
    target = checkpoint / "hf_assets" / "tokenizer_config.json"
    target.unlink()
    server = socket.socket(socket.AF_UNIX)
    try:
        monkeypatch.chdir(target.parent)  # a socket's path is limited to 107 bytes
        server.bind(target.name)
        with pytest.raises(ConfigError, match=r"tokenizer_config\.json: a socket, where a checkpoint holds only"):
            verify_checkpoint(checkpoint)
    finally:
        server.close()
    target.unlink()
    os.symlink("/dev/zero", target)
    with pytest.raises(ConfigError, match=r"tokenizer_config\.json: a symbolic link, where a checkpoint holds only"):
        verify_checkpoint(checkpoint)


# ---- names in checkpoints/ ----------------------------------------------------------------------


def _copies_beside_the_checkpoints(run_dir) -> None:
    checkpoints = run_dir / "checkpoints"
    shutil.copytree(checkpoints / "iter_0000002", checkpoints / "iter_0000002.bak")
    shutil.copytree(checkpoints / "iter_0000002", checkpoints / "iter_0000009 copy")
    shutil.copytree(checkpoints / "iter_0000001", checkpoints / "iter_12")
    (checkpoints / "iter_0000099").write_text("a file, not a checkpoint")


def test_only_checkpoints_named_as_the_trainer_names_them_are_found(run_copy):
    """iter_12 sorted first and was returned: the next stapo train said the run was complete at
    step 12 and trained nothing; iter_0000002.bak: int('0000002.bak')."""
    _copies_beside_the_checkpoints(run_copy)
    newest, skipped = newest_intact_checkpoint(run_copy)
    assert newest == run_copy / "checkpoints" / "iter_0000002" and skipped == []


@pytest.mark.slow
def test_a_copy_beside_a_checkpoint_does_not_break_the_next_train(run_copy):
    """int('0000002.bak'): a ValueError traceback from every later stapo train."""
    checkpoints = run_copy / "checkpoints"
    shutil.copytree(checkpoints / "iter_0000002", checkpoints / "iter_0000002.bak")
    command = train_command(run_copy, "run.steps=3", "checkpoint.save_every=1", "checkpoint.keep_last=5")
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"resumed from {checkpoints / 'iter_0000002'} (step 2)" in result.stderr
    assert "run complete: step 3/3" in result.stdout + result.stderr
    verify_checkpoint(checkpoints / "iter_0000003")
    verify_checkpoint(checkpoints / "iter_0000002.bak")  # the user's copy, untouched


# ---- --overwrite replaces only what stapo convert wrote -----------------------------------------


def _tree(directory) -> dict[str, bytes]:
    return {
        str(path.relative_to(directory)): path.read_bytes() for path in sorted(directory.rglob("*")) if path.is_file()
    }


def _users_directory(path):
    (path / ".git").mkdir(parents=True)
    (path / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    (path / "notes.txt").write_text("precious")
    return path


def test_overwrite_replaces_an_export_of_its_own_and_nothing_else(checkpoint, tmp_path):
    """--overwrite deleted whatever --out held (a clone, a home directory), exit 0."""
    users = _users_directory(tmp_path / "clone")
    before = _tree(users)
    with pytest.raises(ConfigError, match=r"--out .*/clone: --overwrite replaces only what stapo convert wrote, and "):
        convert_megatron_to_hf(checkpoint, users, overwrite=True)
    assert _tree(users) == before
    # its own export: replaced (and again), the marker naming the checkpoint
    out = convert_megatron_to_hf(checkpoint, tmp_path / "hf")
    assert json.loads((out / EXPORT_MARKER).read_text())["source"] == str(checkpoint)
    convert_megatron_to_hf(checkpoint, out, overwrite=True)
    # ... but not with a file in it that an export never writes
    (out / "README.md").write_text("my notes on this model")
    with pytest.raises(ConfigError, match=r"README\.md in it is not a file an export writes") as err:
        convert_megatron_to_hf(checkpoint, out, overwrite=True)
    assert "\n" not in str(err.value)
    assert (out / "README.md").read_text() == "my notes on this model"
    # the fixed staging name of before: a directory of the user's there was removed
    theirs = _users_directory(tmp_path / ".elsewhere.partial")
    convert_megatron_to_hf(checkpoint, tmp_path / "elsewhere")
    assert _tree(theirs) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == [".elsewhere.partial", "clone", "elsewhere", "hf", "run"]


def test_overwrite_of_a_megatron_checkpoint_only_for_a_converted_one(checkpoint, tmp_path):
    hf = save_tiny_qwen3(tmp_path / "hf", tie=True)
    users = _users_directory(tmp_path / "clone")
    before = _tree(users)
    with pytest.raises(ConfigError, match=r"it holds neither stapo_export\.json \(an export\) nor stapo_complete"):
        convert_hf_to_megatron(hf, users, overwrite=True)
    assert _tree(users) == before
    # a run's training checkpoint: the run's, not stapo convert's to replace
    with pytest.raises(ConfigError, match=r"it is a training checkpoint \(step 2\), which belongs to its run"):
        convert_hf_to_megatron(hf, checkpoint, overwrite=True)
    verify_checkpoint(checkpoint)
    # a directory of the user's where the write stages its output: refused, and kept
    staging = _users_directory(tmp_path / ".mg.partial")
    with pytest.raises(ConfigError, match=r"\.mg\.partial: in the way of a checkpoint write, and holds \.git"):
        convert_hf_to_megatron(hf, tmp_path / "mg")
    assert _tree(staging) == before
    shutil.rmtree(staging)
    # a conversion of its own: replaced
    out = convert_hf_to_megatron(hf, tmp_path / "mg")
    convert_hf_to_megatron(hf, out, overwrite=True)
    verify_checkpoint(out)


def _save_into_a_foreign_staging_directory(root: str, out: str) -> None:
    """Two gloo ranks save a checkpoint whose staging name a user's directory holds: rank 0 refuses
    to remove it. Without the refusal shared, rank 1 waits for rank 0 at the next collective."""
    from stapo_megatron.checkpoint.dist import save_dist
    from stapo_megatron.config import ConfigError
    from stapo_megatron.runtime.distributed import ParallelConfig, init_distributed, shutdown_distributed

    ctx = init_distributed(ParallelConfig(data_parallel=2, timeout_minutes=1))
    try:
        try:
            save_dist({}, Path(root) / "iter_0000001", ctx)
            message = "saved"
        except ConfigError as err:
            message = str(err)
        with open(f"{out}.{ctx.rank}", "w") as f:
            f.write(message)
    finally:
        shutdown_distributed()


def test_a_refused_staging_leftover_is_refused_on_every_rank(tmp_path):
    from stapo_megatron.runtime.launch import spawn_ranks

    root = tmp_path / "checkpoints"
    staging = root / ".iter_0000001.partial"
    staging.mkdir(parents=True)
    (staging / "notes.txt").write_text("mine")
    out = tmp_path / "refusal"
    spawn_ranks(_save_into_a_foreign_staging_directory, 2, str(root), str(out))
    messages = [Path(f"{out}.{rank}").read_text() for rank in (0, 1)]
    assert messages[0] == messages[1] and "in the way of a checkpoint write" in messages[0], messages
    assert (staging / "notes.txt").read_text() == "mine"
