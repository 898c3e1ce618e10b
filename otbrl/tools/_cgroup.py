"""One memory cgroup per sandbox call: the kernel-enforced memory budget of `otbrl.tools.sandbox`.

The kernel charges a memory cgroup for every page its processes bring in: the anonymous memory of all
of them, memfd files, POSIX and SysV shared memory, the tmpfs files they write and kernel memory (page
tables, socket buffers). So one limit on the call's cgroup is one budget for the whole call, which
RLIMIT_AS (per process, address space only: a memfd is not counted) is not. Over budget the kernel
reclaims, then its OOM killer kills a process of the call and counts the kill in `memory.events` (v2)
or `memory.oom_control` (v1): that counter, not stderr text, says the memory limit was hit.

Where the per-call cgroups are made (`_find_parent`): under `$OTBRL_SANDBOX_CGROUP` when set (a
directory delegated to this user, e.g. a systemd unit with `Delegate=yes`); otherwise cgroup v2 when its
memory controller is enabled, else the v1 memory hierarchy. v1: under this process's own memory cgroup.
v2: under the root when this process is in it, else beside this process's cgroup (v2 lets no cgroup
with member processes hand memory to children, so not under our own). Where none is writable (an
unprivileged user, a container with a read-only /sys/fs/cgroup), `create` says why and the sandbox
falls back to per-process rlimits. Stdlib only.
"""

from __future__ import annotations

import errno
import itertools
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

PREFIX = "otbrl-sandbox-"  # + pid of the creating process + "-" + a counter
ENV_PARENT = "OTBRL_SANDBOX_CGROUP"


@dataclass(frozen=True)
class Usage:
    oom_kills: int  # processes of the call the kernel killed for going over the budget
    limit_reached: bool  # the call's memory reached the budget at least once (then reclaim or OOM)
    peak_bytes: int | None  # the most the call held at once (None: kernel < 5.19 on v2)


class MemoryCgroup:
    """A cgroup directory; `version` is 1 (the v1 memory hierarchy) or 2."""

    def __init__(self, path: str, version: int) -> None:
        self.path, self.version = path, version

    @property
    def procs_file(self) -> str:
        return os.path.join(self.path, "cgroup.procs")

    def _read(self, name: str) -> str:
        with open(os.path.join(self.path, name)) as f:
            return f.read()

    def _write(self, name: str, value: str) -> None:
        with open(os.path.join(self.path, name), "w") as f:
            f.write(value)

    def pids(self) -> list[int]:
        try:
            return [int(p) for p in self._read("cgroup.procs").split()]
        except OSError:  # already removed
            return []

    def usage(self) -> Usage:
        if self.version == 2:
            events = _keyed(self._read("memory.events"))
            try:
                peak: int | None = int(self._read("memory.peak"))
            except OSError:
                peak = None
            return Usage(events.get("oom_kill", 0), events.get("max", 0) > 0, peak)
        oom = _keyed(self._read("memory.oom_control"))
        failcnt = int(self._read("memory.failcnt"))
        return Usage(oom.get("oom_kill", 0), failcnt > 0, int(self._read("memory.max_usage_in_bytes")))

    def kill(self) -> None:
        """SIGKILL every process in the cgroup until none is left (a fork bomb forks between reads)."""
        if self.version == 2:
            try:
                self._write("cgroup.kill", "1")  # Linux >= 5.14: atomic, no pid-reuse race
            except OSError:
                pass
        kill_until_gone(self.pids)

    def remove(self, timeout_s: float = 3.0) -> bool:
        """rmdir the cgroup (killing what is still in it); False if it is still there after `timeout_s`.
        Pages still charged to it (a tmpfs not yet torn down) do not stop the rmdir: the kernel keeps
        them accounted until they are freed."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                os.rmdir(self.path)
                return True
            except FileNotFoundError:
                return True
            except OSError as e:
                if e.errno != errno.EBUSY or time.monotonic() > deadline:
                    return False
            self.kill()
            time.sleep(0.01)


_counter = itertools.count()
_lock = threading.Lock()
_parent: tuple[str, int] | str | None = None  # (directory, version), or why there is none


def kill_until_gone(find_pids: Callable[[], list[int]], attempts: int = 500) -> None:
    """SIGKILL every pid `find_pids()` lists, again and again until it lists none: a fork bomb may fork
    between one scan and the kill."""
    for _ in range(attempts):
        pids = find_pids()
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.002)


def create(limit_bytes: int) -> tuple[MemoryCgroup | None, str]:
    """A fresh cgroup limited to `limit_bytes` of memory (swap not allowed on top), or (None, why not)."""
    global _parent
    with _lock:
        if _parent is None:  # once per process: the hierarchy does not move under a running trainer
            _parent = _find_parent()
            if not isinstance(_parent, str):
                _sweep(_parent[0])
    if isinstance(_parent, str):
        return None, _parent
    parent, version = _parent
    path = os.path.join(parent, f"{PREFIX}{os.getpid()}-{next(_counter)}")
    try:
        os.mkdir(path)
    except OSError as e:
        return None, f"cannot create {path}: {e.strerror}"
    cgroup = MemoryCgroup(path, version)
    limit = str(limit_bytes)
    try:
        if version == 2:
            cgroup._write("memory.max", limit)
            _try_write(cgroup, "memory.swap.max", "0")  # absent without swap accounting
        else:
            cgroup._write("memory.limit_in_bytes", limit)
            _try_write(cgroup, "memory.memsw.limit_in_bytes", limit)  # memory + swap: no swap on top
            _try_write(cgroup, "memory.swappiness", "0")  # where memsw is not accounted
    except OSError as e:
        cgroup.remove()
        return None, f"cannot set a memory limit in {path}: {e.strerror}"
    return cgroup, ""


def leftovers(pid: int | None = None) -> list[str]:
    """Per-call cgroups of process `pid` (default: this one) that still exist."""
    if _parent is None or isinstance(_parent, str):
        return []
    mark = f"{PREFIX}{os.getpid() if pid is None else pid}-"
    try:
        return [os.path.join(_parent[0], d) for d in os.listdir(_parent[0]) if d.startswith(mark)]
    except OSError:
        return []


def _try_write(cgroup: MemoryCgroup, name: str, value: str) -> None:
    try:
        cgroup._write(name, value)
    except OSError:
        pass


def _sweep(parent: str) -> None:
    """Remove empty per-call cgroups of trainers that died without cleaning up."""
    try:
        names = [d for d in os.listdir(parent) if d.startswith(PREFIX)]
    except OSError:
        return
    for name in names:
        pid = name[len(PREFIX) :].split("-")[0]
        if pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
            try:
                os.rmdir(os.path.join(parent, name))
            except OSError:
                pass


def _keyed(text: str) -> dict[str, int]:
    """'key value' lines (memory.events, memory.oom_control) as a dict."""
    pairs = (line.split() for line in text.splitlines())
    return {p[0]: int(p[1]) for p in pairs if len(p) == 2 and p[1].lstrip("-").isdigit()}


def _find_parent() -> tuple[str, int] | str:
    explicit = os.environ.get(ENV_PARENT)
    if explicit:
        if os.path.exists(os.path.join(explicit, "cgroup.controllers")):
            return _usable_v2(explicit, enable=False)
        if os.path.exists(os.path.join(explicit, "memory.limit_in_bytes")):
            return _usable_v1(explicit)
        return f"${ENV_PARENT}={explicit} is not a cgroup directory with the memory controller"
    mounts, own = _mounts(), _own_cgroups()
    reasons = []
    v2 = next((m for m in mounts if m[2] == "cgroup2"), None)
    if v2 is not None and "" in own:
        mountpoint, root = v2[0], v2[1]
        here = _inside(mountpoint, root, own[""])
        if here is None:
            reasons.append("cgroup v2: this process's cgroup is outside the mounted hierarchy")
        else:
            # the root takes children although it has processes; any other cgroup of ours does not
            parent = here if own[""] == root else os.path.dirname(here)
            found = _usable_v2(parent, enable=True)
            if not isinstance(found, str):
                return found
            reasons.append(found)
    v1 = next((m for m in mounts if m[2] == "cgroup" and "memory" in m[3].split(",")), None)
    if v1 is not None and "memory" in own:
        here = _inside(v1[0], v1[1], own["memory"])
        found = _usable_v1(here) if here else "cgroup v1: own memory cgroup is outside the mount"
        if not isinstance(found, str):
            return found
        reasons.append(found)
    return "; ".join(reasons) or "no memory cgroup controller is mounted"


def _usable_v2(parent: str, enable: bool) -> tuple[str, int] | str:
    try:
        with open(os.path.join(parent, "cgroup.controllers")) as f:
            if "memory" not in f.read().split():
                return f"cgroup v2: no memory controller in {parent}"
        with open(os.path.join(parent, "cgroup.subtree_control")) as f:
            enabled = "memory" in f.read().split()
        if not enabled and enable:
            with open(os.path.join(parent, "cgroup.subtree_control"), "w") as f:
                f.write("+memory")
        elif not enabled:
            return f"cgroup v2: memory is not in {parent}/cgroup.subtree_control"
    except OSError as e:
        return f"cgroup v2: cannot use {parent} ({e.strerror})"
    if not os.access(parent, os.W_OK):
        return f"cgroup v2: {parent} is not writable"
    return parent, 2


def _usable_v1(parent: str) -> tuple[str, int] | str:
    if not os.path.exists(os.path.join(parent, "memory.limit_in_bytes")):
        return f"cgroup v1: {parent} is not a memory cgroup"
    if not os.access(parent, os.W_OK):
        return f"cgroup v1: {parent} is not writable"
    return parent, 1


def _mounts() -> list[tuple[str, str, str, str]]:
    """(mount point, root within the hierarchy, fstype, super options) of the cgroup mounts."""
    found = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            fields, tail = left.split(), right.split()
            if len(fields) >= 5 and len(tail) >= 3 and tail[0] in ("cgroup", "cgroup2"):
                found.append((_unescape(fields[4]), _unescape(fields[3]), tail[0], tail[2]))
    return found


def _own_cgroups() -> dict[str, str]:
    """This process's cgroup per v1 controller, and under "" its v2 cgroup."""
    own = {}
    with open("/proc/self/cgroup") as f:
        for line in f:
            parts = line.rstrip("\n").split(":", 2)
            if len(parts) == 3:
                for controller in parts[1].split(",") if parts[1] else [""]:
                    own[controller] = parts[2]
    return own


def _inside(mountpoint: str, root: str, path: str) -> str | None:
    """The directory of cgroup `path` under a mount of the hierarchy's `root`, or None if not below it."""
    rel = os.path.relpath(path, root)
    return None if rel.startswith("..") else os.path.normpath(os.path.join(mountpoint, rel))


def _unescape(field: str) -> str:
    return field.encode().decode("unicode_escape") if "\\" in field else field
