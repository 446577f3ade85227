"""The two tiers and how xdist runs them: the stack tier as one group on one worker,
in order, sharing that worker's broker and ``up`` (tests/conftest.py)."""

from __future__ import annotations

import os

import pytest


def test_a_fast_test_is_in_no_group(request: pytest.FixtureRequest) -> None:
    assert request.node.get_closest_marker("stack") is None
    assert request.node.get_closest_marker("xdist_group") is None
    assert "@" not in request.node.nodeid


@pytest.mark.stack  # only to be grouped: it starts nothing
def test_a_stack_test_runs_in_the_stack_group(request: pytest.FixtureRequest) -> None:
    """Under ``--dist loadgroup`` the group shows as the node id's suffix; a pytest whose
    node ids xdist cannot suffix (9.2, pytest-dev/pytest-xdist#1386) spreads the stack
    tier over every worker, each starting a broker and an ``up`` of its own."""
    assert request.node.get_closest_marker("xdist_group").args == ("stack",)
    if os.environ.get("PYTEST_XDIST_WORKER") and request.config.getoption("dist") == "loadgroup":
        assert request.node.nodeid.endswith("@stack")
