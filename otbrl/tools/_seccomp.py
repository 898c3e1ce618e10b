"""The sandbox's system-call policy: a seccomp filter, written as classic BPF, for every sandboxed call.

Modelled on the container runtimes' default seccomp profile (Docker's, which bubblewrap users also apply),
but written as a deny list, with two rules that give it an allow list's default:
  * a system call numbered above the newest one this module knows (`MAX_KNOWN`) fails with ENOSYS, so a
    kernel interface added after this list was written is refused until someone reviews it;
  * a foreign ABI (32-bit `int 0x80` or x32 on x86_64) is refused outright: its numbers mean other calls.
What it refuses (EPERM unless said otherwise), and why:
  * key management (`add_key`, `keyctl`, `request_key`): keyrings are not namespaced;
  * new namespaces: `unshare`, `setns`, `clone` with any CLONE_NEW* flag; `clone3` fails with ENOSYS
    (its flags sit in memory a filter cannot read), so the C library falls back to `clone`;
  * every socket family but AF_UNIX, for `socket` and `socketpair` alike: netlink, vsock, AF_ALG, packet,
    inet and the rest. AF_UNIX buffers are charged to the call's memory cgroup (the kernel allocates
    them with __GFP_ACCOUNT since Linux 4.7); a netlink socket's are not (code held 129 MiB of them
    under a 32 MiB budget), a vsock port is taken in the machine-wide port space, outside the network
    namespace, and inet reaches nothing in the call's network namespace, whose loopback is down. Raw
    sockets (SOCK_RAW, SOCK_PACKET) are refused in AF_UNIX too;
  * `prlimit64` on any process but the caller (a pid argument other than 0): as a non-root trainer,
    init shares the code's uid, and the kernel would let the code change init's limits;
  * kernel interfaces with a long record of exploits or that reach other processes: `bpf`,
    `userfaultfd`, `perf_event_open`, `ptrace`, `process_vm_readv/writev`, `kcmp`, `pidfd_getfd`,
    `process_madvise`, io_uring, `fanotify_init`, `name_to_handle_at`/`open_by_handle_at`;
  * administration that needs privileges the code does not have anyway (mounts and the new mount API,
    modules, kexec, reboot, swap, clocks, quotas, accounting, NUMA policy, `personality`, ...): refused
    here too, so a kernel bug in a permission check is not reachable.
The namespace-less fallback (`fallback=True`) also refuses every `socket()` (EACCES; an AF_UNIX
`socketpair` still works), and SysV IPC and POSIX message queues (`shmget`, `msgget`, `semget`,
`mq_open`), which would outlive the call without an IPC namespace of its own.

Stdlib only: `_launcher.py` installs it in the sandbox's user process just before `execve`.
"""

from __future__ import annotations

import ctypes
import errno
import os

# The newest system call known here (file_setattr, Linux 6.17; numbers from 424 on are shared by every
# architecture). Anything above it is refused with ENOSYS.
MAX_KNOWN = 469

# name -> number, from the kernel's asm/unistd_64.h (x86_64) and asm-generic/unistd.h (aarch64,
# riscv64). Only the calls the policy names; a name missing on an architecture does not exist there.
X86_64 = {
    "socket": 41,
    "socketpair": 53,
    "prlimit64": 302,
    "shmget": 29,
    "semget": 64,
    "msgget": 68,
    "clone": 56,
    "ptrace": 101,
    "syslog": 103,
    "uselib": 134,
    "personality": 135,
    "ustat": 136,
    "sysfs": 139,
    "vhangup": 153,
    "pivot_root": 155,
    "_sysctl": 156,
    "adjtimex": 159,
    "chroot": 161,
    "acct": 163,
    "settimeofday": 164,
    "mount": 165,
    "umount2": 166,
    "swapon": 167,
    "swapoff": 168,
    "reboot": 169,
    "sethostname": 170,
    "setdomainname": 171,
    "iopl": 172,
    "ioperm": 173,
    "create_module": 174,
    "init_module": 175,
    "delete_module": 176,
    "get_kernel_syms": 177,
    "query_module": 178,
    "quotactl": 179,
    "nfsservctl": 180,
    "lookup_dcookie": 212,
    "clock_settime": 227,
    "mbind": 237,
    "set_mempolicy": 238,
    "mq_open": 240,
    "kexec_load": 246,
    "add_key": 248,
    "request_key": 249,
    "keyctl": 250,
    "migrate_pages": 256,
    "unshare": 272,
    "move_pages": 279,
    "perf_event_open": 298,
    "fanotify_init": 300,
    "name_to_handle_at": 303,
    "open_by_handle_at": 304,
    "clock_adjtime": 305,
    "setns": 308,
    "process_vm_readv": 310,
    "process_vm_writev": 311,
    "kcmp": 312,
    "finit_module": 313,
    "kexec_file_load": 320,
    "bpf": 321,
    "userfaultfd": 323,
}
GENERIC = {
    "lookup_dcookie": 18,
    "umount2": 39,
    "mount": 40,
    "pivot_root": 41,
    "nfsservctl": 42,
    "chroot": 51,
    "vhangup": 58,
    "quotactl": 60,
    "acct": 89,
    "personality": 92,
    "unshare": 97,
    "kexec_load": 104,
    "init_module": 105,
    "delete_module": 106,
    "clock_settime": 112,
    "syslog": 116,
    "ptrace": 117,
    "reboot": 142,
    "sethostname": 161,
    "setdomainname": 162,
    "settimeofday": 170,
    "adjtimex": 171,
    "mq_open": 180,
    "msgget": 186,
    "semget": 190,
    "shmget": 194,
    "socket": 198,
    "socketpair": 199,
    "prlimit64": 261,
    "add_key": 217,
    "request_key": 218,
    "keyctl": 219,
    "clone": 220,
    "swapon": 224,
    "swapoff": 225,
    "mbind": 235,
    "set_mempolicy": 237,
    "migrate_pages": 238,
    "move_pages": 239,
    "perf_event_open": 241,
    "fanotify_init": 262,
    "name_to_handle_at": 264,
    "open_by_handle_at": 265,
    "clock_adjtime": 266,
    "setns": 268,
    "process_vm_readv": 270,
    "process_vm_writev": 271,
    "kcmp": 272,
    "finit_module": 273,
    "bpf": 280,
    "userfaultfd": 282,
    "kexec_file_load": 294,
}
SHARED = {  # the same number on every architecture
    "io_uring_setup": 425,
    "io_uring_enter": 426,
    "io_uring_register": 427,
    "open_tree": 428,
    "move_mount": 429,
    "fsopen": 430,
    "fsconfig": 431,
    "fsmount": 432,
    "fspick": 433,
    "clone3": 435,
    "pidfd_getfd": 438,
    "process_madvise": 440,
    "mount_setattr": 442,
    "quotactl_fd": 443,
    "open_tree_attr": 467,
}
# machine -> (AUDIT_ARCH_*, table, whether numbers >= 0x40000000 are another ABI: x32)
ARCHES = {
    "x86_64": (0xC000003E, {**X86_64, **SHARED}, True),
    "aarch64": (0xC00000B7, {**GENERIC, **SHARED}, False),
    "riscv64": (0xC00000F3, {**GENERIC, **SHARED}, False),
}

DENIED = (
    # keyrings are not namespaced: the caller's keys would be reachable
    "add_key",
    "keyctl",
    "request_key",
    # namespaces (clone with CLONE_NEW* flags and clone3 are handled apart)
    "unshare",
    "setns",
    # reach into other processes, or kernel interfaces with a long record of exploits
    "bpf",
    "userfaultfd",
    "perf_event_open",
    "ptrace",
    "process_vm_readv",
    "process_vm_writev",
    "kcmp",
    "pidfd_getfd",
    "process_madvise",
    "io_uring_setup",
    "io_uring_enter",
    "io_uring_register",
    "fanotify_init",
    "name_to_handle_at",
    "open_by_handle_at",
    "lookup_dcookie",
    # mounts, old and new API
    "mount",
    "umount2",
    "pivot_root",
    "chroot",
    "open_tree",
    "open_tree_attr",
    "move_mount",
    "fsopen",
    "fsconfig",
    "fsmount",
    "fspick",
    "mount_setattr",
    # system administration
    "init_module",
    "finit_module",
    "delete_module",
    "create_module",
    "get_kernel_syms",
    "query_module",
    "kexec_load",
    "kexec_file_load",
    "reboot",
    "swapon",
    "swapoff",
    "acct",
    "quotactl",
    "quotactl_fd",
    "syslog",
    "settimeofday",
    "clock_settime",
    "clock_adjtime",
    "adjtimex",
    "iopl",
    "ioperm",
    "nfsservctl",
    "uselib",
    "ustat",
    "sysfs",
    "_sysctl",
    "vhangup",
    "sethostname",
    "setdomainname",
    "personality",
    "mbind",
    "set_mempolicy",
    "migrate_pages",
    "move_pages",
)
FALLBACK_DENIED = ("shmget", "msgget", "semget", "mq_open")  # outlive the call without an IPC namespace

CLONE_NAMESPACES = 0x7E020080  # NEWTIME|NEWNS|NEWCGROUP|NEWUTS|NEWIPC|NEWUSER|NEWPID|NEWNET
AF_UNIX = 1  # the one socket family the code may use
SOCK_RAW, SOCK_PACKET, SOCK_TYPE_MASK = 3, 10, 0xF  # the type's low bits; the rest are NONBLOCK/CLOEXEC

# classic BPF opcodes, and seccomp return values
LD_ABS, JEQ, JGT, JGE, JSET, AND, RET = 0x20, 0x15, 0x25, 0x35, 0x45, 0x54, 0x06
RET_ALLOW = 0x7FFF0000
RET_ERRNO = 0x00050000
NR_OFFSET, ARCH_OFFSET = 0, 4


def _arg_low(i: int) -> int:
    """Offset of the low 32 bits of argument `i` in struct seccomp_data (little-endian machines)."""
    return 16 + 8 * i


def program(machine: str, fallback: bool = False) -> list[tuple[int, int, int, int]]:
    """The filter as (code, jt, jf, k) instructions. Raises KeyError on an unsupported machine."""
    audit_arch, table, x32 = ARCHES[machine]
    deny = [table[n] for n in DENIED if n in table]
    if fallback:
        deny += [table[n] for n in FALLBACK_DENIED]
    # (code, jump-if-true label or 0, jump-if-false label or 0, k) with labels resolved below
    code: list[tuple] = [
        (LD_ABS, 0, 0, ARCH_OFFSET),
        (JEQ, 0, "enosys", audit_arch),
        (LD_ABS, 0, 0, NR_OFFSET),
    ]
    if x32:
        code.append((JGE, "enosys", 0, 0x40000000))
    code.append((JGT, "enosys", 0, MAX_KNOWN))
    code += [(JEQ, "eperm", 0, nr) for nr in sorted(set(deny))]
    code += [
        (JEQ, "enosys", 0, table["clone3"]),
        (JEQ, "clone", 0, table["clone"]),
        (JEQ, "socket", 0, table["socket"]),
        (JEQ, "socketpair", 0, table["socketpair"]),
        (JEQ, "prlimit", 0, table["prlimit64"]),
        (RET, 0, 0, RET_ALLOW),
        ("clone",),
        (LD_ABS, 0, 0, _arg_low(0)),  # flags: the first argument on x86_64, aarch64 and riscv64
        (JSET, "eperm", 0, CLONE_NAMESPACES),
        (RET, 0, 0, RET_ALLOW),
        ("prlimit",),
        (LD_ABS, 0, 0, _arg_low(0)),  # pid (a pid_t: the kernel reads the low 32 bits only)
        (JEQ, "allow", "eperm", 0),  # 0: the caller itself
        ("socket",),
    ]
    if fallback:
        code.append((RET, 0, 0, RET_ERRNO | errno.EACCES))
    code += [
        ("socketpair",),  # socket and socketpair: the same (domain, type) arguments
        (LD_ABS, 0, 0, _arg_low(0)),  # domain (an int)
        (JEQ, 0, "eperm", AF_UNIX),
        (LD_ABS, 0, 0, _arg_low(1)),  # type
        (AND, 0, 0, SOCK_TYPE_MASK),
        (JEQ, "eperm", 0, SOCK_RAW),
        (JEQ, "eperm", 0, SOCK_PACKET),
        ("allow",),
        (RET, 0, 0, RET_ALLOW),
        ("eperm",),
        (RET, 0, 0, RET_ERRNO | errno.EPERM),
        ("enosys",),
        (RET, 0, 0, RET_ERRNO | errno.ENOSYS),
    ]
    return _assemble(code)


def _assemble(code: list[tuple]) -> list[tuple[int, int, int, int]]:
    """Resolve label names to BPF's relative jumps (counted from the next instruction, at most 255)."""
    labels, at = {}, 0
    for item in code:
        if len(item) == 1:
            labels[item[0]] = at
        else:
            at += 1
    out = []
    for item in code:
        if len(item) == 1:
            continue
        op, jt, jf, k = item
        here = len(out) + 1
        jumps = [labels[j] - here if isinstance(j, str) else j for j in (jt, jf)]
        if not all(0 <= j <= 255 for j in jumps):
            raise ValueError(f"seccomp program: jump out of range at instruction {len(out)}")
        out.append((op, jumps[0], jumps[1], k))
    return out


class _SockFilter(ctypes.Structure):
    _fields_ = [
        ("code", ctypes.c_uint16),
        ("jt", ctypes.c_uint8),
        ("jf", ctypes.c_uint8),
        ("k", ctypes.c_uint32),
    ]


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(_SockFilter))]


PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 38, 22, 2


def install(fallback: bool = False) -> None:
    """Apply the policy to this (single-threaded) process and everything it starts. Sets
    PR_SET_NO_NEW_PRIVS, which an unprivileged filter needs. Raises OSError where it cannot."""
    machine = os.uname().machine
    if machine not in ARCHES:
        raise OSError(errno.ENOSYS, f"no system-call table for {machine}")
    insns = program(machine, fallback)
    array = (_SockFilter * len(insns))(*(_SockFilter(*i) for i in insns))
    prog = _SockFprog(len(insns), array)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    for args in ((PR_SET_NO_NEW_PRIVS, 1, 0), (PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.addressof(prog))):
        if libc.prctl(args[0], args[1], args[2], 0, 0) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"seccomp: {os.strerror(err)}")
