"""What the sandbox tests check around their calls: this session's sandbox processes and directories, that
none survive a test module (tests/tools/conftest.py runs the check after each sandbox module), and what
a call's `notes` say it ran without.
"""

import os
import tempfile
import time

from otbrl.tools import _cgroup
from otbrl.tools.sandbox import _SLOTS, _UID_BASE

MARK = f"otbrl-sandbox-{os.getpid()}-"  # the sandbox's temp dirs for this (pytest) process


def sandbox_processes() -> list[int]:
    """Processes of this test session's sandboxes, zombies included: their command line names a script
    under MARK, or (root) they run as one of the uids the sandbox hands out to this process."""
    low = _UID_BASE + os.getpid() * _SLOTS
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read()
            with open(f"/proc/{entry}/status") as f:
                uid = int(next(line for line in f if line.startswith("Uid:")).split()[1])
        except (OSError, StopIteration):
            continue
        if MARK.encode() in cmdline or (os.geteuid() == 0 and low <= uid < low + _SLOTS):
            found.append(int(entry))
    return found


def leftover_dirs() -> list[str]:
    return [d for d in os.listdir(tempfile.gettempdir()) if d.startswith(MARK)]


def assert_nothing_left_behind() -> None:
    """No sandbox process, directory or per-call cgroup of this session survives."""
    deadline = time.monotonic() + 2  # the kernel may take a moment to reap a dying namespace
    while sandbox_processes() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert sandbox_processes() == [], "sandbox processes survived the suite"
    assert leftover_dirs() == [], "sandbox directories survived the suite"
    assert _cgroup.leftovers() == [], "per-call cgroups survived the suite"


def isolated(result) -> bool:
    return not any("namespaces unavailable" in n for n in result.notes)


def memcg(result) -> bool:
    """Whether the call ran under a memory cgroup (else the notes say why not)."""
    return not any("memory cgroup" in n for n in result.notes)
