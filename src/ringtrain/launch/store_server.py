"""A local run's rendezvous store in a process of its own, forked from the run's warm pool.

:meth:`ringtrain.launch.pool.WorkerPool.host_store` asks the zygote, which has imported torch
already, to fork this program: it hosts the ``torch.distributed.TCPStore`` that the workers
rendezvous through (bound to the address it is given, loopback for a local run:
:func:`~ringtrain.launch.base.start_store`), prints ``ringtrain-store-port PORT`` on its stdout and
serves until it is killed. The driver of a warm local run then never imports torch (~2
CPU-seconds and ~180 MiB of peak memory less per driver of ``ringtrain run``). A run whose
workers start cold hosts the store in the driver as before.

The process leads its own process group (the zygote's fork), dies with the zygote
(``PR_SET_PDEATHSIG``, which itself dies with the driver) and is registered with the group's
reaper like a worker; the group kills it when it stops
(:class:`~ringtrain.launch.local.LocalWorkerGroup`). Nothing in ringtrain runs it but the zygote.
"""

from __future__ import annotations

import signal
import sys
from typing import NoReturn

from ringtrain.launch.base import start_store
from ringtrain.launch.pool import STORE_PORT_WORD
from ringtrain.launch.worker import die_with_parent


def main(argv: list[str]) -> NoReturn:
    """Host the store until this process is killed (the group's stop does it).

    Args:
        argv: ``[host, world_size]``.

    Raises:
        OSError: if ``host`` is not an address of this machine (the zygote's child prints the
            traceback on stderr and exits 1; the driver then hosts the store itself).
    """
    host, world_size = argv[0], int(argv[1])
    die_with_parent()
    store = start_store(host, world_size)
    sys.stdout.write(f"{STORE_PORT_WORD} {store.port}\n")
    sys.stdout.flush()
    while True:
        signal.pause()
