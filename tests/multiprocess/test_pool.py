"""The warm worker pool (launch/pool.py): workers forked from one zygote per run.

A run and a restart after SIGKILL of a rank go through the pool and end bit-identical to a
cold-start run; the workers are the zygote's children; script mode works; the zygote has no
listening socket (only the driver's end of its socketpair reaches it); a killed zygote makes the
launcher start workers cold, said once. That nothing outlives the driver on every exit path is
tests/multiprocess/test_process_hygiene.py's job, which runs with the pool (the default).

``rt.warm_pool()``: fits in one block fork their workers from one zygote, which is replaced when
the driver's start-up state changed or it died, and nothing of the block outlives it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

import pool_workloads
import ringtrain as rt
import workloads
from ringtrain.launch.local import LocalLauncher
from ringtrain.launch.pool import WorkerPool
from ringtrain.trainer import run_workers
from support import assert_bit_identical, child_pids, job_configs, pid_alive, wait_until


def _exact(tmp_path, name, workers, launcher=None, kill=None, **scaling):
    out = tmp_path / f"{name}.pt"
    pid_dir = tmp_path / f"{name}-pids"
    pid_dir.mkdir()
    cfg = {"epochs": 1, "out": str(out), "kill": kill, "kill_rank": workers - 1, "every": 2}
    cfg["pid_dir"] = str(pid_dir)
    s, r = job_configs(workers, name, str(tmp_path / "runs"), {"max_failures": 2, **scaling})
    result = rt.Trainer(
        pool_workloads.parent_fn, s, r, train_loop_config=cfg, launcher=launcher
    ).fit()
    records = [json.loads(p.read_text()) for p in sorted(pid_dir.iterdir())]
    return result, torch.load(out, weights_only=True), records


@pytest.mark.timeout(300)
@pytest.mark.parametrize("workers", [2, 3])
def test_restart_through_the_pool_is_bit_identical_to_cold(tmp_path, workers):
    _, cold, _ = _exact(tmp_path, "cold", workers, warm_start=False)
    with WorkerPool() as pool:
        result, warm, records = _exact(
            tmp_path, "warm", workers, LocalLauncher(pool=pool), kill=("step", 3)
        )
        assert len(result.failures) == 1, result.failures
        assert len(records) == 2 * workers  # both attempts, every rank
        assert {r["ppid"] for r in records} == {pool.zygote_pid}, (records, pool.zygote_pid)
        assert pool.alive  # per-attempt cleanup leaves the zygote
        zygote = pool.zygote_pid
    assert_bit_identical(cold, warm)
    assert wait_until(lambda: not pid_alive(zygote), timeout_s=30)
    assert not any(pid_alive(r["pid"]) for r in records)


def _listening_unix_inodes() -> set[str]:
    found = set()
    with open("/proc/net/unix") as f:
        next(f)
        for line in f:
            fields = line.split()
            if int(fields[3], 16) & 0x10000:  # __SO_ACCEPTCON: a listener
                found.add(fields[6])
    return found


def _socket_inodes(pid: int) -> set[str]:
    found = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            found.add(target[len("socket:[") : -1])
    return found


def _tcp_listen_inodes() -> set[str]:
    found = set()
    for name in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(name) as f:
            next(f)
            found |= {ln.split()[9] for ln in f if ln.split()[3] == "0A"}
    return found


@pytest.mark.timeout(300)
def test_script_mode_no_listener_and_cold_fallback(tmp_path, capfd):
    script = tmp_path / "train.py"
    script.write_text(
        textwrap.dedent(
            """
            import os, sys, ringtrain as rt
            from ringtrain.worker import preempt as preempt_worker
            ctx = rt.get_context()
            with open(os.path.join(sys.argv[1], f"driver{ctx.world_rank}"), "w") as f:
                f.write(f"{ctx.config.driver_pid} {preempt_worker.driver_pid()} "
                        f"{sorted(preempt_worker._stoppers)}")
            with open(os.path.join(sys.argv[1], f"rank{ctx.world_rank}"), "w") as f:
                f.write(f"{os.getppid()} {os.getcwd()} {' '.join(sys.argv[1:])}")
            print("hello from", ctx.world_rank)
            """
        )
    )
    out = tmp_path / "out"
    out.mkdir()
    s, r = job_configs(2, "script", str(tmp_path / "runs"), {})
    with WorkerPool() as pool:
        # Nobody but the driver can talk to the zygote: it holds no listening socket.
        sockets = _socket_inodes(pool.zygote_pid)
        assert sockets and not sockets & (_listening_unix_inodes() | _tcp_listen_inodes())
        result = run_workers(
            name="script",
            entrypoint="script",
            scaling_config=s,
            run_config=r,
            script=str(script),
            script_args=(str(out), "x"),
            launcher=LocalLauncher(pool=pool),
        )
        assert result.status == "FINISHED"
        for rank in (0, 1):
            ppid, cwd, args = (out / f"rank{rank}").read_text().split(" ", 2)
            assert int(ppid) == pool.zygote_pid and cwd == os.getcwd() and args == f"{out} x"
            # The driver's pid comes in Start (WorkerConfig.driver_pid); the zygote told the
            # worker who its launchers are, so no /proc look-up: both stop it with SIGTERM.
            driver = (out / f"driver{rank}").read_text()
            assert driver == f"{os.getpid()} {os.getpid()} {sorted({os.getpid(), pool.zygote_pid})}"
        assert "(rank 1) hello from 1" in capfd.readouterr().out
        # The zygote dies: the next run starts its workers cold, and says so once.
        os.kill(pool.zygote_pid, signal.SIGKILL)
        assert wait_until(lambda: not pool.alive, timeout_s=30)
        s2, r2 = job_configs(2, "after", str(tmp_path / "runs"), {})
        result = rt.Trainer(
            workloads.metrics_fn,
            s2,
            r2,
            train_loop_config={"rounds": 2, "scores": [1, 2]},
            launcher=LocalLauncher(pool=pool),
        ).fit()
        assert result.status == "FINISHED"
        assert capfd.readouterr().err.count("starting workers cold") == 1
        # ... and writes it to the run directory as one cold_start event, with the reason.
        lines = (tmp_path / "runs" / "after" / "events.jsonl").read_text().splitlines()
        events = [json.loads(line) for line in lines]
        cold = [e for e in events if e["type"] == "cold_start"]
        assert len(cold) == 1 and "zygote" in cold[0]["reason"], events


def test_a_warm_runs_store_is_forked_from_the_zygote_on_loopback(_warm_pool):
    """The rendezvous store of a run with a warm pool is a child of the zygote (the driver need
    not import torch for it): it leads its own process group, listens on loopback only, serves
    a TCPStore client, and dies of its group's SIGKILL. A store that cannot bind its address
    is refused with the store's own error (the driver then hosts the store itself)."""
    from datetime import timedelta

    import net_workloads
    from ringtrain.launch.pool import PoolUnavailable

    pool = _warm_pool.acquire()  # the session's zygote: no import of torch for this test
    try:
        proc, port = pool.host_store("127.0.0.1", 2, dict(os.environ))
        try:
            assert proc.pid in child_pids(pool.zygote_pid)
            assert os.getpgid(proc.pid) == proc.pid
            listeners = net_workloads.tcp_listeners(proc.pid)
            assert [p for _, p in listeners] == [port], listeners
            assert all(net_workloads.is_loopback(h) for h, _ in listeners), listeners
            client = torch.distributed.TCPStore(
                "127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60)
            )
            client.set("rank0", "ready")
            assert client.get("rank0") == b"ready"
            del client
        finally:
            os.killpg(proc.pid, signal.SIGKILL)
        assert proc.wait(timeout=60) == -signal.SIGKILL
        with pytest.raises(PoolUnavailable, match=r"did not start: .*[Aa]ssign"):
            pool.host_store("203.0.113.7", 2, dict(os.environ))  # not this machine's address
    finally:
        _warm_pool.release(pool)


def test_warm_start_is_validated():
    with pytest.raises(ValueError, match="warm_start"):
        rt.ScalingConfig(warm_start="no")  # type: ignore[arg-type]


def _probe_fit(tmp_path, tag, workers):
    """A ``pool_workloads.probe_fn`` run of ``workers`` ranks; their records, by rank."""
    out = tmp_path / "probe"
    out.mkdir(exist_ok=True)
    s, r = job_configs(workers, tag, str(tmp_path / "runs"), {})
    config = {"out": str(out), "tag": tag}
    result = rt.Trainer(pool_workloads.probe_fn, s, r, train_loop_config=config).fit()
    assert result.status == "FINISHED", result.error
    return [json.loads((out / f"{tag}.rank{k}.json").read_text()) for k in range(workers)]


def _hash_with_seed(seed):
    env = {**os.environ, "PYTHONHASHSEED": seed}
    cmd = [sys.executable, "-c", "print(hash('ringtrain'))"]
    return int(subprocess.check_output(cmd, env=env))


@pytest.mark.own_pool  # the block under test, not the session's
@pytest.mark.timeout(300)
def test_fits_in_a_warm_pool_block_share_one_zygote(tmp_path, monkeypatch):
    before = child_pids()
    with rt.warm_pool() as block:
        assert block.zygote_pid is None  # it starts at the first fit
        a, b = _probe_fit(tmp_path, "a", 2), _probe_fit(tmp_path, "b", 3)
        first = block.zygote_pid
        assert {r["ppid"] for r in a + b} == {first}, (a, b, first)
        assert block.started == 1 and not block.reasons
        assert not child_pids(first)  # each fit's workers are gone at its end
        with rt.warm_pool() as inner:  # a nested block joins the open one
            assert inner is block
        assert pid_alive(first)
        # What the zygote's interpreter fixed at start-up changed: the next fit gets a fresh
        # zygote that starts with the driver's state of now, and the old one stops.
        extra = tmp_path / "extra"
        extra.mkdir()
        monkeypatch.setenv("PYTHONHASHSEED", "1234")
        monkeypatch.syspath_prepend(str(extra))
        c = _probe_fit(tmp_path, "c", 2)
        second = block.zygote_pid
        assert second != first and {r["ppid"] for r in c} == {second}, (c, first, second)
        assert {r["hash"] for r in c} == {_hash_with_seed("1234")}, c
        assert all(str(extra) in r["path"] for r in c), c
        assert wait_until(lambda: not pid_alive(first), timeout_s=30)
        assert "PYTHONHASHSEED" in block.reasons[0] and "sys.path" in block.reasons[0]
        # The zygote dies between fits: the next fit gets a fresh one, and says why.
        os.kill(second, signal.SIGKILL)
        assert wait_until(lambda: not pid_alive(second), timeout_s=30)
        d = _probe_fit(tmp_path, "d", 2)
        third = block.zygote_pid
        assert {r["ppid"] for r in d} == {third} and third not in (first, second)
        assert block.started == 3 and "is gone" in block.reasons[1], block.reasons
        helpers = block.helper_pids()
        assert third in helpers and len(helpers) == 2  # the zygote and its reaper
    # The block's exit leaves no process: zygotes, reapers, workers.
    assert block.zygote_pid is None and not block.helper_pids()
    everyone = helpers | {r["pid"] for r in a + b + c + d}
    assert wait_until(lambda: not any(map(pid_alive, everyone)), timeout_s=30)
    assert wait_until(lambda: not (child_pids() - before), timeout_s=30)
    # Outside the block a fit starts (and stops) its own pool, as before.
    e = _probe_fit(tmp_path, "e", 2)
    (own,) = {r["ppid"] for r in e}
    assert own not in (first, second, third) and not pid_alive(own)


@pytest.mark.own_pool  # the block under test, not the session's
@pytest.mark.timeout(300)
def test_a_block_opened_with_start_has_its_zygote_up_before_the_first_fit(tmp_path):
    before = child_pids()
    with rt.warm_pool(start=True) as block:
        early = block.zygote_pid
        assert early is not None and early in child_pids(), (early, child_pids())
        block.start()  # up already, for this environment, sys.path and cwd: nothing new
        assert block.zygote_pid == early and block.started == 1
        a = _probe_fit(tmp_path, "a", 2)
        assert {r["ppid"] for r in a} == {early}, (a, early)  # the first fit used it
        assert block.started == 1 and not block.reasons
    assert block.zygote_pid is None
    assert wait_until(lambda: not pid_alive(early), timeout_s=30)
    assert wait_until(lambda: not (child_pids() - before), timeout_s=30)


def _preload_fit(tmp_path, tag, workers, **scaling):
    """A ``pool_workloads.preload_fn`` run; its result and the ranks' records, by rank."""
    out = tmp_path / "preload"
    out.mkdir(exist_ok=True)
    s, r = job_configs(workers, tag, str(tmp_path / "runs"), scaling)
    config = {"out": str(out), "tag": tag}
    result = rt.Trainer(pool_workloads.preload_fn, s, r, train_loop_config=config).fit()
    assert result.status == "FINISHED", result.error
    return result, [json.loads((out / f"{tag}.rank{k}.json").read_text()) for k in range(workers)]


@pytest.mark.own_pool  # a run's own pool, then a block: not the session's
@pytest.mark.timeout(300)
def test_preloaded_modules_are_imported_once_in_the_zygote_for_every_worker(tmp_path, capfd):
    assert "preload_probe" not in sys.modules  # nothing in the driver imports it
    # A run's own pool imports them when it starts; a module that fails there is left to the
    # workers (said once), the others are imported all the same.
    preload = ("preload_broken_probe", "preload_probe")
    _, records = _preload_fit(tmp_path, "own", 3, preload_modules=preload)
    (zygote,) = {r["ppid"] for r in records}
    assert zygote != os.getpid()  # forked from the zygote, not started cold
    assert [r["probe_imported_in"] for r in records] == [zygote] * 3, records
    err = capfd.readouterr().err
    assert err.count("could not preload preload_broken_probe") == 1, err
    assert "starting workers cold" not in err
    config = json.loads((tmp_path / "runs" / "own" / "config.json").read_text())
    assert config["scaling_config"]["preload_modules"] == list(preload)
    # A block's zygote, already up, imports them at the first request that names them.
    with rt.warm_pool(start=True) as block:
        _, plain = _preload_fit(tmp_path, "plain", 2)
        assert [r["probe_imported_in"] for r in plain] == [None, None], plain
        _, named = _preload_fit(tmp_path, "named", 2, preload_modules=("preload_probe",))
        assert {r["ppid"] for r in plain + named} == {block.zygote_pid}
        assert [r["probe_imported_in"] for r in named] == [block.zygote_pid] * 2, named
        assert block.started == 1
    assert "preload_probe" not in sys.modules


@pytest.mark.own_pool  # the run's own pool, which the module taints
@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("module", "why"),
    [("preload_thread_probe", "a thread was running"), ("preload_cuda_probe", "CUDA")],
    ids=["thread", "cuda"],
)
def test_a_preloaded_module_that_stops_forking_leaves_the_workers_to_start_cold(
    tmp_path, module, why
):
    """A module that starts a thread, or sets up CUDA (emulated on this CPU-only torch:
    tests/preload_cuda_probe.py), in the zygote: workers start cold, and the run says why."""
    _, records = _preload_fit(tmp_path, "tainted", 2, preload_modules=(module,))
    # The zygote did not fork: the workers are the driver's children.
    assert {r["ppid"] for r in records} == {os.getpid()}, records
    lines = (tmp_path / "runs" / "tainted" / "events.jsonl").read_text().splitlines()
    cold = [e for e in map(json.loads, lines) if e["type"] == "cold_start"]
    assert len(cold) == 1 and why in cold[0]["reason"], cold
    assert "preload_modules" in cold[0]["reason"]
    assert module not in sys.modules


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.own_pool
@pytest.mark.timeout(300)
def test_gpu_workers_forked_from_the_zygote_can_use_cuda(tmp_path):
    """On a GPU machine: the zygote's checks never initialise CUDA (no ``cuInit`` through
    ``torch.cuda.is_available()``), so its forked workers run CUDA ops."""
    out = tmp_path / "gpu"
    out.mkdir()
    s, r = job_configs(1, "gpu", str(tmp_path / "runs"), {"use_gpu": True})
    config = {"out": str(out), "tag": "gpu", "cuda": True}
    result = rt.Trainer(pool_workloads.preload_fn, s, r, train_loop_config=config).fit()
    assert result.status == "FINISHED", result.error
    record = json.loads((out / "gpu.rank0.json").read_text())
    assert record["ppid"] != os.getpid(), record  # forked from the zygote, not cold
    assert record["cuda_sum"] == 6.0, record
