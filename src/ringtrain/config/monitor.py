"""``MonitorConfig``: what a run measures and where it logs (step timing, straggler
detection, TensorBoard, CSV); part of :class:`~ringtrain.config.RunConfig`, validated when it
is built, re-exported by :mod:`ringtrain.config`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

from ringtrain.config.validation import check_int, short_errors


@short_errors
@dataclass(frozen=True)
class MonitorConfig:
    """What a run measures and where it logs (see docs/monitoring.md).

    Attributes:
        timing: time every training step in every worker (data wait, forward + backward
            compute, communication and its part not overlapped with backward, optimizer) and
            send per-window aggregates to the driver. On by default; its cost is measured in
            docs/benchmarks.md, "Monitoring overhead".
        timing_interval_s: how often each worker sends its timing window (seconds).
        comm_timing: how DDP's gradient allreduce is timed. ``"hook"``: inside a DDP
            communication hook, per bucket from launch to completion (total and exposed
            communication, bytes). ``"wait"``: without a hook, as the time backward waits for
            DDP's own allreduce after the last gradient (exposed communication only; ``comm_s``
            then equals it); DDP's built-in allreduce averages while copying gradients into its
            buckets, which a hook cannot do, so on CPU a hook costs one more pass over the
            gradients (about 5 % of a step of the benchmark MLP). ``"auto"`` (default): "hook" on
            GPU, where that pass is one cheap kernel, "wait" on CPU.
        straggler_threshold: a rank is a straggler when its busy time per step (step time
            minus time spent waiting in communication) exceeds the median of the other ranks' by
            more than this fraction (0.2: 20 % slower).
        straggler_patience: consecutive timing windows a rank must be over (or back under) the
            threshold before it is flagged (or cleared).
        tensorboard: write TensorBoard event files to ``{run_dir}/tensorboard/``.
        csv: write ``{run_dir}/metrics.csv`` and ``{run_dir}/timing.csv``.
    """

    timing: bool = True
    timing_interval_s: float = 2.0
    comm_timing: Literal["auto", "hook", "wait"] = "auto"
    straggler_threshold: float = 0.2
    straggler_patience: int = 2
    tensorboard: bool = True
    csv: bool = True

    def __post_init__(self) -> None:
        for name in ("timing", "tensorboard", "csv"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(
                    f"MonitorConfig.{name} must be True or False, got {getattr(self, name)!r}"
                )
        for name, value in (
            ("timing_interval_s", self.timing_interval_s),
            ("straggler_threshold", self.straggler_threshold),
        ):
            if (
                isinstance(value, bool)
                or not isinstance(value, (int, float))
                or not value > 0
                or value == float("inf")
            ):
                raise ValueError(f"MonitorConfig.{name} must be a positive number, got {value!r}")
        if self.comm_timing not in ("auto", "hook", "wait"):
            raise ValueError(
                "MonitorConfig.comm_timing must be 'auto', 'hook' or 'wait', got "
                f"{self.comm_timing!r}"
            )
        check_int(
            "MonitorConfig",
            "straggler_patience",
            self.straggler_patience,
            1,
            "the number of consecutive timing windows, e.g. 2",
        )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
