"""What the driver of ``ringtrain run SCRIPT`` does with the script's own ``RunConfig``
(:func:`ringtrain.controller.script_settings.adopt`, issue 40); end to end in
tests/e2e/test_run_script_config.py."""

from __future__ import annotations

import ringtrain as rt
from ringtrain.controller.script_settings import adopt

URI = "/runs/script_2026-01-01_00-00-00"


def _adopt(cli: rt.CheckpointConfig, max_failures: int, script: rt.RunConfig, callbacks=()):
    return adopt(
        cli, max_failures, script, run_name=URI.rsplit("/", 1)[1], run_uri=URI, callbacks=callbacks
    )


def test_what_the_command_line_left_at_its_default_takes_the_scripts_value():
    script = rt.RunConfig(
        checkpoint_config=rt.CheckpointConfig(
            num_to_keep=2, checkpoint_score_attribute="val_loss", checkpoint_score_order="min"
        ),
        failure_config=rt.FailureConfig(max_failures=3),
    )
    a = _adopt(rt.CheckpointConfig(), 0, script)
    assert (a.checkpoint_config.num_to_keep, a.checkpoint_config.checkpoint_score_attribute) == (
        2,
        "val_loss",
    )
    assert a.checkpoint_config.checkpoint_score_order == "min" and a.max_failures == 3
    assert a.notes == [
        "the script's RunConfig applies: num_to_keep=2, checkpoint_score_attribute='val_loss', "
        "checkpoint_score_order='min', max_failures=3"
    ]


def test_a_flag_given_on_the_command_line_wins_and_says_so():
    script = rt.RunConfig(checkpoint_config=rt.CheckpointConfig(num_to_keep=2))
    a = _adopt(rt.CheckpointConfig(num_to_keep=5), 1, script)
    assert a.checkpoint_config.num_to_keep == 5 and a.max_failures == 1
    assert a.notes == ["ringtrain run's --num-to-keep 5 overrides the script's num_to_keep=2"]


def test_a_default_run_config_says_nothing_and_the_run_directory_is_named():
    assert _adopt(rt.CheckpointConfig(num_to_keep=3), 2, rt.RunConfig()).notes == []
    a = _adopt(rt.CheckpointConfig(), 0, rt.RunConfig(name="mnist"), callbacks=("Logger()",))
    assert a.checkpoint_config == rt.CheckpointConfig() and len(a.notes) == 2
    assert a.notes[0].startswith(
        f"the script's RunConfig(name='mnist') does not apply under ringtrain run: the run "
        f"directory is {URI}"
    )
    assert "RunConfig(callbacks=[Logger()]) does not apply" in a.notes[1]


def test_every_other_setting_the_script_gives_is_said_not_read():
    script = rt.RunConfig(
        progress="plain",
        failure_config=rt.FailureConfig(worker_timeout_s=60, preemption_grace_s=5),
    )
    a = _adopt(rt.CheckpointConfig(), 0, script)
    (note,) = a.notes
    assert note.startswith(
        "the script's RunConfig(progress='plain', failure_config.worker_timeout_s=60, "
        "failure_config.preemption_grace_s=5) is not read under ringtrain run"
    ), note
    assert "(ringtrain run's --progress, --worker-timeout)" in note
    sources = adopt(
        rt.CheckpointConfig(), 0, rt.RunConfig(), run_name="r", run_uri="/runs/r",
        notice_sources=("FileNotice('/flag')",),
    ).notes  # fmt: skip
    assert sources and "failure_config.notice_sources=[FileNotice('/flag')]" in sources[0]
