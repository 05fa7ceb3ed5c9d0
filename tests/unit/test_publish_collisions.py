"""Two ranks writing a checkpoint file of the same name (issue 40): the same bytes (replicas'
identical state, Ray's ``Checkpoint.from_dict`` on every rank) are one file and no note; other
bytes get the "last write wins" note once per run, not every round."""

from __future__ import annotations

import fsspec

from ringtrain.controller.effects import Show
from ringtrain.controller.rounds import Publisher


class Messages:
    """The display lines among the effects the publisher returned."""

    def __init__(self) -> None:
        self.effects: list = []

    @property
    def lines(self) -> list[str]:
        return [e.args[0] for e in self.effects if isinstance(e, Show) and e.method == "message"]


class Staging:
    """The CheckpointManager part that _merge_files uses: where round r is staged."""

    def __init__(self, root) -> None:
        self.root = root

    def staging_path(self, round_: int):
        return fsspec.filesystem("file"), str(self.root / f"r{round_}")


ABC = "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"  # sha256(b"abc")


def _files(sha: str) -> tuple[str, dict]:
    return ("files", {"state.pt": {"size": 3, "sha256": sha}})


def test_identical_files_say_nothing_and_different_ones_say_it_once(tmp_path):
    progress = Messages()
    publisher = Publisher(Staging(tmp_path))  # type: ignore[arg-type]
    for round_ in range(3):
        (tmp_path / f"r{round_}").mkdir()
        (tmp_path / f"r{round_}" / "state.pt").write_bytes(b"abc")
        outcomes = {0: _files(ABC), 1: _files(ABC)}
        same = publisher._merge_files(round_, {0, 1}, outcomes, progress.effects)
        assert same["state.pt"]["sha256"] == ABC
    assert progress.lines == []
    for round_ in range(3):
        outcomes = {0: _files("b" * 64), 1: _files(ABC)}
        files = publisher._merge_files(round_, {0, 1}, outcomes, progress.effects)
        assert files["state.pt"]["sha256"] == ABC  # what is on storage: the last write
    assert len(progress.lines) == 1, progress.lines
    assert (
        "ranks 0 and 1 both wrote checkpoint file 'state.pt' with different contents"
        in (progress.lines[0])
    )
    assert "said once per run" in progress.lines[0]
