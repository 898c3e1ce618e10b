"""Child-side half of `otbrl.tools.sandbox`: isolates itself, then runs the model's script.

Started as `python -I -S _launcher.py CONFIG_JSON` in a fresh single-threaded process, because
fork/unshare/setuid are unsafe in a `preexec_fn` of a multi-threaded trainer. Stdlib only, and never
imports `otbrl` (that would pull in torch). Process tree and protocol:

    launcher   joins the call's memory cgroup, unshares namespaces (mount, net, pid, ipc, uts; plus user
               when not root), builds the call's root filesystem on a fresh tmpfs
      init     pid 1 of the new pid namespace: mounts /proc, pivots into the new root (the host's root
               is detached), reaps orphans, reports, and on exit the kernel kills every process left
               in the namespace (daemons, setsid'd children, ...)
        user   drops to the per-call uid (root only), sets rlimits, execs `python -I main.py`

Status lines go to the inherited pipe `status_fd`: "note <text>" (weaker isolation than intended),
"error <text>" (setup failed), "memcg joined" (the memory cgroup holds the call) and
"exit <wait status>" (the user process finished).
"""

import ctypes
import json
import os
import resource
import signal
import stat
import sys
import time

CLONE_NEWNS = 0x00020000
CLONE_NEWCGROUP = 0x02000000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
MS_NOSUID, MS_NODEV, MS_NOEXEC = 2, 4, 8
MS_BIND, MS_MOVE, MS_REC, MS_PRIVATE = 4096, 8192, 16384, 1 << 18
PR_SET_PDEATHSIG, PR_SET_CHILD_SUBREAPER, PR_SET_NO_NEW_PRIVS = 1, 36, 38
PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 22, 2
# machine -> (AUDIT_ARCH_*, socket, io_uring_setup) syscall numbers for the fallback's seccomp filter
SECCOMP_ARCH = {
    "x86_64": (0xC000003E, 41, 425),
    "aarch64": (0xC00000B7, 198, 425),
    "riscv64": (0xC00000F3, 198, 425),
}
SYS_MOUNT_SETATTR = 442  # same number on x86_64 and aarch64
SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "riscv64": 41, "ppc64le": 203, "s390x": 217}
AT_FDCWD, AT_RECURSIVE, MOUNT_ATTR_RDONLY = -100, 0x8000, 1
MNT_DETACH = 2
# What a call sees of the host besides the interpreter's prefix, all read-only: the system's programs and
# shared libraries (the interpreter and its extension modules link against them) and the loader's
# configuration. Not there at all: /home, /root, /tmp, /run, /var (where host sockets live), /srv,
# /mnt, /media, /sys, the rest of /etc.
SYSTEM_PATHS = (
    "/usr",
    "/bin",
    "/sbin",
    "/lib",
    "/lib32",
    "/lib64",
    "/libx32",
    "/etc/ld.so.cache",
    "/etc/ld.so.conf",
    "/etc/ld.so.conf.d",
    "/etc/localtime",
    "/nix/store",  # Nix and Guix interpreters link against libraries in their stores
    "/gnu/store",
)

# Used when namespaces are unavailable. An audit hook only stops Python-level sockets (ctypes can
# still reach libc); it gives the clear message, the seccomp filter (`_deny_sockets`) the guarantee.
AUDIT_BOOTSTRAP = """
import runpy, sys
def _no_network(event, args):
    if event.startswith("socket."):
        raise PermissionError("network access is disabled in this sandbox")
sys.addaudithook(_no_network)
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p] * 3 + [ctypes.c_ulong, ctypes.c_char_p]
_libc.unshare.argtypes = [ctypes.c_int]
_libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
_libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
_libc.syscall.restype = ctypes.c_long


def _check(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _mount(src: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    enc = [None if s is None else s.encode() for s in (src, target, fstype, data)]
    _check(_libc.mount(enc[0], enc[1], enc[2], flags, enc[3]), f"mount {target}")


def _prctl(option: int, value: int) -> None:
    _check(_libc.prctl(option, value, 0, 0, 0), f"prctl {option}")


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def _unshare(root: bool) -> None:
    # cgroup: the call's own cgroup (joined before) is its root, host cgroup paths stay hidden
    flags = CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWPID | CLONE_NEWIPC | CLONE_NEWUTS | CLONE_NEWCGROUP
    if root:
        _check(_libc.unshare(flags), "unshare")
        return
    # An unprivileged user gets the other namespaces through a user namespace in which it keeps its own
    # uid; it holds capabilities there only until exec. RLIMIT_NPROC is then counted per user namespace
    # (Linux >= 5.14), so the limit does not include the trainer's own processes.
    uid, gid = os.getuid(), os.getgid()
    _check(_libc.unshare(flags | CLONE_NEWUSER), "unshare")
    _write("/proc/self/setgroups", "deny")
    _write("/proc/self/uid_map", f"{uid} {uid} 1")
    _write("/proc/self/gid_map", f"{gid} {gid} 1")


def _bind_into(root: str, path: str) -> None:
    """Show host `path` at the same place under `root`, as a symlink if it is one (merged /usr)."""
    path = os.path.normpath(path)
    target = root + path
    if path == "/" or not os.path.lexists(path) or os.path.lexists(target):
        return  # never the whole host; a path already shown (or under one) stays as it is
    os.makedirs(os.path.dirname(target), 0o755, exist_ok=True)
    if os.path.islink(path):
        os.symlink(os.readlink(path), target)
        return
    if os.path.isdir(path):
        os.mkdir(target, 0o755)
    else:
        open(target, "w").close()
    _mount(path, target, None, MS_BIND | MS_REC)


def _minimal_dev(root: str) -> None:
    """A tmpfs /dev with only the harmless devices: no GPUs (often mode 666), no disks, no /dev/shm."""
    dev = root + "/dev"
    os.mkdir(dev, 0o755)
    _mount("tmpfs", dev, "tmpfs", MS_NOSUID | MS_NOEXEC, "mode=0755,size=64k")
    for name in ("null", "zero", "full", "random", "urandom"):
        open(f"{dev}/{name}", "w").close()
        _mount(f"/dev/{name}", f"{dev}/{name}", None, MS_BIND)
    for name, target in (
        ("fd", "/proc/self/fd"),
        ("stdin", "/proc/self/fd/0"),
        ("stdout", "/proc/self/fd/1"),
        ("stderr", "/proc/self/fd/2"),
    ):
        os.symlink(target, f"{dev}/{name}")


def _build_root(cfg: dict) -> str:
    """The call's filesystem, on a fresh tmpfs at cfg["stage"]: the interpreter's prefix and
    SYSTEM_PATHS bound read-only at their own paths (so the interpreter's RUNPATH and compiled-in prefix
    stay valid), a minimal /dev, an empty /proc for init's, the script read-only and a size-limited
    tmpfs working directory, the only writable place. Whatever else the host has -- home directories,
    /tmp, sockets under /run and /var -- is not in it. init pivots into it (`_enter_root`)."""
    if SYS_PIVOT_ROOT.get(os.uname().machine) is None:
        raise OSError(38, f"pivot_root: syscall number unknown on {os.uname().machine}")
    # Private first: nothing mounted below may propagate back to the host's mount namespace.
    _mount(None, "/", None, MS_REC | MS_PRIVATE)
    root = cfg["stage"]
    _mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755,size=1m,nr_inodes=4096")
    shown = [*SYSTEM_PATHS, *cfg["extra_paths"]]
    for path in shown:
        _bind_into(root, path)
    prefix = cfg["prefix"]
    if prefix != "/" and not any(prefix == p or prefix.startswith(p + "/") for p in shown):
        _bind_into(root, prefix)
    _minimal_dev(root)
    os.mkdir(root + "/proc", 0o555)
    os.makedirs(root + cfg["workdir"], 0o755)  # its parent holds the script
    open(root + cfg["script"], "w").close()
    _mount(cfg["script"], root + cfg["script"], None, MS_BIND)
    attr = (ctypes.c_uint64 * 4)(MOUNT_ATTR_RDONLY, 0, 0, 0)
    ret = _libc.syscall(SYS_MOUNT_SETATTR, AT_FDCWD, root.encode(), AT_RECURSIVE, ctypes.byref(attr), 32)
    _check(ret, "mount_setattr read-only")
    owner = cfg["uid"] if cfg["uid"] is not None else os.getuid()
    group = cfg["uid"] if cfg["uid"] is not None else os.getgid()
    opts = f"mode=0700,uid={owner},gid={group},size={cfg['disk_kb']}k,nr_inodes={cfg['max_inodes']}"
    _mount("tmpfs", root + cfg["workdir"], "tmpfs", MS_NOSUID | MS_NODEV, opts)
    return root


def _enter_root(root: str, say) -> None:
    """In init (pid 1 of the new pid namespace): mount its /proc, then make `root` the root of the
    mount namespace and detach the host's root entirely, so no host path can be reached again."""
    try:  # while the host's /proc is still visible: a user namespace may mount proc only then
        _mount("proc", root + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    except OSError as e:
        say("note", f"no /proc in the sandbox ({e})")
    os.chdir(root)
    # pivot_root(".", "."): the old root ends up stacked on the new one, and is then detached
    _check(_libc.syscall(SYS_PIVOT_ROOT[os.uname().machine], b".", b"."), "pivot_root")
    _check(_libc.umount2(b".", MNT_DETACH), "detach the host root")
    os.chdir("/")


class _SockFilter(ctypes.Structure):
    _fields_ = [
        ("code", ctypes.c_uint16),
        ("jt", ctypes.c_uint8),
        ("jf", ctypes.c_uint8),
        ("k", ctypes.c_uint32),
    ]


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(_SockFilter))]


def _deny_sockets() -> None:
    """Without namespaces: a seccomp filter makes socket() fail with EACCES for every address family,
    so neither the network nor a host unix socket can be reached, ctypes or not (the audit hook stops
    Python-level sockets only). socketpair() (multiprocessing, asyncio) still works. io_uring, which
    can open sockets on its own, and foreign syscall ABIs (32-bit int 0x80, x32) are refused too."""
    arch, sys_socket, sys_io_uring_setup = SECCOMP_ARCH[os.uname().machine]
    ld, jeq, jge, ret = 0x20, 0x15, 0x35, 0x06  # BPF_LD|W|ABS, BPF_JMP|JEQ|K, BPF_JMP|JGE|K, BPF_RET|K
    deny, allow = 0x00050000 | 13, 0x7FFF0000  # SECCOMP_RET_ERRNO | EACCES, SECCOMP_RET_ALLOW
    program = [  # (code, jump if true, jump if false, k); jumps count from the next instruction
        (ld, 0, 0, 4),  # seccomp_data.arch
        (jeq, 0, 5, arch),
        (ld, 0, 0, 0),  # seccomp_data.nr
        (jge, 3, 0, 0x40000000),  # the x32 ABI's numbers
        (jeq, 2, 0, sys_socket),
        (jeq, 1, 0, sys_io_uring_setup),
        (ret, 0, 0, allow),
        (ret, 0, 0, deny),
    ]
    insns = (_SockFilter * len(program))(*(_SockFilter(*i) for i in program))
    fprog = _SockFprog(len(program), insns)
    _check(_libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.addressof(fprog), 0, 0), "seccomp")


def _join_cgroup(cfg: dict, say) -> bool:
    """Move this (not yet isolated) launcher into the call's memory cgroup; its children inherit it."""
    if cfg["cgroup_procs"] is None:
        return False
    try:
        _write(cfg["cgroup_procs"], str(os.getpid()))
    except OSError as e:
        if cfg["require_isolation"]:
            say("error", f"cannot join the memory cgroup: {e}")
            os._exit(70)
        say("note", f"cannot join the memory cgroup ({e}): {RLIMIT_NOTE}")
        return False
    say("memcg", "joined")
    return True


RLIMIT_NOTE = (
    "memory_mb bounds each process's address space only (RLIMIT_AS); memfd files, shared memory and "
    "several processes can together hold more"
)


def _exec_user(cfg: dict, isolated: bool, memcg: bool, say) -> None:
    uid = cfg["uid"]
    try:  # over the budget the OOM killer takes the model's processes first, not init or the launcher
        _write("/proc/self/oom_score_adj", "1000")  # before setuid, which makes /proc/self root's
    except OSError:
        pass
    if uid is not None:  # root: a fresh uid of its own, so RLIMIT_NPROC binds and DAC protects files
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
    _prctl(PR_SET_NO_NEW_PRIVS, 1)  # no setuid binaries (su, ping, ...) regain privileges
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # set after setuid, which clears it
    if not isolated and cfg.get("seccomp"):
        try:  # needs no privilege, only PR_SET_NO_NEW_PRIVS (set above)
            _deny_sockets()
        except OSError as e:
            say("note", f"no seccomp filter ({e}): ctypes can still open sockets")
    cpu = cfg["cpu_s"]
    mem = cfg["memory_mb"] * 1024 * 1024
    limits = [
        (resource.RLIMIT_CPU, (cpu, cpu + 1)),
        (resource.RLIMIT_FSIZE, (cfg["fsize"], cfg["fsize"])),
        (resource.RLIMIT_NOFILE, (cfg["nofile"], cfg["nofile"])),
        (resource.RLIMIT_CORE, (0, 0)),
    ]
    if isolated or uid is not None:  # else it would count all of the caller's processes: forks would fail
        limits.append((resource.RLIMIT_NPROC, (cfg["nproc"], cfg["nproc"])))
    if not memcg:  # the cgroup's budget is the limit where there is one; an address-space cap is a
        limits.append((resource.RLIMIT_AS, (mem, mem)))  # poor per-process stand-in (virtual, not RSS)
    for res, value in limits:
        resource.setrlimit(res, value)
    os.chdir(cfg["workdir"])
    python = cfg["python"]
    if isolated:
        argv = [python, "-I", cfg["script"]]
    else:
        argv = [python, "-I", "-c", AUDIT_BOOTSTRAP, cfg["script"]]
    os.execve(python, argv, cfg["env"])


def _init(cfg: dict, root: str | None, memcg: bool, say) -> None:
    isolated = root is not None
    if isolated:
        _enter_root(root, say)
    else:
        _prctl(PR_SET_CHILD_SUBREAPER, 1)  # orphans come back here rather than to the host's init
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    child = os.fork()
    if child == 0:
        try:
            _exec_user(cfg, isolated, memcg, say)
        except BaseException as e:  # noqa: BLE001 - report anything, the parent must never hang
            say("error", f"cannot start the interpreter as the sandbox user: {e}")
        os._exit(71)
    while True:  # reap orphans too, so zombies do not count against RLIMIT_NPROC
        try:
            pid, status = os.waitpid(-1, 0)
        except ChildProcessError:
            break
        if pid == child:
            say("exit", str(status))
            break


def main() -> None:
    signal.signal(signal.SIGTERM, _on_sigterm)
    cfg = json.loads(sys.argv[1])
    status_fd = cfg["status_fd"]
    os.set_inheritable(status_fd, False)  # closed at the user's exec: the code cannot fake a status

    def say(kind: str, text: str) -> None:
        os.write(status_fd, f"{kind} {' '.join(text.split())}\n".encode())

    os.umask(0o022)  # the new root's directories must be traversable by the sandbox's uid
    memcg = _join_cgroup(cfg, say)  # first: a cgroup is joined by host path, before the pivot
    root = None
    try:
        if not cfg["namespaces"]:
            raise OSError("disabled by the caller")
        _unshare(os.geteuid() == 0)
        root = _build_root(cfg)
    except OSError as e:
        if cfg["require_isolation"]:
            say("error", f"namespace isolation unavailable: {e}")
            os._exit(70)
        cfg["seccomp"] = os.uname().machine in SECCOMP_ARCH
        sockets = (
            "socket() is refused by a seccomp filter"
            if cfg["seccomp"]
            else "sockets are blocked by an audit hook only (ctypes can bypass it)"
        )
        say(
            "note",
            f"namespaces unavailable ({e}): no mount or pid isolation; {sockets}; the code may read "
            "what the host lets any user read and write to world-writable directories",
        )
        if cfg["uid"] is not None and not _reachable(cfg["python"]):
            say(
                "error",
                f"{cfg['python']} is not readable by an unprivileged uid and namespaces are "
                "unavailable to hide that; install Python outside a private directory such as /root",
            )
            os._exit(70)
    _prctl(PR_SET_CHILD_SUBREAPER, 1)  # orphans of a namespace-less run come back here to be killed
    pid = os.fork()
    if pid == 0:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        try:
            _init(cfg, root, memcg, say)
        except BaseException as e:  # noqa: BLE001
            say("error", f"sandbox init failed: {e}")
        os._exit(0)  # as pid 1 of the namespace this kills every process still in it
    global _init_pid
    _init_pid = pid
    os.close(status_fd)
    _reap(pid, cfg["uid"] if root is None else None)
    os._exit(0)


_init_pid: int | None = None


def _on_sigterm(signum, frame) -> None:
    """The sandbox's way to stop a run: kill init here so that it is reaped here, not by the host's
    pid 1 (which, in some containers, never reaps and would collect zombies)."""
    if _init_pid is not None:
        os.kill(_init_pid, signal.SIGKILL)


def _reap(init_pid: int, sweep_uid: int | None) -> None:
    """Wait for init; then (no namespaces, root) kill and reap whatever still runs as the call's uid,
    or (no namespaces, not root) reap what has already exited and leave."""
    global _init_pid
    while True:
        try:
            pid, _ = os.waitpid(-1, 0)
        except ChildProcessError:
            return
        if pid == init_pid:
            _init_pid = None
            break
    for _ in range(1000 if sweep_uid is not None else 1):
        pids = processes_of_uid(sweep_uid) if sweep_uid is not None else []
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            while os.waitpid(-1, os.WNOHANG)[0]:
                pass
        except ChildProcessError:
            if not pids:
                return
        time.sleep(0.002)


def processes_of_uid(uid: int) -> list[int]:
    """Live (non-zombie) processes whose real or effective uid is `uid`, from /proc."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/status") as f:
                fields = dict(line.split(":", 1) for line in f if ":" in line)
        except OSError:
            continue
        uids = fields.get("Uid", "").split()
        if fields.get("State", "").strip().startswith("Z") or len(uids) < 2:
            continue
        if uid in (int(uids[0]), int(uids[1])):
            pids.append(int(entry))
    return pids


def _reachable(path: str) -> bool:
    """Whether a uid that is neither owner nor group member can traverse to and execute `path`."""
    parts = os.path.realpath(path).strip("/").split("/")
    for i in range(1, len(parts) + 1):
        if not os.stat("/" + "/".join(parts[:i])).st_mode & stat.S_IXOTH:
            return False
    return True


if __name__ == "__main__":
    main()
