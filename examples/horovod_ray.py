"""Horovod's Ray executor API on ringtrain's Ray backend: MNIST trained by a ``RayExecutor``.

ringtrain's own example, written against ``horovod.ray`` as a Horovod user would (Horovod's
code is not vendored here): connect to Ray, build a ``RayExecutor(settings, num_workers=...,
cpus_per_worker=...)``, ``start()`` it with a per-worker object, ``run`` a function on every
worker (each returns its rank), ``execute`` a method of the per-worker object (the MNIST training
of ``examples/horovod_mnist.py``, with that script's flags), and ``shutdown()``.

Run it on a local Ray instance it starts (and stops)::

    python examples/horovod_ray.py --num-proc 2 --epochs 1

or on a running Ray cluster, from one of its nodes (``--address auto``, or the head's
``HOST:PORT``)::

    python examples/horovod_ray.py --num-proc 2 --epochs 1 --address auto

Each ``run``/``execute`` is
one ringtrain run on fresh Ray actors: see docs/horovod.md for what that changes against
Horovod's long-lived actors.
"""

from __future__ import annotations

import argparse
import os
import sys

import ray

import ringtrain.horovod as hvd  # was: import horovod.torch as hvd
from ringtrain.horovod.ray import RayExecutor  # was: from horovod.ray import RayExecutor

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from horovod_mnist import build_parser, train


def my_rank() -> int:
    """Runs on every worker: joins the group and says which rank it got."""
    hvd.init()
    return hvd.rank()


class MnistJob:
    """The object ``start()`` builds in each worker; ``execute`` calls into it."""

    def __init__(self, options: argparse.Namespace) -> None:
        self.options = options

    def fit(self) -> float:
        return train(self.options)


def main() -> None:
    parser = build_parser()
    parser.add_argument(
        "--address",
        default=None,
        help="a running Ray cluster to connect to ('auto', or the head's HOST:PORT); default: "
        "start a local Ray instance for this script",
    )
    options = parser.parse_args()
    workers = options.num_proc or 2
    if options.address:
        ray.init(address=options.address)
    else:  # a local Ray instance with at least one CPU per worker, even on a smaller machine
        ray.init(num_cpus=max(workers, os.cpu_count() or 1))
    try:
        executor = RayExecutor(
            RayExecutor.create_settings(timeout_s=60), num_workers=workers, cpus_per_worker=1
        )
        executor.start(executable_cls=MnistJob, executable_kwargs={"options": options})
        ranks = executor.run(my_rank)
        if sorted(ranks) != list(range(workers)):
            raise SystemExit(f"expected the ranks 0..{workers - 1} once each, got {ranks}")
        print(f"RayExecutor.run(my_rank) -> {ranks}", flush=True)
        accuracies = executor.execute(lambda job: job.fit())
        print(f"RayExecutor.execute(fit) -> {[round(a, 4) for a in accuracies]}", flush=True)
        executor.shutdown()
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
