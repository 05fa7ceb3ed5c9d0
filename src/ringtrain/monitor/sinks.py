"""Logging sinks the Trainer adds by default: TensorBoard event files and CSV files.

Both are driver-side callbacks (the hooks of :data:`ringtrain.config.CALLBACK_HOOKS`) and know
nothing of the controller: they can be passed to ``RunConfig(callbacks=[...])`` like a user's
own. What they write (``{run_dir}`` is ``{storage_path}/{name}``)::

    {run_dir}/tensorboard/events.out.tfevents.*   one scalar tag per metric (TensorBoard layout)
    {run_dir}/metrics.csv                         one row per completed round (rank 0's metrics)
    {run_dir}/timing.csv                          one row per timing window per rank

Their directory may be a local path or an fsspec URL (``memory://``, ``s3://``...). Event files
and CSVs are appended to as the run goes, which object stores cannot do, so for a URL the files
are written to a local temporary directory and copied into place when the run ends (``on_end``),
after which the temporary directory is removed.
"""

from __future__ import annotations

import csv
import importlib.abc
import logging
import numbers
import os
import shutil
import sys
import tempfile
import threading
import time
from typing import Any

import fsspec

from ringtrain.checkpoint.storage import is_local_fs, join
from ringtrain.config import MonitorConfig
from ringtrain.rundir import RunDirectory
from ringtrain.rundir.schema import METRICS_CSV_FILE, TENSORBOARD_DIR, TIMING_CSV_FILE

__all__ = ["TIMING_FIELDS", "CSVCallback", "TensorBoardCallback", "default_sinks"]

logger = logging.getLogger("ringtrain")

TIMING_FIELDS = (
    "step_s",
    "data_s",
    "compute_s",
    "comm_s",
    "comm_exposed_s",
    "optimizer_s",
    "other_s",
    "busy_s",
    "samples_per_s",
    "rss_bytes",
    "gpu_allocated_bytes",
    "gpu_peak_bytes",
    "gpu_util",
    "outer_steps",
    "outer_bytes",
    "outer_sync_s",
    "outer_sync_frac",
)
"""The fields of a timing window that become TensorBoard / MLflow / W&B scalars (those that are
``None`` or absent, such as the GPU fields of a CPU run or the ``outer_*`` fields of a run that
is not DiLoCo, are left out)."""


def is_number(value: Any) -> bool:
    """Whether ``value`` is a real number that can become a scalar (``bool`` is not; NaN is)."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def step_of(metrics: dict[str, Any], round_: int) -> int:
    """The x-axis position of a report: its int ``"step"`` metric if it has one, else the
    0-based report round."""
    step = metrics.get("step")
    if isinstance(step, numbers.Integral) and not isinstance(step, bool):
        return int(step)
    return round_


def window_step(window: dict[str, Any], fallback: int) -> int:
    """The x-axis position of a timing window: its ``step`` (the rank's cumulative step count),
    or ``fallback`` when it has none."""
    step = window.get("step")
    if isinstance(step, numbers.Integral) and not isinstance(step, bool):
        return int(step)
    return fallback


class _Staging:
    """Where files destined for ``directory`` are written while the run goes: ``directory`` itself
    when it is on the local disk, a temporary local directory (copied there by :meth:`finish`)
    when it is an fsspec URL."""

    def __init__(self, directory: str, prefix: str) -> None:
        if not isinstance(directory, (str, os.PathLike)) or not os.fspath(directory):
            raise ValueError(f"expected a directory path or fsspec URL, got {directory!r}")
        self.fs, path = fsspec.core.url_to_fs(os.fspath(directory))
        self.remote: str | None = None
        if is_local_fs(self.fs):
            self.local = os.path.abspath(path)
        else:
            self.remote = path
            self.local = tempfile.mkdtemp(prefix=f"ringtrain-{prefix}-")
        self._made = False

    def ensure(self) -> str:
        """Create the local directory (on first use) and return it."""
        if not self._made:
            os.makedirs(self.local, exist_ok=True)
            self._made = True
        return self.local

    def fetch(self, name: str) -> None:
        """Copy ``name`` from a remote directory into the local one, if it exists there (a run
        continued in the same directory keeps its earlier rows)."""
        if self.remote is None:
            return
        source = join(self.fs, self.remote, name)
        try:
            if self.fs.exists(source):
                self.fs.get_file(source, os.path.join(self.ensure(), name))
        except OSError as exc:
            logger.warning("could not read %s (%s); starting it afresh", source, exc)

    def finish(self) -> None:
        """For a remote directory: copy every local file there and remove the local copy."""
        if self.remote is None or not os.path.isdir(self.local):
            return
        try:
            for root, _dirs, files in os.walk(self.local):
                rel_root = os.path.relpath(root, self.local)
                for name in sorted(files):
                    rel = name if rel_root == "." else f"{rel_root}/{name}"
                    target = join(self.fs, self.remote, rel)
                    self.fs.makedirs(target.rsplit("/", 1)[0], exist_ok=True)
                    self.fs.put_file(os.path.join(root, name), target)
        finally:
            shutil.rmtree(self.local, ignore_errors=True)


class _NoTorchInThisThread(importlib.abc.MetaPathFinder):
    """A finder that makes ``import torch`` fail in one thread (while tensorboardX imports);
    other threads import torch as usual (the finder answers ``None`` for them, and torch's own
    module lock orders two threads importing it)."""

    def __init__(self) -> None:
        self.thread = threading.get_ident()

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> None:
        if name == "torch" and threading.get_ident() == self.thread:
            raise ImportError("torch is not imported by the driver's TensorBoard sink")
        return None


def _summary_writer_class() -> Any:
    """tensorboardX's ``SummaryWriter``, imported without torch when this process has not
    imported torch: tensorboardX's ``import torch`` (in ``tensorboardX.writer``) only widens
    type annotations to accept tensors, and this sink writes floats. So the driver of
    ``ringtrain run``, whose workers alone need torch, never loads it (~2 CPU-seconds and
    ~180 MiB of peak memory: docs/benchmarks.md, "Overhead vs torchrun")."""
    if "torch" not in sys.modules and "tensorboardX" not in sys.modules:
        finder = _NoTorchInThisThread()
        sys.meta_path.insert(0, finder)
        try:
            import tensorboardX
        except ImportError:  # a tensorboardX that needs torch: import it as it is, below
            for name in [m for m in sys.modules if m.split(".")[0] == "tensorboardX"]:
                del sys.modules[name]
        else:
            return tensorboardX.SummaryWriter
        finally:
            sys.meta_path.remove(finder)
    from tensorboardX import SummaryWriter

    return SummaryWriter


class TensorBoardCallback:
    """Writes the run's metrics, step timing and straggler events as TensorBoard event files.

    Tags (``<r>`` is a rank, ``<name>`` a reported metric; only numbers become scalars, ``bool``
    and non-numeric values are skipped, NaN is kept):

    - ``metrics/<name>``: rank 0's metrics of each completed round (``on_round``);
    - ``rank_<r>/<name>``: every rank's metrics of every report (``on_report``);
    - ``timing/rank_<r>/<field>``: each timing window's :data:`TIMING_FIELDS` (``on_timing``),
      e.g. ``timing/rank_1/step_s`` (seconds) or ``timing/rank_0/rss_bytes`` (bytes);
    - ``stragglers/rank_<r>``: 1 when the rank is flagged as a straggler, 0 when cleared, and a
      text entry ``stragglers`` with the message (``on_straggler``).

    The x-axis (global step) of metrics is the report's int ``"step"`` metric when it has one,
    else the round; of timing windows, the window's ``step`` (the rank's cumulative step count);
    of straggler events, the rank's step in its latest timing window.

    Events reach the file at most ``flush_secs`` after they are logged, so a live ``tensorboard
    --logdir`` sees the run as it goes; ``on_end`` flushes and closes the file.

    Args:
        log_dir: the directory for the event files: a local path, or an fsspec URL (then the
            files are written to a local temporary directory and copied there on ``on_end``).
        flush_secs: the longest time an event waits in memory before it is written (seconds).

    Raises:
        ValueError: if ``log_dir`` is empty or ``flush_secs`` is not positive.
    """

    def __init__(self, log_dir: str, flush_secs: float = 2.0) -> None:
        if isinstance(flush_secs, bool) or not isinstance(flush_secs, (int, float)):
            raise ValueError(f"TensorBoardCallback.flush_secs must be a number, got {flush_secs!r}")
        if not flush_secs > 0:
            raise ValueError(f"TensorBoardCallback.flush_secs must be > 0, got {flush_secs!r}")
        self._staging = _Staging(log_dir, "tensorboard")
        self.log_dir = os.fspath(log_dir)
        self.flush_secs = flush_secs
        self._writer: Any = None
        self._closed = False
        self._last_step: dict[int, int] = {}  # rank -> step of its latest timing window

    @property
    def local_dir(self) -> str:
        """Where the event files are being written now (``log_dir`` itself when it is local)."""
        return self._staging.local

    def _w(self) -> Any:
        if self._writer is None:
            if self._closed:
                raise RuntimeError("TensorBoardCallback: the run has ended and the file is closed")
            writer_class = _summary_writer_class()
            self._writer = writer_class(logdir=self._staging.ensure(), flush_secs=self.flush_secs)
        return self._writer

    def _scalars(
        self, prefix: str, values: dict[str, Any], step: int, walltime: float | None = None
    ) -> None:
        for name, value in values.items():
            if is_number(value):
                self._w().add_scalar(f"{prefix}{name}", float(value), step, walltime=walltime)

    def on_report(self, rank: int, round: int, metrics: dict[str, Any]) -> None:
        self._scalars(f"rank_{rank}/", metrics, step_of(metrics, round))

    def on_round(self, round: int, metrics: dict[str, Any]) -> None:
        self._scalars("metrics/", metrics, step_of(metrics, round))

    def on_timing(self, rank: int, window: dict[str, Any]) -> None:
        step = window_step(window, self._last_step.get(rank, 0))
        self._last_step[rank] = step
        fields = {k: window.get(k) for k in TIMING_FIELDS}
        self._scalars(f"timing/rank_{rank}/", fields, step)

    def on_straggler(self, event: Any) -> None:
        rank = int(event.rank)
        step = self._last_step.get(rank, 0)
        walltime = getattr(event, "time", None) or time.time()
        w = self._w()
        w.add_scalar(
            f"stragglers/rank_{rank}", 1.0 if event.flagged else 0.0, step, walltime=walltime
        )
        w.add_text("stragglers", str(event.message), step, walltime=walltime)

    def on_end(self, result: Any) -> None:
        self.close()

    def close(self) -> None:
        """Flush and close the event file (and copy it to a remote ``log_dir``). Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        self._staging.finish()


class _CSVFile:
    """One CSV file that grows by rows and, when a row brings new columns, by columns: the file
    is then rewritten with the wider header (earlier rows get empty cells there)."""

    def __init__(self, path: str, leading: tuple[str, ...]) -> None:
        self.path = path
        self.columns: list[str] = list(leading)
        self._file: Any = None
        if os.path.exists(path) and os.path.getsize(path) > 0:
            with open(path, newline="") as f:
                header = next(csv.reader(f), [])
            # A file from an earlier driver of the same run: keep its rows and columns.
            self.columns = header + [c for c in leading if c not in header]
            if header != self.columns:
                self._rewrite()

    def append(self, row: dict[str, Any]) -> None:
        new = [k for k in row if k not in self.columns]
        if new:
            self.columns.extend(new)
            self._rewrite()
        if self._file is None:
            fresh = not os.path.exists(self.path) or os.path.getsize(self.path) == 0
            self._file = open(self.path, "a", newline="")  # noqa: SIM115
            if fresh:
                csv.writer(self._file).writerow(self.columns)
        csv.DictWriter(self._file, self.columns, restval="").writerow(row)
        self._file.flush()

    def _rewrite(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        rows: list[dict[str, Any]] = []
        if os.path.exists(self.path):
            with open(self.path, newline="") as f:
                rows = list(csv.DictReader(f))
        tmp = self.path + ".tmp"
        with open(tmp, "w", newline="") as f:
            writer = csv.DictWriter(f, self.columns, restval="", extrasaction="ignore")
            writer.writeheader()
            writer.writerows(rows)
        os.replace(tmp, self.path)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def _cell(value: Any) -> Any:
    """The CSV form of a metric value, or ``_SKIP`` for values a cell cannot hold."""
    if value is None or isinstance(value, (str, bool)) or is_number(value):
        return "" if value is None else value
    return _SKIP


_SKIP = object()


def _cells(values: dict[str, Any], reserved: tuple[str, ...], prefix: str) -> dict[str, Any]:
    row: dict[str, Any] = {}
    for name, value in values.items():
        cell = _cell(value)
        if cell is _SKIP:
            continue
        row[f"{prefix}{name}" if name in reserved else name] = cell
    return row


class CSVCallback:
    """Writes ``metrics.csv`` and ``timing.csv`` into a directory, one row per event, flushed as
    it is written (``tail -f`` works during the run).

    - ``metrics.csv``: ``round, time, <rank 0's metrics...>``, one row per completed round
      (``on_round``). ``time`` is Unix time in seconds.
    - ``timing.csv``: ``time, rank, <window fields...>``, one row per timing window of each rank
      (``on_timing``; fields as in the ``timing`` event of ``docs/run-directory.md``, e.g.
      ``step_s`` in seconds, ``rss_bytes`` in bytes).

    Numbers, strings and booleans become cells (``None`` an empty cell); other values (lists,
    dicts, tensors) are skipped. A metric named like a leading column (``round``, ``time``,
    ``rank``) is written as ``metric.<name>``. When a key appears that the file has no column
    for, the file is rewritten with the wider header and the earlier rows get an empty cell
    there. Existing files (a run continued in the same directory) are appended to.

    Args:
        directory: the directory for both files: a local path, or an fsspec URL (then the files
            are written to a local temporary directory and copied there on ``on_end``).

    Raises:
        ValueError: if ``directory`` is empty.
    """

    METRICS_FILE = METRICS_CSV_FILE
    TIMING_FILE = TIMING_CSV_FILE

    def __init__(self, directory: str) -> None:
        self._staging = _Staging(directory, "csv")
        self.directory = os.fspath(directory)
        self._metrics: _CSVFile | None = None
        self._timing: _CSVFile | None = None
        self._closed = False

    @property
    def local_dir(self) -> str:
        """Where the files are being written now (``directory`` itself when it is local)."""
        return self._staging.local

    def _open(self, name: str, leading: tuple[str, ...]) -> _CSVFile:
        if self._closed:
            raise RuntimeError("CSVCallback: the run has ended and the files are closed")
        self._staging.fetch(name)
        return _CSVFile(os.path.join(self._staging.ensure(), name), leading)

    def on_round(self, round: int, metrics: dict[str, Any]) -> None:
        if self._metrics is None:
            self._metrics = self._open(self.METRICS_FILE, ("round", "time"))
        cells = _cells(metrics, ("round", "time"), "metric.")
        self._metrics.append({"round": round, "time": time.time(), **cells})

    def on_timing(self, rank: int, window: dict[str, Any]) -> None:
        if self._timing is None:
            self._timing = self._open(self.TIMING_FILE, ("time", "rank"))
        values = {k: v for k, v in window.items() if not (k == "rank" and v == rank)}
        cells = _cells(values, ("time", "rank"), "metric.")
        self._timing.append({"time": time.time(), "rank": rank, **cells})

    def on_end(self, result: Any) -> None:
        self.close()

    def close(self) -> None:
        """Close the files (and copy them to a remote ``directory``). Idempotent."""
        if self._closed:
            return
        self._closed = True
        for f in (self._metrics, self._timing):
            if f is not None:
                f.close()
        self._staging.finish()


def default_sinks(run_dir: RunDirectory, config: MonitorConfig) -> list[object]:
    """The logging callbacks a run gets by default, per its :class:`MonitorConfig`.

    - ``config.tensorboard``: a :class:`TensorBoardCallback` writing ``{run_dir}/tensorboard/``;
    - ``config.csv``: a :class:`CSVCallback` writing ``{run_dir}/metrics.csv`` and
      ``{run_dir}/timing.csv``.

    For a run directory that is not on the local disk (an fsspec URL such as ``memory://`` or
    ``s3://``), each callback writes to a local temporary directory while the run goes and
    copies the files into the run directory in ``on_end`` (then removes the temporary
    directory); a driver killed before ``on_end`` leaves the files only in that temporary
    directory.

    Args:
        run_dir: the run's directory writer (its ``uri`` says where the files go).
        config: which sinks are on.

    Returns:
        The callbacks, in the order above (possibly empty).
    """
    sinks: list[object] = []
    if config.tensorboard:
        sinks.append(TensorBoardCallback(join(run_dir.fs, run_dir.uri, TENSORBOARD_DIR)))
    if config.csv:
        sinks.append(CSVCallback(run_dir.uri))
    return sinks
