"""Step timing (worker side) and straggler detection (driver side): pure logic, a fake clock."""

from __future__ import annotations

import pytest

from ringtrain.monitor import timing
from ringtrain.monitor.straggler import StragglerDetector
from ringtrain.monitor.timing import PARTS, StepLimitReached, StepTimer


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t

    def tick(self, dt: float) -> None:
        self.t += dt


@pytest.fixture
def clock(monkeypatch):
    c = Clock()
    monkeypatch.setattr(timing, "_now", c)
    return c


def _train_step(timer, clock, *, data, fwd, loss, bwd, comm_after_bwd, opt, user, comm_overlap=0.0):
    """One step as a DDP loop drives the hooks: fetch, forward, loss, backward (buckets launched
    during it), the exposed tail of communication, optimizer, then user code."""
    timer.loader_fetch_start()
    clock.tick(data)
    timer.loader_fetch_end(samples=8)
    timer.forward_start()
    clock.tick(fwd)
    timer.forward_end()
    clock.tick(loss)
    launched = clock.t
    clock.tick(bwd)
    timer.grad_ready()
    clock.tick(comm_after_bwd)
    timer.comm_done(launched - comm_overlap, 4096)
    timer.optimizer_start()
    clock.tick(opt)
    timer.optimizer_end()
    clock.tick(user)


def test_parts_are_measured_and_add_up_to_the_step(clock):
    timer = StepTimer()
    for _ in range(3):
        _train_step(
            timer, clock, data=0.01, fwd=0.02, loss=0.005, bwd=0.03, comm_after_bwd=0.004,
            opt=0.002, user=0.001,
        )  # fmt: skip
    timer.loader_fetch_start()  # the loop asks for the 4th batch: the 3rd step ends
    timer.loader_exhausted()  # ... and the epoch is over: no 4th step
    w = timer.take_window()
    assert w is not None
    assert w["steps"] == 3 and w["step"] == 3 and w["samples"] == 24
    assert w["step_s"] == pytest.approx(0.072)
    assert w["data_s"] == pytest.approx(0.01)
    assert w["compute_s"] == pytest.approx(0.055)  # forward + loss + backward
    assert w["comm_exposed_s"] == pytest.approx(0.004)
    assert w["comm_s"] == pytest.approx(0.034)  # launched when backward began
    assert w["optimizer_s"] == pytest.approx(0.002)
    assert w["other_s"] == pytest.approx(0.001)
    assert sum(w[p] for p in PARTS) == pytest.approx(w["step_s_mean"])
    assert w["busy_s"] == pytest.approx(0.072 - 0.004)
    assert w["comm_bytes"] == 4096
    assert w["samples_per_s"] == pytest.approx(24 / (3 * 0.072))
    assert w["rss_bytes"] > 0 and w["gpu_allocated_bytes"] is None
    assert timer.take_window() is None  # a window is taken once


def test_an_optimizer_that_waits_for_communication_is_not_counted_twice(clock):
    # Horovod-style: gradients are allreduced while backward runs and optimizer.step() waits for
    # the rest; the wait is exposed communication, the remainder optimizer time.
    timer = StepTimer()
    timer.loader_fetch_start()
    timer.loader_fetch_end(4)
    timer.forward_start()
    clock.tick(0.01)
    timer.forward_end()
    launched = clock.t
    clock.tick(0.01)
    timer.grad_ready()
    timer.optimizer_start()
    clock.tick(0.005)  # waiting for the allreduce inside step()
    timer.comm_done(launched, 100)
    clock.tick(0.002)  # the update itself
    timer.optimizer_end()
    timer.loader_fetch_start()
    w = timer.take_window()
    assert w["comm_exposed_s"] == pytest.approx(0.005)
    assert w["optimizer_s"] == pytest.approx(0.002)
    assert sum(w[p] for p in PARTS) == pytest.approx(w["step_s_mean"])


def test_without_a_comm_hook_the_wait_after_the_last_gradient_is_exposed_communication(clock):
    # MonitorConfig.comm_timing="wait": DDP's own allreduce, untimed; backward returns when it is
    # done and the optimizer follows.
    timer = StepTimer()
    timer.wait_comm_bytes = 1000
    timer.loader_fetch_start()
    timer.loader_fetch_end(4)
    timer.forward_start()
    clock.tick(0.01)
    timer.forward_end()
    clock.tick(0.02)
    timer.grad_ready()
    clock.tick(0.006)  # DDP's finalize waits for the allreduce
    timer.optimizer_start()
    clock.tick(0.002)
    timer.optimizer_end()
    timer.loader_fetch_start()
    w = timer.take_window()
    assert w["compute_s"] == pytest.approx(0.03)
    assert w["comm_exposed_s"] == pytest.approx(0.006) == pytest.approx(w["comm_s"])
    assert w["comm_bytes"] == 1000 and w["optimizer_s"] == pytest.approx(0.002)
    assert sum(w[p] for p in PARTS) == pytest.approx(w["step_s_mean"])


def test_breaking_out_of_the_loop_ends_the_step_and_a_late_fetch_starts_a_new_one(clock):
    timer = StepTimer()
    timer.loader_fetch_start()
    clock.tick(0.01)
    timer.loader_fetch_end(2)
    clock.tick(0.02)
    timer.loader_exhausted()  # `break`: the generator is closed
    clock.tick(5.0)  # evaluation between epochs is not part of any step
    timer.loader_fetch_start()
    timer.loader_fetch_end(2)
    clock.tick(0.03)
    timer.loader_fetch_start()
    w = timer.take_window()
    assert w["steps"] == 2
    assert w["window_s"] == pytest.approx(0.03 + 0.03)


def test_steps_are_delimited_by_the_optimizer_without_a_prepared_loader(clock):
    timer = StepTimer()
    for _ in range(4):
        timer.optimizer_start()
        clock.tick(0.001)
        timer.optimizer_end()
        clock.tick(0.009)
    w = timer.take_window()
    # The first step starts at the first optimizer.step(); each later one ends at the next.
    assert w["steps"] == 4
    assert w["step_s"] == pytest.approx(0.010)  # median; the first closes at its own end
    assert w["step_s_mean"] == pytest.approx((0.001 + 3 * 0.010) / 4)


def test_max_steps_stops_the_loop_when_it_asks_for_one_more_batch(clock):
    timer = StepTimer(max_steps=2)
    for _ in range(2):
        timer.loader_fetch_start()
        timer.loader_fetch_end(1)
        clock.tick(0.01)
    with pytest.raises(StepLimitReached):
        timer.loader_fetch_start()
    assert timer.steps_total == 2
    timer.loader_exhausted()  # the loader's `finally` after the exception: nothing more
    assert timer.take_window()["steps"] == 2


def test_batch_size_of_nested_batches():
    import torch

    assert timing.batch_size_of(torch.zeros(5, 3)) == 5
    assert timing.batch_size_of((torch.zeros(7), torch.zeros(7, 2))) == 7
    assert timing.batch_size_of({"x": [torch.zeros(3, 1)]}) == 3
    assert timing.batch_size_of("text") == 0


# ---------------------------------------------------------------------------- stragglers


def _window(busy, **parts):
    w = {"busy_s": busy, "data_s": 0.0, "compute_s": 0.0, "optimizer_s": 0.0, "other_s": 0.0}
    w.update(parts)
    return w


def test_a_slow_rank_is_flagged_after_patience_windows_and_the_others_are_not():
    det = StragglerDetector(threshold=0.2, patience=2)
    events = []
    for _ in range(3):
        for rank in range(4):
            slow = rank == 2
            w = _window(0.15 if slow else 0.10, compute_s=0.05, data_s=0.08 if slow else 0.03)
            events += det.update(rank, w, now=1.0)
    assert [(e.rank, e.flagged, e.reason) for e in events] == [(2, True, "data")]
    ev = events[0]
    assert ev.median_s == pytest.approx(0.10) and ev.ratio == pytest.approx(1.5)
    assert "rank 2 is a straggler" in ev.message and "waiting for data" in ev.message
    assert det.flagged == {2}


def test_a_rank_within_the_margin_is_not_flagged():
    det = StragglerDetector(threshold=0.2, patience=1)
    events = []
    for _ in range(3):
        events += det.update(0, _window(0.100), now=0)
        events += det.update(1, _window(0.119), now=0)  # 19 % slower: inside the margin
    assert events == []


def test_a_straggler_is_cleared_after_patience_windows_back_in_line():
    det = StragglerDetector(threshold=0.2, patience=2)
    det.update(0, _window(0.1), now=0)
    flagged = det.update(1, _window(0.3, compute_s=0.2), now=0)
    flagged += det.update(1, _window(0.3, compute_s=0.2), now=0)
    assert [(e.flagged, e.reason) for e in flagged] == [(True, "compute")]
    assert det.update(1, _window(0.1), now=0) == []  # one window in line is not enough
    cleared = det.update(1, _window(0.1), now=0)
    assert [(e.rank, e.flagged) for e in cleared] == [(1, False)]
    assert det.flagged == set()


def test_tiny_steps_and_a_lone_rank_are_never_flagged():
    det = StragglerDetector(threshold=0.2, patience=1)
    assert det.update(0, _window(0.5), now=0) == []  # no other rank to compare with
    det = StragglerDetector(threshold=0.2, patience=1, min_busy_s=1e-3)
    det.update(0, _window(1e-5), now=0)
    assert det.update(1, _window(1e-4), now=0) == []  # 10x, but of microseconds
    det.reset()
    assert det.latest == {} and det.flagged == set()
