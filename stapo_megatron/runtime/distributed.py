"""The one entry point that starts torch.distributed and Megatron's parallel state.

NCCL with CUDA, gloo without; on a machine without CUDA the CPU compatibility layer is
installed here and nowhere else.
"""

from __future__ import annotations

import dataclasses
import datetime
import os

import torch
import torch.distributed as dist

from stapo_megatron.config import ConfigError, option


@dataclasses.dataclass
class ParallelConfig:
    tensor_parallel: int = option(1, "Tensor-parallel size: ranks that split each weight matrix (and the vocabulary).")
    pipeline_parallel: int = option(1, "Pipeline-parallel size: ranks that split the layers into stages.")
    context_parallel: int = option(1, "Context-parallel size: ranks that split each sequence (Megatron CP).")
    data_parallel: int = option(1, "Data-parallel size; `stapo train` starts tensor x pipeline x context x data ranks.")
    sequence_parallel: bool = option(False, "Megatron sequence parallelism (needs tensor_parallel > 1).")
    timeout_minutes: int = option(30, "Timeout of collective operations, in minutes.")

    def __post_init__(self):
        for name in ("tensor_parallel", "pipeline_parallel", "context_parallel", "data_parallel", "timeout_minutes"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if self.sequence_parallel and self.tensor_parallel == 1:
            raise ConfigError("sequence_parallel: needs tensor_parallel > 1")

    @property
    def model_parallel_size(self) -> int:
        return self.tensor_parallel * self.pipeline_parallel * self.context_parallel

    @property
    def world_size(self) -> int:
        return self.model_parallel_size * self.data_parallel

    def check_world_size(self, world_size: int) -> None:
        if world_size != self.world_size:
            raise ConfigError(
                f"parallel: {world_size} processes were started, but tensor x pipeline x context x data parallel = "
                f"{self.tensor_parallel} x {self.pipeline_parallel} x {self.context_parallel} x {self.data_parallel} "
                f"= {self.world_size}"
            )


def accelerator_available() -> bool:
    return torch.cuda.is_available()


def device() -> torch.device:
    """Where this rank's tensors live."""
    if accelerator_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def quiet_known_warnings() -> None:
    """Silence warnings that Megatron and torch raise on every step and that mean nothing here."""
    import warnings

    warnings.filterwarnings("ignore", message=r".*is deprecated\. Please use `torch\.distributed\.")
    warnings.filterwarnings("ignore", message=r"The \.grad attribute of a Tensor that is not a leaf Tensor")
    warnings.filterwarnings("ignore", message=r".*(Apex|Transformer Engine).* not installed")
    warnings.filterwarnings("ignore", message=r"When using async grad allreduce it is recommended")


def init_distributed(parallel: ParallelConfig, seed: int = 1234) -> None:
    """Start the process group (from torchrun's environment) and Megatron's parallel groups."""
    quiet_known_warnings()
    from megatron.core import parallel_state, tensor_parallel

    if not accelerator_available():
        from stapo_megatron.runtime import cpu_compat

        cpu_compat.install()
    if not dist.is_initialized():
        if accelerator_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(
            backend="nccl" if accelerator_available() else "gloo",
            timeout=datetime.timedelta(minutes=parallel.timeout_minutes),
        )
    parallel.check_world_size(dist.get_world_size())
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=parallel.tensor_parallel,
        pipeline_model_parallel_size=parallel.pipeline_parallel,
        context_parallel_size=parallel.context_parallel,
    )
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def shutdown_distributed() -> None:
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
