"""Loading a checkpoint never runs code from it: the DCP ``.metadata`` reader (issue 18).

Issue 18: the old reader admitted any global whose module started with
``torch.distributed.checkpoint.``, and protocol 4's ``STACK_GLOBAL`` resolves a dotted name, so
``('torch.distributed.checkpoint.filesystem', 'os.system')`` reached ``os.system`` through DCP's
own ``import os``. These tests replay that payload (and proves it is live with plain pickle),
check the exact allow-list against real checkpoints (an FSDP2 model and optimizer saved by
``rt.Trainer`` at 2 and 3 ranks, and plain state dicts), refuse each hostile construct by name,
and fuzz the reader with hypothesis: generated opcode programs over a hostile list of globals and
random mutations of a real ``.metadata``. The property: the reader returns a ``Metadata`` made of
allowed types or raises ``pickle.UnpicklingError``, and no audit event (``os.system``,
``subprocess.Popen``, ``exec``, ``import``, ``open``, ...) fires while it runs.
"""

from __future__ import annotations

import copyreg
import io
import os
import pickle
import shutil
import struct
import sys
import threading
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fsdp_workloads as fw
import ringtrain as rt
from ringtrain.checkpoint.dcp_metadata import allowed_globals, load_metadata
from ringtrain.checkpoint.sharded import load_full, load_into

SHARES_RUNS = True  # its tests share cached runs: one pytest worker runs them all (conftest)

# ----------------------------------------------------------------------------- pickle opcodes


def _str(s: str) -> bytes:
    raw = s.encode()
    return (
        (b"\x8c" + bytes([len(raw)]) + raw)
        if len(raw) < 256
        else (b"X" + struct.pack("<I", len(raw)) + raw)
    )


PROTO4, STOP, MARK, TUPLE, TUPLE1, TUPLE2 = b"\x80\x04", b".", b"(", b"t", b"\x85", b"\x86"
EMPTY_TUPLE, EMPTY_DICT, EMPTY_LIST = b")", b"}", b"]"
STACK_GLOBAL, REDUCE, NEWOBJ, NEWOBJ_EX, BUILD = b"\x93", b"R", b"\x81", b"\x92", b"b"
SETITEM, APPEND, MEMOIZE, NONE = b"s", b"a", b"\x94", b"N"


def _global(module: str, name: str) -> bytes:
    return _str(module) + _str(name) + STACK_GLOBAL


def _call(module: str, name: str, *args: str) -> bytes:
    """``module.name(*args)`` with protocol 4's STACK_GLOBAL + REDUCE."""
    return _global(module, name) + MARK + b"".join(_str(a) for a in args) + TUPLE + REDUCE


def _program(body: bytes) -> bytes:
    return PROTO4 + body + STOP


def _touch(marker: Path) -> str:
    return f"touch {marker}"


# ----------------------------------------------------------------------------- real checkpoints


def _plain_state() -> dict:
    return {
        "model": torch.nn.Linear(3, 2).state_dict(),
        "step": 7,
        "lr": 1.5e-3,
        "name": "run",
        "nested": {"a": [1, 2], "b": (3, 4), "none": None, "flag": True},
        "bf16": torch.ones(3, dtype=torch.bfloat16),
        "i64": torch.arange(4),
        "channels_last": torch.randn(1, 3, 2, 2).to(memory_format=torch.channels_last),
    }


def _save_plain(directory: Path) -> Path:
    torch.manual_seed(0)
    writer = dcp.FileSystemWriter(str(directory), single_file_per_rank=True)
    dcp.save(_plain_state(), storage_writer=writer, no_dist=True)
    return directory


@pytest.fixture(scope="module")
def fsdp_ckpts(tmp_path_factory):
    """Sharded checkpoints of an FSDP2 model and AdamW, written by rt.Trainer at 2 and 3 ranks."""
    root = tmp_path_factory.mktemp("fsdp_ckpts")
    found = {}
    for workers in (2, 3):
        name = f"w{workers}"
        result = rt.Trainer(
            fw.fsdp_fn,
            rt.ScalingConfig(num_workers=workers),
            rt.RunConfig(name=name, storage_path=str(root / "runs"), progress="off"),
            train_loop_config={
                "strategy": "fsdp",
                "steps": 10,
                "ckpt_at": 2,
                "stop": True,
                "loss_file": str(root / f"{name}.losses.jsonl"),
                "probe_file": str(root / f"{name}.probe.pt"),
                "out": str(root / f"{name}.final.pt"),
            },
        ).fit()
        assert result.error is None, result.error
        found[workers] = Path(result.checkpoint.path)
    return found


class _Recorder(pickle.Unpickler):
    """Lists the globals of a trusted pickle (our own fresh checkpoint)."""

    def __init__(self, f) -> None:
        super().__init__(f)
        self.seen: set[tuple[str, str]] = set()

    def find_class(self, module: str, name: str):
        self.seen.add((module, name))
        return super().find_class(module, name)


def _globals_of(data: bytes) -> set[tuple[str, str]]:
    rec = _Recorder(io.BytesIO(data))
    rec.load()
    return rec.seen


def _check_real(directory: Path) -> set[tuple[str, str]]:
    data = (directory / ".metadata").read_bytes()
    seen = _globals_of(data)
    assert seen <= allowed_globals(), sorted(seen - allowed_globals())
    ours, reference = load_metadata(data), pickle.loads(data)  # trusted: written just now
    assert pickle.dumps(ours) == pickle.dumps(reference)
    return seen


def test_real_checkpoints_name_only_allowed_globals(fsdp_ckpts, tmp_path):
    seen = set()
    for workers, path in fsdp_ckpts.items():
        seen |= _check_real(path)
        full = load_full(str(path))
        assert set(full["model"]) == set(fw.TinyNet().state_dict()), workers
        assert full["optimizer"]["state"], workers  # AdamW moments and step counters
    seen |= _check_real(_save_plain(tmp_path / "plain"))
    full = load_full(str(tmp_path / "plain"))
    want = _plain_state()
    assert full["step"] == 7 and full["nested"] == want["nested"]
    assert full["bf16"].dtype == torch.bfloat16 and torch.equal(full["i64"], want["i64"])
    # What DCP 2.13 writes, exactly: the allow-list is not wider than it needs to be by much.
    dcp_classes = {
        ("torch.distributed.checkpoint.metadata", n)
        for n in (
            "Metadata",
            "TensorStorageMetadata",
            "BytesStorageMetadata",
            "ChunkStorageMetadata",
            "TensorProperties",
            "MetadataIndex",
            "StorageMeta",
            "_MEM_FORMAT_ENCODING",
        )
    }
    assert dcp_classes | {("torch.distributed.checkpoint.filesystem", "_StorageInfo")} <= seen
    assert {("torch", "Size"), ("torch.serialization", "_get_layout")} <= seen
    non_torch = {g for g in allowed_globals() if g[0] != "torch" and not g[0].startswith("torch.")}
    assert non_torch == {("pathlib", "PosixPath"), ("pathlib", "PurePosixPath")}


# ----------------------------------------------------------------------------- issue 18 itself


def test_issue_18_payload_is_refused_and_runs_nothing(tmp_path):
    marker = tmp_path / "pwned"
    payload = _program(
        _call("torch.distributed.checkpoint.filesystem", "os.system", _touch(marker))
    )
    # The payload is live: plain pickle (what DCP uses) runs the command.
    pickle.loads(payload)
    assert marker.exists()
    marker.unlink()

    ckpt = _save_plain(tmp_path / "ckpt")
    (ckpt / ".metadata").write_bytes(payload)
    with pytest.raises(pickle.UnpicklingError, match=r"os\.system: a dotted name"):
        load_full(str(ckpt))
    with pytest.raises(pickle.UnpicklingError, match=r"os\.system: a dotted name"):
        load_into(_plain_state(), str(ckpt))
    assert not marker.exists()


def test_code_in_a_value_is_refused_by_weights_only(tmp_path):
    """Non-tensor values (step counters...) are read with weights_only=True, and the refusal
    surfaces as an UnpicklingError, not as DCP's CheckpointException (a BaseException)."""
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (os.system, (_touch(marker),))

    directory = tmp_path / "evil"
    dcp.save(
        {"w": torch.ones(2), "step": Evil()},
        storage_writer=dcp.FileSystemWriter(str(directory)),
        no_dist=True,
    )
    with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
        load_full(str(directory))
    assert not marker.exists()


# ----------------------------------------------------------------------------- named refusals


def _metadata_with(real: bytes, mutate) -> bytes:
    """The real metadata ``real``, changed by ``mutate``, pickled again as DCP does."""
    meta = pickle.loads(real)  # trusted: our own fresh checkpoint
    mutate(meta)
    return pickle.dumps(meta, protocol=4)


def _storage_path(path: str):
    def mutate(meta) -> None:
        info = next(iter(meta.storage_data.values()))
        info.relative_path = path

    return mutate


_DIST = "torch.distributed.checkpoint.metadata"


def _hostile_cases(marker: Path, real: bytes) -> list[tuple[str, bytes, str]]:
    cmd = _touch(marker)
    deep = _program(EMPTY_DICT + EMPTY_TUPLE + TUPLE1 * 200_000 + _str("x") + SETITEM)
    return [
        ("os.system", _program(_call("os", "system", cmd)), r"os\.system"),
        ("posix.system", _program(_call("posix", "system", cmd)), r"posix\.system"),
        (
            "builtins.eval",
            _program(_call("builtins", "eval", f"__import__('os').system('{cmd}')")),
            "eval",
        ),
        (
            "builtins.exec",
            _program(_call("builtins", "exec", f"import os; os.system('{cmd}')")),
            "exec",
        ),
        ("builtins.getattr", _program(_call("builtins", "getattr", "x", "y")), "getattr"),
        ("builtins.__import__", _program(_call("builtins", "__import__", "os")), "__import__"),
        ("subprocess.Popen", _program(_call("subprocess", "Popen", "touch", str(marker))), "Popen"),
        (
            "dotted via dcp",
            _program(_call("torch.distributed.checkpoint.filesystem", "os.system", cmd)),
            "dotted",
        ),
        ("dotted via metadata", _program(_call(_DIST, "os.system", cmd)), "dotted"),
        (
            "dotted module path",
            _program(_call("torch.distributed.checkpoint.filesystem.os", "system", cmd)),
            "never holds",
        ),
        ("torch._C", _program(_call("torch", "_C", "x")), r"torch\._C"),
        ("torch.load", _program(_call("torch", "load", str(marker))), r"torch\.load"),
        (
            "copyreg._reconstructor",
            _program(_call("copyreg", "_reconstructor", "x")),
            "_reconstructor",
        ),
        ("functools.partial", _program(_call("functools", "partial", "x")), "partial"),
        (
            "dcp module prefix",
            _program(_call("torch.distributed.checkpoint.state_dict_saver", "save", "x")),
            "never holds",
        ),
        ("GLOBAL opcode", _program(b"cos\nsystem\n" + MARK + _str(cmd) + TUPLE + REDUCE), "GLOBAL"),
        ("INST opcode", _program(MARK + _str(cmd) + b"ios\nsystem\n"), "INST"),
        ("OBJ opcode", _program(MARK + _global("os", "system") + _str(cmd) + b"o"), r"os\.system"),
        ("EXT1 opcode", _program(b"\x82\xf0" + MARK + _str(cmd) + TUPLE + REDUCE), "EXT1"),
        ("EXT2 opcode", _program(b"\x83\xf0\x00" + MARK + _str(cmd) + TUPLE + REDUCE), "EXT2"),
        (
            "EXT4 opcode",
            _program(b"\x84\xf0\x00\x00\x00" + MARK + _str(cmd) + TUPLE + REDUCE),
            "EXT4",
        ),
        ("PERSID", _program(b"P" + cmd.encode() + b"\n"), "PERSID"),
        ("BINPERSID", _program(_str(cmd) + b"Q"), "BINPERSID"),
        (
            "NEWOBJ_EX",
            _program(_global(_DIST, "Metadata") + EMPTY_TUPLE + EMPTY_DICT + NEWOBJ_EX),
            "NEWOBJ_EX",
        ),
        ("protocol 2", b"\x80\x02" + _call("os", "system", cmd) + STOP, "protocol"),
        ("REDUCE of a DCP class", _program(_call(_DIST, "Metadata", "x")), r"REDUCE of .*Metadata"),
        (
            "NEWOBJ of torch.Size",
            _program(_global("torch", "Size") + EMPTY_TUPLE + NEWOBJ),
            r"NEWOBJ of torch\.Size",
        ),
        (
            "NEWOBJ with arguments",
            _program(_global(_DIST, "StorageMeta") + _str("x") + TUPLE1 + NEWOBJ),
            "with arguments",
        ),
        (
            "BUILD on a class",
            _program(_global(_DIST, "StorageMeta") + EMPTY_DICT + BUILD),
            "BUILD on _Global",
        ),
        (
            "BUILD with slot state",
            _program(
                _global(_DIST, "StorageMeta")
                + EMPTY_TUPLE
                + NEWOBJ
                + NONE
                + EMPTY_DICT
                + TUPLE2
                + BUILD
            ),
            "fields other than",
        ),
        (
            "BUILD of __class__",
            _program(
                _global(_DIST, "StorageMeta")
                + EMPTY_TUPLE
                + NEWOBJ
                + EMPTY_DICT
                + _str("__class__")
                + _global(_DIST, "Metadata")
                + SETITEM
                + BUILD
            ),
            "fields other than",
        ),
        ("bare class in a tuple", _program(_global(_DIST, "Metadata") + TUPLE1), "not an instance"),
        (
            "bare class in a dict",
            _program(EMPTY_DICT + _str("k") + _global(_DIST, "Metadata") + SETITEM),
            "not an instance",
        ),
        (
            "bare class as REDUCE args",
            _program(_global("torch", "Size") + _global(_DIST, "Metadata") + TUPLE1 + REDUCE),
            "torch.Size",
        ),
        (
            "torch.Size of a str",
            _program(_global("torch", "Size") + _str("abc") + TUPLE1 + REDUCE),
            "tuple of ints",
        ),
        (
            "a tuple as dict key",
            _program(EMPTY_DICT + EMPTY_TUPLE + TUPLE1 + _str("x") + SETITEM),
            "key of type tuple",
        ),
        ("a deep tuple as dict key", deep, "key of type tuple"),
        ("set opcodes", _program(b"\x8f"), "EMPTY_SET"),
        ("not a Metadata", _program(_str("hello")), "not a Metadata"),
        ("trailing stack", _program(_str("a") + _str("b")), "exactly one object"),
        ("truncated", PROTO4 + _str("abc")[:3], "truncated|ends before"),
        (
            "data file outside",
            _metadata_with(real, _storage_path("../../etc/passwd")),
            "not a file name",
        ),
        (
            "absolute data file",
            _metadata_with(real, _storage_path("/etc/passwd")),
            "not a file name",
        ),
        ("dot-dot data file", _metadata_with(real, _storage_path("..")), "not a file name"),
    ]


@pytest.fixture(scope="module")
def plain_meta(tmp_path_factory) -> bytes:
    return (_save_plain(tmp_path_factory.mktemp("plain")) / ".metadata").read_bytes()


def test_each_hostile_construct_is_refused_by_name(plain_meta, tmp_path):
    marker = tmp_path / "pwned"
    copyreg.add_extension("os", "system", 0xF0)  # EXT* would resolve through this registry
    try:
        for label, payload, match in _hostile_cases(marker, plain_meta):
            with pytest.raises(pickle.UnpicklingError, match=match):
                load_metadata(payload)
                pytest.fail(f"{label}: loaded")
            assert not marker.exists(), label
    finally:
        copyreg.remove_extension("os", "system", 0xF0)


# ----------------------------------------------------------------------------- fuzzing

_EVENTS: list[str] = []
_ARMED = threading.local()


def _audit(event: str, args: tuple) -> None:
    if getattr(_ARMED, "on", False):
        _EVENTS.append(event)


_HOOKED: list[bool] = []


def _hook() -> None:
    """Audit hooks cannot be removed: install one per process, armed only around a call."""
    if not _HOOKED:
        sys.addaudithook(_audit)
        _HOOKED.append(True)


def _load_watched(data: bytes):
    """load_metadata(data), failing the test if any audit event fires meanwhile."""
    _hook()
    _EVENTS.clear()
    _ARMED.on = True
    try:
        return load_metadata(data)
    finally:
        _ARMED.on = False
        assert not _EVENTS, f"the reader raised audit events {sorted(set(_EVENTS))}"


_HOSTILE = [
    ("os", "system"),
    ("posix", "system"),
    ("builtins", "eval"),
    ("builtins", "exec"),
    ("builtins", "getattr"),
    ("builtins", "__import__"),
    ("builtins", "open"),
    ("subprocess", "Popen"),
    ("subprocess", "check_output"),
    ("torch", "_C"),
    ("torch", "load"),
    ("torch", "Size.__new__"),
    ("torch.distributed.checkpoint.filesystem", "os.system"),
    ("torch.distributed.checkpoint.metadata", "os.system"),
    ("torch.distributed.checkpoint.metadata", "torch.load"),
    ("torch.distributed.checkpoint.filesystem.os", "system"),
    ("torch.distributed.checkpoint.state_dict_saver", "save"),
    ("copyreg", "_reconstructor"),
    ("functools", "partial"),
    ("collections", "OrderedDict"),
    ("pathlib", "Path"),
    ("builtins", "set"),
]
_ALLOWED = sorted(allowed_globals())
_CMD = "touch /tmp/ringtrain-fuzz-{pid}-should-not-exist"


def _marker() -> Path:
    return Path(_CMD.format(pid=os.getpid()).split()[1])


def _pair(draw) -> tuple[str, str]:
    return draw(st.sampled_from(_HOSTILE) if draw(st.booleans()) else st.sampled_from(_ALLOWED))


@st.composite
def _item(draw, depth: int = 0) -> bytes:
    """One fragment that leaves exactly one object on the stack (when well formed)."""
    choices = ["str", "int", "global", "call", "newobj", "inst", "obj", "ext", "persid"]
    if depth < 3:
        choices += ["tuple", "dict", "list", "build", "newobj_ex"]
    kind = draw(st.sampled_from(choices))
    if kind == "str":
        return _str(draw(st.sampled_from([_CMD.format(pid=os.getpid()), "x", "__class__", "fqn"])))
    if kind == "int":
        return b"K" + bytes([draw(st.integers(0, 255))])
    module, name = _pair(draw)
    if kind == "global":
        return _global(module, name)
    if kind == "call":
        args = draw(st.lists(_item(depth + 1), max_size=2))
        return _global(module, name) + MARK + b"".join(args) + TUPLE + REDUCE
    if kind == "newobj":
        return _global(module, name) + EMPTY_TUPLE + NEWOBJ
    if kind == "newobj_ex":
        return _global(module, name) + EMPTY_TUPLE + EMPTY_DICT + NEWOBJ_EX
    if kind == "inst":
        return MARK + _str(_CMD.format(pid=os.getpid())) + f"i{module}\n{name}\n".encode()
    if kind == "obj":
        return MARK + _global(module, name) + _str("x") + b"o"
    if kind == "ext":
        return draw(st.sampled_from([b"\x82\xf1", b"\x83\xf1\x00", b"\x84\xf1\x00\x00\x00"]))
    if kind == "persid":
        return draw(st.sampled_from([b"Pos system\n", _str("os.system") + b"Q"]))
    inner = draw(st.lists(_item(depth + 1), min_size=1, max_size=3))
    if kind == "tuple":
        return MARK + b"".join(inner) + TUPLE
    if kind == "list":
        return EMPTY_LIST + b"".join(x + APPEND for x in inner)
    if kind == "dict":
        return EMPTY_DICT + b"".join(_str(f"k{i}") + x + SETITEM for i, x in enumerate(inner))
    # build: an object, then a state
    return inner[0] + (inner[1] if len(inner) > 1 else EMPTY_DICT) + BUILD


@st.composite
def _programs(draw) -> bytes:
    body = draw(st.lists(_item(), min_size=1, max_size=4))
    glue = draw(st.sampled_from([b"", MEMOIZE, b"h\x00", TUPLE1, REDUCE, BUILD, NEWOBJ]))
    return _program(glue.join(body))


def _check_outcome(data: bytes) -> None:
    marker = _marker()
    try:
        meta = _load_watched(data)
    except pickle.UnpicklingError:
        pass
    else:  # anything that loads is DCP metadata made of allowed types (it re-pickles cleanly)
        assert type(meta).__name__ == "Metadata"
        assert _globals_of(pickle.dumps(meta, protocol=4)) <= allowed_globals()
    finally:
        ran = marker.exists()
        marker.unlink(missing_ok=True)  # a failing example must fail again when replayed
    assert not ran, "a command from the pickle ran"


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_programs())
def test_fuzz_generated_programs_run_nothing(data):
    copyreg.add_extension("os", "system", 0xF1)
    try:
        _check_outcome(data)
    finally:
        copyreg.remove_extension("os", "system", 0xF1)


_REAL: dict[str, bytes] = {}


def _real_metadata() -> bytes:
    if "plain" not in _REAL:
        directory = Path(os.environ.get("TMPDIR", "/tmp")) / f"ringtrain-fuzz-{os.getpid()}"
        try:
            _REAL["plain"] = (_save_plain(directory) / ".metadata").read_bytes()
        finally:
            shutil.rmtree(directory, ignore_errors=True)
    return _REAL["plain"]


@st.composite
def _mutations(draw) -> bytes:
    data = bytearray(_real_metadata())
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["flip", "insert", "delete", "truncate", "splice"]))
        at = draw(st.integers(0, len(data)))
        if kind == "flip" and at < len(data):
            data[at] = draw(st.integers(0, 255))
        elif kind == "insert":
            module, name = _pair(draw)
            snippet = draw(
                st.sampled_from(
                    [
                        _global(module, name),
                        _call(module, name, _CMD.format(pid=os.getpid())),
                        _global(module, name) + EMPTY_TUPLE + NEWOBJ,
                        EMPTY_DICT + BUILD,
                        b"\x82\xf1",
                    ]
                )
            )
            data[at:at] = snippet
        elif kind == "delete":
            del data[at : at + draw(st.integers(1, 16))]
        elif kind == "truncate":
            del data[at:]
        else:
            module, name = _pair(draw)
            data[at : at + draw(st.integers(0, 8))] = _global(module, name)
    return bytes(data)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_mutations())
def test_fuzz_mutated_real_metadata_runs_nothing(data):
    copyreg.add_extension("os", "system", 0xF1)
    try:
        _check_outcome(data)
    finally:
        copyreg.remove_extension("os", "system", 0xF1)


def test_fuzz_oracle_sees_code_running():
    """The fuzz oracle is not blind: plain pickle of such a program fires its audit events."""
    _hook()
    _EVENTS.clear()
    _ARMED.on = True
    try:
        pickle.loads(_program(_call("os", "system", "true")))
    finally:
        _ARMED.on = False
    assert "os.system" in _EVENTS
