"""Horovod on Ray, as Horovod's docs walk through it (``docs/ray.rst``, "Horovod Ray Executor"),
run on ringtrain's Ray backend.

The walkthrough's steps, made into one runnable script: start Ray, create a ``RayExecutor`` of
``--num-proc`` workers, ``start()`` it, ``run`` the docs' ``simple_fn`` on every worker (each
returns its rank; the ranks must be unique), then train Horovod's own MNIST example on the same
executor (``train(args)`` of ``examples/horovod_pytorch_mnist.py``, with all of that script's
flags), and ``shutdown()``. Against Horovod, the two import lines marked ``# was:`` change; on a
machine with fewer cores than workers, ``ray.init`` is given ``num_cpus`` (the docs call
``ray.init()``; on a cluster: ``ray.init(address="auto")``).

Run it::

    python examples/horovod_ray.py --num-proc 2 --epochs 1

Each ``run`` is one ringtrain run on fresh Ray actors (see docs/horovod.md, "Porting Horovod
scripts and launchers", for what that changes against Horovod's long-lived actors).
"""

from __future__ import annotations

import os
import sys

import ray

import ringtrain.horovod as hvd  # was: import horovod.torch as hvd
from ringtrain.horovod.ray import RayExecutor  # was: from horovod.ray import RayExecutor

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from horovod_pytorch_mnist import parser, train


# Using the stateless `run` method, a function can take in any args or kwargs
def simple_fn():
    hvd.init()
    print("hvd rank", hvd.rank())
    return hvd.rank()


if __name__ == "__main__":
    args = parser.parse_args()
    args.cuda = False
    num_workers = args.num_proc or 2

    # Start the Ray cluster or attach to an existing Ray cluster
    ray.init(num_cpus=max(num_workers, os.cpu_count() or 1))

    # Start num_workers actors on the cluster
    settings = RayExecutor.create_settings(timeout_s=30)
    executor = RayExecutor(settings, num_workers=num_workers, use_gpu=False)
    executor.start()

    # Execute the function on all workers at once
    result = executor.run(simple_fn)
    # Check that the rank of all workers is unique
    assert sorted(result) == list(range(num_workers)), result
    print(f"RayExecutor.run(simple_fn) -> {result}", flush=True)

    # Horovod's MNIST example, trained by the same executor
    executor.run(train, args=[args])

    executor.shutdown()
    ray.shutdown()
