"""The restricted unpickler of a torch distributed checkpoint's index (``.metadata``, a plain pickle).

It admits only the names, opcodes and uses of them that a real index is made of
(:data:`METADATA_GLOBALS`, listed from checkpoints this project writes): each NEWOBJ, REDUCE and
BUILD is checked for what it makes, calls or changes before it happens. What it returns is then
checked against itself and the files beside it (:mod:`stapo_megatron.checkpoint.dcp_index`).
"""

from __future__ import annotations

import dataclasses
import pickle
import pickletools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    _MEM_FORMAT_ENCODING,
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import BytesIOWriteData, SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.serialization import _get_layout

from stapo_megatron.config import ConfigError

# What a torch distributed checkpoint's ``.metadata`` is made of, and how, as disassembled
# (pickletools) from the checkpoints this project writes (torch 2.13, megatron-core 0.16.1): each
# of these dataclasses is made by NEWOBJ with no arguments and given its fields by one BUILD (a
# dict of some of its fields; TensorProperties: the 5-tuple of its own __setstate__); Megatron
# adds the save plans to Metadata as ``all_local_plans``.
_BUILT_CLASSES: dict[type, frozenset[str]] = {
    cls: frozenset(f.name for f in dataclasses.fields(cls))
    for cls in (
        Metadata,
        TensorStorageMetadata,
        BytesStorageMetadata,
        ChunkStorageMetadata,
        TensorProperties,
        MetadataIndex,
        StorageMeta,
        _StorageInfo,
        SavePlan,
        WriteItem,
        TensorWriteData,
        BytesIOWriteData,
    )
}
_BUILT_CLASSES[Metadata] |= {"all_local_plans"}
# ... and these are called by REDUCE, with one argument of the type named.
_CALLED: tuple[tuple[Any, type], ...] = (
    (torch.Size, tuple),
    (WriteItemType, int),
    (_MEM_FORMAT_ENCODING, int),
    (_get_layout, str),
)
# the names pickle writes for them
METADATA_GLOBALS = {(obj.__module__, obj.__qualname__) for obj in [*_BUILT_CLASSES, *(f for f, _ in _CALLED)]}
# Opcodes that only push plain values (None, bools, ints, strings, tuples, lists, dicts) or move
# them through the memo: those of the real indexes, and their variants for other protocols and
# magnitudes (LONG1 for an offset past 2 GiB, BINUNICODE for a long path). GLOBAL/STACK_GLOBAL
# go through find_class; NEWOBJ, REDUCE and BUILD through the rules above; any other is refused.
_VALUE_OPCODES = frozenset(
    "PROTO FRAME STOP MARK MEMOIZE BINPUT LONG_BINPUT BINGET LONG_BINGET NONE NEWTRUE NEWFALSE BININT BININT1 "
    "BININT2 LONG1 SHORT_BINUNICODE BINUNICODE BINUNICODE8 EMPTY_TUPLE TUPLE TUPLE1 TUPLE2 TUPLE3 EMPTY_LIST "
    "APPEND APPENDS EMPTY_DICT SETITEM SETITEMS GLOBAL STACK_GLOBAL".split()
)
_OPCODE_NAMES = {op.code.encode("latin-1")[0]: op.name for op in pickletools.opcodes}


class IndexUnpickler(pickle._Unpickler):
    """The pure-Python unpickler with a dispatch table of only the admitted opcodes, so that each
    NEWOBJ, REDUCE and BUILD is checked for what it makes, calls or changes before it happens
    (the C unpickler cannot be told: a BUILD there sets attributes on any object, a class too)."""

    # set by pickle._Unpickler.load
    stack: list[Any]
    append: Callable[[Any], None]

    def __init__(self, file, path: Path):
        super().__init__(file)
        self.path = path
        self._built: list[Any] = []  # the objects given their state, kept alive so ids stay unique
        self._built_ids: set[int] = set()

    def _refuse(self, what: str) -> ConfigError:
        return ConfigError(
            f"{self.path}: refused to load: {what}, which a checkpoint index never holds (a crafted or foreign file)"
        )

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in METADATA_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise ConfigError(
            f"{self.path}: refused to load: it refers to {module}.{name}, which a checkpoint index never holds "
            f"(a crafted or foreign file)"
        )

    def _load_newobj(self) -> None:
        args = self.stack.pop()
        cls = self.stack.pop()
        if not (isinstance(cls, type) and cls in _BUILT_CLASSES) or type(args) is not tuple or args:
            raise self._refuse(f"NEWOBJ of {describe(cls)} with {describe(args)}")
        self.append(object.__new__(cls))  # what NEWOBJ does for a dataclass

    def _load_reduce(self) -> None:
        args = self.stack.pop()
        func = self.stack[-1]
        kind = next((kind for called, kind in _CALLED if called is func), None)
        if kind is None or type(args) is not tuple or len(args) != 1 or type(args[0]) is not kind:
            raise self._refuse(f"a call of {describe(func)} with {describe(args)}")
        self.stack[-1] = func(args[0])

    def _load_build(self) -> None:
        state = self.stack.pop()
        inst = self.stack[-1]
        fields = _BUILT_CLASSES.get(type(inst))
        # Only an instance made by NEWOBJ above, once: never a class, a function or a dtype.
        if fields is None or id(inst) in self._built_ids:
            raise self._refuse(f"BUILD on {describe(inst)}")
        if type(inst) is TensorProperties:
            if type(state) is not tuple or len(state) != 5:
                raise self._refuse(f"BUILD of TensorProperties from {describe(state)}")
            inst.__setstate__(state)
        else:
            if type(state) is not dict or not all(type(k) is str for k in state) or not state.keys() <= fields:
                raise self._refuse(f"BUILD of {type(inst).__name__} from {describe(state)}")
            vars(inst).update(state)
        self._built.append(inst)
        self._built_ids.add(id(inst))

    @staticmethod
    def _dispatch() -> dict[int, Callable[[Any], None]]:
        plain = pickle._Unpickler.dispatch
        table: dict[int, Callable[[Any], None]] = {}
        for code in range(256):
            name = _OPCODE_NAMES.get(code)
            if name in _VALUE_OPCODES:
                table[code] = plain[code]
            elif name in ("NEWOBJ", "REDUCE", "BUILD"):
                table[code] = getattr(IndexUnpickler, f"_load_{name.lower()}")
            else:
                table[code] = _refusing(name or f"0x{code:02x}")
        return table


def _refusing(name: str) -> Callable[[Any], None]:
    def refuse(unpickler: IndexUnpickler) -> None:
        raise not_an_index(unpickler.path, f"pickle opcode {name}, which a checkpoint index never holds")

    return refuse


IndexUnpickler.dispatch = IndexUnpickler._dispatch()


def describe(obj: Any) -> str:
    """What a refused pickle handed over, in a few words (never its repr: it may be huge)."""
    if isinstance(obj, type):
        return f"the class {obj.__module__}.{obj.__qualname__}"
    if callable(obj) and hasattr(obj, "__qualname__"):
        return f"{getattr(obj, '__module__', '?')}.{obj.__qualname__}"
    if type(obj) is tuple:
        return f"a {len(obj)}-tuple"
    return f"a {type(obj).__module__}.{type(obj).__qualname__}".replace("builtins.", "")


def not_an_index(path, reason: str) -> ConfigError:
    return ConfigError(f"{path}: not a valid checkpoint index: {reason}")
