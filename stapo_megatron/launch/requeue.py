"""A run longer than one SLURM allocation: stop in time, requeue, resume.

The job asks SLURM for USR1 ``--signal-lead`` seconds before its time limit, sent to the batch
shell (``--signal=B:USR1@lead``): torchrun would die of USR1 (it handles only TERM, INT, HUP and
QUIT, and on those kills its ranks within 30 s), so the shell, not the ranks, takes the signal.
Its trap touches the run's ``STOP`` file, which rank 0 reads after every step: the ranks agree
to stop, write the checkpoint of the step they finished and exit 0.

NeMo-Run's script runs the job step in the foreground, and bash runs a trap only once the
foreground command is over; so the script's ``srun`` is wrapped in a shell function that starts
the step in the background and waits for it with the ``wait`` builtin, which a trapped signal
interrupts. When the step has ended, the function decides:

- the step exited 0 and no stop was asked for: the run reached ``run.steps``; the job completes;
- a stop was asked for (the time limit is near), or the step failed (a hang ended by the step
  heartbeat, a lost rank): the run is not complete, so the job requeues itself
  (``scontrol requeue``: the same job id, ``SLURM_RESTART_COUNT`` + 1; SLURM holds it back for
  the credential lifetime, ``AuthInfo=cred_expire``, 120 s by default) and the next allocation
  resumes from the latest complete checkpoint (``checkpoint.resume: auto``);
- after ``--max-requeues`` requeues it does not requeue again: the job fails with a message.

A signal may come while the ranks are still starting: the script exports the allocation's start
time, and rank 0 clears only a STOP file older than it (left by an earlier run), so a request of
this allocation stops the run after its first step. A rank that does not reach a checkpoint
before the time limit (a lead shorter than a step and its checkpoint) is killed by SLURM; the job
then ends TIMEOUT and is not requeued.
"""

from __future__ import annotations

import posixpath
import re
import shlex

from stapo_megatron.config import ConfigError
from stapo_megatron.runtime.run_lock import SLURM_MAX_RESTART_COUNT

DEFAULT_SIGNAL_LEAD_S = 900
DEFAULT_MAX_REQUEUES = 50
# slurm's --signal keeps the lead time in 16 bits
MAX_SIGNAL_LEAD_S = 65535
# SLURM_RESTART_COUNT, which the batch script compares with this, counts in 16 bits: a larger bound
# could never be reached (and bash's test reads integers of 64 bits only).
MAX_REQUEUES = SLURM_MAX_RESTART_COUNT
# slurm keeps a time limit in minutes in 32 bits, the top values meaning "infinite" and "none"
MAX_TIME_LIMIT_S = (2**32 - 3) * 60
_TIME = re.compile(r"(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?")


def time_limit_seconds(text: str) -> int:
    """SLURM's --time (minutes, minutes:seconds, hours:minutes:seconds, days-hours[:minutes[:seconds]]) in seconds."""
    match = _TIME.fullmatch(text)
    if not match:
        raise ConfigError(f"--time: {text!r} is not a SLURM time limit (e.g. 04:00:00 or 2-00:00:00)")
    first = int(match.group(2))  # the one group every form has
    days, second, third = (int(g) if g is not None else None for g in match.group(1, 3, 4))
    if days is not None:  # days-hours[:minutes[:seconds]]
        return ((days * 24 + first) * 60 + (second or 0)) * 60 + (third or 0)
    if third is not None:  # hours:minutes:seconds (the third group matches only after the second)
        return (first * 60 + (second or 0)) * 60 + third
    return first * 60 + (second or 0)  # minutes[:seconds]


def check_requeue_options(signal_lead_s: int, max_requeues: int, time_limit: str) -> None:
    limit = time_limit_seconds(time_limit)
    if limit > MAX_TIME_LIMIT_S:
        raise ConfigError(f"--time: {time_limit} is longer than SLURM can hold ({MAX_TIME_LIMIT_S // 60} minutes)")
    if not 0 <= max_requeues <= MAX_REQUEUES:
        raise ConfigError(f"--max-requeues: must be in [0, {MAX_REQUEUES}], got {max_requeues}")
    if not 1 <= signal_lead_s <= MAX_SIGNAL_LEAD_S:
        raise ConfigError(f"--signal-lead: must be in [1, {MAX_SIGNAL_LEAD_S}] seconds, got {signal_lead_s}")
    if signal_lead_s >= limit:
        raise ConfigError(
            f"--signal-lead: {signal_lead_s} s leaves no time to train within --time {time_limit} ({limit} s)"
        )


def run_dir_for_batch_shell(run_dir: str, job_workdir: str, mounts: list[str], *, in_container: bool) -> str:
    """The run directory as the batch script sees it.

    ``job_workdir`` is where the ranks run (a relative run directory resolves there). A path the
    ranks see under a mount's target (SRC:DST[:FLAGS]: NeMo-Run's job directory at /nemo_run, and
    in a container the container's mounts) is mapped back to its source, which the batch shell sees.
    """
    path = posixpath.normpath(posixpath.join(job_workdir, run_dir))
    best = None
    for mount in mounts:
        source, target = mount.split(":")[:2]
        target = posixpath.normpath(target)
        if (path == target or path.startswith(target.rstrip("/") + "/")) and (
            best is None or len(target) > len(best[1])
        ):
            best = (source, target)
    if best is None:
        if in_container:
            raise ConfigError(
                f"--max-requeues: the run directory {path} exists inside the container only, where the batch "
                "script cannot stop and requeue the run; put run.output_dir under one of --mounts"
            )
        return path
    source, target = best
    return posixpath.normpath(source + path[len(target) :])


def batch_script_lines(run_dir: str, signal_lead_s: int, max_requeues: int) -> str:
    """Bash for NeMo-Run's ``setup_lines``: the USR1 trap and the ``srun`` wrapper described above."""
    from stapo_megatron.runtime.run_files import STOP_FILE
    from stapo_megatron.trainer.launcher import ALLOCATION_STARTED_ENV

    stop_file = shlex.quote(posixpath.join(run_dir, STOP_FILE))
    run_dir = shlex.quote(run_dir)
    return f"""
# stapo: a run longer than one allocation (stapo_megatron/launch/requeue.py)
export {ALLOCATION_STARTED_ENV}=$(date +%s)
stapo_stopping=0
stapo_stop() {{
    stapo_stopping=1
    echo "stapo: USR1, the time limit is {signal_lead_s} s away: asking the run to checkpoint and stop"
    mkdir -p {run_dir} && touch {stop_file}
}}
trap stapo_stop USR1
srun() {{
    command srun "$@" &
    local pid=$! code
    # wait returns early (> 128) when the trap runs; wait again until the step has ended
    while :; do wait "$pid"; code=$?; kill -0 "$pid" 2>/dev/null || break; done
    if [ "$code" = 0 ] && {{ [ "$stapo_stopping" = 0 ] || [ -e {stop_file} ]; }}; then
        # the step ended on its own: the run is complete (one that stopped for USR1 removed the STOP file)
        if [ "$stapo_stopping" = 1 ]; then
            rm -f {stop_file}
            echo "stapo: the run completed before it saw the stop request; the job ends"
        fi
        return 0
    fi
    local restarts=${{SLURM_RESTART_COUNT:-0}}
    if [ "$restarts" -ge {max_requeues} ]; then
        echo "stapo: the run is not complete (step exit $code, stopped for time: $stapo_stopping) and the job" \\
            "was requeued $restarts time(s), the most --max-requeues allows"
        [ "$code" = 0 ] && code=75
        return "$code"
    fi
    echo "stapo: the run is not complete (step exit $code, stopped for time: $stapo_stopping);" \\
        "requeue $((restarts + 1)) of at most {max_requeues}"
    scontrol requeue "$SLURM_JOB_ID"
    return "$code"
}}
""".strip("\n")
