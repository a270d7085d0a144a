"""The one entry point that starts torch.distributed and Megatron's parallel state.

NCCL with CUDA, gloo without. Both patches of Megatron are applied here and nowhere else: the
CPU compatibility layer (:mod:`~stapo_megatron.runtime.cpu_compat`) on a machine without CUDA,
the corrections of Megatron's bugs (:mod:`~stapo_megatron.runtime.megatron_fixes`) everywhere.
:func:`init_distributed` returns the :class:`ParallelContext` that everything which communicates
receives, with a gloo group next to the NCCL one.
"""

from __future__ import annotations

import dataclasses
import datetime
import os

import torch
import torch.distributed as dist

from stapo_megatron.config import ConfigError, option
from stapo_megatron.runtime import console, megatron_fixes

MAX_RANKS = 1 << 16  # of one parallel dimension


@dataclasses.dataclass
class ParallelConfig:
    tensor_parallel: int = option(
        1, "Tensor-parallel size: ranks that split each weight matrix (and the vocabulary).", ge=1, le=MAX_RANKS
    )
    pipeline_parallel: int = option(
        1, "Pipeline-parallel size: ranks that split the layers into stages.", ge=1, le=MAX_RANKS
    )
    context_parallel: int = option(
        1, "Context-parallel size: ranks that split each sequence (Megatron CP).", ge=1, le=MAX_RANKS
    )
    data_parallel: int = option(
        1, "Data-parallel size; `stapo train` starts tensor x pipeline x context x data ranks.", ge=1, le=MAX_RANKS
    )
    sequence_parallel: bool = option(False, "Megatron sequence parallelism (needs tensor_parallel > 1).")
    timeout_minutes: int = option(30, "Timeout of collective operations, in minutes.", ge=1, le=7 * 24 * 60)

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


@dataclasses.dataclass(frozen=True, eq=False)
class ParallelContext:
    """This rank's place in the job and the groups it talks over; made once by :func:`init_distributed`
    and passed to everything that communicates.

    Two kinds of groups, and the rule that keeps collectives device-correct:

    * ``world_group``, ``tp_group``, ``pp_group``, ``dp_group``, ``model_parallel_group`` serve
      tensors on ``device`` (NCCL on GPUs, which refuses CPU tensors);
    * ``cpu_group`` (every rank) and ``dp_cpu_group`` are gloo: Python objects and CPU metadata.

    ``src``/``dst`` ranks are global ranks, whatever the group.
    """

    rank: int
    world_size: int
    local_rank: int
    tp_size: int
    tp_rank: int
    pp_size: int
    pp_rank: int
    cp_size: int
    cp_rank: int
    dp_size: int
    dp_rank: int
    device: torch.device
    world_group: dist.ProcessGroup
    cpu_group: dist.ProcessGroup
    tp_group: dist.ProcessGroup
    pp_group: dist.ProcessGroup
    dp_group: dist.ProcessGroup
    dp_cpu_group: dist.ProcessGroup
    model_parallel_group: dist.ProcessGroup

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    def any_rank(self, flag: bool) -> bool:
        """True on every rank when ``flag`` is true on any rank (a one-element MAX on the device)."""
        value = torch.tensor(float(flag), device=self.device)
        dist.all_reduce(value, op=dist.ReduceOp.MAX, group=self.world_group)
        return bool(value.item())

    def broadcast_object(self, obj, src: int = 0):
        """``obj`` of global rank ``src`` on every rank, pickled over gloo."""
        payload = [obj if self.rank == src else None]
        dist.broadcast_object_list(payload, src=src, group=self.cpu_group)
        return payload[0]

    def all_gather_object(self, obj) -> list:
        """Every rank's ``obj``, in rank order, on every rank, pickled over gloo."""
        gathered = [None] * self.world_size
        dist.all_gather_object(gathered, obj, group=self.cpu_group)
        return gathered


def _megatron_context(local_rank: int, world_group: dist.ProcessGroup, cpu_group: dist.ProcessGroup) -> ParallelContext:
    """Read Megatron's parallel state once; nothing outside this module reads its globals for the trainer."""
    from megatron.core import parallel_state as ps

    return ParallelContext(
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        local_rank=local_rank,
        tp_size=ps.get_tensor_model_parallel_world_size(),
        tp_rank=ps.get_tensor_model_parallel_rank(),
        pp_size=ps.get_pipeline_model_parallel_world_size(),
        pp_rank=ps.get_pipeline_model_parallel_rank(),
        cp_size=ps.get_context_parallel_world_size(),
        cp_rank=ps.get_context_parallel_rank(),
        dp_size=ps.get_data_parallel_world_size(),
        dp_rank=ps.get_data_parallel_rank(),
        device=device(),
        world_group=world_group,
        cpu_group=cpu_group,
        tp_group=ps.get_tensor_model_parallel_group(),
        pp_group=ps.get_pipeline_model_parallel_group(),
        dp_group=ps.get_data_parallel_group(),
        dp_cpu_group=ps.get_data_parallel_group_gloo(),
        model_parallel_group=ps.get_model_parallel_group(),
    )


def prepare_megatron_import() -> None:
    """What comes before Megatron's modules load in a process that runs them: its known warnings
    silenced and, without CUDA, the CPU layer installed, so that they take the CPU view as they load
    (and do not load TorchDynamo for fusions the CPU never runs: 3 to 4 s of a rank's start)."""
    quiet_known_warnings()
    if not accelerator_available():
        from stapo_megatron.runtime import cpu_compat

        cpu_compat.install()


def init_distributed(parallel: ParallelConfig, seed: int = 1234) -> ParallelContext:
    """Start the process group (from torchrun's environment) and Megatron's parallel groups.

    A world started before (tests, tools) is kept, whatever its backend.
    """
    prepare_megatron_import()
    from megatron.core import parallel_state, tensor_parallel

    megatron_fixes.apply()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if not dist.is_initialized():
        if accelerator_available():
            torch.cuda.set_device(local_rank)
        # Plain "nccl", not "cpu:gloo,cuda:nccl": Megatron makes dozens of subgroups with the
        # default backend, and the mixed one would give each a gloo communicator it never uses;
        # and a CPU tensor sent by mistake would silently crawl over TCP instead of failing.
        # One gloo group of every rank (below) carries what is meant for the CPU.
        dist.init_process_group(
            backend="nccl" if accelerator_available() else "gloo",
            timeout=datetime.timedelta(minutes=parallel.timeout_minutes),
        )
    parallel.check_world_size(dist.get_world_size())
    console.configure(rank=dist.get_rank())  # the console shows rank 0's messages (all ranks' on request)
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=parallel.tensor_parallel,
        pipeline_model_parallel_size=parallel.pipeline_parallel,
        context_parallel_size=parallel.context_parallel,
        create_gloo_process_groups=True,  # the data-parallel gloo group of the context
    )
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    return _megatron_context(local_rank, _world_group(), cpu_group(parallel.timeout_minutes))


_cpu_groups: dict[dist.ProcessGroup, dist.ProcessGroup] = {}  # default group -> its gloo companion


def _world_group() -> dist.ProcessGroup:
    world = dist.group.WORLD
    if world is None:
        raise RuntimeError("torch.distributed is not initialized (init_distributed starts it)")
    return world


def cpu_group(timeout_minutes: int = 30) -> dist.ProcessGroup:
    """The gloo group of every rank, for Python objects and CPU metadata: the default group itself
    when that is gloo, else one made for this world the first time (a collective: every rank
    calls it then; :func:`init_distributed` does) and returned again after. Also ``ctx.cpu_group``."""
    world = _world_group()
    if dist.get_backend() == "gloo":
        return world
    if world not in _cpu_groups:
        _cpu_groups.clear()  # a previous world's group died with it
        _cpu_groups[world] = dist.new_group(backend="gloo", timeout=datetime.timedelta(minutes=timeout_minutes))
    return _cpu_groups[world]


def shutdown_distributed() -> None:
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
