"""Checkpoint integrity: every file's size and sha256 in the completion marker, verified before
use; resume skips a damaged checkpoint for the newest intact one, and ``stapo convert`` refuses
a damaged one. Each difference is one line naming the file."""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest

from stapo_megatron.checkpoint.convert import convert_hf_to_megatron, convert_megatron_to_hf
from stapo_megatron.checkpoint.integrity import HASH, assign_shares, file_digest, list_files, verify_checkpoint
from stapo_megatron.checkpoint.marker import COMPLETE_MARKER
from stapo_megatron.config import ConfigError
from tests.checkpoint.crafted import common_state_file, flip_byte
from tests.helpers import save_tiny_qwen3
from tests.trainer.runs import train_command


def _marker(directory):
    return json.loads((directory / COMPLETE_MARKER).read_text())


def test_marker_records_every_file_with_its_hash(trained_run):
    directory = trained_run / "checkpoints" / "iter_0000002"
    marker = _marker(directory)
    assert marker["step"] == 2 and marker["hash"] == HASH
    files = marker["files"]
    assert set(files) == set(list_files(directory))
    assert {".metadata", common_state_file(directory), "metadata.json"} <= set(files)
    assert sum(name.endswith(".distcp") for name in files) >= 2  # both ranks' data
    for name, entry in files.items():
        assert file_digest(directory / name) == (entry["size"], entry[HASH]), name
    assert verify_checkpoint(directory) == marker


def _data_file(directory):
    return sorted(directory.glob("__*.distcp"))[-1]


def _truncate(path):
    path.write_bytes(path.read_bytes()[:-100])


DAMAGE = {
    "flipped-data": (
        lambda d: flip_byte(_data_file(d)),
        r"/__1_\d\.distcp: contents differ from the sha256 recorded in stapo_complete\.json",
    ),
    # common.pt, or under megatron-core 0.19 the data file holding the common state
    "flipped-common": (
        lambda d: flip_byte(d / common_state_file(d)),
        r"/(common\.pt|__0_\d\.distcp): contents differ",
    ),
    "flipped-index": (lambda d: flip_byte(d / ".metadata", 200), r"/\.metadata: contents differ"),
    "truncated": (
        lambda d: _truncate(_data_file(d)),
        r"/__1_\d\.distcp: \d+ bytes, but the checkpoint recorded \d+ \(truncated or replaced\)",
    ),
    "missing": (
        lambda d: (d / ".metadata").unlink(),
        r"/\.metadata: missing \(listed in the checkpoint's stapo_complete\.json\)",
    ),
    "extra": (lambda d: (d / "__7_0.distcp").write_bytes(b"x"), r"/__7_0\.distcp: not part of the checkpoint"),
    "marker-not-json": (
        lambda d: (d / COMPLETE_MARKER).write_text('{"files": '),
        r"stapo_complete\.json: damaged completion marker",
    ),
    "marker-bad-list": (
        lambda d: (d / COMPLETE_MARKER).write_text(json.dumps({"files": {"../x": {"size": 1, HASH: "0" * 64}}})),
        r"stapo_complete\.json: malformed file list",
    ),
}


@pytest.mark.parametrize("kind", list(DAMAGE))
def test_damage_is_one_line_naming_the_file(checkpoint, kind):
    damage, message = DAMAGE[kind]
    damage(checkpoint)
    with pytest.raises(ConfigError, match=message) as err:
        verify_checkpoint(checkpoint)
    assert "\n" not in str(err.value)


def test_cheap_check_skips_only_the_contents_of_data_files(checkpoint):
    flip_byte(_data_file(checkpoint))
    verify_checkpoint(checkpoint, full=False)  # sizes match; contents are the ranks' job
    _truncate(_data_file(checkpoint))
    with pytest.raises(ConfigError, match="truncated or replaced"):
        verify_checkpoint(checkpoint, full=False)


def test_checkpoint_from_before_checksums_loads_with_a_warning(checkpoint, caplog):
    marker = _marker(checkpoint)
    del marker["files"], marker["hash"]
    (checkpoint / COMPLETE_MARKER).write_text(json.dumps(marker))
    assert verify_checkpoint(checkpoint)["step"] == 2
    assert "integrity cannot be verified" in caplog.text  # a warning of the stapo logger


def test_shares_cover_every_file_once_and_keep_writers_files():
    files = {
        "__0_0.distcp": 100,
        "__0_1.distcp": 90,
        "__1_0.distcp": 100,
        "__1_1.distcp": 80,
        "common.pt": 5,
        ".metadata": 50,
        "metadata.json": 1,
        "hf_assets/tokenizer.json": 30,
    }
    for world in (1, 2, 3, 8):
        for by_writer in (False, True):
            shares = assign_shares(files, world, by_writer)
            assert len(shares) == world
            assert sorted(n for share in shares for n in share) == sorted(files)
            assert shares == assign_shares(dict(reversed(list(files.items()))), world, by_writer)
    shares = assign_shares(files, 2, by_writer=True)
    assert {"__0_0.distcp", "__0_1.distcp"} <= set(shares[0]) and {"__1_0.distcp", "__1_1.distcp"} <= set(shares[1])
    loads = [sum(files[n] for n in share) for share in assign_shares(files, 3)]
    assert max(loads) - min(loads) <= 100


def test_convert_records_assets_and_refuses_a_damaged_checkpoint(tmp_path):
    hf = save_tiny_qwen3(tmp_path / "hf", tie=True, seed=3)
    (hf / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 256}))
    megatron = convert_hf_to_megatron(hf, tmp_path / "mg", tp=2, pp=1)
    assert "hf_assets/tokenizer_config.json" in _marker(megatron)["files"]
    convert_megatron_to_hf(megatron, tmp_path / "back", tp=2, pp=1)  # intact: fine
    # A flipped byte in a data file: the ranks' shared hashing finds it.
    damaged = tmp_path / "damaged"
    shutil.copytree(megatron, damaged)
    flip_byte(_data_file(damaged))
    with pytest.raises(ConfigError, match=r"damaged/__\d_\d\.distcp: contents differ") as err:
        convert_megatron_to_hf(damaged, tmp_path / "out", tp=2, pp=1)
    assert "\n" not in str(err.value)
    assert not (tmp_path / "out").exists()
    # The small files are checked before any rank starts.
    flip_byte(damaged / "hf_assets" / "tokenizer_config.json")
    with pytest.raises(ConfigError, match=r"damaged/hf_assets/tokenizer_config\.json: contents differ"):
        convert_megatron_to_hf(damaged, tmp_path / "out", tp=1, pp=1)


def _resume(run_dir, steps: int) -> subprocess.CompletedProcess:
    command = train_command(run_dir, f"run.steps={steps}", "checkpoint.save_every=1", "checkpoint.keep_last=5")
    return subprocess.run(command, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_resume_skips_a_damaged_latest_checkpoint(run_copy):
    checkpoints = run_copy / "checkpoints"
    flip_byte(_data_file(checkpoints / "iter_0000002"))
    result = _resume(run_copy, 3)
    assert result.returncode == 0, result.stderr[-3000:]
    # Messages go to the console's channel, stderr.
    assert "warning: skipping damaged checkpoint iter_0000002:" in result.stderr and "contents differ" in result.stderr
    assert f"[stapo] resumed from {checkpoints / 'iter_0000001'} (step 1)" in result.stderr
    # The run went on from step 1 and rewrote steps 2 and 3, intact.
    verify_checkpoint(checkpoints / "iter_0000002")
    verify_checkpoint(checkpoints / "iter_0000003")


@pytest.mark.slow
def test_resume_with_only_damaged_checkpoints_is_refused(run_copy):
    checkpoints = run_copy / "checkpoints"
    flip_byte(_data_file(checkpoints / "iter_0000002"))
    _truncate(_data_file(checkpoints / "iter_0000001"))
    result = _resume(run_copy, 3)
    assert result.returncode != 0
    assert "no intact checkpoint to resume from (2 damaged; newest iter_0000002:" in result.stderr, result.stderr[
        -3000:
    ]


def _rank_zero_checks_alone(run_dir: str, out: str) -> None:
    """Two gloo ranks; only rank 0 looks for the newest intact checkpoint, as the end-of-run summary
    of a rank started by torchrun or SLURM does. A collective check there waits for a rank that never
    comes (the bug the SLURM tests found)."""
    import datetime

    import torch.distributed as dist

    from stapo_megatron.checkpoint.cli import newest_intact_checkpoint

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    try:
        if dist.get_rank() == 0:
            newest, skipped = newest_intact_checkpoint(run_dir)
            with open(out, "w") as f:
                json.dump({"newest": str(newest), "skipped": skipped}, f)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_one_rank_finds_the_newest_intact_checkpoint_without_the_others(run_copy, tmp_path):
    from stapo_megatron.runtime.launch import spawn_ranks

    flip_byte(run_copy / "checkpoints" / "iter_0000002" / ".metadata")
    out = tmp_path / "newest.json"
    spawn_ranks(_rank_zero_checks_alone, 2, str(run_copy), str(out))
    found = json.loads(out.read_text())
    assert found["newest"] == str(run_copy / "checkpoints" / "iter_0000001")
    assert len(found["skipped"]) == 1 and "iter_0000002" in found["skipped"][0]
