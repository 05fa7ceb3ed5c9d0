"""Horovod's semantics that its own test module (test/parallel/test_torch.py of 0.28.1) relies on,
run in each rank by tests/multiprocess/test_horovod_parity.py.

``python hvd_parity_workloads.py`` under torchrun-style variables prints one JSON line:
``{"rank": r, "checks": {name: "ok" | failure}}``. Each check is a scenario where ringtrain used
to differ from Horovod (issue 45): operations matched by name (a name reused while the peers are
elsewhere, operations submitted in different orders), ``hvd.join()`` serving its peers'
allreduces, reducescatter's gradient and its refusal of scalars, and ``DistributedOptimizer``'s
edge cases (``_parameter_names``, a rank outside its process set, sparse gradients).
"""

from __future__ import annotations

import json
import sys
import traceback
from collections.abc import Callable
from typing import Any

import torch

import ringtrain.horovod as hvd


def run(results: dict[str, str], name: str, fn: Callable[[], Any]) -> None:
    try:
        out = fn()
        results[name] = "ok" if out is None or out is True else f"failed: {out}"
    except Exception:
        results[name] = traceback.format_exc()[-600:]
    try:
        hvd.barrier()  # every check ends together, whatever it did
    except Exception:
        results[name + " (barrier after)"] = traceback.format_exc()[-600:]


def raises(fn: Callable[[], Any]) -> str:
    try:
        fn()
    except Exception as exc:
        return type(exc).__name__
    return "nothing"


def duplicate_name_while_peers_elsewhere(n: int, r: int) -> Any:
    # Horovod's test_horovod_allreduce_duplicate_name_error: rank 0 reuses a name in flight
    # while its peers are in barrier(); only rank 0 raises, and its first operation is later
    # matched by the peers' operation of that name.
    t = torch.full((3,), float(r + 1))
    got = None
    if r == 0:
        h = hvd.allreduce_async(t, name="dup", op=hvd.Sum)
        if raises(lambda: hvd.allreduce_async(t, name="dup")) != "ValueError":
            return "rank 0's duplicate did not raise ValueError"
    hvd.barrier()
    if r > 0:
        h = hvd.allreduce_async(t, name="dup", op=hvd.Sum)
        if raises(lambda: hvd.allreduce_async(t, name="dup")) != "ValueError":
            return f"rank {r}'s duplicate did not raise ValueError"
    hvd.barrier()
    got = hvd.synchronize(h)
    want = float(n * (n + 1) // 2)
    return bool(torch.equal(got, torch.full((3,), want))) or f"got {got.tolist()}, want {want}"


def names_in_different_orders(n: int, r: int) -> Any:
    a, b = torch.full((2,), 1.0 + r), torch.full((4,), 10.0 * (r + 1))
    order = ["a", "b"] if r % 2 == 0 else ["b", "a"]
    handles = {k: hvd.allreduce_async(a if k == "a" else b, name=k, op=hvd.Sum) for k in order}
    got_a, got_b = hvd.synchronize(handles["a"]), hvd.synchronize(handles["b"])
    want_a = sum(1.0 + k for k in range(n))
    want_b = sum(10.0 * (k + 1) for k in range(n))
    ok_a = torch.equal(got_a, torch.full((2,), want_a))
    ok_b = torch.equal(got_b, torch.full((4,), want_b))
    return (ok_a and ok_b) or f"got {got_a.tolist()} and {got_b.tolist()}"


def waits_that_never_meet_raise_everywhere(n: int, r: int) -> Any:
    # every rank blocks on an operation no peer submits: Horovod hangs, ringtrain raises
    err = raises(lambda: hvd.allreduce(torch.ones(2), name=f"only-on-{r}"))
    if err != "RuntimeError":
        return f"raised {err}"
    # unnamed operations still line up afterwards
    got = hvd.allreduce(torch.ones(2), op=hvd.Sum)
    return bool(torch.equal(got, torch.full((2,), float(n)))) or f"then got {got.tolist()}"


def average_is_the_rounded_mean(n: int, r: int) -> Any:
    # Horovod's test_horovod_join_allreduce compares Average exactly with (t * (size - 1)) / size
    # at 3 ranks: Horovod scales in float64, so the mean is rounded once; sum * float32(1/3) is
    # off by one ulp for about a third of the values.
    out = []
    for dtype in (torch.float32, torch.float64):
        gens = [torch.Generator().manual_seed(k) for k in range(n)]
        every = [torch.randint(-100, 100, (1000,), generator=g).to(dtype) for g in gens]
        want = sum(every[1:], every[0].clone()) / n
        got = hvd.allreduce(every[r])
        grouped = hvd.grouped_allreduce([every[r], every[r][:7]])
        if not torch.equal(got, want) or not torch.equal(grouped[1], want[:7]):
            out.append(f"{dtype}: {int((got != want).sum())} of {want.numel()} values differ")
    return out or True


def join_serves_allreduce(n: int, r: int) -> Any:
    # Horovod's test_horovod_join_allreduce: the joined rank contributes zeros, Average still
    # divides by size(), join() returns the last rank to join on every rank.
    for first in range(n):
        t = torch.full((5, 5), float(r + 1), dtype=torch.float64)
        ints = torch.full((17,), 3 * (r + 1), dtype=torch.int32)
        if r == first:
            last = hvd.join()
        else:
            ha = hvd.allreduce_async(t, name="join.a")
            hb = hvd.allreduce_async(ints, name="join.b", op=hvd.Sum)
            avg, total = hvd.synchronize(ha), hvd.synchronize(hb)
            grouped = hvd.grouped_allreduce([t, ints.double()], op=hvd.Sum)
            last = hvd.join()
            others = [k for k in range(n) if k != first]
            want_avg = sum(k + 1 for k in others) / n
            if not torch.allclose(avg, torch.full_like(t, want_avg)):
                return f"average with rank {first} joined: {avg[0, 0].item()}, want {want_avg}"
            if int(total[0]) != sum(3 * (k + 1) for k in others):
                return f"int sum with rank {first} joined: {total[0].item()}"
            if float(grouped[0][0, 0]) != sum(k + 1 for k in others):
                return f"grouped with rank {first} joined: {grouped[0][0, 0].item()}"
        lasts = hvd.allgather_object(last)
        if lasts != [lasts[0]] * n or lasts[0] == first:
            return f"join() returned {lasts} with rank {first} joining first"
    return True


def join_refuses_other_collectives(n: int, r: int) -> Any:
    # Horovod's test_horovod_join_broadcast / _allgather: RuntimeError on the ranks that call
    # them, the joined rank keeps waiting and its join() returns normally.
    if r == 0:
        return 0 < hvd.join() < n
    errors = [
        raises(lambda: hvd.broadcast(torch.ones(3), root_rank=r)),
        raises(lambda: hvd.allgather(torch.ones(2))),
        raises(lambda: hvd.barrier()),
    ]
    last = hvd.join()
    return (errors == ["RuntimeError"] * 3 and 0 < last < n) or f"{errors}, join() -> {last}"


def reducescatter_scalar_raises(n: int, r: int) -> Any:
    errors = [
        raises(lambda: hvd.reducescatter(torch.tensor(float(r)))),
        raises(lambda: hvd.grouped_reducescatter([torch.zeros(3, 1), torch.tensor(float(r))])),
    ]
    return errors == ["RuntimeError", "RuntimeError"] or f"raised {errors}"


def reducescatter_gradient(n: int, r: int) -> Any:
    # Horovod's ReducescatterOp backward: allgather(grad), times size() for Sum
    out = []
    for op, want in ((hvd.Sum, float(n)), (hvd.Average, 1.0)):
        x = torch.ones(4 * n, 3, requires_grad=True)
        hvd.reducescatter(x, op=op).backward(torch.ones(4, 3))
        xs = [torch.ones(2 * n, requires_grad=True), torch.ones(n, 2, requires_grad=True)]
        for y in hvd.grouped_reducescatter(xs, op=op):
            y.sum().backward()
        for g in (x.grad, xs[0].grad, xs[1].grad):
            if not torch.equal(g, torch.full_like(g, want)):
                out.append(f"{op}: gradient {g.flatten()[:3].tolist()}, want {want}")
    return out or True


def optimizer_parameter_names(n: int, r: int) -> Any:
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    opt = torch.optim.SGD(
        [{"params": model[0].parameters()}, {"params": model[1].parameters()}], lr=0.1
    )
    opt = hvd.DistributedOptimizer(opt)
    names = opt._parameter_names
    every = hvd.allgather_object(sorted(names.values()))
    ok = len(names) == 4 and len(set(names.values())) == 4 and every == [every[0]] * n
    return ok or f"_parameter_names {names}"


def optimizer_outside_its_process_set(n: int, r: int) -> Any:
    # Horovod's test_optimizer_process_sets: every rank wraps its optimizer with the even ranks'
    # set; odd ranks step on their own gradients.
    evens = hvd.add_process_set(list(range(0, n, 2)))
    try:
        torch.manual_seed(r)
        model = torch.nn.Linear(3, 2)
        opt = hvd.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.5),
            named_parameters=model.named_parameters(),
            process_set=evens,
        )
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        x = torch.full((1, 3), float((r + 1) ** 2))  # rank 1's gradient is not the evens' mean
        model(x).sum().backward()
        opt.step()
        weights = hvd.allgather_object(model.weight.detach().clone())
        even = [w for k, w in enumerate(weights) if k % 2 == 0]
        same_evens = all(torch.equal(w, even[0]) for w in even)
        odd_alone = all(not torch.equal(w, weights[0]) for k, w in enumerate(weights) if k % 2)
        return (same_evens and odd_alone) or "weights after one step do not match"
    finally:
        hvd.remove_process_set(evens)


def sparse_gradients(n: int, r: int) -> Any:
    # Horovod's test_sparse_embeddings, with the averaged gradient checked
    out = []
    inputs = [torch.tensor([[1, 2, 4, 5], [4, 3, 2, 9]]), torch.tensor([[1, 3, 4], [4, 7, 9]])]
    for sparse_as_dense in (False, True):
        emb = torch.nn.Embedding(10, 3, sparse=True)
        torch.nn.init.constant_(emb.weight, 1.0)
        opt = hvd.DistributedOptimizer(
            torch.optim.SparseAdam(list(emb.parameters()), lr=0.1),
            sparse_as_dense=sparse_as_dense,
        )
        opt.zero_grad()
        emb(inputs[r % 2]).sum().backward()
        opt.synchronize()
        grad = emb.weight.grad
        want = torch.zeros(10, 3)
        for k in range(n):
            want.index_add_(0, inputs[k % 2].flatten(), torch.ones(inputs[k % 2].numel(), 3))
        want /= n
        if not grad.is_sparse or not torch.allclose(grad.to_dense(), want):
            out.append(f"sparse_as_dense={sparse_as_dense}: {grad}")
        with opt.skip_synchronize():
            opt.step()
    return out or True


CHECKS = [
    duplicate_name_while_peers_elsewhere,
    names_in_different_orders,
    waits_that_never_meet_raise_everywhere,
    average_is_the_rounded_mean,
    join_serves_allreduce,
    join_refuses_other_collectives,
    reducescatter_scalar_raises,
    reducescatter_gradient,
    optimizer_parameter_names,
    optimizer_outside_its_process_set,
    sparse_gradients,
]


def main() -> None:
    hvd.init()
    n, r = hvd.size(), hvd.rank()
    results: dict[str, str] = {}
    for check in CHECKS:
        run(results, check.__name__, lambda check=check: check(n, r))
    hvd.shutdown()
    sys.stdout.write(json.dumps({"rank": r, "checks": results}) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
