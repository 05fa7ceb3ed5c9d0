"""The allow-list of the DCP ``.metadata`` reader (:mod:`ringtrain.checkpoint.dcp_metadata`):
the exact globals a file may name, and the checked operations on them.

:func:`find_class` resolves ``(module, qualname)`` through one table (nothing is imported, no
attribute is looked up by a name from the file); :func:`reduce_call`, :func:`new_object`,
:func:`build_object` and :func:`set_item` are the only ways the reader's pickle machine creates
or changes objects, each checking its arguments first. Every refusal is a
:class:`pickle.UnpicklingError` from :func:`refuse`.
"""

from __future__ import annotations

import dataclasses
import pathlib
import pickle
from collections.abc import Callable
from functools import cache
from typing import Any

import torch

_DCP_METADATA = "torch.distributed.checkpoint.metadata"
_DCP_FILESYSTEM = "torch.distributed.checkpoint.filesystem"


@dataclasses.dataclass(frozen=True)
class _Global:
    """A global resolved from the table, on the stack until a REDUCE or NEWOBJ uses it (a bare
    one left in the result is refused)."""

    name: str
    target: Any
    call: Callable[[tuple[Any, ...]], Any] | None  # REDUCE: checks the arguments, then builds
    newobj: bool  # NEWOBJ allowed (a DCP dataclass)


def refuse(why: str) -> pickle.UnpicklingError:
    """The error to raise for a refused ``.metadata``, naming ``why``."""
    return pickle.UnpicklingError(f"DCP .metadata refused: {why} (loading it could run code)")


def _size(args: tuple[Any, ...]) -> torch.Size:
    if len(args) != 1 or type(args[0]) not in (tuple, list):
        raise refuse(f"torch.Size{args!r:.80}: expected one tuple of ints")
    if not all(type(x) is int for x in args[0]):
        raise refuse(f"torch.Size{args!r:.80}: expected one tuple of ints")
    return torch.Size(args[0])


def _path(cls: type) -> Callable[[tuple[Any, ...]], Any]:
    def build(args: tuple[Any, ...]) -> Any:
        if not all(type(x) is str for x in args):
            raise refuse(f"{cls.__name__}{args!r:.80}: expected strings")
        return cls(*args)

    return build


def _layout(args: tuple[Any, ...]) -> torch.layout:
    layouts = {str(v): v for v in vars(torch).values() if isinstance(v, torch.layout)}
    if len(args) != 1 or type(args[0]) is not str or args[0] not in layouts:
        raise refuse(f"torch.serialization._get_layout{args!r:.80}: not a layout's name")
    return layouts[args[0]]


def _enum(cls: Any) -> Callable[[tuple[Any, ...]], Any]:
    def build(args: tuple[Any, ...]) -> Any:
        if len(args) != 1 or type(args[0]) is not int:
            raise refuse(f"{cls.__name__}{args!r:.80}: expected one int")
        return cls(args[0])

    return build


@cache
def _tables() -> tuple[dict[tuple[str, str], _Global], dict[type, frozenset[str]]]:
    """``(globals, dataclasses)``: the exact globals a .metadata may name, and for each DCP
    dataclass the fields BUILD may set."""
    from torch.distributed.checkpoint import filesystem as dcp_fs
    from torch.distributed.checkpoint import metadata as dcp_md

    classes: list[tuple[str, type]] = [
        (_DCP_METADATA, dcp_md.Metadata),
        (_DCP_METADATA, dcp_md.TensorStorageMetadata),
        (_DCP_METADATA, dcp_md.BytesStorageMetadata),
        (_DCP_METADATA, dcp_md.ChunkStorageMetadata),
        (_DCP_METADATA, dcp_md.TensorProperties),
        (_DCP_METADATA, dcp_md.MetadataIndex),
        (_DCP_METADATA, dcp_md.StorageMeta),
        (_DCP_FILESYSTEM, dcp_fs._StorageInfo),
    ]
    table: dict[tuple[str, str], _Global] = {}
    fields: dict[type, frozenset[str]] = {}
    for module, cls in classes:
        table[(module, cls.__name__)] = _Global(f"{module}.{cls.__name__}", cls, None, True)
        fields[cls] = frozenset(f.name for f in dataclasses.fields(cls))
    enum_cls = dcp_md._MEM_FORMAT_ENCODING
    reducible: list[tuple[str, str, Any, Callable[[tuple[Any, ...]], Any]]] = [
        (_DCP_METADATA, "_MEM_FORMAT_ENCODING", enum_cls, _enum(enum_cls)),
        ("torch", "Size", torch.Size, _size),
        ("torch.serialization", "_get_layout", None, _layout),
        ("pathlib", "PosixPath", pathlib.PosixPath, _path(pathlib.PosixPath)),
        ("pathlib", "PurePosixPath", pathlib.PurePosixPath, _path(pathlib.PurePosixPath)),
    ]
    for module, name, target, call in reducible:
        table[(module, name)] = _Global(f"{module}.{name}", target, call, False)
    # Constants: dtypes, layouts, memory formats (none is callable).
    for name, value in vars(torch).items():
        if isinstance(value, (torch.dtype, torch.layout, torch.memory_format)):
            table[("torch", name)] = _Global(f"torch.{name}", value, None, False)
    return table, fields


def allowed_globals() -> frozenset[tuple[str, str]]:
    """The exact ``(module, qualname)`` pairs a ``.metadata`` file may name."""
    return frozenset(_tables()[0])


def find_class(module: Any, name: Any) -> Any:
    """The global ``module.name`` from the table: a constant (dtype, layout, memory format) or a
    ``_Global`` for REDUCE/NEWOBJ; refused if not in the table or dotted."""
    if type(module) is not str or type(name) is not str:
        raise refuse(f"a global named by {type(module).__name__}/{type(name).__name__}")
    if "." in name:
        raise refuse(f"{module}.{name}: a dotted name (it resolves through the module's imports)")
    found = _tables()[0].get((module, name))
    if found is None:
        raise refuse(f"it refers to {module}.{name}, which a DCP metadata file never holds")
    if found.call is None and not found.newobj:
        return found.target  # a constant: dtype, layout, memory format
    return found


def reduce_call(func: Any, args: Any) -> Any:
    """REDUCE: call ``func`` (a :class:`_Global` with a checked call) on ``args``."""
    if type(func) is not _Global or func.call is None:
        raise refuse(f"REDUCE of {getattr(func, 'name', type(func).__name__)}")
    if type(args) is not tuple:
        raise refuse(f"REDUCE of {func.name} with {type(args).__name__} arguments")
    return func.call(args)


def new_object(cls: Any, args: Any) -> Any:
    """NEWOBJ: a bare instance of a DCP dataclass (no arguments)."""
    if type(cls) is not _Global or not cls.newobj:
        raise refuse(f"NEWOBJ of {getattr(cls, 'name', type(cls).__name__)}")
    if type(args) is not tuple or args:
        raise refuse(f"NEWOBJ of {cls.name} with arguments")
    return object.__new__(cls.target)


def build_object(inst: Any, state: Any) -> None:
    """BUILD: set the declared fields of a DCP dataclass instance from ``state``."""
    kind = type(inst)
    fields = _tables()[1].get(kind)
    if fields is None:
        raise refuse(f"BUILD on {kind.__name__}")
    if kind.__name__ == "TensorProperties":
        if type(state) is not tuple or len(state) != 5:
            raise refuse("BUILD of TensorProperties with a state other than its 5-tuple")
        inst.__setstate__(state)  # DCP's own: unpacks the tuple, maps the enum
        return
    if type(state) is not dict or not all(type(k) is str and k in fields for k in state):
        raise refuse(f"BUILD of {kind.__name__} with fields other than {sorted(fields)}")
    if kind is _index_class():
        _check_index({**vars(inst), **state})
    vars(inst).update(state)


@cache
def _index_class() -> type:
    from torch.distributed.checkpoint.metadata import MetadataIndex

    return MetadataIndex


def _check_index(state: dict[str, Any]) -> None:
    """A MetadataIndex is hashed (a dict key): its fqn must be a str, its offset a Size of ints
    or None (hashing a deeply nested tuple crashes CPython), its index an int or None."""
    fqn, offset, index = state.get("fqn"), state.get("offset"), state.get("index")
    if type(fqn) is not str or type(offset) not in (torch.Size, type(None)):
        raise refuse("a MetadataIndex whose fqn is not a str or offset not a torch.Size")
    if type(index) not in (int, type(None)):
        raise refuse("a MetadataIndex whose index is not an int")


def set_item(target: Any, key: Any, value: Any) -> None:
    """SETITEM: ``target[key] = value`` on a dict, with a str, int or flat MetadataIndex key."""
    if type(target) is not dict:
        raise refuse(f"SETITEM on {type(target).__name__}")
    kind = type(key)
    if kind is not str and kind is not int:
        if kind is not _index_class():
            raise refuse(f"a dictionary key of type {kind.__name__}")
        _check_index(vars(key))  # its hash reads fqn and offset: keep them flat
    target[key] = value


def is_global(value: Any) -> bool:
    """Whether ``value`` is a global resolved from the table, waiting for its REDUCE or NEWOBJ
    (a bare one left in the result is refused)."""
    return type(value) is _Global
