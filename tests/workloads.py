"""Train functions for the multi-process tests. They live in an importable module so that the
worker processes load them by reference, exactly as a user's module would be loaded."""

from __future__ import annotations

import os
import signal
import tempfile
import time

import fsspec
import torch
import torch.distributed as dist
from fsspec.implementations.local import LocalFileSystem
from torch.utils.data import DataLoader, TensorDataset

import ringtrain as rt
import spare_hooks


def make_dataset(n: int = 48, d: int = 8) -> TensorDataset:
    # 48 divides evenly over 1, 2 and 3 ranks with batches of 4, 8 and 12: no sampler padding.
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(n, d, generator=g)
    y = (x @ torch.randn(d, 1, generator=g)).squeeze(1) + 0.1 * torch.randn(n, generator=g)
    return TensorDataset(x, y)


def make_model(d: int = 8) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(d, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


def report_with_checkpoint(metrics: dict, model: torch.nn.Module | None, **extra) -> None:
    """``rt.report(metrics)``, with a checkpoint of ``model``'s state dict (and ``extra``) unless
    ``model`` is None. The files are staged in a temporary directory that is removed once
    ``report`` returns: it has copied them into the run directory by then (docs/guide.md)."""
    if model is None:
        rt.report(metrics)
        return
    with tempfile.TemporaryDirectory(prefix="rt_test_ckpt_") as d:
        module = model.module if hasattr(model, "module") else model
        torch.save({"model": module.state_dict(), **extra}, os.path.join(d, "model.pt"))
        rt.report(metrics, checkpoint=rt.Checkpoint.from_directory(d))


def equivalence_fn(config):
    """``steps`` SGD steps over a shuffled dataset; rank 0 saves the final parameters."""
    model = rt.prepare_model(make_model())
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    loader = rt.prepare_data_loader(
        DataLoader(make_dataset(), batch_size=config["batch_size"], shuffle=True)
    )
    step = 0
    while step < config["steps"]:
        for x, y in loader:
            loss = torch.nn.functional.mse_loss(model(x).squeeze(1), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            step += 1
            if step == config["steps"]:
                break
    rank0 = rt.get_context().world_rank == 0
    report_with_checkpoint({"loss": loss.item(), "steps": step}, model if rank0 else None)


def metrics_fn(config):
    ctx = rt.get_context()
    assert dist.is_initialized() == (ctx.world_size > 1)
    for i in range(config["rounds"]):
        t = torch.tensor([float(ctx.world_rank)])
        if ctx.world_size > 1:
            dist.all_reduce(t)
        report_with_checkpoint(
            {
                "round": i,
                "rank": ctx.world_rank,
                "rank_sum": t.item(),
                "score": config["scores"][i],
            },
            torch.nn.Linear(1, 1) if ctx.world_rank == 0 else None,
        )


def raising_fn(config):
    ctx = rt.get_context()
    rt.report({"ok": 1})
    if ctx.world_rank == config["bad_rank"]:
        raise ValueError(f"bad batch on rank {ctx.world_rank}")
    t = torch.zeros(1)
    dist.all_reduce(t)  # the healthy rank waits for its peer in a collective
    time.sleep(30)


def sigkill_fn(config):
    ctx = rt.get_context()
    rt.report({"ok": 1})
    if ctx.world_rank == config["bad_rank"]:
        os.kill(os.getpid(), signal.SIGKILL)
    t = torch.zeros(1)
    dist.all_reduce(t)
    time.sleep(30)


def sleeper_fn(config):
    """Write this worker's pid to a file, then sleep: for orphan tests."""
    ctx = rt.get_context()
    with open(os.path.join(config["pid_dir"], f"rank{ctx.world_rank}.pid"), "w") as f:
        f.write(str(os.getpid()))
    time.sleep(600)


def flaky_fn(config):
    """Fails on rank 1 in the first attempt only; resumes its counter from the checkpoint."""
    ctx = rt.get_context()
    start = 0
    ckpt = rt.get_checkpoint()
    if ckpt is not None:
        with ckpt.as_directory() as d:
            start = torch.load(os.path.join(d, "model.pt"), weights_only=True)["step"] + 1
    for step in range(start, config["steps"]):
        if ctx.attempt == 0 and ctx.world_rank == 1 and step == config["fail_at"]:
            raise RuntimeError("transient failure")
        model = torch.nn.Linear(1, 1)
        report_with_checkpoint(
            {"step": step, "attempt": ctx.attempt, "start": start},
            model if ctx.world_rank == 0 else None,
            step=step,
        )


def threads_fn():
    rt.report({"threads": torch.get_num_threads(), "omp": os.environ.get("OMP_NUM_THREADS")})


# ------------------------------------------------------------------ exact resume (issue 3)


class NoisyDataset(torch.utils.data.Dataset):
    """120 samples of 6 features, 3 classes; deterministic per index."""

    def __init__(self, n: int = 120) -> None:
        g = torch.Generator().manual_seed(7)
        self.x = torch.randn(n, 6, generator=g)
        self.y = torch.randint(0, 3, (n,), generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return self.x[i], self.y[i]


def _kill_self() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _wait_for_own_checkpoint_write() -> None:
    """Wait (up to 120 s) until this rank's background checkpoint write is on storage and its
    CheckpointDone sent: a kill after it cannot cost the round, however slow the machine."""
    from ringtrain.worker.session import installed_session

    session = installed_session()
    if session is not None:
        session.wait_for_checkpoint(120)


def _arm_kill_during_write(round_: int, after_bytes: int) -> None:
    """SIGKILL this process once it has written ``after_bytes`` bytes of a file of checkpoint
    round ``round_``: a real half-written file on disk."""
    from ringtrain.checkpoint import writer

    original = writer.write_files

    def write_files(fs, dest, writers, **kwargs):
        if f"checkpoint_{round_:06d}.tmp" not in dest:
            return original(fs, dest, writers, **kwargs)

        def killing(write):
            def run(f):
                class Killer:
                    written = 0

                    def write(self, data):
                        n = f.write(data)
                        Killer.written += n
                        if Killer.written >= after_bytes:
                            f.flush()
                            _kill_self()
                        return n

                    def flush(self):
                        f.flush()

                write(Killer())

            return run

        return original(fs, dest, {k: killing(w) for k, w in writers.items()}, **kwargs)

    writer.write_files = write_files


def exact_fn(config):
    """The issue's loop: dropout (torch RNG), NumPy and Python noise, momentum SGD, StepLR,
    checkpoints every ``every`` steps and at each epoch's end. On attempt 0, rank
    ``config["kill_rank"]`` SIGKILLs itself at ``config["kill"]``:
    ``("step", n)``, ``("epoch_start", e)`` or ``("write", round, bytes)``; or hangs after step
    ``n`` with ``("hang", n)`` (sleeps) or ``("freeze", n)`` (SIGSTOPs itself); or sleeps after
    its ``n``-th report with ``("hold_after_reports", n, marker)``, once: the first to hold
    creates ``marker`` (so that a driver killed at that round's checkpoint dies before the run
    can end, however slow the driver is, and the resumed run, attempt 0 again, does not hold).
    Rank 0 saves the final parameters and optimizer state to ``config["out"]``."""
    import random

    import numpy as np

    ctx = rt.get_context()
    kill = (
        config.get("kill") if ctx.attempt == 0 and ctx.world_rank == config["kill_rank"] else None
    )
    if kill and kill[0] == "write":
        _arm_kill_during_write(kill[1], kill[2])
    torch.manual_seed(0)
    np.random.seed(0)
    random.seed(0)
    net = torch.nn.Sequential(
        torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Dropout(0.3), torch.nn.Linear(16, 3)
    )
    model = rt.prepare_model(net)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=10, gamma=0.5)
    loader = rt.prepare_data_loader(
        DataLoader(
            NoisyDataset(),
            batch_size=config.get("batch_size", 6),
            shuffle=True,
            num_workers=config.get("loader_workers", 0),
        )
    )
    state = rt.TrainState(
        model=model, optimizer=optimizer, lr_scheduler=scheduler, data_loader=loader, seen=[]
    )
    state.restore()
    every = config.get("every", 4)
    reports = 0
    for epoch in state.epochs(config["epochs"]):
        if kill and kill == ("epoch_start", epoch):
            _kill_self()
        for x, y in loader:
            x = x + 0.01 * torch.from_numpy(np.random.randn(*x.shape)).float() * random.random()
            loss = torch.nn.functional.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            scheduler.step()
            state.step += 1
            state.extras["loss"] = loss.item()
            if kill and kill == ("step", state.step):
                _kill_self()
            if kill and kill == ("hang", state.step):
                time.sleep(3600)  # alive, heartbeating, but no progress; the peer blocks too
            if kill and kill == ("freeze", state.step):
                os.kill(os.getpid(), signal.SIGSTOP)  # the whole process stops answering
            if state.step % every == 0:
                rt.report({"loss": state.extras["loss"], "step": state.step}, checkpoint=state)
                reports += 1
                _hold_once(kill, reports)
        # Resumed from the checkpoint of an epoch's last batch, the loop above runs no batch:
        # the loss comes from the checkpoint (state.extras), not from this attempt's loop.
        end = {"loss": state.extras["loss"], "step": state.step, "epoch_end": epoch}
        rt.report(end, checkpoint=state)
        reports += 1
        _hold_once(kill, reports)
    if ctx.world_rank == 0:
        module = model.module if hasattr(model, "module") else model
        torch.save(
            {"model": module.state_dict(), "optimizer": optimizer.state_dict(), "step": state.step},
            config["out"],
        )


def _hold_once(kill, reports: int) -> None:
    """``kill == ("hold_after_reports", reports, marker)``: sleep, unless ``marker`` exists."""
    if not kill or kill[0] != "hold_after_reports" or kill[1] != reports:
        return
    try:
        os.close(os.open(kill[2], os.O_CREAT | os.O_EXCL))
    except FileExistsError:
        return
    time.sleep(3600)  # the driver dies at this round's checkpoint; its death ends this process


class FlakyFileSystem(LocalFileSystem):
    """``flaky://`` paths are local paths whose checkpoint ``.pt`` writes fail: the first
    ``RT_FLAKY_FAILS`` of them in each process (transient), or all (``RT_FLAKY_FAILS=always``)."""

    protocol = ("flaky",)
    failed = 0

    @classmethod
    def _strip_protocol(cls, path):
        path = str(path)
        if path.startswith("flaky://"):
            path = path[len("flaky://") :]
        return super()._strip_protocol(path)

    def _open(self, path, mode="rb", **kwargs):
        if "w" in mode and str(path).endswith(".pt"):
            budget = os.environ.get("RT_FLAKY_FAILS", "0")
            if budget == "always" or FlakyFileSystem.failed < int(budget):
                FlakyFileSystem.failed += 1
                raise ConnectionError(f"flaky storage: write of {path} refused")
        return super()._open(path, mode=mode, **kwargs)


fsspec.register_implementation("flaky", FlakyFileSystem, clobber=True)


class SlowDataset(torch.utils.data.Dataset):
    """``make_dataset()`` whose every item takes ``delay_s`` seconds to load."""

    def __init__(self, delay_s: float) -> None:
        self.data = make_dataset()
        self.delay_s = delay_s

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i):
        time.sleep(self.delay_s)
        return self.data[i]


class SlowForward(torch.nn.Module):
    """``make_model()`` whose forward takes ``delay_s`` seconds longer."""

    def __init__(self, delay_s: float) -> None:
        super().__init__()
        self.net = make_model()
        self.delay_s = delay_s

    def forward(self, x):
        time.sleep(self.delay_s)
        return self.net(x)


def timed_fn(config):
    """``epochs`` epochs of SGD with known delays: ``data_delay_s`` per sample loaded,
    ``forward_delay_s`` per forward, and ``slow_rank`` sleeping ``slow_s`` after each step (in the
    train function's own code). Reports once per epoch."""
    model = rt.prepare_model(SlowForward(config.get("forward_delay_s", 0.0)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    dataset = SlowDataset(config.get("data_delay_s", 0.0))
    loader = rt.prepare_data_loader(DataLoader(dataset, batch_size=config.get("batch_size", 4)))
    rank = rt.get_context().world_rank
    for epoch in range(config.get("epochs", 1)):
        for x, y in loader:
            loss = torch.nn.functional.mse_loss(model(x).squeeze(1), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            if rank == config.get("slow_rank"):
                time.sleep(config["slow_s"])
        rt.report({"epoch": epoch, "loss": loss.item()})


# ------------------------------------------------------------------ Ray backend (issue 4)


def placement_fn(config):
    """Reports where this rank runs (node rank, local rank, the Ray node id the launcher set,
    the rendezvous host) after an allreduce over the whole group, and its multiprocessing temp
    dir."""
    import multiprocessing.util

    ctx = rt.get_context()
    t = torch.ones(1)
    dist.all_reduce(t)
    rt.report(
        {
            "world_size_sum": t.item(),
            "node_rank": ctx.node_rank,
            "local_rank": ctx.local_rank,
            "local_world_size": ctx.local_world_size,
            "node_id": os.environ.get("RINGTRAIN_RAY_NODE_ID"),
            "master_addr": ctx.master_addr,
            "threads": torch.get_num_threads(),
            "mp_temp": multiprocessing.util.get_temp_dir(),
        }
    )


# ------------------------------------------------------------------ elastic training (issue 8)


class IndexedDataset(torch.utils.data.Dataset):
    """``n`` samples ``(x, y, index)``: the index lets a test account for every sample seen."""

    def __init__(self, n: int = 120) -> None:
        g = torch.Generator().manual_seed(7)
        self.x = torch.randn(n, 6, generator=g)
        self.y = self.x @ torch.randn(6, 1, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return self.x[i], self.y[i], i


def elastic_fn(config):
    """Deterministic momentum-SGD regression with a TrainState (a report with a checkpoint every
    ``every`` steps). Per step, every rank appends ``{pid, attempt, world, rank, step, epoch, ids,
    loss}`` to ``{config["log"]}/{pid}.jsonl``. On attempt 0 at the first world size, the ranks
    in ``config["kill_ranks"]`` SIGKILL themselves right after step ``config["kill_step"]``
    (``kill_after_own_write``: once their own background checkpoint write is done).
    ``stop_at``: return after that step's report. Rank 0 saves the final parameters to
    ``config["out"]`` (every rank to ``{out}.rank{r}`` with ``save_every_rank``).
    ``unrestored_reentry``: after a resize, build the model with a per-rank seed and skip
    ``restore()``. ``rank_noise``: each rank seeds its own torch stream (100 + rank) and adds
    noise from it to its inputs (per-rank randomness, as dropout). ``hang_after_resize``: that (new)
    rank hangs when the train function is re-entered after a resize, before its first step."""
    import json

    ctx = rt.get_context()
    spare_hooks.on_entry(config)  # hot-spare faults (tests/spare_hooks.py)
    first_world = ctx.attempt == 0 and ctx.world_size == config.get("first_world", 3)
    # "unrestored_reentry": after a resize, build a different model on every rank and skip
    # restore(), so that DDP's deferred initial sync must broadcast rank 0's parameters.
    unrestored = config.get("unrestored_reentry") and ctx.attempt == 0 and not first_world
    if ctx.attempt == 0 and not first_world and ctx.world_rank == config.get("hang_after_resize"):
        _hang_after_resize()
    torch.manual_seed(1000 + ctx.world_rank if unrestored else 0)
    model = rt.prepare_model(torch.nn.Linear(6, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    loader = rt.prepare_data_loader(
        DataLoader(IndexedDataset(), batch_size=config.get("batch_size", 4), shuffle=True)
    )
    state = rt.TrainState(model=model, optimizer=optimizer, data_loader=loader)
    if config.get("rank_noise"):  # per-rank randomness (a stand-in for dropout): own streams
        torch.manual_seed(100 + ctx.world_rank)
    if not unrestored:
        state.restore()
    log = os.path.join(config["log"], f"{os.getpid()}.jsonl")
    every = config.get("every", 5)
    for epoch in state.epochs(config["epochs"]):
        for x, y, ids in loader:
            if config.get("rank_noise"):
                x = x + 0.01 * torch.randn_like(x)
            loss, record = elastic_step(model, optimizer, state, x, y, ids, epoch)
            record["loss"] = loss.item()
            with open(log, "a") as f:
                f.write(json.dumps(record) + "\n")
            kills = config.get("kill_ranks", ())
            spare_hooks.after_step(config, state.step)
            if first_world and ctx.world_rank in kills and state.step == config.get("kill_step"):
                if config.get("kill_after_own_write"):
                    _wait_for_own_checkpoint_write()
                _kill_self()
            if first_world and state.step == config.get("notice_step"):
                _partial_notice(config, ctx.world_rank)
            _elastic_grow_hooks(config, state.step)
            if state.step % every == 0:
                rt.report({"loss": loss.item(), "step": state.step}, checkpoint=state)
            if state.step == config.get("stop_at"):
                break
        if state.step == config.get("stop_at"):
            break
    module = model.module if hasattr(model, "module") else model
    if rt.get_context().world_rank == 0:
        torch.save({"model": module.state_dict(), "step": state.step}, config["out"])
    if config.get("save_every_rank"):
        out = f"{config['out']}.rank{rt.get_context().world_rank}"
        torch.save({"model": module.state_dict(), "step": state.step}, out)


def _hang_after_resize() -> None:
    """Sleep until killed (the frame the driver's stack dump of the hung rank shows)."""
    while True:
        time.sleep(0.1)


def elastic_step(model, optimizer, state, x, y, ids, epoch: int) -> tuple[torch.Tensor, dict]:
    """One step of the elastic tests' train functions: momentum SGD on the MSE loss of ``(x, y)``,
    counted in ``state.step`` (whose hooks snapshot and pause for a grow), and the step's record
    ``{pid, attempt, world, rank, step, epoch, ids}`` (the context as it is after the step: a
    resize renumbers the rank). Returns the loss and the record."""
    loss = torch.nn.functional.mse_loss(model(x), y)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    state.step += 1
    here = rt.get_context()
    record = {
        "pid": os.getpid(),
        "attempt": here.attempt,
        "world": here.world_size,
        "rank": here.world_rank,
        "step": state.step,
        "epoch": epoch,
        "ids": ids.tolist(),
    }
    return loss, record


def _partial_notice(config, rank: int) -> None:
    """A preemption notice for some ranks (tests/multiprocess/test_elastic_leave.py): the ranks
    in ``sigterm_ranks`` SIGTERM themselves (a notice from outside the driver), rank 0 creates
    ``notice_file`` (a driver-side source watches it); then every rank waits (up to 120 s) for
    the driver's answer, a GrowRequest (leave in place) or a PreemptRequest (stop), so that the
    step where the ranks agree to pause or stop is the next one however loaded the machine."""
    from ringtrain.elastic.worker import current_runtime
    from ringtrain.wire.channel import PreemptRequest
    from ringtrain.worker.session import installed_session

    if rank in config.get("sigterm_ranks", ()):
        os.kill(os.getpid(), signal.SIGTERM)
    if rank == 0 and config.get("notice_file"):
        with open(config["notice_file"], "w") as f:
            f.write("a partial notice\n")
    elastic, session = current_runtime(), installed_session()
    deadline = time.monotonic() + 120
    while session is not None and time.monotonic() < deadline:
        if elastic is not None:
            elastic._poll_driver()  # takes GrowRequests, keeps the rest in the inbox
        session.poll_driver()
        if elastic is not None and elastic.grow_requested:
            return
        if any(isinstance(m, PreemptRequest) for m in session.inbox):
            return
        time.sleep(0.05)


def _elastic_grow_hooks(config, step: int) -> None:
    """Growing back (tests/multiprocess/test_elastic.py): ``slow_world``/``slow_s``: sleep
    ``slow_s`` per step while the world size is ``slow_world`` (so that a joining worker has time
    to start); ``hold_step``: at that step, while the world size is ``slow_world``, wait (up to
    300 s) until the driver's GrowRequest has arrived, so that the grow happens before the run
    ends however slowly the joining worker starts on a loaded machine; ``kill_joiner_once``: a
    marker path; the first worker that joined a running group (and creates the marker) SIGKILLs
    itself after its first step."""
    world = rt.get_context().world_size
    if config.get("slow_world") == world:
        time.sleep(config.get("slow_s", 0.2))
        if step == config.get("hold_step"):
            from ringtrain.elastic.worker import current_runtime

            elastic = current_runtime()
            deadline = time.monotonic() + 300
            while elastic is not None and not elastic.grow_requested:
                if time.monotonic() > deadline:
                    break
                elastic._poll_driver()
                time.sleep(0.05)
    marker = config.get("kill_joiner_once")
    elastic_settings = rt.get_context().config.elastic
    if marker and elastic_settings is not None and elastic_settings.joining:
        try:
            os.close(os.open(marker, os.O_CREAT | os.O_EXCL))
        except FileExistsError:
            return
        _kill_self()


def node_loss_fn(config):
    """Reports its Ray node, then on attempt 0 waits (to lose its node); later attempts end."""
    ctx = rt.get_context()
    rt.report({"node_id": os.environ.get("RINGTRAIN_RAY_NODE_ID"), "attempt": ctx.attempt})
    if ctx.attempt == 0:
        time.sleep(120)
