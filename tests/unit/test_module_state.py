"""docs/design.md's "Module-level state" table names every module-level variable in ``src/`` that
changes after import (issue 20: "no module-level mutable state except what docs/design.md names
and justifies").

A variable counts as changing when a function rebinds it (``global NAME``), or when the module
calls a mutating method on it (``NAME.append(...)``, ``.add``, ``.clear``, ...) or assigns into
it (``NAME[key] = ...``). Memo caches of pure functions are named in the table's preamble."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src" / "ringtrain"
MUTATING = {
    "append", "add", "clear", "extend", "update", "pop", "remove", "discard", "setdefault",
    "insert", "popitem",
}  # fmt: skip


def changing_globals(source: str) -> set[str]:
    """The module-level names of ``source`` that change after import (see the module doc)."""
    tree = ast.parse(source)
    top: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.Assign):
            top.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            top.add(node.target.id)
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Global):
            found.update(node.names)
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in MUTATING
            and isinstance(node.func.value, ast.Name)
            and node.func.value.id in top
        ):
            found.add(node.func.value.id)
        elif isinstance(node, (ast.Assign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            found.update(
                t.value.id
                for t in targets
                if isinstance(t, ast.Subscript) and isinstance(t.value, ast.Name)
            )
    return found & top


def documented() -> str:
    """The "Module-level state" section of docs/design.md."""
    text = (ROOT / "docs" / "design.md").read_text(encoding="utf-8")
    start = text.index("## Module-level state")
    end = text.find("\n## ", start + 1)
    return text[start : end if end > 0 else None]


def test_the_scan_finds_rebinding_and_mutation():
    source = "A = []\nB = None\nC = {}\nD = 1\ndef f():\n    global B\n    B = 2\n    A.append(1)\n"
    source += "    C['k'] = 1\n    x = D + 1\n"
    assert changing_globals(source) == {"A", "B", "C"}


def test_every_changing_module_variable_is_named_in_design_md():
    section = documented()
    missing = []
    for path in sorted(SRC.rglob("*.py")):
        module = path.relative_to(SRC).with_suffix("").as_posix()
        for name in sorted(changing_globals(path.read_text(encoding="utf-8"))):
            # A row names it as `module.name`, or lists it after its module in the same cell.
            row = re.search(rf"`{re.escape(module)}[.]{re.escape(name)}`", section)
            listed = re.search(rf"`{re.escape(module)}[.][^|]*`{re.escape(name)}`", section)
            if row is None and listed is None:
                missing.append(f"{module}.{name}")
    assert not missing, (
        f"module-level state not named in docs/design.md's 'Module-level state' table: {missing}"
        " (add a row saying what it holds and why it is module-level, or make it an attribute)"
    )
