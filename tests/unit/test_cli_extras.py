"""A subcommand whose extra is missing says which extra to install, in one line, before it
runs anything (issue 40). The real base install, without any extra, is
tests/e2e/test_base_install.py."""

from __future__ import annotations

import sys

import pytest

from ringtrain import cli


def test_tune_without_optuna_names_the_extra(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "optuna", None)  # `import optuna` fails
    for name in [
        m for m in sys.modules if m == "ringtrain.tune" or m.startswith("ringtrain.tune.")
    ]:
        monkeypatch.delitem(sys.modules, name)
    script = tmp_path / "sweep.py"
    script.write_text("train_fn = param_space = tune_config = None\n")
    with pytest.raises(SystemExit) as exit_:
        cli.main(["tune", str(script)])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("ringtrain tune: ringtrain.tune needs Optuna") and err.count("\n") == 1
    assert "pip install 'ringtrain[tune]'" in err
    with pytest.raises(SystemExit) as exit_:
        cli.main(["tune", "--resume", str(tmp_path / "runs" / "sweep")])
    assert exit_.value.code == 2
    assert "pip install 'ringtrain[tune]'" in capsys.readouterr().err
