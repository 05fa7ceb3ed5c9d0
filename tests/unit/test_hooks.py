"""The worker hook registry (ringtrain/worker/hooks.py): every hook a no-op by default, plug-ins
called in registration order, a plug-in receiving each hook from the real core call sites
(TrainState's step and restore, a prepared loader, prepare_model, report), and one way to call a
train function."""

from __future__ import annotations

import ast
import importlib
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import ringtrain as rt
from ringtrain.worker import hooks as hooks_mod
from ringtrain.worker import session as session_mod
from ringtrain.worker.hooks import HOOKS, HookRegistry, LoaderSetup, ModelSetup, WorkerPlugin


class Recorder(WorkerPlugin):
    """Records every hook it receives as ``(name, tag, *args)``."""

    def __init__(self, log: list[tuple[Any, ...]], tag: str = "") -> None:
        self.log = log
        self.tag = tag

    def on_worker_start(self, session: Any) -> None:
        self.log.append(("on_worker_start", self.tag, session))

    def on_worker_stop(self, error: BaseException | None) -> None:
        self.log.append(("on_worker_stop", self.tag, error))

    def on_group_formed(self) -> None:
        self.log.append(("on_group_formed", self.tag))

    def on_group_broken(self) -> None:
        self.log.append(("on_group_broken", self.tag))

    def on_epoch(self, epoch: int, num_epochs: int, steps: int | None) -> None:
        self.log.append(("on_epoch", self.tag, epoch, num_epochs, steps))

    def on_step(self, state: Any) -> None:
        self.log.append(("on_step", self.tag, state.step))

    def on_prepare_optimizer(self, optimizer: object) -> None:
        self.log.append(("on_prepare_optimizer", self.tag, optimizer))

    def on_optimizer_step(self, optimizer: object) -> None:
        self.log.append(("on_optimizer_step", self.tag, optimizer))

    def on_batch_start(self) -> None:
        self.log.append(("on_batch_start", self.tag))

    def on_batch(self, batch: object) -> None:
        self.log.append(("on_batch", self.tag, batch))

    def on_batches_end(self) -> None:
        self.log.append(("on_batches_end", self.tag))

    def on_prepare_loader(self, setup: LoaderSetup) -> None:
        self.log.append(("on_prepare_loader", self.tag, setup.world_size))

    def before_wrap(self, setup: ModelSetup) -> None:
        self.log.append(("before_wrap", self.tag, setup.module is setup.model))

    def after_wrap(self, setup: ModelSetup) -> None:
        self.log.append(("after_wrap", self.tag, setup.model))

    def on_restore(self, state: object, checkpoint: object) -> None:
        self.log.append(("on_restore", self.tag, checkpoint))

    def on_report(self, metrics: Any, round_: int) -> None:
        self.log.append(("on_report", self.tag, dict(metrics), round_))

    def on_heartbeat(self) -> None:
        self.log.append(("on_heartbeat", self.tag))


def test_every_hook_does_nothing_by_default():
    registry = HookRegistry()
    calls = _one_call_of_each(registry)
    for name, args in calls.items():
        assert getattr(registry, name)(*args) is None, name
        assert getattr(WorkerPlugin, name)(object(), *args) is None, name
    # A plug-in that defines one hook is called for that one only.
    log: list[tuple[Any, ...]] = []

    class OnlyStep(WorkerPlugin):
        def on_step(self, state: Any) -> None:
            log.append(("on_step", state.step))

    registry.register(OnlyStep())
    for name, args in calls.items():
        getattr(registry, name)(*args)
    assert log == [("on_step", 7)]


def test_plugins_run_in_registration_order_and_can_leave():
    log: list[tuple[Any, ...]] = []
    registry = HookRegistry()
    first, second = Recorder(log, "a"), Recorder(log, "b")
    registry.register(first)
    registry.register(second)
    assert registry.plugins() == (first, second)
    assert registry.find(Recorder) is first
    for name, args in _one_call_of_each(registry).items():
        getattr(registry, name)(*args)
    assert [entry[0] for entry in log[::2]] == list(HOOKS)
    assert [entry[1] for entry in log] == ["a", "b"] * len(HOOKS)
    registry.unregister(first)
    log.clear()
    registry.on_batch_start()
    assert log == [("on_batch_start", "b")]
    registry.unregister(first)  # not registered: nothing
    assert registry.find(Recorder) is second


def test_a_structural_plugin_and_the_registration_errors():
    class Duck:  # no base class: only the methods it has are called
        def __init__(self) -> None:
            self.steps: list[int] = []

        def on_step(self, state: Any) -> None:
            self.steps.append(state.step)

    registry = HookRegistry()
    duck = Duck()
    registry.register(duck)
    registry.on_step(_Step(3))
    registry.on_batch(object())  # Duck has no on_batch
    assert duck.steps == [3]
    with pytest.raises(ValueError, match="already registered"):
        registry.register(duck)

    class Misspelt:
        def on_steps(self, state: Any) -> None: ...

    with pytest.raises(ValueError, match="defines none of the worker hooks"):
        registry.register(Misspelt())

    class Leave(BaseException):
        pass

    class Raises(WorkerPlugin):
        def on_batch_start(self) -> None:
            raise Leave("pause")

    registry.register(Raises())
    with pytest.raises(Leave):
        registry.on_batch_start()


class _Step:
    def __init__(self, step: int) -> None:
        self.step = step


def _one_call_of_each(registry: HookRegistry) -> dict[str, tuple[Any, ...]]:
    module = torch.nn.Linear(1, 1)
    loader = torch.utils.data.DataLoader(list(range(4)), batch_size=2)
    return {
        "on_worker_start": (object(),),
        "on_worker_stop": (None,),
        "on_group_formed": (),
        "on_group_broken": (),
        "on_epoch": (0, 3, 2),
        "on_step": (_Step(7),),
        "on_prepare_optimizer": (object(),),
        "on_optimizer_step": (object(),),
        "on_batch_start": (),
        "on_batch": ("batch",),
        "on_batches_end": (),
        "on_prepare_loader": (LoaderSetup(loader, world_size=1, world_rank=0),),
        "before_wrap": (ModelSetup(module, module, torch.device("cpu"), 1),),
        "after_wrap": (ModelSetup(module, module, torch.device("cpu"), 1),),
        "on_restore": (object(), "ckpt"),
        "on_report": ({"loss": 1.0}, 0),
        "on_heartbeat": (),
    }


def test_the_core_calls_each_hook(tmp_path):
    """A plug-in in a plain process's session gets the hooks of the real call sites."""
    log: list[tuple[Any, ...]] = []
    hooks = session_mod.current_hooks()
    assert session_mod.installed_session() is not None
    hooks.register(Recorder(log))
    model = rt.prepare_model(torch.nn.Linear(2, 1))
    dataset = torch.utils.data.TensorDataset(torch.arange(8.0).reshape(4, 2))
    loader = rt.prepare_data_loader(torch.utils.data.DataLoader(dataset, batch_size=2))
    state = rt.TrainState(model=model, data_loader=loader)
    optimizer = rt.prepare_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    for _ in loader:
        optimizer.step()
        state.step += 1
    rt.report({"loss": torch.tensor(0.5)})
    names = [entry[0] for entry in log]
    assert names == [
        "before_wrap",
        "after_wrap",
        "on_prepare_loader",
        "on_prepare_optimizer",
        "on_batch_start",
        "on_batch",
        "on_optimizer_step",
        "on_step",
        "on_batch_start",
        "on_batch",
        "on_optimizer_step",
        "on_step",
        "on_batch_start",
        "on_batches_end",
        "on_report",
    ], names
    assert log[0][2] is True and log[1][2] is model  # before: unwrapped; after: the result
    assert [e[2] for e in log if e[0] == "on_step"] == [1, 2]
    assert all(e[2] is optimizer for e in log if e[0].endswith("optimizer_step"))
    assert [e[2] for e in log if e[0] == "on_prepare_optimizer"] == [optimizer]
    assert log[-1][2:] == ({"loss": 0.5}, 0)

    ckpt = _InMemory(state.to_payload())
    log.clear()
    assert state.restore(ckpt)  # type: ignore[arg-type]
    assert [entry[0] for entry in log] == ["on_restore"] and log[0][2] is ckpt


class _InMemory:
    """A checkpoint held in memory as a TrainState payload (as an elastic snapshot is)."""

    uri = "memory-payload"

    def __init__(self, files: dict[str, Any]) -> None:
        self.in_memory_files = files


CORE = (
    "ringtrain.worker.session",
    "ringtrain.worker.state",
    "ringtrain.worker.state_files",
    "ringtrain.worker.accumulate",
    "ringtrain.prepare",
    "ringtrain.worker.data",
    "ringtrain.worker.hooks",
)
"""The worker's core: plug-ins (elastic, timing, precision) hook into it; it imports none."""
PLUGIN_USERS = ("elastic", "launch", "controller", "trainer.py")
"""Where ``ringtrain.elastic`` may be imported (src/ringtrain/...): elastic itself, the
bootstrap that starts the elastic runner, the driver's policy, and the trainer's validation."""


def test_the_core_imports_no_plugin():
    """Importing each core module afresh loads no ``ringtrain.elastic`` module (nor, but for
    prepare's DDP communication hook, the step timer), and no module outside
    :data:`PLUGIN_USERS` imports ``ringtrain.elastic`` (at module or function level: the AST is
    read, so an import inside a function counts)."""
    saved = {k: m for k, m in sys.modules.items() if k == "ringtrain" or k.startswith("ringtrain.")}
    try:
        for name in CORE:
            for key in [k for k in sys.modules if k == "ringtrain" or k.startswith("ringtrain.")]:
                del sys.modules[key]
            importlib.import_module(name)
            loaded = sorted(k for k in sys.modules if k.startswith("ringtrain.elastic"))
            assert not loaded, f"importing {name} imported {loaded}"
            if name != "ringtrain.prepare":  # comm/ddp.py times DDP's allreduce hook itself
                assert "ringtrain.monitor.timing" not in sys.modules, name
    finally:
        for key in [k for k in sys.modules if k == "ringtrain" or k.startswith("ringtrain.")]:
            del sys.modules[key]
        sys.modules.update(saved)
    root = Path(hooks_mod.__file__).parent
    offenders = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if rel.split("/")[0] in PLUGIN_USERS:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            if any(n == "ringtrain.elastic" or n.startswith("ringtrain.elastic.") for n in names):
                offenders.append(f"{rel}:{node.lineno}")
    assert not offenders, f"ringtrain.elastic imported outside {PLUGIN_USERS}: {offenders}"


def test_call_train_fn_passes_the_config_only_to_a_function_that_takes_one():
    seen: list[Any] = []
    session_mod.call_train_fn(lambda config: seen.append(config), {"lr": 1})
    session_mod.call_train_fn(lambda: seen.append("none"), {"lr": 1})
    session_mod.call_train_fn(lambda *args: seen.append(args), None)
    session_mod.call_train_fn(lambda config=None: seen.append(config), None)
    assert seen == [{"lr": 1}, "none", ({},), {}]
    assert hooks_mod.SYNC_TOKEN_ATTR.startswith("_ringtrain")


def test_break_group_ends_the_connections_then_lets_plugins_settle_then_destroys(monkeypatch):
    """``ElasticRuntime.break_group``'s order: the connections end first (so that collectives
    in flight fail at once), then ``on_group_broken`` (plug-ins settle and drop them), then the
    group is destroyed; and the preemption agreement drops its flag allreduce and its group."""
    from ringtrain.elastic import runtime as runtime_mod
    from ringtrain.worker.preempt import PreemptionPlugin

    order: list[str] = []
    registry = HookRegistry()

    class Broken(WorkerPlugin):
        def on_group_broken(self) -> None:
            order.append("on_group_broken")

    class Sockets:
        def shutdown(self) -> int:
            order.append("shutdown")
            return 2

    class Work:
        def wait(self, timeout: Any = None) -> bool:
            order.append("wait")
            return True

    class Session:
        hooks = registry

    plugin = PreemptionPlugin.__new__(PreemptionPlugin)
    plugin._pending = (Work(), torch.zeros(3), "old agreement group")
    plugin._group, plugin._group_for = "old agreement group", "old world"
    registry.register(Broken())
    registry.register(plugin)
    runtime = runtime_mod.ElasticRuntime.__new__(runtime_mod.ElasticRuntime)
    runtime.session = Session()  # type: ignore[assignment]
    runtime.group_sockets = Sockets()  # type: ignore[assignment]
    monkeypatch.setattr(runtime_mod, "destroy_process_group", lambda: order.append("destroy"))
    runtime.break_group()
    assert order == ["shutdown", "on_group_broken", "wait", "destroy"]
    assert plugin._pending is None and plugin._group is None and plugin._group_for is None
