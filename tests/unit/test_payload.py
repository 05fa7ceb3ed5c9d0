"""ringtrain.wire.payload.dumps: functions pickled by value keep their code's file name (cloudpickle
3.1.3 replaced it with "<dynamic-code>", and workers' tracebacks lost their lines)."""

from __future__ import annotations

import pickle
import traceback
import types

from ringtrain.wire.payload import dumps, pickle_payload

_SOURCE = """
def outer(x):
    def inner():
        return {}["label"]  # the line a traceback must name
    return inner()
"""


def _dynamic_function(filename: str) -> types.FunctionType:
    namespace: dict[str, object] = {"__name__": "__main__"}  # pickled by value, like a script's
    exec(compile(_SOURCE, filename, "exec"), namespace)
    fn = namespace["outer"]
    assert isinstance(fn, types.FunctionType)
    return fn


def test_code_objects_keep_their_file_name_nested_ones_too() -> None:
    fn = pickle.loads(dumps(_dynamic_function("/home/user/train.py")))
    assert fn.__code__.co_filename == "/home/user/train.py"
    nested = [c for c in fn.__code__.co_consts if isinstance(c, types.CodeType)]
    assert [c.co_filename for c in nested] == ["/home/user/train.py"]
    try:
        fn(1)
    except KeyError as exc:
        frames = traceback.extract_tb(exc.__traceback__)
    else:
        raise AssertionError("the unpickled function did not run its code")
    assert [(f.filename, f.name, f.lineno) for f in frames[-2:]] == [
        ("/home/user/train.py", "outer", 5),
        ("/home/user/train.py", "inner", 4),
    ]


def test_the_payload_keeps_file_names_and_ships_the_cell_source() -> None:
    import linecache

    cell = "<ipython-input-7-abc>"
    linecache.cache[cell] = (len(_SOURCE), None, _SOURCE.splitlines(True), cell)
    try:
        train_fn, config, sources = pickle.loads(pickle_payload(_dynamic_function(cell), {"lr": 1}))
    finally:
        del linecache.cache[cell]
    assert train_fn.__code__.co_filename == cell
    assert config == {"lr": 1}
    assert sources == {cell: _SOURCE.splitlines(True)}
