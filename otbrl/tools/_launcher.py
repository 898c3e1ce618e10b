"""Child-side half of `otbrl.tools.sandbox`: isolates itself, then runs the model's script.

Started as `python -I -S _launcher.py CONFIG_FD CALL_DIR` in a fresh single-threaded process, because
fork/unshare/setuid are unsafe in a `preexec_fn` of a multi-threaded trainer; the configuration (JSON)
comes through the pipe CONFIG_FD, not the command line. Stdlib only, and never imports `otbrl` (that
would pull in torch). Process tree and protocol:

    launcher   opens the call's cgroups (without joining them: the supervisor stays out of the call's
               memory budget, so the OOM killer cannot take it), unshares namespaces (user, mount, net,
               pid, ipc, uts), builds the call's root filesystem on a fresh tmpfs. As root it creates
               the user namespace with the call's uid as its effective uid, so that uid owns it: the
               kernel charges per-user quotas (inotify instances, message-queue bytes, pending signals,
               processes) of everything inside to the namespace's owner, and that owner is then a uid
               of the call's own, not the trainer's. A helper outside writes the uid map (root and the
               call's uid), and the launcher becomes root of the namespace again.
      init     pid 1 of the new pid namespace: mounts /proc, pivots into the new root (the host's root
               is detached), reaps orphans, reports, and on exit the kernel kills every process left
               in the namespace (daemons, setsid'd children, ...). Not dumpable (its /proc files are
               root's, not the code's, whatever the uid), and its command line overwritten: the code
               sees it as pid 1, and must learn nothing of the host from it.
        user   joins the call's cgroups, starts a session of its own, its own cgroup namespace and an
               empty session keyring, sets the limits of its user namespace (no new namespaces, a few
               inotify instances and watches), drops to the per-call uid (root only), sets rlimits
               (pending signals and message-queue bytes among them) and the seccomp policy
               (`_seccomp.py`), execs `python -I main.py`

Init and the launcher ignore the signals a job-control trick or `kill(0, ...)` could send them (HUP,
INT, QUIT, TERM for init, USR1/2, ALRM, TSTP/TTIN/TTOU), and try `oom_score_adj=-1000`.

Status lines go to the inherited pipe `status_fd`, which the code never holds (close-on-exec):
"note <text>" (weaker isolation than intended), "error <text>" (setup failed), "cgroups joined" (the
call's cgroups hold the code), "exit <wait status> <CPU seconds of the user process and its reaped
children>" and "fsize reached" (a file in the working directory reached the file-size limit).
"""

import ctypes
import json
import os
import resource
import shutil
import signal
import stat
import sys
import time

if __package__:  # imported by sandbox.py (for RLIMIT_NOTE, processes_of_uid)
    from otbrl.tools import _seccomp
else:  # run as a script with -I, which leaves its own directory off sys.path
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import _seccomp

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
PR_SET_DUMPABLE, PR_SET_NAME = 4, 15
INIT_TITLE = b"otbrl-sandbox-init"  # what the code reads in /proc/1/cmdline instead of host paths
SYS_MOUNT_SETATTR = 442  # same number on x86_64 and aarch64
SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "riscv64": 41, "ppc64le": 203, "s390x": 217}
SYS_KEYCTL = {"x86_64": 250, "aarch64": 219, "riscv64": 219}
KEYCTL_JOIN_SESSION_KEYRING = 1
AT_FDCWD, AT_RECURSIVE, MOUNT_ATTR_RDONLY, MOUNT_ATTR_NOSUID = -100, 0x8000, 1, 2
# Signals the code could aim at init or the launcher (kill(0, ...), kill(1, ...), an orphaned process
# group's SIGHUP): ignored there, and reset to the default in the code's process before exec.
SUPERVISOR_IGNORES = (
    signal.SIGHUP,
    signal.SIGINT,
    signal.SIGQUIT,
    signal.SIGUSR1,
    signal.SIGUSR2,
    signal.SIGALRM,
    signal.SIGTSTP,
    signal.SIGTTIN,
    signal.SIGTTOU,
)
# Every namespace limit of the sandbox's user namespace is set to 0 once the call's namespaces exist
# (the user-namespace one is bubblewrap's --disable-userns); seccomp refuses new namespaces as well.
NAMESPACE_LIMITS = ("user", "mnt", "pid", "net", "ipc", "uts", "cgroup", "time")
# The call's share of the per-user inotify quotas, set in its user namespace (the kernel checks every
# level: this one per call, then the host's for the namespace's owner). Tool code needs few.
INOTIFY_LIMITS = {"max_inotify_instances": 16, "max_inotify_watches": 1024}
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
# still reach libc); it gives the clear message, the seccomp policy (`_seccomp.py`) the guarantee.
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


def _unshare(cfg: dict, say) -> bool:
    """Unshare the call's namespaces; True when they include a user namespace of their own (then its
    namespace limits can be set to 0 without touching the host's). The cgroup namespace is made later,
    by the user process once it has joined the call's cgroups."""
    flags = CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWPID | CLONE_NEWIPC | CLONE_NEWUTS
    uid, gid = os.getuid(), os.getgid()
    if uid != 0:
        # An unprivileged user gets the other namespaces through a user namespace in which it keeps
        # its own uid; it holds capabilities there only until exec. RLIMIT_NPROC is then counted per
        # user namespace (Linux >= 5.14), so the limit does not include the trainer's own processes.
        _check(_libc.unshare(flags | CLONE_NEWUSER), "unshare")
        _write("/proc/self/setgroups", "deny")
        _write("/proc/self/uid_map", f"{uid} {uid} 1")
        _write("/proc/self/gid_map", f"{gid} {gid} 1")
        return True
    # Root: root and the call's uid keep their host ids inside. Only a process outside the new user
    # namespace may write such a map, so a helper forked before the unshare writes it. The namespace
    # is created with the call's uid as effective uid, which makes that uid its owner (see the module
    # docstring: per-user quotas are charged to the owner); the launcher is root inside afterwards.
    call = cfg["uid"]
    mapping = f"0 0 1\n{call} {call} 1\n"
    go_r, go_w = os.pipe()
    helper = os.fork()
    if helper == 0:
        os.close(go_w)
        code = 1
        try:
            if os.read(go_r, 1) == b"1":
                for name in ("uid_map", "gid_map"):
                    _write(f"/proc/{os.getppid()}/{name}", mapping)
                code = 0
        finally:
            os._exit(code)
    os.close(go_r)
    try:
        os.setresgid(0, call, 0)  # the group first: with a non-zero euid there is no CAP_SETGID left
        os.setresuid(0, call, 0)  # real and saved uid stay 0, so the way back needs no capability
        created = _libc.unshare(flags | CLONE_NEWUSER) == 0
        err = ctypes.get_errno()
    except OSError as e:  # the call's uid is not mapped here (a trainer in a user namespace itself)
        created, err = False, e.errno
    if not created:
        os.setresuid(0, 0, 0)
        os.setresgid(0, 0, 0)
        os.write(go_w, b"0")
        os.close(go_w)
        os.waitpid(helper, 0)
        why = os.strerror(err)
        say(
            "note",
            f"no user namespace for the call ({why}): its namespace limits stay the host's, and the "
            "code's per-user quotas are its own uid's on the host",
        )
        _check(_libc.unshare(flags), "unshare")
        return False
    os.write(go_w, b"1")
    os.close(go_w)
    if os.waitstatus_to_exitcode(os.waitpid(helper, 0)[1]) != 0:
        raise SystemExit(_fail(say, "cannot write the uid map of the call's user namespace"))
    os.setresuid(0, 0, 0)  # root of the new namespace (mapped to the host's root, whose files it binds)
    os.setresgid(0, 0, 0)
    return True


def _fail(say, text: str) -> int:
    say("error", text)
    return 70


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
    attr = (ctypes.c_uint64 * 4)(MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID, 0, 0, 0)
    ret = _libc.syscall(SYS_MOUNT_SETATTR, AT_FDCWD, root.encode(), AT_RECURSIVE, ctypes.byref(attr), 32)
    _check(ret, "mount_setattr read-only, nosuid")
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


RLIMIT_NOTE = (
    "memory_mb bounds each process's address space only (RLIMIT_AS); memfd files, shared memory, "
    "socket buffers and several processes can together hold more, and a MemoryError from that limit is "
    "not reported in limit_hit"
)


def _join_cgroups(cfg: dict, fds: list[int], say) -> bool:
    """Move this process (the code's, before exec) into the call's cgroups through descriptors the
    launcher opened on the host: its children inherit them, init and the launcher stay outside."""
    try:
        for fd in fds:
            os.write(fd, b"0")  # "0": the writing process itself
    except OSError as e:
        if cfg["require_isolation"]:
            say("error", f"cannot join the call's cgroups: {e}")
            os._exit(70)
        say("note", f"cannot join the call's cgroups ({e}): {RLIMIT_NOTE}")
        return False
    finally:
        for fd in fds:
            os.close(fd)
    if fds:
        say("cgroups", "joined")
    return bool(fds)


def _limit_user_namespace(say) -> None:
    """Set the limits of the call's user namespace: every namespace limit to 0 (bubblewrap's
    --disable-userns, for all kinds), so the code cannot create one even through a kernel bug in the
    seccomp policy's path; and its inotify instances and watches to the call's share (INOTIFY_LIMITS),
    which the kernel checks before the host's per-user quota of the namespace's owner."""
    failed = []
    limits = {f"max_{kind}_namespaces": 0 for kind in NAMESPACE_LIMITS}
    for name, value in {**limits, **INOTIFY_LIMITS}.items():
        try:
            _write(f"/proc/sys/user/{name}", str(value))
        except OSError as e:
            if e.errno != 2:  # a kind this kernel lacks (time namespaces before 5.6)
                failed.append(f"{name}: {e.strerror}")
    if failed:
        say("note", f"could not set the limits of the sandbox's user namespace ({'; '.join(failed)})")


def _fresh_keyring(say) -> None:
    """A new, empty session keyring: the caller's (inherited over fork) is no longer possessed."""
    nr = SYS_KEYCTL.get(os.uname().machine)
    if nr is None or _libc.syscall(nr, KEYCTL_JOIN_SESSION_KEYRING, None) < 0:
        say("note", "no fresh session keyring (key system calls are still refused by seccomp)")


def _exec_user(cfg: dict, isolated: bool, userns: bool, cgroup_fds: list[int], say) -> None:
    uid = cfg["uid"]
    for sig in (*SUPERVISOR_IGNORES, signal.SIGTERM):  # an ignored signal would stay ignored past exec
        signal.signal(sig, signal.SIG_DFL)
    try:  # over the budget the OOM killer takes the model's processes first
        _write("/proc/self/oom_score_adj", "1000")  # before setuid, which makes /proc/self root's
    except OSError:
        pass
    cgroups = _join_cgroups(cfg, cgroup_fds, say)
    os.setsid()  # own session and process group: kill(0, ...) and job-control signals stay in the call
    if isolated:
        try:  # the call's own cgroup is the root of what it sees; host cgroup paths stay hidden
            _check(_libc.unshare(CLONE_NEWCGROUP), "unshare cgroup namespace")
        except OSError as e:
            say("note", f"no cgroup namespace ({e})")
    if userns:
        _limit_user_namespace(say)
    if uid is not None:  # root: a fresh uid of its own, so RLIMIT_NPROC binds and DAC protects files
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
    _fresh_keyring(say)  # after setuid: the new keyring belongs to the call's uid
    _prctl(PR_SET_NO_NEW_PRIVS, 1)  # no setuid binaries (su, ping, ...) regain privileges
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # set after setuid, which clears it
    cpu = cfg["rlimit_cpu"]
    mem = cfg["memory_mb"] * 1024 * 1024
    limits = [
        (resource.RLIMIT_CPU, (cpu, cpu + 1)),
        (resource.RLIMIT_FSIZE, (cfg["fsize"], cfg["fsize"])),
        (resource.RLIMIT_NOFILE, (cfg["nofile"], cfg["nofile"])),
        (resource.RLIMIT_CORE, (0, 0)),
        # per-user quotas, counted for the call's uid in its user namespace and again for the
        # namespace's owner on the host: the call's share of them, whoever that owner is
        (resource.RLIMIT_SIGPENDING, (cfg["sigpending"], cfg["sigpending"])),
        (resource.RLIMIT_MSGQUEUE, (cfg["msgqueue"], cfg["msgqueue"])),
    ]
    if isolated or uid is not None:  # else it would count all of the caller's processes: forks would fail
        limits.append((resource.RLIMIT_NPROC, (cfg["nproc"], cfg["nproc"])))
    if not cgroups or not cfg["memcg"]:  # the cgroup's budget is the limit where there is one; an
        limits.append((resource.RLIMIT_AS, (mem, mem)))  # address-space cap is a poor per-process stand-in
    for res, (soft, hard) in limits:
        current = resource.getrlimit(res)[1]  # never above the inherited hard limit (that would fail)
        if current != resource.RLIM_INFINITY:
            soft, hard = min(soft, current), min(hard, current)
        resource.setrlimit(res, (soft, hard))
    os.chdir(cfg["workdir"])
    python = cfg["python"]
    if isolated:
        argv = [python, "-I", cfg["script"]]
    else:
        argv = [python, "-I", "-c", AUDIT_BOOTSTRAP, cfg["script"]]
    try:  # last: everything above may use calls the policy refuses (unshare, keyctl)
        _seccomp.install(fallback=not isolated)
    except OSError as e:
        if cfg["require_isolation"]:
            say("error", f"no seccomp policy: {e}")
            os._exit(70)
        say("note", f"no seccomp policy ({e}): keys, new namespaces, raw sockets and bpf are not refused")
    os.execve(python, argv, cfg["env"])


def _ignore_signals() -> None:
    for sig in SUPERVISOR_IGNORES:
        signal.signal(sig, signal.SIG_IGN)
    try:  # where allowed (CAP_SYS_RESOURCE): the OOM killer's last choice. It is outside the call's
        _write("/proc/self/oom_score_adj", "-1000")  # memory cgroup anyway, so that OOM cannot take it
    except OSError:
        pass


def _hide_command_line() -> None:
    """Overwrite this process's argument area -- what /proc/<pid>/cmdline shows anyone -- with
    INIT_TITLE, and its name. Init is a fork of the launcher, whose arguments name host paths; the code
    sees init as pid 1. Python keeps its own copy of argv, so nothing here reads the area again."""
    with open("/proc/self/stat", "rb") as f:
        fields = f.read().rsplit(b")", 1)[1].split()  # from field 3 (state) on
    start, end = int(fields[48 - 3]), int(fields[49 - 3])  # arg_start, arg_end (proc(5))
    size = end - start
    if size > 0:  # the title (cut to fit), then zeros to the end; the last byte stays a zero
        ctypes.memmove(start, INIT_TITLE[: size - 1].ljust(size, b"\0"), size)
    name = ctypes.create_string_buffer(INIT_TITLE[:15])  # the kernel keeps 15 bytes of a name
    _libc.prctl(PR_SET_NAME, ctypes.addressof(name), 0, 0, 0)


def _init(cfg: dict, root: str | None, userns: bool, cgroup_fds: list[int], say) -> None:
    isolated = root is not None
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # only the launcher's SIGKILL ends init
    try:
        _hide_command_line()
    except (OSError, ValueError, IndexError) as e:
        say("note", f"init's command line could not be overwritten ({e}): it names the launcher's path")
    # Not dumpable: init's /proc files belong to root (of the host, or of the namespace), so the code
    # cannot write them (oom_score_adj, ...) nor open its memory or fds, also where it shares init's
    # uid (a non-root trainer). The user process turns it back on for itself before exec.
    _prctl(PR_SET_DUMPABLE, 0)
    if isolated:
        _enter_root(root, say)
    else:
        _prctl(PR_SET_CHILD_SUBREAPER, 1)  # orphans come back here rather than to the host's init
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    child = os.fork()
    if child == 0:
        try:
            _prctl(PR_SET_DUMPABLE, 1)  # the code's own /proc files stay its own (oom_score_adj, ...)
            _exec_user(cfg, isolated, userns, cgroup_fds, say)
        except BaseException as e:  # noqa: BLE001 - report anything, the parent must never hang
            say("error", f"cannot start the interpreter as the sandbox user: {e}")
        os._exit(71)
    for fd in cgroup_fds:
        os.close(fd)
    while True:  # reap orphans too, so zombies do not count against RLIMIT_NPROC
        try:
            pid, status, usage = os.wait4(-1, 0)
        except ChildProcessError:
            break
        if pid == child:  # its CPU time, its reaped children's included: the fallback's CPU report
            say("exit", f"{status} {usage.ru_utime + usage.ru_stime:.3f}")
            break


def main() -> None:
    signal.signal(signal.SIGTERM, _on_sigterm)
    _ignore_signals()
    cfg = json.loads(_read_all(int(sys.argv[1])))
    status_fd = cfg["status_fd"]
    os.set_inheritable(status_fd, False)  # closed at the user's exec: the code cannot fake a status

    def say(kind: str, text: str) -> None:
        os.write(status_fd, f"{kind} {' '.join(text.split())}\n".encode())

    os.umask(0o022)  # the new root's directories must be traversable by the sandbox's uid
    cgroup_fds = []
    for path in cfg["cgroup_procs"]:  # opened by host path, before the pivot; joined by the code only
        try:
            cgroup_fds.append(os.open(path, os.O_WRONLY | os.O_CLOEXEC))
        except OSError as e:
            if cfg["require_isolation"]:
                os._exit(_fail(say, f"cannot open the call's cgroup {path}: {e}"))
            say("note", f"cannot open the call's cgroup {path} ({e})")
    root, userns, unshared = None, False, False
    try:
        if not cfg["namespaces"]:
            raise OSError("disabled by the caller")
        userns = _unshare(cfg, say)
        unshared = True
        root = _build_root(cfg)
    except OSError as e:
        if unshared:  # in new namespaces but without a root to enter: no safe way to go on
            os._exit(_fail(say, f"cannot build the sandbox's root: {e}"))
        if cfg["require_isolation"]:
            os._exit(_fail(say, f"namespace isolation unavailable: {e}"))
        if os.geteuid() == 0:
            uncontained = (
                "files it leaves in world-writable directories other than /tmp, /var/tmp and /dev/shm "
                "(whose files of the call's uid are removed afterwards) outlive the call"
            )
        else:
            uncontained = (
                "files it leaves in world-writable directories and processes it starts in a new session "
                "outlive the call, it can signal the caller's processes, and the process limit is not set"
            )
        say(
            "note",
            f"namespaces unavailable ({e}): no mount, pid or IPC isolation. The code may read what the host "
            f"lets any user read and write to world-writable directories; {uncontained}. socket() and SysV "
            "IPC (and POSIX message queues) are refused by the seccomp policy",
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
        try:
            _init(cfg, root, userns, cgroup_fds, say)
        except BaseException as e:  # noqa: BLE001
            say("error", f"sandbox init failed: {e}")
        os._exit(0)  # as pid 1 of the namespace this kills every process still in it
    global _init_pid
    _init_pid = pid
    for fd in cgroup_fds:
        os.close(fd)
    _reap(pid)
    if _file_at_limit(cfg["workdir"], cfg["fsize"]):
        say("fsize", "reached")
    os.close(status_fd)  # the supervisor's sign that the call is over
    if root is None and cfg["uid"] is not None:
        _sweep_uid(cfg["uid"])
    os._exit(0)


_init_pid: int | None = None


def _read_all(fd: int) -> bytes:
    """The configuration, from the pipe the supervisor wrote it to (then closed here)."""
    chunks = []
    while chunk := os.read(fd, 65536):
        chunks.append(chunk)
    os.close(fd)
    return b"".join(chunks)


def _on_sigterm(signum, frame) -> None:
    """The sandbox's way to stop a run: kill init here so that it is reaped here, not by the host's
    pid 1 (which, in some containers, never reaps and would collect zombies)."""
    if _init_pid is not None:
        os.kill(_init_pid, signal.SIGKILL)


def _reap(init_pid: int) -> None:
    """Wait for init, reaping whatever else comes back here (orphans of a namespace-less run)."""
    global _init_pid
    while True:
        try:
            pid, _ = os.waitpid(-1, 0)
        except ChildProcessError:
            return
        if pid == init_pid:
            _init_pid = None
            return


def _file_at_limit(workdir: str, fsize: int) -> bool:
    """Whether a file in the working directory reached RLIMIT_FSIZE: the kernel's own record that a
    write was cut (a file cannot grow past the limit), read after the code has stopped."""
    count = 0
    for top, _, files in os.walk(workdir):
        for name in files:
            count += 1
            try:
                st = os.lstat(os.path.join(top, name))
            except OSError:
                continue
            if stat.S_ISREG(st.st_mode) and st.st_size >= fsize:
                return True
        if count > 100_000:  # the tmpfs bounds inodes; a host directory (fallback) might not
            return False
    return False


def _sweep_uid(uid: int) -> None:
    """Namespace-less, as root: kill and reap whatever still runs as the call's uid, then remove what
    that uid left in the shared temporary directories."""
    for _ in range(1000):
        pids = processes_of_uid(uid)
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
                break
        time.sleep(0.002)
    for shared in ("/tmp", "/var/tmp", "/dev/shm"):
        try:
            entries = list(os.scandir(shared))
        except OSError:
            continue
        for entry in entries:
            try:
                if entry.stat(follow_symlinks=False).st_uid != uid:
                    continue
                if entry.is_dir(follow_symlinks=False):
                    shutil.rmtree(entry.path, ignore_errors=True)
                else:
                    os.unlink(entry.path)
            except OSError:
                pass


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
