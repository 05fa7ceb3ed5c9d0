"""The sweep's final summary when its output is not a terminal (``| tee``, CI): the title is one
line and the table keeps its rows whole (issue 40: it broke mid-sentence at 80 columns); a
minimising sweep's best-of-any-round column is not called "peak"."""

from __future__ import annotations

import io

from ringtrain.tune.progress import SweepDisplay, TrialRow


def _display(mode: str) -> tuple[SweepDisplay, io.StringIO]:
    out = io.StringIO()
    columns = ["train_loop_config/model/width", "train_loop_config/lr"]
    display = SweepDisplay(
        "seed001_grid_search_sweep", "validation_loss", mode, columns, "plain", stream=out, total=3
    )
    for n, (lr, last, best) in enumerate([(1e-3, 0.51, 0.5), (1e-4, 0.72, 0.7), (1e-5, 0.93, 0.9)]):
        display.add(
            TrialRow(
                n,
                {columns[0]: 256, columns[1]: lr},
                "COMPLETE",
                3,
                last,
                best,
                started=0.0,
                ended=12.5,
            )
        )
    return display, out


def test_a_piped_summary_keeps_its_title_and_rows_on_one_line_each():
    display, out = _display("min")
    display.summary()
    lines = out.getvalue().splitlines()
    title = "seed001_grid_search_sweep finished: 3 complete, best trial 0000: validation_loss=0.51"
    assert title in lines, out.getvalue()
    header = next(line for line in lines if "trial" in line and "status" in line)
    assert "train_loop_config/model/width" in header and "lowest validation_loss" in header
    assert "peak" not in out.getvalue()
    for n in range(3):
        row = [line for line in lines if line.strip("│┃ ").startswith(f"{n:04d}")]
        assert len(row) == 1 and "COMPLETE" in row[0] and "12.5s" in row[0], out.getvalue()
