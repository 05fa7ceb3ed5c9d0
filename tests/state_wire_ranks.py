"""Ranks for tests/multiprocess/test_state_wire.py (started with torchrun's environment):
``cluster.distributed.broadcast_state`` round trips and refuses a pickle that would run code.
Prints one JSON line with what each check saw."""

from __future__ import annotations

import io
import json
import os
import pickle
import sys

import torch
import torch.distributed as dist

from ringtrain.cluster.distributed import broadcast_state
from ringtrain.worker.state_files import capture_rng


class Payload:
    """A pickle that runs code when loaded: creates the file ``path``."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def main() -> None:
    marker = sys.argv[1]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    seen: dict[str, object] = {"rank": rank}

    # A TrainState-like payload: tensors, tuples, a dict with int keys, RNG states.
    torch.manual_seed(7)
    payload = {
        "model": {"w": torch.arange(6.0).reshape(2, 3), "b": torch.tensor([1.5])},
        "optimizer": {"state": {0: {"momentum_buffer": torch.ones(3)}}, "param_groups": []},
        "rng": capture_rng(),
        "position": (3, 17, None),
        "empty": torch.empty(0),
    }
    got = broadcast_state(payload if rank == 0 else None, 0)
    same = (
        torch.equal(got["model"]["w"], payload["model"]["w"])
        and torch.equal(got["optimizer"]["state"][0]["momentum_buffer"], torch.ones(3))
        and got["position"] == (3, 17, None)
        and torch.equal(got["rng"]["torch"], payload["rng"]["torch"])
        and got["empty"].numel() == 0
    )
    seen["round_trip"] = same

    # From the last rank, on a sub-group of the last two ranks (the group's own numbering).
    pair = dist.new_group([world - 2, world - 1])
    if rank >= world - 2:
        got = broadcast_state({"from": rank} if rank == world - 1 else None, 1, pair)
        seen["sub_group"] = got["from"]

    # Rank 0 plays an attacker on the wire: the two broadcasts carry a pickle that runs code.
    if rank == 0:
        buffer = io.BytesIO()
        pickle.dump(Payload(marker), buffer)
        data = buffer.getvalue()
        dist.broadcast(torch.tensor([len(data)], dtype=torch.int64), src=0)
        dist.broadcast(torch.frombuffer(bytearray(data), dtype=torch.uint8), src=0)
    else:
        try:
            broadcast_state(None, 0)
            seen["hostile"] = "loaded"
        except pickle.UnpicklingError as exc:
            seen["hostile"] = f"refused: {str(exc).splitlines()[0][:80]}"
    seen["marker"] = os.path.exists(marker)
    dist.barrier()
    dist.destroy_process_group()
    print(json.dumps(seen))


if __name__ == "__main__":
    main()
