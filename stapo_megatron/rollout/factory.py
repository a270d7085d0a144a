"""The rollout engine a config asks for, and the job's SGLang servers behind it."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from stapo_megatron.models.qwen3.config import Qwen3Config
from stapo_megatron.models.qwen3.state_dict_adapter import hf_tensor_shapes
from stapo_megatron.rollout.config import RolloutConfig, SGLangConfig
from stapo_megatron.rollout.engine import RolloutEngine
from stapo_megatron.rollout.node_servers import JobServers


def sglang_settings(cfg: RolloutConfig, hf_dir: str, run_dir: Path | None) -> SGLangConfig:
    """``cfg.sglang`` with the trainer's defaults filled in: the model the run starts from, and logs
    under the run directory."""
    sglang = cfg.sglang
    if not sglang.urls and not sglang.model_path and hf_dir:
        sglang = dataclasses.replace(sglang, model_path=hf_dir)
    if not sglang.log_dir and run_dir is not None:
        sglang = dataclasses.replace(sglang, log_dir=str(Path(run_dir) / "sglang"))
    return sglang


def start_rollout_servers(ctx, cfg: RolloutConfig, hf_dir: str, run_dir: Path) -> JobServers | None:
    """Every rank of a run calls this once: the node leaders launch their node's SGLang servers
    (``rollout.sglang.placement``) and every rank learns all endpoints. None for the local engine."""
    if cfg.engine != "sglang":
        return None
    from stapo_megatron.rollout.node_servers import start_job_servers

    return start_job_servers(ctx, sglang_settings(cfg, hf_dir, run_dir), run_dir)


def build_engine(
    cfg: RolloutConfig,
    arch: Qwen3Config,
    device: torch.device,
    hf_dir: str = "",
    run_dir: Path | None = None,
    servers: JobServers | None = None,
) -> RolloutEngine:
    """The local engine on ``device``, or SGLang servers that accept exactly the names the trainer
    exports (``hf_dir`` is the servers' model path when the config names none). With ``servers``
    (from :func:`start_rollout_servers`) the engine uses the job's servers; without, it launches its
    own or attaches to ``urls``."""
    if cfg.engine == "local":
        from stapo_megatron.rollout.local_engine import LocalEngine

        return LocalEngine(arch, cfg.local, device=device)
    from stapo_megatron.rollout.sglang_engine import SGLangEngine

    names = hf_tensor_shapes(arch).keys()
    sglang = sglang_settings(cfg, hf_dir, run_dir)
    if servers is None:
        return SGLangEngine(sglang, expected_weight_names=names)
    return SGLangEngine(sglang, expected_weight_names=names, endpoints=servers.endpoints, api_key=servers.api_key)
