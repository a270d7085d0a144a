"""The rollout engine a config asks for."""

from __future__ import annotations

from pathlib import Path

import torch

from stapo_megatron.models.qwen3.config import Qwen3Config
from stapo_megatron.models.qwen3.state_dict_adapter import hf_tensor_shapes
from stapo_megatron.rollout.config import RolloutConfig
from stapo_megatron.rollout.engine import RolloutEngine


def build_engine(cfg: RolloutConfig, arch: Qwen3Config, device: torch.device, hf_dir: str = "", run_dir: Path | None = None) -> RolloutEngine:
    """The local engine on ``device``, or SGLang servers that accept exactly the names the trainer
    exports (``hf_dir`` is the servers' model path when the config names none)."""
    if cfg.engine == "local":
        from stapo_megatron.rollout.local_engine import LocalEngine

        return LocalEngine(arch, cfg.local, device=device)
    import dataclasses

    from stapo_megatron.rollout.sglang_engine import SGLangEngine

    sglang = cfg.sglang
    if not sglang.urls and not sglang.model_path and hf_dir:
        sglang = dataclasses.replace(sglang, model_path=hf_dir)
    if not sglang.log_dir and run_dir is not None:
        sglang = dataclasses.replace(sglang, log_dir=str(Path(run_dir) / "sglang_logs"))
    return SGLangEngine(sglang, expected_weight_names=hf_tensor_shapes(arch).keys())
