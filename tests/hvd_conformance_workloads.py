"""The Horovod conformance battery of tests/multiprocess/test_horovod_conformance.py, run in each
rank.

``python hvd_conformance_workloads.py`` under torchrun-style variables (RANK, WORLD_SIZE,
MASTER_ADDR...) runs every check and prints one JSON line: ``{"rank": r, "checks": {name:
result}}``. A result is ``"ok"``, ``"raised <ExceptionType>"`` for the error checks (the test
then asserts every rank raised the same type), or a failure text. References are computed
locally: every rank can rebuild every other rank's input from the seed, so no check trusts
torch.distributed to verify ringtrain.horovod.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from collections.abc import Callable
from typing import Any

import torch

import ringtrain.horovod as hvd

SEED = int(os.environ.get("HVD_CONFORMANCE_SEED", "23"))

#: The dtypes horovod.torch 0.28.1 accepts on CPU (its mpi_ops_v2.cc dispatch: uint8, int8,
#: int16, int32, int64, float16, bfloat16, float32, float64; bool for broadcast/allgather).
DTYPES = [
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
]


class Battery:
    def __init__(self) -> None:
        self.results: dict[str, str] = {}

    def check(self, name: str, fn: Callable[[], Any]) -> None:
        """Record ``ok`` when ``fn`` returns truthy (or None), else the failure."""
        try:
            out = fn()
            self.results[name] = "ok" if out is None or out is True else f"failed: {out}"
        except Exception as exc:  # a check that raises is a failure, recorded with its cause
            self.results[name] = f"error {type(exc).__name__}: {exc}"[:400]

    def raises(self, name: str, fn: Callable[[], Any]) -> None:
        """Record which exception ``fn`` raised (the test compares across ranks)."""
        try:
            fn()
            self.results[name] = "did not raise"
        except Exception as exc:
            self.results[name] = f"raised {type(exc).__name__}"


def data(rank: int, rows: int, dtype: torch.dtype, salt: int = 0) -> torch.Tensor:
    """Rank ``rank``'s input: ``rows x 3`` small values (no overflow in sums/products)."""
    g = torch.Generator().manual_seed(SEED * 1000 + rank * 10 + salt)
    if dtype == torch.bool:
        return torch.randint(0, 2, (rows, 3), generator=g).bool()
    lo = 0 if dtype == torch.uint8 else -3
    return torch.randint(lo, 4, (rows, 3), generator=g).to(dtype)


def same(got: torch.Tensor, want: torch.Tensor) -> bool | str:
    if got.dtype != want.dtype or got.shape != want.shape:
        return f"got {got.dtype}{tuple(got.shape)}, want {want.dtype}{tuple(want.shape)}"
    if not torch.equal(got, want):
        return f"values differ: {got.flatten()[:6].tolist()} vs {want.flatten()[:6].tolist()}"
    return True


def close(got: torch.Tensor, want: torch.Tensor, tol: float = 1e-5) -> bool | str:
    try:
        torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    except AssertionError as exc:
        return str(exc).splitlines()[0]
    return True


# ------------------------------------------------------------------ dtypes


def check_dtypes(b: Battery, n: int, r: int) -> None:
    for dt in DTYPES:
        d = str(dt).replace("torch.", "")
        mine = data(r, 2, dt)
        every = [data(k, 2, dt) for k in range(n)]
        total = every[0].clone()
        for t in every[1:]:
            total = total + t
        b.check(f"allreduce sum {d}", lambda m=mine, t=total: same(hvd.allreduce(m, op=hvd.Sum), t))
        b.check(
            f"allreduce max {d}",
            lambda m=mine, e=every: same(hvd.allreduce(m, op=hvd.Max), torch.stack(e).amax(0)),
        )
        if dt.is_floating_point:
            b.check(
                f"allreduce average {d}",
                lambda m=mine, t=total: close(hvd.allreduce(m).double(), t.double() / n, tol=2e-2),
            )
        y = mine.clone()
        b.check(
            f"allreduce_ {d}",
            lambda y=y, t=total: same(hvd.allreduce_(y, op=hvd.Sum), t) and same(y, t),
        )
        var = data(r, r + 1, dt, salt=1)  # variable first dimension
        want = torch.cat([data(k, k + 1, dt, salt=1) for k in range(n)])
        b.check(f"allgather varlen {d}", lambda v=var, w=want: same(hvd.allgather(v), w))

        def agasync(v: torch.Tensor = var, w: torch.Tensor = want, d: str = d) -> Any:
            h = hvd.allgather_async(v, name=f"ag.{d}")
            if not isinstance(hvd.poll(h), bool):
                hvd.synchronize(h)
                return "poll did not return a bool"
            return same(hvd.synchronize(h), w)

        b.check(f"allgather_async {d}", agasync)
        b.check(
            f"broadcast {d}",
            lambda m=mine, e=every: same(hvd.broadcast(m, root_rank=n - 1), e[n - 1]),
        )
        z = mine.clone()
        b.check(
            f"broadcast_ {d}",
            lambda z=z, e=every: same(hvd.broadcast_(z, root_rank=0), e[0]) and same(z, e[0]),
        )
        b.check(
            f"broadcast_async {d}",
            lambda m=mine, e=every: same(hvd.synchronize(hvd.broadcast_async(m, 0)), e[0]),
        )
        a2a = data(r, 2 * n, dt, salt=2)
        want_a2a = torch.cat([data(k, 2 * n, dt, salt=2)[2 * r : 2 * r + 2] for k in range(n)])
        b.check(
            f"alltoall equal {d}",
            lambda a=a2a, w=want_a2a: same(hvd.alltoall(a), w),
        )
    for name, t in (("bool", torch.tensor([[True, False]]) ^ bool(r % 2)),):
        want = torch.cat([torch.tensor([[True, False]]) ^ bool(k % 2) for k in range(n)])
        b.check(f"allgather {name}", lambda t=t, w=want: same(hvd.allgather(t), w))
        b.check(
            f"broadcast {name}",
            lambda t=t: same(hvd.broadcast(t, 0), torch.tensor([[True, False]])),
        )


# ------------------------------------------------------------------ shapes, handles, grouped


def check_ops(b: Battery, n: int, r: int) -> None:
    f = torch.float64
    every = [data(k, 4, f) for k in range(n)]
    total = sum(every[1:], every[0].clone())
    # alltoall with splits: rank r sends j+1 rows to rank j; returns (tensor, int32 splits)
    splits = [j + 1 for j in range(n)]
    rows = sum(splits)

    def sent(k: int) -> torch.Tensor:
        return data(k, rows, f, salt=3)

    want = torch.cat([sent(k)[sum(splits[:r]) : sum(splits[: r + 1])] for k in range(n)])

    def a2a_splits() -> Any:
        out = hvd.alltoall(sent(r), splits=splits)
        if not isinstance(out, tuple) or len(out) != 2:
            return f"alltoall(splits=...) returned {type(out).__name__}, want a 2-tuple"
        ok = same(out[0], want)
        want_splits = torch.full((n,), r + 1, dtype=torch.int32)
        return ok if ok is not True else same(out[1], want_splits)

    b.check("alltoall splits -> (tensor, splits)", a2a_splits)
    b.check(
        "alltoall splits tensor",
        lambda: same(
            hvd.alltoall(sent(r), splits=torch.tensor(splits, dtype=torch.int32))[0], want
        ),
    )
    b.check(
        "alltoall no splits -> tensor",
        lambda: isinstance(hvd.alltoall(torch.zeros(n, 2)), torch.Tensor) or "not a tensor",
    )

    def a2a_async() -> Any:
        out, received = hvd.synchronize(hvd.alltoall_async(sent(r), splits, name="a2a"))
        return same(out, want) if received.dtype == torch.int32 else f"splits {received.dtype}"

    b.check("alltoall_async returns (tensor, splits)", a2a_async)
    # 0-d and empty tensors
    b.check(
        "allreduce 0-d",
        lambda: same(hvd.allreduce(torch.tensor(2.0), op=hvd.Sum), torch.tensor(2.0 * n)),
    )
    b.check(
        "allgather empty rank",
        lambda: same(
            hvd.allgather(torch.ones(r % 2, 2)),
            torch.ones(sum(k % 2 for k in range(n)), 2),
        ),
    )
    # scaling, ops, compression
    b.check(
        "pre/postscale",
        lambda: close(
            hvd.allreduce(every[r], op=hvd.Sum, prescale_factor=2.0, postscale_factor=0.25),
            total * 0.5,
        ),
    )
    b.check(
        "average=False",
        lambda: close(hvd.allreduce(every[r], average=False), total),
    )
    b.check(
        "min",
        lambda: same(hvd.allreduce(every[r], op=hvd.Min), torch.stack(every).amin(0)),
    )
    b.check(
        "product",
        lambda: close(hvd.allreduce(every[r], op=hvd.Product), torch.stack(every).prod(0)),
    )
    b.check(
        "fp16 compression",
        lambda: close(hvd.allreduce(every[r], op=hvd.Sum, compression=hvd.Compression.fp16), total),
    )

    # async handles: several in flight, poll, synchronize out of order
    def handles() -> Any:
        hs = [hvd.allreduce_async(every[r] * k, name=f"h{k}", op=hvd.Sum) for k in range(3)]
        if not all(isinstance(hvd.poll(h), bool) for h in hs):
            return "poll not bool"
        outs = [hvd.synchronize(h) for h in reversed(hs)]
        return close(torch.stack(outs), torch.stack([total * k for k in (2, 1, 0)]))

    b.check("async handles", handles)
    y = every[r].clone()
    b.check(
        "allreduce_async_",
        lambda: (
            close(hvd.synchronize(hvd.allreduce_async_(y, op=hvd.Sum)), total) and close(y, total)
        ),
    )
    # grouped
    ts = [every[r], every[r][:1].clone(), torch.arange(3) * (r + 1)]
    wants = [total, total[:1], torch.arange(3) * sum(range(1, n + 1))]
    b.check(
        "grouped_allreduce",
        lambda: all(
            close(g.double(), w.double()) is True
            for g, w in zip(hvd.grouped_allreduce(ts, op=hvd.Sum), wants, strict=True)
        ),
    )
    b.check(
        "grouped_allreduce_async",
        lambda: all(
            close(g.double(), w.double()) is True
            for g, w in zip(
                hvd.synchronize(hvd.grouped_allreduce_async(ts, op=hvd.Sum, name="ga")),
                wants,
                strict=True,
            )
        ),
    )
    var = [data(r, r + 1, f, salt=4), data(r, 2, torch.int32, salt=5)]
    gwant = [
        torch.cat([data(k, k + 1, f, salt=4) for k in range(n)]),
        torch.cat([data(k, 2, torch.int32, salt=5) for k in range(n)]),
    ]
    b.check(
        "grouped_allgather",
        lambda: all(
            same(g, w) is True for g, w in zip(hvd.grouped_allgather(var), gwant, strict=True)
        ),
    )
    b.check(
        "grouped_allgather_async",
        lambda: all(
            same(g, w) is True
            for g, w in zip(
                hvd.synchronize(hvd.grouped_allgather_async(var, name="gag")), gwant, strict=True
            )
        ),
    )
    seven = data(r, 7, f, salt=6)
    seven_total = sum((data(k, 7, f, salt=6) for k in range(1, n)), data(0, 7, f, salt=6))
    counts = [7 // n + (1 if k < 7 % n else 0) for k in range(n)]
    mine = slice(sum(counts[:r]), sum(counts[: r + 1]))
    b.check("reducescatter", lambda: close(hvd.reducescatter(seven), seven_total[mine] / n))
    b.check(
        "grouped_reducescatter_async",
        lambda: close(
            hvd.synchronize(hvd.grouped_reducescatter_async([seven, seven * 2], op=hvd.Sum))[1],
            2 * seven_total[mine],
        ),
    )
    b.check(
        "grouped_reducescatter",
        lambda: close(hvd.grouped_reducescatter([seven], op=hvd.Sum)[0], seven_total[mine]),
    )

    # sparse allreduce: Horovod's handle is a function; synchronize() accepts it
    def sparse() -> Any:
        dense = torch.zeros(5, 2)
        dense[r % 5] = float(r + 1)
        h = hvd.sparse_allreduce_async(dense.to_sparse(), name="sp", op=hvd.Sum)
        got = hvd.synchronize(h)
        want = torch.zeros(5, 2)
        for k in range(n):
            want[k % 5] += float(k + 1)
        return close(got.to_dense(), want) if got.is_sparse else "result not sparse"

    b.check("sparse_allreduce_async", sparse)
    # objects, barrier, join
    b.check(
        "broadcast_object", lambda: hvd.broadcast_object({"r": r}, root_rank=n - 1) == {"r": n - 1}
    )
    b.check("allgather_object", lambda: hvd.allgather_object(r * 10) == [k * 10 for k in range(n)])
    b.check("barrier", lambda: hvd.barrier())
    b.check("join", lambda: 0 <= hvd.join() < n)


# ------------------------------------------------------------------ gradients


def check_gradients(b: Battery, n: int, r: int) -> None:
    f = torch.float64
    w = [data(k, 3, f, salt=7) for k in range(n)]  # rank k's weights on the output

    def ar() -> Any:
        x = data(r, 3, f).requires_grad_()
        (hvd.allreduce(x, op=hvd.Sum) * w[r]).sum().backward()
        return close(x.grad, sum(w[1:], w[0].clone()))

    def ag() -> Any:
        x = data(r, r + 1, f).requires_grad_()
        total_rows = sum(k + 1 for k in range(n))
        coeff = [data(k, total_rows, f, salt=8) for k in range(n)]
        (hvd.allgather(x) * coeff[r]).sum().backward()
        off = sum(k + 1 for k in range(r))
        # Horovod >= 0.22: this rank's slice of the gradient averaged over the ranks
        return close(x.grad, (sum(coeff[1:], coeff[0].clone()) / n)[off : off + r + 1])

    def a2a(splits: Any) -> Callable[[], Any]:
        def run() -> Any:
            x = data(r, 2 * n, f).requires_grad_()
            out = hvd.alltoall(x, splits=splits)
            out = out if splits is None else out[0]
            (out * 3.0).sum().backward()
            return close(x.grad, torch.full_like(x, 3.0))

        return run

    def bc() -> Any:
        x = data(r, 3, f).requires_grad_()
        (hvd.broadcast(x, root_rank=0) * w[r]).sum().backward()
        avg = sum(w[1:], w[0].clone()) / n  # Horovod >= 0.22: averaged on the root
        return close(x.grad, avg if r == 0 else torch.zeros_like(x))

    def rs(op: Any, want: float) -> Callable[[], Any]:
        def run() -> Any:
            x = data(r, 2 * n, f).requires_grad_()
            hvd.reducescatter(x, op=op).sum().backward()
            return close(x.grad, torch.full_like(x, want))

        return run

    def grouped() -> Any:
        xs = [data(r, 2, f).requires_grad_(), data(r, 3, f).requires_grad_()]
        sum(o.sum() for o in hvd.grouped_allreduce(xs, op=hvd.Sum)).backward()
        return close(xs[1].grad, torch.full_like(xs[1], float(n)))

    b.check("grad allreduce", ar)
    b.check("grad allgather varlen", ag)
    b.check("grad alltoall equal splits (tensor result)", a2a(None))
    b.check("grad alltoall splits", a2a([2] * n))
    b.check("grad broadcast", bc)
    # Horovod's ReducescatterOp gradient: allgather(grad), times size() for Sum
    b.check("grad reducescatter sum", rs(hvd.Sum, float(n)))
    b.check("grad reducescatter average", rs(hvd.Average, 1.0))
    b.check("grad grouped_allreduce", grouped)


# ------------------------------------------------------------------ process sets


def check_process_sets(b: Battery, n: int, r: int) -> None:
    members = [0, n - 1]  # ranks 0 and 1 at W=2; 0 and 2 at W=3 (rank 1 outside)
    ps = hvd.add_process_set(members)
    inside = r in members
    b.check("ps id", lambda: ps.process_set_id is not None and ps.process_set_id > 0)
    b.check("ps included", lambda: ps.included() == inside)
    b.check("ps size", lambda: ps.size() == len(members))
    b.check("ps rank", lambda: ps.rank() == (members.index(r) if inside else None))
    b.check("global set", lambda: hvd.global_process_set.size() == n)
    b.check("global set rank", lambda: hvd.global_process_set.rank() == r)
    b.check("global set ranks", lambda: hvd.global_process_set.ranks == list(range(n)))
    b.raises("ps duplicate add", lambda: hvd.add_process_set(list(members)))
    f = torch.float64
    if inside:
        mine = data(r, 2, f)
        total = sum(data(k, 2, f) for k in members[1:]) + data(members[0], 2, f)
        b.check("ps allreduce avg", lambda: close(hvd.allreduce(mine, process_set=ps), total / 2))
        b.check(
            "ps grouped_allreduce",
            lambda: close(hvd.grouped_allreduce([mine], op=hvd.Sum, process_set=ps)[0], total),
        )
        b.check(
            "ps allgather varlen",
            lambda: same(
                hvd.allgather(data(r, r + 1, f), process_set=ps),
                torch.cat([data(k, k + 1, f) for k in members]),
            ),
        )
        b.check(
            "ps broadcast global root",
            lambda: same(hvd.broadcast(mine, root_rank=n - 1, process_set=ps), data(n - 1, 2, f)),
        )
        b.check(
            "ps alltoall",
            lambda: same(
                hvd.alltoall(data(r, 4, f, salt=9), process_set=ps),
                torch.cat(
                    [data(k, 4, f, salt=9)[2 * ps.rank() : 2 * ps.rank() + 2] for k in members]
                ),
            ),
        )
        b.check(
            "ps reducescatter",
            lambda: close(
                hvd.reducescatter(data(r, 4, f), op=hvd.Sum, process_set=ps),
                (data(members[0], 4, f) + data(members[1], 4, f))[
                    2 * ps.rank() : 2 * ps.rank() + 2
                ],
            ),
        )
        b.check(
            "ps allgather_object",
            lambda: hvd.allgather_object(r, process_set=ps) == members,
        )
        b.check(
            "ps broadcast_object",
            lambda: hvd.broadcast_object(r, root_rank=n - 1, process_set=ps) == n - 1,
        )
        b.check("ps barrier", lambda: hvd.barrier(process_set=ps))

        def ps_grad() -> Any:
            x = data(r, r + 1, f).requires_grad_()
            (hvd.allgather(x, process_set=ps) * 2.0).sum().backward()
            return close(x.grad, torch.full_like(x, 2.0))  # averaged over the 2 members

        b.check("ps grad allgather", ps_grad)

        def ps_optimizer() -> Any:
            torch.manual_seed(0)
            lin = torch.nn.Linear(3, 1)
            opt = hvd.DistributedOptimizer(
                torch.optim.SGD(lin.parameters(), lr=1.0), lin.named_parameters(), process_set=ps
            )
            lin(data(r, 3, f).float()).sum().backward()
            opt.synchronize()
            want = (data(members[0], 3, f) + data(members[1], 3, f)).float().sum(0) / 2
            return close(lin.weight.grad[0], want)

        b.check("ps DistributedOptimizer", ps_optimizer)
        if n > 2:  # rank 1 is outside [0, 2]: ValueError on both members
            b.raises("ps root outside set", lambda: hvd.broadcast(mine, 1, process_set=ps))
    else:
        b.raises("ps call from non-member", lambda: hvd.allreduce(torch.ones(2), process_set=ps))
    b.check("ps remove", lambda: hvd.remove_process_set(ps) is True)
    b.check("ps invalidated", lambda: ps.process_set_id is None and ps.size() is None)
    b.check("global not removable", lambda: hvd.remove_process_set(hvd.global_process_set) is False)
    b.raises("ps use after remove", lambda: hvd.allreduce(torch.ones(2), process_set=ps))


# ------------------------------------------------------------------ error symmetry


def check_errors(b: Battery, n: int, r: int) -> None:
    """Each call is invalid on one rank (or all); every rank must raise the same type."""
    b.raises("err shape", lambda: hvd.allreduce(torch.ones(2 + (r == n - 1))))
    b.raises(
        "err dtype",
        lambda: hvd.allreduce(torch.ones(2, dtype=torch.float64 if r == 0 else torch.float32)),
    )
    b.raises("err allgather trailing", lambda: hvd.allgather(torch.ones(2, 1 + (r == 1))))
    b.raises(
        "err allgather dtype",
        lambda: hvd.allgather(torch.ones(2, dtype=torch.int32 if r else torch.int64)),
    )
    b.raises("err broadcast root differs", lambda: hvd.broadcast(torch.ones(2), root_rank=r))
    b.raises("err broadcast root out of range", lambda: hvd.broadcast(torch.ones(2), root_rank=n))
    b.raises("err name differs", lambda: hvd.allreduce(torch.ones(2), name=f"n{r}"))
    b.raises(
        "err alltoall bad splits on one rank",
        lambda: hvd.alltoall(torch.ones(n, 1), splits=[n] + [0] * (n - 1) if r else [1] * (n + 1)),
    )
    b.raises("err alltoall indivisible", lambda: hvd.alltoall(torch.ones(n + (r == 0), 1)))
    b.raises("err grouped count", lambda: hvd.grouped_allreduce([torch.ones(2)] * (1 + (r == 0))))
    b.raises("err adasum", lambda: hvd.allreduce(torch.ones(2), op=hvd.Adasum))
    b.raises(
        "err different ops (allreduce vs allgather)",
        lambda: hvd.allreduce(torch.ones(2)) if r == 0 else hvd.allgather(torch.ones(2)),
    )
    # rank 0 waits for an allreduce no peer submits, the peers wait in barrier: Horovod hangs,
    # ringtrain raises on every rank
    b.raises(
        "err allreduce vs barrier",
        lambda: (
            hvd.synchronize(hvd.allreduce_async(torch.ones(2), name="lonely"))
            if r == 0
            else hvd.barrier()
        ),
    )

    def join_serves_allreduce() -> Any:
        got = hvd.allreduce(torch.full((1,), float(n)), op=hvd.Average) if r == 0 else None
        last = hvd.join()  # the joined peers contributed zeros to rank 0's allreduce
        return last == 0 and (got is None or same(got, torch.ones(1)))

    b.check("join serves allreduce", join_serves_allreduce)
    lin = torch.nn.Linear(2, 1)
    b.raises(
        "err DistributedOptimizer vs allreduce",
        lambda: (
            hvd.DistributedOptimizer(torch.optim.SGD(lin.parameters(), lr=0.1))
            if r == 0
            else hvd.allreduce(torch.ones(2))
        ),
    )
    b.raises(
        "err broadcast_parameters layout",
        lambda: hvd.broadcast_parameters({"w": torch.ones(2 + (r == 0))}, root_rank=0),
    )
    # a name in flight: ValueError at once, on the rank that reuses it (Horovod's rule)
    h = hvd.allreduce_async(torch.ones(2), name="dup")
    b.raises("err duplicate name in flight", lambda: hvd.allreduce_async(torch.ones(2), name="dup"))
    hvd.synchronize(h)
    h = hvd.allgather_async(torch.ones(1), name="dupg")
    b.raises(
        "err duplicate name allgather", lambda: hvd.allgather_async(torch.ones(1), name="dupg")
    )
    hvd.synchronize(h)
    b.raises("err unknown handle", lambda: hvd.synchronize(h))
    b.raises("err mpi_threads_supported", hvd.mpi_threads_supported)
    b.raises("err start_timeline", lambda: hvd.start_timeline("/tmp/unused.json"))
    b.raises("err init comm", lambda: hvd.init(comm=[0, 1]))
    b.raises("err ProcessSet from comm", lambda: hvd.ProcessSet(object()))  # type: ignore[arg-type]
    b.raises("err add_process_set differs", lambda: hvd.add_process_set([0] if r == 0 else [0, 1]))
    b.check(
        "usable after errors",
        lambda: same(hvd.allreduce(torch.ones(2), op=hvd.Sum), torch.full((2,), float(n))),
    )


# ------------------------------------------------------------------ optimizer state


def check_broadcast_state(b: Battery, n: int, r: int) -> None:
    class NoGrad(torch.nn.Module):  # Horovod's test_broadcast_state_no_grad model
        def __init__(self) -> None:
            super().__init__()
            self.a = torch.nn.Parameter(torch.tensor([1, 3]), requires_grad=False)
            self.b = torch.nn.Parameter(torch.rand(4) + r)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.index_select(self.b, 0, self.a.long()) * x

    model = NoGrad()
    opt = torch.optim.SGD(
        model.parameters(), lr=0.001, weight_decay=1e-6, momentum=0.9, nesterov=True
    )
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    b.check("no-grad broadcast_parameters", lambda: hvd.broadcast_parameters(model.state_dict(), 0))
    b.check("no-grad broadcast_optimizer_state", lambda: hvd.broadcast_optimizer_state(opt, 0))

    def grads() -> Any:
        grad = opt.param_groups[0]["params"][1].grad
        if opt.param_groups[0]["params"][0].grad is not None:
            return "frozen parameter got a gradient"
        return same(hvd.broadcast(grad, root_rank=0), grad)

    b.check("no-grad grads after broadcast", grads)
    lin = torch.nn.Linear(3, 2)
    b.check(
        "broadcast_parameters(model.parameters())",
        lambda: hvd.broadcast_parameters(list(lin.parameters()), root_rank=0),
    )
    b.check(
        "parameters list equal on all ranks",
        lambda: all(
            torch.equal(w, lin.weight.detach())
            for w in hvd.allgather_object(lin.weight.detach().clone())
        ),
    )
    for cls in (torch.optim.Adam, torch.optim.RMSprop, torch.optim.Adagrad, torch.optim.LBFGS):
        m = torch.nn.Linear(3, 1)
        o = cls(m.parameters(), lr=0.01 * (r + 1))

        def bos(o: Any = o, m: Any = m) -> Any:
            hvd.broadcast_parameters(m.state_dict(), root_rank=0)
            hvd.broadcast_optimizer_state(o, root_rank=0)
            return o.param_groups[0]["lr"] == 0.01 or o.param_groups[0]["lr"]

        b.check(f"broadcast_optimizer_state {cls.__name__}", bos)


def main() -> None:
    hvd.init()
    n, r = hvd.size(), hvd.rank()
    b = Battery()
    for part in (check_dtypes, check_ops, check_gradients, check_process_sets, check_errors):
        try:
            part(b, n, r)
        except Exception:
            b.results[f"{part.__name__} aborted"] = traceback.format_exc()[-800:]
    try:
        check_broadcast_state(b, n, r)
    except Exception:
        b.results["check_broadcast_state aborted"] = traceback.format_exc()[-800:]
    # static process sets at init
    hvd.shutdown()
    try:
        static = hvd.ProcessSet([1, 0] if n > 2 else [1])
        hvd.init(process_sets=[static])
        if static.included():
            b.check(
                "static process set",
                lambda: same(
                    hvd.allreduce(torch.ones(1), op=hvd.Sum, process_set=static),
                    torch.full((1,), float(static.size())),
                ),
            )
        b.check("static ps id", lambda: static.process_set_id == 1)
        hvd.shutdown()
    except Exception:
        b.results["static aborted"] = traceback.format_exc()[-800:]
    sys.stdout.write(json.dumps({"rank": r, "size": n, "checks": b.results}) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
