"""Run Horovod's own PyTorch test module against ``ringtrain.horovod``, one test at a time.

Horovod 0.28.1's ``test/parallel/test_torch.py`` (unmodified) is the specification of
``horovod.torch``'s semantics. This script runs each of its tests on N gloo ranks, the way
``horovodrun -np N --gloo pytest test_torch.py::TorchTests::<test>`` would: N fresh processes,
each running pytest on that one test with ``HOROVOD_RANK``/``HOROVOD_SIZE`` (and the torchrun
variables) set, and ``benchmarks/horovod_shim`` first on ``PYTHONPATH`` so that ``import
horovod.torch as hvd`` binds ``ringtrain.horovod``. A test that has not finished after
``--timeout`` seconds is killed and counted as hung. A test passes when it passes on every rank,
fails when it fails (or errors) on any rank, is skipped when a rank skips it and none fails.

Horovod's tests are not in its PyPI sdist and are not vendored here: pass ``--test-dir`` (the
``test/`` folder of a Horovod checkout at v0.28.1, holding ``parallel/test_torch.py`` and
``utils/common.py``), or let the script download the two files from GitHub into ``--cache-dir``
(checked against their SHA-256 at v0.28.1)::

    git clone --depth 1 --branch v0.28.1 https://github.com/horovod/horovod /tmp/horovod
    python benchmarks/horovod_test_module.py --test-dir /tmp/horovod/test --np 2
    python benchmarks/horovod_test_module.py --np 3 -k reducescatter   # a subset
    python benchmarks/horovod_test_module.py --json /tmp/hvd2.json       # per-test results

Prints one line per test and the counts; exits 0 (the counts are the result).
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
import xml.etree.ElementTree as ET
from dataclasses import asdict, dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
SHIM = HERE / "horovod_shim"
SOURCE = "https://raw.githubusercontent.com/horovod/horovod/v0.28.1/test/"
#: The two files the module needs, with their SHA-256 at the v0.28.1 tag.
FILES = {
    "parallel/test_torch.py": "8af114f63fb7a87271322ad2da2c7050c3a9028570e45e8c44e9b1b4cac8db3a",
    "utils/common.py": "9844d1041c1e26b34657273608a51a19a94c18e0c22f9aa7971ae78189119290",
}
OUTCOMES = ("passed", "failed", "hung", "skipped")


@dataclass
class Outcome:
    """One test's result over all ranks."""

    test: str
    outcome: str  # one of OUTCOMES
    seconds: float
    reason: str = ""


def fetch_tests(cache_dir: Path) -> Path:
    """Download Horovod 0.28.1's test files into ``cache_dir`` (once); returns the test folder.

    Raises:
        RuntimeError: if a download's SHA-256 is not v0.28.1's.
    """
    for rel, digest in FILES.items():
        path = cache_dir / rel
        if path.exists() and hashlib.sha256(path.read_bytes()).hexdigest() == digest:
            continue
        with urllib.request.urlopen(SOURCE + rel, timeout=60) as response:
            body = response.read()
        got = hashlib.sha256(body).hexdigest()
        if got != digest:
            raise RuntimeError(f"{SOURCE + rel}: SHA-256 {got}, expected v0.28.1's {digest}")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(body)
    return cache_dir


def check_version(test_dir: Path) -> None:
    """Warn (stderr) when the test files are not v0.28.1's."""
    for rel, digest in FILES.items():
        path = test_dir / rel
        if not path.exists():
            raise SystemExit(f"{path} is missing: --test-dir is the test/ folder of a checkout")
        if hashlib.sha256(path.read_bytes()).hexdigest() != digest:
            print(f"warning: {path} is not Horovod v0.28.1's", file=sys.stderr)


def list_tests(module: Path) -> list[str]:
    """The ``test_*`` methods of ``TorchTests`` in ``module``, in file order."""
    tree = ast.parse(module.read_text())
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == "TorchTests":
            return [
                f.name
                for f in node.body
                if isinstance(f, ast.FunctionDef) and f.name.startswith("test_")
            ]
    raise SystemExit(f"{module}: no class TorchTests")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_env(rank: int, size: int, port: int) -> dict[str, str]:
    """What ``horovodrun --gloo`` sets for one local rank, plus the rendezvous address."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HOROVOD_", "RANK"))}
    for name in ("WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK"):
        env.pop(name, None)
    env.update(
        HOROVOD_RANK=str(rank),
        HOROVOD_SIZE=str(size),
        HOROVOD_LOCAL_RANK=str(rank),
        HOROVOD_LOCAL_SIZE=str(size),
        HOROVOD_CROSS_RANK="0",
        HOROVOD_CROSS_SIZE="1",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        PYTHONPATH=os.pathsep.join([str(SHIM), env.get("PYTHONPATH", "")]).rstrip(os.pathsep),
        OMP_NUM_THREADS="1",
        # pytest's third-party plugins (hypothesis, anyio...) cost a second per rank per test
        PYTEST_DISABLE_PLUGIN_AUTOLOAD="1",
    )
    return env


def rank_result(xml_path: Path, rc: int | None, log: str) -> tuple[str, str]:
    """One rank's ``(outcome, reason)`` from its JUnit XML (or its exit when there is none)."""
    if not xml_path.exists():
        return "failed", f"no result (exit {rc}): {log.strip().splitlines()[-1:]}"
    case = ET.parse(xml_path).getroot().find(".//testcase")
    if case is None:
        return "failed", f"no test case ran (exit {rc})"
    for tag in ("failure", "error"):
        node = case.find(tag)
        if node is not None:
            message = node.get("message") or tag
            return "failed", message.splitlines()[0][:200]
    skipped = case.find("skipped")
    if skipped is not None:
        return "skipped", (skipped.get("message") or "")[:200]
    return "passed", ""


def combine(per_rank: list[tuple[str, str]]) -> tuple[str, str]:
    """The test's outcome from each rank's: failed if any failed, else skipped if any skipped."""
    for want in ("failed", "skipped"):
        for rank, (outcome, reason) in enumerate(per_rank):
            if outcome == want:
                return want, f"rank {rank}: {reason}"
    return "passed", ""


def run_test(test_dir: Path, name: str, size: int, timeout: float, work: Path) -> Outcome:
    """Run ``TorchTests::name`` on ``size`` ranks; kill them after ``timeout`` seconds."""
    module = test_dir / "parallel" / "test_torch.py"
    port = free_port()
    started = time.monotonic()
    procs, xmls, logs = [], [], []
    for rank in range(size):
        xml_path = work / f"{name}.{rank}.xml"
        log_path = work / f"{name}.{rank}.log"
        cmd = [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-o",
            "addopts=",
            f"--rootdir={test_dir}",
            f"--junitxml={xml_path}",
            f"{module}::TorchTests::{name}",
        ]
        log = log_path.open("w")
        procs.append(
            subprocess.Popen(
                cmd,
                cwd=module.parent,
                env=rank_env(rank, size, port),
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        )
        xmls.append(xml_path)
        logs.append((log, log_path))
    deadline = started + timeout
    while time.monotonic() < deadline and any(p.poll() is None for p in procs):
        time.sleep(0.1)
    hung = any(p.poll() is None for p in procs)
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
        p.wait()
    for log, _ in logs:
        log.close()
    seconds = time.monotonic() - started
    if hung:
        return Outcome(name, "hung", seconds, f"killed after {timeout:.0f} s")
    per_rank = [
        rank_result(x, p.returncode, lp.read_text(errors="replace"))
        for x, p, (_, lp) in zip(xmls, procs, logs, strict=True)
    ]
    outcome, reason = combine(per_rank)
    return Outcome(name, outcome, seconds, reason)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--test-dir", type=Path, help="test/ of a Horovod v0.28.1 checkout")
    parser.add_argument(
        "--cache-dir",
        type=Path,
        default=Path.home() / ".cache" / "ringtrain" / "horovod-0.28.1-test",
        help="where the downloaded test files are kept (without --test-dir)",
    )
    parser.add_argument("--np", type=int, default=2, help="number of ranks (default 2)")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds per test")
    parser.add_argument("-k", default="", help="only tests whose name contains this")
    parser.add_argument(
        "--shard", default="1/1", help="K/N: run the K-th of N interleaved slices of the tests"
    )
    parser.add_argument("--json", type=Path, help="write every test's outcome here")
    parser.add_argument("--keep-logs", type=Path, help="keep each rank's pytest log here")
    args = parser.parse_args(argv)

    test_dir = args.test_dir or fetch_tests(args.cache_dir)
    check_version(test_dir)
    names = [n for n in list_tests(test_dir / "parallel" / "test_torch.py") if args.k in n]
    k, n = (int(x) for x in args.shard.split("/"))
    names = names[k - 1 :: n]
    results: list[Outcome] = []
    with tempfile.TemporaryDirectory(prefix="hvd-test-module-") as tmp:
        work = args.keep_logs or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        for name in names:
            result = run_test(test_dir, name, args.np, args.timeout, work)
            results.append(result)
            print(
                f"{result.outcome.upper():8} {name} ({result.seconds:.1f} s) {result.reason}",
                flush=True,
            )
    counts = {k: sum(r.outcome == k for r in results) for k in OUTCOMES}
    print(
        f"\n{len(results)} tests on {args.np} ranks: "
        + ", ".join(f"{counts[k]} {k}" for k in OUTCOMES)
    )
    for kind in ("failed", "hung", "skipped"):
        for r in results:
            if r.outcome == kind:
                print(f"  {kind}: {r.test}: {r.reason}")
    if args.json:
        args.json.write_text(
            json.dumps(
                {"np": args.np, "counts": counts, "tests": [asdict(r) for r in results]}, indent=1
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
