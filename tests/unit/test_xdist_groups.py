"""The suite's ``xdist_group`` marks need pytest-xdist's loadgroup to rename a test's node id
(it appends ``@<group>`` to ``item._nodeid``): pytest 9.2 computes the node id from a structured
id instead, and the groups were silently ignored (two local Ray clusters at once, shared
launches run once per pytest worker). pyproject pins ``pytest<9.2``; this fails if a pytest the
suite runs with ignores the rename again."""

from __future__ import annotations

import pytest


def test_a_renamed_node_id_is_the_one_pytest_reports(request: pytest.FixtureRequest) -> None:
    node = request.node
    before = node.nodeid
    try:
        node._nodeid = f"{before}@probe"  # what xdist's loadgroup does on each pytest worker
        assert node.nodeid == f"{before}@probe"
    finally:
        node._nodeid = before
    assert node.nodeid == before
