"""The run directory ``{storage_path}/{name}/``: its schema (:mod:`ringtrain.rundir.schema`),
its one writer (:class:`RunDirectory`, the driver's) and its one incremental reader
(:mod:`ringtrain.rundir.reader`). Layout: docs/run-directory.md."""

from __future__ import annotations

from ringtrain.rundir.writer import RunDirectory

__all__ = ["RunDirectory"]
