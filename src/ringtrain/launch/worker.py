"""The worker bootstrap: ``python -m ringtrain.launch.worker [--script PATH ARGS...]``.

Started by a launcher with the variables of :func:`ringtrain.cluster.env.worker_environment`. It

1. arranges to die with its parent (``PR_SET_PDEATHSIG`` on Linux, plus a watchdog thread that
   polls the parent pid everywhere), so no worker outlives a killed driver, to print its
   threads' stacks on :data:`~ringtrain.launch.base.STACK_DUMP_SIGNAL`, and to keep its
   multiprocessing temp dir where its reaper removes it
   (:func:`~ringtrain.launch.reaper.use_worker_temp_dir`);
2. connects to the driver's authenticated channel (its address and secret are the only
   ``RINGTRAIN_*`` variables it reads: :data:`ringtrain.cluster.env.BOOTSTRAP_ENV`), says Hello and
   receives its Start message, whose :class:`~ringtrain.wire.worker_config.WorkerConfig` says
   everything else (timeouts, checkpoint mode, timing, step limit, elastic settings);
3. sets the torch thread count, installs the session, and in function mode initialises the
   process group (gloo on CPU, NCCL on GPU) before calling ``train_fn(config)``; in script mode runs
   the script as ``__main__`` (the script calls ``init_process_group`` itself, or lets ringtrain do
   it on first need);
4. reports an exception (type, message, traceback) to the driver before exiting with status 1, or
   sends Done and exits 0. The traceback starts at the user's code (the bootstrap's and runpy's
   frames are cut) and is printed by the driver, once: this process prints it only when the
   channel is gone. Source lines the driver shipped with the payload (functions defined in a
   notebook cell or ``python -c``) are put in :mod:`linecache` first, so the traceback shows
   them.
"""

from __future__ import annotations

import ctypes
import faulthandler
import linecache
import os
import runpy
import signal
import socket
import sys
import threading
import time
import traceback
from typing import Any

from ringtrain.cluster.distributed import destroy_process_group, init_process_group
from ringtrain.cluster.env import RingtrainEnvironment
from ringtrain.launch.base import STACK_DUMP_SIGNAL
from ringtrain.launch.reaper import use_worker_temp_dir
from ringtrain.monitor.timing import install_timer
from ringtrain.wire.channel import Done, Hello, Start, WorkerChannel, WorkerError
from ringtrain.wire.worker_config import WorkerConfig
from ringtrain.worker import preempt as preempt_worker
from ringtrain.worker.hooks import StopTraining

PR_SET_PDEATHSIG = 1
FINISH_WRITE_TIMEOUT_S = 120.0


def die_with_parent() -> None:
    """Exit when the parent process (the driver) dies, even if it is SIGKILLed."""
    parent = os.getppid()
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL("libc.so.6", use_errno=True)
            libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        except OSError:
            pass
    if os.getppid() != parent or parent == 1:
        os._exit(1)  # the parent died before prctl took effect

    def watch() -> None:
        while True:
            time.sleep(0.5)
            if os.getppid() != parent:
                os._exit(1)

    threading.Thread(target=watch, name="ringtrain-parent-watchdog", daemon=True).start()


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # Before any thread starts: SIGTERM from anyone but the driver becomes a preemption notice.
    preempt_worker.watch_worker_signals()
    die_with_parent()
    # Its multiprocessing temp dir (DataLoader workers' sockets), which whoever reaps this
    # process removes: a SIGKILLed worker's exit handlers never run.
    use_worker_temp_dir()
    # Where a hung rank is stuck, on demand (a train function may install its own handler).
    faulthandler.register(STACK_DUMP_SIGNAL, file=sys.stderr, all_threads=True)
    # Before the Hello: loading torch's libraries holds the GIL for long stretches (a 0.4 s
    # heartbeat thread saw 1.5 s gaps at load 18 on 2 cores), which after the Hello reads as
    # "stopped answering" beyond a short worker_timeout_s. Before it, the time counts against
    # the driver's connect allowance (controller/health.HELLO_TIMEOUT_S) instead.
    import torch

    from ringtrain.worker import session as session_mod

    environment = RingtrainEnvironment()
    ctx = environment.context()
    channel = WorkerChannel.connect(environment.driver_address(), environment.authkey())
    channel.send(Hello(rank=ctx.world_rank, pid=os.getpid(), hostname=socket.gethostname()))
    start: Start = channel.recv()
    config = start.config
    sess = session_mod.Session(
        context=ctx.with_config(config),
        channel=channel,
        next_round=config.start_round,
        async_checkpoint=config.async_checkpoint,
    )
    _setup_timing(sess, config)
    session_mod.install_session(sess)
    preempt_worker.register(sess)  # stops at an agreed step on a preemption notice
    _setup_integrity(sess, config)
    sess.start_heartbeat(heartbeat_interval(config.worker_timeout_s))
    sess.hooks.on_worker_start(sess)

    code = 0
    try:
        import torch

        torch.set_num_threads(num_threads())
        if argv and argv[0] == "--script":
            _run_script(argv[1], argv[2:], start, sess)
        else:
            _run_function(start, sess)
        sess.hooks.on_worker_stop(None)
        sess.wait_for_checkpoint()  # the last checkpoint must be on storage before Done
        channel.send(Done(rank=sess.context.world_rank, time=time.time(), rounds=sess.next_round))
    except BaseException as exc:
        code = exc.code if isinstance(exc, SystemExit) and isinstance(exc.code, int) else 1
        _stop_hooks(sess, exc)
        _report_error(sess, channel, exc)
    finally:
        destroy_process_group()
        channel.close()
    return code


def _stop_hooks(sess: Any, exc: BaseException) -> None:
    """The plug-ins' ``on_worker_stop(exc)``; one that fails is logged, never masks ``exc``."""
    try:
        sess.hooks.on_worker_stop(exc)
    except Exception:
        traceback.print_exc()


def num_threads() -> int:
    """torch's intra-op threads: ``OMP_NUM_THREADS``, which the launcher sets (OpenMP and MKL
    read it when the process starts, before any code of ours could tell them)."""
    try:
        return max(1, int(os.environ.get("OMP_NUM_THREADS", "1")))
    except ValueError:
        return 1


def _run_script(script: str, script_args: list[str], start: Start, sess: Any) -> None:
    """Script mode: run ``script`` as ``__main__`` with ``script_args`` as its arguments."""
    sys.argv = [script, *script_args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    if start.latest_checkpoint:
        sess.latest_checkpoint = _resume_checkpoint(start)
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exc:
        if exc.code not in (None, 0):
            raise
    except StopTraining:  # a plug-in ended the run cleanly (max_steps, a preemption stop)
        pass


def _run_function(start: Start, sess: Any) -> None:
    """Function mode: unpickle ``(train_fn, config)`` from ``start`` and call it (elastic runs
    through :func:`ringtrain.elastic.worker.run_elastic`)."""
    import cloudpickle

    from ringtrain.worker.session import call_train_fn

    assert start.payload is not None, "function mode needs a payload"
    train_fn, config, *extra = cloudpickle.loads(start.payload)
    install_sources(extra[0] if extra else {})
    # After unpickling: the train function's module may register the fsspec protocol of the
    # run's storage.
    if start.latest_checkpoint:
        sess.latest_checkpoint = _resume_checkpoint(start)
    elastic = start.config.elastic is not None
    if not elastic:
        init_process_group(sess.context)
        sess.hooks.on_group_formed()  # the plug-ins' sub-groups (the step agreement's)
    try:
        if elastic:  # ScalingConfig(num_workers=(min, max)): resizes in place
            from ringtrain.elastic.worker import run_elastic

            run_elastic(train_fn, config, sess)
        else:
            call_train_fn(train_fn, config)
    except StopTraining:  # a plug-in ended the run cleanly (max_steps, a preemption stop)
        pass


def _report_error(sess: Any, channel: WorkerChannel, exc: BaseException) -> None:
    """Tell the driver why this worker fails (or print it when the channel is gone)."""
    # A checkpoint this rank was writing in the background is finished first (bounded): a
    # peer's failure must not also cost the checkpoint this rank had nearly saved.
    sess.wait_for_checkpoint(timeout_s=FINISH_WRITE_TIMEOUT_S)
    formatted = user_traceback(exc)
    try:
        channel.send(
            WorkerError(
                rank=sess.context.world_rank,  # an elastic resize may have renumbered it
                time=time.time(),
                exc_type=type(exc).__name__,
                message=str(exc),
                traceback=formatted,
            )
        )
    except OSError:  # the driver cannot print it: this rank's stderr is all that is left
        sys.stderr.write(formatted)


_INTERNAL = (
    os.path.dirname(os.path.abspath(__file__)),  # ringtrain/launch: this bootstrap
    os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "elastic"),
    # session.call_train_fn, the one caller of the train function:
    os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "session.py"),
    os.path.dirname(os.path.abspath(runpy.__file__ or "")) + os.sep + "runpy.py",
    "<frozen runpy>",
)


def user_traceback(exc: BaseException) -> str:
    """``exc`` formatted as Python would, from the first frame outside the bootstrap (this
    module, ``runpy``, the elastic runner, ``session.call_train_fn``) on: what the user's own
    code did. A ``SyntaxError`` of the script keeps no frame at all (its file and line say
    everything); an exception raised inside the bootstrap itself keeps every frame."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename.startswith(_INTERNAL):
        tb = tb.tb_next
    if tb is None and not isinstance(exc, SyntaxError):
        tb = exc.__traceback__
    return "".join(traceback.format_exception(type(exc), exc, tb))


def install_sources(sources: dict[str, list[str]]) -> None:
    """Put the source lines the driver shipped (``{filename: lines}``, files that exist only in
    the driver's :mod:`linecache`: notebook cells, ``python -c``) into this process's
    :mod:`linecache`, so tracebacks through them show their lines. Files present here win."""
    for filename, lines in sources.items():
        if not isinstance(filename, str) or os.path.isfile(filename):
            continue
        lines = [str(line) for line in lines]
        # mtime None: linecache.checkcache() keeps the entry (it cannot stat a cell).
        linecache.cache[filename] = (sum(map(len, lines)), None, lines, filename)


def _resume_checkpoint(start: Start) -> Any:
    """The checkpoint to resume from, with the file table the driver verified: loading reads
    only those files and checks each one's SHA-256 as it reads it."""
    from ringtrain.checkpoint.checkpoint import Checkpoint

    assert start.latest_checkpoint is not None
    ckpt = Checkpoint(start.latest_checkpoint)
    ckpt.set_verified_files(start.checkpoint_files)
    return ckpt


def _setup_timing(sess: Any, config: WorkerConfig) -> None:
    """Give the session a step timer when the driver asked for timing (``MonitorConfig``) or a
    step limit (``ringtrain bench``)."""
    if config.timing_interval_s is None and config.max_steps is None:
        return
    # Without timing windows (a step limit only) it counts steps and sends nothing.
    install_timer(sess, config.max_steps, config.comm_timing, config.timing_interval_s)


def _setup_integrity(sess: Any, config: WorkerConfig) -> None:
    """Register the replica and replay checks the run asks for
    (``FailureConfig.replica_check_every``, ``replay_check_every``), before the group forms
    (each makes a sub-group)."""
    if config.replica_check_every:
        from ringtrain.integrity.replicas import ReplicaCheck

        sess.hooks.register(ReplicaCheck(sess, config.replica_check_every, config.recheck_step))
    if config.replay_check_every:
        from ringtrain.integrity.replay import ReplayCheck

        sess.hooks.register(ReplayCheck(sess, config.replay_check_every))


def heartbeat_interval(worker_timeout_s: float | None) -> float:
    """Seconds between heartbeats: five per timeout (so the driver sees a frozen process well
    within it), but no more often than every 50 ms and at least every 2 s."""
    if worker_timeout_s is None:
        return 2.0
    return max(0.05, min(2.0, worker_timeout_s / 5))


if __name__ == "__main__":
    sys.stdout.flush()
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter teardown: daemon threads and half-destroyed torch state can hang or crash
    # at exit, and every resource worth closing was closed above.
    os._exit(code)
