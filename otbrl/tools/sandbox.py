"""Run model-written Python in a throwaway, resource-limited process: `run_python(code) -> ToolResult`.

docs/sandbox.md states the threat model. Each call gets a fresh temporary directory and a child process
tree (see `_launcher.py`) with:
  * cgroups of its own (v2, or v1; see `_cgroup.py`) that only the code's processes join -- never the
    sandbox's launcher or init, so the OOM killer cannot pick them:
      - one memory budget for the whole call (`memory_mb`), counting every process and the memory they
        hold outside themselves (memfd files, shared memory, the tmpfs files they wrote, the kernel
        memory of their AF_UNIX socket buffers). Over budget
        the OOM killer stops a process of the call and the cgroup's kill counter sets
        `limit_hit == "memory"`; `memory_peak_mb` is the cgroup's peak;
      - one process-and-thread count (`max_processes`, a pids cgroup), whose count of refused forks
        sets `limit_hit == "processes"`;
      - one CPU budget for all processes (`cpu_s`): the supervisor reads the cgroup's CPU time every
        50 ms and stops the call at the budget (`limit_hit == "cpu"`, `cpu_used_s`);
  * rlimits as backstops (CPU seconds, processes) and limits (file size, open files, no core dumps);
    a wall-clock deadline (counted from the call, startup included) after which the whole tree is
    killed and reaped -- also when the host's pid 1 never reaps orphans;
  * namespaces (user, mount, network, pid, ipc, uts, cgroup): no network but an empty loopback; a root
    filesystem of its own, built on a tmpfs and pivoted into, holding only the interpreter's prefix and
    the system's programs and libraries (/usr, /bin, /lib, ...) read-only and nosuid, a /dev with only
    null, zero, full, random and urandom (no GPUs), its own /proc, and a size-limited tmpfs working
    directory, the only writable place. The host's home directories, /tmp, /run, /var and their unix
    sockets are not there to reach; abstract unix sockets belong to the (empty) network namespace.
    Every process it started dies with it (pid namespace) -- also children that called setsid or
    double-forked. Every namespace limit of the call's user namespace is 0;
  * a system-call policy (`_seccomp.py`, in every mode) refusing key management, new namespaces, every
    socket family but AF_UNIX (netlink, vsock, AF_ALG, packet, inet, ...), `prlimit64` on other
    processes, bpf, userfaultfd, perf_event_open, ptrace, io_uring, mounts, administration calls and
    any call newer than the policy; a fresh, empty session keyring; a session and process group of its
    own, so job-control tricks and kill(0, ...) stay inside the call;
  * as root, a uid of its own per call (`_UID_BASE + pid * 256 + slot`; no account, no subordinate
    range and no process has it, checked once per trainer process), which also owns the call's user
    namespace: the kernel charges per-user quotas (inotify instances and watches, message-queue bytes,
    pending signals, processes) of everything in a user namespace to its owner too, so a call cannot
    use up the trainer's. RLIMIT_NPROC binds (it does not for root), concurrent calls never share a
    process budget, and leftovers can be swept by uid. As a non-root user the call keeps its uid inside
    its user namespace (the trainer's: an unprivileged process can map only itself), where RLIMIT_NPROC
    counts only the sandbox's own processes (Linux >= 5.14);
  * the call's share of per-user quotas, whoever owns its namespace: RLIMIT_SIGPENDING (`SIGPENDING`),
    RLIMIT_MSGQUEUE (`MSGQUEUE_BYTES`), and inotify instances and watches set in its user namespace;
  * init (pid 1 of the call) is root's as root, not dumpable (its /proc files are root's, whatever
    the uid), and shows "otbrl-sandbox-init" as its command line; the launcher has no pid in the
    call's pid namespace and gets its configuration through a pipe;
  * a scrubbed environment (PATH, HOME, TMPDIR, LANG only) and `python -I` (no PYTHON* variables, no
    user site); no file descriptors but stdin (/dev/null), stdout and stderr are inherited;
  * stdout and stderr each capped at `max_output_bytes`; past that the run is stopped (limit "output").
The report comes from the kernel and the supervisor only (see `ToolResult`): nothing the code prints,
and no signal it sends itself, sets `limit_hit` or `error`. Every argument is checked before anything
is written or started.

Where a mechanism is missing the call still runs, weaker, and says so in `ToolResult.notes`:
  * no cgroup it may create (an unprivileged user without a delegated one, a container with a
    read-only /sys/fs/cgroup; set `OTBRL_SANDBOX_CGROUP` to delegated directories): `memory_mb` then
    bounds each process's address space (RLIMIT_AS), `cpu_s` each process's CPU time, `max_processes`
    the uid's processes, and hitting the first or the last is not reported in `limit_hit`;
  * no namespaces (e.g. a container without CAP_SYS_ADMIN or user namespaces): the code runs on the
    host's filesystem (it may read what any user may read and write to world-writable directories such
    as /tmp); socket(), SysV IPC and POSIX message queues are refused by the seccomp policy; as root the
    call's uid's files in /tmp, /var/tmp and /dev/shm are removed afterwards; as a non-root user
    neither the process count nor setsid'd children can be contained.
Pass `require_isolation=True` to get an error result instead of any of these.

`run_python` never raises: a failure of the sandbox itself comes back as `ToolResult.error`.
"""

from __future__ import annotations

import fcntl
import json
import math
import os
import re
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from otbrl.tools import _cgroup
from otbrl.tools._launcher import RLIMIT_NOTE, processes_of_uid

__all__ = ["ToolResult", "processes_of_uid", "run_python"]

_LAUNCHER = str(Path(__file__).with_name("_launcher.py"))
_UID_BASE = 1_000_000_000  # far above real users; pid (< 2**22) * 256 + slot keeps it below 2**31
_SLOTS = 256
_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8"}
# The interpreter for sandboxed code (and the launcher); None: the base interpreter of this one (a
# venv's packages are not available inside, only the standard library and the base site-packages).
PYTHON: str | None = None
# Host paths a call may read besides the interpreter's prefix and the system's (/usr, /lib, ...): an
# interpreter whose shared libraries live elsewhere (e.g. Homebrew's) needs their directory here.
READ_ONLY_PATHS: tuple[str, ...] = ()
_NAMESPACES = True  # tests switch this off to exercise the namespace-less fallback
# Upper bounds of the arguments: past them a limit stops meaning anything (memory_mb << 20 would wrap
# in the kernel's 64-bit counters) or a call could fill the host's temporary directory.
MAX_CODE_BYTES = 1 << 20
MAX_TIMEOUT_S = 24 * 3600.0
MAX_MEMORY_MB = 1 << 20  # 1 TiB
MAX_OUTPUT_BYTES = 64 << 20
MAX_PROCESSES = 1 << 16
MAX_FILE_MB = 1 << 20
MAX_OPEN_FILES = 1 << 20
# How often the supervisor reads the call's CPU time: the budget's overshoot is at most this times the
# number of CPUs the call runs on.
_CPU_POLL_S = 0.05
# The call's share of per-user quotas that the kernel counts per uid (and again for the owner of the
# call's user namespace): queued signals, and bytes of POSIX message queues (three queues of the
# default size, 10 x 8 KiB).
SIGPENDING = 256
MSGQUEUE_BYTES = 256 << 10


@dataclass(frozen=True)
class ToolResult:
    """Outcome of one sandboxed run.

    `exit_code` is the process's exit status, negative for a signal (like `subprocess`), None when the
    process was killed by the sandbox (timeout, output or CPU limit) or never started. `limit_hit` names
    the limit that ended or hampered the run: None, "timeout", "cpu", "memory", "output", "processes"
    or "file_size". Only the kernel and the supervisor set it -- the sandbox's timers, cgroup counters
    (OOM kills, refused forks, CPU time), the size of the files left in the working directory -- never
    anything the code prints or a signal it sends itself. `error` is set only when the sandbox itself
    failed, and holds no text of the code's. `memory_peak_mb` is the most memory the call held at once,
    all of its processes, memfds, shared memory and tmpfs files together, as its memory cgroup counted
    it (None without one); `cpu_used_s` the CPU time of all its processes (None without accounting).
    """

    stdout: str
    stderr: str
    exit_code: int | None
    limit_hit: str | None
    duration_s: float
    truncated: bool = False
    error: str | None = None
    notes: tuple[str, ...] = ()
    max_output_bytes: int = 4096
    timeout_s: float = 0.0
    memory_peak_mb: float | None = None
    cpu_used_s: float | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.exit_code == 0 and self.limit_hit is None

    def to_text(self) -> str:
        """The observation for the model: output (stderr tail kept when both must be cut) + status.

        The status markers ("[stderr]", "[exit code N]", "[killed ...]", "[memory limit hit]", ...) are
        lines of their own that start with "[" (or "(no output)"). A line of the code's own output that
        looks like one of them -- ignoring case, leading white space, and splitting lines the way
        `str.splitlines` does -- is shown with a backslash in front (`_defuse`), so a marker line is
        always the sandbox's: a reward function that reads the text cannot be fooled by printed text."""
        if self.error is not None:
            return f"[sandbox error] {self.error}"
        out, err, budget = self.stdout, self.stderr, self.max_output_bytes
        cut = len(out) + len(err) > budget
        if cut:  # keep the head of stdout and the tail of stderr (where a traceback's message is)
            keep_err = min(len(err), budget // 2 if out else budget)
            err = err[len(err) - keep_err :] if keep_err else ""
            out = out[: budget - keep_err]
        parts = [_defuse(out.rstrip("\n"))] if out else []
        if err:
            parts.append("[stderr]\n" + _defuse(err.rstrip("\n")))
        if self.truncated or cut:
            parts.append(f"[output truncated to {budget} bytes]")
        if self.limit_hit == "timeout":
            parts.append(f"[killed: time limit of {self.timeout_s:g} s exceeded]")
        elif self.limit_hit == "output":
            parts.append("[killed: output limit exceeded]")
        elif self.limit_hit is not None:
            parts.append(f"[{self.limit_hit} limit hit]")
        if self.exit_code is not None and self.exit_code < 0:
            parts.append(f"[killed by signal {_signal_name(-self.exit_code)}]")
        elif self.exit_code:
            parts.append(f"[exit code {self.exit_code}]")
        return "\n".join(parts) if parts else "(no output)"


def run_python(
    code: str,
    *,
    timeout_s: float = 5.0,
    memory_mb: int = 256,
    max_output_bytes: int = 4096,
    cpu_s: float | None = None,
    max_processes: int = 16,
    max_file_mb: int = 16,
    max_open_files: int = 64,
    require_isolation: bool = False,
) -> ToolResult:
    """Run `code` as a script in a fresh sandbox (see the module docstring) and return what happened.

    `memory_mb` is the budget of the whole call (of each process where no memory cgroup is available);
    `cpu_s` (default: `timeout_s`) the CPU seconds of all of the call's processes together (of each
    process without CPU accounting); `max_processes` counts every process and thread of the run;
    `max_file_mb` bounds each file and (x4) the working directory. Every argument is checked before
    anything runs. Thread-safe; never raises.
    """
    start = time.monotonic()
    try:
        limits = (timeout_s, memory_mb, max_output_bytes, cpu_s, max_processes, max_file_mb, max_open_files)
        _check_arguments(code, *limits, require_isolation)
        with _uid_slot() as uid:
            return _run(
                code,
                uid,
                start,
                float(timeout_s),
                memory_mb,
                max_output_bytes,
                float(timeout_s if cpu_s is None else cpu_s),
                max_processes,
                max_file_mb,
                max_open_files,
                require_isolation,
            )
    except Exception as e:  # noqa: BLE001 - the trainer must never see an exception from a tool
        return ToolResult(
            "",
            "",
            None,
            None,
            time.monotonic() - start,
            error=f"{type(e).__name__}: {e}",
            max_output_bytes=max_output_bytes if _is_int(max_output_bytes) and max_output_bytes > 0 else 4096,
            timeout_s=float(timeout_s) if _is_number(timeout_s) else 0.0,
        )


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _check_arguments(
    code, timeout_s, memory_mb, max_output_bytes, cpu_s, max_processes, max_file_mb, max_open_files, isolation
) -> None:
    """Raise TypeError or ValueError, one line naming the argument, for anything but a sane limit."""
    if not isinstance(code, str):
        raise TypeError(f"code must be a str, got {type(code).__name__}")
    # a cheap bound first (a character is at least one byte), then the real one
    if len(code) > MAX_CODE_BYTES or len(code.encode("utf-8", "surrogatepass")) > MAX_CODE_BYTES:
        raise ValueError(f"code is longer than {MAX_CODE_BYTES} bytes (MAX_CODE_BYTES)")
    for name, value in (("timeout_s", timeout_s), ("cpu_s", cpu_s)):
        if name == "cpu_s" and value is None:
            continue
        if not _is_number(value):
            raise TypeError(f"{name} must be a finite int or float (not a bool), got {value!r}")
        if not 0 < value <= MAX_TIMEOUT_S:
            raise ValueError(f"{name} must be > 0 and <= {MAX_TIMEOUT_S:g} seconds, got {value!r}")
    for name, value, high in (
        ("memory_mb", memory_mb, MAX_MEMORY_MB),
        ("max_output_bytes", max_output_bytes, MAX_OUTPUT_BYTES),
        ("max_processes", max_processes, MAX_PROCESSES),
        ("max_file_mb", max_file_mb, MAX_FILE_MB),
        ("max_open_files", max_open_files, MAX_OPEN_FILES),
    ):
        if not _is_int(value):
            raise TypeError(f"{name} must be an int (not a bool or float), got {value!r}")
        if not 1 <= value <= high:
            raise ValueError(f"{name} must be between 1 and {high}, got {value!r}")
    if not isinstance(isolation, bool):
        raise TypeError(f"require_isolation must be a bool, got {isolation!r}")


_MISSING_NOTES = {
    "memory": f"no memory cgroup: {RLIMIT_NOTE}",
    "pids": (
        "no pids cgroup: max_processes is an RLIMIT_NPROC of the call's uid, and a fork or thread it "
        "refuses is not reported in limit_hit"
    ),
    "cpu": (
        "no cpu accounting cgroup: cpu_s bounds each process (RLIMIT_CPU), so several processes can "
        "together use more"
    ),
}


def _run(
    code: str,
    uid: int | None,
    start: float,
    timeout_s: float,
    memory_mb: int,
    cap: int,
    cpu_s: float,
    max_processes: int,
    max_file_mb: int,
    max_open_files: int,
    require_isolation: bool,
) -> ToolResult:
    cgroups = _cgroup.create_call(memory_mb << 20, max_processes)
    notes = [f"{_MISSING_NOTES[name]} ({why})" for name, why in cgroups.missing.items()]
    if cgroups.missing and require_isolation:
        cgroups.remove()
        missing = "; ".join(f"no {name} cgroup: {why}" for name, why in cgroups.missing.items())
        raise RuntimeError(f"isolation required, but {missing}")
    base = proc = usage = None
    status_r = -1
    launcher_status = None
    try:
        base = tempfile.mkdtemp(prefix=f"otbrl-sandbox-{os.getpid()}-")  # pid: leak checks per trainer
        os.chmod(base, 0o711)  # the sandbox uid may reach main.py and work/, not list the directory
        script = os.path.join(base, "main.py")
        with open(script, "w", encoding="utf-8", errors="surrogatepass") as f:
            f.write(code)
        os.chmod(script, 0o644)
        workdir = os.path.join(base, "work")
        os.mkdir(workdir, 0o700)
        os.mkdir(os.path.join(base, "stage"), 0o700)  # mount point of the call's new root
        if uid is not None:
            os.chown(workdir, uid, uid)  # used as is only when namespaces (and its tmpfs) are unavailable
        python = os.path.realpath(PYTHON or getattr(sys, "_base_executable", None) or sys.executable)
        if cgroups.memory is not None and not _cgroup.kernel_memory_counted():
            why = "the kernel was booted with cgroup.memory=nokmem"
            if require_isolation:
                raise RuntimeError(f"isolation required, but kernel memory is not counted ({why})")
            notes.append(
                f"kernel memory is not counted in the call's memory cgroup ({why}): socket buffers, "
                "page tables and other kernel objects of the call are outside memory_mb"
            )
        status_r, status_w = os.pipe()
        has_pids = cgroups.pids is not None
        cfg = {
            "status_fd": status_w,
            "uid": uid,
            "python": python,
            "prefix": os.path.dirname(os.path.dirname(python)),  # .../bin/python3.11 -> ...
            "script": script,
            "workdir": workdir,
            "stage": os.path.join(base, "stage"),
            "cgroup_procs": cgroups.procs_files,
            "memcg": cgroups.memory is not None,
            # not an ancestor of the call's directory: the launcher builds the new root's copy of it
            "extra_paths": [p for p in map(os.path.realpath, READ_ONLY_PATHS) if not _contains(p, base)],
            "namespaces": _NAMESPACES,
            "env": {**_ENV, "HOME": workdir, "TMPDIR": workdir},
            # per process; with CPU accounting only a backstop past the call's budget
            "rlimit_cpu": math.ceil(cpu_s) + (1 if cgroups.cpu is not None else 0),
            "memory_mb": memory_mb,
            "fsize": max_file_mb << 20,
            "nofile": max_open_files,
            # RLIMIT_NPROC counts the launcher and init too when not root (one uid in the user
            # namespace); with a pids cgroup it is only a backstop above it, so that the cgroup (which
            # counts what it refuses) binds first
            "nproc": max_processes + (0 if uid is not None else 2) + (2 if has_pids else 0),
            "disk_kb": 4 * max_file_mb << 10,
            "max_inodes": 4096,
            "sigpending": SIGPENDING,
            "msgqueue": MSGQUEUE_BYTES,
            "require_isolation": require_isolation,
        }
        # the configuration goes through a pipe, not the command line, which other processes can read;
        # written whole before the launcher starts, so the pipe must hold it (64 KiB, or made larger)
        config_r, config_w = os.pipe()
        try:
            payload = json.dumps(cfg).encode()
            try:
                if len(payload) > 65536:
                    fcntl.fcntl(config_w, fcntl.F_SETPIPE_SZ, len(payload))
                os.write(config_w, payload)
            finally:
                os.close(config_w)
            proc = subprocess.Popen(
                [python, "-I", "-S", _LAUNCHER, str(config_r), base],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                pass_fds=(status_w, config_r),
                start_new_session=True,
                cwd=base,
                env=dict(_ENV),
            )
        finally:
            os.close(status_w)
            os.close(config_r)
        cpu_budget = (cpu_s, cgroups.cpu_seconds) if cgroups.cpu is not None else None
        out, err, status, killed_for = _collect(proc, status_r, start + timeout_s, cap, cpu_budget)
    finally:
        if proc is not None:
            launcher_status = _kill_tree(proc, uid, cgroups)
        if status_r >= 0:
            os.close(status_r)
        if base is not None:
            _remove(base)
        try:
            usage = cgroups.usage()  # after the kill: the peak and the counters are final
        except (OSError, ValueError, KeyError) as e:
            notes.append(f"could not read the call's cgroup counters ({e})")
        notes += [f"could not remove the cgroup {path}" for path in cgroups.remove()]
    end = time.monotonic() - start
    return _result(out, err, status, killed_for, cap, end, timeout_s, cpu_s, notes, usage, launcher_status)


def _contains(ancestor: str, path: str) -> bool:
    return (path.rstrip("/") + "/").startswith(ancestor.rstrip("/") + "/")


def _collect(proc: subprocess.Popen, status_r: int, deadline: float, cap: int, cpu_budget=None):
    """Read stdout/stderr (each kept up to `cap` bytes) and the launcher's status lines until the user
    process has been reported finished, the deadline passes, the output exceeds the cap, or (with
    `cpu_budget` = (seconds, read the call's CPU time)) the call's processes together used their CPU
    budget."""
    bufs = {proc.stdout.fileno(): bytearray(), proc.stderr.fileno(): bytearray()}
    status = bytearray()
    killed_for = None
    with selectors.DefaultSelector() as sel:
        for fd in (*bufs, status_r):
            os.set_blocking(fd, False)
            sel.register(fd, selectors.EVENT_READ)
        while killed_for is None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                killed_for = "timeout"
                break
            if cpu_budget is not None:
                used = cpu_budget[1]()
                if used is not None and used >= cpu_budget[0]:
                    killed_for = "cpu"
                    break
                remaining = min(remaining, _CPU_POLL_S)
            for key, _ in sel.select(remaining):
                data = os.read(key.fd, 65536)
                if key.fd == status_r:
                    status += data
                    if not data:  # init exited: the user process is finished (or never started)
                        killed_for = "done"
                elif not data:
                    sel.unregister(key.fd)
                elif _append(bufs[key.fd], data, cap):
                    killed_for = "output"
    for fd, buf in bufs.items():  # what the finished process wrote is already in the pipes
        while killed_for == "done" and not _read_ready(fd, buf, cap):
            pass
    return (
        bytes(bufs[proc.stdout.fileno()]),
        bytes(bufs[proc.stderr.fileno()]),
        status.decode(),
        (None if killed_for == "done" else killed_for),
    )


def _append(buf: bytearray, data: bytes, cap: int) -> bool:
    """Append up to the cap; True once the stream has gone past it."""
    buf += data[: cap + 1 - len(buf)]
    return len(buf) > cap


def _read_ready(fd: int, buf: bytearray, cap: int) -> bool:
    """One non-blocking read; True when nothing more is available now (or the cap is reached)."""
    try:
        data = os.read(fd, 65536)
    except BlockingIOError:
        return True
    return not data or _append(buf, data, cap)


def _result(
    out: bytes,
    err: bytes,
    status: str,
    killed_for: str | None,
    cap: int,
    duration: float,
    timeout_s: float,
    cpu_s: float,
    notes: list[str],
    usage: _cgroup.Usage | None,
    launcher_status: int | None,
) -> ToolResult:
    """The report, from the launcher's status lines (written before the code ran, or by init and the
    launcher, which the code cannot reach), the kernel's counters and the supervisor's own decisions.
    Nothing the code wrote to stdout or stderr is read here."""
    errors, exit_code, joined, own_cpu, fsize = [], None, False, None, False
    for line in status.splitlines():
        kind, _, text = line.partition(" ")
        if kind == "note":
            notes.append(text)
        elif kind == "cgroups":
            joined = True
        elif kind == "error":
            errors.append(text)
        elif kind == "fsize":
            fsize = True
        elif kind == "exit":
            wait_status, _, cpu = text.partition(" ")
            if killed_for is None:
                exit_code = os.waitstatus_to_exitcode(int(wait_status))
            own_cpu = float(cpu) if cpu else None
    truncated = len(out) > cap or len(err) > cap
    stdout = out[:cap].decode("utf-8", "replace")
    stderr = err[:cap].decode("utf-8", "replace")
    usage = usage if joined else None  # cgroups the code never joined counted nothing of the call
    cpu_used = usage.cpu_s if usage is not None else None
    limit = killed_for
    if usage and usage.oom_kills and killed_for != "output":
        limit = "memory"  # the kernel killed for memory (before any timeout it may have caused)
    elif limit is None and usage and exit_code and usage.limit_reached:
        limit = "memory"  # the run failed after its memory reached the budget (an ENOMEM, say)
    elif limit is None and cpu_used is not None and cpu_used >= cpu_s:
        limit = "cpu"  # the call's CPU time, counted by the kernel, reached the budget
    elif limit is None and cpu_used is None and exit_code in (-signal.SIGXCPU, -signal.SIGKILL):
        # no accounting: RLIMIT_CPU's signal counts only where the kernel's rusage shows the time spent
        if own_cpu is not None and own_cpu >= math.ceil(cpu_s) - 0.05:
            limit = "cpu"
    if limit is None and usage and usage.forks_refused:
        limit = "processes"  # the pids cgroup refused a fork or a thread (it counts each)
    elif limit is None and fsize:
        limit = "file_size"
    error = None
    if errors:
        error = "; ".join(errors)
    elif killed_for is None and exit_code is None:  # no text of the code's: its stderr is not read
        how = "" if launcher_status is None else f" (its exit status: {launcher_status})"
        error = f"the sandbox's launcher ended without reporting the code's exit status{how}"
    peak = usage.peak_bytes / 2**20 if usage and usage.peak_bytes is not None else None
    cpu_used = None if cpu_used is None else round(cpu_used, 3)
    fields = (stdout, stderr, exit_code, limit, duration, truncated, error, tuple(notes), cap, timeout_s)
    return ToolResult(*fields, peak, cpu_used)


def _kill_tree(proc: subprocess.Popen, uid: int | None, cgroups: _cgroup.CallCgroups) -> int | None:
    """Stop the run and reap everything: SIGTERM asks the launcher to kill its init (a pid namespace dies
    with it; without namespaces the launcher kills what runs as the call's uid) and to reap it. SIGKILL
    to the process group, to what is left in the cgroups and a uid sweep here are only the backstop for
    a launcher that does not exit. Returns the launcher's exit status if it had ended by itself."""
    status = proc.poll()
    try:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=3)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # before wait(): the unreaped launcher keeps the pgid ours
        except ProcessLookupError:
            pass
        proc.wait()
    finally:
        for stream in (proc.stdout, proc.stderr):
            stream.close()
    cgroups.kill()
    if uid is not None:
        _kill_uid(uid)
    return status


def _kill_uid(uid: int) -> None:
    _cgroup.kill_until_gone(lambda: processes_of_uid(uid))


def _remove(base: str) -> None:
    """Remove the call's directory even if the code chmod'ed things (namespace-less mode)."""

    def make_writable(func, path, _exc) -> None:
        os.chmod(os.path.dirname(path), 0o700)
        func(path)

    for root, _, _ in os.walk(base):
        if root != base and os.path.ismount(root):  # never recurse into a mount (cannot happen: the
            return  # launcher's mounts live in its own namespace) -- leave it rather than delete through
    shutil.rmtree(base, onerror=make_writable)


_slot_lock = threading.Condition()
_slots_used: set[int] = set()
_next_slot = 0
_slots_free: tuple[int, set[int]] | None = None  # (pid, slots whose uid belongs to no one else)


def _unused_slots() -> set[int]:
    """The slots of this process's uid range (`_UID_BASE + pid * 256 + slot`) whose uid is nobody else's
    (`_taken_uids`). Checked once per process (a fork gets its own range), before its first call: a
    call's uid must own nothing else on the host, because the kernel charges per-user quotas to it, and
    because a process running as it outside the call would hold every capability in the call's
    namespaces (it owns them)."""
    global _slots_free
    if _slots_free is None or _slots_free[0] != os.getpid():
        low = _UID_BASE + os.getpid() * _SLOTS
        taken = _taken_uids(range(low, low + _SLOTS))
        _slots_free = (os.getpid(), {slot for slot in range(_SLOTS) if low + slot not in taken})
    return _slots_free[1]


def _taken_uids(uids: range, passwd: str = "/etc/passwd", subuid: str = "/etc/subuid") -> set[int]:
    """The uids of `uids` that belong to someone: an account in `passwd`, a subordinate range in
    `subuid` (handed to a user for its own user namespaces), or a process (real, effective, saved or
    filesystem uid) running as it now."""
    taken: set[int] = set()
    for path in (passwd, subuid):
        try:
            with open(path) as f:
                lines = [line.split(":") for line in f if not line.startswith("#")]
        except OSError:
            continue
        for fields in lines:
            try:  # passwd: name:x:uid:...; subuid: name:first:count
                start, count = (int(fields[2]), 1) if path == passwd else map(int, fields[1:3])
            except (IndexError, ValueError):
                continue
            taken.update(range(max(start, uids.start), min(start + count, uids.stop)))
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/status") as f:
                ids = next(line for line in f if line.startswith("Uid:")).split()[1:]
        except (OSError, StopIteration):
            continue
        taken.update(u for u in map(int, ids) if u in uids)
    return taken


@contextmanager
def _uid_slot() -> Iterator[int | None]:
    """A uid of the call's own (root only; None otherwise): no other live call uses it, and it belongs to
    nobody else on the host (`_unused_slots`). Slots rotate, so a uid that still has unreaped zombies
    (they count against RLIMIT_NPROC) is not handed out again at once. Blocks past the number of free
    slots (256 at most) of concurrent calls."""
    global _next_slot
    if os.geteuid() != 0:
        yield None
        return
    with _slot_lock:
        free = _unused_slots()
        if not free:
            raise RuntimeError(f"every uid of this process's range ({_UID_BASE} + pid * {_SLOTS}) is in use")
        while len(_slots_used & free) >= len(free):
            _slot_lock.wait()
        while _next_slot in _slots_used or _next_slot not in free:
            _next_slot = (_next_slot + 1) % _SLOTS
        slot = _next_slot
        _next_slot = (_next_slot + 1) % _SLOTS
        _slots_used.add(slot)
    try:
        yield _UID_BASE + os.getpid() * _SLOTS + slot
    finally:
        with _slot_lock:
            _slots_used.discard(slot)
            _slot_lock.notify()


# A line that reads like one of to_text's markers: "[" or "(" then one of their words.
_MARKER_LIKE = re.compile(
    r"[\[(]\s*(stderr|output\s+truncated|killed|exit\s+code|sandbox\s+error|no\s+output|\w+\s+limit\s+hit)",
    re.IGNORECASE,
)


def _defuse(text: str) -> str:
    """The code's text with a backslash before every line that looks like a marker of `to_text`. Lines
    are split as `str.splitlines` splits them (\\r, form feeds, U+2028, ... too), so no reader that
    splits lines finds a marker the code wrote."""
    lines = text.splitlines(keepends=True)
    return "".join("\\" + line if _MARKER_LIKE.match(line.lstrip()) else line for line in lines)


def _signal_name(num: int) -> str:
    try:
        return signal.Signals(num).name
    except ValueError:
        return str(num)
