"""The sandbox's hostile cases (docs/sandbox.md): how much host memory each call really used, what the
code said it held, and whether a host unix socket could be reached.

    .venv/bin/python benchmarks/bench_sandbox.py                  # writes docs/results/sandbox.{md,json}
    .venv/bin/python benchmarks/bench_sandbox.py --out /tmp/x.md  # writes /tmp/x.md and /tmp/x.json
    .venv/bin/python benchmarks/bench_sandbox.py --before old.json  # adds the "before" columns

"Host peak" is the rise of an unlimited memory cgroup made for each case and holding the caller (a
fresh interpreter per case): the sandbox's own per-call cgroup, if any, is created below it (v1) or
beside the caller inside it (v2), so the peak covers every process of the call, memfds, shared memory
and tmpfs pages.
Without a writable cgroup the host peak is not measured. Only run_python's long-standing arguments are
used and `memory_peak_mb` is read with getattr, so the same script runs against older otbrl code
(a checkout of c251123: `PYTHONPATH=<checkout> .venv/bin/python benchmarks/bench_sandbox.py --out ...`).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

from otbrl.tools import run_python

RESULTS = Path(__file__).resolve().parents[1] / "docs" / "results"
MIB = 1 << 20

MEMFD = """
    import os
    held = 0
    fds = []
    for i in range(48):
        fd = os.memfd_create(f"m{i}")
        os.write(fd, b"x" * (15 << 20))  # 15 MiB, written (touched); the fd stays open
        fds.append(fd)
        held += 15
        print(held, flush=True)
"""

PROCESSES = """
    import os, time
    kids = []
    for k in range(6):  # 6 x 80 MiB, each process under memory_mb
        r, w = os.pipe()
        if os.fork() == 0:
            blocks = [b"x" * (10 << 20) for _ in range(8)]
            os.write(w, b"1")
            time.sleep(30)
            os._exit(0)
        os.close(w)
        kids.append(r)
    done = sum(len(os.read(r, 1)) for r in kids)  # EOF (0) for a child killed on the way
    time.sleep(0.2)
    alive = sum(1 for _ in range(done) if os.waitpid(-1, os.WNOHANG) == (0, 0))
    print(80 * min(done, alive), flush=True)  # what all the children hold at once now
"""

TMPFS = """
    held = 0
    for i in range(20):  # files in the (tmpfs) working directory
        with open(f"f{i}", "wb") as f:
            f.write(b"x" * (15 << 20))
        held += 15
        print(held, flush=True)
"""

SHARED = """
    import mmap
    held = 0
    maps = []
    for i in range(20):  # MAP_SHARED | MAP_ANONYMOUS: shmem pages
        m = mmap.mmap(-1, 15 << 20)
        m.write(b"x" * (15 << 20))
        maps.append(m)
        held += 15
        print(held, flush=True)
"""

CONNECT = """
    import socket
    try:
        s = socket.socket(socket.AF_UNIX)
        s.settimeout(2)
        s.connect({path!r})
        s.sendall(b"leak")
        print("CONNECTED")
    except OSError as e:
        print("refused:", type(e).__name__)
"""

# (key, label, code, run_python keyword arguments besides the code)
MEMORY_CASES = [
    ("memfd", "memfd, 48 x 15 MiB, `memory_mb=256`", MEMFD, {"memory_mb": 256}),
    (
        "memfd_files",
        "memfd, 48 x 15 MiB, `memory_mb=256, max_open_files=256`",
        MEMFD,
        {"memory_mb": 256, "max_open_files": 256},
    ),
    ("processes", "6 processes x 80 MiB, `memory_mb=128`", PROCESSES, {"memory_mb": 128}),
    (
        "tmpfs",
        "tmpfs files (20 x 15 MiB) in the working directory, `memory_mb=128, max_file_mb=64`",
        TMPFS,
        {"memory_mb": 128, "max_file_mb": 64},
    ),
    ("shared", "shared anonymous `mmap` (20 x 15 MiB), `memory_mb=128`", SHARED, {"memory_mb": 128}),
]
TIMEOUT_S = 30.0


def _accepts(name: str) -> bool:
    """Whether this otbrl's run_python takes the keyword `name` (older code may not)."""
    import inspect

    return name in inspect.signature(run_python).parameters


# ---------------------------------------------------------------- host memory: an unlimited cgroup


class HostCgroup:
    """A fresh memory cgroup with no limit, holding this process while one call runs (once per process:
    the sandbox picks its cgroups' parent at its first call). v1: a child of this process's memory
    cgroup; v2: `<parent>/otbrl-bench-<pid>` with this process in its `caller` child (v2 forbids
    processes in a cgroup that hands memory to children), memory.peak read on the former."""

    def __init__(self) -> None:
        self.version, self.parent, self.home = _cgroup_location()

    def run(self, call):
        """(result of call(), host peak in MiB or None, why not measured)."""
        if self.version is None:
            return call(), None, self.parent
        top = Path(self.parent) / f"otbrl-bench-{os.getpid()}"
        try:
            top.mkdir()
            if self.version == 1:
                member, peak_file = top, top / "memory.max_usage_in_bytes"
            else:
                (top / "cgroup.subtree_control").write_text("+memory")
                member, peak_file = top / "caller", top / "memory.peak"
                member.mkdir()
            (member / "cgroup.procs").write_text(str(os.getpid()))
        except OSError as e:
            self._remove(top)
            return call(), None, f"could not create or join a memory cgroup ({e})"
        try:
            usage_file = top / ("memory.usage_in_bytes" if self.version == 1 else "memory.current")
            if self.version == 1:
                peak_file.write_text("0")  # reset the high-water mark to the current usage
            baseline = int(usage_file.read_text())
            result = call()
            peak = (int(peak_file.read_text()) - baseline) / MIB
        finally:
            (Path(self.home) / "cgroup.procs").write_text(str(os.getpid()))
            self._remove(top)
        return result, peak, None

    @staticmethod
    def _remove(top: Path) -> None:
        for _ in range(50):  # the sandbox's own cgroup below may take a moment to go
            try:
                for child in (top / "caller",):
                    if child.is_dir():
                        child.rmdir()
                if top.is_dir():
                    top.rmdir()
                return
            except OSError:
                time.sleep(0.1)


def _cgroup_location():
    """(1 or 2, directory to create the case cgroups in, this process's cgroup directory), or
    (None, why not, None)."""
    lines = Path("/proc/self/cgroup").read_text().splitlines()
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            base = Path("/sys/fs/cgroup/memory")
            home = base / path.lstrip("/")
            if os.access(home, os.W_OK):
                return 1, str(home), str(home)
            return None, f"the v1 memory cgroup {home} is not writable", None
    for line in lines:
        if line.startswith("0::"):
            home = Path("/sys/fs/cgroup") / line[3:].lstrip("/")
            parent = home if str(home) == "/sys/fs/cgroup" else home.parent  # beside our own cgroup
            if not os.access(parent, os.W_OK):
                return None, f"the v2 cgroup {parent} is not writable", None
            try:
                if "memory" not in (parent / "cgroup.subtree_control").read_text().split():
                    (parent / "cgroup.subtree_control").write_text("+memory")
            except OSError as e:
                return None, f"no memory controller in {parent} ({e})", None
            return 2, str(parent), str(home)
    return None, "no memory cgroup hierarchy", None


# ---------------------------------------------------------------- the cases


def _held(stdout: str) -> int:
    """The last number the code printed: what it said it held when it stopped or was killed."""
    numbers = [int(w) for w in stdout.split() if w.isdigit()]
    return numbers[-1] if numbers else 0


def _call(code: str, **kwargs):
    return run_python(textwrap.dedent(code), timeout_s=TIMEOUT_S, max_output_bytes=4096, **kwargs)


def memory_case(key: str, label: str, code: str, kwargs: dict) -> dict:
    """One case in a fresh interpreter (run it through `in_fresh_process`): the sandbox picks where its
    cgroups go once per process, below the cgroup the process was in at its first call."""
    missing = [k for k in kwargs if not _accepts(k)]
    if missing:
        return {"key": key, "label": label, "skipped": f"run_python has no {', '.join(missing)}"}
    start = time.perf_counter()
    result, host_peak, why = HostCgroup().run(lambda: _call(code, **kwargs))
    peak = getattr(result, "memory_peak_mb", None)
    return {
        "key": key,
        "label": label,
        "host_peak_mib": None if host_peak is None else round(host_peak, 1),
        "host_peak_missing": why,
        "held_mib": _held(result.stdout),
        "limit_hit": result.limit_hit,
        "memory_peak_mb": peak,
        "exit_code": result.exit_code,
        "error": result.error,
        "notes": list(result.notes),
        "seconds": round(time.perf_counter() - start, 2),
    }


def in_fresh_process(fn, *args):
    with mp.get_context("spawn").Pool(1) as pool:
        return pool.apply(fn, args)


def socket_case() -> dict:
    """A listening AF_UNIX socket of mode 0777 in a fresh 0755 directory under /tmp."""
    label = "`connect()` to a host `AF_UNIX` socket, mode 0777 in a 0755 directory"
    host_dir = tempfile.mkdtemp(prefix="otbrl-bench-", dir="/tmp")
    os.chmod(host_dir, 0o755)
    path = os.path.join(host_dir, "bus.sock")
    server = socket.socket(socket.AF_UNIX)
    try:
        server.bind(path)
        os.chmod(path, 0o777)
        server.listen(5)
        server.settimeout(0.5)
        result = _call(CONNECT.format(path=path), memory_mb=128)
        try:
            conn, _ = server.accept()
            conn.close()
            accepted = True
        except TimeoutError:
            accepted = False
    finally:
        server.close()
        os.unlink(path)
        os.rmdir(host_dir)
    out = result.stdout.strip() or result.stderr.strip()[-200:] or str(result.error)
    return {
        "key": "unix_socket",
        "label": label,
        "connected": "CONNECTED" in result.stdout,
        "accepted": accepted,
        "outcome": out,
        "notes": list(result.notes),
    }


# ---------------------------------------------------------------- issue 23: ways out, and forged reports

KEYRING = """
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    buf = ctypes.create_string_buffer(64)
    n = libc.syscall({keyctl}, 11, {serial}, buf, 64)  # KEYCTL_READ of the caller's key
    print("read:", buf.value.decode() if n > 0 else "refused")
"""

PACKET_RING = """
    import ctypes, os, socket, struct, time
    libc = ctypes.CDLL(None, use_errno=True)
    uid, gid = os.getuid(), os.getgid()
    if libc.unshare(0x10000000 | 0x40000000) != 0:  # CLONE_NEWUSER | CLONE_NEWNET
        print("unshare refused:", os.strerror(ctypes.get_errno()))
        raise SystemExit
    open("/proc/self/setgroups", "w").write("deny")
    open("/proc/self/uid_map", "w").write(f"0 {{uid}} 1")
    open("/proc/self/gid_map", "w").write(f"0 {{gid}} 1")
    s = socket.socket(17, socket.SOCK_RAW, 0)  # AF_PACKET: root of its own user namespace may
    block, blocks, frame = 4 << 20, 128, 2048
    s.setsockopt(263, 5, struct.pack("IIII", block, blocks, frame, block // frame * blocks))  # RX_RING
    print("ring MiB:", block * blocks >> 20, flush=True)
    time.sleep(2)
"""

CPU_BURN = """
    import os
    for _ in range(5):
        if os.fork() == 0:
            break
    while True:
        pass
"""

ORPHANED_GROUP = """
    import os, signal, time
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    a = os.fork()
    if a == 0:
        b = os.fork()
        if b == 0:
            if os.fork() == 0:
                os.kill(os.getpid(), signal.SIGSTOP)
                os._exit(0)
            time.sleep(0.3)
            os._exit(0)
        os.setpgid(0, 0)
        os.waitpid(b, 0)
        time.sleep(0.5)
        os._exit(0)
    os.waitpid(a, 0)
    print("finished")
"""

OOM_VICTIM = """
    import os, subprocess, sys
    open("/proc/self/oom_score_adj", "w").write("0")
    sys.stderr.write("MODEL TEXT\\\\n")
    sys.stderr.flush()
    subprocess.Popen(["sh", "-c", "i=0; while :; do head -c 4194304 /dev/zero > f$i; i=$((i+1)); done"])
    os.execv("/bin/sleep", ["sleep", "2"])
"""

THREADS = """
    import threading
    stop = threading.Event()
    try:
        for _ in range(64):
            threading.Thread(target=stop.wait).start()
    except RuntimeError:
        pass
    stop.set()
"""

SYSV = """
    import ctypes
    print(ctypes.CDLL(None).shmget({key}, 1 << 20, 0o1666))
"""


def _short(text, n: int = 90) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= n else text[: n - 3] + "..."


def _report(r) -> str:
    """The fields the issue is about, as one cell."""
    parts = [f"limit_hit={r.limit_hit}", f"exit={r.exit_code}"]
    if r.error:
        parts.append(f"error: {_short(r.error, 70)}")
    return ", ".join(parts)


def escape_keyring() -> str:
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    nr = {"x86_64": (248, 250), "aarch64": (217, 219)}.get(platform.machine())
    if nr is None:
        return "not measured: no syscall numbers for this machine"
    serial = libc.syscall(nr[0], b"user", b"otbrl-bench-key", b"secret", 6, -3)
    try:
        r = _call(KEYRING.format(keyctl=nr[1], serial=serial), memory_mb=128)
    finally:
        libc.syscall(nr[1], 9, serial, -3)
    return f"{_short(r.stdout.strip() or r.stderr.strip()[-80:])}; {_report(r)}"


def escape_packet_ring() -> str:
    """MemAvailable sampled every 20 ms during the call: what the host lost (noisy: other processes)."""
    import threading

    def available() -> int:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) << 10
        return 0

    base, low, done = available(), [available()], threading.Event()

    def sample() -> None:
        while not done.wait(0.02):
            low[0] = min(low[0], available())

    t = threading.Thread(target=sample)
    t.start()
    try:
        r = run_python(textwrap.dedent(PACKET_RING), timeout_s=TIMEOUT_S, memory_mb=64)
    finally:
        done.set()
        t.join()
    peak = getattr(r, "memory_peak_mb", None)
    out = _short(r.stdout.strip() or r.stderr.strip()[-80:], 60)
    peak_text = "—" if peak is None else f"{peak:.1f} MiB"
    lost = (base - low[0]) / MIB
    return f"{out}; host MemAvailable dropped {lost:.0f} MiB; memory_peak_mb {peak_text}; {_report(r)}"


def escape_cpu() -> str:
    """CPU time of every process of the call: the rise of `cpuacct.usage` of a fresh v1 cpuacct cgroup
    holding this (fresh) process, so the sandbox's own per-call cgroup, if any, is created below it
    and counted too. Processes killed with the call are in it as well (rusage would miss them: no
    living parent reaps them)."""
    home = None
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if "cpuacct" in controllers.split(","):
            mount = next(
                (
                    m.split()[1]
                    for m in Path("/proc/self/mounts").read_text().splitlines()
                    if m.split()[2] == "cgroup" and "cpuacct" in m.split()[3].split(",")
                ),
                None,
            )
            home = None if mount is None else Path(mount) / path.lstrip("/")
    if home is None or not os.access(home, os.W_OK):
        return "not measured: no writable v1 cpuacct cgroup"
    top = home / f"otbrl-bench-cpu-{os.getpid()}"
    top.mkdir()
    try:
        (top / "cgroup.procs").write_text(str(os.getpid()))
        r = _call(CPU_BURN, memory_mb=128, cpu_s=1)
        used = int((top / "cpuacct.usage").read_text()) / 1e9
    finally:
        (home / "cgroup.procs").write_text(str(os.getpid()))
        HostCgroup._remove(top)
    return f"{used:.1f} CPU-s used, {r.duration_s:.1f} s; {_report(r)}"


def escape_simple(code: str, **kwargs) -> str:
    return _report(_call(code, **kwargs))


def escape_sysv() -> str:
    from otbrl.tools import sandbox

    if os.geteuid() != 0 or not os.path.exists("/usr/bin/python3"):
        return "not measured: needs root and /usr/bin/python3"
    sandbox._NAMESPACES = False
    sandbox.PYTHON = "/usr/bin/python3"
    key = 0x07B7B000 + os.getpid() % 0xFFF
    r = _call(SYSV.format(key=key), memory_mb=128)
    left = [line.split()[0] for line in Path("/proc/sysvipc/shm").read_text().splitlines()[1:]]
    survived = str(key) in left
    if survived:
        subprocess.run(["ipcrm", "-M", str(key)], capture_output=True)
    said = any("SysV" in n for n in r.notes)
    fate = "survived" if survived else "gone"
    return f"segment {fate} after the call; notes {'name' if said else 'do not name'} SysV IPC"


def escape_argument(kwargs: dict) -> str:
    start = time.perf_counter()
    r = run_python("import time\ntime.sleep(1)\nprint('ran')", **kwargs)
    ran = "the code ran" if "ran" in r.stdout or time.perf_counter() - start > 0.9 else "the code did not run"
    return f"{ran}; {_short(r.error or _report(r), 80)}"


ESCAPE_CASES = [
    ("keyring", "1. read the caller's session key (KEYCTL_READ)", escape_keyring, ()),
    ("packet_ring", "2. user namespace + AF_PACKET ring of 512 MiB, `memory_mb=64`", escape_packet_ring, ()),
    ("sighup", "3. orphaned process group: SIGHUP to the sandbox's group", escape_simple, (ORPHANED_GROUP,)),
    (
        "oom",
        "4. `oom_score_adj=0`, tmpfs files written by small programs, `memory_mb=64`",
        escape_simple,
        (OOM_VICTIM,),
        {"memory_mb": 64, "max_file_mb": 64},
    ),
    (
        "eagain",
        "5. prints 'Resource temporarily unavailable', exits 1",
        escape_simple,
        ("import sys\nsys.stderr.write('Resource temporarily unavailable\\n')\nsys.exit(1)",),
    ),
    ("sigxcpu", "5. sends itself SIGXCPU", escape_simple, ("import os\nos.kill(os.getpid(), 24)",)),
    ("threads", "5. 64 threads under `max_processes=8`", escape_simple, (THREADS,), {"max_processes": 8}),
    ("cpu", "6. six busy processes, `cpu_s=1`", escape_cpu, ()),
    ("sysv", "7. namespace-less fallback: a SysV shared-memory segment", escape_sysv, ()),
    ("arg_inf", "8. `timeout_s=inf`", escape_argument, ({"timeout_s": float("inf")},)),
    ("arg_cpu", "8. `cpu_s=-5`", escape_argument, ({"cpu_s": -5},)),
    ("arg_mem", "8. `memory_mb=2**44`", escape_argument, ({"memory_mb": 2**44},)),
    ("arg_out", "8. `max_output_bytes=1.5`", escape_argument, ({"max_output_bytes": 1.5},)),
    ("arg_bool", "8. `timeout_s=True`", escape_argument, ({"timeout_s": True},)),
]


def escape_case(key: str) -> dict:
    """One issue-23 case in a fresh interpreter; the outcome as one cell of text."""
    case = next(c for c in ESCAPE_CASES if c[0] == key)
    fn, args = case[2], case[3]
    kwargs = case[4] if len(case) > 4 else {}
    if fn is escape_simple:
        kwargs = {"memory_mb": 128, **kwargs}
    start = time.perf_counter()
    try:
        outcome = fn(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 - an old checkout may lack what a case needs
        outcome = f"not measured: {type(e).__name__}: {_short(e, 60)}"
    seconds = round(time.perf_counter() - start, 2)
    return {"key": key, "label": case[1], "outcome": outcome, "seconds": seconds}


# ---------------------------------------------------------------- bubblewrap, side by side (docs/sandbox.md)

PROBE = r"""
import ctypes, os, socket, sys
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
NR = {"x86_64": dict(add_key=248, keyctl=250, clone=56, userfaultfd=323, perf=298, ptrace=101),
      "aarch64": dict(add_key=217, keyctl=219, clone=220, userfaultfd=282, perf=241, ptrace=117)}
NR = NR[os.uname().machine]
serial = int(sys.argv[1])
def show(name, ret):
    print(name + "\t" + ("allowed" if ret >= 0 else "refused (" + os.strerror(ctypes.get_errno()) + ")"))
buf = ctypes.create_string_buffer(64)
show("keyctl(KEYCTL_READ) of the caller's session key", libc.syscall(NR["keyctl"], 11, serial, buf, 64))
show("add_key to the session keyring", libc.syscall(NR["add_key"], b"user", b"planted", b"x", 1, -3))
pid = libc.syscall(NR["clone"], 0x10000000 | 17, 0, 0, 0, 0)
if pid == 0:
    os._exit(0)
if pid > 0:
    os.waitpid(pid, 0)
show("clone(CLONE_NEWUSER)", pid)
show("unshare(CLONE_NEWNET)", libc.unshare(0x40000000))
show("userfaultfd(UFFD_USER_MODE_ONLY)", libc.syscall(NR["userfaultfd"], 1))
attr = ctypes.create_string_buffer(128)
ctypes.memmove(attr, (1).to_bytes(4, "little") + (128).to_bytes(4, "little"), 8)
ctypes.memmove(ctypes.addressof(attr) + 40, (1 << 5 | 1 << 6).to_bytes(8, "little"), 8)
show("perf_event_open (software, user only)", libc.syscall(NR["perf"], attr, 0, -1, -1, 0))
show("ptrace(PTRACE_TRACEME)", libc.syscall(NR["ptrace"], 0, 0, 0, 0))
try:
    socket.socket(17, socket.SOCK_RAW, 0).close()
    print("socket(AF_PACKET, SOCK_RAW)\tallowed")
except OSError as e:
    print("socket(AF_PACKET, SOCK_RAW)\trefused (" + e.strerror + ")")
print("/proc/sys/user/max_user_namespaces\t" + open("/proc/sys/user/max_user_namespaces").read().strip())
"""

BWRAP_ARGS = (
    "--unshare-all --unshare-user --disable-userns --new-session --die-with-parent --ro-bind /usr /usr "
    "--symlink usr/lib /lib --symlink usr/lib64 /lib64 --symlink usr/bin /bin --proc /proc --dev /dev "
    "--tmpfs /tmp"
).split()

# Runs as the user under test: adds a key to its session keyring, which the sandboxed probe inherits,
# then runs the probe (argv[1:] is the sandbox's command line, the key's serial is appended).
KEY_THEN_RUN = r"""
import ctypes, subprocess, sys
libc = ctypes.CDLL(None)
libc.syscall.restype = ctypes.c_long
nr = {"x86_64": (248, 250), "aarch64": (217, 219)}[__import__("os").uname().machine]
serial = libc.syscall(nr[0], b"user", b"otbrl-bench-key", b"secret", 6, -3)
try:
    sys.stdout.write(subprocess.run(sys.argv[1:] + [str(serial)], capture_output=True, text=True).stdout)
finally:
    libc.syscall(nr[1], 9, serial, -3)
"""


def _probe_lines(text: str) -> dict:
    return dict(line.split("\t", 1) for line in text.splitlines() if "\t" in line)


def bwrap_comparison() -> dict:
    """The same probe under bubblewrap (no seccomp program given: bwrap has no built-in policy) and
    under run_python, as this user and, when root, bwrap also as `nobody`."""
    bwrap = shutil.which("bwrap")
    python = "/usr/bin/python3"
    if bwrap is None or not os.path.exists(python):
        return {"skipped": "bwrap or /usr/bin/python3 is not installed"}
    version = subprocess.run([bwrap, "--version"], capture_output=True, text=True).stdout.strip()
    with tempfile.TemporaryDirectory() as d:
        os.chmod(d, 0o755)
        probe = os.path.join(d, "probe.py")
        Path(probe).write_text(PROBE)
        os.chmod(probe, 0o644)
        sandboxed = [bwrap, *BWRAP_ARGS, "--ro-bind", d, d, python, probe]
        columns = {}
        who = [("bwrap, this user", [])]
        if os.geteuid() == 0:
            who.append(("bwrap, nobody", ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]))
        for name, prefix in who:
            command = [*prefix, python, "-c", KEY_THEN_RUN, *sandboxed]
            out = subprocess.run(command, capture_output=True, text=True)
            columns[name] = _probe_lines(out.stdout)
        # run_python, as this user: the probe's key comes from this process's session keyring
        import ctypes

        libc = ctypes.CDLL(None)
        libc.syscall.restype = ctypes.c_long
        nr = {"x86_64": (248, 250), "aarch64": (217, 219)}[platform.machine()]
        serial = libc.syscall(nr[0], b"user", b"otbrl-bench-key", b"secret", 6, -3)
        try:
            code = f"import sys\nsys.argv = ['probe', '{serial}']\n" + PROBE
            columns["run_python, this user"] = _probe_lines(run_python(code, timeout_s=TIMEOUT_S).stdout)
        finally:
            libc.syscall(nr[1], 9, serial, -3)
    return {"version": version, "args": " ".join(BWRAP_ARGS), "columns": columns}


def bwrap_table(result: dict) -> str:
    if "skipped" in result:
        return f"Not measured: {result['skipped']}."
    columns = result["columns"]
    rows = list(next(iter(columns.values())))
    lines = ["| probe | " + " | ".join(columns) + " |", "|---|" + "---|" * len(columns)]
    for row in rows:
        lines.append(f"| {row} | " + " | ".join(c.get(row, "—") for c in columns.values()) + " |")
    return "\n".join(lines)


# ---------------------------------------------------------------- report


def _machine() -> str:
    """The machine line of the results pages (`studies.pages.machine`). Imported here, not at the top:
    run against an older otbrl checkout (PYTHONPATH, as above) that module is absent, and a plain line
    stands in."""
    try:
        import torch

        from studies.pages import machine
    except ImportError:
        return f"{platform.machine()}, {os.cpu_count()} CPUs; Python {platform.python_version()}"
    return machine(torch.get_num_threads())


def _environment() -> str:
    version = HostCgroup().version
    cgroup = {1: "cgroup v1", 2: "cgroup v2", None: "no writable memory cgroup"}[version]
    user = "root" if os.geteuid() == 0 else f"uid {os.geteuid()}"
    return f"kernel {platform.release()}, {cgroup}, {user}"


def _commit() -> str:
    try:
        import otbrl

        repo = Path(otbrl.__file__).resolve().parents[1]
        out = subprocess.run(
            ["git", "-C", str(repo), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
        )
        status = ["git", "-C", str(repo), "status", "--porcelain", "--", "otbrl/tools"]
        dirty = subprocess.run(status, capture_output=True, text=True).stdout.strip()
        return out.stdout.strip() + (" + uncommitted changes in otbrl/tools/" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _mib(x) -> str:
    return "not measured" if x is None else f"{x:.0f} MiB"


def _memory_cells(r: dict | None) -> list[str]:
    if r is None:
        return ["—", "—"]
    if "skipped" in r:
        return [f"skipped: {r['skipped']}", "—"]
    return [f"{_mib(r['host_peak_mib'])} / {r['held_mib']} MiB", _status(r)]


def _status(r: dict) -> str:
    peak = r["memory_peak_mb"]
    return f"{r['limit_hit'] or 'none'}, " + ("—" if peak is None else f"{peak:.1f}")


def _socket_cell(r: dict | None) -> str:
    if r is None:
        return "—"
    connected = "connected" if r["connected"] else f"not connected ({r['outcome']})"
    return f"{connected}, the server {'accepted' if r['accepted'] else 'accepted nothing'}"


def table(now: dict, before: dict | None) -> str:
    old = {r["key"]: r for r in before["cases"]} if before else {}
    header = ["case"]
    if before:
        header += ["before: host peak / held", "before: `limit_hit`, `memory_peak_mb`"]
    header += ["now: host peak / held", "now: `limit_hit`, `memory_peak_mb`"]
    rows = []
    for r in now["cases"]:
        if r["key"] == "unix_socket":
            cells = ([_socket_cell(old.get(r["key"])), ""] if before else []) + [_socket_cell(r), ""]
        else:
            cells = (_memory_cells(old.get(r["key"])) if before else []) + _memory_cells(r)
        rows.append([r["label"], *cells])
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def escape_table(now: dict, before: dict | None) -> str:
    old = {r["key"]: r for r in (before or {}).get("escape", [])}
    header = ["case (issue 23 class)"] + (["before"] if before else []) + ["now"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in now.get("escape", []):
        cells = [r["label"]]
        if before:
            cells.append(old[r["key"]]["outcome"] if r["key"] in old else "—")
        cells.append(r["outcome"])
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(lines)


def page(now: dict, before: dict | None, command: str) -> str:
    runs = f"now: otbrl at {now['commit']}, {now['environment']}"
    if before:
        runs = f"before: otbrl at {before['commit']}, {before['environment']}; " + runs
    notes = sorted({n for r in now["cases"] for n in r.get("notes", [])})
    note_text = "".join(f"\n* {n}" for n in notes) if notes else " none."
    missing = {r.get("host_peak_missing") for r in now["cases"]} - {None}
    not_measured = f"\n  Not measured here: {'; '.join(sorted(missing))}." if missing else ""
    return f"""# The sandbox's hostile cases (docs/sandbox.md)

Machine: {now["machine"]}. Runs: {runs}.

Regenerate (from the repo root): `{command}`

The "before" columns come from a run of the same script against the old code, whose JSON is passed
with `--before`:

```bash
git worktree add /tmp/old-sandbox c251123
(cd /tmp/old-sandbox && PYTHONPATH=/tmp/old-sandbox $OLDPWD/.venv/bin/python \\
  $OLDPWD/benchmarks/bench_sandbox.py --out /tmp/old-sandbox.md)
.venv/bin/python benchmarks/bench_sandbox.py --before /tmp/old-sandbox.json
git worktree remove --force /tmp/old-sandbox
```

Each case is one `run_python` call (`timeout_s={TIMEOUT_S:g}`, other limits at their defaults unless named).
Columns:

* **host peak**: the most memory the call used, seen from the host: the rise of the peak
  (`memory.max_usage_in_bytes` on cgroup v1, `memory.peak` on v2) of a fresh memory cgroup with no
  limit that holds the calling process, so it counts every process of the call, memfds, shared memory,
  tmpfs pages and the caller's own allocations during the call.{not_measured}
* **held**: the last number the code printed (flushed as it went) before it stopped or was killed: what
  it said it held at once.
* **`limit_hit`, `memory_peak_mb`**: the `ToolResult` fields (`memory_peak_mb` is "—" where the
  field does not exist or is None).
* The memfd code stops at 48 memfds (720 MiB), under the default `max_open_files=64`, so its two rows
  differ only in the limit passed.
* The socket row: whether `connect()` inside the call succeeded, and whether the host's listening socket
  accepted a connection.

{table(now, before)}

`ToolResult.notes` now:{note_text}

## Ways out and forged reports (issue 23)

Each row is one call of hostile code (`timeout_s={TIMEOUT_S:g}`, `memory_mb=128` unless named), run
against each version by the same script. The cells give what the code achieved and the fields of the
report the issue is about. "MemAvailable dropped" is the fall of the host's `MemAvailable` during the
call (sampled every 20 ms; other processes on the machine add noise). "CPU-s used" is the CPU time of
every process of the call: the rise of `cpuacct.usage` of a fresh cpuacct cgroup holding the caller
(the sandbox's own per-call cgroup, if any, is made below it).

{escape_table(now, before)}

## The same probe under bubblewrap ({now.get("bwrap", {}).get("version", "not installed")})

`bwrap {now.get("bwrap", {}).get("args", "")}`, with no `--seccomp` program: bubblewrap ships no
system-call policy of its own (Flatpak passes one). The probe is in `PROBE` in this script; "this user"
is {"root" if os.geteuid() == 0 else "uid " + str(os.geteuid())}.

{bwrap_table(now.get("bwrap", {"skipped": "not run"}))}
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out", type=Path, default=RESULTS / "sandbox.md", help="markdown output; JSON beside it"
    )
    parser.add_argument("--before", type=Path, help="JSON of an earlier run, shown as the 'before' columns")
    args = parser.parse_args()
    before = json.loads(args.before.read_text()) if args.before else None

    cg = HostCgroup()
    if cg.version is None:
        print(f"host peak not measured: {cg.parent}")
    cases = []
    for key, label, code, kwargs in MEMORY_CASES:
        cases.append(in_fresh_process(memory_case, key, label, code, kwargs))
        print(json.dumps(cases[-1]), flush=True)
    cases.append(socket_case())
    print(json.dumps(cases[-1]), flush=True)
    escape = []
    for case in ESCAPE_CASES:
        escape.append(in_fresh_process(escape_case, case[0]))
        print(json.dumps(escape[-1]), flush=True)
    bwrap = bwrap_comparison()
    print(json.dumps(bwrap), flush=True)
    now = {
        "bwrap": bwrap,
        "machine": _machine(),
        "environment": _environment(),
        "commit": _commit(),
        "cases": cases,
        "escape": escape,
    }

    command = ".venv/bin/python benchmarks/bench_sandbox.py"
    if args.out.resolve() != (RESULTS / "sandbox.md").resolve():
        command += f" --out {args.out}"
    if args.before:
        command += f" --before {args.before}"
    text = page(now, before, command)
    print(table(now, before))
    print(escape_table(now, before))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    data = dict(now, before=before)
    args.out.with_suffix(".json").write_text(json.dumps(data, indent=1) + "\n")
    print(f"wrote {args.out} and {args.out.with_suffix('.json')}")


if __name__ == "__main__":
    sys.exit(main())
