"""Per-step timing inside a worker: where each training step's time goes.

A :class:`StepTimer` is held by the worker plug-in :class:`TimingPlugin` (:mod:`ringtrain.worker.
hooks`) when ``MonitorConfig.timing`` is on (the worker bootstrap registers it:
:func:`install_timer`; nothing of the worker's core knows about it). It is fed through the hooks
and by hooks on the objects ringtrain already prepares, so the user's loop does not change:

- the prepared data loader's batch hooks mark the step boundary and the data wait
  (``loader_fetch_start`` / ``loader_fetch_end``): a step runs from one ``next(loader)`` call to
  the next;
- forward pre/post hooks on the prepared model and a post-accumulate-grad hook on each parameter
  bound the compute (forward + backward: from the first forward of the step to the last gradient
  accumulated);
- the timer is the :class:`~ringtrain.worker.hooks.CommObserver` the plug-in offers
  ``prepare_model`` (``before_wrap``): DDP's communication hook reports each bucket's allreduce
  from launch to completion, and its size, to it (:mod:`ringtrain.comm.ddp`,
  ``MonitorConfig.comm_timing="hook"``, the default on GPU); without a hook (``"wait"``, the
  default on CPU, where a hook would cost one more pass over the gradients) the communication
  the step waits for is the gap between the last gradient and ``optimizer.step()``;
- global optimizer step hooks time ``optimizer.step()``.

Each closed step is split into disjoint parts that add up to its wall time::

    step = data + compute + comm_exposed + optimizer + other

``comm_exposed`` runs from the last gradient being ready to the end of the last collective: the
communication not hidden behind backward (with DDP's copy of the last bucket before its launch),
which includes waiting for slower peers. ``comm`` (total, overlapped
or not) is reported beside it. ``other`` is everything else (the loss's ``.item()``, logging,
``report()``...). On the heartbeat thread the plug-in takes one aggregated *window* every
``MonitorConfig.timing_interval_s`` seconds (:meth:`StepTimer.take_window`) and sends it to the
driver: one message per window, never one per step; the first ``report()`` of an epoch sends one
ahead of itself, carrying the epoch (the driver's progress bar and ETA).

On GPU the parts are host-side times: kernels run asynchronously, so a part ends when its work
was queued, not when it finished; the step total is exact whenever the loop synchronises (a
``.item()``, the optimizer reading gradients). Totals are right, the split is approximate.

The cost is a few ``time.perf_counter()`` calls per step plus one per parameter per backward
(see docs/benchmarks.md, "Monitoring overhead").
"""

from __future__ import annotations

import contextlib
import math
import statistics
import threading
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from ringtrain.monitor.memory import memory_stats
from ringtrain.monitor.outer_loop import outer_fields
from ringtrain.wire.channel import Timing
from ringtrain.worker.hooks import ModelSetup, StopTraining, WorkerPlugin

if TYPE_CHECKING:
    from ringtrain.worker.session import Session

_now = time.perf_counter

PARTS = ("data_s", "compute_s", "comm_exposed_s", "optimizer_s", "other_s")
"""The disjoint parts of a step, in seconds; they add up to the step time."""


def warmup_steps(total_steps: int, fraction: float = 0.2, minimum: int = 2) -> int:
    """Steps of a ``total_steps``-step run that are warm-up: ``max(minimum, ceil(fraction *
    total_steps))`` (``ringtrain bench``'s rule, docs/scaling.md)."""
    return max(minimum, math.ceil(fraction * total_steps))


class StepLimitReached(StopTraining):
    """Raised from the prepared data loader when the run's ``max_steps`` (``ringtrain bench``)
    are done; the worker treats it as a clean finish (a
    :class:`~ringtrain.worker.hooks.StopTraining`)."""


class _Step:
    __slots__ = (
        "comm_bytes",
        "comm_last_done",
        "comm_s",
        "data_end",
        "fwd_first",
        "fwd_last_end",
        "grad_last",
        "opt_intervals",
        "opt_open",
        "outer",
        "samples",
        "start",
    )

    def __init__(self, start: float) -> None:
        self.start = start
        self.data_end: float | None = None
        self.fwd_first: float | None = None
        self.fwd_last_end: float | None = None
        self.grad_last: float | None = None
        self.comm_s = 0.0
        self.comm_bytes = 0
        self.comm_last_done: float | None = None
        self.opt_open: float | None = None
        self.opt_intervals: list[tuple[float, float]] = []
        self.outer = [0.0, 0, 0]  # DiLoCo's outer loop in this step: seconds, bytes, exchanges
        self.samples = 0


class StepTimer:
    """Times the steps of one worker and aggregates them into windows.

    The ``*_start``/``*_end`` methods are called from the training thread by ringtrain's hooks;
    :meth:`comm_done` may come from a communication thread; :meth:`take_window` from the
    heartbeat thread.

    Args:
        max_steps: raise :class:`StepLimitReached` when the loader is asked for a batch after
            this many steps (``None``: no limit). With a limit, no window mixes warm-up steps
            (the first :func:`warmup_steps` ``(max_steps)``) with later ones, so that a
            benchmark can leave out exactly the warm-up however long its windows are.
    """

    def __init__(self, max_steps: int | None = None) -> None:
        self.max_steps = max_steps
        # The step count at which a window ends early (the warm-up's end), or None.
        self.cut_at = warmup_steps(max_steps) if max_steps else None
        self.comm_timing = "auto"
        # Set when DDP's allreduce runs without a timing hook (MonitorConfig.comm_timing="wait"):
        # the bytes it allreduces per step.
        self.wait_comm_bytes: int | None = None
        self.optimizer_hooks: tuple[Any, Any] | None = None  # torch's hook handles
        self.steps_total = 0
        # DiLoCo's outer steps so far on this rank (outer_sync_done); None: no DiLoCo.
        self.outer_steps: int | None = None
        self._step: _Step | None = None
        self._loader_driven = False
        self._lock = threading.Lock()
        # Closed steps since the last window: (step_s, data, compute, exposed, opt, other,
        # comm_s, comm_bytes, samples, outer_s, outer_bytes, outer_exchanges).
        self._closed: list[tuple[float, ...]] = []

    # ------------------------------------------------------------------ step boundaries
    def loader_fetch_start(self) -> None:
        """The loop asks the prepared loader for its next batch: the previous step ends and a
        new one starts (its data wait begins now).

        Raises:
            StepLimitReached: when ``max_steps`` steps are done.
        """
        t = _now()
        self._loader_driven = True
        if self._step is not None:
            self._close(t)
            self._step = None
        if self.max_steps is not None and self.steps_total >= self.max_steps:
            raise StepLimitReached(f"max_steps={self.max_steps} reached")
        self._step = _Step(t)

    def loader_fetch_end(self, samples: int) -> None:
        """The batch (``samples`` samples) is in hand: the data wait ends."""
        step = self._step
        if step is not None:
            step.data_end = _now()
            step.samples = samples

    def loader_exhausted(self) -> None:
        """The loader stopped: at the end of an epoch the step opened by the fetch that found no
        batch is dropped (the epoch's last step already ended when the loop asked for more);
        when the loop broke out early, the step in progress ends now."""
        step = self._step
        if step is not None:
            if step.data_end is not None:
                self._close(_now())
            self._step = None

    # ------------------------------------------------------------------ inside a step
    def forward_start(self) -> None:
        step = self._step
        if step is not None and step.fwd_first is None:
            step.fwd_first = _now()

    def forward_end(self) -> None:
        step = self._step
        if step is not None:
            step.fwd_last_end = _now()

    def grad_ready(self) -> None:
        step = self._step
        if step is not None:
            step.grad_last = _now()

    def comm_done(self, started: float, nbytes: int) -> None:
        """One collective launched at ``started`` (a ``perf_counter`` time) on ``nbytes`` bytes
        has completed."""
        t = _now()
        step = self._step
        if step is None:
            return
        with self._lock:
            step.comm_s += t - started
            step.comm_bytes += nbytes
            if step.comm_last_done is None or t > step.comm_last_done:
                step.comm_last_done = t

    def outer_sync_done(
        self, seconds: float, nbytes: int, exchanges: int, outer_steps: int
    ) -> None:
        """DiLoCo's outer loop ran after an inner step (:mod:`ringtrain.parallel.diloco`): it took
        ``seconds`` of the training thread and put ``nbytes`` bytes on the wire in ``exchanges``
        new exchanges; the rank has applied ``outer_steps`` outer steps in all. Counted in the
        step in progress (none open: only the count is kept)."""
        with self._lock:
            self.outer_steps = outer_steps
            step = self._step
            if step is not None:
                step.outer[0] += seconds
                step.outer[1] += nbytes
                step.outer[2] += exchanges

    def optimizer_start(self) -> None:
        step = self._step
        if step is None and not self._loader_driven:
            # No prepared loader: steps run from one optimizer.step() to the next.
            self._step = step = _Step(_now())
        if step is not None:
            step.opt_open = _now()

    def optimizer_end(self) -> None:
        step = self._step
        if step is None or step.opt_open is None:
            return
        t = _now()
        step.opt_intervals.append((step.opt_open, t))
        step.opt_open = None
        if not self._loader_driven:
            self._close(t)
            self._step = _Step(t)

    # ------------------------------------------------------------------ aggregation
    def _close(self, end: float) -> None:
        step = self._step
        assert step is not None
        total = max(0.0, end - step.start)
        data = (step.data_end - step.start) if step.data_end is not None else 0.0
        compute_end = step.grad_last if step.grad_last is not None else step.fwd_last_end
        compute = 0.0
        if step.fwd_first is not None and compute_end is not None:
            compute = max(0.0, compute_end - step.fwd_first)
        with self._lock:
            comm_s, comm_bytes, last_done = step.comm_s, step.comm_bytes, step.comm_last_done
            outer = tuple(float(v) for v in step.outer)
        exposed_from = compute_end if compute_end is not None else step.start
        exposed_to = min(last_done, end) if last_done is not None else exposed_from
        if (
            last_done is None
            and self.wait_comm_bytes is not None
            and step.grad_last is not None
            and step.opt_intervals
        ):
            # Untimed DDP allreduce: backward returned once it was done, and the optimizer
            # followed; the gap after the last gradient is the wait for communication.
            exposed_to = min(step.opt_intervals[0][0], end)
            comm_s = max(0.0, exposed_to - exposed_from)
            comm_bytes = self.wait_comm_bytes
        exposed = max(0.0, exposed_to - exposed_from)
        opt = 0.0
        for a, b in step.opt_intervals:
            # DistributedOptimizer.step() waits for communication: that wait is exposed
            # communication, counted once.
            overlap = max(0.0, min(b, exposed_to) - max(a, exposed_from))
            opt += (b - a) - overlap
        other = max(0.0, total - data - compute - exposed - opt)
        record: tuple[float, ...] = (total, data, compute, exposed, opt, other, comm_s)
        record += (float(comm_bytes), float(step.samples), *outer)
        with self._lock:
            self._closed.append(record)
            self.steps_total += 1

    def take_window(self) -> dict[str, Any] | None:
        """Aggregate the steps closed since the last call (``None`` when there are none). When
        they straddle the warm-up's end (``max_steps`` given), only the warm-up steps are
        aggregated; the rest stay for the next call (callers that flush call until ``None``).

        Returns:
            The window: ``steps``, ``step`` (cumulative), ``step_s`` (median, seconds),
            ``step_s_mean``, the mean of each part in :data:`PARTS` (seconds per step; they sum to
            ``step_s_mean``), ``comm_s``, ``comm_bytes`` (mean bytes allreduced per step),
            ``busy_s`` (``step_s_mean - comm_exposed_s``), ``samples``, ``samples_per_s``,
            ``window_s``, the memory readings of :func:`~ringtrain.monitor.memory.memory_stats`,
            and for a DiLoCo model the figures of
            :func:`~ringtrain.monitor.outer_loop.outer_fields`.
        """
        with self._lock:
            records, self._closed = self._closed, []
            steps_total = self.steps_total
            outer_steps = self.outer_steps
            first = steps_total - len(records) + 1  # the step number of records[0]
            if self.cut_at is not None and first <= self.cut_at < steps_total:
                keep = self.cut_at - first + 1
                records, self._closed = records[:keep], records[keep:]
                steps_total = self.cut_at
        if not records:
            return None
        n = len(records)
        cols = list(zip(*records, strict=True))
        window_s = sum(cols[0])
        mean = [sum(c) / n for c in cols]
        samples = int(sum(cols[8]))
        out: dict[str, Any] = {
            "steps": n,
            "step": steps_total,
            "step_s": statistics.median(cols[0]),
            "step_s_mean": mean[0],
        }
        for i, name in enumerate(PARTS, start=1):
            out[name] = mean[i]
        out["comm_s"] = mean[6]
        out["comm_bytes"] = mean[7]
        out["busy_s"] = max(0.0, mean[0] - mean[3])
        out["samples"] = samples
        out["samples_per_s"] = samples / window_s if window_s > 0 else 0.0
        out["window_s"] = window_s
        out.update(memory_stats())
        if outer_steps is not None:
            out.update(outer_fields(outer_steps, n, window_s, *(sum(c) for c in cols[9:12])))
        return out


# ---------------------------------------------------------------------------------- hooks


class TimingPlugin(WorkerPlugin):
    """The worker plug-in that holds and feeds ``timer`` and sends its windows
    (:mod:`ringtrain.worker.hooks`): a prepared loader's batches bound the steps and the data
    wait; the prepared model gets forward, gradient and optimizer-step hooks
    (:func:`instrument_model`); the timer is the model's communication observer; windows go to
    the driver from the heartbeat thread every ``interval_s`` seconds, ahead of the first report
    of each epoch, and when the train function ends.

    Args:
        timer: the step timer.
        session: the worker's session (its channel and rank; ``None``: send nothing).
        interval_s: seconds between windows (``None``: a step limit only, send nothing).

    Raises (from ``on_batch_start``):
        StepLimitReached: when the timer's ``max_steps`` are done.
    """

    def __init__(
        self, timer: StepTimer, session: Session | None = None, interval_s: float | None = None
    ) -> None:
        self.timer = timer
        self.session = session
        self.interval_s = interval_s
        self._last_window = time.monotonic()
        self._send_lock = threading.Lock()
        # Where training is (on_epoch): sent with each window for the driver's progress bar.
        self.hint: dict[str, Any] = {}
        self._hint_sent: dict[str, Any] | None = None

    def on_batch_start(self) -> None:
        self.timer.loader_fetch_start()  # ends the previous step, starts this one

    def on_batch(self, batch: object) -> None:
        self.timer.loader_fetch_end(batch_size_of(batch))

    def on_batches_end(self) -> None:
        self.timer.loader_exhausted()  # end of epoch, or the loop broke out early

    def before_wrap(self, setup: ModelSetup) -> None:
        setup.comm_observer = self.timer  # DDP's allreduce reports to it (comm.ddp)

    def after_wrap(self, setup: ModelSetup) -> None:
        instrument_model(self.timer, setup.model, setup.module)

    def on_epoch(self, epoch: int, num_epochs: int, steps: int | None) -> None:
        hint: dict[str, Any] = {
            "progress_epoch": epoch,
            "progress_epochs": num_epochs,
            "progress_epoch_start_step": int(self.timer.steps_total),
        }
        if steps is not None:
            hint["progress_epoch_steps"] = steps
        self.hint = hint

    def on_report(self, metrics: Mapping[str, object], round_: int) -> None:
        if self.hint and self.hint is not self._hint_sent:
            # A new epoch since the last window: send one now, ahead of this report on the same
            # connection, so that the driver shows this round's epoch as "k/N" (once per epoch).
            self._hint_sent = self.hint
            self.send()

    def on_heartbeat(self) -> None:
        if self.interval_s is None or time.monotonic() - self._last_window < self.interval_s:
            return
        self._last_window = time.monotonic()
        self.send()

    def on_worker_stop(self, error: BaseException | None) -> None:
        """The last window (the steps since the previous one), unless the channel is gone."""
        with contextlib.suppress(OSError, ValueError):
            self.send()

    def send(self) -> None:
        """Send the steps timed since the last window to the driver (nothing when none, or
        without a channel). Called from the heartbeat and the training thread.

        Raises:
            OSError, ValueError: the channel is closed.
        """
        session = self.session
        if self.interval_s is None or session is None or session.channel is None:
            return
        with self._send_lock:
            while (window := self.timer.take_window()) is not None:  # the warm-up apart
                window = {**window, **self.hint}
                rank = session.context.world_rank
                session.channel.send(Timing(rank=rank, time=time.time(), window=window))


def install_timer(
    session: Session, max_steps: int | None, comm_timing: str, interval_s: float | None
) -> StepTimer:
    """Register a :class:`TimingPlugin` with a new :class:`StepTimer` on ``session``.

    Args:
        session: the worker's session.
        max_steps: end the run cleanly after this many steps (``ringtrain bench``); None: no limit.
        comm_timing: ``MonitorConfig.comm_timing``.
        interval_s: seconds between the timing windows the heartbeat sends; None: send none
            (a step limit without timing).

    Returns:
        The timer (the plug-in's ``timer``).
    """
    timer = StepTimer(max_steps=max_steps)
    timer.comm_timing = comm_timing
    session.hooks.register(TimingPlugin(timer, session, interval_s))
    if interval_s is not None:
        session.beat_at_least_every(interval_s)
    return timer


def batch_size_of(batch: Any) -> int:
    """Samples in ``batch``: the first dimension of its first tensor (nested in tuples, lists,
    dicts), 0 when it has none."""
    for _ in range(8):
        if hasattr(batch, "shape"):
            return int(batch.shape[0]) if len(batch.shape) else 1
        if isinstance(batch, dict):
            batch = next(iter(batch.values()), None)
        elif isinstance(batch, (list, tuple)) and batch:
            batch = batch[0]
        else:
            return 0
    return 0


def instrument_model(timer: StepTimer, model: Any, params_of: Any) -> None:
    """Hook ``model`` (the module the loop calls, possibly DDP-wrapped) for forward timing and
    each parameter of ``params_of`` that requires a gradient for backward timing."""
    model.register_forward_pre_hook(lambda _m, _a: timer.forward_start())
    model.register_forward_hook(lambda _m, _a, _o: timer.forward_end())
    grad_ready = timer.grad_ready
    for p in params_of.parameters():
        if p.requires_grad and hasattr(p, "register_post_accumulate_grad_hook"):
            p.register_post_accumulate_grad_hook(lambda _p: grad_ready())
    install_optimizer_hooks(timer)


def install_optimizer_hooks(timer: StepTimer) -> None:
    """Time every ``optimizer.step()`` of this process (torch's global optimizer step hooks);
    once per timer (the handles are kept in ``timer.optimizer_hooks``)."""
    if timer.optimizer_hooks is not None:
        return
    from torch.optim.optimizer import (
        register_optimizer_step_post_hook,
        register_optimizer_step_pre_hook,
    )

    pre = register_optimizer_step_pre_hook(lambda _o, _a, _k: timer.optimizer_start())
    post = register_optimizer_step_post_hook(lambda _o, _a, _k: timer.optimizer_end())
    timer.optimizer_hooks = (pre, post)
