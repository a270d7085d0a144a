"""Loading a Megatron distributed checkpoint without running anything it holds.

Three kinds of stored bytes are unpickled on a load, and each is read here without the code
execution that pickle allows:

- ``.metadata`` (torch distributed checkpoint's index, a plain pickle): read by a restricted
  unpickler (:mod:`~stapo_megatron.checkpoint.index_unpickler`), which admits only the names,
  opcodes and uses of them that a real index is made of, and then checked against itself and the
  files beside it (:mod:`~stapo_megatron.checkpoint.dcp_index`) before any data is read.
- the common (non-sharded) state: ``common.pt`` (written by megatron-core 0.16-0.18), or from
  0.19 on a sharded object ``common_state`` inside the ``__*.distcp`` files: either by
  ``torch.load(weights_only=True)`` (:func:`load_common_state`);
- sharded objects (the RNG states, Megatron's ``_extra_state`` entries), stored as byte items
  inside the ``__*.distcp`` files: ``torch.load(weights_only=True)``.

Megatron loads the index with ``pickle.load``, the sharded objects (and 0.19's common state) with
``torch.load(weights_only=False)``. 0.16 let a caller of ``dist_checkpointing.load`` choose the
common strategy; 0.17 removed that choice and 0.19 reads its common state object through torch's
default planner, so :func:`load` is ``dist_checkpointing.load``'s sequence of steps, composed of
Megatron's own helpers, with the common state read by :func:`load_common_state` and the sharded
state by :class:`SafeShardedLoadStrategy` (Megatron's :class:`TorchDistLoadShardedStrategy`
reading through :class:`SafeFileSystemReader` and :class:`SafeLoadPlanner`).
``tests/checkpoint/test_safe_load.py`` compares both with the installed release's own load.
``metadata.json`` is JSON and is checked by :func:`check_backend`. Every file is opened only if it
is a regular file (:mod:`stapo_megatron.checkpoint.files`). Every refusal is a one-line
:class:`ConfigError` naming the file.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import pickle
import re
from pathlib import Path
from typing import Any

import torch
from megatron.core.dist_checkpointing.core import CheckpointingException
from megatron.core.dist_checkpointing.dict_utils import merge
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, apply_factory_merges
from megatron.core.dist_checkpointing.state_dict_utils import load_preprocess
from megatron.core.dist_checkpointing.strategies import torch as mcore_torch
from megatron.core.dist_checkpointing.strategies.common import COMMON_STATE_FNAME
from megatron.core.dist_checkpointing.utils import extract_sharded_base, force_all_tensors_to_non_fp8
from megatron.core.dist_checkpointing.validation import (
    StrictHandling,
    determine_global_metadata,
    validate_integrity_and_strict_load,
)
from torch.distributed import checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner
from torch.futures import Future

from stapo_megatron.checkpoint.dcp_index import METADATA_FILE, first_line, read_dcp_metadata
from stapo_megatron.checkpoint.files import open_regular
from stapo_megatron.config import ConfigError
from stapo_megatron.runtime.megatron_fixes import megatron_release

CONFIG_FILE = "metadata.json"
# Megatron's metadata.json is a few hundred bytes.
MAX_CONFIG_BYTES = 1024**2
# megatron-core 0.19+ stores the common state as this sharded object (one shard) in the .distcp files.
COMMON_OBJECT = ShardedObject("common_state", None, (1,), (0,)).unique_key


def _weights_only_reason(err: BaseException) -> str:
    """The informative sentence of torch's multi-paragraph weights_only refusal."""
    text = str(err)
    named = re.search(r"GLOBAL ([\w.]+)", text)
    if named:
        return f"it refers to {named.group(1)}, which is not plain data (only tensors and plain Python data are loaded)"
    if "WeightsUnpickler error:" in text:
        text = text.split("WeightsUnpickler error:", 1)[1]
        text = text.split("Check the documentation", 1)[0]
    else:
        text = "" if text.startswith("Weights only load failed") else text
    reason = " ".join(text.split()).split(". ")[0].rstrip(".")
    return reason or first_line(err)


def load_stored_object(source: str | os.PathLike | io.BytesIO, name: str, map_location=None) -> Any:
    """``torch.load(weights_only=True)`` of bytes or of a regular file; a refusal or damage is a
    one-line ConfigError naming ``name``."""
    try:
        if isinstance(source, io.BytesIO):
            return torch.load(source, map_location=map_location, weights_only=True)
        with open_regular(source) as f:
            return torch.load(f, map_location=map_location, weights_only=True)
    except ConfigError:
        raise
    except pickle.UnpicklingError as err:
        raise ConfigError(f"{name}: refused to load: {_weights_only_reason(err)}") from None
    except FileNotFoundError:
        raise ConfigError(f"{name}: missing (not a complete distributed checkpoint)") from None
    except Exception as err:  # torch raises RuntimeError, EOFError, ... for damaged files
        raise ConfigError(f"{name}: not a readable torch file: {first_line(err)}") from None


def check_backend(directory: str | os.PathLike) -> None:
    """``metadata.json`` names the format the strategies here read (torch_dist + torch)."""
    path = Path(directory) / CONFIG_FILE
    try:
        with open_regular(path) as f:
            text = f.read(MAX_CONFIG_BYTES + 1)
        if len(text) > MAX_CONFIG_BYTES:
            raise ConfigError(f"{path}: more than {MAX_CONFIG_BYTES} bytes (not a Megatron checkpoint's)")
        config = json.loads(text.decode("utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"{path}: missing (not a Megatron distributed checkpoint)") from None
    except (ValueError, RecursionError) as err:
        raise ConfigError(f"{path}: not valid JSON ({first_line(err)})") from None
    # megatron-core 0.16-0.18 write common_backend torch (common.pt); 0.19 none (the common state is a sharded object)
    if (
        not isinstance(config, dict)
        or config.get("sharded_backend") != "torch_dist"
        or config.get("common_backend", "torch") != "torch"
    ):
        raise ConfigError(
            f"{path}: not a torch_dist checkpoint (this project reads sharded_backend torch_dist, with common_backend "
            "torch or none)"
        )


def common_state_source(directory: str | os.PathLike) -> str:
    """Where a checkpoint's common state is, as error messages name it: its ``common.pt`` where that
    exists (megatron-core 0.16-0.18; 0.19 also reads it first), else the object in the data files."""
    path = Path(directory) / COMMON_STATE_FNAME
    return str(path) if os.path.lexists(path) else f"{Path(directory)} (object {COMMON_OBJECT})"


def load_common_state(directory: str | os.PathLike) -> Any:
    """The common (non-sharded) state of a checkpoint of any tested release, by ``weights_only=True``:
    ``common.pt``, or else 0.19's ``common_state`` object, located through the checked index."""
    path = Path(directory) / COMMON_STATE_FNAME
    if os.path.lexists(path):
        return load_stored_object(path, str(path), map_location="cpu")
    metadata = read_dcp_metadata(Path(directory) / METADATA_FILE)
    stored = [info for index, info in metadata.storage_data.items() if index.fqn == COMMON_OBJECT]
    if len(stored) != 1:
        raise ConfigError(
            f"{directory}: holds no common state (neither {COMMON_STATE_FNAME} nor one object {COMMON_OBJECT}; not a "
            "complete distributed checkpoint)"
        )
    info = stored[0]
    data_file = Path(directory) / info.relative_path
    with open_regular(data_file) as f:  # the index was checked: the range lies inside the file
        f.seek(info.offset)
        data = f.read(info.length)
    name = f"{data_file} (object {COMMON_OBJECT})"
    wrapped = load_stored_object(io.BytesIO(data), name, map_location="cpu")
    if not isinstance(wrapped, list) or len(wrapped) != 1:  # Megatron stores a shard's objects as a list
        raise ConfigError(f"{name}: not a list of one object (damaged, or not written by megatron-core)")
    return wrapped[0]


class SafeFileSystemReader(FileSystemReader):
    """FileSystemReader whose metadata is read by :func:`read_dcp_metadata`, once (then cached)."""

    def __init__(self, path: str | os.PathLike):
        super().__init__(path)
        self._cached_metadata: Metadata | None = None
        self._reading: _StorageInfo | None = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        if rank is None and self._cached_metadata is not None:
            return self._cached_metadata
        name = METADATA_FILE if rank is None else f"__{rank}{METADATA_FILE}"
        metadata = read_dcp_metadata(Path(self.path) / name)
        storage_meta = getattr(metadata, "storage_meta", None)
        if storage_meta is None:
            storage_meta = metadata.storage_meta = StorageMeta()
        storage_meta.load_id = self.load_id
        if rank is None:
            self._cached_metadata = metadata
        return metadata

    def _slice_file(self, file, sinfo: _StorageInfo):
        self._reading = sinfo  # the item read_data is at, for an error naming its file
        return super()._slice_file(file, sinfo)

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """FileSystemReader.read_data, with a failure (damaged bytes, a stored tensor of another
        shape) as one line naming the data file and the item instead of torch's traceback."""
        self._reading = None
        try:
            return super().read_data(plan, planner)
        except ConfigError:
            raise
        except Exception as err:
            info = self._reading
            if info is None:
                raise ConfigError(f"{self.path}: cannot read its data: {first_line(err)}") from None
            end = info.offset + info.length
            raise ConfigError(
                f"{Path(self.path) / info.relative_path}: the item at bytes [{info.offset}, {end}) cannot be read "
                f"(damaged or not written for this index): {first_line(err)}"
            ) from None


class SafeLoadPlanner(mcore_torch.MCoreLoadPlanner):
    """Megatron's load planner with the byte items (sharded objects) read by ``weights_only=True``."""

    def __init__(self, *args, checkpoint_dir: str | os.PathLike, **kwargs):
        super().__init__(*args, **kwargs)
        self.checkpoint_dir = Path(checkpoint_dir)

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        info = self.metadata.storage_data.get(read_item.storage_index) if self.metadata else None
        where = self.checkpoint_dir / info.relative_path if info is not None else self.checkpoint_dir
        obj = load_stored_object(value, f"{where} (object {read_item.dest_index.fqn})")
        # As DefaultLoadPlanner.load_bytes, but with the object loaded above.
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


class SafeShardedLoadStrategy(mcore_torch.TorchDistLoadShardedStrategy):
    """The installed release's TorchDistLoadShardedStrategy, reading through the safe reader and planner."""

    def load(self, sharded_state_dict, checkpoint_dir, async_strategy: str = "mcore"):
        # The steps of TorchDistLoadShardedStrategy.load (0.16.1 to 0.19.2) with SafeFileSystemReader and
        # SafeLoadPlanner. ``async_strategy`` (0.17+) picks a cached metadata reader, which this never uses.
        flexible_shape_sharded_tensors = [
            sh_ten
            for sh_ten in mcore_torch.nested_values(sharded_state_dict)
            if isinstance(sh_ten, ShardedTensor) and not sh_ten.allow_shape_mismatch
        ]
        allow_shape_mismatch_sharded_tensors = {
            sh_ten.key: sh_ten
            for sh_ten in mcore_torch.nested_values(sharded_state_dict)
            if isinstance(sh_ten, ShardedTensor) and sh_ten.allow_shape_mismatch
        }
        orig_sharded_state_dict = sharded_state_dict
        sharded_state_dict, flat_mapping, rename_mapping = mcore_torch._replace_state_dict_keys_with_sharded_keys(
            sharded_state_dict
        )
        pyt_state_dict = mcore_torch.mcore_to_pyt_state_dict(sharded_state_dict, True)
        reader = SafeFileSystemReader(checkpoint_dir)
        reader.read_metadata()  # a refusal surfaces here as itself, not inside torch's collective wrapper
        release = megatron_release()
        options: dict[str, Any] = {}
        if release >= (0, 17):  # the state dict's nesting is kept as Megatron built it
            options.update(flatten_state_dict=False, flatten_sharded_tensors=False)
        if hasattr(self, "stream_ckpt_dequant"):  # 0.19: quantized tensors dequantized one at a time
            options["stream_ckpt_dequant"] = self.stream_ckpt_dequant
        planner = SafeLoadPlanner(
            shapes_validation_sharded_tensors=flexible_shape_sharded_tensors,
            allow_shape_mismatch_sharded_tensors=allow_shape_mismatch_sharded_tensors,
            checkpoint_dir=checkpoint_dir,
            **options,
        )
        if release >= (0, 18):  # each rank reads its own items, without collectives
            dcp.load(pyt_state_dict, reader, planner=planner, no_dist=True)
        else:
            dcp.load_state_dict(pyt_state_dict, reader, planner=planner)
        if getattr(self, "cache_metadata", True):  # 0.17+ keep it only when asked to
            self.cached_global_metadata = reader.read_metadata()
        mcore_state_dict = {k: mcore_torch._unwrap_pyt_sharded_tensor(v) for k, v in pyt_state_dict.items()}
        mcore_state_dict = mcore_torch._replace_sharded_keys_with_state_dict_keys(
            mcore_state_dict, flat_mapping, rename_mapping
        )
        mcore_torch._restore_dict_types(mcore_state_dict, orig_sharded_state_dict)
        return mcore_state_dict

    def load_tensors_metadata(self, checkpoint_dir, metadata: Metadata | None = None):
        if metadata is None:
            metadata = SafeFileSystemReader(checkpoint_dir).read_metadata()
        return super().load_tensors_metadata(checkpoint_dir, metadata)

    def load_sharded_metadata(self, checkpoint_dir):
        metadata = SafeFileSystemReader(checkpoint_dir).read_metadata()
        sharded_metadata = {}
        for key, storage_metadata in metadata.state_dict_metadata.items():
            if isinstance(storage_metadata, BytesStorageMetadata):
                sh_obj = ShardedObject.empty_from_unique_key(key)
                sharded_metadata[sh_obj.unique_key] = sh_obj
        sharded_metadata.update(self.load_tensors_metadata(checkpoint_dir, metadata))
        return sharded_metadata


def load(sharded_state_dict: dict, checkpoint_dir: str | os.PathLike) -> dict:
    """``dist_checkpointing.load(sharded_state_dict, checkpoint_dir)`` with its defaults (every
    shard read once, unexpected keys allowed), nothing stored unpickled unrestricted. Collective
    over the default process group, as Megatron's (its access-integrity check)."""
    strategy = SafeShardedLoadStrategy()
    if not getattr(strategy, "stream_ckpt_dequant", False):
        force_all_tensors_to_non_fp8(sharded_state_dict)
    sharded_state_dict, nonpersistent_state_dict, factories = load_preprocess(sharded_state_dict)
    common_state_dict = load_common_state(checkpoint_dir)
    if not isinstance(common_state_dict, dict) or not all(isinstance(k, str) for k in common_state_dict):
        raise ConfigError(f"{common_state_source(checkpoint_dir)}: holds no state dict with string keys")
    merge(common_state_dict, nonpersistent_state_dict)
    sharded_state_dict, _ = extract_sharded_base(sharded_state_dict)
    local_metadata, global_metadata = determine_global_metadata(sharded_state_dict)
    sharded_state_dict, _, _ = validate_integrity_and_strict_load(
        sharded_state_dict, StrictHandling.ASSUME_OK_UNEXPECTED, True, local_metadata, global_metadata
    )
    merge(common_state_dict, strategy.load(sharded_state_dict, checkpoint_dir))
    return apply_factory_merges(common_state_dict, factories)


@contextlib.contextmanager
def one_line_errors(directory: str | os.PathLike):
    """A refusal raised inside torch's distributed-checkpoint collectives comes out as itself, and
    Megatron's refusal of a checkpoint that does not fit the model asked for (a global shape or
    a key that differs: a checkpoint whose ``common.pt`` and tensors disagree, or another
    model's) as one line naming ``directory``."""
    try:
        yield
    except CheckpointException as err:
        for exc, _ in err.failures.values():
            if isinstance(exc, ConfigError):
                raise ConfigError(str(exc)) from None
        for exc, _ in err.failures.values():
            if isinstance(exc, CheckpointingException):
                raise _does_not_fit(directory, exc) from None
        raise
    except CheckpointingException as err:
        raise _does_not_fit(directory, err) from None


def _does_not_fit(directory: str | os.PathLike, err: Exception) -> ConfigError:
    reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    return ConfigError(f"{directory}: cannot be loaded into this model: {reason}")
