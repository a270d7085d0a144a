"""Loading a checkpoint never runs what it holds: crafted pickles in ``.metadata``, the common
state (``common.pt``, or 0.19's object in the data files) and a stored sharded object are refused
with one line naming the file, on every load path (``stapo convert``, resume, the in-process
readers), also when the payload would hand back a valid object afterwards and the checksums were
recomputed to match. And the safe loader loads what the installed megatron-core's own load does."""

from __future__ import annotations

import io
import json
import pickle
import re
import subprocess
import sys

import pytest
import torch

from stapo_megatron.checkpoint import dcp_index, index_unpickler, safe_load
from stapo_megatron.checkpoint.convert import convert_megatron_to_hf, read_meta
from stapo_megatron.checkpoint.dist import load_common
from stapo_megatron.config import ConfigError
from stapo_megatron.runtime.launch import spawn_ranks
from tests.checkpoint import _safe_load_workers
from tests.checkpoint.crafted import (
    Stealth,
    Touch,
    common_source_pattern,
    read_common,
    read_metadata,
    rehash,
    replace_object,
    write_common,
)
from tests.trainer.runs import train_command


def _one_line(err) -> str:
    message = str(err.value if hasattr(err, "value") else err)
    assert "\n" not in message.strip(), message
    return message


# ---- the readers themselves (one process, no ranks) -------------------------------------------


def test_the_safe_load_matches_the_installed_releases_own_load(trained_run, tmp_path):
    # safe_load.load is dist_checkpointing.load's steps with the safe readers (per release where
    # they differ): on a real checkpoint, at its layout (TP=2), the installed release's own load
    # must give the same tensors, sharded objects and common state.
    directory = trained_run / "checkpoints" / "iter_0000002"
    spawn_ranks(_safe_load_workers.compare_with_megatron_load, 2, str(directory), str(tmp_path))
    for rank in (0, 1):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert result["only_ours"] == result["only_theirs"] == result["differing"] == [], result
        assert result["tensors"] >= 10  # the model's 10 parameters (and the tensors of the common state)
        # the common state's entries and the RNG states' stored object came through as well
        assert any(key.startswith("stapo/") for key in result["others"]), result["others"]
        assert any(key.startswith("rng_state/") for key in result["others"]), result["others"]


def test_the_real_index_loads_with_only_the_admitted_classes(trained_run):
    directory = trained_run / "checkpoints" / "iter_0000002"
    seen = set()

    class Recording(pickle.Unpickler):
        def find_class(self, module, name):
            seen.add((module, name))
            return super().find_class(module, name)

    with open(directory / ".metadata", "rb") as f:
        Recording(f).load()
    dtypes = {(m, n) for m, n in seen if m == "torch" and isinstance(getattr(torch, n), torch.dtype)}
    assert seen - dtypes <= index_unpickler.METADATA_GLOBALS
    metadata = dcp_index.read_dcp_metadata(directory / ".metadata")
    assert metadata.state_dict_metadata.keys() == read_metadata(directory).state_dict_metadata.keys()


@pytest.mark.parametrize("stealth", [False, True], ids=["payload", "stealth"])
def test_crafted_index_is_refused_in_process(checkpoint, tmp_path, stealth):
    flag = tmp_path / "pwned"
    payload = Stealth(read_metadata(checkpoint), flag) if stealth else Touch(flag)
    (checkpoint / ".metadata").write_bytes(pickle.dumps(payload))
    with pytest.raises(
        ConfigError, match=r"\.metadata: refused to load: it refers to (posix\.system|operator\.itemgetter)"
    ) as err:
        dcp_index.read_dcp_metadata(checkpoint / ".metadata")
    _one_line(err)
    assert not flag.exists()


@pytest.mark.parametrize("stealth", [False, True], ids=["payload", "stealth"])
def test_crafted_common_state_is_refused(checkpoint, tmp_path, stealth):
    flag = tmp_path / "pwned"
    common = read_common(checkpoint)
    write_common(checkpoint, Stealth(common, flag) if stealth else Touch(flag))
    rehash(checkpoint)
    source = common_source_pattern(checkpoint)
    with pytest.raises(ConfigError, match=source + r": refused to load: .*(posix\.system|operator\.itemgetter)") as err:
        load_common(checkpoint)
    _one_line(err)
    with pytest.raises(ConfigError, match=source + r": refused to load"):
        read_meta(checkpoint)  # the path of `stapo eval`, `stapo convert` and the config checks
    assert not flag.exists()


def test_crafted_stored_object_is_refused(tmp_path):
    flag = tmp_path / "pwned"
    buffer = io.BytesIO()
    torch.save([Stealth({"python": (3, (1,), None)}, flag)], buffer)
    buffer.seek(0)
    with pytest.raises(
        ConfigError, match=r"^x/__0_0\.distcp \(object rng_state\): refused to load: .*operator\.itemgetter"
    ):
        safe_load.load_stored_object(buffer, "x/__0_0.distcp (object rng_state)")
    assert not flag.exists()


def test_foreign_metadata_json_is_refused(checkpoint):
    (checkpoint / "metadata.json").write_text('{"sharded_backend": "zarr", "common_backend": "torch"}')
    with pytest.raises(ConfigError, match=r"metadata\.json: not a torch_dist checkpoint"):
        load_common(checkpoint)


def test_index_pointing_outside_the_checkpoint_is_refused(checkpoint):
    metadata = read_metadata(checkpoint)
    info = next(iter(metadata.storage_data.values()))
    info.relative_path = "../../../etc/passwd"
    (checkpoint / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(
        ConfigError, match=r"\.metadata: not a valid checkpoint index: .* outside the checkpoint directory"
    ):
        dcp_index.read_dcp_metadata(checkpoint / ".metadata")


def test_garbage_index_is_one_line(checkpoint):
    (checkpoint / ".metadata").write_bytes(b"\x80\x04garbage")
    with pytest.raises(ConfigError, match=r"\.metadata: not a valid checkpoint index") as err:
        dcp_index.read_dcp_metadata(checkpoint / ".metadata")
    _one_line(err)


# ---- stapo convert megatron-to-hf (the ranks read the index and the model's stored objects) ----


@pytest.mark.parametrize("stealth", [False, True], ids=["payload", "stealth"])
def test_convert_refuses_a_crafted_index(checkpoint, tmp_path, stealth):
    flag = tmp_path / "pwned"
    payload = Stealth(read_metadata(checkpoint), flag) if stealth else Touch(flag)
    (checkpoint / ".metadata").write_bytes(pickle.dumps(payload))
    rehash(checkpoint)
    with pytest.raises(ConfigError, match=r"iter_0000002/\.metadata: refused to load") as err:
        convert_megatron_to_hf(checkpoint, tmp_path / "hf", tp=1, pp=1)
    _one_line(err)
    assert not flag.exists()
    assert not (tmp_path / "hf").exists()


def test_convert_reads_no_stored_object_so_a_crafted_one_runs_nothing(checkpoint, tmp_path):
    # The model's state is tensors only (no module's _extra_state: checkpoint/convert.py), so the
    # export unpickles no stored object of the checkpoint; a crafted one (the RNG states a resume
    # reads, refused there: test_resume_refuses_crafted_rng_state) is never loaded.
    flag = tmp_path / "pwned"
    replace_object(checkpoint, "rng_state", lambda obj: Stealth(obj, flag))
    rehash(checkpoint)
    out = convert_megatron_to_hf(checkpoint, tmp_path / "hf", tp=2, pp=1)
    assert (out / "model.safetensors.index.json").is_file() or list(out.glob("*.safetensors"))
    assert not flag.exists()


def test_stapo_convert_cli_prints_one_line(checkpoint, tmp_path):
    flag = tmp_path / "pwned"
    write_common(checkpoint, Stealth(read_common(checkpoint), flag))
    rehash(checkpoint)
    source = common_source_pattern(checkpoint)
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "stapo_megatron.cli",
            "convert",
            "megatron-to-hf",
            "--ckpt",
            str(checkpoint),
            "--out",
            str(tmp_path / "hf"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 2, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("stapo: error: ")]
    assert len(errors) == 1 and re.search(source + ": refused to load: it refers to operator.itemgetter", errors[0]), (
        result.stderr
    )
    assert "Traceback" not in result.stderr
    assert not flag.exists()


# ---- resume (the RNG states are sharded objects read only there) -------------------------------


@pytest.mark.slow
def test_resume_refuses_crafted_rng_state(run_copy, tmp_path):
    flag = tmp_path / "pwned"
    checkpoint = run_copy / "checkpoints" / "iter_0000002"
    replace_object(checkpoint, "rng_state", lambda obj: Stealth(obj, flag))
    rehash(checkpoint)
    result = subprocess.run(
        train_command(run_copy, "run.steps=3", "checkpoint.save_every=1", "checkpoint.keep_last=5"),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode != 0
    assert "refused to load" in result.stderr and "(object rng_state/shard_" in result.stderr, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if "refused to load" in line]
    assert errors and all("iter_0000002/__" in line and ".distcp" in line for line in errors)
    assert not flag.exists()
