"""Read a DCP ``.metadata`` file without ever running code from it.

``torch.distributed.checkpoint`` writes ``.metadata`` with ``pickle.dump`` and reads it back with
``pickle.load``: whoever can write the file can run any command on every rank that resumes from
it, and in ``ringtrain export``. :func:`load_metadata` replaces that ``pickle.load`` with a small
pickle virtual machine of its own (:class:`_Machine`), which knows only these operations (the
table and the checked calls are in :mod:`ringtrain.checkpoint.dcp_globals`):

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

import pickle
import pickletools
import struct
from collections.abc import Callable
from typing import Any

from ringtrain.checkpoint.dcp_globals import (
    allowed_globals,
    build_object,
    find_class,
    is_global,
    new_object,
    reduce_call,
    refuse,
    set_item,
)

__all__ = ["allowed_globals", "load_metadata"]


def _uint(data: bytes, pos: int, width: int) -> int:
    raw = data[pos : pos + width]
    if len(raw) != width:
        raise refuse("a truncated pickle")
    return int.from_bytes(raw, "little")


def _take(data: bytes, pos: int, n: int) -> bytes:
    raw = data[pos : pos + n]
    if len(raw) != n:
        raise refuse("a truncated pickle")
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
                raise refuse("a pickle that ends before its STOP opcode")
            code = data[pos]
            # The three opcodes of most of a .metadata, inline (the rest: one method each).
            if code == _SHORT_BINUNICODE and pos + 1 < end:
                stop = pos + 2 + data[pos + 1]
                if stop > end:
                    raise refuse("a truncated pickle")
                self.stack.append(str(data[pos + 2 : stop], "utf-8", "surrogatepass"))
                self.pos = stop
                continue
            if code == _MEMOIZE and self.stack:
                memo.append(self.stack[-1])
                self.pos = pos + 1
                continue
            if code == _BINGET and pos + 1 < end and data[pos + 1] < len(memo):
                value = memo[data[pos + 1]]
                if is_global(value):
                    self.loose += 1
                self.stack.append(value)
                self.pos = pos + 2
                continue
            self.pos = pos + 1
            handler = dispatch.get(code)
            if handler is None:
                raise refuse(f"opcode {_opname(code)} at byte {self.pos - 1}")
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
            raise refuse("a pickle protocol other than 4 or 5 (what DCP writes)")

    def op_frame(self) -> None:
        self.arg(8)  # the whole file is in memory: frames need no handling

    def op_stop(self) -> bool:
        if self.marks or len(self.stack) != 1:
            raise refuse("a pickle that does not end with exactly one object")
        if self.loose:
            raise refuse("a class or function itself (not an instance of it) in the metadata")
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
            raise refuse(f"memo slot {index} past the {len(self.memo)} in use")

    def op_binput(self) -> None:
        self._put(self.arg(1))

    def op_long_binput(self) -> None:
        self._put(self.arg(4))

    def _get(self, index: int) -> None:
        if index >= len(self.memo):
            raise refuse(f"memo slot {index} was never filled")
        value = self.memo[index]
        if is_global(value):
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
            raise refuse(f"TUPLE{n} with {len(stack)} items on the stack")
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
            raise refuse(f"APPEND to {type(target).__name__}")
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
        set_item(stack[-1], key, value)

    def op_setitems(self) -> None:
        items = self.pop_mark()
        if len(items) % 2:
            raise refuse("SETITEMS with an odd number of items")
        target = self.stack[-1]
        for k in range(0, len(items), 2):
            set_item(target, items[k], items[k + 1])

    # -- globals and the calls they allow
    def op_stack_global(self) -> None:
        stack = self.stack
        name, module = stack.pop(), stack.pop()
        found = find_class(module, name)
        if is_global(found):
            self.loose += 1
        stack.append(found)

    def op_reduce(self) -> None:
        args = self.stack.pop()
        self.stack[-1] = reduce_call(self.stack[-1], args)
        self.loose -= 1

    def op_newobj(self) -> None:
        args = self.stack.pop()
        self.stack[-1] = new_object(self.stack[-1], args)
        self.loose -= 1

    def op_build(self) -> None:
        state = self.stack.pop()
        build_object(self.stack[-1], state)


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
        raise refuse(f"storage_data is a {type(storage).__name__}, not a dict")
    for key, info in storage.items():
        if type(key) is not MetadataIndex or type(info) is not _StorageInfo:
            raise refuse("storage_data maps other than MetadataIndex -> _StorageInfo")
        path = vars(info).get("relative_path")
        if type(path) is not str or "/" in path or "\\" in path or path in ("", ".", ".."):
            raise refuse(f"data file {path!r:.80} is not a file name in the checkpoint")
        if any(
            type(vars(info).get(f)) is not int or vars(info)[f] < 0 for f in ("offset", "length")
        ):
            raise refuse(f"data file {path!r}: offset and length must be ints >= 0")


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
            raise refuse(f"it holds a {type(metadata).__name__}, not a Metadata")
        _check_files(metadata)
    except pickle.UnpicklingError:
        raise
    except Exception as exc:  # malformed input: one clear error, whatever the opcode tripped
        raise pickle.UnpicklingError(
            f"DCP .metadata is not a valid metadata pickle ({type(exc).__name__}: {exc!s:.200})"
        ) from exc
    return metadata
