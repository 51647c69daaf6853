"""The sandboxes' seccomp filter: one deny list, compiled for bwrap and written for Docker.

Everything is allowed except the calls below, which fail with EPERM. EPERM, not a kill:
programs probe for these features (libuv tries io_uring, glibc's `getifaddrs` and
`if_nameindex` open an `AF_NETLINK` socket, NTP-aware code calls `adjtimex`) and fall back or
report an error when told "not permitted"; a kill would turn a probe into a crashed test run. Most of them already fail for
lack of capabilities; the filter is there because the kernel code behind each is reachable
without one, or because a mistake elsewhere (a capability left over, a namespace not made)
should not be enough.

- **Kernel keyrings** (`add_key`, `request_key`, `keyctl`): keyrings are not namespaced. A
  process inherits the session keyring of whoever started it (a systemd service, an ssh
  login), and through it could read that starter's keys or leave keys for the next sandbox.
  bwrap sandboxes also start every exec in a fresh, empty session keyring; this blocks the
  rest (the user keyring, `request_key` upcalls).
- **io_uring** (`io_uring_setup`, `io_uring_enter`, `io_uring_register`): a large, young
  kernel interface with a long record of privilege escalations; it also performs I/O outside
  the calls this filter sees.
- **bpf**: unprivileged BPF programs (when the host allows them) are a classic escalation path
  and can read kernel memory through verifier bugs.
- **userfaultfd**: lets a process stall the kernel at a chosen page fault, the usual way to win
  kernel race conditions.
- **perf_event_open**: kernel and hardware counters leak information about other processes
  and the kernel, and the subsystem has had escalation bugs.
- **ptrace, process_vm_readv, process_vm_writev**: all processes of a sandbox run as one uid in
  their own PID namespace, so ptrace could only reach the sandbox's own processes; it is
  denied entirely (not only for non-children) because debuggers are not needed by the tasks,
  and on older kernels a traced process could change a syscall after the filter checked it.
- **Kernel modules** (`init_module`, `finit_module`, `delete_module`) and **kexec**
  (`kexec_load`, `kexec_file_load`), `reboot`, `swapon`, `swapoff`, `acct`: need capabilities
  the sandbox never has; denied so that a leaked capability is still not enough.
- **Clocks** (`clock_settime`, `clock_adjtime`, `settimeofday`, `adjtimex`): the clock is the
  host's (time namespaces only offset monotonic clocks); `adjtimex` is denied even for reads,
  which only NTP tools do.
- **Mounts** (`mount`, `umount2`, `pivot_root`, `move_mount`, `open_tree`, `fsopen`,
  `fsconfig`, `fsmount`, `fspick`, `mount_setattr`): bwrap already prevents them (the sandbox
  has no capabilities and cannot make a user namespace to gain some: `--disable-userns`); the
  filter applies after bwrap has made its own mounts, so denying them costs nothing.
- **File handles** (`open_by_handle_at`, `name_to_handle_at`): `open_by_handle_at` opens files
  by handle around directory permissions (the "shocker" container escape); it needs
  CAP_DAC_READ_SEARCH, denied for the same reason as modules. `name_to_handle_at` needs no
  capability, and its one use is making the handles that `open_by_handle_at` takes.
- **Other processes' kernel state** (`kcmp`, `pidfd_getfd`): `kcmp` tells whether two
  processes share kernel objects (open files, memory, file tables), a probe no task needs;
  `pidfd_getfd` copies a descriptor out of another process, the reach of ptrace, which is
  denied.
- **memfd_secret**: memory taken out of the kernel's direct map, hidden even from the host's
  root (`/proc/PID/mem`, crash dumps); no task needs it, and nothing a sandbox holds should be
  out of the host's sight.
- **personality** (its argument): only the default persona (`PER_LINUX`, 0) and the query
  `0xffffffff` are allowed. Other values switch kernel behaviour for the process and its
  children: `ADDR_NO_RANDOMIZE` turns address-space randomization off (an exploit aid),
  `READ_IMPLIES_EXEC` makes readable mappings executable, `MMAP_PAGE_ZERO` asks for page 0
  to be mapped at exec (what null-pointer exploits want), and `PER_LINUX32` and other
  personas change what `uname` and the kernel report. The kernel reads only the low 32 bits;
  values with any of the upper 32 set are denied, so none reaches an allowed persona by
  truncation.
- **Socket families** (`socket`'s first argument): `AF_UNIX` always; `AF_INET` and `AF_INET6`
  only where the sandbox's network policy has a network (`inet=True`: for bwrap the private
  loopback of its own network namespace); every other family (`AF_NETLINK`, `AF_PACKET`,
  `AF_VSOCK`, `AF_ALG`, ...) is denied: each is its own kernel code reachable without
  privileges, and a sandbox needs none of them. Values with high bits set are denied too.

The filter is built for the native architecture only; libseccomp makes a call through another
ABI (e.g. 32-bit `int 0x80` on x86_64) kill the process, since nothing in a sandbox needs one
and it would otherwise bypass the syscall numbers above.

libseccomp (`libseccomp.so.2`, Debian/Ubuntu package libseccomp2, a dependency of apt) is
loaded with ctypes, so no Python binding is needed.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import functools
import json
import os
import socket
import tempfile

DENIED = {
    "keyring": ("add_key", "request_key", "keyctl"),
    "io_uring": ("io_uring_setup", "io_uring_enter", "io_uring_register"),
    "bpf": ("bpf",),
    "userfaultfd": ("userfaultfd",),
    "perf": ("perf_event_open",),
    "ptrace": ("ptrace", "process_vm_readv", "process_vm_writev"),
    "modules": ("init_module", "finit_module", "delete_module"),
    "kexec": ("kexec_load", "kexec_file_load", "reboot", "swapon", "swapoff", "acct"),
    "clock": ("clock_settime", "clock_adjtime", "settimeofday", "adjtimex"),
    "mount": ("mount", "umount2", "pivot_root", "move_mount", "open_tree", "fsopen", "fsconfig",
              "fsmount", "fspick", "mount_setattr"),
    "handles": ("open_by_handle_at", "name_to_handle_at"),
    "process_internals": ("kcmp", "pidfd_getfd"),
    "secretmem": ("memfd_secret",),
}
# personality(2) values allowed (see the module docstring); every other one fails with EPERM.
PERSONAS = (0, 0xFFFFFFFF)  # PER_LINUX (the default), the query
# Socket families: AF_UNIX always, AF_INET/AF_INET6 with a network. Everything else (and every
# value >= _FAMILY_CAP, which covers values with high bits set) is denied.
ALWAYS_FAMILIES = (socket.AF_UNIX,)
INET_FAMILIES = (socket.AF_INET, socket.AF_INET6)
_FAMILY_CAP = max(INET_FAMILIES) + 1

_ACT_ALLOW = 0x7FFF0000
_ACT_ERRNO = 0x00050000
_CMP_EQ, _CMP_GE, _CMP_MASKED_EQ = 4, 5, 7
_NR_ERROR = -1


class SeccompError(RuntimeError):
  """libseccomp is missing or refused the filter."""


class _ArgCmp(ctypes.Structure):
  _fields_ = [("arg", ctypes.c_uint), ("op", ctypes.c_int), ("datum_a", ctypes.c_uint64),
              ("datum_b", ctypes.c_uint64)]


@functools.lru_cache(maxsize=1)
def _lib():
  name = ctypes.util.find_library("seccomp") or "libseccomp.so.2"
  try:
    lib = ctypes.CDLL(name, use_errno=True)
  except OSError as e:
    raise SeccompError(f"libseccomp not found ({name}: {e}); install the Debian package "
                       "libseccomp2") from e
  lib.seccomp_init.restype = ctypes.c_void_p
  lib.seccomp_init.argtypes = [ctypes.c_uint32]
  lib.seccomp_release.argtypes = [ctypes.c_void_p]
  lib.seccomp_rule_add_array.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int,
                                         ctypes.c_uint, ctypes.POINTER(_ArgCmp)]
  lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
  lib.seccomp_export_bpf.argtypes = [ctypes.c_void_p, ctypes.c_int]
  return lib


def denied_syscalls() -> list[str]:
  """Every syscall name the filter denies outright (socket is filtered by family instead)."""
  return [name for group in DENIED.values() for name in group]


def persona_rules() -> list[tuple[int, int, int, int]]:
  """Comparisons (arg, op, datum_a, datum_b) on personality's argument, one per deny rule, that
  together deny every value but `PERSONAS` (0 and 0xffffffff).

  libseccomp ANDs the comparisons of one rule but takes each argument once per rule, so "not
  0 and not 0xffffffff" is written as rules that each match one kind of denied value: any
  value >= 2**32; and, for each bit i, "bit i set and bit i+1 (mod 32) clear" (a masked
  equality). A 32-bit value with both set and clear bits has such a pair going round its
  bits; 0 and 0xffffffff have none.
  """
  assert PERSONAS == (0, 0xFFFFFFFF)  # what the rules below encode
  rules = [(0, _CMP_GE, 1 << 32, 0)]
  for i in range(32):
    bit, nxt = 1 << i, 1 << ((i + 1) % 32)
    rules.append((0, _CMP_MASKED_EQ, bit | nxt, bit))
  return rules


def denied_families(inet: bool) -> list[int]:
  """Socket families below `_FAMILY_CAP` that the filter denies (all above it are denied)."""
  allowed = set(ALWAYS_FAMILIES) | (set(INET_FAMILIES) if inet else set())
  return [f for f in range(_FAMILY_CAP) if f not in allowed]


@functools.lru_cache(maxsize=4)
def bpf_program(inet: bool) -> bytes:
  """The compiled filter (a `struct sock_filter` array, as `bwrap --seccomp FD` reads it).

  Args:
    inet: allow AF_INET and AF_INET6 sockets (the sandbox has a network, if only a loopback).

  Returns:
    The BPF program for the native architecture.

  Raises:
    SeccompError: libseccomp is missing, does not know one of the syscalls, or failed.
  """
  lib = _lib()
  ctx = lib.seccomp_init(_ACT_ALLOW)
  if not ctx:
    raise SeccompError("seccomp_init failed")
  deny = _ACT_ERRNO | errno.EPERM
  try:
    def add(name: str, *cmps: tuple[int, int, int, int]) -> None:
      nr = lib.seccomp_syscall_resolve_name(name.encode())
      if nr == _NR_ERROR:
        raise SeccompError(f"syscall {name!r} unknown to this libseccomp; a newer libseccomp2 "
                           "is needed")
      arr = (_ArgCmp * max(1, len(cmps)))(*[_ArgCmp(*c) for c in cmps])
      rc = lib.seccomp_rule_add_array(ctx, deny, nr, len(cmps), arr)
      if rc < 0:
        raise SeccompError(f"seccomp_rule_add({name}, {cmps}): {os.strerror(-rc)}")

    for name in denied_syscalls():
      add(name)
    for family in denied_families(inet):
      add("socket", (0, _CMP_EQ, family, 0))
    add("socket", (0, _CMP_GE, _FAMILY_CAP, 0))
    for cmp in persona_rules():
      add("personality", cmp)
    with tempfile.TemporaryFile() as f:
      rc = lib.seccomp_export_bpf(ctx, f.fileno())
      if rc < 0:
        raise SeccompError(f"seccomp_export_bpf: {os.strerror(-rc)}")
      f.seek(0)
      return f.read()
  finally:
    lib.seccomp_release(ctx)


def program_fd(inet: bool) -> int:
  """A pipe's read end holding `bpf_program(inet)`, for `bwrap --seccomp FD` (which reads it
  to the end and closes it). The caller passes it to the child and closes its own copy."""
  prog = bpf_program(inet)
  r, w = os.pipe()
  try:
    if len(prog) > 65536:  # a pipe buffer's default size; the programs are ~1 KiB
      raise SeccompError(f"filter of {len(prog)} bytes does not fit a pipe buffer")
    os.write(w, prog)
  except BaseException:
    os.close(r)
    raise
  finally:
    os.close(w)
  return r


def docker_profile(inet: bool) -> dict:
  """The same filter as a Docker seccomp profile (`--security-opt seccomp=<json>`).

  Docker replaces its own default profile with this one, so the profile denies what Docker's
  default does beyond this list for an unprivileged container too (namespace and NUMA calls,
  `iopl`, ...): it starts from the same allow-by-default and adds them. Docker's default
  allows a few more personas (PER_LINUX32, UNAME26); this profile keeps to `PERSONAS`.
  """
  extra = ["unshare", "setns", "quotactl", "lookup_dcookie", "syslog", "uselib", "ustat",
           "sysfs", "_sysctl", "nfsservctl", "iopl", "ioperm", "vm86", "vm86old",
           "create_module", "get_kernel_syms", "query_module"]
  rules = [{"names": denied_syscalls() + extra, "action": "SCMP_ACT_ERRNO",
            "errnoRet": errno.EPERM}]
  for family in denied_families(inet):
    rules.append({"names": ["socket"], "action": "SCMP_ACT_ERRNO", "errnoRet": errno.EPERM,
                  "args": [{"index": 0, "value": family, "op": "SCMP_CMP_EQ"}]})
  rules.append({"names": ["socket"], "action": "SCMP_ACT_ERRNO", "errnoRet": errno.EPERM,
                "args": [{"index": 0, "value": _FAMILY_CAP, "op": "SCMP_CMP_GE"}]})
  ops = {_CMP_GE: "SCMP_CMP_GE", _CMP_MASKED_EQ: "SCMP_CMP_MASKED_EQ"}
  for arg, op, a, b in persona_rules():
    rules.append({"names": ["personality"], "action": "SCMP_ACT_ERRNO", "errnoRet": errno.EPERM,
                  "args": [{"index": arg, "value": a, "valueTwo": b, "op": ops[op]}]})
  return {"defaultAction": "SCMP_ACT_ALLOW", "defaultErrnoRet": errno.EPERM,
          "architectures": ["SCMP_ARCH_X86_64", "SCMP_ARCH_AARCH64"], "syscalls": rules}


def docker_security_opt(inet: bool) -> list[str]:
  """`security_opt` for docker-py: the profile above and no new privileges."""
  return ["no-new-privileges", "seccomp=" + json.dumps(docker_profile(inet), sort_keys=True)]


def syscall_number(name: str) -> int:
  """The native architecture's number of syscall `name` (libseccomp's table).

  Raises:
    SeccompError: libseccomp is missing or does not know `name`.
  """
  nr = _lib().seccomp_syscall_resolve_name(name.encode())
  if nr == _NR_ERROR or nr < 0:
    raise SeccompError(f"syscall {name!r}: unknown on this architecture")
  return nr
