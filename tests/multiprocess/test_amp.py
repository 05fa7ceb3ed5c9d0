"""Mixed precision and gradient accumulation across an exact resume (issue 5): the GradScaler
state and a checkpoint taken inside an accumulation group survive a SIGKILL bit-exactly."""

from __future__ import annotations

import pytest
import torch

import comm_workloads
import ringtrain as rt
from ringtrain.comm.ddp import PowerSGDStateDict
from support import run_job


def _fit(tmp_path, name, **config):
    out = tmp_path / f"{name}.pt"
    result = run_job(
        comm_workloads.resume_fn,
        storage_path=tmp_path / "runs",
        name=name,
        max_failures=1,
        train_loop_config={"epochs": 2, "out": str(out), **config},
    )
    return result, torch.load(out, weights_only=True)


def test_fp16_scaler_and_mid_accumulation_checkpoint_resume_bit_exactly(tmp_path):
    """16-mixed with the fp16 comm hook, accumulation over 2 micro-steps, a checkpoint every 3
    micro-steps; rank 1 dies after micro-step 17, so the run resumes from micro-step 15, inside
    an accumulation group, with the first scale overflowing fp16 (skipped steps, backoff)."""
    clean_result, clean = _fit(tmp_path, "clean", comm_hook="fp16")
    assert clean_result.failures == []
    scales = clean["scales"]
    assert scales[0] < 2.0**24 and len(set(scales)) > 2  # the scaler backed off and grew
    result, resumed = _fit(tmp_path, "killed", comm_hook="fp16", kill=17)
    assert [(f.rank, f.kind) for f in result.failures] == [(1, "signal")]
    assert resumed["step"] == clean["step"] == 20
    assert resumed["scaler"] == clean["scaler"]
    assert resumed["scales"] == scales[-len(resumed["scales"]) :]
    for k, v in clean["model"].items():
        assert torch.equal(resumed["model"][k], v), f"parameter {k} differs"
    for i, s in clean["optimizer"]["state"].items():
        assert torch.equal(
            resumed["optimizer"]["state"][i]["momentum_buffer"], s["momentum_buffer"]
        )


def _loop(precision, steps=3, use_rt_backward=True):
    torch.manual_seed(0)
    model = rt.prepare_model(torch.nn.Linear(4, 1), precision=precision)
    optimizer = rt.prepare_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    for _ in range(steps):
        loss = model(torch.ones(8, 4)).pow(2).mean()
        optimizer.zero_grad()
        if use_rt_backward:
            rt.backward(loss)
        else:
            loss.backward()
        optimizer.step()
    return model, optimizer


def test_prepare_optimizer_scales_only_under_16_mixed():
    for precision in ("32", "bf16-mixed"):
        _, optimizer = _loop(precision)
        assert optimizer.grad_scaler is None
        assert "grad_scaler" not in rt.TrainState(optimizer=optimizer)._objects
    model, optimizer = _loop("16-mixed")
    assert isinstance(optimizer.grad_scaler, torch.amp.GradScaler)
    assert isinstance(optimizer, torch.optim.Optimizer)
    assert optimizer.param_groups is optimizer.optimizer.param_groups
    state = rt.TrainState(model=model, optimizer=optimizer)
    assert state["grad_scaler"] is optimizer.grad_scaler  # saved with the TrainState
    # an LR scheduler works on the prepared optimizer
    torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5).step()
    assert optimizer.optimizer.param_groups[0]["lr"] == pytest.approx(0.05)


def test_bare_loss_backward_under_16_mixed_is_refused():
    with pytest.raises(RuntimeError, match=r"call rt.backward\(loss\)"):
        _loop("16-mixed", use_rt_backward=False)
    with pytest.raises(ValueError, match="only applies to precision='16-mixed'"):
        rt.prepare_optimizer(
            torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1),
            precision="32",
            grad_scaler=torch.amp.GradScaler("cpu"),
        )


def test_powersgd_state_round_trips():
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState

    a = PowerSGDState(process_group=None, start_powerSGD_iter=2)
    a.iter = 7
    a.rng.randint(10)
    a.error_dict[0] = torch.randn(5)
    a.p_memory_dict[0], a.q_memory_dict[0] = torch.randn(3), torch.randn(2)
    saved = PowerSGDStateDict(a).state_dict()
    b = PowerSGDState(process_group=None, start_powerSGD_iter=2)
    PowerSGDStateDict(b).load_state_dict(saved)
    assert b.iter == 7 and b.rng.randint(1 << 30) == a.rng.randint(1 << 30)
    for attr in ("error_dict", "p_memory_dict", "q_memory_dict"):
        assert torch.equal(getattr(b, attr)[0], getattr(a, attr)[0])
