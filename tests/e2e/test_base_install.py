"""The ``ringtrain`` command on the base install, without any optional extra (issue 40).

A real, fresh virtual environment (not ``--system-site-packages``: that would see the test
extra's Optuna, Ray, Lightning, ...) gets torch and ``pip install -c constraints.txt -e .``, the
base dependencies only, as a user who follows the README's first command gets. Every
subcommand must work there, and the ones that need an extra must say which one in a line.
torch is this environment's own, linked (:func:`_link_torch`: its folders only, the same
wheel, already compiled); pip installs everything else the base install needs, so the test
still proves that the base dependency list is enough. An import blocker inside the test
environment would be cheaper, but it would only prove what it blocks.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# Every package an extra brings (pyproject.toml): none may be importable in the base venv.
EXTRAS = (
    "optuna",
    "ray",
    "lightning",
    "pytorch_lightning",
    "deepspeed",
    "matplotlib",
    "mlflow",
    "wandb",
    "safetensors",
    "scipy",
)

SCRIPT = textwrap.dedent(
    """
    import torch
    import torch.nn.functional as F
    from torch.utils.data import DataLoader, TensorDataset
    import ringtrain as rt

    model = rt.prepare_model(torch.nn.Linear(8, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = TensorDataset(torch.randn(64, 8), torch.randint(0, 2, (64,)))
    loader = rt.prepare_data_loader(DataLoader(data, batch_size=8))
    for x, y in loader:
        loss = F.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    rt.report({"loss": loss.item()})
    """
)

SWEEP = textwrap.dedent(
    """
    from ringtrain import tune

    def train_fn(config):
        pass

    param_space = {"lr": tune.loguniform(1e-4, 1e-1)}
    tune_config = tune.TuneConfig(metric="loss", mode="min")
    """
)

# Imports every module of the package: each must import, or fail for want of an extra's
# package; the faces that need an extra must name it (``pip install 'ringtrain[...]'``).
IMPORT_ALL = textwrap.dedent(
    """
    import importlib, json, pkgutil, sys
    import ringtrain

    failed = {}
    for info in pkgutil.walk_packages(ringtrain.__path__, "ringtrain."):
        if info.name.endswith("__main__"):
            continue  # runs the command
        try:
            importlib.import_module(info.name)
        except ImportError as exc:
            failed[info.name] = [getattr(exc, "name", None), str(exc)]
    json.dump(failed, sys.stdout)
    """
)


def _link_torch(venv: Path) -> None:
    """Make this environment's torch (its package folders and its dist-info) visible in
    ``venv`` through a ``.pth`` file of links: the same installed wheel, and its modules already
    compiled, instead of unpacking and compiling 800 MB again. Only torch's own top-level
    folders are linked, none of the test environment's other packages; pip then sees torch
    installed and installs what it requires itself."""
    dist = importlib.metadata.distribution("torch")
    farm = venv.parent / "torch-links"
    farm.mkdir()
    tops = {Path(str(f)).parts[0] for f in dist.files or () if not str(f).startswith("..")}
    for top in sorted(tops):
        (farm / top).symlink_to(Path(str(dist.locate_file(top))))
    site = subprocess.run(
        [
            str(venv / "bin" / "python"),
            "-c",
            "import sysconfig; print(sysconfig.get_path('purelib'))",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    (Path(site) / "torch-links.pth").write_text(f"{farm}\n")


@pytest.fixture(scope="module")
def base_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    venv = tmp_path_factory.mktemp("base") / "venv"
    # --no-compile: Python compiles what is imported when it is first imported, a fraction of
    # the files (compiling all of them at install took longer than the test itself).
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--no-compile"]
    done = subprocess.run([sys.executable, "-m", "venv", str(venv)], capture_output=True)
    assert done.returncode == 0, done
    _link_torch(venv)  # the README's `pip install torch==...`, from this environment's wheel
    command = [*pip, "-c", str(ROOT / "constraints.txt"), "-e", str(ROOT)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"{command}: {done.stdout}\n{done.stderr}"
    return venv


def _run(venv: Path, *args: str, cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RINGTRAIN_", "PYTHON"))}
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    return subprocess.run(
        [str(venv / "bin" / args[0]), *args[1:]],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.timeout(900)
def test_every_command_works_without_the_extras(base_venv: Path, tmp_path: Path) -> None:
    found = _run(
        base_venv,
        "python",
        "-c",
        f"import importlib.util; print([m for m in {EXTRAS!r} if importlib.util.find_spec(m)])",
        cwd=tmp_path,
    )
    assert found.stdout.strip() == "[]", found  # the environment really has no extra

    helped = _run(base_venv, "ringtrain", "--help", cwd=tmp_path)
    assert helped.returncode == 0 and "ringtrain run -n 2" in helped.stdout, helped
    for command in ("run", "ls", "show", "bench", "dashboard", "export", "tune", "chaos"):
        sub = _run(base_venv, "ringtrain", command, "--help", cwd=tmp_path)
        assert sub.returncode == 0 and "usage: ringtrain" in sub.stdout, (command, sub)

    imported = _run(base_venv, "python", "-c", IMPORT_ALL, cwd=tmp_path)
    assert imported.returncode == 0, imported
    failed = json.loads(imported.stdout)
    for module, (missing, message) in failed.items():
        assert (missing or "").split(".")[0] in EXTRAS or "pip install 'ringtrain[" in message, (
            f"{module} does not import on the base install: {message}"
        )
    for face, extra in (
        ("ringtrain.tune", "tune"),
        ("ringtrain.integrations.lightning", "lightning"),
        ("ringtrain.integrations.pytorch_lightning", "lightning"),
        ("ringtrain.train.lightning", "lightning"),
    ):
        assert f"pip install 'ringtrain[{extra}]'" in failed[face][1], (face, failed[face])

    (tmp_path / "sweep.py").write_text(SWEEP)
    tuned = _run(base_venv, "ringtrain", "tune", "sweep.py", cwd=tmp_path)
    assert tuned.returncode == 2, tuned
    assert "Traceback" not in tuned.stderr and len(tuned.stderr.strip().splitlines()) == 1, tuned
    assert "pip install 'ringtrain[tune]'" in tuned.stderr, tuned

    (tmp_path / "train.py").write_text(SCRIPT)
    ran = _run(base_venv, "ringtrain", "run", "-n", "2", "--name", "base", "train.py", cwd=tmp_path)
    assert ran.returncode == 0 and "FINISHED" in ran.stdout + ran.stderr, ran
    listed = _run(base_venv, "ringtrain", "ls", cwd=tmp_path)
    assert listed.returncode == 0 and re.search(r"base\s+FINISHED", listed.stdout), listed
    shown = _run(base_venv, "ringtrain", "show", "runs/base", cwd=tmp_path)
    assert shown.returncode == 0 and "loss" in shown.stdout, shown

    _dashboard_serves(base_venv, tmp_path)


def _dashboard_serves(venv: Path, cwd: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RINGTRAIN_", "PYTHON"))}
    proc = subprocess.Popen(
        [str(venv / "bin" / "ringtrain"), "dashboard", "runs", "--port", "0"],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        assert proc.stdout is not None
        first = proc.stdout.readline()
        url = re.search(r"http://127\.0\.0\.1:\d+/", first)
        assert url, first
        with urllib.request.urlopen(url.group(0), timeout=30) as page:
            assert page.status == 200
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
