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
falls back to per-process rlimits.

Beside the memory cgroup, each call gets (`create_call`) a pids cgroup, so one process and thread count
bounds the call and the kernel counts each refused fork (`pids.events`), and CPU accounting (v1
`cpuacct.usage`, v2 `cpu.stat`), so the supervisor can hold all of the call's processes to one CPU
budget. On cgroup v2 one directory does all three; on v1 each controller has its own hierarchy (a
directory per hierarchy, made once where controllers are mounted together). `$OTBRL_SANDBOX_CGROUP`
may list several directories separated by os.pathsep (one per v1 hierarchy). Stdlib only.
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
    forks_refused: int | None = None  # forks and thread creations the pids cgroup refused (None: none)
    cpu_s: float | None = None  # CPU time used by all of the call's processes (None: no accounting)


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


def kernel_memory_counted() -> bool:
    """Whether memory cgroups count kernel memory: AF_UNIX socket buffers (allocated with
    __GFP_ACCOUNT since Linux 4.7), page tables, inotify events, ... Off only when the kernel was
    booted with cgroup.memory=nokmem."""
    try:
        with open("/proc/cmdline") as f:
            words = f.read().split()
    except OSError:
        return True
    options = [w.split("=", 1)[1].split(",") for w in words if w.startswith("cgroup.memory=")]
    return not any("nokmem" in o for o in options)


def leftovers(pid: int | None = None) -> list[str]:
    """Per-call cgroups of process `pid` (default: this one) that still exist, in every hierarchy."""
    parents = [p for p in (_parent, *(_others or {}).values()) if p is not None and not isinstance(p, str)]
    mark = f"{PREFIX}{os.getpid() if pid is None else pid}-"
    found = set()
    for parent, _ in parents:
        try:
            found |= {os.path.join(parent, d) for d in os.listdir(parent) if d.startswith(mark)}
        except OSError:
            pass
    return sorted(found)


class Cgroup:
    """A per-call cgroup directory of one v1 hierarchy (or the call's v2 directory) for pids or CPU."""

    def __init__(self, path: str, version: int) -> None:
        self.path, self.version = path, version

    @property
    def procs_file(self) -> str:
        return os.path.join(self.path, "cgroup.procs")

    def read(self, name: str) -> str:
        with open(os.path.join(self.path, name)) as f:
            return f.read()

    def pids(self) -> list[int]:
        try:
            return [int(p) for p in self.read("cgroup.procs").split()]
        except OSError:
            return []


class CallCgroups:
    """The cgroups of one call: memory, pids and CPU accounting, each None where unavailable (then
    `missing` says why, per controller). `procs_files` are what the call's first process joins."""

    def __init__(self) -> None:
        self.memory: MemoryCgroup | None = None
        self.pids: Cgroup | None = None
        self.cpu: Cgroup | None = None
        self.missing: dict[str, str] = {}
        self._dirs: list[Cgroup | MemoryCgroup] = []  # distinct directories, to kill and remove

    @property
    def procs_files(self) -> list[str]:
        return [d.procs_file for d in self._dirs]

    def cpu_seconds(self) -> float | None:
        """CPU time of every process of the call so far, from the kernel's accounting."""
        if self.cpu is None:
            return None
        try:
            if self.cpu.version == 1:
                return int(self.cpu.read("cpuacct.usage")) / 1e9
            return _keyed(self.cpu.read("cpu.stat"))["usage_usec"] / 1e6
        except (OSError, KeyError, ValueError):
            return None

    def usage(self) -> Usage:
        mem = self.memory.usage() if self.memory is not None else Usage(0, False, None)
        refused = None
        if self.pids is not None:
            refused = _keyed(self.pids.read("pids.events")).get("max", 0)
        return Usage(mem.oom_kills, mem.limit_reached, mem.peak_bytes, refused, self.cpu_seconds())

    def kill(self) -> None:
        for d in self._dirs:
            if isinstance(d, MemoryCgroup):
                d.kill()
            else:
                kill_until_gone(d.pids)

    def remove(self) -> list[str]:
        """rmdir every directory (killing what is left in it); the paths that could not be removed."""
        failed = []
        for d in self._dirs:
            if isinstance(d, MemoryCgroup):
                ok = d.remove()
            else:
                ok = MemoryCgroup(d.path, d.version).remove()  # the same rmdir-and-kill loop
            if not ok:
                failed.append(d.path)
        return failed


_others: dict[str, tuple[str, int] | str] | None = None  # "pids", "cpu" -> (directory, version) or why


def create_call(limit_bytes: int, max_tasks: int) -> CallCgroups:
    """The cgroups of one call: memory limited to `limit_bytes` (see `create`), pids limited to
    `max_tasks` processes and threads, and CPU accounting. Never raises: what is missing is in
    `.missing`."""
    global _others
    call = CallCgroups()
    call.memory, why = create(limit_bytes)
    if call.memory is None:
        call.missing["memory"] = why
    else:
        call._dirs.append(call.memory)
    with _lock:
        if _others is None:
            _others = _find_others(_parent)
            for found in _others.values():
                if not isinstance(found, str):
                    _sweep(found[0])
    made: dict[str, Cgroup] = {}  # parent directory -> the call's directory there
    if call.memory is not None:
        made[os.path.dirname(call.memory.path)] = Cgroup(call.memory.path, call.memory.version)
    for name in ("pids", "cpu"):
        found = _others[name]
        if isinstance(found, str):
            call.missing[name] = found
            continue
        parent, version = found
        group = made.get(parent)
        if group is None:
            path = os.path.join(parent, f"{PREFIX}{os.getpid()}-{next(_counter)}")
            try:
                os.mkdir(path)
            except OSError as e:
                call.missing[name] = f"cannot create {path}: {e.strerror}"
                continue
            group = made[parent] = Cgroup(path, version)
            call._dirs.append(group)
        if name == "pids":
            try:
                with open(os.path.join(group.path, "pids.max"), "w") as f:
                    f.write(str(max_tasks))
            except OSError as e:
                call.missing[name] = f"cannot set pids.max in {group.path}: {e.strerror}"
                continue
        setattr(call, name, group)
    return call


def _find_others(memory: tuple[str, int] | str | None) -> dict[str, tuple[str, int] | str]:
    """Where the pids and CPU-accounting cgroups of a call go: beside the memory one on v2 (the same
    directory: one cgroup for the call), else in the v1 pids and cpuacct hierarchies, under this
    process's own cgroup there, or in the directories `$OTBRL_SANDBOX_CGROUP` lists."""
    found: dict[str, tuple[str, int] | str] = {}
    if memory is not None and not isinstance(memory, str) and memory[1] == 2:
        parent = memory[0]
        found["cpu"] = (parent, 2)  # cpu.stat is in every v2 cgroup, no controller needed
        try:
            with open(os.path.join(parent, "cgroup.subtree_control")) as f:
                pids = "pids" in f.read().split()
        except OSError:
            pids = False
        found["pids"] = (parent, 2) if pids else f"cgroup v2: pids is not in {parent}/cgroup.subtree_control"
        return found
    explicit = os.environ.get(ENV_PARENT)
    files = {"pids": "pids.max", "cpu": "cpuacct.usage"}
    if explicit:
        for name, marker in files.items():
            listed = explicit.split(os.pathsep)
            path = next((p for p in listed if os.path.exists(os.path.join(p, marker))), None)
            if path is None:
                found[name] = f"${ENV_PARENT} lists no v1 directory with {marker}"
            elif not os.access(path, os.W_OK):
                found[name] = f"cgroup v1: {path} is not writable"
            else:
                found[name] = (path, 1)
        return found
    try:
        mounts, own = _mounts(), _own_cgroups()
    except OSError as e:
        return dict.fromkeys(files, f"cannot read this process's cgroups ({e.strerror})")
    for name, controller in (("pids", "pids"), ("cpu", "cpuacct")):
        mount = next((m for m in mounts if m[2] == "cgroup" and controller in m[3].split(",")), None)
        if mount is None or controller not in own:
            found[name] = f"no v1 {controller} hierarchy is mounted, and no v2 memory cgroup is in use"
            continue
        here = _inside(mount[0], mount[1], own[controller])
        if here is None:
            found[name] = f"cgroup v1: own {controller} cgroup is outside the mount"
        elif not os.access(here, os.W_OK):
            found[name] = f"cgroup v1: {here} is not writable"
        else:
            found[name] = (here, 1)
    return found


def _try_enable(parent: str, controller: str) -> None:
    try:
        with open(os.path.join(parent, "cgroup.subtree_control"), "w") as f:
            f.write(f"+{controller}")
    except OSError:
        pass


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
        for path in explicit.split(os.pathsep):
            if os.path.exists(os.path.join(path, "cgroup.controllers")):
                return _usable_v2(path, enable=False)
            if os.path.exists(os.path.join(path, "memory.limit_in_bytes")):
                return _usable_v1(path)
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
        if enable:  # best effort: without it the call has no pids cgroup, and says so
            _try_enable(parent, "pids")
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
