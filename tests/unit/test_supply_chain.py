"""What CI installs is pinned, and known-malicious releases can never be installed (issue 40).

``lightning`` and ``pytorch-lightning`` 2.6.2 and 2.6.3 on PyPI were malicious
(GHSA-w37p-236h-pfx3: a credential stealer that runs on ``import lightning``): every extra
that names them excludes those versions. CI (and the README's test command) install with
``-c constraints.txt``, which pins every package of ``ringtrain[test]``'s dependency closure,
so a new release enters a build only by a change to that file.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest
from packaging.requirements import Requirement

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11

ROOT = Path(__file__).resolve().parents[2]
MALICIOUS = {"lightning": ("2.6.2", "2.6.3"), "pytorch-lightning": ("2.6.2", "2.6.3")}


def _lock_module():
    spec = importlib.util.spec_from_file_location("ringtrain_ci_lock", ROOT / ".ci" / "lock.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _pins() -> dict[str, str]:
    pins: dict[str, str] = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            assert version, f"constraints.txt: {line!r} is not an exact pin (name==version)"
            pins[re.sub(r"[-_.]+", "-", name).lower()] = version
    return pins


def test_no_extra_admits_a_malicious_lightning_release():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    named: dict[str, list[str]] = {}
    for extra, requirements in extras.items():
        for line in requirements:
            req = Requirement(line)
            name = re.sub(r"[-_.]+", "-", req.name).lower()
            if name in MALICIOUS:
                named.setdefault(name, []).append(extra)
                for bad in MALICIOUS[name]:
                    assert not req.specifier.contains(bad, prereleases=True), (
                        f"pyproject.toml extra {extra!r}: {line!r} admits {name} {bad}, a "
                        f"malicious release (GHSA-w37p-236h-pfx3); add !={bad}"
                    )
    assert set(named) == set(MALICIOUS), named  # both packages are named (and so checked)
    assert "test" in named["pytorch-lightning"]  # `import pytorch_lightning as pl` is tested


def test_constraints_pin_every_installed_dependency_and_no_malicious_release():
    pins = _pins()
    assert "ringtrain" not in pins and "torch" not in pins  # torch: whichever build suits
    for name, bad in MALICIOUS.items():
        assert pins.get(name) not in bad, f"constraints.txt pins {name}=={pins[name]}"
    installed = _lock_module().closure()
    stale = {
        name: (pins.get(name), version)
        for name, version in installed.items()
        if name not in ("ringtrain", "torch") and pins.get(name) != version
    }
    assert not stale, (
        f"constraints.txt does not pin these installed packages of ringtrain[test] (pinned, "
        f"installed): {stale}; regenerate it with `python .ci/lock.py > constraints.txt` "
        f"(see .ci/lock.py)"
    )


def test_ci_and_the_readme_install_with_the_constraints():
    command = 'pip install -c constraints.txt -e ".[test]"'
    assert command in (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    assert command.replace("pip install", "pip install -q --no-compile") in ci
