"""The worker side of a campaign: the user's train function, wrapped to inject its faults.

:class:`ChaosTrainFn` is what a campaign's runs ship to their workers instead of the bare train
function. In each worker it listens to ``TrainState.step`` (a step hook,
:mod:`ringtrain.worker.hooks`): it stops the run cleanly after ``steps`` steps, fires this rank's
faults when their step comes, and writes one JSON line per fired fault and per worker start (its
first step) to ``log_dir/faults.jsonl``, which the campaign reads for the recovery times. A fault
fires once per run: the first process to reach it creates ``log_dir/fired/N`` (exclusively) before
acting, so a restarted attempt (or a resumed driver) that passes the same step again goes on.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

from ringtrain.chaos.plan import Fault
from ringtrain.worker.hooks import StepState

LOG_FILE = "faults.jsonl"
FIRED_DIR = "fired"


def log_event(log_dir: str, **fields: Any) -> None:
    """Append one JSON line to ``log_dir/faults.jsonl`` (one ``write``: lines never interleave)."""
    line = (json.dumps({"time": time.time(), "pid": os.getpid(), **fields}) + "\n").encode()
    fd = os.open(os.path.join(log_dir, LOG_FILE), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        os.write(fd, line)
        os.fsync(fd)
    finally:
        os.close(fd)


def read_log(log_dir: str) -> list[dict[str, Any]]:
    """The lines of ``log_dir/faults.jsonl`` (a torn last line is skipped)."""
    try:
        with open(os.path.join(log_dir, LOG_FILE)) as f:
            lines = f.read().splitlines()
    except FileNotFoundError:
        return []
    out = []
    for line in lines:
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


class ChaosTrainFn:
    """``train_fn`` with a fault schedule (picklable; runs in every worker).

    Args:
        train_fn: the user's train function, ``train_fn(config)`` or ``train_fn()``.
        plan: the faults of this run (empty for the clean run).
        log_dir: a local directory every worker can write (the run's chaos directory).
        steps: raise ``StepLimitReached`` (a clean finish) when ``TrainState.step`` would pass
            this value; ``None``: no limit.
    """

    def __init__(
        self,
        train_fn: Callable[..., Any],
        plan: tuple[Fault, ...],
        log_dir: str,
        steps: int | None,
    ) -> None:
        self.train_fn = train_fn
        self.plan = tuple(plan)
        self.log_dir = os.path.abspath(log_dir)
        self.steps = steps
        self.__name__ = getattr(train_fn, "__name__", "train_fn")

    def __call__(self, config: dict[str, Any]) -> None:
        from ringtrain.worker import session as session_mod

        sess = session_mod.current_session()
        injector = _Injector(self, sess.context.world_rank, sess.context.attempt)
        sess.hooks.register(injector)
        try:
            session_mod.call_train_fn(self.train_fn, config)
        finally:
            sess.hooks.unregister(injector)


class _Injector:
    """One worker process's step listener: step limit, first-step record, faults."""

    def __init__(self, fn: ChaosTrainFn, rank: int, attempt: int) -> None:
        self.fn = fn
        self.rank = rank
        self.attempt = attempt
        self.started = time.time()
        self.last_t: float | None = None
        self.step_s = 0.0
        self.logged_first = False
        self.pending = [(i, f) for i, f in enumerate(fn.plan) if f.rank == rank]
        if any(f.kind == "write" for _, f in self.pending):
            _install_write_hook()

    def on_step(self, state: StepState) -> None:
        """The worker's step hook (:mod:`ringtrain.worker.hooks`): ``state.step`` was just set."""
        step = state.step
        now = time.time()
        if self.last_t is not None:
            self.step_s = now - self.last_t
        self.last_t = now
        steps = self.fn.steps
        if steps is not None and step > steps:
            from ringtrain.monitor.timing import StepLimitReached

            raise StepLimitReached(f"ringtrain chaos: steps={steps} reached")
        if not self.logged_first:
            self.logged_first = True
            log_event(
                self.fn.log_dir,
                event="first_step",
                rank=self.rank,
                step=step,
                attempt=self.attempt,
                started=self.started,
            )
        for item in [p for p in self.pending if p[1].step <= step]:
            self.pending.remove(item)
            index, fault = item
            if self._claim(index):
                self._fire(index, fault, step, state)

    def _claim(self, index: int) -> bool:
        fired = os.path.join(self.fn.log_dir, FIRED_DIR)
        os.makedirs(fired, exist_ok=True)
        try:
            os.close(os.open(os.path.join(fired, str(index)), os.O_CREAT | os.O_EXCL, 0o600))
        except FileExistsError:
            return False
        return True

    def _log(self, index: int, fault: Fault, step: int, **more: Any) -> None:
        log_event(
            self.fn.log_dir,
            event="fault",
            index=index,
            kind=fault.kind,
            rank=self.rank,
            step=step,
            attempt=self.attempt,
            **more,
        )

    def _fire(self, index: int, fault: Fault, step: int, state: StepState) -> None:
        if fault.kind == "bitflip":
            from ringtrain.integrity.inject import flip_bit

            model = state["model"]  # type: ignore[index]
            flip_bit(next(getattr(model, "module", model).parameters()), bit=20)
            self._log(index, fault, step)
        elif fault.kind == "kill":
            delay = fault.delay_frac * self.step_s

            def die() -> None:
                self._log(index, fault, step, delay_s=round(delay, 4))
                os.kill(os.getpid(), signal.SIGKILL)

            threading.Timer(delay, die).start()
        elif fault.kind == "hang":
            self._log(index, fault, step)
            os.kill(os.getpid(), signal.SIGSTOP)
        elif fault.kind == "driver":
            from ringtrain.worker.preempt import driver_pid

            driver = driver_pid()  # the parent, or the grandparent of a worker the pool forked
            self._log(index, fault, step, driver_pid=driver)
            os.kill(driver, signal.SIGKILL)
            time.sleep(60)  # the driver's death takes this worker down (PR_SET_PDEATHSIG)
            os._exit(1)
        elif fault.kind == "write":
            _armed.append(lambda path: self._log(index, fault, step, file=path))


# Armed "write" faults of this process: each is called with the file being written, then the
# process is SIGKILLed after that file's first bytes are on disk.
_armed: list[Callable[[str], None]] = []
_hook_installed = False


def _install_write_hook() -> None:
    """Wrap ``ringtrain.checkpoint.writer.write_files`` in this worker process (the session
    looks it up at each checkpoint), so that an armed fault kills the process half-way through
    a file of the next checkpoint."""
    global _hook_installed
    if _hook_installed:
        return
    _hook_installed = True
    from ringtrain.checkpoint import writer

    original = writer.write_files

    def write_files(fs: Any, dest: str, writers: dict[str, Any], **kwargs: Any) -> Any:
        if not _armed or not writers:
            return original(fs, dest, writers, **kwargs)
        on_kill = _armed.pop(0)
        name, write = next(iter(writers.items()))
        target = dest.rstrip("/") + "/" + name

        def killing(f: Any) -> None:
            write(_KillAfterFirstWrite(f, lambda: on_kill(target)))

        return original(fs, dest, {**writers, name: killing}, **kwargs)

    writer.write_files = write_files


class _KillAfterFirstWrite:
    """A file wrapper: the first write goes to disk (flushed), then the process is SIGKILLed."""

    def __init__(self, inner: Any, before_kill: Callable[[], None]) -> None:
        self.inner = inner
        self.before_kill = before_kill

    def write(self, data: Any) -> int:
        n = int(self.inner.write(data))
        self.inner.flush()
        self.before_kill()
        os.kill(os.getpid(), signal.SIGKILL)
        return n

    def flush(self) -> None:
        self.inner.flush()
