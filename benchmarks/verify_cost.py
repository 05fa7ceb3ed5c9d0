"""Cost of verified, signed checkpoints (issue 18): today's path vs the path before it.

One checkpoint of a ``--params``-parameter float32 state (default 100 M, 400 MB, as ten tensors)
goes through the four steps a checkpoint takes, on the local disk, in one process:

1. **write**: ``torch.save`` into the round's staging directory through ringtrain's hashing
   writer (:func:`ringtrain.checkpoint.writer.write_files`); identical in both paths.
2. **publish**: the manifest and the atomic rename. Before: an unsigned manifest. Now:
   :func:`ringtrain.checkpoint.storage.publish` (HMAC-SHA256 over the manifest).
3. **verify** (the driver, before a restart): before, the old ``read_manifest(...,
   verify_checksums=True)`` re-implemented here (the start-up scan's sizes, then ``fs.size``
   and a chunked SHA-256 of each listed file); now :meth:`CheckpointManager.scan` and
   :meth:`CheckpointManager.latest_verified` (signature, run and round, confined
   ``O_NOFOLLOW`` opens, SHA-256, no unlisted file).
4. **load** (a worker): before, ``torch.load(path, mmap=True, weights_only=True)`` with no
   check; now ``TrainState.restore``'s reader, ``ringtrain.worker.state_files.load_file``: the file
   is copied into a private ``memfd`` and hashed in one pass, compared with the manifest table the
   driver sent, then ``torch.load(memfd, mmap=True, weights_only=True)``. Both then copy every
   tensor into a preallocated model (``copy_``), so the mmap path pays its page reads too.

The file is in the page cache in both paths (it was just written): the numbers are CPU costs
(hashing, copies), not disk reads. Runs alternate (before, now, now, before, ...) and the summary
is the median of each step over ``--repeats`` runs, with the ratio now / before.

Usage::

    python benchmarks/verify_cost.py                      # 100 M parameters, 5 runs each
    python benchmarks/verify_cost.py --params 10000000 --repeats 3   # smoke run
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

import torch
from fsspec.implementations.local import LocalFileSystem

from ringtrain.checkpoint import signing, storage
from ringtrain.checkpoint.checkpoint import Checkpoint
from ringtrain.checkpoint.manager import CheckpointManager
from ringtrain.checkpoint.writer import write_files
from ringtrain.config import CheckpointConfig

STEPS = ("write", "publish", "verify", "load")


def make_state(params: int, pieces: int = 10) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    size = params // pieces
    return {f"w{i}": torch.randn(size, generator=g) for i in range(pieces)}


def _write(fs: Any, run: str, state: dict[str, torch.Tensor]) -> dict[str, dict[str, Any]]:
    staging = os.path.join(run, storage.staging_dirname(0))
    return write_files(fs, staging, {"train_state.pt": lambda f: torch.save(state, f)})


def _copy_into(model: dict[str, torch.Tensor], loaded: dict[str, torch.Tensor]) -> None:
    for k, t in model.items():
        t.copy_(loaded[k])


# ------------------------------------------------------------------ the path before issue 18


def before(run: str, state: dict[str, torch.Tensor], model: dict[str, torch.Tensor]) -> dict:
    fs = LocalFileSystem()
    times: dict[str, float] = {}
    t = time.perf_counter()
    files = _write(fs, run, state)
    times["write"] = time.perf_counter() - t

    t = time.perf_counter()
    staging = os.path.join(run, storage.staging_dirname(0))
    final = os.path.join(run, storage.checkpoint_dirname(0))
    manifest = {"format": 1, "round": 0, "created": time.time(), "metrics": {}, "files": files}
    with open(os.path.join(staging, storage.MANIFEST), "w") as f:
        f.write(json.dumps(manifest, indent=1))
        f.flush()
        os.fsync(f.fileno())
    os.replace(staging, final)
    times["publish"] = time.perf_counter() - t

    t = time.perf_counter()
    for _ in range(2):  # the start-up scan (sizes), then the check of the latest (SHA-256)
        with open(os.path.join(final, storage.MANIFEST)) as f:
            manifest = json.loads(f.read())
        for rel, info in manifest["files"].items():
            assert fs.size(os.path.join(final, rel)) == info["size"]
    for rel, info in manifest["files"].items():
        path = os.path.join(final, rel)
        assert fs.size(path) == info["size"]
        digest = hashlib.sha256()
        with fs.open(path, "rb") as fin:
            while chunk := fin.read(storage.CHUNK):
                digest.update(chunk)
        assert digest.hexdigest() == info["sha256"]
    times["verify"] = time.perf_counter() - t

    t = time.perf_counter()
    loaded = torch.load(
        os.path.join(final, "train_state.pt"), weights_only=True, map_location="cpu", mmap=True
    )
    _copy_into(model, loaded)
    times["load"] = time.perf_counter() - t
    return times


# ------------------------------------------------------------------ today's path


def now(run: str, state: dict[str, torch.Tensor], model: dict[str, torch.Tensor]) -> dict:
    from ringtrain.worker.state_files import load_file as _load

    fs = LocalFileSystem()
    signer = signing.resolve()
    times: dict[str, float] = {}
    t = time.perf_counter()
    files = _write(fs, run, state)
    times["write"] = time.perf_counter() - t

    t = time.perf_counter()
    mgr = CheckpointManager(fs, run, CheckpointConfig(), signer=signer)
    storage.publish(fs, run, 0, files, {}, signer)
    times["publish"] = time.perf_counter() - t

    t = time.perf_counter()
    mgr.scan()
    tracked = mgr.latest_verified()
    assert tracked is not None and tracked.files is not None, mgr.notes
    times["verify"] = time.perf_counter() - t

    t = time.perf_counter()
    ckpt = Checkpoint(mgr.worker_uri(tracked), fs)
    ckpt.set_verified_files(mgr.resume_files)  # what a worker gets in Start
    loaded = _load(ckpt, "train_state.pt")  # TrainState.restore's reader
    _copy_into(model, loaded)
    times["load"] = time.perf_counter() - t
    return times


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--params", type=int, default=100_000_000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dir", default=None, help="scratch directory (default: a temp dir)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    root = tempfile.mkdtemp(prefix="rt_verify_cost_", dir=args.dir)
    os.environ.setdefault(signing.ENV_KEY_DIR, os.path.join(root, "keys"))
    state = make_state(args.params)
    model = {k: torch.empty_like(v) for k, v in state.items()}
    results: dict[str, list[dict]] = {"before": [], "now": []}
    order = []
    for i in range(args.repeats):
        order += (
            [("before", before), ("now", now)] if i % 2 == 0 else [("now", now), ("before", before)]
        )
    try:
        for i, (label, fn) in enumerate(order):
            run = os.path.join(root, f"run{i}")
            os.makedirs(run)
            times = fn(run, state, model)
            assert all(torch.equal(model[k], state[k]) for k in state)
            results[label].append(times)
            shutil.rmtree(run)
            print(
                f"{label:6s} " + "  ".join(f"{s} {times[s]:.3f} s" for s in STEPS),
                file=sys.stderr,
                flush=True,
            )
    finally:
        shutil.rmtree(root, ignore_errors=True)
    mb = args.params * 4 / 1e6
    print(f"\n{args.params:,} float32 parameters ({mb:.0f} MB), median of {args.repeats} runs\n")
    print("| step | before (s) | now (s) | now / before |")
    print("|---|---|---|---|")
    for step in (*STEPS, "total"):
        b = statistics.median(
            sum(r.values()) if step == "total" else r[step] for r in results["before"]
        )
        n = statistics.median(
            sum(r.values()) if step == "total" else r[step] for r in results["now"]
        )
        print(f"| {step} | {b:.3f} | {n:.3f} | {n / b:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
