"""Train functions of tests/multiprocess/test_horovod.py. Each runs in real gloo workers, checks
ringtrain.horovod against references computed with plain torch.distributed, and reports the
names of the failed checks (an empty list on success) so that the test sees every rank's result."""

from __future__ import annotations

import os
import signal
import time

import torch
import torch.distributed as dist

import ringtrain as rt
import ringtrain.horovod as hvd
from ringtrain.worker.session import current_session


class Checks:
    def __init__(self) -> None:
        self.failed: list[str] = []

    def true(self, name: str, cond: bool) -> None:
        if not cond:
            self.failed.append(name)

    def close(self, name: str, got: torch.Tensor, want: torch.Tensor, **tol) -> None:
        try:
            torch.testing.assert_close(got, want, **tol)
        except AssertionError as exc:
            self.failed.append(f"{name}: {str(exc).splitlines()[0]}")

    def raises(self, name: str, exc_type: type, fn) -> float:
        start = time.monotonic()
        try:
            fn()
        except exc_type:
            return time.monotonic() - start
        except Exception as exc:  # the wrong error
            self.failed.append(f"{name}: raised {type(exc).__name__}: {exc}")
            return 0.0
        self.failed.append(f"{name}: did not raise {exc_type.__name__}")
        return 0.0


def _ref_allreduce(t: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
    out = t.clone()
    dist.all_reduce(out, op=op)
    return out


# ------------------------------------------------------------------ collectives


def check_collectives(c: Checks) -> None:
    n, r = hvd.size(), hvd.rank()
    ctx = rt.get_context()
    c.true(
        "size/rank",
        (n, r) == (dist.get_world_size(), dist.get_rank()) == (ctx.world_size, ctx.world_rank),
    )
    c.true("local", (hvd.local_size(), hvd.local_rank()) == (n, r))
    c.true("cross", (hvd.cross_size(), hvd.cross_rank()) == (1, 0))
    c.true("probes", hvd.gloo_built() == dist.is_gloo_available() and hvd.mpi_built() is False)
    c.true("nccl probe", hvd.nccl_built() == dist.is_nccl_available())
    c.true("gloo enabled", hvd.gloo_enabled())
    g = torch.Generator().manual_seed(100 + r)
    x = torch.randn(5, 3, generator=g)
    total = _ref_allreduce(x)
    c.close("allreduce avg", hvd.allreduce(x), total / n)
    c.close("allreduce sum", hvd.allreduce(x, op=hvd.Sum), total)
    c.close("allreduce average=False", hvd.allreduce(x, average=False), total)
    for name, op, dop in (
        ("min", hvd.Min, dist.ReduceOp.MIN),
        ("max", hvd.Max, dist.ReduceOp.MAX),
        ("product", hvd.Product, dist.ReduceOp.PRODUCT),
    ):
        c.close(f"allreduce {name}", hvd.allreduce(x, op=op), _ref_allreduce(x, dop))
    c.close(
        "pre/postscale",
        hvd.allreduce(x, op=hvd.Sum, prescale_factor=3.0, postscale_factor=0.5),
        total * 1.5,
    )
    c.close("prescale avg", hvd.allreduce(x, prescale_factor=2.0), total * 2 / n)
    y = x.clone()
    out = hvd.allreduce_(y)
    c.true("allreduce_ in place", out is y)
    c.close("allreduce_", y, total / n)
    h = hvd.allreduce_async(x, name="async.x")
    c.true("poll bool", isinstance(hvd.poll(h), bool))
    c.close("allreduce_async", hvd.synchronize(h), total / n)
    c.close(
        "input unchanged", x, torch.randn(5, 3, generator=torch.Generator().manual_seed(100 + r))
    )
    y = x.clone()
    hvd.synchronize(hvd.allreduce_async_(y, op=hvd.Sum))
    c.close("allreduce_async_", y, total)
    fp16 = hvd.allreduce(x, compression=hvd.Compression.fp16)
    c.true("fp16 keeps dtype", fp16.dtype == torch.float32)
    c.close("allreduce fp16", fp16, total / n, atol=5e-3, rtol=5e-3)
    c.close(
        "allreduce bf16",
        hvd.allreduce(x, compression=hvd.Compression.bf16),
        total / n,
        atol=5e-2,
        rtol=5e-2,
    )
    ints = torch.arange(6, dtype=torch.int64) * (r + 1)
    c.close("allreduce int sum", hvd.allreduce(ints, op=hvd.Sum), _ref_allreduce(ints))
    c.raises("adasum", NotImplementedError, lambda: hvd.allreduce(x, op=hvd.Adasum))

    # differentiable allreduce: d/dx sum_r (w_r * allreduce_sum(x)) = sum_r w_r on every rank
    w = torch.randn(5, 3, generator=g)
    xg = x.clone().requires_grad_()
    (hvd.allreduce(xg, op=hvd.Sum) * w).sum().backward()
    c.close("allreduce grad", xg.grad, _ref_allreduce(w))

    # grouped: mixed shapes and dtypes, more tensors than one bucket holds with a tiny threshold
    tensors = [torch.randn(k + 1, 2, generator=g) for k in range(7)]
    tensors += [torch.randn(4, generator=g, dtype=torch.float64), torch.arange(3) * r]
    refs = [_ref_allreduce(t) for t in tensors]
    for got, want in zip(hvd.grouped_allreduce(tensors, op=hvd.Sum), refs, strict=True):
        c.close("grouped_allreduce", got, want)
    os.environ["HOROVOD_FUSION_THRESHOLD"] = "64"  # many buckets
    try:
        got = hvd.synchronize(hvd.grouped_allreduce_async(tensors, op=hvd.Sum, name="grp"))
    finally:
        del os.environ["HOROVOD_FUSION_THRESHOLD"]
    for got_t, want in zip(got, refs, strict=True):
        c.close("grouped_allreduce_async small buckets", got_t, want)
    floats = [t.clone() for t in tensors[:7]]
    hvd.grouped_allreduce_(floats)
    for got_t, want in zip(floats, refs[:7], strict=True):
        c.close("grouped_allreduce_", got_t, want / n)
    gg = [t.clone().requires_grad_() for t in tensors[:3]]
    sum(o.sum() for o in hvd.grouped_allreduce(gg, op=hvd.Sum)).backward()
    c.close("grouped grad", gg[1].grad, torch.full_like(gg[1], float(n)))

    # allgather with a variable first dimension; reference: all_gather_object
    part = torch.full((r + 1, 2), float(r)) + torch.arange(2.0)
    objs = [None] * n
    dist.all_gather_object(objs, part)
    c.close("allgather varlen", hvd.allgather(part), torch.cat(objs))
    c.close(
        "allgather_async", hvd.synchronize(hvd.allgather_async(part, name="ag")), torch.cat(objs)
    )
    pg = part.clone().requires_grad_()
    coeff = torch.arange(float(sum(k + 1 for k in range(n)) * 2)).view(-1, 2)
    (hvd.allgather(pg) * coeff).sum().backward()
    offset = sum(k + 1 for k in range(r))
    c.close("allgather grad (Horovod: averaged)", pg.grad, coeff[offset : offset + r + 1])

    # broadcast
    b = torch.full((3,), float(r))
    ref = b.clone()
    dist.broadcast(ref, src=n - 1)
    c.close("broadcast", hvd.broadcast(b, root_rank=n - 1), ref)
    c.close("broadcast leaves input", b, torch.full((3,), float(r)))
    b2 = b.clone()
    hvd.broadcast_(b2, root_rank=n - 1)
    c.close("broadcast_", b2, ref)
    c.close(
        "broadcast_async", hvd.synchronize(hvd.broadcast_async(b, 0, name="bc")), torch.zeros(3)
    )
    bg = b.clone().requires_grad_()
    hvd.broadcast(bg, root_rank=1).sum().backward()
    c.close("broadcast grad (Horovod: averaged)", bg.grad, torch.full((3,), 1.0 if r == 1 else 0.0))

    # alltoall with splits: rank r sends j+1 rows to rank j
    splits = [j + 1 for j in range(n)]
    send = torch.arange(float(sum(splits))).unsqueeze(1) + 100 * r
    recv = torch.empty(n * (r + 1), 1)
    dist.all_to_all_single(recv, send, output_split_sizes=[r + 1] * n, input_split_sizes=splits)
    out, received = hvd.alltoall(send, splits=splits)
    c.close("alltoall splits", out, recv)
    c.true("alltoall received", received.tolist() == [r + 1] * n)
    even = torch.arange(2.0 * n) + 10 * r
    ref_even = torch.empty_like(even)
    dist.all_to_all_single(ref_even, even)
    c.close("alltoall even", hvd.alltoall(even), ref_even)
    c.raises("alltoall bad splits", ValueError, lambda: hvd.alltoall(even, splits=[1] * n))
    sg = send.clone().requires_grad_()
    hvd.alltoall(sg, splits=splits)[0].sum().backward()
    c.close("alltoall grad", sg.grad, torch.ones_like(sg))

    # reducescatter: 7 rows split as evenly as possible, earlier ranks one more
    t = torch.randn(7, 2, generator=g)
    full = _ref_allreduce(t) / n
    counts = [7 // n + (1 if k < 7 % n else 0) for k in range(n)]
    start = sum(counts[:r])
    c.close("reducescatter", hvd.reducescatter(t), full[start : start + counts[r]])
    c.close(
        "reducescatter sum",
        hvd.reducescatter(t, op=hvd.Sum),
        _ref_allreduce(t)[start : start + counts[r]],
    )

    # objects, barrier, join
    c.true("broadcast_object", hvd.broadcast_object({"from": r}, root_rank=0) == {"from": 0})
    c.true("allgather_object", hvd.allgather_object(r * 10) == [k * 10 for k in range(n)])
    hvd.barrier()
    last = hvd.join()
    c.true("join agrees", hvd.allgather_object(last) == [last] * n and 0 <= last < n)

    # broadcast_parameters / broadcast_optimizer_state
    torch.manual_seed(1000 + r)  # different parameters per rank
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    for v in expected.values():
        dist.broadcast(v, src=0)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    for k, v in model.state_dict().items():
        c.close(f"broadcast_parameters {k}", v, expected[k])
    opt = torch.optim.Adam(model.parameters(), lr=0.01 * (r + 1))
    model(torch.randn(6, 4, generator=g)).sum().backward()
    opt.step()
    root_state = {k: v.clone() for k, v in opt.state[model[0].weight].items()}
    for v in root_state.values():
        dist.broadcast(v, src=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    c.close(
        "broadcast_optimizer_state exp_avg",
        opt.state[model[0].weight]["exp_avg"],
        root_state["exp_avg"],
    )
    c.true("broadcast_optimizer_state lr", opt.param_groups[0]["lr"] == 0.01)


def check_errors(c: Checks) -> None:
    """Mismatches raise RuntimeError on every rank (quickly), duplicate names ValueError; the
    group is still usable afterwards."""
    n, r = hvd.size(), hvd.rank()
    slow = []
    slow.append(c.raises("shape mismatch", RuntimeError, lambda: hvd.allreduce(torch.ones(r + 2))))
    dtype = torch.float64 if r == 0 else torch.float32
    slow.append(
        c.raises("dtype mismatch", RuntimeError, lambda: hvd.allreduce(torch.ones(3, dtype=dtype)))
    )
    slow.append(
        c.raises(
            "grouped mismatch",
            RuntimeError,
            lambda: hvd.grouped_allreduce([torch.ones(2)] * (r + 1)),
        )
    )
    slow.append(
        c.raises(
            "allgather trailing mismatch", RuntimeError, lambda: hvd.allgather(torch.ones(2, r + 1))
        )
    )
    slow.append(
        c.raises(
            "broadcast root mismatch",
            RuntimeError,
            lambda: hvd.broadcast(torch.ones(2), root_rank=r),
        )
    )
    slow.append(
        c.raises("name mismatch", RuntimeError, lambda: hvd.allreduce(torch.ones(2), name=f"n{r}"))
    )
    c.true(f"errors raised within 10 s ({max(slow):.2f} s)", max(slow) < 10)
    h = hvd.allreduce_async(torch.ones(2), name="dup")
    c.raises("duplicate name", ValueError, lambda: hvd.allreduce_async(torch.ones(2), name="dup"))
    c.close("first of duplicate still fine", hvd.synchronize(h), torch.ones(2))
    hvd.synchronize(hvd.allreduce_async(torch.ones(2), name="dup"))  # reusable once finished
    c.raises("unknown handle", ValueError, lambda: hvd.synchronize(h))
    lin = torch.nn.Linear(3 + (r % 2), 2)
    c.raises(
        "optimizer layout mismatch",
        RuntimeError,
        lambda: hvd.DistributedOptimizer(
            torch.optim.SGD(lin.parameters(), lr=0.1), lin.named_parameters()
        ),
    )
    c.close(
        "group usable after errors",
        hvd.allreduce(torch.ones(2), op=hvd.Sum),
        torch.full((2,), float(n)),
    )


def check_sync_batch_norm(c: Checks) -> None:
    """hvd.SyncBatchNorm on each rank's part == BatchNorm over the concatenated global batch."""
    n, r = hvd.size(), hvd.rank()
    xs = [
        torch.randn(4, 3, 5, generator=torch.Generator().manual_seed(k)) * (k + 1) for k in range(n)
    ]
    ws = [torch.randn(4, 3, 5, generator=torch.Generator().manual_seed(50 + k)) for k in range(n)]
    bn, ref = hvd.SyncBatchNorm(3), torch.nn.BatchNorm1d(3)
    with torch.no_grad():
        bn.weight.copy_(torch.tensor([1.0, 2.0, 0.5]))
        ref.weight.copy_(bn.weight)
    x = xs[r].clone().requires_grad_()
    out = bn(x)
    (out * ws[r]).sum().backward()
    xf = torch.cat(xs).requires_grad_()
    out_ref = ref(xf)
    (out_ref * torch.cat(ws)).sum().backward()
    mine = slice(4 * r, 4 * (r + 1))
    tol = {"atol": 1e-5, "rtol": 1e-4}
    c.close("syncbn forward", out, out_ref[mine], **tol)
    c.close("syncbn input grad", x.grad, xf.grad[mine], **tol)
    # parameter gradients are per rank until the optimizer sums them
    c.close("syncbn weight grad", _ref_allreduce(bn.weight.grad), ref.weight.grad, **tol)
    c.close("syncbn running_mean", bn.running_mean, ref.running_mean, **tol)
    c.close("syncbn running_var", bn.running_var, ref.running_var, **tol)


# ------------------------------------------------------------------ DistributedOptimizer vs DDP


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(8, 32),
        torch.nn.Tanh(),
        torch.nn.Linear(32, 16),
        torch.nn.Tanh(),
        torch.nn.Linear(16, 1),
    )


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step * 1000 + rank)
    return torch.randn(6, 8, generator=g), torch.randn(6, 1, generator=g)


def _train_ddp(steps: int, bpps: int, clip: float | None = None) -> dict:
    model = torch.nn.parallel.DistributedDataParallel(_model())
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    r = dist.get_rank()
    for step in range(steps):
        opt.zero_grad()
        for k in range(bpps):
            x, y = _batch(step * bpps + k, r)
            loss = torch.nn.functional.mse_loss(model(x), y)
            if k < bpps - 1:
                with model.no_sync():
                    loss.backward()
            else:
                loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
    return {k: v.detach().clone() for k, v in model.module.state_dict().items()}


def _train_hvd(steps: int, bpps: int, clip: float | None = None, **kwargs) -> dict:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = hvd.DistributedOptimizer(
        opt, named_parameters=model.named_parameters(), backward_passes_per_step=bpps, **kwargs
    )
    r = hvd.rank()
    for step in range(steps):
        opt.zero_grad()
        for k in range(bpps):
            x, y = _batch(step * bpps + k, r)
            torch.nn.functional.mse_loss(model(x), y).backward()
        if clip is not None:
            opt.synchronize()
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            with opt.skip_synchronize():
                opt.step()
        else:
            opt.step()
    opt._hvd_engine.close()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def check_optimizer(c: Checks) -> None:
    steps = 4
    initial = _model().state_dict()
    ddp1 = _train_ddp(steps, 1)
    ddp2 = _train_ddp(steps, 2)
    ddp_clip = _train_ddp(steps, 1, clip=0.05)
    c.true("training moved the parameters", not torch.equal(ddp1["0.weight"], initial["0.weight"]))
    variants = [
        ("default", 1, None, {}, ddp1, {}),
        ("tiny buckets", 1, None, {"fusion_threshold_bytes": 200}, ddp1, {}),
        ("no fusion", 1, None, {"fusion_threshold_bytes": 0}, ddp1, {}),
        ("predivide", 1, None, {"gradient_predivide_factor": 2.0}, ddp1, {}),
        ("bpps=2", 2, None, {}, ddp2, {}),
        ("skip_synchronize + clip", 1, 0.05, {}, ddp_clip, {}),
        (
            "fp16",
            1,
            None,
            {"compression": hvd.Compression.fp16},
            ddp1,
            {"atol": 2e-3, "rtol": 1e-2},
        ),
        (
            "bf16",
            1,
            None,
            {"compression": hvd.Compression.bf16},
            ddp1,
            {"atol": 2e-2, "rtol": 5e-2},
        ),
        (
            "bf16 bpps=2",
            2,
            None,
            {"compression": hvd.Compression.bf16},
            ddp2,
            {"atol": 2e-2, "rtol": 5e-2},
        ),
    ]
    for name, bpps, clip, kwargs, want, tol in variants:
        got = _train_hvd(steps, bpps, clip, **kwargs)
        for key, value in want.items():
            c.close(
                f"optimizer {name} {key}", got[key], value, **(tol or {"atol": 1e-6, "rtol": 1e-5})
            )
    # bytes on the wire: fp16 halves them
    model = _model()
    sizes = {}
    for comp in (hvd.Compression.none, hvd.Compression.fp16):
        opt = hvd.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.0), model.named_parameters(), compression=comp
        )
        torch.nn.functional.mse_loss(model(_batch(0, 0)[0]), _batch(0, 0)[1]).backward()
        opt.step()
        opt.zero_grad()
        sizes[comp.__name__] = opt._hvd_engine.bytes_on_wire
        opt._hvd_engine.close()
    c.true(f"fp16 halves the bytes {sizes}", sizes["FP16Compressor"] * 2 == sizes["NoneCompressor"])
    # zero_grad between backward and step is refused; an unused parameter gets a zero gradient
    model = _model()
    extra = torch.nn.Parameter(torch.ones(3))
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD([*model.parameters(), extra], lr=0.1),
        [*model.named_parameters(), ("extra", extra)],
    )
    torch.nn.functional.mse_loss(model(_batch(0, 0)[0]), _batch(0, 0)[1]).backward()
    c.raises("zero_grad before step", AssertionError, opt.zero_grad)
    opt.step()
    c.true("unused parameter", extra.grad is not None and torch.equal(extra.grad, torch.zeros(3)))
    c.true("isinstance SGD", isinstance(opt, torch.optim.SGD))
    opt._hvd_engine.close()


def collectives_fn(config):
    hvd.init()
    c = Checks()
    for part in (check_collectives, check_errors, check_sync_batch_norm, check_optimizer):
        try:
            part(c)
        except Exception as exc:
            c.failed.append(f"{part.__name__} raised {type(exc).__name__}: {exc}")
            raise
    hvd.shutdown()
    hvd.init()  # init after shutdown works
    c.true("reinit", hvd.size() == dist.get_world_size())
    hvd.shutdown()
    rt.report({"failed": c.failed, "world_size": dist.get_world_size()})


# ------------------------------------------------------------------ elastic


class _Data(torch.utils.data.Dataset):
    def __init__(self) -> None:
        g = torch.Generator().manual_seed(5)
        self.x = torch.randn(48, 8, generator=g)
        self.y = torch.randn(48, 1, generator=g)

    def __len__(self) -> int:
        return 48

    def __getitem__(self, i):
        return self.x[i], self.y[i]


def elastic_fn(config):
    hvd.init()
    model = _model()
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), model.named_parameters()
    )
    data = _Data()
    sampler = hvd.elastic.ElasticSampler(data, shuffle=True, seed=1)
    loader = torch.utils.data.DataLoader(data, batch_size=4, sampler=sampler)
    state = hvd.elastic.TorchState(model, opt, train_sampler=sampler, epoch=0, batch=0, resets=0)

    def on_reset():
        state.resets += 1

    state.register_reset_callbacks([on_reset])

    @hvd.elastic.run
    def train(state):
        first = (state.epoch, state.batch, state.commits)
        while state.epoch < 2:
            start = state.batch
            for idx, (x, y) in enumerate(loader):
                state.batch = start + idx + 1  # batches of this epoch done
                opt.zero_grad()
                torch.nn.functional.mse_loss(model(x), y).backward()
                opt.step()
                state.train_sampler.record_batch(idx, 4)
                if state.batch % 2 == 0:
                    state.commit()
                ctx = rt.get_context()
                if config["kill"] and ctx.attempt == 0 and ctx.world_rank == 1 and state.batch == 5:
                    current_session().wait_for_checkpoint(30)
                    time.sleep(1.0)  # let the driver publish the commit of batch 4
                    os.kill(os.getpid(), signal.SIGKILL)
            state.epoch += 1
            state.batch = 0
            state.train_sampler.set_epoch(state.epoch)
        return first

    first = train(state)
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    rt.report(
        {
            "attempt": rt.get_context().attempt,
            "resumed_at": list(first),
            "resets": state.resets,
            "params": flat.tolist(),
        }
    )
