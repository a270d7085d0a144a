"""Build one pipeline stage of a Qwen3 layout on the meta device, without its process groups.

Megatron's GPTModel takes its tensor/pipeline groups from a ``ProcessGroupCollection`` and asks
them only for ``size()`` and ``rank()`` while it is built, so groups that merely answer those
let one process build any rank of any TP x PP layout in milliseconds (a real TP8 x PP4 world
would need 32 processes). torch.distributed must be initialised (Megatron reports size 1
otherwise): a one-process gloo group is enough. Parameters live on the meta device: nothing
is allocated. Checked against stages built inside real spawned worlds (tests/launch).
"""

from __future__ import annotations

import torch

from stapo_megatron.models.qwen3.config import Qwen3Config


class SizedGroup:
    """Stands in for a process group while a model is built: it knows its size and our rank."""

    def __init__(self, size: int, rank: int = 0):
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank


def ensure_single_process_world() -> None:
    """A one-process gloo group and Megatron's (trivial) parallel state, if none exists yet."""
    import torch.distributed as dist

    from stapo_megatron.runtime.distributed import ParallelConfig, init_distributed

    if dist.is_initialized():
        return
    from stapo_megatron.runtime.launch import become_single_rank

    become_single_rank()
    init_distributed(ParallelConfig(), seed=0)


def meta_stage(arch: Qwen3Config, tp: int, pp: int, stage: int, params_dtype: torch.dtype = torch.bfloat16):
    """Pipeline stage ``stage`` of ``arch`` at TP x PP (tensor-parallel rank 0), on the meta device."""
    from megatron.core.process_groups_config import ProcessGroupCollection

    from stapo_megatron.models.qwen3.model import build_gpt_model, transformer_config

    ensure_single_process_world()
    groups = ProcessGroupCollection(
        tp=SizedGroup(tp),
        pp=SizedGroup(pp, stage),
        cp=SizedGroup(1),
        tp_cp=SizedGroup(tp),
        # no embedding group: it only all-reduces the initial values of tied embeddings
        embd=None,
        pos_embd=None,
        dp=SizedGroup(1),
        dp_cp=SizedGroup(1),
        mp=SizedGroup(tp * pp, stage * tp),
    )
    with torch.device("meta"):
        config = transformer_config(
            arch,
            tensor_parallel=tp,
            pipeline_parallel=pp,
            params_dtype=params_dtype,
            perform_initialization=False,
            use_cpu_initialization=True,
        )
        return build_gpt_model(arch, config, pre_process=stage == 0, post_process=stage == pp - 1, pg_collection=groups)
