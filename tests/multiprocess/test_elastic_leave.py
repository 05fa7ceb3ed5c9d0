"""A preemption notice for some ranks of an elastic run (issue 19): while ``min_workers`` holds
without them, they leave in place at one agreed step and the others go on as an elastic shrink
(no restart, no disk round trip, the global batch kept), bit-exact with a run that switches size
through a disk checkpoint at that step; when ``min`` would be broken, the whole run is preempted.

The workload (``workloads.elastic_fn``) raises the notice after step ``NOTICE_STEP`` and every
rank waits there for the driver's answer, so the ranks agree on the next step, ``STOP_STEP``,
however loaded the machine: at W=3 rank 1 SIGTERMs itself (a notice from outside the driver);
at W=4 a driver-side source gives a notice for rank 3 (what a Ray node drain gives).
"""

from __future__ import annotations

import collections
import threading
import time

import pytest
import torch

import workloads
from ringtrain.preemption import Notify, PreemptionNotice
from support import read_events as _events
from support import read_jsonl_dir as _records
from support import run_job

EPOCHS = 2  # 120 samples, global batch 12: 10 steps per epoch, 20 in all
NOTICE_STEP = 4
STOP_STEP = NOTICE_STEP + 1  # the first step boundary after every rank got the driver's answer
NO_GROW = {"elastic_grow_after_s": None}


class RanksNotice:
    """A driver-side source: a notice for ``ranks`` once ``path`` exists (a test's stand-in for
    a Ray node drain, which covers the ranks on one node)."""

    def __init__(self, path: str, ranks: tuple[int, ...]) -> None:
        self.path, self.ranks = path, ranks
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self, notify: Notify) -> None:
        def poll() -> None:
            while not self._stop.wait(0.05):
                try:
                    open(self.path).close()
                except FileNotFoundError:
                    continue
                notify(PreemptionNotice.now("node drained", "test", ranks=self.ranks))
                return

        self._thread = threading.Thread(target=poll, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)


def _fit(tmp_path, name, workers, *, restore_from=None, scaling=None, failure=None, **config):
    log = tmp_path / f"{name}_log"
    log.mkdir()
    cfg = {"epochs": EPOCHS, "log": str(log), "out": str(tmp_path / f"{name}.pt"), **config}
    result = run_job(
        workloads.elastic_fn,
        workers,
        storage_path=tmp_path / "runs",
        name=name,
        restore_from=restore_from,
        max_failures=0,
        train_loop_config=cfg,
        **(scaling or {}),
        **(failure or {}),
    )
    out = torch.load(cfg["out"], weights_only=True) if (tmp_path / f"{name}.pt").exists() else None
    return result, _records(log), out


def _check_leave(result, records, old_world, leaving, per_worker_batch):
    """One leave in place, no failure, no restart; the others keep their processes, renumbered
    in order; no step lost or repeated; every sample of each epoch seen once."""
    assert result.error is None and result.status == "FINISHED"
    assert result.failures == [] and result.preemptions == 1
    (notice,) = _events(result.path, "preemption")
    assert notice["ranks"] == list(leaving)
    (resize,) = _events(result.path, "resize")
    new_world = old_world - len(leaving)
    assert (resize["old_world_size"], resize["new_world_size"]) == (old_world, new_world)
    assert resize["snapshot_step"] == STOP_STEP and resize["steps_rolled_back"] == 0
    assert resize["cause"] == f"preemption notice for ranks {list(leaving)}"
    assert [e["attempt"] for e in _events(result.path, "run_start")] == [0]
    before = {r["rank"]: r["pid"] for r in records if r["world"] == old_world}
    after = {r["rank"]: r["pid"] for r in records if r["world"] == new_world}
    stay = [r for r in range(old_world) if r not in leaving]
    assert after == {new: before[old] for new, old in enumerate(stay)}
    kept = [r for r in records if r["world"] == old_world and r["step"] <= STOP_STEP]
    later = [r for r in records if r["world"] == new_world]
    assert sorted({r["step"] for r in kept}) == list(range(1, STOP_STEP + 1))
    assert sorted({r["step"] for r in later}) == list(range(STOP_STEP + 1, 10 * EPOCHS + 1))
    assert not [r for r in records if r["world"] == old_world and r["step"] > STOP_STEP]
    for epoch in range(EPOCHS):
        seen = collections.Counter(i for r in kept + later if r["epoch"] == epoch for i in r["ids"])
        assert sorted(seen) == list(range(120)), f"epoch {epoch}: samples skipped"
        assert max(seen.values()) == 1, f"epoch {epoch}: samples seen twice"
    assert {len(r["ids"]) for r in kept} == {per_worker_batch[0]}
    assert {len(r["ids"]) for r in later} == {per_worker_batch[1]}


@pytest.mark.timeout(300)
def test_sigterm_to_one_worker_of_three_leaves_in_place_bit_exact(tmp_path):
    started = time.monotonic()
    result, records, final = _fit(
        tmp_path, "leave3", (2, 3), scaling=NO_GROW, notice_step=NOTICE_STEP, sigterm_ranks=[1]
    )
    _check_leave(result, records, 3, (1,), (4, 6))
    # The same 3 workers to the stop step, saved to disk; then 2 workers (6 each) resume.
    first, _, _ = _fit(tmp_path, "ref", 3, stop_at=STOP_STEP)
    _, _, reference = _fit(tmp_path, "ref2", 2, restore_from=first.path, batch_size=6)
    assert reference["step"] == final["step"] == 10 * EPOCHS
    for key, value in reference["model"].items():
        assert torch.equal(value, final["model"][key]), f"{key} differs"
    print(f"leave at W=3 and its reference: {time.monotonic() - started:.1f} s")


@pytest.mark.timeout(240)
def test_a_notice_for_one_rank_of_four_leaves_in_place(tmp_path):
    flag = tmp_path / "drained"
    result, records, _ = _fit(
        tmp_path,
        "leave4",
        (3, 4),
        scaling=NO_GROW,
        failure={"notice_sources": [RanksNotice(str(flag), (3,))]},
        notice_step=NOTICE_STEP,
        notice_file=str(flag),
        batch_size=3,
        first_world=4,
    )
    _check_leave(result, records, 4, (3,), (3, 4))


@pytest.mark.timeout(240)
def test_a_notice_that_would_break_min_preempts_the_whole_run(tmp_path):
    flag = tmp_path / "drained"
    result, records, _ = _fit(
        tmp_path,
        "below_min",
        (3, 4),
        scaling=NO_GROW,
        failure={"notice_sources": [RanksNotice(str(flag), (2, 3))]},
        notice_step=NOTICE_STEP,
        notice_file=str(flag),
        batch_size=3,
        first_world=4,
    )
    assert result.status == "PREEMPTED" and result.error is None and result.failures == []
    assert _events(result.path, "resize") == []
    (notice,) = _events(result.path, "preemption")
    assert notice["ranks"] == [2, 3]
    # The first boundaries after the notice (the flag's agreement may take one more step).
    (saved,) = _events(result.path, "preemption_saved")
    assert saved["step"] in (STOP_STEP, STOP_STEP + 1)
    assert max(r["step"] for r in records) == saved["step"]  # every rank stopped there
    assert {r["rank"] for r in records if r["step"] == saved["step"]} == {0, 1, 2, 3}
