"""Per-sandbox cgroups (v2, or v1 per controller): memory (+swap), pids, CPU, and kill-all.

A sandbox's cgroup is `<hierarchy>/<parent>/<name>` in every hierarchy that offers a controller
we use. cgroup v2 is used when its root offers memory and pids; otherwise each controller is
taken from the v1 hierarchy that has it. What neither offers is reported by `missing` so the
caller can fall back to rlimits. Everything here needs root.
"""

from __future__ import annotations

import functools
import os
import signal
import time
from typing import Optional

from envs.sandbox.base import Limits

CONTROLLERS = ("memory", "pids", "cpu")


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
  def create(cls, name: str, limits: Limits, parent: str = "arbor-sandbox") -> Optional["Cgroup"]:
    """Makes (or takes over and empties) the group `parent/name` and sets its limits.

    Args:
      name: the group's name, unique per live sandbox (bwrap uses its uid).
      limits: memory (+swap, no swap beyond it), pids and CPU quota are applied.
      parent: the group the sandboxes' groups live under.

    Returns:
      The group, or None when the machine offers none of the controllers.
    """
    v2, v1 = _mounts()
    if v2 is not None:
      base = os.path.join(v2, parent)
      if not os.path.isdir(base):
        os.makedirs(base, exist_ok=True)
      wanted = [c for c in CONTROLLERS if c in open(os.path.join(v2, "cgroup.controllers")).read()]
      for d in (v2, base):  # enable the controllers for the children of root and of parent
        _write(os.path.join(d, "cgroup.subtree_control"), " ".join("+" + c for c in wanted))
      path = os.path.join(base, name)
      os.makedirs(path, exist_ok=True)
      cg = cls({c: path for c in wanted}, 2)
    elif v1:
      dirs = {}
      for c, mount in v1.items():
        path = os.path.join(mount, parent, name)
        os.makedirs(path, exist_ok=True)
        dirs[c] = path
      cg = cls(dirs, 1)
    else:
      return None
    cg.kill()  # a stale group of a crashed holder of this name
    cg._limit(limits)
    return cg

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
