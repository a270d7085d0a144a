"""The run directory's lifecycle, without processes: its lock, starting afresh in a used
directory, pruning by the run's own history, a cut-off metrics file, a full disk, the order of
flags and overrides, and a learning rate changed on resume."""

from __future__ import annotations

import errno
import json
import os
import socket
import subprocess
import sys
import time

import pytest
import torch

from stapo_megatron.config import ConfigError
from stapo_megatron.runtime import console, run_lock
from stapo_megatron.runtime.run_files import (
    METRICS_FILE,
    RUN_MARKER,
    NoSpaceError,
    atomic_open,
    write_resolved_config,
)
from stapo_megatron.runtime.run_lock import LOCK_FILE, RunLock
from stapo_megatron.trainer.checkpoint_directory import HISTORY_FILE, CheckpointDirectory
from stapo_megatron.trainer.launcher import ALLOCATION_STARTED_ENV, load_train_config, prepare_run_directory
from stapo_megatron.trainer.metrics import MetricsLogger, read_metrics
from stapo_megatron.trainer.run_directory import mark_run_directory


def _dead_pid() -> int:
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def _write_lock(run_dir, host, pid, started, age):
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / LOCK_FILE
    path.write_text(json.dumps({"host": host, "pid": pid, "started": started, "token": "other"}))
    os.utime(path, (time.time() - age, time.time() - age))
    return path


def test_a_second_run_is_refused_and_a_dead_runs_lock_is_taken_over(tmp_path, caplog):
    run_dir = tmp_path / "run"
    with RunLock.acquire(run_dir) as lock:
        holder = json.loads((run_dir / LOCK_FILE).read_text())
        assert holder["pid"] == os.getpid() and holder["host"] == socket.gethostname()
        assert oct((run_dir / LOCK_FILE).stat().st_mode & 0o777) == "0o600"
        with pytest.raises(ConfigError) as refused:
            RunLock.acquire(run_dir)
        message = str(refused.value)
        assert "\n" not in message and "in use by another run" in message
        assert f"host {socket.gethostname()}, pid {os.getpid()}, started " in message
        assert time.strftime("%Y-%m-%d %H:%M", time.localtime(lock.holder.started)) in message
    assert not (run_dir / LOCK_FILE).exists()  # released

    # Same host, holder gone: taken over at once.
    _write_lock(run_dir, socket.gethostname(), _dead_pid(), time.time() - 5, age=1)
    with RunLock.acquire(run_dir) as lock:
        assert lock.held() and json.loads((run_dir / LOCK_FILE).read_text())["pid"] == os.getpid()
    assert "taking over the lock of a run that is gone" in caplog.text  # a warning of the stapo logger
    caplog.clear()

    # Same host, the pid reused since by another process (this one, younger than the lock).
    _write_lock(run_dir, socket.gethostname(), os.getpid(), time.time() - 10**7, age=1)
    RunLock.acquire(run_dir).release()
    assert "is no longer running" in caplog.text
    caplog.clear()

    # Another host: alive while its heartbeat is fresh, stale once it is older than the bound.
    _write_lock(run_dir, "node-elsewhere", 4242, time.time() - 3600, age=5)
    with pytest.raises(ConfigError, match="host node-elsewhere, pid 4242"):
        RunLock.acquire(run_dir)
    _write_lock(run_dir, "node-elsewhere", 4242, time.time() - 3600, age=run_lock.STALE_AFTER_S + 10)
    lock = RunLock.acquire(run_dir)
    assert "no heartbeat for" in caplog.text

    # A holder whose lock was taken over (after a long stall) does not delete the new holder's.
    _write_lock(run_dir, "node-elsewhere", 4242, time.time(), age=0)
    lock.release()
    assert json.loads((run_dir / LOCK_FILE).read_text())["host"] == "node-elsewhere"


def test_a_requeued_slurm_job_takes_over_its_earlier_allocations_lock(tmp_path, monkeypatch):
    def lock_of(job, restarts):
        _write_lock(tmp_path, "node-elsewhere", 4242, time.time(), age=1)
        holder = json.loads((tmp_path / LOCK_FILE).read_text())
        (tmp_path / LOCK_FILE).write_text(json.dumps({**holder, "job": job, "restarts": restarts}))

    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    for job, restarts in (("77", 1), ("76", 0)):  # this allocation's own, another job's: live
        lock_of(job, restarts)
        with pytest.raises(ConfigError, match="host node-elsewhere, pid 4242"):
            RunLock.acquire(tmp_path)
    lock_of("77", 0)
    with RunLock.acquire(tmp_path) as lock:
        assert (lock.holder.job, lock.holder.restarts) == ("77", 1)
        assert json.loads((tmp_path / LOCK_FILE).read_text())["restarts"] == 1


def test_the_heartbeat_keeps_the_lock_fresh(tmp_path, monkeypatch):
    monkeypatch.setattr(run_lock, "HEARTBEAT_S", 0.05)
    with RunLock.acquire(tmp_path) as lock:
        os.utime(lock.path, (time.time() - 1000, time.time() - 1000))
        time.sleep(0.3)
        assert time.time() - lock.path.stat().st_mtime < 1.0


_RANK_SCRIPT = """
import signal, subprocess, sys, time
from stapo_megatron.checkpoint.dist import _use_fork_results_queue
from stapo_megatron.runtime.launch import watch_launcher
from megatron.core.dist_checkpointing.strategies import filesystem_async
signal.signal(signal.SIGTERM, lambda *a: None)  # as the trainer's stop request does
watch_launcher(int(sys.argv[1]), interval=0.1)
_use_fork_results_queue()
filesystem_async._results_queue.put(1)
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
print(filesystem_async._results_queue._manager._process.pid, child.pid, flush=True)
time.sleep(600)
"""


def test_a_rank_and_what_it_started_end_with_the_launcher_and_the_checkpoint_queue_with_its_rank():
    import psutil

    launcher = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    # Started together: their imports overlap. The second one's "launcher" is this test.
    ranks = [
        subprocess.Popen([sys.executable, "-c", _RANK_SCRIPT, str(pid)], stdout=subprocess.PIPE, text=True)
        for pid in (launcher.pid, os.getpid())
    ]
    try:
        (manager, child), (lone_manager, _) = [
            map(psutil.Process, map(int, r.stdout.readline().split())) for r in ranks
        ]
        # The checkpoint queue's manager does not inherit the rank's SIGTERM handler...
        manager.terminate()
        assert _ends(manager)
        # ... and ends with its rank, even one killed with SIGKILL, which runs no clean-up.
        ranks[1].kill()
        assert _ends(lone_manager)
        # A rank ends, with what it started, when its launcher is killed (left unreaped: a zombie).
        launcher.kill()
        assert ranks[0].wait(timeout=20) == 1
        assert _ends(child)
    finally:
        for process in (launcher, *ranks):
            process.kill()
            process.wait()


def _ends(process, timeout: float = 10.0) -> bool:
    """Whether a process (not necessarily a child of this one) ends within ``timeout``."""
    import psutil

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if process.status() == psutil.STATUS_ZOMBIE:  # ended; its parent has not reaped it
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.05)
    return False


def _fake_checkpoint(checkpoints: CheckpointDirectory, step: int) -> None:
    directory = checkpoints.path(step)
    directory.mkdir(parents=True)
    (directory / "stapo_complete.json").write_text(json.dumps({"step": step}))


def test_pruning_touches_only_the_runs_own_checkpoints(tmp_path):
    checkpoints = CheckpointDirectory(tmp_path, keep_last=2)
    for step in (10, 20, 30, 40, 50, 60):  # another run's (copied in, or kept on purpose)
        _fake_checkpoint(checkpoints, step)
    (checkpoints.root / HISTORY_FILE).write_text(json.dumps({"steps": []}))
    for step in (1, 2, 3):
        checkpoints.add_to_history(step)
        _fake_checkpoint(checkpoints, step)
        checkpoints._prune(step)
    # By step number, steps 1-3 would all be gone as soon as written.
    assert checkpoints.complete_steps() == [2, 3, 10, 20, 30, 40, 50, 60]
    assert checkpoints.history() == [2, 3]

    # Resumed from step 2 (step 3 was set aside), the new step 3 replaces the old; steps after
    # the one saved belong to the abandoned trajectory and go.
    checkpoints._write_history([2, 3, 4, 5])
    for step in (4, 5):
        _fake_checkpoint(checkpoints, step)
    checkpoints.add_to_history(3)
    checkpoints._prune(3)
    assert checkpoints.complete_steps() == [2, 3, 10, 20, 30, 40, 50, 60]
    assert checkpoints.history() == [2, 3]


def test_pruning_a_directory_from_before_the_history(tmp_path):
    checkpoints = CheckpointDirectory(tmp_path, keep_last=2)
    for step in (1, 2, 3):
        _fake_checkpoint(checkpoints, step)
    (checkpoints.root / ".iter_0000004.partial").mkdir()
    checkpoints.add_to_history(4)
    _fake_checkpoint(checkpoints, 4)
    checkpoints._prune(4)
    assert checkpoints.complete_steps() == [3, 4] and checkpoints.history() == [3, 4]
    assert not (checkpoints.root / ".iter_0000004.partial").exists()


def _config(run_dir, *overrides):
    return load_train_config(None, [f"run.output_dir={run_dir}", *overrides])


def test_starting_afresh_in_a_used_directory(tmp_path, capsys, monkeypatch):
    console.configure(rank=0)  # as `stapo` does: messages on stderr
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    mark_run_directory(run_dir)
    checkpoints = CheckpointDirectory(run_dir, keep_last=3)
    for step in (5, 10):
        _fake_checkpoint(checkpoints, step)
    (run_dir / METRICS_FILE).write_text('{"step": 1}\n')
    (run_dir / "STOP").touch()

    with pytest.raises(ConfigError) as refused:
        prepare_run_directory(_config(run_dir, "checkpoint.resume=never"), overwrite=False)
    assert "\n" not in str(refused.value)
    assert "has checkpoints up to step 10" in str(refused.value) and "--overwrite" in str(refused.value)
    assert checkpoints.complete_steps() == [5, 10] and (run_dir / "STOP").exists()  # nothing touched

    # A resumed run keeps everything but the stop request of the earlier run.
    prepare_run_directory(_config(run_dir), overwrite=False)
    assert checkpoints.complete_steps() == [5, 10] and not (run_dir / "STOP").exists()
    assert f"[stapo] removed {run_dir / 'STOP'}, a stop request left by an earlier run\n" in capsys.readouterr().err

    # In a requeued SLURM allocation: a stop request older than the allocation is an earlier run's;
    # one made since (USR1 while the ranks were starting) is this allocation's, and is kept.
    monkeypatch.setenv(ALLOCATION_STARTED_ENV, "1000")
    (run_dir / "STOP").touch()
    os.utime(run_dir / "STOP", (999, 999))
    prepare_run_directory(_config(run_dir), overwrite=False)
    assert not (run_dir / "STOP").exists()
    (run_dir / "STOP").touch()
    prepare_run_directory(_config(run_dir), overwrite=False)
    assert (run_dir / "STOP").exists()
    assert "a stop request of this allocation (its time limit is near)" in capsys.readouterr().err
    monkeypatch.delenv(ALLOCATION_STARTED_ENV)
    (run_dir / "STOP").unlink()

    (run_dir / LOCK_FILE).write_text("{}")
    (run_dir / "notes.txt").write_text("the user's own")  # no run writes it: it stays
    prepare_run_directory(_config(run_dir, "checkpoint.resume=never"), overwrite=True)
    assert checkpoints.complete_steps() == [] and not (run_dir / METRICS_FILE).exists()
    assert (run_dir / LOCK_FILE).exists() and (run_dir / RUN_MARKER).exists()
    assert (run_dir / "notes.txt").read_text() == "the user's own"
    (archive,) = (run_dir / "archive").iterdir()
    assert sorted(p.name for p in archive.iterdir()) == ["checkpoints", METRICS_FILE]
    assert CheckpointDirectory(archive, keep_last=3).complete_steps() == [5, 10]
    err = capsys.readouterr().err
    assert f"[stapo] --overwrite: moved the earlier run (checkpoints, {METRICS_FILE}) to {archive}\n" in err
    assert "[stapo] --overwrite: left in place what no run writes: notes.txt\n" in err


def test_a_cut_off_metrics_line_is_skipped_by_readers_and_repaired_on_resume(tmp_path, caplog):
    from stapo_megatron.trainer.inspector import read_dumps
    from stapo_megatron.trainer.plot import plot_runs

    rows = [{"step": s, "reward/accuracy": 0.1 * s, "policy/entropy": 1.0 / s} for s in (1, 2, 3)]
    text = "".join(json.dumps(r) + "\n" for r in rows) + '{"step": 4, "reward/acc'
    (tmp_path / METRICS_FILE).write_text(text)
    assert read_metrics(tmp_path) == rows
    assert f"{tmp_path / METRICS_FILE}: line 4 is cut off or malformed" in caplog.text
    assert plot_runs([tmp_path]).stat().st_size > 10_000

    (tmp_path / "spurious").mkdir()
    (tmp_path / "spurious" / "step_0000001.jsonl").write_text('{"step": 1, "token": "a"}\n{"step": 1, "tok')
    assert read_dumps(tmp_path) == [{"step": 1, "token": "a"}]

    logging_cfg = _config(tmp_path, "logging.progress_bar=false", "logging.tensorboard=false").logging
    logger = MetricsLogger(tmp_path, logging_cfg, "run", {}, resume_step=2, total_steps=10)
    logger.log(3, {"reward/accuracy": 0.5})
    logger.close()
    lines = (tmp_path / METRICS_FILE).read_text().splitlines()
    assert [json.loads(line) for line in lines] == [*rows[:2], {"step": 3, "reward/accuracy": 0.5}]


def test_a_full_disk_is_one_line_and_leaves_no_partial_file(tmp_path, monkeypatch):
    cfg = _config(tmp_path / "run")
    cfg.run.directory.mkdir()
    mark_run_directory(cfg.run.directory)
    config_file = write_resolved_config(cfg)
    before = config_file.read_bytes()

    real_fsync = os.fsync

    def full(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(NoSpaceError) as error:
        write_resolved_config(cfg)
    assert str(error.value) == f"no space left on {config_file}"
    assert config_file.read_bytes() == before
    assert sorted(p.name for p in config_file.parent.iterdir()) == [RUN_MARKER, "config.yaml"]
    with pytest.raises(NoSpaceError, match="no space left on .*/blob.bin$"):
        with atomic_open(tmp_path / "blob.bin", "wb") as f:
            f.write(b"x" * 100)
    assert not list(tmp_path.glob("*blob*"))
    monkeypatch.setattr(os, "fsync", real_fsync)

    # A metrics row half written when the disk fills is taken back.
    logging_cfg = _config(tmp_path, "logging.progress_bar=false", "logging.tensorboard=false").logging
    logger = MetricsLogger(tmp_path, logging_cfg, "run", {}, resume_step=0, total_steps=10)
    logger.log(1, {"reward/accuracy": 0.25})
    size = (tmp_path / METRICS_FILE).stat().st_size
    real_write = os.write

    def half_then_full(fd, data):
        if real_write(fd, data[: len(data) // 2]) and len(data) > 1:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "write", half_then_full)
    with pytest.raises(NoSpaceError, match=f"^no space left on {tmp_path / METRICS_FILE}$"):
        logger.log(2, {"reward/accuracy": 0.5})
    monkeypatch.setattr(os, "write", real_write)
    logger.close()
    assert (tmp_path / METRICS_FILE).stat().st_size == size
    assert read_metrics(tmp_path) == [{"step": 1, "reward/accuracy": 0.25}]


def test_a_checkpoint_write_on_a_full_disk_is_one_line_and_leaves_no_partial_checkpoint(tmp_path, monkeypatch):
    import types

    import torch.distributed as dist
    from torch.distributed.checkpoint.api import CheckpointException

    from stapo_megatron.checkpoint.dist import staging_dir
    from stapo_megatron.trainer import checkpointing

    def full_disk_write(state, directory, ctx, metadata=None, assets=None):
        staging_dir(directory).mkdir(parents=True)
        (staging_dir(directory) / "__0_0.distcp").write_bytes(b"half a shard")
        # How Megatron's writer reports a rank's failure (a BaseException, the OSError as text).
        failure = RuntimeError(f"Worker failure: [Errno 28] {os.strerror(errno.ENOSPC)}")
        raise CheckpointException("write", {1: (failure, None)})

    monkeypatch.setattr(checkpointing, "save_dist", full_disk_write)
    stage = types.SimpleNamespace(sharded_state_dict=lambda: {})
    optimizer = types.SimpleNamespace(sharded_state_dict=lambda *args, **kwargs: {})
    scheduler = types.SimpleNamespace(state_dict=lambda: {"num_steps": 3})
    progress = types.SimpleNamespace(state_dict=lambda: {"step": 3})
    ctx = types.SimpleNamespace(
        rank=0,
        tp_size=1,
        pp_size=1,
        dp_size=1,
        tp_rank=0,
        pp_rank=0,
        dp_rank=0,
        broadcast_object=lambda obj, src=0: obj,  # one rank: its own object
    )
    checkpoints = CheckpointDirectory(tmp_path, keep_last=2)
    checkpointer = checkpointing.Checkpointer(
        checkpoints,
        ctx,
        model=stage,
        optimizer=optimizer,
        scheduler=scheduler,
        progress=progress,
        record={},
        arch=_config(tmp_path).model,
        params_dtype=torch.float32,
        assets=None,
    )
    _fake_checkpoint(checkpoints, 2)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with pytest.raises(NoSpaceError) as error:
            checkpointer.save(3)
    finally:
        dist.destroy_process_group()
    assert str(error.value) == f"no space left on {tmp_path / 'checkpoints'}"
    assert sorted(p.name for p in checkpoints.root.iterdir()) == [HISTORY_FILE, "iter_0000002"]
    assert checkpoints.complete_steps() == [2]


def test_a_full_disk_deep_inside_a_library_is_recognised():
    from stapo_megatron.runtime.run_files import is_no_space, reporting_no_space

    class CheckpointException(Exception):
        pass

    wrapped = CheckpointException(f"rank 1: RuntimeError('write failed: {os.strerror(errno.ENOSPC)}')")
    assert is_no_space(wrapped) and not is_no_space(RuntimeError("out of memory"))
    with pytest.raises(NoSpaceError, match="^no space left on /scratch/run/checkpoints$"):
        with reporting_no_space("/scratch/run/checkpoints"):
            try:
                raise OSError(errno.EDQUOT, "quota")
            except OSError as err:
                raise RuntimeError("save failed") from err
    with pytest.raises(RuntimeError, match="unrelated"):
        with reporting_no_space("/scratch"):
            raise RuntimeError("unrelated")


@pytest.mark.parametrize(
    "argv, overrides, resume",
    [
        (["train", "a.b=1", "--no-resume", "c.d=2"], ["a.b=1", "c.d=2"], "never"),
        (
            ["train", "--resume", "a.b=1", "--config", "x.yaml", "c.d=2", "e.f=3"],
            ["a.b=1", "c.d=2", "e.f=3"],
            "required",
        ),
        (["train", "a.b=1", "c.d=2", "--overwrite"], ["a.b=1", "c.d=2"], None),
    ],
)
def test_overrides_and_flags_in_any_order(argv, overrides, resume):
    from stapo_megatron.cli import parse_args

    args = parse_args(argv)
    assert args.overrides == overrides and args.resume == resume
    assert args.overwrite == ("--overwrite" in argv)


def test_an_unknown_flag_is_still_refused(capsys):
    from stapo_megatron.cli import parse_args
    from stapo_megatron.trainer.main import main as rank_main

    with pytest.raises(SystemExit) as exit_:
        parse_args(["train", "a.b=1", "--no-such-flag"])
    assert exit_.value.code == 2 and "unrecognized arguments: --no-such-flag" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_args(["inspect", "run", "a.b=1"])  # a command without overrides
    # The rank entry point, as torchrun starts it, takes them in any order too.
    assert rank_main(["run.steps=0", "--config", "missing.yaml", "run.seed=1"]) == 2


def test_a_learning_rate_changed_on_resume_takes_effect(tmp_path, capsys):
    console.configure(rank=0)
    from stapo_megatron.trainer.trainer import build_scheduler

    def optimizer(lr):
        # Megatron's optimizer groups carry their peak and final rates, restored from a checkpoint.
        return torch.optim.AdamW(
            [{"params": [torch.nn.Parameter(torch.zeros(2))], "max_lr": lr, "min_lr": 1e-5}], lr=lr
        )

    schedule = ["optim.warmup_steps=2", "optim.schedule=cosine", "run.steps=10", "optim.min_lr=1e-5"]
    old_cfg = _config(tmp_path, "optim.lr=1e-3", *schedule)
    old_optimizer = optimizer(1e-3)
    old = build_scheduler(old_optimizer, old_cfg)
    old.step(5)
    saved_optimizer, saved_scheduler = old_optimizer.state_dict(), old.state_dict()

    new_cfg = _config(tmp_path, "optim.lr=2e-3", *schedule)
    reference = build_scheduler(optimizer(2e-3), new_cfg)
    reference.step(5)
    expected = reference.optimizer.param_groups[0]["lr"]

    resumed_optimizer = optimizer(2e-3)
    resumed_optimizer.load_state_dict(saved_optimizer)  # as Checkpointer.load: optimizer, then scheduler
    resumed = build_scheduler(resumed_optimizer, new_cfg)
    resumed.load_state_dict(saved_scheduler)
    assert resumed.num_steps == 5
    assert resumed_optimizer.param_groups[0]["lr"] == pytest.approx(expected, rel=1e-12)
    assert expected != pytest.approx(old_optimizer.param_groups[0]["lr"])
    out = capsys.readouterr().err
    assert "optim.lr changed on resume: 0.001 in the checkpoint, 0.002 now (takes effect)" in out
    assert out.count("changed on resume") == 1


def test_adam_settings_changed_on_resume_take_effect(tmp_path, capsys):
    console.configure(rank=0)
    from stapo_megatron.trainer.trainer import build_scheduler

    def optimizer(betas, eps):
        group = {"params": [torch.nn.Parameter(torch.zeros(2))], "max_lr": 1e-3, "min_lr": 0.0}
        return torch.optim.AdamW([group], lr=1e-3, betas=betas, eps=eps)

    old_optimizer = optimizer((0.9, 0.999), 1e-8)
    old = build_scheduler(old_optimizer, _config(tmp_path, "optim.beta1=0.9", "optim.beta2=0.999", "optim.eps=1e-8"))
    old.step(3)
    saved_optimizer, saved_scheduler = old_optimizer.state_dict(), old.state_dict()

    new_cfg = _config(tmp_path, "optim.beta1=0.8", "optim.beta2=0.95", "optim.eps=1e-6")
    resumed_optimizer = optimizer((0.8, 0.95), 1e-6)
    resumed_optimizer.load_state_dict(saved_optimizer)  # the checkpoint's groups bring back the old values
    assert resumed_optimizer.param_groups[0]["betas"] == (0.9, 0.999)
    build_scheduler(resumed_optimizer, new_cfg).load_state_dict(saved_scheduler)
    assert resumed_optimizer.param_groups[0]["betas"] == (0.8, 0.95)
    assert resumed_optimizer.param_groups[0]["eps"] == 1e-6
    out = capsys.readouterr().err
    assert "optim.betas changed on resume: (0.9, 0.999) in the checkpoint, (0.8, 0.95) now (takes effect)" in out
    assert "optim.eps changed on resume: 1e-08 in the checkpoint, 1e-06 now (takes effect)" in out


# ---- end to end: real `stapo train` processes -------------------------------------------------


def _stapo_train(run_dir, *args, timeout=600) -> subprocess.CompletedProcess:
    from tests.trainer.runs import FAST

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "stapo_megatron.cli", "train", f"run.output_dir={run_dir}", *FAST, *args]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)


def _error_line(result: subprocess.CompletedProcess) -> str:
    lines = [line for line in result.stderr.splitlines() if line.startswith("stapo: error:")]
    assert result.returncode == 2 and len(lines) == 1, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    return lines[0]


def _wait_for_rows(process, run_dir, count, timeout=300, after=lambda: True):
    """Until the run logged ``count`` rows, and ``after()`` held before."""
    from tests.trainer.runs import metrics

    deadline = time.monotonic() + timeout
    while not (after() and (run_dir / METRICS_FILE).is_file() and len(metrics(run_dir)) >= count):
        assert process.poll() is None, process.stdout.read()[-3000:]
        assert time.monotonic() < deadline, "the run did not get going"
        time.sleep(0.2)


@pytest.mark.slow
def test_the_run_directory_across_runs(tmp_path):
    """One directory through a run's lifecycle: a second run refused while the first runs; the
    launcher killed with SIGKILL takes its ranks along; its lock is taken over; --no-resume
    refused on its checkpoints; a cut-off metrics line, a stale STOP file and a changed lr on
    resume; --overwrite archiving the old run; a second Ctrl-C ending with 130 and nothing left."""
    import signal

    import psutil

    from stapo_megatron.runtime.launch import kill_tree
    from tests.trainer.runs import metrics, start_session, train_command

    run_dir = tmp_path / "run"
    first = start_session(
        train_command(run_dir, "run.steps=10000", "checkpoint.save_every=1", "checkpoint.keep_last=2", "optim.lr=1e-3")
    )
    try:
        _wait_for_rows(first, run_dir, 2)
        launched = psutil.Process(first.pid).children(recursive=True)
        assert len(launched) >= 3  # torchrun and two ranks (and their checkpoint-queue managers)
        config = (run_dir / "config.yaml").read_bytes()

        second = _stapo_train(run_dir, "run.steps=3", "optim.lr=5e-4")
        line = _error_line(second)
        assert f"in use by another run (host {socket.gethostname()}, pid {first.pid}, started " in line
        assert (run_dir / "config.yaml").read_bytes() == config  # the first run's, untouched

        os.kill(first.pid, signal.SIGKILL)  # the launcher only
        first.wait()
        gone, alive = psutil.wait_procs(launched, timeout=60)
        assert not alive, f"still running after the launcher was killed: {[p.cmdline() for p in alive]}"
    finally:
        kill_tree(first.pid)
    saved = CheckpointDirectory(run_dir, keep_last=2).complete_steps()
    assert len(saved) >= 2 and set(saved[-2:]) <= set(CheckpointDirectory(run_dir, keep_last=2).history())
    last = saved[-1]

    # Flags after overrides; the dead launcher's lock is taken over; the old checkpoints stay.
    refused = _stapo_train(run_dir, "run.steps=3", "--no-resume")
    assert "taking over the lock of a run that is gone" in refused.stderr
    assert f"has checkpoints up to step {last} of an earlier run" in _error_line(refused)

    (run_dir / "STOP").touch()  # as a first Ctrl-C leaves it when the ranks never read it
    with open(run_dir / METRICS_FILE, "a", encoding="utf-8") as f:
        f.write('{"step": 99, "reward/acc')  # a row cut off by a full disk
    resumed = _stapo_train(run_dir, f"run.steps={last + 2}", "optim.lr=2e-3", "checkpoint.save_every=0")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"(step {last})" in resumed.stderr and "a stop request left by an earlier run" in resumed.stderr
    assert "optim.lr changed on resume: 0.001 in the checkpoint, 0.002 now (takes effect)" in resumed.stderr
    rows = metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(1, last + 3))  # not stopped after one step
    rates = [(r["step"] > last, r["optim/lr"]) for r in rows if "optim/lr" in r]
    assert {rate for resumed_step, rate in rates if not resumed_step} == {1e-3}
    assert {rate for resumed_step, rate in rates if resumed_step} == {2e-3}
    assert not (run_dir / "STOP").exists() and not (run_dir / LOCK_FILE).exists()

    fresh = start_session(train_command(run_dir, "run.steps=10000", "--overwrite"))
    try:
        _wait_for_rows(fresh, run_dir, 1, after=lambda: any(run_dir.glob(f"archive/*/{METRICS_FILE}")))  # the new run's
        launched = psutil.Process(fresh.pid).children(recursive=True)
        fresh.send_signal(signal.SIGINT)
        time.sleep(0.5)
        fresh.send_signal(signal.SIGINT)
        output, _ = fresh.communicate(timeout=120)
        gone, alive = psutil.wait_procs(launched, timeout=30)
    finally:
        kill_tree(fresh.pid)
    assert fresh.returncode == 130, output[-3000:]
    assert "killed by a second SIGINT" in output and not alive
    assert not (run_dir / "STOP").exists() and not (run_dir / LOCK_FILE).exists()
    (archive,) = (run_dir / "archive").iterdir()
    assert CheckpointDirectory(archive, keep_last=2).complete_steps()[-1] == last + 2
    assert [r["step"] for r in metrics(archive)] == list(range(1, last + 3))


@pytest.mark.slow
def test_a_bad_data_file_fails_before_torchrun(tmp_path):
    from tests.fixtures import write_qwen3_tokenizer

    tokenizer = write_qwen3_tokenizer(tmp_path / "qwen3-tokenizer")
    data = tmp_path / "prompts.jsonl"
    data.write_text('{"problem": "1+1", "answer": "2"}\n{not json\n')
    result = _stapo_train(tmp_path / "run", f"data.source={data}", "data.bad_rows=error", f"tokenizer={tokenizer}")
    line = _error_line(result)
    assert f"{data}: row 2: malformed JSON" in line
    # Before: the error came from rank 0 after torchrun and the model had started (33 s, against
    # 10.5 s now, on an idle 2-core machine), with a traceback per rank and torchrun's report.
    assert "torch.distributed" not in result.stderr and "elastic" not in result.stderr
    assert not (tmp_path / "run").exists()  # nothing started: not even the run directory's lock


@pytest.mark.slow
def test_a_second_ctrl_c_stops_a_single_process_run_with_130(tmp_path):
    import signal

    from stapo_megatron.runtime.launch import kill_tree
    from tests.trainer.runs import start_session, train_command

    run_dir = tmp_path / "run"
    # Long steps (64 responses per prompt): the second Ctrl-C comes well before the step ends.
    process = start_session(
        train_command(run_dir, "run.steps=10000", "parallel.tensor_parallel=1", "batch.group_size=64")
    )
    try:
        _wait_for_rows(process, run_dir, 1)
        process.send_signal(signal.SIGINT)
        seen = []
        while not seen or "Ctrl-C again" not in seen[-1]:  # the first one is taken: a stop request
            seen.append(process.stdout.readline())
            assert seen[-1], "".join(seen)[-3000:]
        process.send_signal(signal.SIGINT)
        output = "".join(seen) + process.communicate(timeout=120)[0]
    finally:
        kill_tree(process.pid)
    assert process.returncode == 130, output[-3000:]
    assert "stapo: interrupted" in output
    assert not (run_dir / "STOP").exists() and not (run_dir / LOCK_FILE).exists()


def _ask_to_die_with(parent_pid: int) -> None:
    from stapo_megatron.runtime.launch import die_with_parent

    die_with_parent(parent_pid)


def test_a_child_whose_parent_died_before_asking_ends_at_once():
    """A fork that races the kill of its parent (the checkpoint queue's manager, forked while its
    rank is killed) asks for the parent-death signal too late: it must end rather than linger
    holding the run's output pipes."""
    import multiprocessing

    fork = multiprocessing.get_context("fork")
    kept = fork.Process(target=_ask_to_die_with, args=(os.getpid(),))
    kept.start()
    kept.join(30)
    orphan = fork.Process(target=_ask_to_die_with, args=(1,))  # as if reparented: its parent is gone
    orphan.start()
    orphan.join(30)
    assert kept.exitcode == 0
    assert orphan.exitcode == -9  # SIGKILL
