"""Per-sandbox cgroups (v2, or v1 per controller): memory (+swap), pids, CPU, and kill-all.

A sandbox's cgroup is `<hierarchy>/<parent>/<name>` in every hierarchy that offers a controller
we use. cgroup v2 is used when its root offers memory and pids; otherwise each controller is
taken from the v1 hierarchy that has it. What neither offers is reported by `missing` so the
caller can fall back to rlimits. Everything here needs root.

By default `parent` is `arbor-sandbox` at the top of each hierarchy. A service calls
`nest_under_own_cgroup()` once at start-up to put every later sandbox under its own cgroup
instead (`<own>/arbor-sandbox`), so the service's memory and pids limits (systemd's MemoryMax,
TasksMax with `Delegate=yes`) bound all of its sandboxes together. On v2 a cgroup with member
processes cannot hand controllers to children, so the service first moves itself into the leaf
`<own>/service`.
"""

from __future__ import annotations

import functools
import os
import signal
import time
from typing import Optional

from envs.sandbox.base import Limits

CONTROLLERS = ("memory", "pids", "cpu")
SANDBOXES = "arbor-sandbox"  # the parent group's name
_parents: dict[str, str] = {}  # controller -> parent relative to its hierarchy (set by nesting)


@functools.lru_cache(maxsize=None)
def _mounts() -> tuple[Optional[str], dict[str, str]]:
  """(cgroup2 mount point with memory+pids usable, {v1 controller: mount point})."""
  v2, v1 = None, {}
  with open("/proc/self/mountinfo") as f:
    for line in f:
      left, _, right = line.partition(" - ")
      fields, (fstype, _, opts) = left.split(), right.split()[:3]
      if fields[3] != "/":  # a bind of a sub-cgroup (containers): not the hierarchy root
        continue
      if fstype == "cgroup2":
        try:
          offered = open(os.path.join(fields[4], "cgroup.controllers")).read().split()
        except OSError:
          continue
        if {"memory", "pids"} <= set(offered):
          v2 = fields[4]
      elif fstype == "cgroup":
        for c in opts.split(","):
          if c in CONTROLLERS:
            v1.setdefault(c, fields[4])
  return v2, v1


def _write(path: str, value: str) -> None:
  with open(path, "w") as f:
    f.write(value)


def _enable_down_to(v2: str, rel: str, wanted: list[str]) -> None:
  """Enables `wanted` in cgroup.subtree_control of every group from the v2 root to `rel`
  (made where missing), writing only where one is not enabled yet: a delegated service may not
  write above its own group, where its delegator enabled them already."""
  d = v2
  for part in [""] + [p for p in rel.split("/") if p]:
    d = os.path.join(d, part) if part else d
    os.makedirs(d, exist_ok=True)
    enabled = open(os.path.join(d, "cgroup.subtree_control")).read().split()
    missing = [c for c in wanted if c not in enabled]
    if missing:
      _write(os.path.join(d, "cgroup.subtree_control"), " ".join("+" + c for c in missing))


def _own_cgroups(pid: str = "self") -> dict[str, str]:
  """A process's cgroup per controller ("" for v2), relative to each hierarchy's root."""
  out = {}
  with open(f"/proc/{pid}/cgroup") as f:
    for line in f:
      _, controllers, path = line.rstrip("\n").split(":", 2)
      for c in controllers.split(",") if controllers else [""]:
        out[c] = path.strip("/")
  return out


def nest_under_own_cgroup(leaf: str = "service") -> dict[str, str]:
  """Makes every later sandbox group of this process a child of this process's own cgroup.

  On v2 this process first moves into `<own>/<leaf>` (a group with member processes cannot
  enable controllers for children); it must be the only process in its group then (a systemd
  service with `Delegate=yes`, started directly).

  Args:
    leaf: the v2 group this process moves into.

  Returns:
    controller ("" for v2) -> the sandboxes' parent, relative to the hierarchy's root.

  Raises:
    OSError: the groups cannot be made or joined (not root, or no delegation).
  """
  v2, v1 = _mounts()
  own = _own_cgroups()
  _parents.clear()
  if v2 is not None:
    base = own.get("", "")
    if base:  # the real root may keep processes and enable controllers at once; others not
      os.makedirs(os.path.join(v2, base, leaf), exist_ok=True)
      _write(os.path.join(v2, base, leaf, "cgroup.procs"), str(os.getpid()))
    _parents[""] = os.path.join(base, SANDBOXES).strip("/")
  else:
    for c in v1:
      _parents[c] = os.path.join(own.get(c, ""), SANDBOXES).strip("/")
  return dict(_parents)


class Cgroup:
  """One sandbox's cgroup(s). `Cgroup.create(name, limits)` or None when the machine has none.

  Args:
    dirs: controller -> the group's directory (v2: the same directory for every controller).
    version: 1 or 2.
  """

  def __init__(self, dirs: dict[str, str], version: int):
    self.dirs = dirs          # controller -> directory (v2: every controller the same dir)
    self.version = version

  @property
  def missing(self) -> tuple[str, ...]:
    """The CONTROLLERS this machine does not offer (the caller falls back to rlimits)."""
    return tuple(c for c in CONTROLLERS if c not in self.dirs)

  @property
  def procs_files(self) -> list[str]:
    """The cgroup.procs files a process writes its pid to, to join every controller."""
    return sorted({os.path.join(d, "cgroup.procs") for d in self.dirs.values()})

  @classmethod
  def create(cls, name: str, limits: Limits, parent: Optional[str] = None) -> Optional["Cgroup"]:
    """Makes (or takes over and empties) the group `parent/name` and sets its limits.

    Args:
      name: the group's name, unique per live sandbox (bwrap uses its uid).
      limits: memory (+swap, no swap beyond it), pids and CPU quota are applied.
      parent: the group the sandboxes' groups live under, relative to each hierarchy's root
        (None: `arbor-sandbox`, or under this process's own cgroup after
        `nest_under_own_cgroup`).

    Returns:
      The group, or None when the machine offers none of the controllers.
    """
    v2, v1 = _mounts()
    if v2 is not None:
      rel = parent if parent is not None else _parents.get("", SANDBOXES)
      wanted = [c for c in CONTROLLERS if c in open(os.path.join(v2, "cgroup.controllers")).read()]
      _enable_down_to(v2, rel, wanted)
      path = os.path.join(v2, rel, name)
      os.makedirs(path, exist_ok=True)
      cg = cls({c: path for c in wanted}, 2)
    elif v1:
      dirs = {}
      for c, mount in v1.items():
        rel = parent if parent is not None else _parents.get(c, SANDBOXES)
        path = os.path.join(mount, rel, name)
        os.makedirs(path, exist_ok=True)
        dirs[c] = path
      cg = cls(dirs, 1)
    else:
      return None
    cg.kill()  # a stale group of a crashed holder of this name
    cg._limit(limits)
    return cg

  @classmethod
  def existing(cls, name: str, parent: Optional[str] = None) -> Optional["Cgroup"]:
    """The group `parent/name` where it exists (a crashed holder's), without changing it.

    Args:
      name: the group's name.
      parent: as in `create`.

    Returns:
      The group (its existing directories only), or None when there is none.
    """
    v2, v1 = _mounts()
    if v2 is not None:
      path = os.path.join(v2, parent if parent is not None else _parents.get("", SANDBOXES),
                          name)
      return cls({c: path for c in CONTROLLERS}, 2) if os.path.isdir(path) else None
    dirs = {c: os.path.join(mount, parent if parent is not None else
                            _parents.get(c, SANDBOXES), name) for c, mount in v1.items()}
    dirs = {c: d for c, d in dirs.items() if os.path.isdir(d)}
    return cls(dirs, 1) if dirs else None

  def _limit(self, limits: Limits) -> None:
    mem = limits.memory_mb << 20
    quota = max(1000, int(limits.cpus * 100_000))
    if self.version == 2:
      d = self.dirs["memory"]
      _write(os.path.join(d, "memory.max"), str(mem))
      if os.path.exists(os.path.join(d, "memory.swap.max")):
        _write(os.path.join(d, "memory.swap.max"), "0")
      _write(os.path.join(d, "pids.max"), str(limits.pids))
      if "cpu" in self.dirs:
        _write(os.path.join(d, "cpu.max"), f"{quota} 100000")
      return
    if "memory" in self.dirs:
      d = self.dirs["memory"]
      # memsw >= limit at all times: lower memsw last when shrinking, first when growing.
      memsw = os.path.join(d, "memory.memsw.limit_in_bytes")
      has_memsw = os.path.exists(memsw)
      current = int(open(os.path.join(d, "memory.limit_in_bytes")).read())
      if has_memsw and mem > current:
        _write(memsw, str(mem))
      _write(os.path.join(d, "memory.limit_in_bytes"), str(mem))
      if has_memsw:
        _write(memsw, str(mem))  # memory + swap = memory: no swap at all
    if "pids" in self.dirs:
      _write(os.path.join(self.dirs["pids"], "pids.max"), str(limits.pids))
    if "cpu" in self.dirs:
      _write(os.path.join(self.dirs["cpu"], "cpu.cfs_period_us"), "100000")
      _write(os.path.join(self.dirs["cpu"], "cpu.cfs_quota_us"), str(quota))

  def pids(self) -> set[int]:
    """Pids of the processes in the group."""
    out = set()
    for f in self.procs_files:
      try:
        out.update(int(p) for p in open(f).read().split())
      except FileNotFoundError:
        pass
    return out

  def kill(self, deadline: float = 5.0) -> bool:
    """SIGKILLs every process in the group until it is empty.

    Args:
      deadline: seconds to keep trying.

    Returns:
      False if the group is not empty by then.
    """
    kill_file = os.path.join(next(iter(self.dirs.values()), ""), "cgroup.kill")
    t_end = time.monotonic() + deadline
    while time.monotonic() < t_end:
      pids = self.pids()
      if not pids:
        return True
      if self.version == 2 and os.path.exists(kill_file):
        _write(kill_file, "1")
      else:  # v1: repeat until a fork bomb (bounded by pids.max) has no survivor left
        for pid in pids:
          try:
            os.kill(pid, signal.SIGKILL)
          except ProcessLookupError:
            pass
      time.sleep(0.002)
    return not self.pids()

  def remove(self) -> None:
    """Deletes the (empty) group; a busy group is left for the next holder of the name."""
    for d in set(self.dirs.values()):
      for _ in range(50):
        try:
          os.rmdir(d)
          break
        except FileNotFoundError:
          break
        except OSError:  # EBUSY: zombies not yet reaped
          time.sleep(0.002)
