"""Read a DCP ``.metadata`` file without ever running code from it.

``torch.distributed.checkpoint`` writes ``.metadata`` with ``pickle.dump`` and reads it back with
``pickle.load``: whoever can write the file can run any command on every rank that resumes from
it, and in ``ringtrain export``. :func:`load_metadata` replaces that ``pickle.load`` with a small
pickle virtual machine of its own (:class:`_Machine`), which knows only these operations:

- **Globals** resolve through one table of exact ``(module, qualname)`` pairs
  (:func:`allowed_globals`): the DCP classes that ``dcp.save`` of torch 2.13 writes (found by
  listing the globals of real checkpoints of an FSDP2 model and optimizer at 2 and 3 ranks, sync
  and async, and of plain state dicts, with ``pickletools``), ``torch.Size``, every ``torch``
  dtype, layout and memory format, the layout helper and ``pathlib.PosixPath``. Nothing is
  imported, no attribute is looked up by a name from the file: a name with a ``.`` (how
  ``filesystem.os.system`` reached ``os.system`` through DCP's own ``import os``) is refused.
- **Calls** are the few the table grants, with their arguments checked first: ``REDUCE`` only of
  ``torch.Size`` (ints), ``PosixPath`` (strings), the memory-format enum (one int) and the
  layout helper (a layout's name); ``NEWOBJ`` only of the DCP dataclasses, without arguments;
  ``BUILD`` only on an instance of those dataclasses, setting only their declared fields
  (``TensorProperties`` through its own ``__setstate__``, which takes a 5-tuple). Classes
  themselves are never modified, and a class or function left bare in the result is refused.
- **Opcodes** are those ``pickle.dump`` (protocol 4 and 5) writes for such objects; ``GLOBAL``,
  ``INST``, ``OBJ``, ``NEWOBJ_EX``, ``EXT1/2/4`` (copyreg's extension registry),
  ``PERSID``/``BINPERSID``, out-of-band buffers, sets and the opcodes of protocols 0 to 3 are
  refused.
- **Dictionary keys** are strings, ints or a ``MetadataIndex`` of a string and a ``torch.Size``
  (hashing a deeply nested tuple crashes CPython), and every data file the result names is a
  plain file name inside the checkpoint directory (no ``/``, no ``..``).

Any refusal, and any malformed input, raises :class:`pickle.UnpicklingError` naming the reason.
No audit event fires while it runs (no import, no open, no exec; tested). Cost: as fast as
CPython's pure-Python unpickler; 2.6 to 5 times C ``pickle`` on 1 to 14 MB of metadata, about
0.1 s where C takes 2 ms on a small one (``benchmarks/load_safety.py``).
"""

from __future__ import annotations

import dataclasses
import pathlib
import pickle
import pickletools
import struct
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


def _refuse(why: str) -> pickle.UnpicklingError:
    return pickle.UnpicklingError(f"DCP .metadata refused: {why} (loading it could run code)")


def _size(args: tuple[Any, ...]) -> torch.Size:
    if len(args) != 1 or type(args[0]) not in (tuple, list):
        raise _refuse(f"torch.Size{args!r:.80}: expected one tuple of ints")
    if not all(type(x) is int for x in args[0]):
        raise _refuse(f"torch.Size{args!r:.80}: expected one tuple of ints")
    return torch.Size(args[0])


def _path(cls: type) -> Callable[[tuple[Any, ...]], Any]:
    def build(args: tuple[Any, ...]) -> Any:
        if not all(type(x) is str for x in args):
            raise _refuse(f"{cls.__name__}{args!r:.80}: expected strings")
        return cls(*args)

    return build


def _layout(args: tuple[Any, ...]) -> torch.layout:
    layouts = {str(v): v for v in vars(torch).values() if isinstance(v, torch.layout)}
    if len(args) != 1 or type(args[0]) is not str or args[0] not in layouts:
        raise _refuse(f"torch.serialization._get_layout{args!r:.80}: not a layout's name")
    return layouts[args[0]]


def _enum(cls: Any) -> Callable[[tuple[Any, ...]], Any]:
    def build(args: tuple[Any, ...]) -> Any:
        if len(args) != 1 or type(args[0]) is not int:
            raise _refuse(f"{cls.__name__}{args!r:.80}: expected one int")
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


def _find_class(module: Any, name: Any) -> Any:
    if type(module) is not str or type(name) is not str:
        raise _refuse(f"a global named by {type(module).__name__}/{type(name).__name__}")
    if "." in name:
        raise _refuse(f"{module}.{name}: a dotted name (it resolves through the module's imports)")
    found = _tables()[0].get((module, name))
    if found is None:
        raise _refuse(f"it refers to {module}.{name}, which a DCP metadata file never holds")
    if found.call is None and not found.newobj:
        return found.target  # a constant: dtype, layout, memory format
    return found


def _reduce(func: Any, args: Any) -> Any:
    if type(func) is not _Global or func.call is None:
        raise _refuse(f"REDUCE of {getattr(func, 'name', type(func).__name__)}")
    if type(args) is not tuple:
        raise _refuse(f"REDUCE of {func.name} with {type(args).__name__} arguments")
    return func.call(args)


def _newobj(cls: Any, args: Any) -> Any:
    if type(cls) is not _Global or not cls.newobj:
        raise _refuse(f"NEWOBJ of {getattr(cls, 'name', type(cls).__name__)}")
    if type(args) is not tuple or args:
        raise _refuse(f"NEWOBJ of {cls.name} with arguments")
    return object.__new__(cls.target)


def _build(inst: Any, state: Any) -> None:
    kind = type(inst)
    fields = _tables()[1].get(kind)
    if fields is None:
        raise _refuse(f"BUILD on {kind.__name__}")
    if kind.__name__ == "TensorProperties":
        if type(state) is not tuple or len(state) != 5:
            raise _refuse("BUILD of TensorProperties with a state other than its 5-tuple")
        inst.__setstate__(state)  # DCP's own: unpacks the tuple, maps the enum
        return
    if type(state) is not dict or not all(type(k) is str and k in fields for k in state):
        raise _refuse(f"BUILD of {kind.__name__} with fields other than {sorted(fields)}")
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
        raise _refuse("a MetadataIndex whose fqn is not a str or offset not a torch.Size")
    if type(index) not in (int, type(None)):
        raise _refuse("a MetadataIndex whose index is not an int")


def _setitem(target: Any, key: Any, value: Any) -> None:
    if type(target) is not dict:
        raise _refuse(f"SETITEM on {type(target).__name__}")
    kind = type(key)
    if kind is not str and kind is not int:
        if kind is not _index_class():
            raise _refuse(f"a dictionary key of type {kind.__name__}")
        _check_index(vars(key))  # its hash reads fqn and offset: keep them flat
    target[key] = value


def _uint(data: bytes, pos: int, width: int) -> int:
    raw = data[pos : pos + width]
    if len(raw) != width:
        raise _refuse("a truncated pickle")
    return int.from_bytes(raw, "little")


def _take(data: bytes, pos: int, n: int) -> bytes:
    raw = data[pos : pos + n]
    if len(raw) != n:
        raise _refuse("a truncated pickle")
    return raw


class _Machine:
    """The pickle virtual machine, restricted to the opcodes in :data:`_DISPATCH`. ``loose``
    counts the globals on the stack that no REDUCE or NEWOBJ has used yet: at STOP it must be 0,
    so no class or function can end up inside the result."""

    __slots__ = ("data", "loose", "marks", "memo", "pos", "result", "stack")

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.pos = 0
        self.stack: list[Any] = []
        self.marks: list[list[Any]] = []
        self.memo: list[Any] = []
        self.loose = 0
        self.result: Any = None

    def run(self) -> Any:
        data, dispatch, memo, end = self.data, _DISPATCH, self.memo, len(self.data)
        while True:
            pos = self.pos
            if pos >= end:
                raise _refuse("a pickle that ends before its STOP opcode")
            code = data[pos]
            # The three opcodes of most of a .metadata, inline (the rest: one method each).
            if code == _SHORT_BINUNICODE and pos + 1 < end:
                stop = pos + 2 + data[pos + 1]
                if stop > end:
                    raise _refuse("a truncated pickle")
                self.stack.append(str(data[pos + 2 : stop], "utf-8", "surrogatepass"))
                self.pos = stop
                continue
            if code == _MEMOIZE and self.stack:
                memo.append(self.stack[-1])
                self.pos = pos + 1
                continue
            if code == _BINGET and pos + 1 < end and data[pos + 1] < len(memo):
                value = memo[data[pos + 1]]
                if type(value) is _Global:
                    self.loose += 1
                self.stack.append(value)
                self.pos = pos + 2
                continue
            self.pos = pos + 1
            handler = dispatch.get(code)
            if handler is None:
                raise _refuse(f"opcode {_opname(code)} at byte {self.pos - 1}")
            if handler(self):
                return self.result

    def pop_mark(self) -> list[Any]:
        items = self.stack
        self.stack = self.marks.pop()
        return items

    def arg(self, width: int) -> int:
        value = _uint(self.data, self.pos, width)
        self.pos += width
        return value

    def push_bytes(self, width: int, text: bool) -> None:
        n = self.arg(width)
        raw = _take(self.data, self.pos, n)
        self.pos += n
        self.stack.append(str(raw, "utf-8", "surrogatepass") if text else raw)

    # -- framing, protocol, end
    def op_proto(self) -> None:
        if self.arg(1) not in (4, 5):
            raise _refuse("a pickle protocol other than 4 or 5 (what DCP writes)")

    def op_frame(self) -> None:
        self.arg(8)  # the whole file is in memory: frames need no handling

    def op_stop(self) -> bool:
        if self.marks or len(self.stack) != 1:
            raise _refuse("a pickle that does not end with exactly one object")
        if self.loose:
            raise _refuse("a class or function itself (not an instance of it) in the metadata")
        self.result = self.stack[0]
        return True

    # -- memo
    def op_mark(self) -> None:
        self.marks.append(self.stack)
        self.stack = []

    def op_memoize(self) -> None:
        self.memo.append(self.stack[-1])

    def _put(self, index: int) -> None:
        if index == len(self.memo):
            self.memo.append(self.stack[-1])
        elif index < len(self.memo):
            self.memo[index] = self.stack[-1]
        else:
            raise _refuse(f"memo slot {index} past the {len(self.memo)} in use")

    def op_binput(self) -> None:
        self._put(self.arg(1))

    def op_long_binput(self) -> None:
        self._put(self.arg(4))

    def _get(self, index: int) -> None:
        if index >= len(self.memo):
            raise _refuse(f"memo slot {index} was never filled")
        value = self.memo[index]
        if type(value) is _Global:
            self.loose += 1
        self.stack.append(value)

    def op_binget(self) -> None:
        self._get(self.arg(1))

    def op_long_binget(self) -> None:
        self._get(self.arg(4))

    # -- scalars
    def op_none(self) -> None:
        self.stack.append(None)

    def op_newtrue(self) -> None:
        self.stack.append(True)

    def op_newfalse(self) -> None:
        self.stack.append(False)

    def op_binint(self) -> None:
        self.stack.append(int.from_bytes(_take(self.data, self.pos, 4), "little", signed=True))
        self.pos += 4

    def op_binint1(self) -> None:
        self.stack.append(self.arg(1))

    def op_binint2(self) -> None:
        self.stack.append(self.arg(2))

    def _long(self, width: int) -> None:
        n = self.arg(width)
        self.stack.append(int.from_bytes(_take(self.data, self.pos, n), "little", signed=True))
        self.pos += n

    def op_long1(self) -> None:
        self._long(1)

    def op_long4(self) -> None:
        self._long(4)

    def op_binfloat(self) -> None:
        self.stack.append(struct.unpack(">d", _take(self.data, self.pos, 8))[0])
        self.pos += 8

    def op_short_binunicode(self) -> None:
        self.push_bytes(1, True)

    def op_binunicode(self) -> None:
        self.push_bytes(4, True)

    def op_binunicode8(self) -> None:
        self.push_bytes(8, True)

    def op_short_binbytes(self) -> None:
        self.push_bytes(1, False)

    def op_binbytes(self) -> None:
        self.push_bytes(4, False)

    def op_binbytes8(self) -> None:
        self.push_bytes(8, False)

    # -- containers
    def op_empty_tuple(self) -> None:
        self.stack.append(())

    def op_tuple(self) -> None:
        items = self.pop_mark()
        self.stack.append(tuple(items))

    def _tuple(self, n: int) -> None:
        stack = self.stack
        if len(stack) < n:
            raise _refuse(f"TUPLE{n} with {len(stack)} items on the stack")
        packed = tuple(stack[-n:])
        del stack[-n:]
        stack.append(packed)

    def op_tuple1(self) -> None:
        self._tuple(1)

    def op_tuple2(self) -> None:
        self._tuple(2)

    def op_tuple3(self) -> None:
        self._tuple(3)

    def op_empty_list(self) -> None:
        self.stack.append([])

    def _extend(self, items: list[Any]) -> None:
        target = self.stack[-1]
        if type(target) is not list:
            raise _refuse(f"APPEND to {type(target).__name__}")
        target.extend(items)

    def op_append(self) -> None:
        self._extend([self.stack.pop()])

    def op_appends(self) -> None:
        self._extend(self.pop_mark())

    def op_empty_dict(self) -> None:
        self.stack.append({})

    def op_setitem(self) -> None:
        stack = self.stack
        value, key = stack.pop(), stack.pop()
        _setitem(stack[-1], key, value)

    def op_setitems(self) -> None:
        items = self.pop_mark()
        if len(items) % 2:
            raise _refuse("SETITEMS with an odd number of items")
        target = self.stack[-1]
        for k in range(0, len(items), 2):
            _setitem(target, items[k], items[k + 1])

    # -- globals and the calls they allow
    def op_stack_global(self) -> None:
        stack = self.stack
        name, module = stack.pop(), stack.pop()
        found = _find_class(module, name)
        if type(found) is _Global:
            self.loose += 1
        stack.append(found)

    def op_reduce(self) -> None:
        args = self.stack.pop()
        self.stack[-1] = _reduce(self.stack[-1], args)
        self.loose -= 1

    def op_newobj(self) -> None:
        args = self.stack.pop()
        self.stack[-1] = _newobj(self.stack[-1], args)
        self.loose -= 1

    def op_build(self) -> None:
        state = self.stack.pop()
        _build(self.stack[-1], state)


def _opname(code: int) -> str:
    for op in pickletools.opcodes:
        if ord(op.code) == code:
            return op.name
    return f"0x{code:02x} (not a pickle opcode)"


_SHORT_BINUNICODE, _MEMOIZE, _BINGET = 0x8C, 0x94, ord("h")
_DISPATCH: dict[int, Callable[[_Machine], Any]] = {
    ord(op.code): getattr(_Machine, f"op_{op.name.lower()}")
    for op in pickletools.opcodes
    if hasattr(_Machine, f"op_{op.name.lower()}")
}


def _check_files(metadata: Any) -> None:
    """Every data file the metadata names is a plain file name in the checkpoint directory."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import MetadataIndex

    storage = metadata.storage_data
    if type(storage) is not dict:
        raise _refuse(f"storage_data is a {type(storage).__name__}, not a dict")
    for key, info in storage.items():
        if type(key) is not MetadataIndex or type(info) is not _StorageInfo:
            raise _refuse("storage_data maps other than MetadataIndex -> _StorageInfo")
        path = vars(info).get("relative_path")
        if type(path) is not str or "/" in path or "\\" in path or path in ("", ".", ".."):
            raise _refuse(f"data file {path!r:.80} is not a file name in the checkpoint")
        if any(
            type(vars(info).get(f)) is not int or vars(info)[f] < 0 for f in ("offset", "length")
        ):
            raise _refuse(f"data file {path!r}: offset and length must be ints >= 0")


def load_metadata(data: bytes) -> Any:
    """The ``torch.distributed.checkpoint.metadata.Metadata`` pickled in ``data``.

    Args:
        data: the whole content of a ``.metadata`` file.

    Returns:
        The ``Metadata`` object, built only from the allowed globals (see the module docstring).

    Raises:
        pickle.UnpicklingError: ``data`` names anything outside the allow-list, calls anything
            the table does not grant, uses a refused opcode, is malformed or truncated, or is not
            a ``Metadata`` whose data files lie in the checkpoint directory.
    """
    from torch.distributed.checkpoint.metadata import Metadata

    try:
        metadata = _Machine(bytes(data)).run()
        if type(metadata) is not Metadata:
            raise _refuse(f"it holds a {type(metadata).__name__}, not a Metadata")
        _check_files(metadata)
    except pickle.UnpicklingError:
        raise
    except Exception as exc:  # malformed input: one clear error, whatever the opcode tripped
        raise pickle.UnpicklingError(
            f"DCP .metadata is not a valid metadata pickle ({type(exc).__name__}: {exc!s:.200})"
        ) from exc
    return metadata
