"""The SGLang API key never reaches a command line, a log or another user.

Servers are the process-mode ``fake_sglang`` started exactly as production starts
``sglang.launch_server``: through ``python -m stapo_megatron.rollout.sglang_launch`` with the key in
the environment. The fake, like SGLang, logs its settings (key included) when it starts.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from stapo_megatron.config.core import ConfigError
from stapo_megatron.rollout.config import SGLangConfig
from stapo_megatron.rollout.engine import SamplingParams
from stapo_megatron.rollout.sglang_client import request
from stapo_megatron.rollout.sglang_engine import SGLangEngine
from stapo_megatron.rollout.sglang_launch import KEY_ENV

try:
    from . import fake_sglang
except ImportError:  # tests/rollout is not a package
    import fake_sglang

FAKE_SCRIPT = str(Path(fake_sglang.__file__).resolve())
LAUNCH = [sys.executable, "-m", "stapo_megatron.rollout.sglang_launch"]
# Starts with "-" (argparse would take it for a flag if it were a separate argument) and is unmistakable.
KEY = "-Xy_z-contract-secret-3f9a"

pytestmark = pytest.mark.timeout(60)


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes of process group ``pgid``."""
    members = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                with open(f"/proc/{entry.name}/stat", encoding="utf-8", errors="replace") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            if fields[2] == str(pgid) and fields[0] not in ("Z", "X"):
                members.append(int(entry.name))
    return members


def test_contract_launched_command_lines_hold_no_key_and_servers_require_it(tmp_path):
    cfg = SGLangConfig(
        model_path="fake/qwen3-0.6b",
        server_command=[*LAUNCH, FAKE_SCRIPT],
        log_dir=str(tmp_path / "logs"),
        num_servers=2,
        api_key=KEY,
        startup_timeout_s=30,
        shutdown_grace_s=3,
        env={"FAKE_SGLANG_RECORD_DIR": str(tmp_path), "FAKE_SGLANG_SPAWN_CHILD": "1"},
    )
    with SGLangEngine(cfg) as engine:
        processes = []
        for status in engine.server_status():
            members = group_members(status["pid"])
            child = int((tmp_path / f"{status['url'].rsplit(':', 1)[1]}.child").read_text())
            assert status["pid"] in members and child in members  # the server and the process it started
            processes += members
        assert len(processes) == 4
        for pid in processes:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            assert KEY.encode() not in cmdline, cmdline.split(b"\0")
        # The wrapper took the key out of the environment the server's own children inherit.
        child_env = Path(f"/proc/{child}/environ").read_bytes().split(b"\0")
        assert not any(item.startswith(KEY_ENV.encode() + b"=") for item in child_env)

        # The server got the key: without it, or with another, it refuses; the engine's requests pass.
        body = {
            "input_ids": [3, 4],
            "sampling_params": {"max_new_tokens": 3},
            "return_logprob": True,
            "logprob_start_len": -1,
        }
        for url in engine.urls:
            assert request(url, "POST", "/generate", body, api_key=None, timeout=10).status == 401
            assert request(url, "POST", "/generate", body, api_key="wrong", timeout=10).status == 401
            assert request(url, "POST", "/flush_cache", {}, api_key=None, timeout=10).status == 401
            assert request(url, "POST", "/generate", body, api_key=KEY, timeout=10).status == 200
        [group] = engine.generate([[3, 4]], SamplingParams(max_new_tokens=3))
        assert group[0].token_ids == fake_sglang.fake_sample([3, 4], 0, 3, set(), None)[0]

        for log_file in engine.log_files:
            log = log_file.read_text()
            # the server logged its settings; the key in them was replaced
            assert "server_args=" in log and "'api_key': '<redacted>'" in log and KEY not in log
            assert stat.S_IMODE(log_file.stat().st_mode) == 0o600


def run_wrapper(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([*LAUNCH, *args], env={**os.environ, **env}, capture_output=True, text=True, timeout=30)


PROBE = """
import json, os, sys
print(json.dumps({"name": __name__, "argv": sys.argv[1:], "cmdline": open("/proc/self/cmdline", "rb").read().decode(),
                  "env": os.environ.get(%r)}))
"""


def test_wrapper_runs_a_module_as_python_m_does_with_the_key_in_process_only(tmp_path):
    (tmp_path / "argv_probe.py").write_text(PROBE % KEY_ENV)
    done = run_wrapper("argv_probe", "--model-path", "m", env={KEY_ENV: KEY, "PYTHONPATH": str(tmp_path)})
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout)
    assert seen["name"] == "__main__" and seen["env"] is None
    assert seen["argv"] == ["--model-path", "m", f"--api-key={KEY}", f"--admin-api-key={KEY}"]
    assert KEY not in seen["cmdline"] and seen["cmdline"].split("\0")[-4:-1] == ["argv_probe", "--model-path", "m"]


def test_wrapper_refuses_a_key_on_the_command_line_or_no_key():
    flags = [FAKE_SCRIPT, "--model-path", "m", "--port", "1"]
    for given in (["--api-key", "k"], ["--admin-api-key=k"], ["--api-k=k"]):
        done = run_wrapper(*flags, *given, env={KEY_ENV: "k"})
        assert done.returncode == 1
        assert done.stderr.strip().splitlines() == [
            f"stapo_megatron.rollout.sglang_launch: {given[0].split('=')[0]} on the command line is readable by every "
            f"local user; pass the key in ${KEY_ENV}"
        ]
    done = run_wrapper(*flags, env={KEY_ENV: ""})
    assert done.returncode == 1 and done.stderr.strip() == (
        f"stapo_megatron.rollout.sglang_launch: ${KEY_ENV} is empty or not set; refusing to start a server that "
        "anyone can control"
    )


@pytest.mark.parametrize("field", ["extra_args", "server_command"])
@pytest.mark.parametrize("flag", ["--api-key", "--admin-api-key=s", "--api-k"])
def test_config_refuses_key_flags(field, flag):
    with pytest.raises(ConfigError) as info:
        SGLangConfig(model_path="m", **{field: ["x", flag, "s"]})
    name = flag.split("=")[0]
    assert str(info.value) == (
        f"{field}: {name} would put the API key on a command line, readable by every local "
        "user; set api_key or api_key_env instead"
    )
