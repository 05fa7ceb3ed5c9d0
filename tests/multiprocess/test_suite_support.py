"""The suite's own help for hangs (tests/conftest.py): shortly before pytest-timeout fails a test,
every ringtrain worker under the pytest process is sent SIGUSR2 and prints its stacks, which its
driver forwards into the test's captured output. Checked here on a real run: the workers' stacks
arrive, and no other process (the zygote, the store, the reapers) is signalled or ended by it."""

from __future__ import annotations

import threading

import hygiene_workloads
from support import dump_worker_stacks, wait_until

FRAME = "_waiting_for_the_test"  # the function each worker waits in


def test_a_stack_dump_reaches_every_worker_and_ends_nothing(tmp_path, run_job, capfd):
    marker_dir = tmp_path / "pids"
    marker_dir.mkdir()
    signalled: list[int] = []
    seen: list[str] = []

    def captured() -> str:
        out, err = capfd.readouterr()
        seen.append(out + err)
        return "".join(seen)

    def dump_then_release() -> None:
        try:
            wait_until(lambda: len(list(marker_dir.glob("rank*.pid"))) == 3, timeout_s=120)
            signalled.extend(dump_worker_stacks())
            # The workers print, their driver forwards; then they may leave that frame.
            wait_until(lambda: captured().count(FRAME) >= 3, timeout_s=60)
        finally:
            (marker_dir / "release").touch()

    helper = threading.Thread(target=dump_then_release, daemon=True)
    helper.start()
    result = run_job(hygiene_workloads.stack_dump_fn, 3, train_loop_config={"dir": str(marker_dir)})
    helper.join(timeout=60)
    text = captured()

    assert result.error is None and result.failures == []
    workers = {int(p.read_text()) for p in marker_dir.glob("rank*.pid")}
    assert set(signalled) == workers  # the workers, and nothing else under this process
    for rank in range(3):  # each rank's own stack, forwarded with its rank
        assert f"(rank {rank})   File" in text and f"in {FRAME}" in text, text[-3000:]
        lines = [line for line in text.splitlines() if line.startswith(f"(rank {rank})")]
        assert any(FRAME in line for line in lines), text[-3000:]
