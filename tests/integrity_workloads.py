"""Train functions for the silent-data-corruption tests (tests/multiprocess/test_integrity.py):
DDP with momentum, a TrainState checkpoint every ``ckpt_every`` steps, and an injected bit flip
(``config["inject"]``) on one rank."""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader

import ringtrain as rt
import workloads
from ringtrain.integrity.inject import inject_bitflip


def sdc_fn(config):
    torch.manual_seed(0)
    model = rt.prepare_model(workloads.make_model())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    loader = rt.prepare_data_loader(
        DataLoader(workloads.make_dataset(n=config.get("samples", 96)), batch_size=4, shuffle=True)
    )
    state = rt.TrainState(model=model, optimizer=optimizer, data_loader=loader)
    state.restore()
    ctx = rt.get_context()
    inject = config.get("inject")
    # A transient flip happens once (the first attempt); a faulty device corrupts every attempt.
    if inject and ctx.world_rank == inject["rank"] and (inject.get("every") or ctx.attempt == 0):
        inject_bitflip(inject["where"], inject["step"], every=inject.get("every", False))
    for _ in state.epochs(config.get("epochs", 2)):
        for x, y in loader:
            loss = torch.nn.functional.mse_loss(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            state.step += 1
            if state.step % config.get("ckpt_every", 2) == 0:
                rt.report({"loss": loss.item(), "step": state.step}, checkpoint=state)
    if ctx.world_rank == 0:
        module = getattr(model, "module", model)
        torch.save(
            {
                "model": {k: v.clone() for k, v in module.state_dict().items()},
                "optimizer": optimizer.state_dict(),
                "step": state.step,
            },
            config["out"],
        )


def fsdp_fn(config):
    """FSDP over every rank: no replicas to compare."""
    torch.manual_seed(0)
    rt.prepare_model(workloads.make_model(), parallel_strategy="fsdp")
