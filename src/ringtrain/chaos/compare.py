"""Compare two runs' checkpoints tensor by tensor and say where they first differ.

Both runs checkpoint at the same report rounds, so round ``r`` of the faulty run must equal round
``r`` of the clean run, bit for bit (``torch.equal``), in every file: the model's parameters and
buffers, the optimizer's state and param groups, the LR scheduler, the gradient scaler, the
step and epoch counters and extras (``train_state.pt``), and each rank's RNG streams and data
position (``rank_NNNNN.pt``). The first round that differs, and the resume that preceded it in the
faulty run (from its ``events.jsonl``), localise a divergence.

Only files listed in a checkpoint's manifest are read, after the manifest has checked their size
and SHA-256, and ``.pt`` files are loaded with ``torch.load(weights_only=True)``: nothing in a
run directory is unpickled.
"""

from __future__ import annotations

import io
import os
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from ringtrain.checkpoint import storage
from ringtrain.rundir.reader import run_events
from ringtrain.rundir.schema import CheckpointEvent, ResumeEvent, RunStartEvent

STATE_FILE = (
    "train_state.pt"  # ringtrain.worker.state.STATE_FILE (not imported: no torch model code)
)


@dataclass(frozen=True)
class Difference:
    """Where two runs first differ.

    Attributes:
        round: the report round of the first checkpoint that differs (None: the checkpoint
            lists differ).
        checkpoint: that checkpoint's directory name.
        step: its ``TrainState.step`` in the clean run (None when unknown).
        last_equal_step: the step of the last checkpoint that was still equal (None: none).
        what: which state differs, e.g. ``optimizer state of param 3 (momentum_buffer)``.
        context: which attempt of the faulty run wrote that checkpoint, and from what it resumed.
    """

    round: int | None
    checkpoint: str | None
    step: int | None
    last_equal_step: int | None
    what: str
    context: str

    def message(self) -> str:
        """One sentence: what differs, from which step, after which resume."""
        if self.round is None:
            return self.what
        since = f"from step {self.step}" if self.step is not None else f"at {self.checkpoint}"
        equal = (
            f"; step {self.last_equal_step} was equal" if self.last_equal_step is not None else ""
        )
        return f"{self.what} differs {since} ({self.checkpoint}{equal}): {self.context}"


def list_checkpoints(run_path: str) -> dict[int, str]:
    """``{round: path}`` of the published checkpoints of a local run directory."""
    found = {}
    for name in os.listdir(run_path):
        round_ = storage.parse_round(name)
        if round_ is not None and os.path.isdir(os.path.join(run_path, name)):
            found[round_] = os.path.join(run_path, name)
    return dict(sorted(found.items()))


def load_checkpoint(path: str) -> dict[str, Any]:
    """Every file a checkpoint's manifest lists: ``.pt`` files loaded (weights only), others as
    their SHA-256.

    Raises:
        ValueError: when the manifest is missing or does not match the files, or lists a path
            outside the checkpoint directory.
    """
    import torch
    from fsspec.implementations.local import LocalFileSystem

    fs = LocalFileSystem()
    manifest = storage.read_manifest(fs, path, verify_checksums=True)
    # Where the storage module reads a file once and checks those bytes against the manifest
    # (signed manifests, docs/security.md), use it: no gap between the check and the load.
    read_verified = getattr(storage, "read_verified", None)
    root = os.path.realpath(path)
    files: dict[str, Any] = {}
    for rel, info in sorted(manifest["files"].items()):
        full = os.path.realpath(os.path.join(root, rel))
        if os.path.commonpath([root, full]) != root:
            raise ValueError(f"{path}: manifest lists {rel!r}, outside the checkpoint")
        if not rel.endswith((".pt", ".pth")):
            files[rel] = {"sha256": info.get("sha256")}
        elif read_verified is not None:
            data = read_verified(fs, path, rel, info)
            files[rel] = torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")
        else:
            files[rel] = torch.load(full, weights_only=True, map_location="cpu")
    return files


def checkpoint_step(files: dict[str, Any]) -> int | None:
    """The ``TrainState.step`` a loaded checkpoint holds (None: not a TrainState)."""
    state = files.get(STATE_FILE)
    if isinstance(state, dict) and isinstance(state.get("step"), int):
        return int(state["step"])
    return None


def first_difference(a: Any, b: Any, path: tuple[Any, ...] = ()) -> tuple[Any, ...] | None:
    """The path (keys and indices) of the first place where ``a`` and ``b`` differ, or None.
    Tensors must have the same dtype, shape and bits (NaNs in the same places)."""
    import torch

    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return None if _same_tensor(a, b) else path
    if isinstance(a, dict) and isinstance(b, dict):
        if list(a) != list(b) and set(a) != set(b):
            return (*path, "<keys>")
        return _first_of((a[key], b[key], (*path, key)) for key in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return (*path, "<length>")
        return _first_of(((x, y, (*path, i)) for i, (x, y) in enumerate(zip(a, b, strict=True))))
    if type(a) is not type(b):
        return path
    if isinstance(a, float) and a != a and b != b:
        return None  # both NaN
    return None if a == b else path


def _first_of(pairs: Iterable[tuple[Any, Any, tuple[Any, ...]]]) -> tuple[Any, ...] | None:
    """The first difference among ``(a, b, path)`` pairs, in order (lazily: stops at it)."""
    for a, b, path in pairs:
        found = first_difference(a, b, path)
        if found is not None:
            return found
    return None


def _same_tensor(a: Any, b: Any) -> bool:
    """Both tensors, of the same dtype, shape and bits (NaNs in the same places)."""
    import torch

    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
        return False
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if torch.equal(a, b):
        return True
    if a.is_floating_point() or a.is_complex():
        same_nan = torch.equal(torch.isnan(a), torch.isnan(b))
        return same_nan and torch.equal(torch.nan_to_num(a), torch.nan_to_num(b))
    return False


def describe(file: str, path: tuple[Any, ...]) -> str:
    """A difference's path in words: ``optimizer state of param 3 (momentum_buffer)``."""
    p = list(path)
    if file == STATE_FILE:
        if p[:1] == ["objects"] and len(p) >= 2:
            name, rest = p[1], p[2:]
            if name == "model":
                return f"model parameter {rest[0]}" if rest else "model state"
            if name == "optimizer":
                if rest[:1] == ["state"] and len(rest) >= 2:
                    key = f" ({rest[2]})" if len(rest) >= 3 else ""
                    return f"optimizer state of param {rest[1]}{key}"
                if rest[:1] == ["param_groups"]:
                    key = f" ({rest[2]})" if len(rest) >= 3 else ""
                    return f"optimizer param group {rest[1] if len(rest) > 1 else ''}{key}"
                return "optimizer state"
            if name == "lr_scheduler":
                return "LR scheduler" + (f" ({rest[0]})" if rest else "")
            if name == "grad_scaler":
                return "gradient scaler" + (f" ({rest[0]})" if rest else "")
            return f"{name} state" + (f" ({_join(rest)})" if rest else "")
        if p[:1] == ["extras"] and len(p) >= 2:
            return f"extra {p[1]!r}"
        if p[:1] in (["step"], ["epoch"]):
            return f"{p[0]} counter"
        return f"{STATE_FILE} {_join(p)}"
    if file.startswith("rank_") and file.endswith(".pt"):
        rank = int(file[5:-3]) if file[5:-3].isdigit() else file
        if p[:1] == ["rng"]:
            kind = f" ({p[1]})" if len(p) >= 2 else ""
            return f"RNG state of rank {rank}{kind}"
        if p[:1] == ["data_loader"]:
            return f"data loader position of rank {rank}"
        if p[:1] == ["model_rank_state"]:
            return f"per-rank model state of rank {rank}" + (f" ({p[1]})" if len(p) > 1 else "")
        return f"{file} {_join(p)}"
    return f"file {file}" + (f" {_join(p)}" if p else "")


def _join(path: list[Any]) -> str:
    return "".join(f"[{k!r}]" for k in path)


def compare_checkpoints(a: dict[str, Any], b: dict[str, Any]) -> str | None:
    """In words, the first state that differs between two loaded checkpoints, or None."""
    if set(a) != set(b):
        only = sorted(set(a) ^ set(b))
        return f"the files of the checkpoint ({', '.join(only)} in one run only)"
    ordered = sorted(a, key=lambda n: (n != STATE_FILE, n))  # shared state first, then ranks
    for name in ordered:
        found = first_difference(a[name], b[name])
        if found is not None:
            return describe(name, found)
    return None


def writers_of(run_path: str) -> dict[int, dict[str, Any]]:
    """For each checkpoint round of a run, which attempt wrote it: ``{"attempt", "world_size",
    "resumed_from" (checkpoint name or None), "first_after_resume" (bool), "driver_restarts"}``,
    from the run's ``events.jsonl``."""
    out: dict[int, dict[str, Any]] = {}
    current: dict[str, Any] = {"attempt": 0, "world_size": None, "resumed_from": None}
    drivers = -1
    fresh = False
    for ev in run_events(run_path):
        match ev:
            case ResumeEvent():
                current["resumed_from"] = os.path.basename((ev.checkpoint or "").rstrip("/"))
                fresh = True
            case RunStartEvent():
                if ev.attempt == 0:
                    drivers += 1  # every driver (a resumed one too) starts at attempt 0
                current["attempt"] = ev.attempt if ev.attempt is not None else 0
                current["world_size"] = ev.world_size
                if not fresh:
                    current["resumed_from"] = None
                fresh = False
                current["first"] = True
            case CheckpointEvent(round=int(round_)):
                out[round_] = {
                    "attempt": current["attempt"],
                    "world_size": current["world_size"],
                    "resumed_from": current["resumed_from"],
                    "first_after_resume": bool(current.get("first")),
                    "driver_restarts": max(drivers, 0),
                }
                current["first"] = False
    return out


def context_of(writer: dict[str, Any] | None) -> str:
    """``the first checkpoint after resuming from checkpoint_000001 at world size 3 ...``."""
    if writer is None:
        return "written by an attempt not recorded in events.jsonl"
    ws = writer.get("world_size")
    at = f" at world size {ws}" if ws else ""
    attempt = f"attempt {writer['attempt']}"
    if writer["driver_restarts"]:
        attempt += f" of driver {writer['driver_restarts'] + 1}"
    if writer["resumed_from"] is None:
        return (
            f"written by {attempt}{at} before any resume: the training is not reproducible by "
            "itself (seed random, numpy and torch at the start of train_fn; keep every other "
            "generator in the TrainState; no clock or unordered data)"
        )
    first = "the first checkpoint" if writer["first_after_resume"] else "a checkpoint"
    return f"{first} after resuming from {writer['resumed_from']}{at} ({attempt})"


def compare_runs(clean_path: str, faulty_path: str) -> Difference | None:
    """None when every checkpoint of the faulty run equals the clean run's of the same round;
    otherwise the first :class:`Difference`."""
    clean, faulty = list_checkpoints(clean_path), list_checkpoints(faulty_path)
    if not clean:
        raise ValueError(f"{clean_path}: the clean run has no checkpoint to compare with")
    extra = sorted(set(faulty) - set(clean))
    missing = sorted(set(clean) - set(faulty))
    writers = writers_of(faulty_path)
    last_equal: int | None = None
    for round_, path in clean.items():
        if round_ not in faulty:
            continue  # a round whose checkpoint is absent is judged below, if it is the last
        a, b = load_checkpoint(path), load_checkpoint(faulty[round_])
        what = compare_checkpoints(a, b)
        step = checkpoint_step(a)
        if what is not None:
            return Difference(
                round_,
                os.path.basename(path),
                step,
                last_equal,
                what,
                context_of(writers.get(round_)),
            )
        last_equal = step if step is not None else last_equal
    if missing or extra:
        names = [storage.checkpoint_dirname(r) for r in missing]
        more = [storage.checkpoint_dirname(r) for r in extra]
        what = "the checkpoints differ: " + "; ".join(
            part
            for part in (
                f"the faulty run lacks {', '.join(names)}" if names else "",
                f"only the faulty run has {', '.join(more)}" if more else "",
            )
            if part
        )
        return Difference(None, None, None, last_equal, what, "")
    return None
