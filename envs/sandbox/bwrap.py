"""`bwrap` backend: the hardened default for Linux hosts that run Arbor as root.

Why each piece is there (bwrap started by root maps the sandbox user onto host uid 0, so the
sandbox must never reach bwrap with root's credentials):

- **Dedicated unprivileged uid.** Each live sandbox holds one uid (gid = uid) from a pool
  (default 2000000000..+255), locked across processes with flock on `LOCK_DIR/<uid>.lock`.
  A root `/bin/sh` joins the sandbox's cgroups, sets rlimits, then execs `setpriv` which drops
  to uid/gid with no supplementary groups and no-new-privs before exec'ing bwrap. Inside,
  the user is that same uid: no capabilities, no access to root-owned 0600/0640 files, no write
  to `/proc/sys`, and RLIMIT_NPROC counts exactly this sandbox's processes.
- **Clean process state.** The wrapper and bwrap get an empty environment and no file
  descriptors besides the three pipes (`close_fds`); inside, `--clearenv` and a small explicit
  environment (`BASE_ENV` + the exec's `env`), also for pid 1 (`/proc/1/environ`).
- **Namespaces.** `--unshare-all` (network: only a private loopback; ipc; pid; uts; cgroup),
  `--unshare-user --disable-userns` (no nested user namespace), `--cap-drop ALL`,
  `--new-session` (no TIOCSTI into a terminal), `--die-with-parent`.
- **Keyring and seccomp.** Kernel keyrings are not namespaced: a process inherits the session
  keyring of whoever started it. Every exec joins a fresh, empty anonymous session keyring
  (`keyctl(KEYCTL_JOIN_SESSION_KEYRING, NULL)`, made by a one-line perl launcher as root
  before dropping to the uid: perl-base is on every Debian/Ubuntu and adds ~1.5 ms per exec),
  so no key of the starter or of another sandbox is reachable (the user keyring is per user
  namespace, and each exec makes its own). bwrap then loads the seccomp filter of
  `seccomp.py` (`--seccomp FD`) just before the command: keyring calls, io_uring, bpf,
  userfaultfd, perf_event_open, ptrace, kcmp, pidfd_getfd, memfd_secret, file handles,
  module/kexec/clock/mount calls, personas other than the default and socket families
  other than AF_UNIX (and AF_INET/AF_INET6 under `network="loopback"`) fail with EPERM.
- **File system.** Read-only binds of /usr (with the /bin, /lib... links), or of the
  top-level entries of a per-task root filesystem, untrusted, bound from descriptors with no
  link followed on the host (`rootfs.py`); optional extra read-only binds. /etc is not
  the host's: it is a per-process copy (`<root_dir>/.etc-<pid>-*`) of a short list of host
  entries programs need (`ETC_FROM_HOST`: the dynamic loader's cache, the alternatives links,
  time zone, openssl.cnf, Python's site files, ...) plus generated `hosts`, `hostname` and
  `nsswitch.conf`, with the sandbox's own `passwd` and `group` (naming its uid, generated in
  `<root_dir>/<uid>/etc`) bound over it; nothing else of the host's /etc (no token or
  credential file put there, no /etc/ssl/private) is in view. No resolv.conf or CA
  certificates: no network policy reaches past the loopback. A task root filesystem keeps its
  own /etc, with the generated passwd and group bound over the image's (where `etc` is a
  directory and they are regular files). A fresh /proc with
  /proc/sys bound read-only (bwrap alone leaves the namespaced ipc/pid sysctls
  writable) and a minimal /dev; `/` and `/dev` remounted read-only. The workspace, /tmp and
  /dev/shm are three host tmpfs mounts of `limits.disk_mb` each (a real quota; `nr_inodes`
  bounds file counts at one per 4 KiB), owned by the sandbox uid, mounted nodev,nosuid under
  `<root_dir>/<uid>/` and bound into every exec. They persist across execs and are filled
  through the file API (host side, as root but symlink-safe: `hostfs`; files are chowned to
  the sandbox uid) or by commands. Pages the sandbox writes there also count against its
  memory cgroup; pages the file API writes count only against the tmpfs size.
- **Resources.** cgroup v2 or v1 (`cgroups.py`): memory = memory+swap, pids, CPU quota.
  Without a memory cgroup, RLIMIT_AS per process (a forked memory bomb can then use up to
  pids x memory_mb); without a pids cgroup, RLIMIT_NPROC on the dedicated uid still bounds
  processes; without a cpu cgroup, only the exec timeout bounds CPU. Always RLIMIT_CORE 0 and
  RLIMIT_NOFILE 4096.
- **Lifetime.** Every exec is its own bwrap with its own PID namespace whose pid 1 is a small
  shell (`_INIT`) that runs the command and reaps orphans: when the command exits, or on
  timeout when pid 1 is SIGKILLed, the kernel kills everything left inside (background jobs,
  setsid daemons). Nothing runs between execs, so an agent cannot keep a server running from
  one exec to the next. close() kills running execs, empties the cgroup (or, without one,
  SIGKILLs every live process of the uid), unmounts the tmpfs mounts and only then returns
  the uid to the pool. A crashed holder's left-overs are swept by the uid's next holder.
- **Fork.** `fork()` makes a new sandbox with the same options and copies the workspace into
  it on the host (`hostfs.copy_tree`: descriptor-relative, O_NOFOLLOW, chowned to the fork's
  uid); /tmp and /dev/shm start empty, and no process is carried over.
- bwrap errors (e.g. an unreadable bind source) come back as an ExecResult with exit code 1
  and a `bwrap: ...` stderr: they are not turned into SandboxError, since a command can print
  the same.
- bwrap reports a command killed by signal N as exit code 128+N (shell convention), not -N.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import ctypes
import errno
import fcntl
import glob
import itertools
import os
import shutil
import signal
import tempfile
import threading
import time
from typing import Mapping, Optional, Sequence

from envs.sandbox import hostfs, process, rootfs as image, seccomp
from envs.sandbox.base import (ExecResult, Limits, Sandbox, SandboxError, SandboxFull,
                               fill_fork)
from envs.sandbox.cgroups import Cgroup

DEFAULT_UIDS = range(2_000_000_000, 2_000_000_256)
DEFAULT_ROOT = "/run/arbor-sandbox"
# uid locks live in one fixed place whatever root_dir a process uses, so two processes can
# never hold the same uid.
LOCK_DIR = "/run/arbor-sandbox-uids"
SYSTEM_DIRS = ("usr", "bin", "sbin", "lib", "lib32", "lib64", "libx32")
# Host /etc entries a sandbox sees (read-only): what the dynamic loader, the shell, Python,
# pytest, OpenSSL, fontconfig and `file` read. Anything else in the host's /etc (credentials,
# tokens, service configs) stays out of view. Missing entries are skipped.
ETC_FROM_HOST = ("ld.so.cache", "ld.so.conf", "ld.so.conf.d", "alternatives", "localtime",
                 "timezone", "protocols", "services", "networks", "ethertypes", "mime.types",
                 "os-release", "debian_version", "lsb-release", "ssl/openssl.cnf", "python3",
                 "python3.11", "python3.12", "python3.13", "bash.bashrc", "profile", "shells",
                 "inputrc", "locale.alias", "gai.conf", "host.conf", "magic", "magic.mime",
                 "fonts", "matplotlibrc", "mtab")
IDENTITY_ETC = ("passwd", "group")  # generated per sandbox (they name its uid)
NETWORKS = ("loopback", "none")
WORKSPACE = "/workspace"
BASE_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/tmp", "TMPDIR": "/tmp",
            "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8", "USER": "sandbox", "LOGNAME": "sandbox"}
NOFILE = 4096
# pid 1 of every exec's PID namespace (bwrap --as-pid-1): runs the command as its child and
# reaps every orphan while it waits; its exit tears the namespace down. bwrap's own init is not
# used because the outer bwrap exits without reaping it, leaving a zombie for the host's init.
# An asynchronous list gets /dev/null as stdin, hence the fd 3 dance.
_INIT = 'exec 3<&0; /bin/sh -c "$1" <&3 3<&- & wait $!; exit $?'
# Runs as root: join the cgroups named before `--`, set rlimits, exec the rest (setpriv ...).
_JOIN = 'while [ "$1" != -- ]; do echo $$ > "$1" || exit 125; shift; done; shift; '
# Runs as root after _JOIN: join a new anonymous session keyring (KEYCTL_JOIN_SESSION_KEYRING=1,
# name NULL), then exec the rest. ENOSYS (a kernel without keyrings) and EPERM (an outer seccomp
# filter, e.g. Docker's default profile, denies keyctl to us, hence to the sandbox too, since
# filters are inherited) leave no keyring to isolate; anything else is an error.
_KEYRING = ('syscall(%d, 1, 0) >= 0 or $! == %d or $! == %d or die "keyctl: $!\\n"; '
            'exec {$ARGV[0]} @ARGV; die "exec: $!\\n"')

_libc = ctypes.CDLL(None, use_errno=True)
_MS_NOSUID, _MS_NODEV, _MNT_DETACH = 2, 4, 2


def _mount_tmpfs(target: str, size_mb: int, uid: int) -> None:
  opts = f"size={size_mb}m,nr_inodes={max(1024, size_mb * 256)},mode=0700,uid={uid},gid={uid}"
  if _libc.mount(b"tmpfs", target.encode(), b"tmpfs", _MS_NOSUID | _MS_NODEV, opts.encode()):
    e = ctypes.get_errno()
    raise SandboxError(f"mount tmpfs on {target} ({opts}): {os.strerror(e)}")


def _umount(target: str) -> None:
  while _libc.umount2(target.encode(), _MNT_DETACH) == 0:
    pass  # stacked mounts of a crashed holder: peel them all


def _processes_of(uid: int) -> list[int]:
  """Live host pids with `uid` as real, effective, saved or fs uid (the uid is dedicated to
  one sandbox). Reads `Uid:` in /proc/PID/status: the owner of /proc/PID is root for a process
  that made itself non-dumpable."""
  out, want = [], str(uid)
  for name in os.listdir("/proc"):
    if name.isdigit():
      try:
        with open(f"/proc/{name}/status") as f:
          lines = {l.split(":", 1)[0]: l for l in f if l.startswith(("State:", "Uid:"))}
      except OSError:
        continue
      zombie = lines.get("State", "").split()[1:2] == ["Z"]  # dead already, awaiting reaping
      if not zombie and want in lines.get("Uid", "").split()[1:5]:
        out.append(int(name))
  return out


def _children_of(pid: int) -> list[int]:
  out = []
  for name in os.listdir("/proc"):
    if name.isdigit():
      try:
        with open(f"/proc/{name}/stat", "rb") as f:
          stat = f.read()
      except OSError:
        continue
      if int(stat[stat.rindex(b")") + 2:].split()[1]) == pid:
        out.append(int(name))
  return out


def _sigkill(pid: int) -> None:
  try:
    os.kill(pid, signal.SIGKILL)
  except ProcessLookupError:
    pass


class UidPool:
  """Host uids for sandboxes, one per live sandbox, exclusive across processes (flock).

  Args:
    uids: the pool; unused host uids >= 1000.
    root_dir: where the sandboxes' host directories are made (created mode 0711).

  Raises:
    ValueError: an empty pool, or a uid out of [1000, 2**32 - 1).
  """

  def __init__(self, uids: Sequence[int] = DEFAULT_UIDS, root_dir: str = DEFAULT_ROOT):
    if not uids or min(uids) < 1000 or max(uids) >= 2**32 - 1:
      raise ValueError(f"uids={uids!r}: expected a non-empty range of unused uids >= 1000")
    self.uids, self.root_dir = list(uids), root_dir
    self._held: dict[int, int] = {}  # uid -> lock fd
    self._next = itertools.count()
    os.makedirs(LOCK_DIR, mode=0o700, exist_ok=True)
    os.makedirs(root_dir, mode=0o711, exist_ok=True)
    os.chmod(root_dir, 0o711)  # sandbox uids must traverse it to bind their mounts

  def acquire(self) -> tuple[int, bool]:
    """Takes a free uid.

    Returns:
      (uid, stale): stale when a crashed holder may have left processes or mounts behind.

    Raises:
      SandboxFull: every uid of the pool is held.
    """
    start = next(self._next)
    for i in range(len(self.uids)):
      uid = self.uids[(start + i) % len(self.uids)]
      if uid in self._held:
        continue
      fd = os.open(os.path.join(LOCK_DIR, f"{uid}.lock"), os.O_RDWR | os.O_CREAT, 0o600)
      try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
      except BlockingIOError:
        os.close(fd)
        continue
      stale = os.pread(fd, 1, 0) != b""
      os.pwrite(fd, b"%d\n" % os.getpid(), 0)
      self._held[uid] = fd
      return uid, stale
    raise SandboxFull(f"all {len(self.uids)} sandbox uids are in use (uids={self.uids[0]}..)")

  def release(self, uid: int) -> None:
    """Returns a held uid to the pool, marked clean."""
    fd = self._held.pop(uid)
    os.ftruncate(fd, 0)  # clean release: the next holder need not sweep
    os.close(fd)         # drops the flock


_pools: dict[tuple, UidPool] = {}


def _pool(uids: Sequence[int], root_dir: str) -> UidPool:
  key = (tuple(uids), root_dir)
  if key not in _pools:
    _pools[key] = UidPool(uids, root_dir)
  return _pools[key]


def _host_binds() -> list[str]:
  """bwrap arguments for the host's own /usr, /bin, /lib... (trusted, bound by path)."""
  args = []
  for name in SYSTEM_DIRS:
    src = "/" + name
    if os.path.islink(src):  # e.g. bin -> usr/bin; resolved inside the sandbox
      args += ["--symlink", os.readlink(src), src]
    elif os.path.isdir(src):
      args += ["--ro-bind", src, src]
  return args


def _write(path: str, text: str) -> None:
  with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644),
            "w") as f:
    f.write(text)
  os.chmod(path, 0o644)


_etc_bases: dict[tuple[str, int], str] = {}
_etc_lock = threading.Lock()  # sandboxes may be created from several threads at once


def _etc_base(root_dir: str) -> str:
  """This process's copy of the host /etc entries a sandbox sees (`ETC_FROM_HOST`) plus the
  uid-independent generated files, built once per process under `root_dir`.

  A copy, not one bind per entry: every read-only bind makes bwrap re-read its mount table,
  which cost ~8 ms per exec for the ~30 entries; one directory bind costs nothing measurable.
  The copy is as old as the process (a package installed later updates it at the next start).
  """
  key = (root_dir, os.getpid())  # a forked child builds its own: the parent's may go first
  with _etc_lock:
    if key not in _etc_bases or not os.path.isdir(_etc_bases[key]):
      _etc_bases[key] = _build_etc_base(root_dir)
    return _etc_bases[key]


def _build_etc_base(root_dir: str) -> str:
  for old in glob.glob(os.path.join(root_dir, ".etc-*")):  # of processes that are gone
    with contextlib.suppress(ValueError, OSError):
      pid = int(os.path.basename(old).split("-")[1])
      if pid != os.getpid() and not os.path.exists(f"/proc/{pid}"):
        shutil.rmtree(old)
  base = tempfile.mkdtemp(prefix=f".etc-{os.getpid()}-", dir=root_dir)
  os.chmod(base, 0o755)
  # Removed at a normal exit; after a crash, by the next process that builds one.
  atexit.register(shutil.rmtree, base, True)
  for name in ETC_FROM_HOST:
    src, dst = os.path.join("/etc", name), os.path.join(base, name)
    if not os.path.lexists(src):
      continue
    os.makedirs(os.path.dirname(dst), mode=0o755, exist_ok=True)
    if os.path.islink(src) and not os.path.realpath(src).startswith("/etc/"):
      os.symlink(os.readlink(src), dst)  # e.g. localtime -> /usr/share/zoneinfo/..
    elif os.path.isdir(src):
      shutil.copytree(src, dst, symlinks=True)
    elif os.path.isfile(src):
      shutil.copy(src, dst)
  _write(os.path.join(base, "hosts"),
         "127.0.0.1\tlocalhost sandbox\n::1\tlocalhost ip6-localhost ip6-loopback\n")
  _write(os.path.join(base, "hostname"), "sandbox\n")
  _write(os.path.join(base, "nsswitch.conf"),
         "passwd: files\ngroup: files\nshadow: files\nhosts: files dns\nnetworks: files\n"
         "protocols: files\nservices: files\n")
  for name in ("passwd", "group"):  # mount points of the per-sandbox files
    _write(os.path.join(base, name), "")
  for d, dirs, files in os.walk(base):  # readable by the sandbox uid whatever the host's umask
    for n in dirs + files:
      if not os.path.islink(os.path.join(d, n)):
        os.chmod(os.path.join(d, n), 0o755 if n in dirs else 0o644)
  return base


def _write_identity(etc_dir: str, uid: int) -> None:
  """The sandbox's own /etc/passwd and /etc/group (root-owned, world-readable)."""
  os.makedirs(etc_dir, mode=0o755, exist_ok=True)
  # Host root and unmapped ids show up as 65534 inside the sandbox's user namespace.
  _write(os.path.join(etc_dir, "passwd"),
         f"root:x:0:0:root:/root:/usr/sbin/nologin\n"
         f"sandbox:x:{uid}:{uid}:sandbox:/tmp:/bin/sh\n"
         f"nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n")
  _write(os.path.join(etc_dir, "group"), f"root:x:0:\nsandbox:x:{uid}:\nnogroup:x:65534:\n")


def _etc_binds(etc_dir: str, root_dir: str) -> list[str]:
  """bwrap arguments for /etc without a task rootfs: the process's base copy with the
  sandbox's passwd and group bound over it."""
  args = ["--ro-bind", _etc_base(root_dir), "/etc"]
  for name in IDENTITY_ETC:
    args += ["--ro-bind", os.path.join(etc_dir, name), "/etc/" + name]
  return args


class BwrapSandbox(Sandbox):
  """See the module docstring. Create with `await BwrapSandbox.create(limits, ...)`."""

  workspace_path = WORKSPACE

  def __init__(self, limits: Limits, uid: int, pool: UidPool, cgroup: Optional[Cgroup],
               binds: list[str], network: str = "loopback", seccomp_filter: bool = True,
               rootfs: Optional[str] = None):
    self.limits, self.uid, self._pool, self.cgroup = limits, uid, pool, cgroup
    self.host_dir = os.path.join(pool.root_dir, str(uid))
    self.workspace = os.path.join(self.host_dir, "workspace")  # host path of /workspace
    self._binds, self._rootfs = binds, rootfs
    self.network, self._seccomp = network, seccomp_filter
    self._perl = shutil.which("perl")
    self._keyring = _KEYRING % (seccomp.syscall_number("keyctl"), errno.ENOSYS, errno.EPERM)
    self._closed = False
    self._options: dict = {}  # create()'s arguments, for fork()
    self._running: set[int] = set()       # outer bwrap pids of running execs
    self._tasks: set[asyncio.Task] = set()
    self._bwrap, self._setpriv = shutil.which("bwrap"), shutil.which("setpriv")

  @classmethod
  async def create(cls, limits: Limits = Limits(), *, rootfs: Optional[str] = None,
                   ro_binds: Sequence[str | tuple[str, str]] = (),
                   uids: Sequence[int] = DEFAULT_UIDS, root_dir: str = DEFAULT_ROOT,
                   cgroups: bool = True, network: str = "loopback",
                   seccomp_filter: bool = True) -> "BwrapSandbox":
    """Starts a sandbox: takes a uid, mounts its tmpfs mounts and makes its cgroups.

    Args:
      limits: the sandbox's limits.
      rootfs: a task root filesystem whose top-level entries are bound read-only (see
        `rootfs.py`: given by its real path, no link on the way); None: the host's /usr,
        /etc and their links.
      ro_binds: extra host paths bound read-only, each `path` or `(host_path, sandbox_path)`,
        e.g. a task's virtualenv.
      uids: the uid pool.
      root_dir: where the sandbox's host directory is made.
      cgroups: False forces the rlimit fallback (for tests of it).
      network: "loopback": a private network namespace with only a loopback, AF_INET/AF_INET6
        sockets allowed (servers a task's tests start on localhost work); "none": the seccomp
        filter also denies AF_INET/AF_INET6, only AF_UNIX sockets remain.
      seccomp_filter: False leaves the seccomp filter out (for tests that check the other
        layers on their own).

    Returns:
      The started sandbox.

    Raises:
      SandboxError: not root, bwrap (>= 0.5 with a rootfs), setpriv, perl or libseccomp
        missing, or a mount failed.
      SandboxFull: every uid of the pool is held.
      ValueError: rootfs is not a directory or has a link on its path, a ro_binds entry is
        not an existing absolute path or its sandbox path crosses a link of the rootfs, or
        network is not one of NETWORKS.
    """
    if os.geteuid() != 0:
      raise SandboxError(f"bwrap backend needs root (euid={os.geteuid()}) to mount the quota "
                         "tmpfs, set up cgroups and drop to a dedicated uid")
    if network not in NETWORKS:
      raise ValueError(f"network={network!r}: expected one of {NETWORKS}")
    for tool in ("bwrap", "setpriv", "perl"):
      if shutil.which(tool) is None:
        raise SandboxError(f"{tool} not found on PATH (Debian packages bubblewrap, util-linux, "
                           "perl-base)")
    try:
      seccomp.bpf_program(network != "none")  # compiled once per process; fails early here
    except seccomp.SeccompError as e:
      raise SandboxError(f"seccomp filter: {e}") from e
    binds = _host_binds() if rootfs is None else []
    for b in ro_binds:
      src, dst = (b, b) if isinstance(b, str) else b
      if not (os.path.isabs(src) and os.path.isabs(dst) and os.path.exists(src)):
        raise ValueError(f"ro_binds entry {b!r}: expected existing absolute host path(s)")
      binds += ["--ro-bind", src, dst]
    if rootfs is not None:  # refuses a link on rootfs's path or on the way to a destination
      image.check(rootfs, [b if isinstance(b, str) else b[1] for b in ro_binds],
                  shutil.which("bwrap"))
    pool = _pool(uids, root_dir)
    uid, stale = pool.acquire()
    cgroup = None
    try:
      host_dir = os.path.join(root_dir, str(uid))
      if stale:
        cls._sweep(uid, host_dir)
      os.makedirs(host_dir, mode=0o711, exist_ok=True)
      for name in ("workspace", "tmp", "shm"):
        path = os.path.join(host_dir, name)
        os.makedirs(path, mode=0o700, exist_ok=True)
        _mount_tmpfs(path, limits.disk_mb, uid)
      etc_dir = os.path.join(host_dir, "etc")
      _write_identity(etc_dir, uid)
      if cgroups:
        cgroup = Cgroup.create(str(uid), limits)
    except BaseException:
      cls._sweep(uid, os.path.join(root_dir, str(uid)))
      pool.release(uid)
      raise
    sb = cls(limits, uid, pool, cgroup, binds, network, seccomp_filter, rootfs)
    sb._options = dict(rootfs=rootfs, ro_binds=tuple(ro_binds), uids=uids, root_dir=root_dir,
                       cgroups=cgroups, network=network, seccomp_filter=seccomp_filter)
    return sb

  @staticmethod
  def _sweep(uid: int, host_dir: str, by_uid: bool = True) -> None:
    """Kill every process of `uid` and unmount its tmpfs mounts (stale or closing state)."""
    for _ in range(200 if by_uid else 0):
      pids = _processes_of(uid)
      if not pids:
        break
      for pid in pids:
        _sigkill(pid)
      time.sleep(0.005)
    for name in ("workspace", "tmp", "shm"):
      _umount(os.path.join(host_dir, name))
      with contextlib.suppress(OSError):
        os.rmdir(os.path.join(host_dir, name))
    for name in IDENTITY_ETC:
      with contextlib.suppress(OSError):
        os.unlink(os.path.join(host_dir, "etc", name))
    with contextlib.suppress(OSError):
      os.rmdir(os.path.join(host_dir, "etc"))
    with contextlib.suppress(OSError):
      os.rmdir(host_dir)

  def _argv(self, cmd: str, env: Mapping[str, str], seccomp_fd: Optional[int],
            system: image.Binds) -> list[str]:
    lim = self.limits
    missing = self.cgroup.missing if self.cgroup else ("memory", "pids", "cpu")
    ulimits = f"ulimit -c 0 && ulimit -n {NOFILE} && ulimit -p {lim.pids}"
    if "memory" in missing:
      ulimits += f" && ulimit -v {lim.memory_mb * 1024}"
    join = self.cgroup.procs_files if self.cgroup else []
    script = _JOIN + ulimits + ' || exit 125; exec "$@"'
    u = str(self.uid)
    bw = [self._bwrap, "--unshare-all", "--unshare-user", "--disable-userns", "--cap-drop", "ALL",
          "--die-with-parent", "--new-session", "--hostname", "sandbox", "--clearenv"]
    for k, v in {**BASE_ENV, **env}.items():
      bw += ["--setenv", k, v]
    bw += system.args + self._binds
    # Per exec: the base copy is rebuilt if something removed it meanwhile.
    bw += system.identity if self._rootfs else _etc_binds(os.path.join(self.host_dir, "etc"),
                                                          self._pool.root_dir)
    if seccomp_fd is not None:
      bw += ["--seccomp", str(seccomp_fd)]
    # bwrap leaves the new /proc/sys writable where the sandbox owns the namespace (ipc, pid
    # sysctls); a read-only bind of it shows the same per-namespace values, read-only.
    bw += ["--proc", "/proc", "--ro-bind", "/proc/sys", "/proc/sys", "--dev", "/dev",
           "--bind", self.workspace, WORKSPACE,
           "--bind", os.path.join(self.host_dir, "tmp"), "/tmp",
           "--bind", os.path.join(self.host_dir, "shm"), "/dev/shm",
           "--remount-ro", "/dev", "--remount-ro", "/", "--chdir", WORKSPACE,
           "--as-pid-1", "/bin/sh", "-c", _INIT, "sh", cmd]
    return (["/bin/sh", "-c", script, "arbor-sandbox", *join, "--",
             self._perl, "-e", self._keyring, "--", self._setpriv,
             "--reuid", u, "--regid", u, "--clear-groups", "--no-new-privs", "--"] + bw)

  def _kill_exec(self, pid: int) -> None:
    """End one exec: SIGKILL its namespace's pid 1 (the kernel kills the whole PID namespace,
    the outer bwrap reaps pid 1 and exits), or the outer bwrap itself if pid 1 is not there
    yet (its --die-with-parent takes pid 1 along)."""
    children = _children_of(pid)
    for child in children:
      _sigkill(child)
    if not children:
      _sigkill(pid)

  def _check_open(self) -> None:
    if self._closed:
      raise SandboxError(f"sandbox uid={self.uid} is closed")

  async def exec(self, cmd: str | Sequence[str], timeout: Optional[float] = None,
                 stdin: Optional[str] = None,
                 env: Optional[Mapping[str, str]] = None) -> ExecResult:
    self._check_open()
    cmd, timeout = process.check_exec_args(cmd, timeout, stdin, self.limits.default_timeout)
    env = process.check_env(env)
    system = self._system_view()  # the rootfs's descriptors are opened for each exec
    fds = list(system.fds)
    try:
      seccomp_fd = seccomp.program_fd(self.network != "none") if self._seccomp else None
    except BaseException:
      image.close_all(fds)
      raise
    fds += [] if seccomp_fd is None else [seccomp_fd]
    argv = self._argv(cmd, env, seccomp_fd, system)
    task = asyncio.current_task()
    self._tasks.add(task)
    pids = []

    def started(pid: int) -> None:
      while fds:
        os.close(fds.pop())  # the child holds its copies; bwrap uses and closes them
      pids.append(pid)
      self._running.add(pid)
      if self._closed:  # close() ran while we were spawning
        self._kill_exec(pid)

    try:
      return await process.run(argv, timeout=timeout, output_bytes=self.limits.output_bytes,
                               stdin=stdin, kill=self._kill_exec, on_start=started,
                               pass_fds=tuple(fds))
    finally:
      while fds:  # the spawn failed
        os.close(fds.pop())
      self._running.difference_update(pids)
      self._tasks.discard(task)

  def _system_view(self) -> image.Binds:
    """The rootfs's binds and their descriptors (opened now), or nothing without one."""
    try:
      return image.binds(self._rootfs, {n: os.path.join(self.host_dir, "etc", n)
                                        for n in IDENTITY_ETC})
    except ValueError as e:  # the rootfs changed since create()
      raise SandboxError(str(e)) from None

  async def write_file(self, path: str, content: str | bytes) -> None:
    self._check_open()
    hostfs.write_file(self.workspace, path, content, self.limits.file_bytes,
                      owner=(self.uid, self.uid))

  async def read_file(self, path: str) -> bytes:
    self._check_open()
    return hostfs.read_file(self.workspace, path, self.limits.file_bytes)

  async def list_files(self, path: str = ".") -> list[str]:
    self._check_open()
    return hostfs.list_files(self.workspace, path)

  async def fork(self) -> "BwrapSandbox":
    """A new sandbox (its own uid, tmpfs mounts and cgroups; the same limits, system view and
    options) whose workspace is a copy of this one's (see `Sandbox.fork`). /tmp and /dev/shm
    start empty.

    The copy is made on the host, as root (files made unreadable inside are copied too), by
    `hostfs.copy_tree`, which opens every name relative to its parent with O_NOFOLLOW and
    chowns what it makes to the fork's uid; this workspace is only read. Not `cp -a
    --reflink=auto`: both workspaces are tmpfs mounts (the real disk quota), where there is no
    reflink, and cp walks by path names, so an exec running here meanwhile could swap a
    directory for a symlink and have root copy host files into the fork. Not an overlay with
    this workspace as lower layer: this sandbox keeps writing to it, and overlayfs leaves
    changes to a lower layer undefined (the fork could see them), which breaks independence.
    """
    self._check_open()
    fork = await BwrapSandbox.create(self.limits, **self._options)
    if self._closed:  # closed while the fork was being made
      await fork.close()
      self._check_open()
    return await fill_fork(fork, lambda: asyncio.to_thread(
        hostfs.copy_tree, self.workspace, fork.workspace, (fork.uid, fork.uid)))

  async def close(self) -> None:
    if self._closed:
      return
    self._closed = True
    for pid in list(self._running):
      self._kill_exec(pid)
    others = self._tasks - {asyncio.current_task()}
    if others:  # running execs return as soon as their processes are gone
      await asyncio.wait(others, timeout=10)
    # Every sandbox process is in the cgroup (joined before bwrap started; it cannot leave):
    # emptying it is enough. Without one, or if it will not empty, sweep the uid itself.
    emptied = self.cgroup is not None and self.cgroup.kill()
    if self.cgroup is not None:
      self.cgroup.remove()
    self._sweep(self.uid, self.host_dir, by_uid=not emptied)
    self._pool.release(self.uid)
