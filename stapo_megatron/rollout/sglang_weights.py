"""Pieces of SGLang weight sync that do not talk HTTP: expected names, serialization, the trainer's
end of a weight-update process group, and safetensors checkpoints for disk sync."""

from __future__ import annotations

import base64
import datetime
import io
import json
import os
import shutil
import socket
from collections.abc import Callable, Iterable, Sequence
from multiprocessing.reduction import ForkingPickler
from pathlib import Path
from typing import Any

import torch
from torch.multiprocessing import reductions

from stapo_megatron.rollout.sglang_client import SGLangWeightSyncError

NamedTensors = list[tuple[str, torch.Tensor]]
TensorSerializer = Callable[[NamedTensors], str]

_SHOW = 5  # names listed in an error message


def preview_names(names: Iterable[str]) -> str:
    names = sorted(names)
    more = f" (+{len(names) - _SHOW} more)" if len(names) > _SHOW else ""
    return ", ".join(names[:_SHOW]) + more


def expected_names_from_hf_checkpoint(model_path: str | os.PathLike) -> frozenset[str]:
    """The tensor names of a local Hugging Face safetensors checkpoint (what SGLang's loader accepts)."""
    path = Path(model_path)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        with open(index, encoding="utf-8") as f:
            return frozenset(json.load(f)["weight_map"])
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path} holds no model.safetensors.index.json and no *.safetensors file")
    from safetensors import safe_open

    names: set[str] = set()
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            names.update(f.keys())
    return frozenset(names)


class _IpcPickler(ForkingPickler):
    """``ForkingPickler`` with a dispatch table of its own for tensors and CPU storages, so no reducer
    of the process changes: SGLang's ``monkey_patch_torch_reductions`` does the same for every pickle
    of the process and breaks any later pickling of a CPU tensor (e.g. Megatron's checkpoint writer
    processes)."""

    def __init__(self, file):
        super().__init__(file)
        self.dispatch_table = {**self.dispatch_table, **_IPC_REDUCERS}


_CUDA_DEVICE_ARG = 6  # position of the device index in torch's rebuild_cuda_tensor arguments


def _reduce_tensor(tensor: torch.Tensor):
    """torch's own reduction; a CUDA tensor names its device by UUID, as SGLang's patched reducer sends
    it: each server process maps the UUID to its own index (its CUDA_VISIBLE_DEVICES may differ)."""
    reduce = getattr(reductions, "_reduce_tensor_original", reductions.reduce_tensor)  # unpatched if patched
    rebuild, args = reduce(tensor)
    if not tensor.is_cuda:
        return rebuild, args
    device = args[_CUDA_DEVICE_ARG] if len(args) > _CUDA_DEVICE_ARG else None
    if not isinstance(device, int):
        raise SGLangWeightSyncError(
            f"torch {torch.__version__} reduces a CUDA tensor without a device index at argument {_CUDA_DEVICE_ARG}; "
            "the IPC serializer does not know this torch"
        )
    uuid = str(torch.cuda.get_device_properties(device).uuid)
    return rebuild, (*args[:_CUDA_DEVICE_ARG], uuid, *args[_CUDA_DEVICE_ARG + 1 :])


def _reduce_cpu_storage(storage: torch.UntypedStorage):
    """A CPU storage as a shared-memory file (torch's ``file_system`` sharing, whatever strategy the process
    set): a server that is not this process's child can open it, a file descriptor it could not.

    The ``torch_shm_manager`` daemon this starts (once per process) ends by itself, removing any file
    left, about 2 s after its last client (this process, the servers that opened a file) is gone; it is
    not ended earlier, which would leave the files of live storages behind and make every later share
    of this process fail."""
    if storage.device.type != "cpu":
        raise SGLangWeightSyncError(f"cannot share a {storage.device.type} storage through CPU shared memory")
    if storage.size() == 0:
        return reductions.rebuild_storage_empty, (type(storage),)
    metadata = storage._share_filename_cpu_()
    # One reference per payload, for the one receiver that opens it (rebuild_storage_filename drops
    # it once its own mapping holds one), as torch's file_system reducer takes: without it, the first
    # receiver to close its mapping removed the file while the next server was still to open it.
    # A payload is therefore opened once: one per server TP rank, never reused.
    storage._shared_incref()
    return reductions.rebuild_storage_filename, (type(storage), *metadata)


_IPC_REDUCERS: dict[type, Callable[[Any], Any]] = {
    torch.Tensor: _reduce_tensor,
    torch.nn.Parameter: _reduce_tensor,
    torch.UntypedStorage: _reduce_cpu_storage,
}


def serialize_for_ipc(named_tensors: NamedTensors) -> str:
    """One ``serialized_named_tensors`` entry as SGLang's ``MultiprocessingSerializer.deserialize`` reads it
    (base64 of a ``ForkingPickler`` dump): CUDA IPC handles for GPU tensors, shared-memory files for CPU
    ones. The tensors must stay alive until the server answered; an entry is for one receiver."""
    buffer = io.BytesIO()
    _IpcPickler(buffer).dump(named_tensors)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def local_address_towards(host: str) -> str:
    """This machine's address on the route to ``host`` (a UDP connect sends no packet)."""
    if host in ("127.0.0.1", "localhost", "::1"):
        return host if host != "localhost" else "127.0.0.1"
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as sock:
        try:
            sock.connect((host, 9))
            return sock.getsockname()[0]
        except OSError:
            return socket.gethostbyname(socket.gethostname())


class WeightUpdateGroup:
    """The trainer's end (rank 0) of the process group SGLang servers join for weight broadcasts.

    The trainer hosts a TCPStore; each server rank joins with
    ``rendezvous(tcp://addr:port) -> PrefixStore(group_name) -> _new_process_group_helper`` (SGLang's
    ``init_custom_process_group``). Joining the same way on this side keeps the store keys identical.
    The group stays outside the trainer's default world: it is not a Megatron group.
    """

    def __init__(self, *, master_address: str, port: int, world_size: int, backend: str, timeout_s: float, name: str):
        import torch.distributed as dist

        if backend == "nccl" and dist.is_initialized():
            from torch.distributed.distributed_c10d import _get_default_group

            if getattr(_get_default_group(), "bound_device_id", None) is not None:
                # torch would build this group by ncclCommSplit of the trainer's world, which needs
                # every trainer rank and hangs; bail out with the reason instead.
                raise SGLangWeightSyncError(
                    "the trainer's default process group was created with device_id, so torch would split the "
                    "weight-update NCCL group from it and hang; init the default group without device_id or use "
                    "weight_sync 'tensor' or 'disk'"
                )
        self.name = name
        self.world_size = world_size
        self.backend = backend
        self.master_address = master_address
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.store: dist.TCPStore | None = dist.TCPStore(
            master_address, port, world_size, True, self.timeout, wait_for_workers=False
        )
        self.port = self.store.port
        self.pg = None

    def join(self) -> None:
        """Create rank 0's process group; blocks (gloo) until every server rank has joined too."""
        from torch.distributed.distributed_c10d import PrefixStore, _new_process_group_helper, _world

        assert self.store is not None, "join() after destroy()"
        pg, _ = _new_process_group_helper(
            self.world_size,
            0,
            [],
            self.backend,
            PrefixStore(self.name, self.store),
            group_name=self.name,  # type: ignore[arg-type]  # torch types it as its NewType GroupName of str
            timeout=self.timeout,
        )
        # Identity rank map, as SGLang registers on its side, so torch.distributed.broadcast(src=0) resolves.
        _world.pg_group_ranks[pg] = {i: i for i in range(self.world_size)}
        self.pg = pg

    def broadcast(self, tensors: Sequence[torch.Tensor]) -> list:
        """Start one broadcast per tensor from rank 0, in order; returns the async works."""
        import torch.distributed as dist

        return [dist.broadcast(t, src=0, group=self.pg, async_op=True) for t in tensors]

    def prepare(self, tensor: torch.Tensor) -> torch.Tensor:
        """The tensor as the backend can send it: contiguous, on the current GPU for NCCL."""
        tensor = tensor.detach()
        if self.backend == "nccl" and not tensor.is_cuda:
            tensor = tensor.to(torch.device("cuda", torch.cuda.current_device()))
        return tensor.contiguous()

    def destroy(self) -> None:
        import torch.distributed as dist

        if self.pg is not None:
            try:
                dist.destroy_process_group(self.pg)
            except Exception:  # noqa: BLE001 - a broken group must not block shutdown
                pass
            self.pg = None
        self.store = None


def write_bucket_file(path: Path, named_tensors: NamedTensors) -> None:
    """One bucket as one safetensors file (copied to CPU)."""
    from safetensors.torch import save_file

    # clone(): safetensors refuses tensors that share storage (views of one flat bucket, tied embeddings).
    save_file(
        {name: t.detach().to("cpu").clone().contiguous() for name, t in named_tensors},
        str(path),
        metadata={"format": "pt"},
    )


def publish_checkpoint(staging: Path, weight_map: dict[str, str], total_bytes: int, *, config_from: str | None) -> Path:
    """Write the index of the files in ``staging`` (a hidden ``.<tag>.partial`` directory) and rename it
    to ``<tag>``, so a server never reads a half-written checkpoint. Small JSON files (config.json, ...)
    are copied from ``config_from`` when it is a local directory, for loaders that want a whole HF
    directory."""
    with open(staging / "model.safetensors.index.json", "w", encoding="utf-8") as f:
        json.dump({"metadata": {"total_size": total_bytes}, "weight_map": weight_map}, f, indent=1, sort_keys=True)
    if config_from and Path(config_from).is_dir():
        for src in Path(config_from).glob("*.json"):
            if src.name != "model.safetensors.index.json":
                shutil.copy2(src, staging / src.name)
    final = staging.parent / staging.name.removeprefix(".").removesuffix(".partial")
    shutil.rmtree(final, ignore_errors=True)
    os.replace(staging, final)
    return final
