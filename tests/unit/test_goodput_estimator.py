"""``benchmarks/goodput.py``'s goodput paired in time (``local_useful``) on synthetic step logs:
the pure arithmetic that turns a mode's step log into useful seconds. (The benchmark itself runs
real processes for minutes; its figures are in docs/benchmarks.md, "Recovery and goodput".)"""

from __future__ import annotations

import importlib.util
import os
import sys
from types import ModuleType

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _goodput() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "goodput_under_test", os.path.join(ROOT, "benchmarks", "goodput.py")
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


goodput = _goodput()


def _log(stretches: list[tuple[int, int, int, int, float]], t: float = 1000.0) -> list[dict]:
    """Rank-0 (and, at world 2, rank-1) step lines: each stretch is (pid, world, first step,
    last step, period s), one after the other, with a 1 s gap between stretches."""
    lines = []
    for pid, world, first, last, period in stretches:
        for step in range(first, last + 1):
            for rank in range(world):
                lines.append({"step": step, "time": t, "world": world, "rank": rank, "pid": pid})
            t += period
        t += 1.0
    return lines


def test_an_undisturbed_run_is_worth_its_own_period_in_every_minute() -> None:
    # The machine slows down from 30 ms to 40 ms a step after a minute: each minute's steps
    # are worth that minute's period, so goodput stays ~100 % whatever the drift.
    steps = []
    t = 0.0
    for step in range(1, 5001):
        steps.append({"step": step, "time": t, "world": 2, "rank": 0, "pid": 7})
        t += 0.030 if step < 2000 else 0.040
    local = goodput.local_useful(steps, 5000)
    wall = steps[-1]["time"] - steps[0]["time"]
    assert local.useful_s == pytest.approx(wall, rel=0.002)
    assert local.shrunk_gain_s == 0.0
    assert min(local.periods_s) == pytest.approx(0.030, rel=0.01)
    assert max(local.periods_s) == pytest.approx(0.040, rel=0.01)


def test_recomputed_steps_and_gaps_are_lost_and_the_warmup_steps_do_not_set_the_period() -> None:
    # pid 1 trains 1..500 and dies; pid 2 re-trains 481..1000 (20 recomputed), its first 20
    # steps at 100 ms (a cold group): the period stays 20 ms, each step counts once.
    first = _log([(1, 2, 1, 500, 0.020)])
    second = _log([(2, 2, 481, 500, 0.100), (2, 2, 501, 1000, 0.020)], t=first[-1]["time"] + 3)
    # The cold steps and the hot ones are one stretch (same pid, consecutive steps).
    second = [s for s in second if s["step"] <= 500] + [
        dict(s, time=s["time"] - 1.0) for s in second if s["step"] > 500
    ]
    local = goodput.local_useful(first + second, 1000, bin_s=1e9)
    assert local.periods_s == [pytest.approx(0.020)]
    assert local.useful_s == pytest.approx(1000 * 0.020)


def test_a_shrunk_stretch_is_worth_the_full_worlds_period_and_its_gain_is_reported() -> None:
    # world 2 at 30 ms, a kill, world 1 at 20 ms for 100 steps, back to world 2.
    steps = _log([(1, 2, 1, 300, 0.030), (1, 1, 301, 400, 0.020), (1, 2, 401, 700, 0.030)])
    local = goodput.local_useful(steps, 700, bin_s=1e9)
    assert local.useful_s == pytest.approx(700 * 0.030)
    # 99 world-1 periods, each 10 ms faster than a world-2 one.
    assert local.shrunk_gain_s == pytest.approx(99 * 0.010)


def test_a_minute_without_steady_steps_borrows_its_nearest_minutes_period() -> None:
    # Minute 0 at 30 ms; minute 1 only a 5-step stretch (all warm-up); minute 2 at 50 ms.
    steps = _log([(1, 2, 1, 1500, 0.040)], t=0.0)
    for s in steps:  # 1500 steps x 40 ms = 60 s: exactly minute 0
        s["time"] *= 0.75  # -> 30 ms, 45 s
    steps += _log([(2, 2, 1501, 1505, 0.1)], t=70.0)
    steps += _log([(3, 2, 1506, 2000, 0.050)], t=121.0)
    local = goodput.local_useful(steps, 2000, bin_s=60.0)
    # Steps 1501-1505 sit in minute 1: nearest with steady steps is minute 0 (ties -> earlier).
    expected = 1505 * 0.030 + 495 * 0.050
    assert local.useful_s == pytest.approx(expected, rel=1e-6)


def test_a_log_missing_a_useful_step_or_any_steady_step_is_refused() -> None:
    steps = _log([(1, 2, 1, 100, 0.030)])
    with pytest.raises(ValueError, match="never logged"):
        goodput.local_useful(steps, 101)
    with pytest.raises(ValueError, match="no steady step at world size 2"):
        goodput.local_useful(_log([(1, 1, 1, 100, 0.030)]), 100)
    with pytest.raises(ValueError, match="no step of rank 0"):
        goodput.local_useful([], 1)
