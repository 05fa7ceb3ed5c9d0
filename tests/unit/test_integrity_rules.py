"""The corruption checks' pure parts: fingerprints, the replica sets of a mesh, who a mismatch
names, and what the driver decides (tests/multiprocess/test_integrity.py runs them for real)."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from ringtrain.config.parallel import MeshShape
from ringtrain.controller import integrity
from ringtrain.controller.effects import Write
from ringtrain.integrity.fingerprint import fingerprint, state_tensors
from ringtrain.integrity.inject import flip_bit
from ringtrain.integrity.replicas import judge, replica_sets
from ringtrain.wire.channel import IntegrityMismatch, IntegrityVerified


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_every_single_bit_flip_changes_the_fingerprint(dtype):
    t = torch.randn(7, 3).to(dtype)
    base = fingerprint([t])
    words = t.numel() * t.element_size() // 4
    for index in range(words):
        for bit in range(32):
            flipped = t.clone()
            flip_bit(flipped, bit, index)
            assert fingerprint([flipped]) != base, (index, bit)


def test_the_fingerprint_depends_on_which_tensor_holds_the_bytes_not_on_layout():
    a, b = torch.randn(10), torch.randn(10)
    assert fingerprint([a, b]) != fingerprint([b, a])
    assert fingerprint([a.reshape(2, 5)]) == fingerprint([a])
    assert fingerprint([a.reshape(5, 2).t()]) == fingerprint([a.reshape(5, 2).t().contiguous()])
    assert fingerprint([]) == fingerprint([])


def test_state_tensors_cover_parameters_buffers_and_optimizer_state():
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.BatchNorm1d(2))
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(4, 3)).sum().backward()
    optimizer.step()
    before = fingerprint(state_tensors(model, optimizer))
    flip_bit(optimizer.state[model[0].weight]["exp_avg"], 3)
    assert fingerprint(state_tensors(model, optimizer)) != before
    count = len(list(state_tensors(model, optimizer)))
    assert count == 4 + 3 + 4 * 3  # params, buffers (BatchNorm), Adam's step/exp_avg/exp_avg_sq


def test_replica_sets_on_a_mesh_are_the_ranks_holding_the_same_shard():
    assert replica_sets(3, None) == [[0, 1, 2]]
    hsdp = MeshShape(pp=1, dp_replicate=2, dp_shard=2, tp=1)
    assert sorted(replica_sets(4, hsdp)) == [[0, 2], [1, 3]]
    fsdp = MeshShape(pp=1, dp_replicate=1, dp_shard=4, tp=1)
    assert all(len(s) == 1 for s in replica_sets(4, fsdp))


def test_the_minority_is_named_and_two_replicas_are_only_suspects():
    assert judge({0: 5, 1: 5, 2: 5}, [[0, 1, 2]]) == ([], True)
    assert judge({0: 5, 1: 9, 2: 5}, [[0, 1, 2]]) == ([1], True)
    assert judge({0: 5, 1: 9}, [[0, 1]]) == ([0, 1], False)
    assert judge({0: 5, 1: 5, 2: 7, 3: 8}, [[0, 1, 2, 3]]) == ([0, 1, 2, 3], False)  # a tie
    assert judge({0: 1, 1: 2, 2: 1, 3: 1}, [[0, 2], [1, 3]]) == ([1, 3], False)


def _mismatch(suspects, named, step=9):
    fps = {0: 1, 1: 2, 2: 1} if named else {0: 1, 1: 2}
    return IntegrityMismatch(
        rank=0, time=1.0, step=step, check="replica", fingerprints=fps,
        suspects=tuple(suspects), named=named, last_clean_step=6, clean_round=2,
    )  # fmt: skip


def test_a_named_rank_rolls_back_then_is_excluded_or_fails_the_second_time():
    hosts = {0: "a", 1: "b", 2: "c"}
    first = integrity.after_mismatch(
        _mismatch([1], True), hosts=hosts, caught=Counter(), suspected=Counter(), can_shrink_by=1
    )
    assert (first.action, first.culprits, first.clean_round) == ("rollback", (1,), 2)
    record = next(e.record for e in first.effects if isinstance(e, Write))
    assert (record.ranks, record.hosts, record.named, record.action) == (
        [1],
        ["b"],
        True,
        "rollback",
    )
    again = dict(hosts=hosts, caught=Counter({1: 1}), suspected=Counter())
    assert integrity.after_mismatch(_mismatch([1], True), **again, can_shrink_by=1).action == (
        "exclude"
    )
    failed = integrity.after_mismatch(_mismatch([1], True), **again, can_shrink_by=0)
    assert failed.action == "fail" and "rank 1 on b corrupted its state a second time" in (
        failed.reason
    )


def test_two_suspects_are_rechecked_by_the_re_run_and_fail_together_the_second_time():
    hosts = {0: "a", 1: "b"}
    first = integrity.after_mismatch(
        _mismatch([0, 1], False),
        hosts=hosts,
        caught=Counter(),
        suspected=Counter(),
        can_shrink_by=0,
    )
    assert first.action == "rollback" and first.culprits == () and first.recheck is not None
    # The re-run's true fingerprint is rank 0's: rank 1 is named.
    named, effects = integrity.named_by_rerun(
        first.recheck, IntegrityVerified(rank=0, time=2.0, step=9, fingerprint=1)
    )
    assert named == (1,) and effects[0].record.action == "named"
    # Neither had it: the corruption had spread; nobody is named.
    named, effects = integrity.named_by_rerun(
        first.recheck, IntegrityVerified(rank=0, time=2.0, step=9, fingerprint=3)
    )
    assert named == () and effects[0].record.action == "unresolved"
    second = integrity.after_mismatch(
        _mismatch([0, 1], False),
        hosts=hosts,
        caught=Counter(),
        suspected=Counter({0: 1, 1: 1}),
        can_shrink_by=1,
    )
    assert second.action == "fail" and "one of rank 0 on a, rank 1 on b" in second.reason


def test_ringtrain_show_lists_what_the_replica_checks_found(tmp_path):
    import io

    from rich.console import Console

    from ringtrain.monitor.render import render_run
    from ringtrain.monitor.runs import load_run
    from ringtrain.rundir import RunDirectory
    from ringtrain.rundir.schema import ReplicaMismatchEvent, RunStartEvent

    run = RunDirectory(str(tmp_path), "sdc")
    run.create()
    run.write(RunStartEvent(world_size=3, attempt=0))
    run.write(
        ReplicaMismatchEvent(
            step=9, check="replica", ranks=[2], hosts=["node-c"], action="rollback", named=True
        )
    )
    run.write(
        ReplicaMismatchEvent(
            step=12, check="replica", ranks=[0, 1], hosts=["a", "b"], action="fail", named=False
        )
    )
    run.close()
    details = load_run(run.uri)
    assert details.corruption == [
        "step 9 (replica check): rank 2 on node-c - rollback",
        "step 12 (replica check): one of rank 0 on a, rank 1 on b - fail",
    ]
    out = io.StringIO()
    render_run(details, Console(file=out, width=120))
    assert "Silent data corruption (2)" in out.getvalue()


def test_the_replay_ring_names_a_rank_whose_record_and_replay_both_disagree():
    from ringtrain.integrity.replay import MISMATCH, OK, neighbours, verdict

    assert [neighbours(r, 3) for r in range(3)] == [(2, 1), (0, 2), (1, 0)]
    assert (neighbours(0, 2), neighbours(1, 2)) == ((1, 1), (0, 0))  # two workers: each other
    ok = {q: OK for q in range(4)}
    assert verdict(ok, 4) == ([], True)
    # results[q] is q's replay of q - 1: rank 2 miscomputes its step and rank 1's replay.
    assert verdict({**ok, 2: MISMATCH, 3: MISMATCH}, 4) == ([2], True)
    assert verdict({0: OK, 1: OK, 2: MISMATCH}, 3) == ([1, 2], False)  # transient: a pair
    assert verdict({0: MISMATCH, 1: OK, 2: MISMATCH}, 3) == ([2], True)  # 2 in (1,2), (2,0)
    assert verdict({0: MISMATCH, 1: MISMATCH}, 2) == ([0, 1], False)  # two workers: suspects
    assert verdict({0: MISMATCH, 1: MISMATCH, 2: MISMATCH}, 3) == ([0, 1, 2], False)
    # two disagreeing pairs apart: both pairs are suspects, nobody named
    assert verdict({**ok, 1: MISMATCH, 3: MISMATCH}, 4) == ([0, 1, 2, 3], False)


def test_what_the_replay_sends_is_described_in_json_never_pickled():
    import json

    from ringtrain.integrity.wire import pack

    raw = pack(
        [torch.zeros(2, 3), torch.zeros(0, dtype=torch.int64)], {"valid": 1, "kwargs": ["a"]}
    )
    described = json.loads(raw)
    assert described == {
        "meta": {"valid": 1, "kwargs": ["a"]},
        "tensors": [
            {"dtype": "torch.float32", "shape": [2, 3]},
            {"dtype": "torch.int64", "shape": [0]},
        ],
    }
