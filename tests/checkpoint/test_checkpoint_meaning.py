"""A checkpoint is checked for meaning as well as bytes: the torch index against itself and its data
files before any data is read, the restricted unpickler admitting only what a real index does with
what it names, ``common.pt`` field by field, and checkpoints from before checksums refused in the
same one line. Each crafted file has its checksums recomputed, so integrity does not catch it first."""

from __future__ import annotations

import importlib
import pickle
import random
import re
import subprocess
import sys

import numpy as np
import pytest
import torch
from torch.distributed.checkpoint.metadata import MetadataIndex

from stapo_megatron.checkpoint import dcp_index, index_unpickler
from stapo_megatron.checkpoint.convert import convert_megatron_to_hf, read_meta
from stapo_megatron.checkpoint.dist import common_field
from stapo_megatron.config import ConfigError
from tests.checkpoint.crafted import (
    drop_checksums,
    read_common,
    read_metadata,
    rehash,
    replace_tensor,
    write_common,
    write_metadata,
)

EMBEDDING = "embedding.word_embeddings.weight"  # [256, 128] float32, two chunks of 128 rows (TP=2)


def _one_line(err) -> str:
    message = str(err.value)
    assert "\n" not in message.strip(), message
    return message


def _chunks(metadata):
    return metadata.state_dict_metadata[EMBEDDING].chunks


def _storage(metadata, chunk: int):
    return metadata.storage_data[MetadataIndex(EMBEDDING, _chunks(metadata)[chunk].offsets)]


def _edit_index(checkpoint, edit) -> None:
    metadata = read_metadata(checkpoint)
    edit(metadata)
    write_metadata(checkpoint, metadata)
    rehash(checkpoint)


def _set(obj, **fields):
    for name, value in fields.items():
        setattr(obj, name, value)


# ---- the index against itself and its data files ------------------------------------------------


def test_stapo_convert_refuses_chunks_outside_the_tensor(checkpoint, tmp_path):
    """The issue's attack: exit 0 and an all-zero embedding."""
    _edit_index(checkpoint, lambda m: _set(_chunks(m)[0], sizes=torch.Size([-5, 10**12])))
    out = tmp_path / "hf"
    command = ["convert", "megatron-to-hf", "--ckpt", str(checkpoint), "--out", str(out)]
    result = subprocess.run(
        [sys.executable, "-m", "stapo_megatron.cli", *command], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 2, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("stapo: error: ")]
    assert len(errors) == 1, result.stderr
    assert (
        f"{checkpoint}/.metadata: not a valid checkpoint index: {EMBEDDING}: a chunk at offsets [0, 0] of sizes "
        "[-5, 1000000000000], not non-negative integers inside its size [256, 128]" in errors[0]
    )
    assert "Traceback" not in result.stderr
    assert not out.exists()


INDEX_DAMAGE = {
    "size-past-the-tensor": (
        lambda m: _set(_chunks(m)[1], sizes=torch.Size([200, 128])),
        r"a chunk at offsets \[128, 0\] of sizes \[200, 128\], not non-negative integers inside its size \[256, 128\]",
    ),
    "another-rank": (
        lambda m: _set(_chunks(m)[0], sizes=torch.Size([128])),
        r"a chunk at offsets \[0, 0\] of sizes \[128\], not non-negative",
    ),
    "overlap": (lambda m: _set(_chunks(m)[1], offsets=torch.Size([64, 0])), r"chunks overlap at element \[64, 0\]"),
    "gap": (lambda m: _set(_chunks(m)[1], sizes=torch.Size([100, 128])), r"no chunk holds element \[228, 0\]"),
    "chunk-removed": (lambda m: _chunks(m).pop(), r"no chunk holds element \[128, 0\]"),
    "tensor-grown": (
        lambda m: _set(m.state_dict_metadata[EMBEDDING], size=torch.Size([512, 128])),
        r"no chunk holds element \[256, 0\] of its size \[512, 128\]",
    ),
    "dtype-changed": (
        lambda m: _set(m.state_dict_metadata[EMBEDDING].properties, dtype=torch.float64),
        rf"{EMBEDDING} at \[0, 0\] is stored in \d+ bytes, but its chunk holds 131072 bytes of data",
    ),
    "dtype-not-a-dtype": (
        lambda m: _set(m.state_dict_metadata[EMBEDDING].properties, dtype="float32"),
        rf"malformed entry for {EMBEDDING}",
    ),
    "no-storage-entry": (
        lambda m: m.storage_data.pop(MetadataIndex(EMBEDDING, torch.Size([128, 0]))),
        rf"{EMBEDDING} at \[128, 0\] has no storage entry",
    ),
    "unlisted-storage-entry": (
        lambda m: m.storage_data.__setitem__(MetadataIndex("decoder.extra", torch.Size([0, 0])), _storage(m, 0)),
        r"a storage entry for decoder\.extra at \[0, 0\], which the index does not list",
    ),
    "shared-bytes": (
        lambda m: _set(_storage(m, 1), relative_path=_storage(m, 0).relative_path, offset=_storage(m, 0).offset),
        rf"{EMBEDDING} and {EMBEDDING} share bytes of __\d_\d\.distcp",
    ),
    "past-the-file": (
        lambda m: _set(_storage(m, 0), offset=10**9),
        rf"__\d_\d\.distcp: \d+ bytes, but \.metadata stores {EMBEDDING} at bytes \[1000000000, \d+\) \(truncated",
    ),
    "missing-file": (
        lambda m: _set(_storage(m, 0), relative_path="__9_9.distcp"),
        rf"{EMBEDDING} is stored in __9_9\.distcp, which is missing",
    ),
    "transforms": (
        lambda m: _set(_storage(m, 0), transform_descriptors=["zstd"]),
        r"is stored through transforms \(compression\), which stapo never writes",
    ),
}


@pytest.mark.parametrize("kind", list(INDEX_DAMAGE))
def test_an_index_inconsistent_with_itself_or_its_files_is_refused(checkpoint, kind):
    edit, message = INDEX_DAMAGE[kind]
    _edit_index(checkpoint, edit)
    with pytest.raises(ConfigError, match=message) as err:
        dcp_index.read_dcp_metadata(checkpoint / ".metadata")
    assert _one_line(err).startswith(str(checkpoint))


def _brute_force_tiles(boxes, shape) -> bool:
    counts = np.zeros(shape, dtype=np.int64)
    for start, end in boxes:
        counts[tuple(slice(s, e) for s, e in zip(start, end))] += 1
    return bool((counts == 1).all())


def _partition(low, high, rng, depth=6):
    """A random exact cover of the box [low, high) by cuts, not always on a grid."""
    dims = [d for d in range(len(low)) if high[d] - low[d] > 1]
    if not dims or depth == 0 or rng.random() < 0.3:
        return [(tuple(low), tuple(high))]
    d = rng.choice(dims)
    cut = rng.randrange(low[d] + 1, high[d])
    return _partition(low, [*high[:d], cut, *high[d + 1 :]], rng, depth - 1) + _partition(
        [*low[:d], cut, *low[d + 1 :]], high, rng, depth - 1
    )


def test_the_cover_check_agrees_with_counting_every_element():
    rng = random.Random(0)
    verdicts = set()
    for _ in range(2000):
        shape = tuple(rng.randint(1, 6) for _ in range(rng.randint(1, 3)))
        boxes = _partition([0] * len(shape), list(shape), rng)
        change = rng.random()
        if change < 0.3 and len(boxes) > 1:
            boxes.pop(rng.randrange(len(boxes)))
        elif change < 0.6:
            start = tuple(rng.randrange(0, n) for n in shape)
            boxes.append((start, tuple(rng.randint(s + 1, n) for s, n in zip(start, shape))))
        tiles = _brute_force_tiles(boxes, shape)
        assert (dcp_index.tiling_error(boxes, shape) is None) == tiles, (shape, boxes)
        verdicts.add(tiles)
    assert verdicts == {True, False}


def test_the_cover_check_is_cheap_for_real_layouts_and_bounded_for_others():
    # 94 layers x 128 experts x 8 tensor-parallel shards of a [94, 128, 8 * 10**9] tensor: no element is visited
    width = 10**9
    shape = (94, 128, 8 * width)
    grid = [
        ((i, e, r * width), (i + 1, e + 1, (r + 1) * width)) for i in range(94) for e in range(128) for r in range(8)
    ]
    assert dcp_index.tiling_error(grid, shape) is None
    assert "overlap at element [93, 127, 7000000000]" in str(dcp_index.tiling_error(grid + [grid[-1]], shape))
    # a valid cover no writer makes, crafted to make a sweep quadratic: refused in bounded time
    n = 3000
    odd = [((0, j), (n, j + 1)) for j in range(n)] + [((i, n), (i + 1, n + 1)) for i in range(n)]
    assert "too irregularly to check" in dcp_index.tiling_error(odd, (n, n + 1))


# ---- the restricted unpickler: no BUILD on what it did not make ---------------------------------

# The 16 names a real index refers to (torch 2.13, megatron-core 0.16.1), as the issue counted them.
ADMITTED = [
    ("torch.distributed.checkpoint.metadata", name)
    for name in (
        "Metadata",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "MetadataIndex",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    )
] + [
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.distributed.checkpoint.planner", "SavePlan"),
    ("torch.distributed.checkpoint.planner", "WriteItem"),
    ("torch.distributed.checkpoint.planner", "WriteItemType"),
    ("torch.distributed.checkpoint.planner", "TensorWriteData"),
    ("torch.distributed.checkpoint.planner", "BytesIOWriteData"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
]


def _build_on_global(module: str, name: str) -> bytes:
    """A pickle that takes ``module.name`` itself and BUILDs it with slot state {stapo_pwned: True}:
    setattr on the class (or function) for the rest of the process, under a plain unpickler."""

    def text(value: str) -> bytes:
        return pickle.SHORT_BINUNICODE + bytes([len(value)]) + value.encode()

    state = pickle.NONE + pickle.EMPTY_DICT + text("stapo_pwned") + pickle.NEWTRUE + pickle.SETITEM + pickle.TUPLE2
    return pickle.PROTO + b"\x04" + text(module) + text(name) + pickle.STACK_GLOBAL + state + pickle.BUILD + pickle.STOP


def test_build_on_an_admitted_class_is_refused_and_changes_nothing(tmp_path):
    assert {(m, n) for m, n in ADMITTED} == index_unpickler.METADATA_GLOBALS
    index = tmp_path / ".metadata"
    changed, messages = [], {}
    for module, name in ADMITTED:
        target = getattr(importlib.import_module(module), name)
        before = dict(vars(target))
        index.write_bytes(_build_on_global(module, name))
        try:
            dcp_index.read_dcp_metadata(index)
        except ConfigError as err:
            messages[name] = str(err)
        finally:
            if vars(target) != before:
                changed.append(name)
                delattr(target, "stapo_pwned")  # leave the process as it was for the other tests
    assert not changed
    for _, name in ADMITTED:
        refusal = rf".*/\.metadata: refused to load: BUILD on [\w. ]*{name}, which .*"
        assert re.fullmatch(refusal, messages.get(name, "")), name


def test_what_a_real_index_holds_is_all_admitted(trained_run):
    # every opcode, name and use of it in a checkpoint this project writes loads (the list above is complete)
    metadata = dcp_index.read_dcp_metadata(trained_run / "checkpoints" / "iter_0000002" / ".metadata")
    assert len(metadata.all_local_plans) == 2  # Megatron's save plans, one per rank


# ---- common.pt, field by field -------------------------------------------------------------------


# how a refusal names the common state: common.pt, or (megatron-core 0.19) its object in a .distcp file
COMMON_SOURCE = r"(common\.pt|\(object common_state/shard_0_1\))"


def _edit_common(checkpoint, edit) -> None:
    common = read_common(checkpoint)
    edit(common)
    write_common(checkpoint, common)
    rehash(checkpoint)


def _arch(common) -> dict:
    return common["stapo"]["arch"]


COMMON_DAMAGE = {
    "keys-not-strings": (
        lambda c: c.__setitem__(7, "x"),
        COMMON_SOURCE + r": holds a dict with keys that are not strings, not a state dict",
    ),
    "dtype-a-number": (
        lambda c: c["stapo"].__setitem__("params_dtype", 5),
        COMMON_SOURCE + r": field stapo\.params_dtype is an integer, not a string",
    ),
    "dtype-unknown": (
        lambda c: c["stapo"].__setitem__("params_dtype", "float33"),
        COMMON_SOURCE + r": field stapo\.params_dtype is 'float33', not a torch dtype",
    ),
    "width-a-string": (
        lambda c: _arch(c).__setitem__("hidden_size", "128"),
        COMMON_SOURCE + r": field stapo\.arch\.hidden_size is a string, not an integer",
    ),
    "width-zero": (
        lambda c: _arch(c).__setitem__("hidden_size", 0),
        COMMON_SOURCE + r": field stapo\.arch\.hidden_size: must be >= 1, got 0",
    ),
    "layers-missing": (
        lambda c: _arch(c).pop("num_hidden_layers"),
        COMMON_SOURCE + r": field stapo\.arch\.num_hidden_layers is missing",
    ),
    "tie-a-string": (
        lambda c: _arch(c).__setitem__("tie_word_embeddings", "no"),
        COMMON_SOURCE + r": field stapo\.arch\.tie_word_embeddings is a string, not a bool",
    ),
    "arch-a-list": (
        lambda c: c["stapo"].__setitem__("arch", [1, 2]),
        COMMON_SOURCE + r": field stapo\.arch is a list, not a dict",
    ),
    "format": (
        lambda c: c["stapo"].__setitem__("format", 2),
        COMMON_SOURCE + r": field stapo\.format is 2; this stapo reads format 1",
    ),
}


@pytest.mark.parametrize("kind", list(COMMON_DAMAGE))
def test_a_common_state_of_the_wrong_shape_names_the_field(checkpoint, kind):
    edit, message = COMMON_DAMAGE[kind]
    _edit_common(checkpoint, edit)
    with pytest.raises(ConfigError, match=message) as err:
        read_meta(checkpoint)  # the path of stapo convert, stapo eval and the config checks
    assert _one_line(err).startswith(str(checkpoint))


def test_stapo_convert_refuses_a_mistyped_architecture_before_any_rank_starts(checkpoint, tmp_path):
    """A string width: a TypeError traceback on every rank."""
    _edit_common(checkpoint, lambda c: _arch(c).__setitem__("hidden_size", "128"))
    with pytest.raises(ConfigError, match=r"field stapo\.arch\.hidden_size is a string") as err:
        convert_megatron_to_hf(checkpoint, tmp_path / "hf", tp=2, pp=1)
    _one_line(err)
    assert not (tmp_path / "hf").exists()


def test_a_common_state_that_does_not_fit_the_tensors_is_one_line(checkpoint, tmp_path):
    """Three layers in common.pt, two in the tensors: a CheckpointingException traceback from every rank."""
    _edit_common(checkpoint, lambda c: _arch(c).__setitem__("num_hidden_layers", 3))
    with pytest.raises(ConfigError, match=rf"^{checkpoint}: cannot be loaded into this model: Global shape mismatch"):
        convert_megatron_to_hf(checkpoint, tmp_path / "hf", tp=2, pp=1)
    assert not (tmp_path / "hf").exists()


def test_common_field_names_source_and_field():
    progress = {"step": "7", "skipped": True, "lr": 3, "sampler": {1: 2}}
    source = "ckpt/common.pt"
    assert common_field(progress, "lr", float, source, "progress.lr") == 3
    for key, kind, message in [
        ("step", int, "field progress.step is a string, not an integer"),
        ("skipped", int, "field progress.skipped is a bool, not an integer"),
        ("sampler", dict, "field progress.sampler is a dict with keys that are not strings"),
        ("absent", (dict, type(None)), "field progress.absent is missing"),
    ]:
        with pytest.raises(ConfigError, match=rf"^ckpt/common\.pt: {message}"):
            common_field(progress, key, kind, source, f"progress.{key}")


# ---- checkpoints from before checksums: the same one-line errors --------------------------------


def test_a_truncated_data_file_of_a_checkpoint_from_before_checksums_is_one_line(checkpoint, tmp_path):
    """Cut inside the embedding's bytes: an EOFError traceback from the rank."""
    drop_checksums(checkpoint)
    info = _storage(read_metadata(checkpoint), 1)
    data = checkpoint / info.relative_path
    data.write_bytes(data.read_bytes()[: info.offset + info.length - 100])
    with pytest.raises(
        ConfigError, match=rf"/{info.relative_path}: \d+ bytes, but \.metadata stores {EMBEDDING} at .* \(truncated"
    ) as err:
        convert_megatron_to_hf(checkpoint, tmp_path / "hf", tp=1, pp=1)
    _one_line(err)
    assert not (tmp_path / "hf").exists()


def test_a_damaged_item_is_one_line_and_the_previous_export_stays(checkpoint, tmp_path):
    """A flipped byte in a stored tensor's framing, where no checksum can tell: a RuntimeError
    traceback from the rank. The export it was to replace stays as it was."""
    out = convert_megatron_to_hf(checkpoint, tmp_path / "hf", tp=1, pp=1)
    before = {path.name: path.read_bytes() for path in out.iterdir()}
    drop_checksums(checkpoint)
    info = _storage(read_metadata(checkpoint), 0)
    data = checkpoint / info.relative_path
    raw = bytearray(data.read_bytes())
    raw[info.offset] ^= 0xFF  # the zip signature torch.save starts each item with
    data.write_bytes(bytes(raw))
    span = rf"\[{info.offset}, {info.offset + info.length}\)"
    with pytest.raises(ConfigError, match=rf"/{info.relative_path}: the item at bytes {span} cannot be read") as err:
        convert_megatron_to_hf(checkpoint, out, tp=1, pp=1, overwrite=True)
    _one_line(err)
    assert {path.name: path.read_bytes() for path in out.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "run"]  # no staging left beside it


def test_a_stored_tensor_of_another_shape_is_one_line(checkpoint, tmp_path):
    """The same bytes as the chunk, another shape (checksums recomputed): an AssertionError traceback."""
    data_file = replace_tensor(checkpoint, EMBEDDING, torch.zeros(64, 256))
    rehash(checkpoint)
    with pytest.raises(ConfigError, match=rf"/{data_file}: the item at bytes \[\d+, \d+\) cannot be read") as err:
        convert_megatron_to_hf(checkpoint, tmp_path / "hf", tp=1, pp=1)
    _one_line(err)
