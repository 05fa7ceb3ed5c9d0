"""State sent between ranks without a pickle (``cluster.distributed.broadcast_state``): the
elastic snapshot a joining worker or a hot spare receives, FSDP shards, DiLoCo's global state.
gloo's connections are not authenticated, so a rank must never unpickle what arrives: a payload
that would run code is refused, and nothing runs."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

from support import run_torchrun_style

HERE = Path(__file__).resolve().parents[1]


def test_state_round_trips_and_a_pickle_that_runs_code_is_refused(tmp_path):
    world_size = 3  # the sub-group (ranks 1 and 2) numbers its ranks 0 and 1
    marker = tmp_path / "ran"
    outs = run_torchrun_style(
        [str(HERE / "state_wire_ranks.py"), str(marker)],
        world_size,
        timeout_s=120,
        pythonpath=[str(HERE)],
    )
    ranks = [json.loads(out.strip().splitlines()[-1]) for out in outs]
    assert [r["round_trip"] for r in ranks] == [True] * world_size
    assert [r.get("sub_group") for r in ranks[-2:]] == [world_size - 1] * 2
    for r in ranks[1:]:
        assert r["hostile"].startswith("refused: "), r
    assert not any(r["marker"] for r in ranks) and not marker.exists()
    # The same bytes do run code when unpickled: the refusal is what kept the marker away.
    from state_wire_ranks import Payload

    pickle.loads(pickle.dumps(Payload(str(marker))))
    assert marker.exists()
