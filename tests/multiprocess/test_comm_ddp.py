"""prepare_model's communication options for DDP users (issue 5): torch's DDP comm hooks, DDP
options, mixed precision, gradient accumulation, on 2 real gloo ranks; Horovod launcher variables.

One 2-rank run (``comm_workloads.options_fn``) trains the same model with every option on the
same data and the tests below read its results."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import comm_workloads
import ringtrain as rt
from ringtrain.comm.ddp import wire_bytes

STEPS = 12


@pytest.fixture(scope="module")
def options_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("options")
    out = tmp / "out.pt"
    result = rt.Trainer(
        comm_workloads.options_fn,
        rt.ScalingConfig(num_workers=2),
        rt.RunConfig(name="options", storage_path=str(tmp), progress="off"),
        train_loop_config={"steps": STEPS, "out": str(out)},
    ).fit()
    assert result.error is None
    return torch.load(out, weights_only=True)


def _distance(a: dict, b: dict) -> float:
    return sum(((a[k] - b[k]) ** 2).sum() for k in a).sqrt().item()


def _initial() -> dict:
    return comm_workloads._mlp().state_dict()


@pytest.mark.parametrize(("hook", "rel_tol"), [("bf16", 0.02), ("fp16", 0.005), ("powersgd", 0.1)])
def test_comm_hook_trains_like_plain_allreduce(options_run, hook, rel_tol):
    plain = options_run["hooks"]["None"]["params"]
    moved = _distance(plain, _initial())
    assert moved > 0.1
    got = options_run["hooks"][hook]["params"]
    # the same trajectory up to the compression error: far closer to the plain run than the
    # plain run is to where it started
    assert _distance(got, plain) < rel_tol * moved
    assert _distance(got, plain) > 0  # the hook did change what went over the wire


def test_comm_hooks_put_fewer_bytes_on_the_wire(options_run):
    hooks = options_run["hooks"]
    numel = sum(v.numel() for v in _initial().values())
    assert hooks["None"]["log"] == []  # DDP's built-in allreduce (C++), no Python hook
    for half in ("bf16", "fp16"):
        calls = hooks[half]["log"]
        dtype = torch.bfloat16 if half == "bf16" else torch.float16
        assert len(calls) == STEPS and {d for d, _ in calls} == {dtype}
        assert sum(n for _, n in calls) == STEPS * numel
    calls = hooks["powersgd"]["log"]
    # 2 warm-up steps of plain allreduce, then 3 allreduces per step (uncompressed, P, Q)
    assert len(calls) == 2 + 3 * (STEPS - 2)
    assert sum(n for _, n in calls[2:]) < 0.5 * (STEPS - 2) * numel
    shapes = [v.shape for v in _initial().values()]
    assert sum(n for _, n in calls[2:5]) * 4 == wire_bytes("powersgd", shapes, powersgd_rank=2)
    assert sum(n for _, n in calls[:1]) * 4 == wire_bytes("powersgd", shapes, warm_up=True)
    assert wire_bytes("bf16", shapes) * 2 == wire_bytes(None, shapes) == numel * 4


def test_ddp_options_reach_the_ddp_object(options_run):
    small, unused = options_run["ddp"]["small_buckets_static"], options_run["ddp"]["unused"]
    assert small["bucket_bytes_cap"] == int(0.001 * 1024 * 1024)
    assert small["static_graph"] is True and small["find_unused_parameters"] is False
    # a model with a parameter forward never uses trains only with find_unused_parameters
    assert unused["find_unused_parameters"] is True and unused["static_graph"] is False
    assert unused["gradient_as_bucket_view"] is True  # ddp_kwargs still pass through
    assert unused["bucket_bytes_cap"] == 25 * 1024 * 1024


@pytest.mark.parametrize(("precision", "rel_tol"), [("bf16-mixed", 0.02), ("16-mixed", 0.005)])
def test_mixed_precision_autocasts_inside_and_trains_like_fp32(options_run, precision, rel_tol):
    runs = options_run["precision"]
    fp32 = runs["32"]
    assert fp32["inner"] == fp32["outer"] == "torch.float32"
    run = runs[precision]
    assert run["inner"] == ("torch.bfloat16" if precision == "bf16-mixed" else "torch.float16")
    assert run["outer"] == "torch.float32"  # outputs cast back: the loss is computed in fp32
    moved = _distance(fp32["params"], _initial())
    assert 0 < _distance(run["params"], fp32["params"]) < rel_tol * moved


def test_accumulate_skips_allreduces_and_matches_the_large_batch(options_run):
    plain, accumulated = (
        options_run["accumulate"]["plain"],
        options_run["accumulate"]["accumulated"],
    )
    # batch 8 for 6 steps vs 2 micro-batches of 4 for 12 micro-steps: one allreduce per step
    assert plain["allreduces"] == accumulated["allreduces"] == STEPS // 2
    for k, v in plain["params"].items():
        torch.testing.assert_close(accumulated["params"][k], v, rtol=1e-5, atol=1e-6)


def test_bad_options_fail_before_any_process_group(tmp_path):
    model = torch.nn.Linear(2, 2)
    cases = {
        "comm_hook='int8') is not supported": dict(comm_hook="int8"),
        "bucket_cap_mb=0": dict(bucket_cap_mb=0),
        "static_graph='yes') must be True or False": dict(static_graph="yes"),
        "contradicts ddp_kwargs['find_unused_parameters']": dict(
            find_unused_parameters=True, ddp_kwargs={"find_unused_parameters": False}
        ),
        "unknown PowerSGD option(s) ['rank']": dict(
            comm_hook="powersgd", comm_hook_options={"rank": 2}
        ),
        "only applies to comm_hook='powersgd'": dict(
            comm_hook="bf16", comm_hook_options={"matrix_approximation_rank": 2}
        ),
        "start_powerSGD_iter=1 must be >= 2": dict(
            comm_hook="powersgd", comm_hook_options={"start_powerSGD_iter": 1}
        ),
        "precision='fp8' is not supported": dict(precision="fp8"),
    }
    for message, kwargs in cases.items():
        with pytest.raises(ValueError) as info:
            rt.prepare_model(model, **kwargs)
        assert message in str(info.value)
    with pytest.raises(ValueError, match="steps must be an integer >= 1"), rt.accumulate(model, 0):
        pass


HOROVOD_SCRIPT = textwrap.dedent(
    """
    import os
    import ringtrain as rt

    names = ("RANK", "SIZE", "LOCAL_RANK", "LOCAL_SIZE", "CROSS_RANK", "CROSS_SIZE")
    rt.report({n.lower(): int(os.environ["HOROVOD_" + n]) for n in names}
              | {"torch_rank": int(os.environ["RANK"])})
    """
)


def test_ringtrain_run_np_sets_horovod_variables(tmp_path):
    script = tmp_path / "hvd_env.py"
    script.write_text(HOROVOD_SCRIPT)
    ringtrain = os.path.join(os.path.dirname(sys.executable), "ringtrain")
    proc = subprocess.run(
        [ringtrain, "run", "-np", "2", "--name", "hvd", "--progress", "off", str(script)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr + proc.stdout
    result = json.loads((tmp_path / "runs" / "hvd" / "result.json").read_text())
    for rank in (0, 1):
        metrics = result["metrics_per_rank"][str(rank)]
        assert metrics == {
            "rank": rank,
            "size": 2,
            "local_rank": rank,
            "local_size": 2,
            "cross_rank": 0,
            "cross_size": 1,
            "torch_rank": rank,
        }
