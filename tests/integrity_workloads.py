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
    """Optionally: ``precision``, ``comm_hook``, ``loader_workers``, ``accumulate`` (micro-batches
    per optimizer step), ``epochs``, ``ckpt_every`` (steps), ``samples``."""
    torch.manual_seed(0)
    model = rt.prepare_model(
        workloads.make_model(),
        precision=config.get("precision", "32"),
        comm_hook=config.get("comm_hook"),
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    loader = rt.prepare_data_loader(
        DataLoader(
            workloads.make_dataset(n=config.get("samples", 96)),
            batch_size=4,
            shuffle=True,
            num_workers=config.get("loader_workers", 0),
        )
    )
    state = rt.TrainState(model=model, optimizer=optimizer, data_loader=loader)
    state.restore()
    ctx = rt.get_context()
    inject = config.get("inject")
    # A transient flip happens once (the first attempt); a faulty device corrupts every attempt.
    if inject and ctx.world_rank == inject["rank"] and (inject.get("every") or ctx.attempt == 0):
        inject_bitflip(inject["where"], inject["step"], every=inject.get("every", False))
    micro = config.get("accumulate", 1)
    for _ in state.epochs(config.get("epochs", 2)):
        for x, y in loader:
            for xs, ys in zip(x.chunk(micro), y.chunk(micro), strict=True):
                with rt.accumulate(model, micro):
                    loss = torch.nn.functional.mse_loss(model(xs).squeeze(-1), ys) / micro
                    loss.backward()
            optimizer.step()
            optimizer.zero_grad()
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


def hsdp_sdc_fn(config):
    """HSDP (``ParallelConfig(dp_replicate=2, dp_shard=2)``, FSDP2): momentum SGD, a TrainState
    checkpoint every 2 steps, a bit flipped in ``config["inject"]``'s rank's parameter shard.
    Rank 0 saves the full parameters to ``config["out"]``."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    model = rt.prepare_model(net, parallel_strategy="fsdp")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    loader = rt.prepare_data_loader(
        DataLoader(workloads.make_dataset(n=96), batch_size=4, shuffle=True)
    )
    state = rt.TrainState(model=model, optimizer=optimizer, data_loader=loader)
    state.restore()
    ctx = rt.get_context()
    inject = config.get("inject")
    if inject and ctx.world_rank == inject["rank"] and ctx.attempt == 0:
        inject_bitflip(inject["where"], inject["step"])
    for _ in state.epochs(2):
        for x, y in loader:
            loss = torch.nn.functional.mse_loss(model(x).squeeze(-1), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            state.step += 1
            if state.step % 2 == 0:
                rt.report({"loss": loss.item(), "step": state.step}, checkpoint=state)
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    if ctx.world_rank == 0:
        torch.save({"model": full, "step": state.step}, config["out"])
