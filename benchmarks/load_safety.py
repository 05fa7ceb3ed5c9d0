"""What "loading never runs code" and "no process outlives the driver" cost (issue 18).

1. Reading a DCP ``.metadata``: :func:`ringtrain.checkpoint.dcp_metadata.load_metadata` (the
   restricted pickle machine) against ``pickle.loads`` (what DCP itself uses, which can run any
   code), on the same bytes. The metadata is built with DCP's own classes the way ``dcp.save``
   builds it for T tensors (weights and two Adam moments each), sharded over R ranks: R chunks
   per tensor and R storage entries. Median of ``--repeats`` reads each, and the ratio.
2. The reaper: the time the driver spends starting it (``Reaper(token)``: a fork and exec,
   without waiting; the reaper's Python starts in the background) and ending it (``close()``,
   0.5 s later as in a run: it sweeps ``/proc`` once and exits, and the driver reaps it).

Run::

    python benchmarks/load_safety.py                 # 3 metadata sizes, 5 repeats
    python benchmarks/load_safety.py --repeats 3 --sizes 100x2 1000x8
"""

from __future__ import annotations

import argparse
import pathlib
import pickle
import statistics
import time

import torch

from ringtrain.checkpoint.dcp_metadata import load_metadata
from ringtrain.launch.reaper import Reaper


def build_metadata(tensors: int, ranks: int) -> bytes:
    """A DCP Metadata as ``dcp.save`` writes it: ``tensors`` parameters (x3 with Adam moments),
    each sharded in ``ranks`` row chunks, plus an Adam step counter per parameter."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        StorageMeta,
        TensorProperties,
        TensorStorageMetadata,
    )

    rows, cols = 16 * ranks, 1024
    state: dict = {}
    storage: dict = {}
    planner: dict = {}
    for t in range(tensors):
        for kind in ("model", "optimizer.state.exp_avg", "optimizer.state.exp_avg_sq"):
            fqn = f"{kind}.layers.{t}.weight"
            chunks = [
                ChunkStorageMetadata(torch.Size([r * 16, 0]), torch.Size([16, cols]))
                for r in range(ranks)
            ]
            props = TensorProperties(dtype=torch.float32)
            state[fqn] = TensorStorageMetadata(props, torch.Size([rows, cols]), chunks)
            planner[fqn] = tuple(fqn.split("."))
            for r in range(ranks):
                storage[MetadataIndex(fqn, [r * 16, 0])] = _StorageInfo(
                    f"__{r}_0.distcp", t * 65536, 65536
                )
        step = f"optimizer.state.step.layers.{t}.weight"
        state[step] = BytesStorageMetadata()
        planner[step] = tuple(step.split("."))
        storage[MetadataIndex(step)] = _StorageInfo("__0_0.distcp", 0, 64)
    meta = Metadata(
        state,
        planner_data=planner,
        storage_data=storage,
        storage_meta=StorageMeta(checkpoint_id=pathlib.PosixPath("/tmp/ringtrain_dcp_r0_x")),
        version="1.0.0",
    )
    return pickle.dumps(meta, protocol=4)


def median_time(fn, repeats: int) -> tuple[float, list[float]]:
    fn()  # warm: imports, caches
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), times


def bench_metadata(sizes: list[str], repeats: int) -> None:
    print("| tensors x ranks | .metadata | pickle.loads (unsafe) | load_metadata | ratio |")
    print("|---|---|---|---|---|")
    for size in sizes:
        tensors, ranks = (int(x) for x in size.split("x"))
        data = build_metadata(tensors, ranks)
        base, _ = median_time(lambda data=data: pickle.loads(data), repeats)
        ours, runs = median_time(lambda data=data: load_metadata(data), repeats)
        assert pickle.dumps(load_metadata(data)) == pickle.dumps(pickle.loads(data))
        print(
            f"| {tensors} x {ranks} | {len(data) / 1e6:.2f} MB | {base * 1e3:.1f} ms "
            f"| {ours * 1e3:.1f} ms ({', '.join(f'{t * 1e3:.0f}' for t in runs)}) "
            f"| {ours / base:.1f}x |"
        )


def bench_reaper(repeats: int) -> None:
    starts, closes = [], []
    for i in range(repeats + 1):
        t0 = time.perf_counter()
        reaper = Reaper(f"bench{i}")
        started = time.perf_counter() - t0
        for pgid in range(4):
            reaper.add(10_000_000 + pgid)  # pids that do not exist: killpg finds nothing
        time.sleep(0.5)  # as in a run: the reaper has long started when the group stops
        t1 = time.perf_counter()
        reaper.close()
        closed = time.perf_counter() - t1
        if i:  # the first one warms the page cache
            starts.append(started)
            closes.append(closed)
    print(
        f"reaper: start {statistics.median(starts) * 1e3:.1f} ms median "
        f"({', '.join(f'{t * 1e3:.1f}' for t in starts)}), "
        f"close {statistics.median(closes) * 1e3:.1f} ms median "
        f"({', '.join(f'{t * 1e3:.0f}' for t in closes)})"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", nargs="+", default=["50x2", "300x8", "1000x32"])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    bench_metadata(args.sizes, args.repeats)
    bench_reaper(args.repeats)


if __name__ == "__main__":
    main()
