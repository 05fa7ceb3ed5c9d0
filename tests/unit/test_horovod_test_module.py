"""``benchmarks/horovod_test_module.py``'s bookkeeping on synthetic inputs: which tests it finds
in a test module, how it reads one rank's JUnit XML, and how the ranks' outcomes combine into
the test's. (Running Horovod's module itself takes minutes; its figure is in
docs/benchmarks.md, "Horovod's own test module".)"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]


def _runner() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "horovod_test_module_under_test", ROOT / "benchmarks" / "horovod_test_module.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


runner = _runner()


def test_lists_the_test_methods_of_torchtests_in_file_order(tmp_path):
    module = tmp_path / "test_torch.py"
    module.write_text(
        "class Other:\n    def test_not_this(self): pass\n"
        "class TorchTests:\n"
        "    def setup(self): pass\n"
        "    def test_b(self): pass\n"
        "    def test_a(self): pass\n"
    )
    assert runner.list_tests(module) == ["test_b", "test_a"]


def _junit(path: Path, body: str) -> Path:
    path.write_text(
        f'<testsuites><testsuite><testcase name="t">{body}</testcase></testsuite></testsuites>'
    )
    return path


def test_reads_a_ranks_outcome_from_its_junit_xml(tmp_path):
    passed = _junit(tmp_path / "p.xml", "")
    failed = _junit(tmp_path / "f.xml", '<failure message="AssertionError: 1 != 2&#10;more"/>')
    skipped = _junit(tmp_path / "s.xml", '<skipped message="No GPUs available"/>')
    assert runner.rank_result(passed, 0, "") == ("passed", "")
    assert runner.rank_result(failed, 1, "") == ("failed", "AssertionError: 1 != 2")
    assert runner.rank_result(skipped, 0, "") == ("skipped", "No GPUs available")
    assert runner.rank_result(tmp_path / "none.xml", -9, "a\nKilled")[0] == "failed"


def test_a_test_fails_if_any_rank_fails_and_is_skipped_if_any_rank_skips():
    assert runner.combine([("passed", ""), ("passed", "")]) == ("passed", "")
    assert runner.combine([("skipped", "x"), ("failed", "y")]) == ("failed", "rank 1: y")
    assert runner.combine([("passed", ""), ("skipped", "x")]) == ("skipped", "rank 1: x")


def test_each_rank_gets_horovodruns_variables_and_the_shim_first_on_the_path():
    env = runner.rank_env(1, 3, 29555)
    assert env["HOROVOD_RANK"] == "1" and env["HOROVOD_SIZE"] == "3"
    assert env["MASTER_PORT"] == "29555"
    assert env["PYTHONPATH"].split(os.pathsep)[0] == str(runner.SHIM)
    assert (runner.SHIM / "horovod" / "__init__.py").exists()
