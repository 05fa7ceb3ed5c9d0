"""ringtrain in a Jupyter notebook, executed by a real kernel with ``nbclient`` (issue 21, item 7):
a worker's traceback through a function defined in a cell shows the cell's source line, and
running a finished run's cell again with more epochs says that it continues that run (and how to
start a fresh one) instead of resuming it silently.
"""

from __future__ import annotations

import pytest

nbformat = pytest.importorskip("nbformat", reason="pip install 'ringtrain[test]' (nbformat)")
nbclient = pytest.importorskip("nbclient", reason="pip install 'ringtrain[test]' (nbclient)")
pytest.importorskip("ipykernel", reason="pip install 'ringtrain[test]' (ipykernel)")

CELLS = [
    """
import ringtrain as rt
storage = STORAGE

def train(config):
    for epoch in range(config["epochs"]):
        rt.report({"epoch": epoch})
""",
    """
result = rt.Trainer(
    train,
    train_loop_config={"epochs": 1},
    run_config=rt.RunConfig(name="nb", storage_path=storage, progress="off"),
).fit()
print("history", len(result.metrics_history))
""",
    """
# The same cell again with more epochs: it continues the finished run, and says so.
again = rt.Trainer(
    train,
    train_loop_config={"epochs": 3},
    run_config=rt.RunConfig(name="nb", storage_path=storage, progress="off"),
).fit()
print("history", len(again.metrics_history))
""",
    """
def broken(config):
    rows = {"train": 1}
    return rows["label"]  # the line the traceback must show
""",
    """
try:
    rt.Trainer(broken, run_config=rt.RunConfig(storage_path=storage, progress="off")).fit()
except rt.TrainingFailedError as exc:
    print("FAILED", exc)
""",
]


@pytest.mark.timeout(240)
def test_notebook_cells_tracebacks_and_rerun(tmp_path):
    cells = [c.replace("STORAGE", repr(str(tmp_path / "runs"))) for c in CELLS]
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    client = nbclient.NotebookClient(
        nb, timeout=200, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    )
    client.execute()
    outputs = [
        "".join(o.get("text", "") for o in cell.outputs if o.get("output_type") == "stream")
        for cell in nb.cells
    ]
    assert outputs[1].strip() == "history 1", outputs[1]
    again = outputs[2]  # the warning is on the cell's stderr, as a user sees it
    assert "RunContinuedWarning: run 'nb' already finished" in again, again
    assert "RunConfig(name=...)" in again, again
    failed = outputs[4]
    assert "FAILED rank 0 raised KeyError: 'label'" in failed, failed
    assert 'return rows["label"]  # the line the traceback must show' in failed, failed
