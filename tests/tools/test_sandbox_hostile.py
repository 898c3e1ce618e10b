"""Hostile model code: every case must be contained, reported, and leave nothing behind.

The fork bomb runs with a small process limit and a short deadline so the suite stays safe on a shared
machine. Tests of containment that only namespaces provide are skipped, with the reason, where the
sandbox reports (in `notes`) that it had to run without them.
"""

import os
import signal
import socket
import sys
import tempfile
import textwrap
import time

import pytest

from otbrl.tools import run_python
from tests.tools.sandbox_checks import isolated, memcg, sandbox_processes

pytestmark = [
    pytest.mark.skipif(sys.platform != "linux", reason="the sandbox is Linux-only"),
    pytest.mark.usefixtures("nothing_left_behind"),
]


def _run(code: str, **kwargs):
    kwargs.setdefault("timeout_s", 5)
    result = run_python(textwrap.dedent(code), **kwargs)
    assert result.error is None, result.error
    return result


def test_fork_bomb_is_contained():
    code = """
        import os
        while True:
            try:
                os.fork()
            except OSError:
                pass
    """
    start = time.monotonic()
    result = _run(code, timeout_s=1.5, max_processes=16)
    # whichever bound the kernel reports first: the process limit, the call's CPU budget (cpu_s defaults
    # to timeout_s and is shared by every process: a bomb on an idle 2-core machine spends it in ~0.8 s
    # of wall time) or the wall clock
    assert result.limit_hit in ("timeout", "processes", "cpu")
    assert time.monotonic() - start < 5
    assert sandbox_processes() == []


def test_process_limit_is_enforced():
    code = """
        import os, time
        made = 0
        for _ in range(100):
            try:
                pid = os.fork()
            except OSError:
                break
            if pid == 0:
                time.sleep(2)
                os._exit(0)
            made += 1
        print(made)
    """
    result = _run(code, max_processes=8)
    assert int(result.stdout) < 8  # the script itself is one of the 8
    assert sandbox_processes() == []


def test_infinite_loop_hits_the_wall_clock_limit_quickly():
    start = time.monotonic()
    result = _run("while True:\n    pass", timeout_s=1)
    assert result.limit_hit == "timeout" and result.exit_code is None
    assert time.monotonic() - start < 3
    assert "time limit" in result.to_text()


def test_sleeping_process_hits_the_wall_clock_limit():
    result = _run("import time\ntime.sleep(60)", timeout_s=1)
    assert result.limit_hit == "timeout" and result.duration_s < 3


def test_cpu_limit_stops_the_run():
    result = _run("while True:\n    pass", timeout_s=10, cpu_s=1)
    assert result.limit_hit == "cpu" and result.duration_s < 5
    if result.cpu_used_s is not None:  # the call's CPU accounting: the supervisor stopped it
        assert result.exit_code is None and 1 <= result.cpu_used_s < 1.5
    else:  # per-process RLIMIT_CPU, confirmed by the kernel's rusage of the process
        assert result.exit_code == -signal.SIGXCPU


def test_memory_bomb_hits_the_memory_limit():
    code = """
        chunks = []
        while True:
            chunks.append(bytearray(16 * 1024 * 1024))
    """
    result = _run(code, memory_mb=128)
    assert result.exit_code != 0
    assert result.limit_hit == ("memory" if memcg(result) else None)
    if memcg(result):  # the kernel's OOM killer ended it, and counted the kill
        assert result.exit_code == -signal.SIGKILL and result.memory_peak_mb <= 128
    else:  # RLIMIT_AS: the allocation failed inside Python; no kernel counter reports it
        assert "MemoryError" in result.stderr


def test_socket_to_loopback_cannot_reach_the_parent(tmp_path):
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(5)
    server.settimeout(0.5)
    port = server.getsockname()[1]
    code = f"""
        import socket
        try:
            s = socket.socket()  # refused by the seccomp policy; its namespace's loopback is down too
            s.settimeout(2)
            s.connect(("127.0.0.1", {port}))
            s.sendall(b"leak")
            print("CONNECTED")
        except OSError as e:
            print("blocked:", e)
    """
    try:
        result = _run(code)
        assert "blocked" in result.stdout and "CONNECTED" not in result.stdout
        with pytest.raises(TimeoutError):  # the parent's server saw no connection at all
            server.accept()
    finally:
        server.close()


@pytest.fixture
def parent_dir():
    """A directory of the parent's that other users may enter and read, as a trainer's files are."""
    path = tempfile.mkdtemp(prefix="otbrl-test-parent-")
    os.chmod(path, 0o755)
    yield path
    import shutil

    shutil.rmtree(path)


def test_writing_and_deleting_outside_the_working_directory(parent_dir):
    victim = os.path.join(parent_dir, "precious.txt")
    with open(victim, "w") as f:
        f.write("keep me")
    code = f"""
        import os, shutil
        for action in (lambda: os.remove({victim!r}),
                       lambda: open({victim!r}, 'w').write('overwritten'),
                       lambda: open({os.path.join(parent_dir, "planted.txt")!r}, 'w').write('x'),
                       lambda: shutil.rmtree({parent_dir!r}),
                       lambda: open(os.path.expanduser('~/../main.py'), 'w').write('x')):
            try:
                action()
                print("DONE")
            except OSError as e:
                print("refused:", type(e).__name__)
    """
    result = _run(code)
    assert "DONE" not in result.stdout and result.stdout.count("refused") == 5, result.to_text()
    with open(victim) as f:
        assert f.read() == "keep me"
    assert os.listdir(parent_dir) == ["precious.txt"]


def test_world_writable_directories_are_read_only(parent_dir):
    shared = os.path.join(parent_dir, "shared")
    os.mkdir(shared)
    os.chmod(shared, 0o777)
    target = os.path.join(shared, "dropped.txt")
    result = _run(f"open({target!r}, 'w').write('x')\nprint('WROTE')")
    if not isolated(result):
        pytest.skip("no mount namespace: world-writable directories stay writable (documented)")
    assert "WROTE" not in result.stdout and not os.path.exists(target)


def test_parent_environment_is_not_visible(monkeypatch):
    monkeypatch.setenv("OTBRL_TEST_SECRET", "hunter2")
    code = f"""
        import os
        print(sorted(os.environ))
        print("hunter2" in repr(dict(os.environ)))
        for pid in ({os.getpid()}, os.getppid(), 1):
            try:
                print("hunter2" in open(f"/proc/{{pid}}/environ").read())
            except OSError as e:
                print("unreadable", type(e).__name__)
    """
    result = _run(code)
    assert "OTBRL_TEST_SECRET" not in result.stdout and "hunter2" not in result.stdout
    assert "True" not in result.stdout, result.stdout


def test_huge_stdout_is_bounded_and_stops_the_run():
    start = time.monotonic()
    result = _run("import sys\nwhile True:\n    sys.stdout.write('x' * 65536)", max_output_bytes=2000)
    assert result.limit_hit == "output" and result.truncated
    assert len(result.stdout) == 2000 and time.monotonic() - start < 5
    assert "truncated" in result.to_text()


def test_huge_stderr_is_bounded():
    result = _run("import sys\nsys.stderr.write('e' * 10_000_000)", max_output_bytes=1000)
    assert result.truncated and len(result.stderr) <= 1000


@pytest.mark.parametrize(
    ("code", "exit_code"),
    [("import sys\nsys.exit(3)", 3), ("import os\nos._exit(7)", 7), ("import sys\nsys.exit('bye')", 1)],
)
def test_exits_are_reported(code, exit_code):
    result = _run(code)
    assert result.exit_code == exit_code and result.limit_hit is None
    assert f"[exit code {exit_code}]" in result.to_text()


def test_ctypes_segfault_is_reported_as_a_signal():
    result = _run("import ctypes\nctypes.string_at(0)")
    assert result.exit_code == -signal.SIGSEGV
    assert "SIGSEGV" in result.to_text()


def test_self_kill_is_reported_as_a_signal():
    result = _run("import os, signal\nos.kill(os.getpid(), signal.SIGKILL)")
    assert result.exit_code == -signal.SIGKILL


def test_children_left_running_are_killed():
    marker = "1234.5678"  # a sleep duration nobody else uses
    code = f"""
        import os, subprocess, time
        subprocess.Popen(["sleep", "{marker}"])                       # plain child
        subprocess.Popen(["sleep", "{marker}"], start_new_session=True)  # escapes the process group
        if os.fork() == 0:                                             # double-forked daemon
            os.setsid()
            if os.fork() == 0:
                os.execvp("sleep", ["sleep", "{marker}"])
            os._exit(0)
        time.sleep(0.2)
        print("spawned")
    """
    result = _run(code)
    assert result.stdout == "spawned\n" and result.exit_code == 0
    leftovers = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                if marker.encode() in f.read():
                    leftovers.append(int(entry))
        except OSError:
            continue
    assert leftovers == []


def test_file_size_limit():
    code = "open('big', 'wb').write(b'x' * (3 * 1024 * 1024))"
    result = _run(code, max_file_mb=1)
    assert result.limit_hit == "file_size" and "File too large" in result.stderr


def test_hostile_neighbour_does_not_disturb_a_concurrent_call():
    import threading

    bomb = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    out = {}

    def neighbour() -> None:
        out["bomb"] = run_python(bomb, timeout_s=1.5, max_processes=8)

    thread = threading.Thread(target=neighbour)
    thread.start()
    time.sleep(0.3)
    calm = run_python("import os\nprint(sum(range(10)))", timeout_s=10)
    thread.join()
    assert calm.ok and calm.stdout == "45\n", calm.to_text()
    assert out["bomb"].limit_hit in ("timeout", "processes", "cpu")  # the first bound reached


# ---------------------------------------------------------------- without namespaces (weaker, documented)


@pytest.fixture
def no_namespaces(monkeypatch):
    """The fallback for hosts that refuse unshare: rlimits, a per-call uid (root) and an audit hook."""
    from otbrl.tools import sandbox
    from otbrl.tools._launcher import _reachable

    if os.geteuid() != 0:
        pytest.skip("without namespaces a non-root sandbox shares the caller's uid: not contained")
    python = os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)
    if not _reachable(python):  # e.g. pyenv under /root: namespaces are what make it reachable
        python = next(
            (
                p
                for p in ("/usr/bin/python3", "/usr/local/bin/python3")
                if os.path.exists(p) and _reachable(p)
            ),
            None,
        )
        if python is None:
            pytest.skip("no interpreter an unprivileged uid can run")
    monkeypatch.setattr(sandbox, "_NAMESPACES", False)
    monkeypatch.setattr(sandbox, "PYTHON", python)


def test_fallback_reports_that_it_is_weaker(no_namespaces):
    result = _run("print('hi')")
    assert result.ok and not isolated(result)


def test_fallback_blocks_python_sockets(no_namespaces):
    result = _run("import socket\nsocket.create_connection(('127.0.0.1', 9))")
    assert "network access is disabled" in result.stderr


def test_fallback_hides_the_environment(no_namespaces, monkeypatch):
    monkeypatch.setenv("OTBRL_TEST_SECRET", "hunter2")
    code = f"import os\nprint(dict(os.environ))\nprint(open('/proc/{os.getpid()}/environ').read())"
    result = _run(code)
    assert "hunter2" not in result.stdout + result.stderr and "PermissionError" in result.stderr


def test_fallback_protects_the_parents_files(no_namespaces, parent_dir):
    victim = os.path.join(parent_dir, "precious.txt")
    with open(victim, "w") as f:
        f.write("keep me")
    result = _run(f"import os\nos.remove({victim!r})")
    assert "PermissionError" in result.stderr and os.listdir(parent_dir) == ["precious.txt"]


def test_fallback_contains_a_fork_bomb(no_namespaces):
    bomb = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    result = _run(bomb, timeout_s=1.5, max_processes=16)
    assert result.limit_hit in ("timeout", "processes", "cpu") and sandbox_processes() == []


def test_fallback_kills_escaped_children(no_namespaces):
    marker = "2345.6789"
    code = f"import subprocess\nsubprocess.Popen(['sleep', '{marker}'], start_new_session=True)\nprint('ok')"
    result = _run(code)
    assert result.stdout == "ok\n", result
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                assert marker.encode() not in f.read()
        except OSError:
            continue
