"""Hostile scenarios run in a fresh interpreter, as the caller or as `nobody`, with host-side checks.

`scenario(who, delegated, code, setup=..., check=..., **run_python_kwargs)` runs one sandboxed call in
a new interpreter: as the caller (root here), or, when the caller is root, as `nobody` with the system's
interpreter -- once with per-call cgroups delegated to it (`nobody+cgroups`: the way an unprivileged
trainer is meant to run) and where it matters once without any (`nobody`). The interpreter imports
`otbrl.tools` through a stub parent package, so it needs neither torch nor a venv the unprivileged user
can read; as `nobody` it imports a copy of `otbrl/tools` in a directory any user can read
(`Delegation.tools`, made by the `delegated` fixture in conftest.py), so the runs work from any
checkout, a private one under /root or a `mktemp -d` clone included.

A scenario is (setup, code, check): `setup` runs in that interpreter before the call and may set
`params` (the code receives it as `PARAMS`) and define `during(pid)`; `check` runs after the call and
sets `check` from what the host sees. When the code calls `hold()` (the HOLD prelude, prepended to
every scenario's code), its process renames itself to a marker and waits for SIGUSR1: the runner finds
it by that name, calls `during(pid)` while the call holds whatever it took -- host-side evidence taken
during the call, not after it -- and then sends SIGUSR1. The code prints what its system calls returned:
it is our test code, so its output is evidence here, never for the sandbox's own report.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
NOBODY = 65534
# System-call numbers from the kernel's headers (asm/unistd_64.h; asm-generic/unistd.h for aarch64).
NR = {
    "x86_64": {
        "add_key": 248,
        "keyctl": 250,
        "unshare": 272,
        "clone": 56,
        "setns": 308,
        "bpf": 321,
        "userfaultfd": 323,
        "perf_event_open": 298,
        "ptrace": 101,
        "shmget": 29,
        "clone3": 435,
        "prlimit64": 302,
    },
    "aarch64": {
        "add_key": 217,
        "keyctl": 219,
        "unshare": 97,
        "clone": 220,
        "setns": 268,
        "bpf": 280,
        "userfaultfd": 282,
        "perf_event_open": 241,
        "ptrace": 117,
        "shmget": 194,
        "clone3": 435,
        "prlimit64": 261,
    },
}.get(platform.machine())
needs_nr = pytest.mark.skipif(NR is None, reason=f"syscall numbers not listed for {platform.machine()}")
WHO = ["caller", "nobody+cgroups"]

# Prepended to each scenario's code: `hold()` renames the process to the runner's marker and waits (at
# most 20 s) for the SIGUSR1 the runner sends once `during(pid)` has looked at the host.
HOLD = """
def hold():
    import ctypes, signal
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
    ctypes.CDLL(None).prctl(15, PARAMS["marker"].encode(), 0, 0, 0)  # PR_SET_NAME
    return signal.sigtimedwait({signal.SIGUSR1}, 20) is not None
"""

RUNNER = r"""
import dataclasses, json, os, signal, sys, tempfile, threading, time, types
spec = json.loads(sys.stdin.read())
pkg = types.ModuleType("otbrl")  # the package without its __init__ (torch): only otbrl.tools is needed
pkg.__path__ = [os.path.join(spec["repo"], "otbrl")]
sys.modules["otbrl"] = pkg
from otbrl.tools import _cgroup, run_python, sandbox
marker = "hold-%d" % os.getpid()  # at most 15 bytes: the kernel's limit for a process name
env = {"NR": spec["nr"], "sandbox": sandbox, "params": {}}
exec(spec["setup"], env)
code = "PARAMS = %r\n" % ({**env["params"], "marker": marker},) + spec["code"]
done, seen = threading.Event(), {}

def watch():  # find the held code by its name, look at the host, let it go on
    while not done.is_set():
        for entry in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{entry}/comm") as f:
                    if f.read().strip() != marker:
                        continue
            except OSError:
                continue
            try:
                seen["during"] = env["during"](int(entry)) if "during" in env else None
            except Exception as e:  # reported, and the code still let go
                seen["during"] = {"error": repr(e)}
            try:
                os.kill(int(entry), signal.SIGUSR1)
            except ProcessLookupError:  # it ended meanwhile (killed at a limit)
                pass
            return
        time.sleep(0.02)

watcher = threading.Thread(target=watch)
watcher.start()
result = run_python(code, **spec["kwargs"])
done.set()
watcher.join()
env["result"], env["during"] = result, seen.get("during")
exec(spec["check"], env)
mark = f"otbrl-sandbox-{os.getpid()}-"
left = [d for d in os.listdir(tempfile.gettempdir()) if d.startswith(mark)] + _cgroup.leftovers()
out = {**dataclasses.asdict(result), "check": env.get("check"), "during": env["during"], "leftovers": left}
print(json.dumps(out))
"""


@dataclass(frozen=True)
class Delegation:
    """What root hands to `nobody` for the scenario runs: per-controller v1 cgroup directories
    (memory, pids, cpuacct; joined by os.pathsep for OTBRL_SANDBOX_CGROUP, None where this machine has
    no such hierarchies) and a directory any user can read, holding a copy of `otbrl/tools`."""

    cgroups: str | None
    tools: str | None


def delegated_cgroups() -> str | None:
    """Per-controller v1 directories made by root and handed to `nobody`, the way a delegated subtree
    is set up. None where this machine has no such v1 controllers (then `nobody+cgroups` is skipped)."""
    made = []
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        for name in ("memory", "pids", "cpuacct"):
            base = Path("/sys/fs/cgroup") / name
            if name in controllers.split(",") and (base / "cgroup.procs").exists():
                d = base / path.lstrip("/") / f"otbrl-test-nobody-{os.getpid()}"
                d.mkdir(exist_ok=True)
                for f in [d, *d.iterdir()]:
                    os.chown(f, NOBODY, NOBODY)
                made.append(str(d))
    return os.pathsep.join(made) if len(made) == 3 else None


def others_may_read(path: Path) -> bool:
    """Whether a uid that is neither owner nor group member can reach and read `path`."""
    return all(os.stat(d).st_mode & 0o001 for d in path.resolve().parents) and bool(
        os.stat(path).st_mode & 0o004
    )


def readable_copy_of_the_tools() -> str:
    """A copy of `otbrl/tools/*.py` under a fresh directory of mode 0755 in the first of /tmp and
    /dev/shm that any user can enter: the `nobody` runs import it instead of the checkout, which may sit
    in a private directory (a `mktemp -d` clone is 0700). Returns the directory that holds `otbrl/`."""
    for parent in (tempfile.gettempdir(), "/tmp", "/dev/shm"):
        if not (os.path.isdir(parent) and os.stat(parent).st_mode & 0o001):
            continue
        top = tempfile.mkdtemp(prefix="otbrl-test-tools-", dir=parent)
        os.chmod(top, 0o755)
        target = Path(top, "otbrl", "tools")
        target.mkdir(parents=True, mode=0o755)
        os.chmod(target.parent, 0o755)
        for source in (REPO / "otbrl" / "tools").glob("*.py"):
            shutil.copyfile(source, target / source.name)
            os.chmod(target / source.name, 0o644)
        if others_may_read(target / "sandbox.py"):
            return top
        shutil.rmtree(top)
    raise RuntimeError("no temporary directory that other users can enter (/tmp, /dev/shm)")


def scenario(
    who: str, delegated: Delegation, code: str, *, setup: str = "", check: str = "", **kwargs
) -> dict:
    """Run one call as `who` in a fresh interpreter; the ToolResult's fields, `check`, `during` and
    `leftovers` (the runner's own sandbox directories and cgroups still there: must be none)."""
    kwargs.setdefault("timeout_s", 10)
    spec = {
        "repo": str(REPO),
        "nr": NR or {},
        "setup": textwrap.dedent(setup),
        "code": HOLD + textwrap.dedent(code),
        "check": textwrap.dedent(check),
        "kwargs": kwargs,
    }
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8"}
    python, user = sys.executable, None
    if who != "caller":
        if os.geteuid() != 0:
            pytest.skip("already unprivileged: the 'caller' case is the unprivileged run")
        python, user = "/usr/bin/python3", NOBODY
        if not os.access(python, os.X_OK):
            pytest.skip("no system interpreter to run as nobody")
        spec["repo"] = delegated.tools
        if who == "nobody+cgroups":
            if delegated.cgroups is None:
                pytest.skip("no v1 memory, pids and cpuacct hierarchies to delegate here")
            env["OTBRL_SANDBOX_CGROUP"] = delegated.cgroups
    proc = subprocess.run(
        [python, "-I", "-c", RUNNER],
        input=json.dumps(spec),
        capture_output=True,
        text=True,
        cwd="/",
        env=env,
        user=user,
        group=user,
        extra_groups=[] if user is not None else None,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.splitlines()[-1])
    assert out["leftovers"] == [], out["leftovers"]
    return out


def assert_clean(out: dict) -> None:
    """The sandbox itself did not fail, and no model text reached `error`."""
    assert out["error"] is None, out
