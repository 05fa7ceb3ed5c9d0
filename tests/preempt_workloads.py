"""Train functions for the preemption tests (tests/multiprocess/test_preemption.py): the exact
resume workload (``workloads.exact_fn``) with a preemption notice raised from inside the run at a
chosen step, once (a marker file keeps the resumed run from raising it again)."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import torch
from torch.utils.data import DataLoader

import ringtrain as rt
import workloads
from ringtrain.wire.channel import PreemptRequest
from ringtrain.worker.hooks import WorkerPlugin
from ringtrain.worker.preempt import PreemptionPlugin
from ringtrain.worker.session import current_session


class NoticeAt(WorkerPlugin):
    """At ``TrainState.step == step`` (or at report round ``round_``), once per marker: send
    the notice ``how``: ``"driver-SIGTERM"``, ``"driver-SIGUSR1"`` (to the driver,
    ``config["driver_pid"]``), ``"workers-SIGTERM"`` (SIGTERM to every worker's process group,
    sent by a ``kill`` process: a node going away) or ``"file"`` (create
    ``config["notice_file"]``). With ``slow_s``, every later step sleeps that long (a save that
    cannot finish in time)."""

    def __init__(self, config: dict) -> None:
        self.config = config
        self.step = config.get("notice_step")
        self.round = config.get("notice_round")
        self.sent = False

    def on_step(self, state) -> None:
        if self.sent and self.config.get("slow_s"):
            time.sleep(self.config["slow_s"])
        if self.sent and self.config["how"] != "file":
            self._hold_until_it_arrives()
        if self.step is not None and state.step == self.step:
            self._send()

    def _hold_until_it_arrives(self) -> None:
        """Hold this rank's next step until the notice has reached it: its own flag raised
        (SIGTERM to the workers) or the driver's PreemptRequest on its channel. Without this, a
        slow driver lets these fast steps run to the end first, and the run rightly ends
        FINISHED: the test would depend on the machine's speed. The peers wait in the next
        collective, so every rank stops at one step, as in a real run."""
        session = current_session()
        plugin = session.hooks.find(PreemptionPlugin)
        assert plugin is not None
        deadline = time.monotonic() + 120
        while plugin.reason is None and time.monotonic() < deadline:
            session.poll_driver()  # only moves messages to the inbox: the plug-in takes them
            if any(isinstance(m, PreemptRequest) for m in session.inbox):
                return
            time.sleep(0.01)

    def on_report(self, metrics, round_) -> None:
        if self.round is not None and round_ == self.round:
            self._send()  # the round's checkpoint is being written in the background now

    def _send(self) -> None:
        marker = self.config["marker"]
        try:
            os.close(os.open(marker, os.O_CREAT | os.O_EXCL))
        except FileExistsError:
            return
        self.sent = True
        how = self.config["how"]
        if how.startswith("driver-"):
            os.kill(self.config["driver_pid"], getattr(signal, how.split("-", 1)[1]))
        elif how == "workers-SIGTERM":
            pids = _worker_pids(self.config["pid_dir"])
            subprocess.run(["kill", "-TERM", "--", *[f"-{p}" for p in pids]], check=True)
        elif how == "file":
            with open(self.config["notice_file"], "w") as f:
                f.write("the file says so\n")
        else:
            raise ValueError(how)


def _worker_pids(pid_dir: str) -> list[int]:
    return [int(open(os.path.join(pid_dir, n)).read()) for n in sorted(os.listdir(pid_dir))]


def preempt_fn(config):
    """``workloads.exact_fn``, with :class:`NoticeAt` on rank ``config["notice_rank"]`` (0)."""
    ctx = rt.get_context()
    if config.get("pid_dir"):
        with open(os.path.join(config["pid_dir"], f"rank{ctx.world_rank}"), "w") as f:
            f.write(str(os.getpid()))
    if config.get("how") and ctx.world_rank == config.get("notice_rank", 0):
        current_session().hooks.register(NoticeAt(config))
    workloads.exact_fn(config)


def uneven_step_fn(config):
    """DDP training where ``config["setter"]`` alone sets ``TrainState.step`` (``"once"``), or
    adds 2 to it per batch while the others add 1 (``"jump"``)."""
    torch.manual_seed(0)
    model = rt.prepare_model(workloads.make_model())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = rt.prepare_data_loader(DataLoader(workloads.make_dataset(), batch_size=2))
    state = rt.TrainState(model=model, optimizer=optimizer, data_loader=loader)
    rank = rt.get_context().world_rank
    for x, y in loader:
        loss = torch.nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if config["how"] == "once" and rank == config["setter"]:
            if state.step == 0:
                with open(config["first_set"], "w") as f:
                    f.write(repr(time.time()))
            state.step += 1
        elif config["how"] == "jump":
            state.step += 2 if rank == config["setter"] else 1
