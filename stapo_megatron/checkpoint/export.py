"""Per-rank export of the Hugging Face tensors: every rank produces its own share, no rank gathers all.

Each pipeline stage exports its own layers. Within a stage, every parameter is gathered to ONE
tensor-parallel rank, its *owner* (chosen so that the TP ranks of the stage own about equal bytes),
which converts it to Hugging Face tensors; the other TP ranks only send their shard. The union of
all ranks' outputs is the full HF state dict, each name exactly once (tied embeddings come from
the first stage only). Data-parallel replicas each produce the whole dict; callers pick replicas.

The tensors come out in bounded flat buckets (:class:`FlatBucket`: one buffer per dtype and the
names, shapes and offsets inside it). A bucket's byte budget covers its contents plus the gather
buffer of the parameter being copied into it, so a rank that keeps at most two buckets alive (one
in flight, one being filled, see :func:`pipelined`) never holds more than its own shards plus two
buckets. The offline ``stapo convert`` export and the live weight sync share this iterator.
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, cast

import torch
import torch.distributed as dist

from stapo_megatron.models.qwen3.config import Qwen3Config, first_layer_of_stage
from stapo_megatron.models.qwen3.state_dict_adapter import (
    ParamMapping,
    gather_dim,
    hf_tensor_shapes,
    param_mappings,
    to_hf,
)

if TYPE_CHECKING:
    from megatron.core.models.gpt import GPTModel

DEFAULT_BUCKET_BYTES = 512 * 1024**2

# Called with every buffer the export allocates (bucket buffers, gather buffers); tests and the
# benchmark measure live bytes with it.
AllocationProbe = Callable[[torch.Tensor], None]


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    count = 1
    for dim in shape:
        count *= dim
    return count * dtype.itemsize


def unwrap(model: torch.nn.Module) -> GPTModel:
    """The GPTModel inside Megatron's DDP / Float16Module wrappers."""
    while hasattr(model, "module") and not hasattr(model, "decoder"):
        model = cast(torch.nn.Module, model.module)  # nn.Module.__getattr__ is typed Tensor | Module
    return model


def stage_layer_offset(model: torch.nn.Module) -> int:
    """Index of this stage's first decoder layer in the whole model (the trainer's pipeline split)."""
    gpt = unwrap(model)
    return first_layer_of_stage(
        gpt.config.num_layers, gpt.config.pipeline_model_parallel_size, gpt.pg_collection.pp.rank()
    )


@dataclasses.dataclass(frozen=True)
class ExportEntry:
    """One Megatron parameter of the stage and the HF tensors its owner produces from it."""

    mapping: ParamMapping
    owner: int  # TP rank that gathers and converts it
    tensors: tuple[tuple[str, tuple[int, ...], torch.dtype], ...]  # (HF name, shape, output dtype)
    staging_bytes: int  # the owner's gather buffer plus the largest copy a conversion makes (0: none)

    @property
    def nbytes(self) -> int:
        return sum(_nbytes(shape, dtype) for _, shape, dtype in self.tensors)


def _exported(mapping: ParamMapping, arch: Qwen3Config) -> bool:
    # With tied embeddings the last stage's output layer is a copy; the first stage exports the original.
    return not (mapping.megatron_name == "output_layer.weight" and arch.tie_word_embeddings)


def stage_export_plan(
    model: torch.nn.Module, arch: Qwen3Config, tp_size: int, dtype: torch.dtype | None = None
) -> list[ExportEntry]:
    """Every parameter this stage exports with its owner, in export order; the same on each TP rank.

    Owners are assigned greedily to the TP rank with the fewest bytes so far, so the TP ranks of a
    stage produce about equal shares.
    """
    model = unwrap(model)
    shapes = hf_tensor_shapes(arch)
    params = dict(model.named_parameters())
    load = [0] * tp_size
    plan = []
    for mapping in param_mappings(model, arch, stage_layer_offset(model)):
        if not _exported(mapping, arch):
            continue
        param = params[mapping.megatron_name]
        out_dtype = dtype or param.dtype
        tensors = tuple((name, shapes[name], out_dtype) for name in mapping.hf_names)
        gathered = tp_size > 1 and mapping.layout != "replicated"
        shard_bytes = param.numel() * param.element_size()
        owner = min(range(tp_size), key=lambda r: (load[r], r))
        staging = tp_size * shard_bytes if gathered else 0
        if gathered and _gathers_in_place(mapping, param.dtype, out_dtype):
            # Shards land in the bucket itself. The last TP rank owns it: its own shard is the one that
            # reaches into the vocabulary padding, copied locally; any other such shard needs a buffer.
            owner = tp_size - 1
            rows = param.shape[0]
            staging = shard_bytes * len(_partial_shards(tp_size, rows, shapes[mapping.hf_names[0]][0], owner))
        if mapping.layout in ("qkv", "gate_up"):
            # Splitting q/k/v or gate/up out of the fused tensor copies one part at a time.
            staging += max(_nbytes(shapes[name], param.dtype) for name in mapping.hf_names)
        entry = ExportEntry(mapping, owner, tensors, staging)
        load[owner] += entry.nbytes
        plan.append(entry)
    return plan


# ---- buckets ----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class TensorSlot:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # in elements of ``dtype``, inside that dtype's buffer

    @property
    def numel(self) -> int:
        count = 1
        for dim in self.shape:
            count *= dim
        return count


@dataclasses.dataclass(frozen=True)
class BucketLayout:
    """Where each tensor of one bucket sits: picklable metadata, the same on sender and receiver."""

    index: int
    slots: tuple[TensorSlot, ...]

    @property
    def names(self) -> list[str]:
        return [slot.name for slot in self.slots]

    def sizes(self) -> dict[torch.dtype, int]:
        """Elements of each dtype's flat buffer, in first-seen dtype order."""
        sizes: dict[torch.dtype, int] = {}
        for slot in self.slots:
            sizes[slot.dtype] = max(sizes.get(slot.dtype, 0), slot.offset + slot.numel)
        return sizes

    @property
    def nbytes(self) -> int:
        return sum(count * dtype.itemsize for dtype, count in self.sizes().items())


@dataclasses.dataclass
class FlatBucket:
    """A bucket's tensors packed in one flat buffer per dtype."""

    layout: BucketLayout
    buffers: dict[torch.dtype, torch.Tensor]

    @classmethod
    def allocate(cls, layout: BucketLayout, device: torch.device) -> FlatBucket:
        return cls(
            layout, {dtype: torch.empty(count, dtype=dtype, device=device) for dtype, count in layout.sizes().items()}
        )

    def view(self, slot: TensorSlot) -> torch.Tensor:
        return self.buffers[slot.dtype][slot.offset : slot.offset + slot.numel].view(slot.shape)

    def named_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """(name, view into the flat buffer): no copies, every view shares the bucket's storage."""
        return [(slot.name, self.view(slot)) for slot in self.layout.slots]

    @property
    def nbytes(self) -> int:
        return self.layout.nbytes


def plan_buckets(
    plan: list[ExportEntry], tp_rank: int, bucket_bytes: int
) -> list[tuple[BucketLayout, list[ExportEntry]]]:
    """Cut this rank's owned entries, in order, into buckets of at most ``bucket_bytes``.

    A bucket's buffer is allocated whole before its first parameter is gathered, so the budget covers
    its contents plus the largest staging (gather buffer, conversion copy) of its parameters; an
    entry that alone exceeds the budget gets a bucket of its own.
    """
    buckets: list[tuple[BucketLayout, list[ExportEntry]]] = []
    slots: list[TensorSlot] = []
    entries: list[ExportEntry] = []
    filled = staging = 0
    offsets: dict[torch.dtype, int] = {}

    def close() -> None:
        nonlocal slots, entries, filled, staging, offsets
        if slots:
            buckets.append((BucketLayout(len(buckets), tuple(slots)), entries))
        slots, entries, filled, staging, offsets = [], [], 0, 0, {}

    for entry in plan:
        if entry.owner != tp_rank:
            continue
        if entries and filled + entry.nbytes + max(staging, entry.staging_bytes) > bucket_bytes:
            close()
        staging = max(staging, entry.staging_bytes)
        for name, shape, dtype in entry.tensors:
            slot = TensorSlot(name, dtype, tuple(shape), offsets.get(dtype, 0))
            offsets[dtype] = slot.offset + slot.numel
            slots.append(slot)
        entries.append(entry)
        filled += entry.nbytes
    close()
    return buckets


# ---- the per-rank iterator ---------------------------------------------------------------------


def _gathers_in_place(mapping: ParamMapping, param_dtype: torch.dtype, out_dtype: torch.dtype) -> bool:
    """The HF tensor is the TP shards stacked in order (the embedding and output layer): gather into the bucket."""
    return mapping.layout == "vocab" and param_dtype == out_dtype


def _partial_shards(tp_size: int, rows: int, vocab: int, owner: int) -> list[int]:
    """TP ranks other than the owner whose shard holds both vocabulary rows and padding rows."""
    return [r for r in range(tp_size) if r != owner and r * rows < vocab < (r + 1) * rows]


@torch.no_grad()
def _exchange_rows(
    bucket: FlatBucket | None,
    position: int,
    local: torch.Tensor,
    entry: ExportEntry,
    ctx,
    vocab: int,
    probe: AllocationProbe | None,
) -> None:
    """A row-split parameter whose HF tensor is its shards in order, received straight into the owner's
    bucket slot (point to point over the TP group); padding rows never leave their rank."""
    rows = local.shape[0]
    owner = dist.get_global_rank(ctx.tp_group, entry.owner)
    if entry.owner != ctx.tp_rank:
        if ctx.tp_rank * rows < vocab:
            dist.send(local.contiguous(), dst=owner, group=ctx.tp_group)
        return
    assert bucket is not None, "the owner allocates its bucket before its first entry"
    target = bucket.view(bucket.layout.slots[position])
    for r in range(ctx.tp_size):
        start = r * rows
        valid = min(rows, vocab - start)
        if valid <= 0:
            continue
        if r == ctx.tp_rank:
            target[start : start + valid].copy_(local[:valid])
        elif valid == rows:
            dist.recv(target[start : start + rows], src=dist.get_global_rank(ctx.tp_group, r), group=ctx.tp_group)
        else:
            spare = local.new_empty(local.shape)
            if probe is not None:
                probe(spare)
            dist.recv(spare, src=dist.get_global_rank(ctx.tp_group, r), group=ctx.tp_group)
            target[start:].copy_(spare[:valid])


@torch.no_grad()
def _gather_to_owner(
    local: torch.Tensor, entry: ExportEntry, ctx, probe: AllocationProbe | None
) -> torch.Tensor | None:
    """The TP-gathered full Megatron tensor on the entry's owner, None elsewhere (collective over the TP group)."""
    if ctx.tp_size == 1 or entry.mapping.layout == "replicated":
        return local if entry.owner == ctx.tp_rank else None
    owner_rank = dist.get_global_rank(ctx.tp_group, entry.owner)
    if entry.owner != ctx.tp_rank:
        dist.gather(local.contiguous(), None, dst=owner_rank, group=ctx.tp_group)
        return None
    # One buffer for all shards, gathered into its rows: no list of separately allocated shards.
    stacked = local.new_empty((ctx.tp_size, *local.shape))
    if probe is not None:
        probe(stacked)
    dist.gather(local.contiguous(), list(stacked.unbind(0)), dst=owner_rank, group=ctx.tp_group)
    if gather_dim(entry.mapping) == 1:
        # (rows, tp, cols): the shards side by side, copied into the bucket without a transposed copy.
        return stacked.transpose(0, 1)
    return stacked.reshape(ctx.tp_size * local.shape[0], *local.shape[1:])


@torch.no_grad()
def iter_rank_buckets(
    model: torch.nn.Module,
    arch: Qwen3Config,
    ctx,
    *,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    dtype: torch.dtype | None = None,
    probe: AllocationProbe | None = None,
) -> Iterator[FlatBucket]:
    """This rank's share of the HF state dict, in flat buckets on ``ctx.device``.

    Collective over ``ctx.tp_group``: every TP rank of the stage must exhaust it (a rank that owns
    nothing still sends its shards). A yielded bucket is the caller's; the next one is allocated
    only when the caller asks for it.
    """
    model = unwrap(model)
    params = dict(model.named_parameters())
    plan = stage_export_plan(model, arch, ctx.tp_size, dtype)
    layouts = iter(plan_buckets(plan, ctx.tp_rank, bucket_bytes))
    layout, owned = next(layouts, (None, []))
    bucket: FlatBucket | None = None
    position = 0  # next slot of the current bucket
    for entry in plan:
        local = params[entry.mapping.megatron_name].detach()
        if entry.owner == ctx.tp_rank and bucket is None:
            assert layout is not None, "plan_buckets gives every owned entry a bucket"
            bucket = FlatBucket.allocate(layout, local.device)
            if probe is not None:
                for buffer in bucket.buffers.values():
                    probe(buffer)
        if ctx.tp_size > 1 and _gathers_in_place(entry.mapping, local.dtype, entry.tensors[0][2]):
            _exchange_rows(bucket, position, local, entry, ctx, entry.tensors[0][1][0], probe)
            if entry.owner != ctx.tp_rank:
                continue
            position += 1
        else:
            full = _gather_to_owner(local, entry, ctx, probe)
            if full is None:
                continue
            assert bucket is not None  # full is only returned to the owner, which allocated the bucket above
            position = _copy_into(bucket, position, entry, full, arch, ctx.tp_size, probe)
            del full  # the gather buffer goes before the bucket is handed out
        if entry is owned[-1]:
            assert bucket is not None  # owned lists this rank's entries only
            yield bucket
            bucket, position = None, 0
            layout, owned = next(layouts, (None, []))


def _copy_into(
    bucket: FlatBucket,
    position: int,
    entry: ExportEntry,
    full: torch.Tensor,
    arch: Qwen3Config,
    tp_size: int,
    probe: AllocationProbe | None,
) -> int:
    """Convert one gathered parameter straight into its bucket slots; returns the next slot."""
    for name, tensor in to_hf(entry.mapping, full, arch, tp_size):
        slot = bucket.layout.slots[position]
        if slot.name != name:
            raise RuntimeError(f"export plan out of step: {name} arrived where {slot.name} was planned")
        if probe is not None and not tensor._is_view() and tensor is not full:
            probe(tensor)  # a conversion that had to copy
        target = bucket.view(slot)
        if tensor.dim() > target.dim():  # a row-parallel weight as (rows, tp, cols): the shards side by side
            target = target.view(tensor.shape)
        target.copy_(tensor)
        position += 1
    return position


def rank_export_names(model: torch.nn.Module, arch: Qwen3Config, tp_size: int, tp_rank: int) -> list[str]:
    """The HF names :func:`iter_rank_buckets` yields on this rank, in order (no communication)."""
    return [
        name
        for entry in stage_export_plan(model, arch, tp_size)
        if entry.owner == tp_rank
        for name, _, _ in entry.tensors
    ]


def pipelined(buckets: Iterable[FlatBucket], send: Callable[[FlatBucket], None]) -> int:
    """``send`` every bucket on a worker thread while the next one is prepared (a one-deep pipeline).

    At most two buckets are alive: the one in flight and the one being filled; a bucket is
    released as soon as its send returned. Returns the number of buckets sent.
    """

    def send_from(box: list[FlatBucket]) -> None:
        # The bucket travels in a box emptied here: the executor keeps its arguments until after the
        # result is set, which would let a third bucket be allocated while this one is still referenced.
        send(box.pop())

    count = 0
    with cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="stapo-bucket-send") as pool:
        in_flight: cf.Future | None = None
        try:
            for bucket in buckets:
                if in_flight is not None:
                    in_flight.result()
                in_flight = pool.submit(send_from, [bucket])
                del bucket
                count += 1
            if in_flight is not None:
                in_flight.result()
        except BaseException:
            if in_flight is not None:
                cf.wait([in_flight])
            raise
    return count
