"""The Ray backend on a real two-node Ray cluster started on this machine by the tests.

One cluster (``ray.cluster_utils.Cluster``: a head and a worker node, 2 CPUs each, from
tests/backends/conftest.py, shared with the tier's other Ray modules) serves the whole module;
it starts before the first test, so its processes predate every test's leak check. Its head
notices a lost node within about a second (``ray_cluster.SHARED_HEAD_ARGS``: the node death
test). The exact-resume tests run ``workloads.exact_fn`` and
compare, tensor by tensor, with an uninterrupted run on the *local* backend: the Ray backend must
give the very same parameters. The module also checks where the rendezvous store listens (issue
18), on this cluster rather than on one of its own.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from datetime import timedelta

import pytest
import torch

import net_workloads
import ringtrain as rt
import workloads
from ray_cluster import assert_torn_down, leftovers
from support import assert_bit_identical, run_job, wait_until

ray = pytest.importorskip("ray", reason="the Ray backend needs Ray: pip install 'ringtrain[ray]'")
pytest.importorskip("ray.util.state", reason="the Ray state API needs ray[default]")

from ray.cluster_utils import Cluster  # noqa: E402

from ringtrain.launch.ray import PlacementError  # noqa: E402
from ringtrain.launch.ray_worker import remote_worker_class  # noqa: E402
from ringtrain.result import TrainingFailedError  # noqa: E402

# One local Ray cluster at a time: the Ray tests share one pytest worker (pyproject addopts).
pytestmark = pytest.mark.xdist_group("ray")

EPOCHS = 3  # exact_fn: 30 steps, a report every 4 steps and at each epoch's end: 10 rounds
_finals: dict[str, dict] = {}


def _run_config(tmp_path, name, **kwargs):
    return rt.RunConfig(
        name=name,
        storage_path=str(tmp_path / "runs"),
        failure_config=rt.FailureConfig(max_failures=kwargs.pop("max_failures", 1)),
        progress="off",
        **kwargs,
    )


def _fit_exact(tmp_path, name, backend="ray", kill=None, callbacks=(), max_failures=1):
    out = tmp_path / f"{name}.pt"
    cfg = {"epochs": EPOCHS, "out": str(out), "kill": kill, "kill_rank": 1}
    result = rt.Trainer(
        workloads.exact_fn,
        rt.ScalingConfig(num_workers=2, backend=backend),
        _run_config(tmp_path, name, callbacks=callbacks, max_failures=max_failures),
        train_loop_config=cfg,
    ).fit()
    return result, torch.load(out, weights_only=True)


def _local_final(tmp_path_factory):
    if "local" not in _finals:
        result, final = _fit_exact(tmp_path_factory.mktemp("local"), "local", backend="local")
        assert result.failures == []
        _finals["local"] = final
    return _finals["local"]


EXPECTED_STEPS = [s for s in range(1, EPOCHS * 10 + 1) for every in (4, 10) if s % every == 0]


def test_two_workers_end_to_end_match_the_local_backend(cluster, tmp_path, tmp_path_factory):
    result, final = _fit_exact(tmp_path, "e2e")
    assert result.failures == [] and result.error is None
    assert_bit_identical(_local_final(tmp_path_factory), final)
    assert [m["step"] for m in result.metrics_history] == EXPECTED_STEPS
    # every rank's reports reached the driver, and the checkpoints are in the run directory
    run = tmp_path / "runs" / "e2e"
    events = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
    reports = [e for e in events if e["type"] == "report"]
    assert sorted({e["rank"] for e in reports}) == [0, 1]
    assert len(reports) == 2 * len(EXPECTED_STEPS)
    assert sorted(result.metrics_per_rank) == [0, 1]
    assert result.checkpoint is not None
    assert os.path.dirname(result.checkpoint.path) == str(run)
    assert json.loads((run / "result.json").read_text())["status"] == "FINISHED"
    assert json.loads((run / "config.json").read_text())["scaling_config"]["backend"] == "ray"
    _finals["ray"] = final
    assert_torn_down()


class _KillActor:
    """Driver-side callback: ``ray.kill`` the actor of bundle 1 (rank 1 under PACK on one
    node) of attempt ``attempt`` once rank 1 has reported round ``at``."""

    def __init__(self, run_name: str, at: int, attempt: int = 0) -> None:
        self.prefix = f"ringtrain-{run_name}-a{attempt}-w1-"
        self.at = at
        self.killed: list[str] = []

    def on_report(self, rank, round_, metrics):
        if self.killed or rank != 1 or round_ != self.at:
            return
        names = [n for n in ray.util.list_named_actors() if n.startswith(self.prefix)]
        if not names:
            return  # an earlier attempt's report of this round
        assert len(names) == 1, names
        ray.kill(ray.get_actor(names[0]), no_restart=True)
        self.killed.append(names[0])


def test_a_worker_sigkill_then_a_killed_actor_resume_bit_exactly(
    cluster, tmp_path, tmp_path_factory
):
    """Two failures of one run, each followed by a restart of the whole group from the last
    checkpoint: rank 1's worker process SIGKILLed at step 17 (attempt 0), then rank 1's Ray
    actor killed by ``ray.kill`` once it reported round 5, attempt 1's first new round (its
    worker process dies with it; 10 of the 30 steps are still to come). Each is named for
    what it was; the run ends bit-identical to the local backend's uninterrupted run, with
    every round's metrics once."""
    killer = _KillActor("two_kills", at=5, attempt=1)
    result, final = _fit_exact(
        tmp_path, "two_kills", kill=("step", 17), callbacks=[killer], max_failures=2
    )
    assert len(killer.killed) == 1
    assert [(f.rank, f.kind) for f in result.failures] == [(1, "signal"), (1, "exception")]
    assert result.failures[0].message == "rank 1 was killed by SIGKILL"
    actor_died = result.failures[1].message
    assert "the Ray actor of rank 1" in actor_died and "died" in actor_died, actor_died
    assert_bit_identical(_local_final(tmp_path_factory), final)
    assert [m["step"] for m in result.metrics_history] == EXPECTED_STEPS
    assert_torn_down()


def test_spread_placement_sets_node_and_local_ranks(cluster, tmp_path):
    strategy, node_ranks, local_ranks = "SPREAD", [0, 1], [0, 0]
    assert_torn_down()  # both nodes idle: SPREAD then puts one worker on each
    result = rt.Trainer(
        workloads.placement_fn,
        rt.ScalingConfig(
            num_workers=2,
            backend="ray",
            placement_strategy=strategy,
            resources_per_worker={"CPU": 1},
        ),
        _run_config(tmp_path, strategy.lower(), max_failures=0),
    ).fit()
    per_rank = [result.metrics_per_rank[r] for r in (0, 1)]
    assert [m["world_size_sum"] for m in per_rank] == [2.0, 2.0]
    assert [m["node_rank"] for m in per_rank] == node_ranks
    assert [m["local_rank"] for m in per_rank] == local_ranks
    assert [m["local_world_size"] for m in per_rank] == [2 // len(set(node_ranks))] * 2
    assert [m["threads"] for m in per_rank] == [1, 1]
    node_ids = [m["node_id"] for m in per_rank]
    alive = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
    assert set(node_ids) <= alive
    assert len(set(node_ids)) == len(set(node_ranks))  # one node id per node rank
    # Each worker's multiprocessing temp dir (launch/reaper.py) is gone with it: its actor
    # removes it once the worker has exited.
    temps = [m["mp_temp"] for m in per_rank]
    assert all(os.path.basename(t).startswith("pymp-ringtrain-") for t in temps), temps
    assert wait_until(lambda: not any(map(os.path.exists, temps)), timeout_s=10), temps
    assert_torn_down()


@pytest.mark.parametrize(
    ("scaling", "message"),
    [
        (
            {"num_workers": 3, "placement_strategy": "STRICT_SPREAD"},
            "STRICT_SPREAD needs 3 nodes with CPU 1 each, the cluster has 2",
        ),
        ({"num_workers": 2, "resources_per_worker": {"CPU": 3}}, "no node can hold one worker"),
        ({"num_workers": 1, "resources_per_worker": {"TPU": 1}}, "missing TPU 1"),
    ],
    ids=["strict-spread", "cpu", "custom"],
)
def test_unsatisfiable_placement_fails_in_time_naming_what_is_missing(
    cluster, tmp_path, scaling, message
):
    trainer = rt.Trainer(
        workloads.placement_fn,
        rt.ScalingConfig(backend="ray", placement_timeout_s=1.0, **scaling),
        _run_config(tmp_path, "unplaceable", max_failures=3),
    )
    with pytest.raises(PlacementError, match="placement_timeout_s=1") as info:
        trainer.fit()
    assert message in str(info.value)
    assert_torn_down()


def test_cli_runs_a_script_on_ray(cluster, tmp_path):
    script = tmp_path / "train.py"
    script.write_text(
        textwrap.dedent(
            """
            import torch, torch.distributed as dist, ringtrain as rt
            dist.init_process_group("gloo")
            t = torch.ones(1); dist.all_reduce(t)
            ctx = rt.get_context()
            print("sum", t.item(), "node", ctx.node_rank, "local", ctx.local_rank)
            rt.report({"sum": t.item(), "rank": dist.get_rank()})
            """
        )
    )
    cmd = [sys.executable, "-m", "ringtrain.cli", "run", "--backend", "ray", "--address"]
    cmd += [cluster.address, "-n", "2", "--storage-path", str(tmp_path / "runs")]
    cmd += ["--placement-strategy", "STRICT_PACK"]  # both workers on one node
    cmd += ["--name", "cli", "--progress", "plain", str(script)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "(rank 0) sum 2.0 node 0 local 0" in proc.stdout
    assert "(rank 1) sum 2.0 node 0 local 1" in proc.stdout
    assert "[cli] FINISHED" in proc.stdout + proc.stderr
    config = json.loads((tmp_path / "runs" / "cli" / "config.json").read_text())
    assert config["scaling_config"]["backend"] == "ray"
    assert config["scaling_config"]["ray_address"] == cluster.address
    assert_torn_down()


# ------------------------------------------------------------------ the store's address (issue 18)


def test_the_rank0_actor_store_binds_the_node_address(cluster):
    """On Ray, the rendezvous store listens on its node's address, not the wildcard (the cluster
    runs on this machine, so the actor's sockets can be read from /proc)."""
    actor = remote_worker_class(ray).options(num_cpus=1).remote()
    try:
        port = ray.get(actor.host_store.remote(2), timeout=120)
        info = ray.get(actor.node_info.remote(), timeout=120)
        # the socket is bound before host_store returns; the store takes it over meanwhile
        assert wait_until(
            lambda: any(p == port for _, p in net_workloads.tcp_listeners(info["pid"])),
            timeout_s=60,
        )
        ours = [(h, p) for h, p in net_workloads.tcp_listeners(info["pid"]) if p == port]
        assert ours == [(info["ip"], port)], f"the store listens on {ours}, not {info['ip']}"
        assert info["ip"] not in ("0.0.0.0", "::")
        # and it serves: a worker-side client can use it
        import torch.distributed as dist

        client = dist.TCPStore(info["ip"], port, is_master=False, timeout=timedelta(seconds=60))
        client.set("k", "v")
        assert client.get("k") == b"v"
        del client
    finally:
        ray.kill(actor, no_restart=True)
    assert_torn_down()


def test_a_hung_rank_is_failed_and_its_stack_reaches_the_driver(cluster, tmp_path, capfd):
    """Hang detection on Ray: rank 1 sleeps after step 3 (``worker_timeout_s=2``); the driver
    fails it as hung and, before it stops the group, asks rank 1's actor for the worker's stacks
    (SIGUSR2 to the process, on whatever node it runs): the line it sleeps on reaches the
    driver's output with the rank's prefix."""
    config = {"epochs": 1, "out": str(tmp_path / "out.pt"), "kill": ("hang", 3), "kill_rank": 1}
    with pytest.raises(TrainingFailedError) as failed:
        run_job(
            workloads.exact_fn,
            storage_path=tmp_path / "runs",
            name="hang",
            train_loop_config=config,
            backend="ray",
            max_failures=0,
            worker_timeout_s=4.0,  # 2 s let a loaded machine call the hung rank frozen (no stacks)
            progress="off",
        )
    [failure] = failed.value.failures
    assert failure.kind == "hang" and failure.rank == 1, failed.value.failures
    out, err = capfd.readouterr()
    found = re.search(r"\(rank 1\) +File .*workloads\.py\", line \d+ in ", out + err)
    assert found, (out + err)[-3000:]
    assert_torn_down()


class _RemoveNode:
    """Driver-side callback: once both ranks reported round 0, kill every process of the worker
    node (raylet included, no grace), as a machine failure would."""

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        self.nodes: dict[int, str] = {}
        self.removed: str | None = None

    def on_report(self, rank, round_, metrics):
        if metrics["attempt"] == 0:
            self.nodes[rank] = metrics["node_id"]

    def on_round(self, round_, metrics):
        if self.removed is not None:
            return
        driver_node = ray.get_runtime_context().get_node_id()
        victim = next(n for n in self.cluster.worker_nodes if n.node_id != driver_node)
        self.removed = victim.node_id
        self.cluster.remove_node(victim, allow_graceful=False)


def test_node_death_is_a_worker_failure_and_the_run_recovers(cluster, tmp_path):
    # The last test that uses the cluster: it leaves the head node alone.
    remover = _RemoveNode(cluster)
    result = rt.Trainer(
        workloads.node_loss_fn,
        rt.ScalingConfig(num_workers=2, backend="ray", placement_strategy="SPREAD"),
        _run_config(tmp_path, "node_loss", max_failures=1, callbacks=[remover]),
    ).fit()
    lost = [r for r, n in remover.nodes.items() if n == remover.removed]
    assert len(lost) == 1, remover.nodes
    assert [(f.rank, f.kind) for f in result.failures] == [(lost[0], "exception")]
    assert "died" in result.failures[0].message
    assert result.metrics["attempt"] == 1
    assert_torn_down()


def test_ringtrain_never_imports_ray_and_names_the_extra_when_missing(tmp_path):
    code = textwrap.dedent(
        """
        import sys
        import ringtrain as rt
        rt.ScalingConfig(num_workers=2, backend="ray")
        assert "ray" not in sys.modules, "importing ringtrain imported ray"
        sys.modules["ray"] = None  # as if Ray were not installed
        try:
            rt.Trainer(lambda: None, rt.ScalingConfig(backend="ray")).fit()
        except ImportError as exc:
            print(exc)
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
        cwd=tmp_path,
    )
    assert "pip install 'ringtrain[ray]'" in proc.stdout


def test_tune_sweep_gang_schedules_trials_on_the_cluster(cluster, tmp_path):
    """Sweep trials as Ray placement groups: capacity is the cluster's 4 CPUs, so at most two
    2-worker trials run at once; every trial's placement group is removed afterwards."""
    import tune_workloads
    from ringtrain import tune

    log = tmp_path / "log"
    log.mkdir()
    grid = tune.Tuner(
        tune_workloads.regression_fn,
        param_space={"lr": tune.grid_search([0.01, 0.02, 0.03]), "rounds": 2, "log": str(log)},
        tune_config=tune.TuneConfig(metric="score", mode="max"),
        scaling_config=rt.ScalingConfig(num_workers=2, backend="ray"),
        run_config=rt.RunConfig(name="ray_sweep", storage_path=str(tmp_path), progress="off"),
    ).fit()
    assert grid.statuses == ["COMPLETE"] * 3
    records = [json.loads(line) for f in sorted(log.iterdir()) for line in f.open()]
    assert len(records) == 6
    points = sorted([(r["start"], 1) for r in records] + [(r["end"], -1) for r in records])
    running = [sum(d for _, d in points[: i + 1]) for i in range(len(points))]
    assert max(running) <= 4
    assert wait_until(lambda: leftovers() == ([], []), timeout_s=30)
    assert ray.is_initialized()  # the sweep used the caller's Ray and left it running
