"""Probes behind the notes of ``benchmarks/recovery.py`` (docs/benchmarks.md, "Checkpoints").

Not part of the benchmark: each probe isolates one cost that the benchmark's breakdown points at,
and compares it with an alternative. Some use ringtrain internals on purpose (``_stage``, the
function that async saves use to copy the state into host memory)::

    python benchmarks/_recovery_probes.py costs       # staging, restore, verification (100 M)
    python benchmarks/_recovery_probes.py inflight    # a kill while rank 0 still writes

``costs``, in one process with one torch thread, on the 100 M model of the benchmark (6 x
``nn.Linear(4096, 4096)`` and its SGD momentum, 806 MB):

* staging a checkpoint: ``ringtrain.worker.state_files.stage`` (a fresh ``clone()`` of every tensor,
  what each async save does) vs ``copy_`` into buffers kept from the previous save;
* the synchronous write for comparison: ``torch.save`` through a SHA-256 hashing writer + fsync;
* loading it back: ``read()`` the whole file into bytes and ``torch.load(BytesIO)`` (what
  ``TrainState.restore`` does) vs ``torch.load(path, mmap=True)``, both followed by
  ``load_state_dict`` into the model and optimizer and one in-place write of every momentum buffer
  (the optimizer keeps the loaded tensors; memory-mapped ones become private on first write);
* SHA-256 of the file (what the driver does before every restart to verify the checkpoint).

``inflight``: the benchmark's recovery run with a 25 M model, checkpoints every 3 steps, and rank 1
killed right after step 4, without waiting for the checkpoint of step 3 to be published: rank 0 is
then still writing it in the background. Prints the step the restart resumed from.
"""

from __future__ import annotations

import hashlib
import io
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))


def timed(fn: Callable[[], Any], n: int) -> list[float]:
    out = []
    for _ in range(n):
        start = time.perf_counter()
        result = fn()
        out.append(time.perf_counter() - start)
        del result
    return out


def show(label: str, values: list[float]) -> None:
    print(
        f"{label:<62} median {statistics.median(values):6.3f} s   "
        f"runs: {', '.join(f'{v:.3f}' for v in values)}"
    )


def costs(repeats: int = 5) -> None:
    import torch

    from ringtrain.worker.state_files import stage as _stage

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(4096, 4096) for _ in range(6)])
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4, momentum=0.9)
    model(torch.randn(4, 4096)).sum().backward()
    optimizer.step()
    payload = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}

    show(
        "stage: fresh clone() of every tensor (ringtrain _stage)",
        timed(lambda: _stage(payload), repeats),
    )
    buffers = _stage(payload)

    def reuse() -> None:
        for k, v in payload["model"].items():
            buffers["model"][k].copy_(v)
        for i, st in payload["optimizer"]["state"].items():
            buffers["optimizer"]["state"][i]["momentum_buffer"].copy_(st["momentum_buffer"])

    show("stage: copy_() into the buffers of the previous save", timed(reuse, repeats))

    class Hashing:
        def __init__(self, f: Any) -> None:
            self.f = f
            self.sha = hashlib.sha256()

        def write(self, data: Any) -> int:
            view = memoryview(data).cast("B")
            self.sha.update(view)
            self.f.write(view)
            return view.nbytes

        def flush(self) -> None:
            self.f.flush()

    fd, path = tempfile.mkstemp(suffix=".pt")
    os.close(fd)
    try:

        def sync_write() -> None:
            with open(path, "wb") as f:
                writer: Any = Hashing(f)  # a file-like, as ringtrain's _HashingWriter
                torch.save(payload, writer)
                f.flush()
                os.fsync(f.fileno())

        show("sync write: torch.save + SHA-256 + fsync", timed(sync_write, repeats))
        print(f"{'checkpoint file':<62} {os.path.getsize(path) / 1e6:.0f} MB")

        def restore(load: Callable[[], Any]) -> None:
            state = load()
            model.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])
            # load_state_dict keeps the loaded momentum tensors as they are (mmap: file pages,
            # copied on first write); write them once so both variants pay for private memory.
            for st in optimizer.state.values():
                st["momentum_buffer"].mul_(1.0)

        def read_bytes() -> Any:
            with open(path, "rb") as f:
                data = f.read()
            return torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")

        def mmap() -> Any:
            return torch.load(path, weights_only=True, map_location="cpu", mmap=True)

        show(
            "restore: read() + torch.load(BytesIO) (TrainState.restore)",
            timed(lambda: restore(read_bytes), repeats),
        )
        show("restore: torch.load(path, mmap=True)", timed(lambda: restore(mmap), repeats))

        def sha() -> str:
            digest = hashlib.sha256()
            with open(path, "rb") as f:
                while chunk := f.read(1 << 20):
                    digest.update(chunk)
            return digest.hexdigest()

        show("verify: SHA-256 of the file (driver, before a restart)", timed(sha, repeats))
    finally:
        os.remove(path)


def inflight() -> None:
    import recovery

    cfg = {
        **recovery.LARGE_QUICK,
        "steps": 6,
        "every": 3,
        "kill_step": 4,
        "wait_published": False,
    }
    run = recovery.run_once(cfg, async_save=True, max_failures=1, timeout_s=300)
    run["noisy"] = False
    res = recovery.analyse_recovery(run, cfg["every"])
    a0 = run["files"]["a0_r0"]
    ckpt = [rep for rep in a0["reports"] if rep[1]]
    kill = run["files"]["kill"]
    print(f"rank 0 returned from report(checkpoint=state) of step {ckpt[-1][0]} at t = 0")
    print(f"rank 1 killed after step {kill['step']} at t = {kill['t_kill'] - ckpt[-1][4]:.2f} s")
    print(f"checkpoint directories at the kill: {kill['published']}")
    for e in run["events"]:
        if e["type"] in ("failure", "decision", "run_start", "checkpoint"):
            what = f" rank {e['rank']} ({e['kind']})" if e["type"] == "failure" else ""
            print(f"  event {e['type']:<10} t = {e['time'] - ckpt[-1][4]:6.2f} s{what}")
    print(
        f"resumed from step {res['restored_step']}: {res['steps_recomputed']} steps recomputed, "
        f"{res['steps_since_last_checkpoint']} since the last checkpoint"
    )


if __name__ == "__main__":
    which = sys.argv[1] if len(sys.argv) > 1 else "costs"
    if which == "costs":
        costs()
    elif which == "inflight":
        inflight()
    else:
        sys.exit(f"unknown probe {which!r} (costs, inflight)")
