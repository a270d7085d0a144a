"""Secret config fields: declared once, hidden in everything written for people and tools, and
never read back from a written config as if ``<redacted>`` were the value."""

from __future__ import annotations

import dataclasses
import os
import stat
import typing

import pytest
import yaml

from stapo_megatron.cli import main
from stapo_megatron.config import ConfigError, load_config, to_dict
from stapo_megatron.trainer import launcher
from stapo_megatron.trainer.config import TrainConfig

API_KEY = "sk-live-4f1d9b"
HF_TOKEN = "hf_Qx81secret"
SECRETS = [f"rollout.sglang.api_key={API_KEY}", f"rollout.sglang.env={{HF_TOKEN: {HF_TOKEN}, NCCL_DEBUG: WARN}}"]


def secret_fields(cls: type, prefix: str = "") -> list[str]:
    names = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            names += secret_fields(hints[f.name], f"{prefix}{f.name}.")
        elif f.metadata.get("secret"):
            names.append(prefix + f.name)
    return names


def test_secret_fields_are_declared_once_and_redacted():
    assert secret_fields(TrainConfig) == ["rollout.sglang.env", "rollout.sglang.api_key"]
    cfg = load_config(TrainConfig, None, SECRETS)
    plain, shown = to_dict(cfg), to_dict(cfg, redact=True)
    assert (
        plain["rollout"]["sglang"]["api_key"] == API_KEY and plain["rollout"]["sglang"]["env"]["HF_TOKEN"] == HF_TOKEN
    )
    assert shown["rollout"]["sglang"]["api_key"] == "<redacted>"
    assert shown["rollout"]["sglang"]["env"] == {"HF_TOKEN": "<redacted>", "NCCL_DEBUG": "<redacted>"}
    # everything else is shown as it is
    for side in (plain, shown):
        side["rollout"]["sglang"].pop("api_key"), side["rollout"]["sglang"].pop("env")
    assert plain == shown
    # reprs (log lines, tracebacks, assertion diffs) leave secret fields out
    assert API_KEY not in repr(cfg) and HF_TOKEN not in repr(cfg) and "api_key_env=" in repr(cfg)
    # unset secrets stay visibly unset (the engine then makes a per-run key)
    unset = to_dict(load_config(TrainConfig, None, []), redact=True)["rollout"]["sglang"]
    assert unset["api_key"] is None and unset["env"] == {}


def test_stapo_config_prints_no_secret(capsys):
    assert main(["config", *SECRETS]) == 0
    out = capsys.readouterr().out
    assert API_KEY not in out and HF_TOKEN not in out
    assert yaml.safe_load(out)["rollout"]["sglang"]["api_key"] == "<redacted>"


def test_a_redacted_config_is_refused_as_input(tmp_path):
    written = tmp_path / "config.yaml"
    written.write_text(yaml.safe_dump(to_dict(load_config(TrainConfig, None, SECRETS), redact=True)))
    with pytest.raises(ConfigError) as info:
        load_config(TrainConfig, written)
    assert str(info.value) == (
        "rollout.sglang.env.HF_TOKEN: is '<redacted>' (copied from a written config, where "
        "secrets are hidden); give the real value or leave it unset"
    )
    with pytest.raises(ConfigError, match=r"^rollout\.sglang\.api_key: is '<redacted>' "):
        load_config(TrainConfig, written, ["rollout.sglang.env={}"])
    # the real values given again: the run resumes with them
    cfg = load_config(TrainConfig, written, SECRETS)
    assert cfg.rollout.sglang.api_key == API_KEY and cfg.rollout.sglang.env["HF_TOKEN"] == HF_TOKEN
    # without secrets, a written config reads back as the same config
    plain = tmp_path / "plain.yaml"
    original = load_config(TrainConfig, None, ["run.steps=3"])
    plain.write_text(yaml.safe_dump(to_dict(original, redact=True)))
    assert load_config(TrainConfig, plain) == original


def test_train_writes_a_private_run_directory_without_secrets(tmp_path, monkeypatch):
    """``stapo train`` up to the point where torchrun would start."""
    run_dir = tmp_path / "runs" / "secret_run"
    launched = []
    monkeypatch.setattr(launcher, "launch", lambda cfg, lock: launched.append(cfg) or 0)
    previous = os.umask(0o022)
    try:
        assert main(["train", f"run.output_dir={run_dir}", *SECRETS]) == 0
    finally:
        os.umask(previous)
    [cfg] = launched
    assert cfg.rollout.sglang.api_key == API_KEY  # the ranks get the real values ...
    written = (run_dir / "config.yaml").read_text()
    assert API_KEY not in written and HF_TOKEN not in written  # ... people reading the run do not
    assert yaml.safe_load(written)["rollout"]["sglang"]["env"]["HF_TOKEN"] == "<redacted>"
    assert stat.S_IMODE(run_dir.stat().st_mode) == 0o700
    assert stat.S_IMODE((run_dir / "config.yaml").stat().st_mode) == 0o600
