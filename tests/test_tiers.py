"""The two tiers and how xdist runs them: the stack tier as two groups, each on one
worker in order: the tests of the session's broker and ``up``, and the tests that
start their own (tests/conftest.py)."""

from __future__ import annotations

import os

import pytest


def test_a_fast_test_is_in_no_group(request: pytest.FixtureRequest) -> None:
    assert request.node.get_closest_marker("stack") is None
    assert request.node.get_closest_marker("xdist_group") is None
    assert "@" not in request.node.nodeid


def _assert_grouped(request: pytest.FixtureRequest, group: str) -> None:
    """Under ``--dist loadgroup`` the group shows as the node id's suffix; a pytest whose
    node ids xdist cannot suffix (9.2, pytest-dev/pytest-xdist#1386) spreads the stack
    tier over every worker, each starting a broker and an ``up`` of its own."""
    assert [mark.args for mark in request.node.iter_markers("xdist_group")] == [(group,)]
    if os.environ.get("PYTEST_XDIST_WORKER") and request.config.getoption("dist") == "loadgroup":
        assert request.node.nodeid.endswith(f"@{group}")


@pytest.mark.stack  # only to be grouped: it starts nothing
def test_a_test_that_starts_its_own_stack_runs_in_the_own_group(
        request: pytest.FixtureRequest) -> None:
    _assert_grouped(request, "stack_own")


def test_a_test_of_the_session_stack_runs_in_the_stack_group(
        request: pytest.FixtureRequest, broker: object) -> None:
    assert request.node.get_closest_marker("stack") is not None
    _assert_grouped(request, "stack")


def test_a_module_that_seeds_a_store_runs_on_one_worker(request: pytest.FixtureRequest) -> None:
    from tests.conftest import ONE_WORKER_MODULES

    groups: dict[str, set[tuple[object, ...]]] = {}
    for item in request.session.items:
        if item.path.name in ONE_WORKER_MODULES and item.get_closest_marker("stack") is None:
            groups.setdefault(item.path.name, set()).update(
                mark.args for mark in item.iter_markers("xdist_group"))
    if not groups:
        pytest.skip("neither module is collected in this session")
    assert groups == {name: {(ONE_WORKER_MODULES[name],)} for name in groups}
