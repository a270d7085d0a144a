"""The trainer's accelerator state moved to host memory while colocated rollout servers generate.

Megatron keeps Python references everywhere into the trainer's tensors: DDP maps every
``param.data`` and ``param.main_grad`` into its contiguous buffers, the distributed optimizer
keeps views of those buffers for its shards and caches bucket views, the optimizer's groups hold
the fp32 main parameters and Adam's state. Replacing any of these tensors would leave a stale
reference behind, so the offload works one level below: it copies each distinct *storage* to host
memory and resizes the storage to zero bytes, which frees its device memory while every tensor and
view of it stays the same object; the reload resizes the storage back and copies the bytes in, so
each of those references sees its old values at the same place.

Two parts go separately because the weight sync reads the parameters: ``OPTIMIZER`` (gradient
buffers, fp32 main parameters, Adam's state) can leave before the sync, ``PARAMS`` (the model's
parameters and DDP's parameter buffers) only after it. A storage shared by both (fp32 training,
where the optimizer updates the model's own parameters) belongs to ``PARAMS``. The frozen
reference model of the KL penalty (:mod:`stapo_megatron.trainer.reference`), which the weight
sync does not read, belongs to ``OPTIMIZER``: it leaves first and comes back for the update.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Literal

import torch

Part = Literal["optimizer", "params"]
OPTIMIZER: Part = "optimizer"
PARAMS: Part = "params"


def _torch_optimizers(optimizer) -> list[torch.optim.Optimizer]:
    """The torch optimizers inside Megatron's optimizer (one, or one per chained optimizer)."""
    inner = getattr(optimizer, "chained_optimizers", None) or [optimizer]
    return [o.optimizer for o in inner]


def _param_tensors(model) -> Iterator[torch.Tensor]:
    for param in model.parameters():
        yield param.data
    for buffer in getattr(model, "buffers", []) + getattr(model, "expert_parallel_buffers", []):
        if getattr(buffer, "param_data", None) is not None:
            yield buffer.param_data


def _optimizer_tensors(model, optimizer) -> Iterator[torch.Tensor]:
    for param in model.parameters():
        if getattr(param, "main_grad", None) is not None:
            yield param.main_grad
        if param.grad is not None:
            yield param.grad
    for buffer in getattr(model, "buffers", []) + getattr(model, "expert_parallel_buffers", []):
        yield buffer.grad_data
    for torch_optimizer in _torch_optimizers(optimizer):
        for group in torch_optimizer.param_groups:
            for main_param in group["params"]:
                yield main_param.data
                if main_param.grad is not None:
                    yield main_param.grad
        for state in torch_optimizer.state.values():
            yield from (value for value in state.values() if torch.is_tensor(value))


def _whole_storage_bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    """A uint8 tensor over every byte of ``storage`` (a fresh view: one made before a resize is stale)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


class TrainerOffload:
    """Moves a DDP-wrapped model's and its Megatron optimizer's device storages to host and back.

    Host buffers are pinned when CUDA is available (fast, asynchronous copies) and kept between
    steps in a pool by size, since pinning tens of GB each step would cost more than the copy.
    """

    def __init__(self, model, optimizer, device: torch.device, reference: torch.nn.Module | None = None):
        self.model, self.optimizer, self.reference = model, optimizer, reference
        self.device = torch.device(device)
        self._pin = torch.cuda.is_available()
        self._offloaded: dict[Part, list[tuple[torch.UntypedStorage, torch.Tensor]]] = {OPTIMIZER: [], PARAMS: []}
        self._host_pool: dict[int, list[torch.Tensor]] = {}

    def offloaded(self, part: Part) -> bool:
        return bool(self._offloaded[part])

    def _storages(self, part: Part) -> list[torch.UntypedStorage]:
        """The distinct resident device storages of ``part``, each once (views share one)."""
        params: dict[int, torch.UntypedStorage] = {}
        for tensor in _param_tensors(self.model):
            storage = tensor.untyped_storage()
            params.setdefault(storage.data_ptr(), storage)
        if part == PARAMS:
            chosen = params
        else:
            chosen = {}
            reference = self.reference.parameters() if self.reference is not None else ()
            for tensor in itertools.chain(_optimizer_tensors(self.model, self.optimizer), reference):
                storage = tensor.untyped_storage()
                if storage.data_ptr() not in params:
                    chosen.setdefault(storage.data_ptr(), storage)
        return [s for s in chosen.values() if s.nbytes() > 0 and s.device.type == self.device.type]

    def _host_buffer(self, nbytes: int) -> torch.Tensor:
        free = self._host_pool.get(nbytes)
        if free:
            return free.pop()
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=self._pin)

    def offload(self, part: Part) -> int:
        """Copy ``part``'s device storages to host and free them; the bytes moved (0 if already off)."""
        if self._offloaded[part]:
            return 0
        moved = []
        for storage in self._storages(part):
            host = self._host_buffer(storage.nbytes())
            host.copy_(_whole_storage_bytes(storage), non_blocking=self._pin)
            moved.append((storage, host))
        self._synchronize()  # the host copies are complete before the device memory is given away
        for storage, _ in moved:
            storage.resize_(0)
        self._offloaded[part] = moved
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # hand the freed blocks back to the driver, for the servers
        return sum(host.numel() for _, host in moved)

    def reload(self, part: Part | None = None) -> int:
        """Bring ``part``'s (None: every) offloaded storage back into the same storage objects; the bytes moved."""
        parts = (PARAMS, OPTIMIZER) if part is None else (part,)
        moved = 0
        for part in parts:
            for storage, host in self._offloaded[part]:
                storage.resize_(host.numel())
                _whole_storage_bytes(storage).copy_(host, non_blocking=self._pin)
                moved += host.numel()
        self._synchronize()  # the host buffers are not reused before their copies are done
        for part in parts:
            for _, host in self._offloaded[part]:
                self._host_pool.setdefault(host.numel(), []).append(host)
            self._offloaded[part] = []
        return moved

    def _synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
