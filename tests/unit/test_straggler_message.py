"""The straggler line names what it compares with (issue 40): with one other rank there is no
median, there is that rank."""

from __future__ import annotations

from ringtrain.monitor.straggler import StragglerDetector


def _flag(busy: dict[int, float]) -> list[str]:
    detector = StragglerDetector(threshold=0.2, patience=1)
    lines = []
    for _ in range(2):
        for rank, b in busy.items():
            lines += [e.message for e in detector.update(rank, {"busy_s": b}, now=0.0)]
    for rank in busy:  # back in line
        for _ in range(2):
            lines += [e.message for e in detector.update(rank, {"busy_s": 0.1}, now=1.0)]
    return lines


def test_two_ranks_compare_with_the_other_rank_and_more_with_their_median():
    two = _flag({0: 0.1, 1: 0.15})
    assert two[0].startswith("rank 1 is a straggler: busy 0.15 s/step vs 0.1 s/step of rank 0 ")
    assert two[1] == "rank 1 is no longer a straggler (0.1 s/step vs 0.1 s/step of rank 0)"
    assert not any("median" in line for line in two)
    three = _flag({0: 0.1, 1: 0.1, 2: 0.15})
    assert three[0].startswith(
        "rank 2 is a straggler: busy 0.15 s/step vs 0.1 s/step, the median of the other ranks "
    )
