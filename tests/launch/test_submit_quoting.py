"""stapo submit: every value that reaches the job script arrives there exactly, or is refused.

NeMo-Run writes srun arguments, container mounts and the job directory into the sbatch script
without quoting; the values stapo passes are quoted by stapo, or refused with one line when
they cannot be written safely. The generated scripts are read by bash itself here.
"""

from __future__ import annotations

import re
import stat
import subprocess

import pytest
import yaml

from .test_submit import exports, main_srun, option_values, run_cli

# Spaces, a command separator, command substitutions, both quote characters and a glob.
HOSTILE_DIR = "/scratch/x y;touch PWNED $(touch PWNED) `touch PWNED` 'q' \"d\" *"
HOSTILE_VALUE = "a b;touch PWNED $(touch PWNED)'q\"*"


def bash_words(line: str, cwd) -> list[str]:
    """The arguments bash passes to the line's command (srun, cd, ...), without running it."""
    command = line.split(" ", 1)[0]
    script = f'{command}() {{ printf "%s\\0" "$@"; }}\n{line}\n'
    done = subprocess.run(["bash", "-c", script], cwd=cwd, capture_output=True, timeout=30)
    assert done.returncode == 0, done.stderr
    return done.stdout.decode().split("\0")[:-1]


def assert_valid_bash(script: str, tmp_path) -> None:
    path = tmp_path / "job.sh"
    path.write_text(script)
    done = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("container", [False, True], ids=["chdir", "container-workdir"])
def test_sbatch_values_round_trip_through_bash(container, nemorun_home, capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    # in a container, the run directory on a mount: the batch script can see it (to requeue the job)
    extra = (
        [
            "--container-image",
            "nvcr.io/nvidia/pytorch:25.01-py3",
            "--mounts",
            "/lustre/data:/data",
            "run.output_dir=/data/runs/q",
        ]
        if container
        else []
    )
    code, out, err = run_cli(
        capsys,
        "submit",
        "--gpus-per-node",
        "0",
        "--procs-per-node",
        "2",
        "--account",
        "a",
        "--workdir",
        HOSTILE_DIR,
        "--env",
        f"TOKEN={HOSTILE_VALUE}",
        *extra,
        "--dryrun",
        "run.steps=1",
    )
    assert code == 0, err
    assert_valid_bash(out, tmp_path)
    [srun_line] = [line for line in out.splitlines() if line.startswith("srun ")]
    flag = "--container-workdir" if container else "--chdir"
    words = bash_words(srun_line, tmp_path)
    assert option_values(words, flag)[-1] == HOSTILE_DIR  # srun takes the last one
    assert option_values(main_srun(out), flag)[-1] == HOSTILE_DIR  # and shlex reads it the same way
    assert words[words.index("torchrun") :][-2:] == ["--config", words[-1]] and words[-1].endswith("/stapo_config.yaml")
    export = f"export TOKEN={exports(out)['TOKEN']}"
    done = subprocess.run(
        ["bash", "-c", f'{export}\nprintf "%s" "$TOKEN"'], cwd=tmp_path, capture_output=True, text=True
    )
    assert done.stdout == HOSTILE_VALUE

    # the local executor's job script likewise
    code, out, err = run_cli(
        capsys, "submit", "--executor", "local", "--workdir", HOSTILE_DIR, "--dryrun", "run.steps=1"
    )
    assert code == 0, err
    assert_valid_bash(out, tmp_path)
    [cd_line] = [line for line in out.splitlines() if line.startswith("cd ")]
    assert bash_words(cd_line, tmp_path) == [HOSTILE_DIR]
    assert not list(tmp_path.glob("PWNED*"))  # nothing in the values ran


SLURM = ["--gpus-per-node", "0", "--procs-per-node", "2"]
REFUSED = [
    (["--account", "a", "--workdir", "/scratch/a\nb"], "--workdir: '/scratch/a\\nb' contains a control character"),
    (["--executor", "local", "--workdir", "/scratch/a\rb"], "--workdir: '/scratch/a\\rb' contains a control character"),
    (["--account", "a;id"], "--account: 'a;id' cannot go into the sbatch script"),
    (["--account", "a", "--partition", "batch gpu"], "--partition: 'batch gpu' cannot go into the sbatch script"),
    (["--account", "a", "--container-image", "img;id"], "--container-image: 'img;id' cannot go into the sbatch script"),
    (["--account", "a", "--mounts", "/data set:/data"], "--mounts: '/data set:/data' cannot go into the sbatch script"),
    (
        ["--account", "a", "--tunnel", "ssh", "--host", "h", "--user", "u", "--remote-job-dir", "/x $(id)"],
        "--remote-job-dir: '/x $(id)' cannot go into the sbatch script",
    ),
]


@pytest.mark.parametrize("args, message", REFUSED, ids=[m.split(":")[0] + str(i) for i, (_, m) in enumerate(REFUSED)])
def test_values_the_script_cannot_carry_are_refused_in_one_line(args, message, capsys, monkeypatch, tmp_path):
    home = tmp_path / "nemo_home"
    monkeypatch.setenv("NEMORUN_HOME", str(home))
    monkeypatch.chdir(tmp_path)
    code, _, err = run_cli(capsys, "submit", *([] if "local" in args else SLURM), *args, "--dryrun")
    assert code == 2
    assert err.count("\n") == 1 and err.startswith(f"stapo: error: {message}"), err
    assert not (home / "experiments").exists()


def test_a_job_directory_the_script_cannot_carry_is_refused(capsys, monkeypatch, tmp_path):
    pytest.importorskip("nemo_run", reason="NeMo-Run is not importable: pip install -e '.[launch]'")
    from nemo_run.config import get_nemorun_home, set_nemorun_home

    home = tmp_path / "nemo home"
    previous = get_nemorun_home()
    set_nemorun_home(str(home))
    monkeypatch.chdir(tmp_path)
    try:
        code, _, err = run_cli(capsys, "submit", *SLURM, "--account", "a", "--dryrun")
    finally:
        set_nemorun_home(previous)
    assert code == 2 and err.count("\n") == 1
    assert err.startswith(f"stapo: error: NEMORUN_HOME: {str(home)!r} cannot go into the sbatch script"), err
    assert not (home / "experiments").exists()


SECRETS = ["rollout.sglang.api_key=s3cret-api-key", "rollout.sglang.env={HF_TOKEN: hf_s3cret, NCCL_DEBUG: WARN}"]


def test_submitted_config_keeps_secrets_in_a_private_file_and_a_dry_run_hides_them(tmp_path):
    pytest.importorskip("nemo_run", reason="NeMo-Run is not importable: pip install -e '.[launch]'")
    from stapo_megatron.launch.nemo import CONFIG_NAME, ResolvedConfigPackager
    from stapo_megatron.launch.submission import SubmitOptions, prepare

    options = dict(config=None, overrides=SECRETS, account="a", gpus_per_node=0, procs_per_node=2)
    shown = yaml.safe_load(prepare(SubmitOptions(**options, dryrun=True)).config_yaml)["rollout"]["sglang"]
    assert shown["api_key"] == "<redacted>" and shown["env"] == {"HF_TOKEN": "<redacted>", "NCCL_DEBUG": "<redacted>"}

    sub = prepare(SubmitOptions(**options))  # the job's ranks need the real values
    job_dir = tmp_path / "job"
    ResolvedConfigPackager(config_yaml=sub.config_yaml).package(tmp_path, str(job_dir), "job")
    written = job_dir / CONFIG_NAME
    assert stat.S_IMODE(written.stat().st_mode) == 0o600
    sglang = yaml.safe_load(written.read_text())["rollout"]["sglang"]
    assert sglang["api_key"] == "s3cret-api-key" and sglang["env"]["HF_TOKEN"] == "hf_s3cret"


def test_local_dry_run_prints_no_secret(nemorun_home, capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    code, out, err = run_cli(capsys, "submit", "--executor", "local", "--dryrun", *SECRETS)
    assert code == 0, err
    assert "s3cret" not in out and re.search(r"api_key: <redacted>", out)
