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


# ---------------------------------------------------------------- report


def _machine() -> str:
    import importlib

    for module in ("otbrl.app.studies.report", "otbrl.studies.report"):  # now, and at c251123
        try:
            import torch

            return importlib.import_module(module).machine(torch.get_num_threads())
        except (ImportError, AttributeError):
            continue
    return f"{platform.machine()}, {os.cpu_count()} CPUs; Python {platform.python_version()}"


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
        dirty = subprocess.run(
            ["git", "-C", str(repo), "status", "--porcelain", "--", "otbrl"], capture_output=True, text=True
        ).stdout.strip()
        return out.stdout.strip() + (" + uncommitted changes in otbrl/" if dirty else "")
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
    now = {"machine": _machine(), "environment": _environment(), "commit": _commit(), "cases": cases}

    command = ".venv/bin/python benchmarks/bench_sandbox.py"
    if args.out.resolve() != (RESULTS / "sandbox.md").resolve():
        command += f" --out {args.out}"
    if args.before:
        command += f" --before {args.before}"
    text = page(now, before, command)
    print(table(now, before))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    data = dict(now, before=before)
    args.out.with_suffix(".json").write_text(json.dumps(data, indent=1) + "\n")
    print(f"wrote {args.out} and {args.out.with_suffix('.json')}")


if __name__ == "__main__":
    sys.exit(main())
