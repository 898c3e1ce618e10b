"""Fixtures shared by the sandbox test modules."""

import pytest

from tests.tools.sandbox_checks import assert_nothing_left_behind


@pytest.fixture(scope="module")
def nothing_left_behind():
    """After a module's last test: no sandbox process, directory or per-call cgroup of this session
    survives (the sandbox modules use it in their `pytestmark`)."""
    yield
    assert_nothing_left_behind()
