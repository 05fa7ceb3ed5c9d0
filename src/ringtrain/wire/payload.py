"""The function-mode payload: what the driver ships to every worker in its ``Start`` message.

``pickle_payload(train_fn, config)`` is ``dumps((train_fn, config, sources))``:
``sources`` maps the file names of ``train_fn``'s code that exist only in the driver's
:mod:`linecache` (a notebook cell, ``python -c``) to their lines, so that a worker's traceback
through them shows the source line (:func:`ringtrain.launch.worker.install_sources`). Payloads
of older versions are 2-tuples; workers accept both.

:func:`dumps` is ``cloudpickle.dumps`` that keeps each pickled code object's file name: from
cloudpickle 3.1.3 on, a function pickled by value (one defined in ``__main__``, a notebook cell,
``python -c``) arrives with ``co_filename == "<dynamic-code>"``, and a worker's traceback then
names neither the file nor the line. Every ringtrain payload goes through it.

When pickling fails, the error names the variable that holds the unpicklable object (a closure
variable, a global the function reads, a default argument or a ``train_loop_config`` key), not only
its type.
"""

from __future__ import annotations

import io
import linecache
import os
import sys
import types
from collections import ChainMap
from collections.abc import Callable, Iterator
from typing import Any

_MAX_DEPTH = 3


def _functions(fn: Any, depth: int = 0, seen: set[int] | None = None) -> Iterator[Any]:
    """``fn`` and the Python functions it reaches through closures and globals (bounded)."""
    seen = set() if seen is None else seen
    fn = getattr(fn, "__func__", fn)  # bound methods
    if not isinstance(fn, types.FunctionType) or id(fn) in seen or depth > _MAX_DEPTH:
        return
    seen.add(id(fn))
    yield fn
    for _, value in _references(fn):
        yield from _functions(value, depth + 1, seen)


def _code_names(code: types.CodeType) -> Iterator[str]:
    yield from code.co_names
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _code_names(const)


def _code_files(code: types.CodeType) -> Iterator[str]:
    yield code.co_filename
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _code_files(const)


def _references(fn: types.FunctionType) -> Iterator[tuple[str, Any]]:
    """``(how the function refers to it, value)`` for its closure variables, the globals its
    code reads, and its default arguments."""
    for name, cell in zip(fn.__code__.co_freevars, fn.__closure__ or (), strict=False):
        try:
            yield f"closure variable {name!r}", cell.cell_contents
        except ValueError:  # an empty cell
            continue
    module_globals = fn.__globals__
    for name in dict.fromkeys(_code_names(fn.__code__)):
        if name in module_globals:
            yield f"global {name!r}", module_globals[name]
    for i, default in enumerate(fn.__defaults__ or ()):
        yield f"default argument {i}", default
    for name, default in (fn.__kwdefaults__ or {}).items():
        yield f"default argument {name!r}", default


def source_lines(train_fn: Callable[..., Any]) -> dict[str, list[str]]:
    """``{filename: lines}`` of the code files of ``train_fn`` (and of the functions it reaches)
    that are not files on disk but are known to this process: notebook cells (IPython puts them
    in :mod:`linecache`) and the program of ``python -c`` (read from ``/proc/self/cmdline``)."""
    files: dict[str, None] = {}
    for fn in _functions(train_fn):
        files.update(dict.fromkeys(_code_files(fn.__code__)))
    sources: dict[str, list[str]] = {}
    for filename in files:
        if os.path.isfile(filename):
            continue  # the worker reads it itself
        lines = linecache.getlines(filename)
        if not lines and filename == "<string>":
            lines = _command_line_program()
        if lines:
            sources[filename] = list(lines)
    return sources


def _command_line_program() -> list[str]:
    """The program text of ``python -c PROGRAM`` (Linux), else ``[]``."""
    if sys.argv[:1] != ["-c"]:
        return []
    try:
        with open("/proc/self/cmdline", "rb") as f:
            args = f.read().split(b"\0")
    except OSError:
        return []
    if b"-c" not in args:
        return []
    at = args.index(b"-c") + 1
    if at >= len(args):
        return []
    return args[at].decode("utf-8", errors="replace").splitlines(keepends=True)


def _code_at(rebuild: Callable[..., types.CodeType], args: tuple[Any, ...], filename: str) -> Any:
    """Unpickling side of :func:`dumps`: the code object cloudpickle rebuilt, with its file name."""
    code = rebuild(*args)
    if isinstance(code, types.CodeType) and isinstance(filename, str):
        return code.replace(co_filename=filename)
    return code


def _reduce_code(code: types.CodeType) -> tuple[Any, ...]:
    import cloudpickle

    base = cloudpickle.Pickler.dispatch_table[types.CodeType]
    rebuild, args = base(code)[:2]
    return _code_at, (rebuild, args, code.co_filename)


def dumps(obj: Any) -> bytes:
    """``cloudpickle.dumps(obj)``, keeping ``co_filename`` of every code object pickled by value
    (see the module docstring); the bytes load with plain ``pickle.loads``/``cloudpickle.loads``
    wherever ringtrain is importable.

    Raises:
        Exception: whatever ``cloudpickle`` raises for an object it cannot pickle.
    """
    import cloudpickle

    class _Pickler(cloudpickle.Pickler):
        dispatch_table = ChainMap(
            {types.CodeType: _reduce_code}, cloudpickle.Pickler.dispatch_table
        )

    with io.BytesIO() as file:
        _Pickler(file).dump(obj)
        return file.getvalue()


def describe_unpicklable(train_fn: Callable[..., Any], config: Any) -> str | None:
    """Where the object that cannot be pickled sits: ``"closure variable 'lock' of train_fn
    (a _thread.lock)"``; ``None`` if no single culprit is found."""
    import cloudpickle

    def fails(value: Any) -> bool:
        try:
            cloudpickle.dumps(value)
        except Exception:
            return True
        return False

    if isinstance(config, dict):
        for key, value in config.items():
            if fails(value):
                return f"train_loop_config[{key!r}] ({_type_name(value)})"
    for fn in _functions(train_fn):
        for how, value in _references(fn):
            if isinstance(value, (types.FunctionType, types.ModuleType, type)):
                continue  # a function is searched itself; modules and classes go by reference
            if fails(value):
                return f"{how} of {fn.__qualname__} ({_type_name(value)})"
    return None


def _type_name(value: Any) -> str:
    cls = type(value)
    return f"a {cls.__module__}.{cls.__qualname__}".replace("a builtins.", "a ")


def pickle_payload(train_fn: Callable[..., Any], config: dict[str, Any] | None) -> bytes:
    """``dumps((train_fn, config, sources))`` (see the module docstring).

    Raises:
        TypeError: if ``train_fn`` or ``config`` cannot be pickled; the message names the
            variable holding the unpicklable object when it can be found.
    """
    try:
        sources = source_lines(train_fn)
    except Exception:  # best effort: a traceback without source lines is no reason to fail
        sources = {}
    try:
        return dumps((train_fn, config, sources))
    except Exception as exc:
        culprit = describe_unpicklable(train_fn, config)
        where = f"{culprit} cannot be pickled" if culprit else "pickling failed"
        raise TypeError(
            f"train_fn and train_loop_config must be picklable to reach the workers: {where} "
            f"({type(exc).__name__}: {exc}); create such objects (locks, open files, "
            "connections, loaded datasets) inside train_fn instead"
        ) from None
