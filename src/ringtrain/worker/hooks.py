"""Worker lifecycle hooks: how elastic training, step timing and precision plug into a worker
without the core (session, state, prepare, data) importing them.

Each worker's :class:`~ringtrain.worker.session.Session` holds one :class:`HookRegistry`. A plug-in
is any object with some of the methods of :class:`WorkerPlugin` (subclass it to inherit a no-op for
every hook you leave out); ``session.hooks.register(plugin)`` adds it. The core calls the
registry at each point of the worker's life, and the registry calls, in registration order, the
plug-ins that define that hook::

    from ringtrain.worker.hooks import WorkerPlugin
    from ringtrain.worker.session import current_session

    class PrintSteps(WorkerPlugin):
        def on_step(self, state):
            print("step", state.step)

    current_session().hooks.register(PrintSteps())

============================  ==================================================================
hook                          when (who calls it)
============================  ==================================================================
``on_worker_start(session)``  the worker's session is installed, before the train function
``on_worker_stop(error)``     the train function returned (``error=None``) or raised
``on_group_formed()``         the default process group was formed (again, after an elastic
                              resize): every rank at once, so a plug-in may make sub-groups
``on_group_broken()``         elastic runs: the group's connections were just ended, before it
                              is destroyed: finish (they fail fast now) and drop in-flight work
``on_epoch(epoch, n, steps)`` ``TrainState.epochs`` enters ``epoch`` of ``n`` (``steps`` a pass)
``on_step(state)``            ``TrainState.step`` was set (after the new value is stored)
``on_prepare_optimizer(opt)`` ``prepare_optimizer`` wrapped ``opt`` (before its first step)
``on_optimizer_step(opt)``    a prepared optimizer's ``step()`` returned (also a step the fp16
                              loss scaler skipped): DiLoCo's outer sync runs here
``on_batch_start()``          a prepared data loader is about to fetch its next batch
``on_batch(batch)``           a prepared data loader hands ``batch`` out (on the device)
``on_batches_end()``          a prepared data loader's iteration ended (epoch end, or a break)
``on_prepare_loader(setup)``  ``prepare_data_loader`` starts: may replace the loader
``before_wrap(setup)``        ``prepare_model``: placed on the device, not yet wrapped
``after_wrap(setup)``         ``prepare_model``: wrapped (DDP/FSDP), about to be returned
``on_restore(state, ckpt)``   ``TrainState.restore()`` loaded ``ckpt`` into ``state``
``on_report(metrics, round)`` ``report()`` is about to send round ``round``'s metrics
``on_heartbeat()``            the heartbeat thread beats (the only hook not on the training
                              thread: what a plug-in sends from here must be thread-safe)
============================  ==================================================================

An exception a hook raises propagates to the caller: that is how the elastic plug-in leaves the
train function to pause for a grow, and how the timing and preemption plug-ins end a run cleanly
(:class:`StopTraining`: a ``BaseException`` a train function's ``except Exception`` does not
catch). What ``prepare_model`` wires into the model travels in :class:`ModelSetup`: the
precision a precision plug-in applies in ``before_wrap``, and the :class:`CommObserver` a timing
plug-in offers there, which DDP's communication hook reports to.

The plug-ins (none of them imported by the core: session, state, data, loader, accumulate, this
module): precision (:mod:`ringtrain.worker.precision`, registered by ``prepare_model``,
``prepare_optimizer`` or ``backward`` on first use), step timing
(:mod:`ringtrain.monitor.timing`, registered by the worker bootstrap when the run asks for it),
the preemption agreement (:mod:`ringtrain.worker.preempt`, registered by the bootstrap in every
ringtrain-launched worker), elastic training (:mod:`ringtrain.elastic.runtime`) and the chaos
injector (:mod:`ringtrain.chaos.worker`).
A hook that is not defined costs nothing: the registry keeps, per hook, the tuple of bound
methods to call, rebuilt on each ``register``/``unregister``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

if TYPE_CHECKING:
    import torch
    from torch.utils.data import DataLoader

T = TypeVar("T")

HOOKS = (
    "on_worker_start",
    "on_worker_stop",
    "on_group_formed",
    "on_group_broken",
    "on_epoch",
    "on_step",
    "on_prepare_optimizer",
    "on_optimizer_step",
    "on_batch_start",
    "on_batch",
    "on_batches_end",
    "on_prepare_loader",
    "before_wrap",
    "after_wrap",
    "on_restore",
    "on_report",
    "on_heartbeat",
)
"""Every hook's name, in the order of a worker's life."""


class StopTraining(BaseException):
    """Raised by a plug-in's hook to end the train function cleanly (the worker then finishes
    as if it had returned): the timing plug-in at ``max_steps``
    (:class:`~ringtrain.monitor.timing.StepLimitReached`), the preemption plug-in at the agreed
    stop step (:class:`~ringtrain.worker.preempt.PreemptStop`). A ``BaseException``, so that a
    train function's ``except Exception`` does not swallow it."""


class CommObserver(Protocol):
    """What a plug-in that times communication offers ``prepare_model`` in
    :attr:`ModelSetup.comm_observer` (the step timer, :class:`ringtrain.monitor.timing.StepTimer`):
    DDP's wrapping (:func:`ringtrain.comm.ddp.wrap_ddp`) times its gradient allreduce for it,
    and DiLoCo's plug-in reports its outer loop to it.

    Attributes:
        comm_timing: ``MonitorConfig.comm_timing``: ``"hook"`` (time each bucket in a DDP
            communication hook), ``"wait"`` (no hook: the observer measures the step's wait),
            ``"auto"`` (a hook on CUDA or with a compression hook, else ``"wait"``).
        wait_comm_bytes: set by the wrapping in ``"wait"`` mode: the bytes one step's allreduce
            puts on the wire.
    """

    comm_timing: str
    wait_comm_bytes: int | None

    def comm_done(self, started: float, nbytes: int) -> None:
        """One bucket's collective, launched at ``started`` (``time.perf_counter()``) and
        carrying ``nbytes`` bytes, completed."""
        ...

    def outer_sync_done(
        self, seconds: float, nbytes: int, exchanges: int, outer_steps: int
    ) -> None:
        """DiLoCo's outer loop (:mod:`ringtrain.parallel.diloco`) ran after an inner step:
        ``seconds`` of the training thread, ``nbytes`` bytes sent in ``exchanges`` exchanges it
        started; ``outer_steps``: the outer steps this rank has applied in all (a resumed
        run's included)."""
        ...


SYNC_TOKEN_ATTR = "_ringtrain_restored_token"
"""Set on a module (unwrapped) by a restore plug-in to the :attr:`ModelSetup.sync_token` of the
state it loaded into it: ``comm.ddp.sync_unless_restored`` compares the two at the first forward
to skip DDP's initial broadcast (see :attr:`ModelSetup.sync_token`)."""


class StepState(Protocol):
    """What a step hook sees of a :class:`~ringtrain.TrainState`."""

    @property
    def step(self) -> int: ...


@dataclass
class LoaderSetup:
    """What ``prepare_data_loader`` is about to shard; ``on_prepare_loader`` hooks may change it.

    Attributes:
        data_loader: the user's ``DataLoader``; a plug-in may replace it (the elastic plug-in
            sets the per-worker batch of the current world size).
        world_size: workers the loader is sharded over.
        world_rank: this worker's rank.
        micro_batch_size: the largest micro-batch ``PreparedDataLoader.micro_batches`` cuts a
            batch into (samples); ``None``: no splitting.
    """

    data_loader: DataLoader[Any]
    world_size: int
    world_rank: int
    micro_batch_size: int | None = None


@dataclass
class ModelSetup:
    """The model ``prepare_model`` is preparing; ``before_wrap``/``after_wrap`` hooks may change it.

    Attributes:
        module: the user's module, on its device (unwrapped); ``before_wrap`` may replace it.
        model: what ``prepare_model`` returns: ``module`` before wrapping, the DDP/FSDP wrapper
            after; ``after_wrap`` may replace it.
        device: the worker's device.
        world_size: workers the model is replicated or sharded over.
        sync_token: set by a ``before_wrap`` hook when every rank is about to load the same
            state into the module before its first forward (an elastic snapshot): DDP then skips
            its initial broadcast, and checks at the first forward that every rank's module
            carries this token in :data:`SYNC_TOKEN_ATTR` (``None``: DDP broadcasts as usual).
        precision: ``prepare_model(precision=...)``, normalised (``"32"``, ``"bf16-mixed"``,
            ``"16-mixed"``): the precision plug-in applies it in ``before_wrap``.
        comm_observer: set by a ``before_wrap`` hook that times communication (the timing
            plug-in): the wrapping reports each gradient allreduce to it.
    """

    module: torch.nn.Module
    model: torch.nn.Module
    device: torch.device
    world_size: int
    sync_token: int | None = None
    precision: str = "32"
    comm_observer: CommObserver | None = None


class WorkerPlugin(Protocol):
    """The hooks a plug-in may define; each does nothing by default.

    Subclass it explicitly to inherit the no-ops, or define only the methods you need on any
    object (the registry calls what is there). Hooks run on the training thread.
    """

    def on_worker_start(self, session: Any) -> None:
        """The session (:class:`ringtrain.worker.session.Session`) is installed; no train
        function ran."""
        return None

    def on_worker_stop(self, error: BaseException | None) -> None:
        """The train function returned (``error`` is None) or raised ``error``."""
        return None

    def on_group_formed(self) -> None:
        """The default process group was just formed (by the worker bootstrap, or re-formed by
        an elastic resize). Every rank of the group calls it at the same point, so a plug-in
        may create its own sub-groups here (``torch.distributed.new_group``: a collective);
        the elastic runtime notes their gloo connections with the group's, to end them all when
        a peer is lost."""
        return None

    def on_group_broken(self) -> None:
        """Elastic runs: this rank is leaving its process group (a pause to resize, or a lost
        peer), whose connections were just ended; the group is destroyed next. Wait for the
        collectives a plug-in still has in flight on the group or its sub-groups (they end at
        once now, with an error if a peer never took part) and drop them and the sub-groups:
        a process group destroyed with work still queued on it can block its destructor, and
        with it the training thread, wherever its last reference is dropped."""
        return None

    def on_epoch(self, epoch: int, num_epochs: int, steps: int | None) -> None:
        """``TrainState.epochs`` enters ``epoch`` (0-based) of ``num_epochs``; ``steps``: the
        batches of one pass of the loader (``None``: unknown)."""
        return None

    def on_step(self, state: StepState) -> None:
        """``state.step`` was just set (a ``TrainState``); may raise to leave the train function."""
        return None

    def on_prepare_optimizer(self, optimizer: object) -> None:
        """``prepare_optimizer`` returns ``optimizer`` (a
        :class:`~ringtrain.worker.precision.PreparedOptimizer`), before its first step."""
        return None

    def on_optimizer_step(self, optimizer: object) -> None:
        """``optimizer`` (a :class:`~ringtrain.worker.precision.PreparedOptimizer`) finished a
        ``step()`` call, whether or not the fp16 loss scaler skipped the update: every rank calls
        it at the same steps, so a plug-in may run a collective here (DiLoCo's outer sync)."""
        return None

    def on_batch_start(self) -> None:
        """A prepared loader is about to fetch a batch; may raise to leave the train function."""
        return None

    def on_batch(self, batch: object) -> None:
        """A prepared loader hands ``batch`` out (already on the device)."""
        return None

    def on_batches_end(self) -> None:
        """A prepared loader's iteration ended (epoch end, or the loop broke out of it)."""
        return None

    def on_prepare_loader(self, setup: LoaderSetup) -> None:
        """``prepare_data_loader`` starts; ``setup`` may be changed in place."""
        return None

    def before_wrap(self, setup: ModelSetup) -> None:
        """``prepare_model`` placed the module; wrapping comes next. ``setup`` may be changed."""
        return None

    def after_wrap(self, setup: ModelSetup) -> None:
        """``prepare_model`` wrapped the module into ``setup.model``; ``setup`` may be changed."""
        return None

    def on_restore(self, state: object, checkpoint: object) -> None:
        """``TrainState.restore()`` loaded ``checkpoint`` into ``state``."""
        return None

    def on_report(self, metrics: Mapping[str, object], round_: int) -> None:
        """``report()`` is about to send round ``round_``'s (clean) ``metrics``."""
        return None

    def on_heartbeat(self) -> None:
        """The heartbeat thread beats (every ``worker_timeout_s / 5``, or more often if a
        plug-in asked with :meth:`~ringtrain.worker.session.Session.beat_at_least_every`). Runs
        on that thread; ``OSError``/``ValueError`` (the channel closed) end the heartbeat."""
        return None


def _defined(plugin: object, name: str) -> Callable[..., Any] | None:
    """``plugin``'s bound hook ``name``, or None when it has none or inherits the no-op."""
    method = getattr(plugin, name, None)
    if method is None or not callable(method):
        return None
    if getattr(type(plugin), name, None) is getattr(WorkerPlugin, name):
        return None
    return method


class HookRegistry:
    """The plug-ins of one worker and the dispatch of every hook to them (in registration order).

    The registry has the methods of :class:`WorkerPlugin` itself: ``hooks.on_step(state)``
    calls every registered plug-in's ``on_step``.
    """

    def __init__(self) -> None:
        self._plugins: list[object] = []
        self._calls: dict[str, tuple[Callable[..., Any], ...]] = dict.fromkeys(HOOKS, ())

    # ------------------------------------------------------------------ membership
    def register(self, plugin: object) -> None:
        """Add ``plugin`` (after those already registered; its hooks run after theirs).

        Raises:
            ValueError: if ``plugin`` is already registered, or defines none of the hooks
                (:data:`HOOKS`; a misspelt method name would otherwise be silently ignored).
        """
        if any(p is plugin for p in self._plugins):
            raise ValueError(f"{type(plugin).__name__} is already registered")
        if not any(_defined(plugin, name) for name in HOOKS):
            raise ValueError(
                f"{type(plugin).__name__} defines none of the worker hooks "
                f"({', '.join(HOOKS)}); check the method names"
            )
        self._plugins.append(plugin)
        self._rebuild()

    def unregister(self, plugin: object) -> None:
        """Remove ``plugin``; nothing when it is not registered."""
        self._plugins = [p for p in self._plugins if p is not plugin]
        self._rebuild()

    def plugins(self) -> tuple[object, ...]:
        """The registered plug-ins, in registration order."""
        return tuple(self._plugins)

    def find(self, kind: type[T]) -> T | None:
        """The first registered plug-in that is an instance of ``kind``, or None."""
        for plugin in self._plugins:
            if isinstance(plugin, kind):
                return plugin
        return None

    def _rebuild(self) -> None:
        calls: dict[str, tuple[Callable[..., Any], ...]] = {}
        for name in HOOKS:
            found = (_defined(p, name) for p in self._plugins)
            calls[name] = tuple(m for m in found if m is not None)
        self._calls = calls

    # ------------------------------------------------------------------ dispatch
    def on_worker_start(self, session: Any) -> None:
        for call in self._calls["on_worker_start"]:
            call(session)

    def on_worker_stop(self, error: BaseException | None) -> None:
        for call in self._calls["on_worker_stop"]:
            call(error)

    def on_group_formed(self) -> None:
        for call in self._calls["on_group_formed"]:
            call()

    def on_group_broken(self) -> None:
        for call in self._calls["on_group_broken"]:
            call()

    def on_epoch(self, epoch: int, num_epochs: int, steps: int | None) -> None:
        for call in self._calls["on_epoch"]:
            call(epoch, num_epochs, steps)

    def on_step(self, state: StepState) -> None:
        for call in self._calls["on_step"]:
            call(state)

    def on_prepare_optimizer(self, optimizer: object) -> None:
        for call in self._calls["on_prepare_optimizer"]:
            call(optimizer)

    def on_optimizer_step(self, optimizer: object) -> None:
        for call in self._calls["on_optimizer_step"]:
            call(optimizer)

    def on_batch_start(self) -> None:
        for call in self._calls["on_batch_start"]:
            call()

    def on_batch(self, batch: object) -> None:
        for call in self._calls["on_batch"]:
            call(batch)

    def on_batches_end(self) -> None:
        for call in self._calls["on_batches_end"]:
            call()

    def on_prepare_loader(self, setup: LoaderSetup) -> None:
        for call in self._calls["on_prepare_loader"]:
            call(setup)

    def before_wrap(self, setup: ModelSetup) -> None:
        for call in self._calls["before_wrap"]:
            call(setup)

    def after_wrap(self, setup: ModelSetup) -> None:
        for call in self._calls["after_wrap"]:
            call(setup)

    def on_restore(self, state: object, checkpoint: object) -> None:
        for call in self._calls["on_restore"]:
            call(state, checkpoint)

    def on_report(self, metrics: Mapping[str, object], round_: int) -> None:
        for call in self._calls["on_report"]:
            call(metrics, round_)

    def on_heartbeat(self) -> None:
        for call in self._calls["on_heartbeat"]:
            call()
