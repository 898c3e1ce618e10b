"""Ways out of the sandbox and ways to bend its report, as root and as an unprivileged user.

Each scenario runs in a fresh interpreter (`tests.tools.scenarios.scenario`): as the caller (root here),
and, when the caller is root, again as `nobody` with the system's interpreter, once with per-call
cgroups delegated to it (`nobody+cgroups`: the way an unprivileged trainer is meant to run) and where
it matters once without any (`nobody`: the call must then say in `notes` what it could not contain,
and `require_isolation=True` must refuse).

A scenario is (setup, code, check): `setup` runs in that interpreter before the call (adding a key to
its keyring, say) and may set `params`, which the code receives as `PARAMS`; `check` runs after it and
sets `check` from what the host sees (is the key still there?). The code prints what its system calls
returned: it is our test code, so its output is evidence here, never for the sandbox's own report.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

from otbrl.tools import run_python
from tests.tools.scenarios import WHO, assert_clean, needs_nr, scenario

pytestmark = [
    pytest.mark.skipif(sys.platform != "linux", reason="the sandbox is Linux-only"),
    pytest.mark.usefixtures("nothing_left_behind"),
]


# ---------------------------------------------------------------- 1. kernel keyrings

KEY_SETUP = """
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    serial = libc.syscall(NR["add_key"], b"user", b"otbrl-host-key", b"secret", 6, -3)  # session keyring
    assert serial > 0, ctypes.get_errno()
    params = {"serial": serial}
"""

KEY_ATTACK = """
    import ctypes, os
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    NR = PARAMS["nr"]
    serial = PARAMS["serial"]
    buf = ctypes.create_string_buffer(64)
    for name, args in [
        ("read", (NR["keyctl"], 11, serial, buf, 64)),              # KEYCTL_READ
        ("update", (NR["keyctl"], 2, serial, b"pwned", 5)),         # KEYCTL_UPDATE
        ("unlink", (NR["keyctl"], 9, serial, -3)),                  # KEYCTL_UNLINK from the session
        ("add", (NR["add_key"], b"user", b"otbrl-planted", b"x", 1, -3)),
        ("session", (NR["keyctl"], 0, -3, 0)),                      # KEYCTL_GET_KEYRING_ID
    ]:
        print(name, libc.syscall(*args), buf.value.decode(errors="replace") if name == "read" else "")
"""

KEY_CHECK = """
    buf = ctypes.create_string_buffer(64)
    n = libc.syscall(NR["keyctl"], 11, serial, buf, 64)
    found = libc.syscall(NR["keyctl"], 10, -3, b"user", b"otbrl-host-key", 0)  # KEYCTL_SEARCH
    planted = libc.syscall(NR["keyctl"], 10, -3, b"user", b"otbrl-planted", 0)
    check = {"payload": buf.raw[: max(n, 0)].decode(), "linked": found == serial, "planted": planted > 0}
    libc.syscall(NR["keyctl"], 9, serial, -3)
    if planted > 0:
        libc.syscall(NR["keyctl"], 9, planted, -3)
"""


@needs_nr
@pytest.mark.parametrize("who", WHO)
def test_the_callers_keyrings_are_out_of_reach(who, delegated):
    setup = KEY_SETUP + '    params["nr"] = NR\n'
    out = scenario(who, delegated, KEY_ATTACK, setup=setup, check=KEY_CHECK)
    assert_clean(out)
    calls = dict(line.split(" ", 2)[:2] for line in out["stdout"].splitlines())
    assert all(int(v) == -1 for v in calls.values()), out["stdout"]  # every key syscall refused
    assert "secret" not in out["stdout"]
    assert out["check"] == {"payload": "secret", "linked": True, "planted": False}, out["check"]


# ---------------------------------------------------------------- 2. nested namespaces, raw sockets

NAMESPACE_ATTACK = """
    import ctypes, os, socket
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    NR = PARAMS["nr"]
    def show(name, ret):
        print(name, "ok" if ret >= 0 else "refused")
    CLONE_NEWUSER, CLONE_NEWNET, SIGCHLD = 0x10000000, 0x40000000, 17
    pid = libc.syscall(NR["clone"], CLONE_NEWUSER | CLONE_NEWNET | SIGCHLD, 0, 0, 0, 0)
    if pid == 0:
        os._exit(0)
    if pid > 0:
        os.waitpid(pid, 0)
    show("clone", pid)
    show("clone3", libc.syscall(NR["clone3"], 0, 0))  # a null struct: refused before it is read
    show("setns", libc.syscall(NR["setns"], os.open("/proc/self/ns/net", os.O_RDONLY), 0))
    show("bpf", libc.syscall(NR["bpf"], 0, 0, 0))
    show("userfaultfd", libc.syscall(NR["userfaultfd"], 1))  # UFFD_USER_MODE_ONLY: no privilege needed
    attr = ctypes.create_string_buffer(128)
    ctypes.memmove(attr, (1).to_bytes(4, "little") + (128).to_bytes(4, "little"), 8)  # software event
    ctypes.memmove(ctypes.addressof(attr) + 40, (1 << 5 | 1 << 6).to_bytes(8, "little"), 8)  # user only
    show("perf_event_open", libc.syscall(NR["perf_event_open"], attr, 0, -1, -1, 0))
    show("ptrace", libc.syscall(NR["ptrace"], 0, 0, 0, 0))  # PTRACE_TRACEME
    try:
        open("/proc/sys/user/max_user_namespaces", "w").write("100")
        print("raise limit ok")
    except OSError:
        print("raise limit refused")
    print("userns limit", open("/proc/sys/user/max_user_namespaces").read().strip())
    # the attack itself: a user namespace of its own, where a packet socket (whose receive ring no
    # memory cgroup counts) and nf_tables are within reach
    show("unshare", libc.unshare(CLONE_NEWUSER | CLONE_NEWNET))
    for name, family, kind in [("packet", 17, socket.SOCK_RAW), ("raw", socket.AF_INET, socket.SOCK_RAW)]:
        try:
            socket.socket(family, kind, 0).close()
            print(name, "ok")
        except OSError:
            print(name, "refused")
"""


@needs_nr
@pytest.mark.parametrize("who", WHO)
def test_no_new_namespaces_raw_sockets_or_kernel_interfaces(who, delegated):
    out = scenario(who, delegated, NAMESPACE_ATTACK, setup="params = {'nr': NR}")
    assert_clean(out)
    lines = out["stdout"].splitlines()
    refused = [line for line in lines if line.endswith("refused")]
    assert len(refused) == len(lines) - 1, out["stdout"]  # everything but the limit line
    if any("no user namespace for the call" in n for n in out["notes"]):  # root where userns is off:
        return  # the limit is the host's and must stay so; seccomp alone refuses (checked above)
    assert "userns limit 0" in lines, out["stdout"]


def test_ordinary_processes_threads_and_sockets_still_work():
    code = """
        import multiprocessing.connection, socket, subprocess, threading
        t = threading.Thread(target=print, args=("thread",))
        t.start(); t.join()
        a, b = socket.socketpair()
        a.send(b"pair"); print(b.recv(4).decode())
        with multiprocessing.connection.Listener("listener", "AF_UNIX") as server:  # a unix stream server
            with multiprocessing.connection.Client("listener", "AF_UNIX") as client:
                client.send("unix"); print(server.accept().recv())
        print(subprocess.run(["echo", "child"], capture_output=True, text=True).stdout.strip())
    """
    result = run_python(textwrap.dedent(code), timeout_s=20)
    assert result.ok, result.to_text()
    assert result.stdout.split() == ["thread", "pair", "unix", "child"]


# ---------------------------------------------------------------- 3. signals to the supervisor

ORPHANED_GROUP = """
    import os, signal, time
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # this process survives its own trick
    # B, in our process group, stops a grandchild and exits while its parent A has moved to a group of
    # its own: the kernel finds B's group orphaned with a stopped member and sends the whole group
    # SIGHUP + SIGCONT -- the sandbox's own processes too, if they share that group.
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
    time.sleep(0.2)
    print("finished")
"""

KILL_AROUND = """
    import os, signal, time
    for s in (signal.SIGHUP, signal.SIGINT, signal.SIGTERM, signal.SIGUSR1):
        signal.signal(s, signal.SIG_IGN)
    for target in (0, 1, -1):
        for s in (signal.SIGHUP, signal.SIGINT, signal.SIGTERM, signal.SIGUSR1):
            try:
                os.kill(target, s)
            except OSError:
                pass
    time.sleep(0.5)
    print("finished")
"""


@pytest.mark.parametrize("who", WHO)
@pytest.mark.parametrize("code", [ORPHANED_GROUP, KILL_AROUND], ids=["orphaned-group-sighup", "kill-0-1-all"])
def test_signals_cannot_reach_init_or_the_launcher(who, delegated, code):
    out = scenario(who, delegated, code)
    assert_clean(out)
    assert out["exit_code"] == 0 and out["stdout"] == "finished\n", out


OOM_VICTIM = """
    import os, subprocess, sys
    for value in ("-1000", "0"):  # below the start value needs CAP_SYS_RESOURCE; back to 0 does not
        try:
            with open("/proc/self/oom_score_adj", "w") as f:
                f.write(value)
        except OSError:
            print("oom_score_adj", value, "refused", flush=True)
    sys.stderr.write("MODEL TEXT\\n")
    sys.stderr.flush()
    # Memory that no process's RSS shows (tmpfs files), written by small programs while this process
    # becomes `sleep`: the largest processes in the cgroup are then the sandbox's own Python ones.
    subprocess.Popen(["sh", "-c", "i=0; while :; do head -c 4194304 /dev/zero > f$i; i=$((i+1)); done"])
    os.execv("/bin/sleep", ["sleep", "2"])
"""


@pytest.mark.parametrize("who", WHO)
def test_the_code_cannot_make_the_oom_killer_take_the_supervisor(who, delegated):
    out = scenario(who, delegated, OOM_VICTIM, memory_mb=64, max_file_mb=64)
    if any("memory cgroup" in n for n in out["notes"]):
        pytest.skip(f"no memory cgroup: {out['notes']}")
    assert_clean(out)
    assert out["limit_hit"] == "memory" and "MODEL TEXT" not in str(out["error"]), out
    assert "oom_score_adj -1000 refused" in out["stdout"]


def test_a_supervisor_killed_from_outside_gives_an_error_without_the_codes_text():
    import signal
    import threading

    code = "import sys, time\nsys.stderr.write('MODEL TEXT\\n')\nsys.stderr.flush()\ntime.sleep(5)"
    out = {}
    thread = threading.Thread(target=lambda: out.update(result=run_python(code, timeout_s=20)))
    start = time.monotonic()
    thread.start()
    launcher = None
    while launcher is None and time.monotonic() - start < 5:  # the launcher: our child running _launcher.py
        time.sleep(0.1)
        for entry in filter(str.isdigit, os.listdir("/proc")):
            try:
                cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
                ppid = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            if ppid == os.getpid() and b"_launcher.py" in cmdline:
                launcher = int(entry)
    assert launcher is not None
    time.sleep(0.5)  # the code has written its text by now
    os.kill(launcher, signal.SIGKILL)
    thread.join(30)
    result = out["result"]
    assert result.error is not None and "MODEL TEXT" not in result.error, result
    assert result.duration_s < 5 and result.limit_hit is None


# ---------------------------------------------------------------- 5. reports the code cannot forge


@pytest.mark.parametrize(
    "code",
    [
        "import sys\nsys.stderr.write('Resource temporarily unavailable\\n')\nsys.exit(1)",
        "import sys\nsys.stderr.write('OSError: [Errno 27] File too large\\n')\nsys.exit(1)",
        "import sys\nsys.stderr.write('OSError: [Errno 24] Too many open files\\n')\nsys.exit(1)",
        "import os, signal\nos.kill(os.getpid(), signal.SIGXCPU)",
    ],
    ids=["eagain-text", "efbig-text", "emfile-text", "self-sigxcpu"],
)
def test_printed_text_and_self_sent_signals_set_no_limit(code):
    result = run_python(code, timeout_s=10)
    assert result.error is None and result.exit_code != 0
    assert result.limit_hit is None, result


THREADS = """
    import threading, time
    stop = threading.Event()
    started = 0
    try:
        for _ in range(64):
            threading.Thread(target=stop.wait).start()
            started += 1
    except RuntimeError as e:
        print("refused after", started, e)
    stop.set()
"""


@pytest.mark.parametrize("who", WHO)
def test_threads_count_against_the_process_limit_and_are_reported(who, delegated):
    out = scenario(who, delegated, THREADS, max_processes=8)
    assert_clean(out)
    assert out["stdout"].startswith("refused after"), out
    assert int(out["stdout"].split()[2]) < 8
    assert out["limit_hit"] == "processes", out


# ---------------------------------------------------------------- 6. one CPU budget per call

CPU_BURN = """
    import os
    for _ in range(5):  # six processes, each under a per-process limit of cpu_s
        if os.fork() == 0:
            break
    while True:
        pass
"""


@pytest.mark.parametrize("who", WHO)
def test_one_cpu_budget_for_all_processes_of_a_call(who, delegated):
    out = scenario(who, delegated, CPU_BURN, cpu_s=1, timeout_s=30)
    assert_clean(out)
    assert out["limit_hit"] == "cpu", out
    assert out["cpu_used_s"] is not None and 1 <= out["cpu_used_s"] < 2, out
    assert out["duration_s"] < 20


def test_cpu_budget_counts_what_the_call_used_when_it_finishes_under_it():
    result = run_python("x = 0\nfor i in range(200000):\n    x += i", cpu_s=5)
    assert result.ok and result.cpu_used_s is not None and 0 < result.cpu_used_s < 5, result


# ---------------------------------------------------------------- nobody without any cgroup: says so

WITHOUT_CGROUPS = """
    print("ran")
"""


def test_an_unprivileged_call_without_cgroups_says_what_it_cannot_bound(delegated):
    out = scenario("nobody", delegated, WITHOUT_CGROUPS)
    assert_clean(out)
    notes = " ".join(out["notes"])
    for what in ("memory cgroup", "pids cgroup", "cpu accounting"):
        assert what in notes, notes
    refused = scenario("nobody", delegated, WITHOUT_CGROUPS, require_isolation=True)
    assert refused["error"] is not None and refused["stdout"] == ""


# ---------------------------------------------------------------- 7. the namespace-less fallback


@pytest.fixture
def no_namespaces(monkeypatch):
    from otbrl.tools import sandbox
    from otbrl.tools._launcher import _reachable

    if os.geteuid() != 0:
        pytest.skip("without namespaces a non-root sandbox shares the caller's uid: not contained")
    python = next((p for p in ("/usr/bin/python3", "/usr/local/bin/python3") if _reachable(p)), None)
    if python is None:
        pytest.skip("no interpreter an unprivileged uid can run")
    monkeypatch.setattr(sandbox, "_NAMESPACES", False)
    monkeypatch.setattr(sandbox, "PYTHON", python)


def _sysv_keys(kind: str) -> set[int]:
    lines = Path(f"/proc/sysvipc/{kind}").read_text().splitlines()[1:]
    return {int(line.split()[0]) for line in lines}


@needs_nr
def test_fallback_leaves_no_sysv_ipc_or_shared_memory_files_and_says_what_it_cannot_contain(no_namespaces):
    key = 0x07B70000 + os.getpid() % 0xFFFF
    code = f"""
        import ctypes, os
        libc = ctypes.CDLL(None, use_errno=True)
        print("shmget", libc.shmget({key}, 1 << 20, 0o1666))  # IPC_CREAT | 0666
        print("msgget", libc.msgget({key}, 0o1666))
        print("semget", libc.semget({key}, 1, 0o1666))
        for path in ("/dev/shm/otbrl-left-{os.getpid()}", "/tmp/otbrl-left-{os.getpid()}"):
            try:
                open(path, "w").write("x")
                print("wrote", path)
            except OSError as e:
                print("refused", path, type(e).__name__)
    """
    before = {kind: _sysv_keys(kind) for kind in ("shm", "msg", "sem")}
    try:
        result = run_python(textwrap.dedent(code), timeout_s=10)
        assert result.error is None, result
        for kind in ("shm", "msg", "sem"):
            assert key not in _sysv_keys(kind) - before[kind], (kind, result.stdout)
        for path in (f"/dev/shm/otbrl-left-{os.getpid()}", f"/tmp/otbrl-left-{os.getpid()}"):
            assert not os.path.exists(path), (path, result.stdout)
        notes = " ".join(result.notes)
        for what in ("SysV", "world-writable", "read what"):
            assert what in notes, notes
    finally:
        for path in (f"/dev/shm/otbrl-left-{os.getpid()}", f"/tmp/otbrl-left-{os.getpid()}"):
            if os.path.exists(path):
                os.remove(path)
        subprocess.run(["ipcrm", "-M", str(key)], capture_output=True)
        subprocess.run(["ipcrm", "-Q", str(key)], capture_output=True)
        subprocess.run(["ipcrm", "-S", str(key)], capture_output=True)
    refused = run_python("print('ran')", require_isolation=True)
    assert refused.error is not None and "namespace" in refused.error and refused.stdout == ""


# ---------------------------------------------------------------- 8. arguments, before any code runs

SLOW = "import time\ntime.sleep(2)\nprint('ran')"


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"timeout_s": math.inf}, "timeout_s"),
        ({"timeout_s": math.nan}, "timeout_s"),
        ({"timeout_s": True}, "timeout_s"),
        ({"timeout_s": "5"}, "timeout_s"),
        ({"timeout_s": -1}, "timeout_s"),
        ({"cpu_s": -5}, "cpu_s"),
        ({"cpu_s": 0}, "cpu_s"),
        ({"cpu_s": True}, "cpu_s"),
        ({"cpu_s": math.inf}, "cpu_s"),
        ({"memory_mb": 2**44}, "memory_mb"),
        ({"memory_mb": 1.5}, "memory_mb"),
        ({"memory_mb": True}, "memory_mb"),
        ({"memory_mb": 0}, "memory_mb"),
        ({"max_output_bytes": 1.5}, "max_output_bytes"),
        ({"max_output_bytes": True}, "max_output_bytes"),
        ({"max_output_bytes": 2**40}, "max_output_bytes"),
        ({"max_processes": True}, "max_processes"),
        ({"max_processes": 10**6}, "max_processes"),
        ({"max_file_mb": 2**44}, "max_file_mb"),
        ({"max_file_mb": 2.0}, "max_file_mb"),
        ({"max_open_files": 0}, "max_open_files"),
        ({"max_open_files": 10**9}, "max_open_files"),
        ({"require_isolation": "yes"}, "require_isolation"),
    ],
)
def test_bad_arguments_are_refused_before_the_code_runs(kwargs, name):
    start = time.monotonic()
    result = run_python(SLOW, **kwargs)
    assert result.error is not None and name in result.error and "\n" not in result.error, result.error
    assert result.stdout == "" and time.monotonic() - start < 1.5  # the code (2 s) never ran


def test_oversized_code_is_refused_before_anything_is_written():
    mark = f"otbrl-sandbox-{os.getpid()}-"
    before = {d for d in os.listdir(tempfile.gettempdir()) if d.startswith(mark)}
    result = run_python("#" * (64 << 20))
    assert result.error is not None and "code" in result.error and "\n" not in result.error
    assert {d for d in os.listdir(tempfile.gettempdir()) if d.startswith(mark)} == before


def test_good_arguments_of_every_accepted_type_run():
    result = run_python("print('ok')", timeout_s=5, cpu_s=2.5, memory_mb=128, max_processes=4)
    assert result.ok and result.stdout == "ok\n", result


# ---------------------------------------------------------------- the seccomp program itself (no kernel)


def _bpf_run(program, nr: int, arch: int, args=(0,) * 6) -> int:
    """A classic-BPF interpreter for the instructions a seccomp filter uses, over struct seccomp_data
    (little-endian): the reference the program is checked against."""
    data = nr.to_bytes(4, "little", signed=True) + arch.to_bytes(4, "little") + bytes(8)
    data += b"".join((a & (2**64 - 1)).to_bytes(8, "little") for a in (*args, *[0] * (6 - len(args))))
    acc, pc = 0, 0
    while True:
        code, jt, jf, k = program[pc]
        pc += 1
        if code == 0x20:  # BPF_LD | BPF_W | BPF_ABS
            acc = int.from_bytes(data[k : k + 4], "little")
        elif code == 0x54:  # BPF_ALU | BPF_AND | BPF_K
            acc &= k
        elif code == 0x06:  # BPF_RET | BPF_K
            return k
        elif code in (0x15, 0x25, 0x35, 0x45):  # JEQ, JGT, JGE, JSET with K
            taken = {0x15: acc == k, 0x25: acc > k, 0x35: acc >= k, 0x45: bool(acc & k)}[code]
            pc += jt if taken else jf
        else:
            raise AssertionError(f"unexpected opcode {code:#x}")


ALLOW, EPERM, EACCES, ENOSYS = 0x7FFF0000, 0x50000 | 1, 0x50000 | 13, 0x50000 | 38


@pytest.mark.parametrize("machine", ["x86_64", "aarch64", "riscv64"])
def test_the_seccomp_program_decides_as_documented(machine):
    from otbrl.tools import _seccomp

    audit, table, x32 = _seccomp.ARCHES[machine]
    prog = _seccomp.program(machine)
    fallback = _seccomp.program(machine, fallback=True)
    read = 0 if machine == "x86_64" else 63

    def run(name_or_nr, args=(), p=prog, arch=audit):
        nr = table[name_or_nr] if isinstance(name_or_nr, str) else name_or_nr
        return _bpf_run(p, nr, arch, args)

    assert run(read) == ALLOW
    for name in (
        "keyctl",
        "add_key",
        "request_key",
        "unshare",
        "setns",
        "bpf",
        "userfaultfd",
        "perf_event_open",
        "ptrace",
        "mount",
        "io_uring_setup",
        "process_vm_readv",
    ):
        assert run(name) == EPERM, name
    assert run("clone3") == ENOSYS
    assert run("clone", (17,)) == ALLOW  # fork
    assert run("clone", (0x3D0F00,)) == ALLOW  # a thread (CLONE_VM | CLONE_THREAD | ...)
    for flag in (0x10000000, 0x20000000, 0x40000000, 0x20000, 0x80, 0x02000000, 0x04000000, 0x08000000):
        assert run("clone", (flag | 17,)) == EPERM, hex(flag)
    for call in ("socket", "socketpair"):
        assert run(call, (1, 0o2000001)) == ALLOW  # AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC
        assert run(call, (1, 2)) == ALLOW and run(call, (1, 5)) == ALLOW  # SOCK_DGRAM, SOCK_SEQPACKET
        assert run(call, (1, 3)) == EPERM  # AF_UNIX, SOCK_RAW
        # every other family, whatever the type: inet, inet6, netlink, packet, AF_ALG, vsock, AF_XDP
        for family in (2, 10, 16, 17, 38, 40, 44, 0, 46, 0xFFFF):
            for kind in (1, 2, 3, 5 | 0o4000):
                assert run(call, (family, kind)) == EPERM, (call, family, kind)
        assert run(call, ((1 << 32) | 16, 2)) == EPERM  # the kernel reads an int: netlink, not AF_UNIX
    assert run("socketpair", (1, 1), p=fallback) == ALLOW and run("socketpair", (16, 2), p=fallback) == EPERM
    assert run("prlimit64", (0, 7)) == ALLOW  # the caller's own limits (what setrlimit does)
    for pid in (1, 2, 12345, -1, 0xFFFFFFFF):
        assert run("prlimit64", (pid, 7)) == EPERM, pid  # init, the launcher, anyone else
    assert run("shmget") == ALLOW and run("shmget", p=fallback) == EPERM
    assert run("socket", (1, 1), p=fallback) == EACCES
    assert run(_seccomp.MAX_KNOWN + 1) == ENOSYS  # newer than this policy: refused until reviewed
    assert run(read, arch=0x40000003) == ENOSYS  # another ABI (i386)
    if x32:
        assert run(0x40000000 | read) == ENOSYS


@pytest.mark.parametrize(
    ("header", "machine"),
    [
        ("/usr/include/x86_64-linux-gnu/asm/unistd_64.h", "x86_64"),
        ("/usr/include/asm-generic/unistd.h", "aarch64"),
    ],
)
def test_the_syscall_tables_match_the_kernel_headers(header, machine):
    import re

    from otbrl.tools import _seccomp

    if not os.path.exists(header):
        pytest.skip(f"{header} is not installed")
    text = Path(header).read_text()
    defined = {m[0]: int(m[1]) for m in re.findall(r"#define __NR(?:3264)?_(\w+)\s+(\d+)\b", text)}
    table = _seccomp.ARCHES[machine][1]
    checked = [name for name in table if name in defined]
    assert len(checked) >= len(table) - 2  # open_tree_attr is newer than older headers
    assert {name: table[name] for name in checked} == {name: defined[name] for name in checked}


# ---------------------------------------------------------------- the report's sources (no kernel)


def test_a_launcher_that_died_gives_an_error_without_the_codes_text():
    from otbrl.tools import sandbox

    # no "exit" line: the launcher (and init) died before reporting; stderr holds the code's text
    result = sandbox._result(b"", b"MODEL TEXT", "cgroups joined\n", None, 4096, 0.1, 5.0, 5.0, [], None, -9)
    assert result.error is not None and "MODEL TEXT" not in result.error and "-9" in result.error
    assert result.limit_hit is None and result.stderr == "MODEL TEXT"


def test_limits_come_from_the_counters_not_from_the_exit(tmp_path):
    from otbrl.tools import _cgroup, sandbox

    def report(status, usage, killed_for=None):
        return sandbox._result(b"", b"", status, killed_for, 4096, 0.1, 5.0, 2.0, [], usage, None).limit_hit

    quiet = _cgroup.Usage(0, False, 1 << 20, 0, 0.5)
    joined = "cgroups joined\n"
    assert report(joined + f"exit {9 << 0} 0.1\n", quiet) is None  # SIGKILL, no counter: nothing
    assert report(joined + f"exit {24} 3.0\n", quiet) is None  # SIGXCPU, the cgroup says 0.5 CPU-s
    assert report(joined + "exit 0 0.1\n", _cgroup.Usage(0, False, 1, 3, 0.5)) == "processes"
    assert report(joined + "exit 0 0.1\n", _cgroup.Usage(0, False, 1, 0, 2.0)) == "cpu"
    assert report(joined + "exit 0 0.1\n", _cgroup.Usage(1, True, 1, 0, 0.5)) == "memory"
    assert report(joined + "exit 256 0.1\nfsize reached\n", quiet) == "file_size"
    # without cgroups (fallback): RLIMIT_CPU's signal counts only with the kernel's rusage behind it
    assert report("exit 24 0.2\n", None) is None
    assert report("exit 24 2.0\n", None) == "cpu"


def test_v2_keeps_memory_pids_and_cpu_in_one_directory(tmp_path, monkeypatch):
    from otbrl.tools import _cgroup

    (tmp_path / "cgroup.subtree_control").write_text("memory pids\n")
    found = _cgroup._find_others((str(tmp_path), 2))
    assert found == {"cpu": (str(tmp_path), 2), "pids": (str(tmp_path), 2)}
    (tmp_path / "cgroup.subtree_control").write_text("memory\n")
    assert "pids is not in" in _cgroup._find_others((str(tmp_path), 2))["pids"]
    call = tmp_path / "call"
    call.mkdir()
    (call / "cpu.stat").write_text("usage_usec 1500000\nuser_usec 1000000\nsystem_usec 500000\n")
    (call / "pids.events").write_text("max 4\n")
    group = _cgroup.CallCgroups()
    group.cpu = group.pids = _cgroup.Cgroup(str(call), 2)
    assert group.cpu_seconds() == 1.5 and group.usage().forks_refused == 4
    # a v1 delegation lists one directory per hierarchy
    dirs = []
    for name, marker in (("mem", "memory.limit_in_bytes"), ("pids", "pids.max"), ("acct", "cpuacct.usage")):
        (tmp_path / name).mkdir()
        (tmp_path / name / marker).write_text("0\n")
        dirs.append(str(tmp_path / name))
    monkeypatch.setenv(_cgroup.ENV_PARENT, os.pathsep.join(dirs))
    assert _cgroup._find_parent() == (dirs[0], 1)
    assert _cgroup._find_others((dirs[0], 1)) == {"pids": (dirs[1], 1), "cpu": (dirs[2], 1)}
