"""The train function of ``benchmarks/elastic_overhead.py`` (imported by reference in the workers).

``_goodput_worker.train_fn``'s workload (an MLP 784-1024-1024-10, momentum SGD, DDP, batch 64 per
worker, an asynchronous ``TrainState`` checkpoint every ``every`` steps), with, when
``config["profile"]`` is true, timers around what a step boundary runs: the elastic plug-in's
snapshot copy (``snapshot.take``), its ring replication (``snapshot.replicate_to_neighbour``),
its grow-flag agreement (``ElasticRuntime._grow_agreed`` in the old code; now the start,
``_start_grow_agreement``, and the wait for the result), the preemption plug-in's flag
agreement (``PreemptionPlugin._agreed``) and the whole ``TrainState.step`` increment (every
plug-in's ``on_step``). Each rank writes its totals (seconds) and counts to
``{log}/profile_rank{R}.json`` when it returns.
"""

from __future__ import annotations

import functools
import json
import os
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import _goodput_worker
import torch

import ringtrain as rt

TOTALS: dict[str, float] = defaultdict(float)
COUNTS: dict[str, int] = defaultdict(int)


def _timed(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            TOTALS[name] += time.perf_counter() - start
            COUNTS[name] += 1

    return wrapper


def _install_timers() -> None:
    """Wrap the step-boundary parts named in the module docs (in this worker process only)."""
    from ringtrain.elastic import runtime, snapshot
    from ringtrain.worker import preempt as preempt_worker
    from ringtrain.worker import session, state

    for module, name in (
        (snapshot, "take"),
        (snapshot, "replicate_to_neighbour"),
        (snapshot, "take_async"),
        (snapshot, "finish_pending"),
    ):
        if hasattr(module, name) and not hasattr(getattr(module, name), "__wrapped__"):
            setattr(module, name, _timed(name, getattr(module, name)))
    start = getattr(runtime.ElasticRuntime, "_start_grow_agreement", None)
    if start is not None and not hasattr(start, "__wrapped__"):

        @functools.wraps(start)
        def timed_start(*args: Any, **kwargs: Any) -> Callable[[], bool]:
            return _timed(
                "grow flag: wait for the result", _timed("grow flag: start", start)(*args, **kwargs)
            )

        runtime.ElasticRuntime._start_grow_agreement = timed_start  # type: ignore[method-assign]
    for cls, name in (
        (runtime.ElasticRuntime, "_grow_agreed"),
        (preempt_worker.PreemptionPlugin, "_agreed"),
    ):
        if hasattr(cls, name) and not hasattr(getattr(cls, name), "__wrapped__"):
            setattr(cls, name, _timed(f"{cls.__name__}.{name}", getattr(cls, name)))
    if not hasattr(state.step_taken, "__wrapped__"):
        state.step_taken = _timed("step boundary (all on_step hooks)", session.step_taken)
    _time_step_phases()


def _time_step_phases() -> None:
    """Time each step's phases: forward; loss + backward (DDP's allreduce included);
    ``optimizer.step()``; and the rest of the iteration (the step log, the step boundary, the
    next batch), from hooks on the prepared model and torch's global optimizer hooks."""
    from torch.optim.optimizer import (
        register_optimizer_step_post_hook,
        register_optimizer_step_pre_hook,
    )

    marks: dict[str, float] = {}

    def mark(name: str, since: str | None = None, part: str | None = None) -> None:
        now = time.perf_counter()
        if since is not None and part is not None and since in marks:
            TOTALS[part] += now - marks[since]
            COUNTS[part] += 1
        marks[name] = now

    prepare = rt.prepare_model

    def timed_prepare(model: Any, *args: Any, **kwargs: Any) -> Any:
        wrapped = prepare(model, *args, **kwargs)
        wrapped.register_forward_pre_hook(
            lambda *_: mark("fwd0", "opt1", "phase: rest (log, boundary, next batch)")
        )
        wrapped.register_forward_hook(lambda *_: mark("fwd1", "fwd0", "phase: forward"))
        return wrapped

    rt.prepare_model = timed_prepare
    register_optimizer_step_pre_hook(
        lambda *_: mark("opt0", "fwd1", "phase: loss + backward (allreduce)")
    )
    register_optimizer_step_post_hook(lambda *_: mark("opt1", "opt0", "phase: optimizer.step"))


def train_fn(config: dict[str, Any]) -> None:
    """``_goodput_worker.train_fn``, timed (see the module docs) when ``config["profile"]``."""
    if config.get("profile"):
        _install_timers()
    try:
        _goodput_worker.train_fn(config)
    finally:
        if config.get("profile"):
            rank = rt.get_context().world_rank
            path = os.path.join(config["log"], f"profile_rank{rank}.json")
            with open(path, "w") as f:
                json.dump(
                    {
                        "totals_s": dict(TOTALS),
                        "counts": dict(COUNTS),
                        "threads": torch.get_num_threads(),
                        "interop": torch.get_num_interop_threads(),
                        "omp": os.environ.get("OMP_NUM_THREADS"),
                        "cpu_s": time.process_time(),
                        "threads_alive": threading.active_count(),
                    },
                    f,
                )
