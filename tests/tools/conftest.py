"""Fixtures shared by the sandbox test modules."""

import os
import shutil
import time

import pytest

from tests.tools.sandbox_checks import assert_nothing_left_behind
from tests.tools.scenarios import Delegation, delegated_cgroups, readable_copy_of_the_tools


@pytest.fixture(scope="module")
def nothing_left_behind():
    """After a module's last test: no sandbox process, directory or per-call cgroup of this session
    survives (the sandbox modules use it in their `pytestmark`)."""
    yield
    assert_nothing_left_behind()


@pytest.fixture(scope="session")
def delegated():
    """What the `nobody` scenario runs need (see `tests.tools.scenarios`): v1 cgroup directories handed
    to nobody, and a copy of otbrl/tools that nobody can read wherever this checkout is. Made once per
    session, as root only; removed at the end."""
    if os.geteuid() != 0:
        yield Delegation(None, None)
        return
    try:
        cgroups = delegated_cgroups()
    except OSError:
        cgroups = None
    tools = readable_copy_of_the_tools()
    yield Delegation(cgroups, tools)
    shutil.rmtree(tools, ignore_errors=True)
    for d in (cgroups or "").split(os.pathsep):
        if d:
            for _ in range(100):
                try:
                    os.rmdir(d)
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.05)
