"""How much host memory this process may use, read from where it really runs: its own
memory cgroup and the kernel's counts.

NOTE [ Memory limits ]
======================

Containers and batch schedulers run almost every training job in a memory cgroup, and
the limit that kills the job is that cgroup's, not the machine's RAM. Two numbers
follow from it (:func:`host_memory`):

* ``total``: the least of ``MemTotal`` (``/proc/meminfo``) and the cgroup's
  *effective limit*. ``host_budget_bytes="auto"`` is half of it (NOTE [ Host tier ] in
  _store/hosttier.py); ``policy="auto"``'s memory floor keeps 10% of it free on a CPU-only
  run (NOTE [ The offload quota ] in _policies/auto.py, step 0, through ``Probe.headroom``).
* ``available``: the least of ``MemAvailable`` and, at each cgroup level with a limit,
  that limit less its usage plus its inactive file pages (page cache the kernel
  reclaims before it kills anything: v2 ``memory.stat``'s ``inactive_file``, v1's
  ``total_inactive_file``, as a container's "working set" counts it).

**Which cgroup.** The process's own, named in ``/proc/self/cgroup``, never the files at
the root of ``/sys/fs/cgroup`` (those are the machine's root cgroup, or a container's
view, not the process's: a job in a 2 GiB cgroup read the root's "no limit" and sized
its host tier to half the machine). The line of the v1 ``memory`` controller
(``4:memory:/a/b``) wins where there is one: on a hybrid hierarchy (v1 controllers
and a unified v2 mount without them) memory is v1's. Else the v2 line (``0::/a/b``).
The hierarchy's mount comes from ``/proc/self/mountinfo`` (fstype ``cgroup`` with
``memory`` among its options, or ``cgroup2``), falling back to ``/sys/fs/cgroup/memory``
and ``/sys/fs/cgroup``; the mount's root (mountinfo's 4th field) is cut from the
process's path, so a container that sees only its own subtree (a cgroup namespace, or
a bind mount of its cgroup: ``/proc/self/cgroup`` says ``/`` or ``/docker/<id>``, the
mount's root is the same) finds its files at the mount point. Where the path does not
lie under the mount's root, or its directory is missing, the mount point is read as the
process's cgroup (at worst the root's "no limit": the kernel's numbers then stand).

**Nested limits.** A cgroup's limit binds every cgroup below it, so the effective limit
is the least along the path from the process's cgroup up to the highest one visible
(the mount point). v2: each level's ``memory.max`` and ``memory.high`` (past ``high``
the kernel throttles the cgroup to reclaim: as good as a wall for a training step);
``max`` means none. v1: each level's ``memory.limit_in_bytes`` where
``memory.use_hierarchy`` is 1 or missing (else only the process's own), and
``memory.stat``'s ``hierarchical_memory_limit``, which covers ancestors a container
cannot see; "no limit" is written as LONG_MAX rounded down to a page, so every value
from 2^60 up is none.

**Cost.** ``policy="auto"`` reads the room at every forward's end, on the training
thread. A full read is about seven files (150 µs on this project's VM), so on the real
root the layout (mountinfo, the levels, ``memory.use_hierarchy``) and the limits are
read again at most once a second, or at once when ``/proc/self/cgroup`` changes (the
process moved); the usage and ``memory.stat`` of each level with a limit, which the
room is made of, are read at every call. A limit changed while the job runs is seen
within a second. A fake tree (``root=``, tests) is read whole every time.

**Never a crash.** A missing or unreadable file, a value that is not a number, an
unknown layout: that level (or the whole cgroup) says nothing, and the kernel's numbers
stand alone. Nothing here raises; :meth:`HostMemory.describe` says where the numbers
came from.

**Pinned memory is not capped by ``RLIMIT_MEMLOCK``.** The host tier pins its buffers
through CUDA (``torch.empty(..., pin_memory=True)``: ``cudaHostAlloc``, or
``cudaHostRegister``), and the NVIDIA driver pins those pages itself (its
``os_lock_user_pages`` takes ``get_user_pages`` references) without counting them
against ``RLIMIT_MEMLOCK``, which binds ``mlock(2)``, io_uring's registered buffers
and RDMA registrations. Capping ``"auto"`` at it gave a host tier of 8 MiB (the systemd default ``ulimit
-l``) or 64 KiB (Docker's) on most GPU machines. The pinned pages are charged to the
memory cgroup, which is why its limit, not ``ulimit -l``, bounds the host tier.
"""

from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass
from typing import List, Optional, Tuple

__all__ = ["ROOT", "CgroupMemory", "HostMemory", "Mount", "cgroup_memory", "host_memory",
           "parse_proc_cgroup", "parse_mountinfo", "cgroup_levels", "meminfo"]

ROOT = "/"  # where /proc and /sys are: tests point it at a fake tree
UNLIMITED = 1 << 60  # at or above: "no limit" (v1 writes LONG_MAX rounded to a page)
_OCTAL = re.compile(r"\\([0-7]{3})")
_MEMINFO_KEYS = ("MemTotal:", "MemFree:", "MemAvailable:")
_MOUNTS = ("", [])  # the last mountinfo text read and its cgroup mounts
_PLAN_TTL_S = 1.0   # how long the real root's layout and limits are trusted (cgroup_memory)
_PLAN = (0.0, None, None)  # (expires, /proc/self/cgroup text, plan) of the real root
_STAT_KEYS = {}     # memory.stat key -> its compiled pattern (_stat_value)
_V2_INACTIVE = ("inactive_file",)
_V1_INACTIVE = ("total_inactive_file", "inactive_file")


@dataclass(frozen=True)
class Mount:
    """A cgroup hierarchy's mount (a line of ``/proc/self/mountinfo``)."""
    root: str          # the cgroup path mounted there ("/" unless a container's view)
    point: str         # where it is mounted
    version: int       # 1 or 2
    controllers: frozenset  # v1: the controllers in its super options ("memory", ...)


@dataclass(frozen=True)
class CgroupMemory:
    """The memory cgroup this process is in (:func:`cgroup_memory`)."""
    version: int               # 1 or 2
    path: str                  # as /proc/self/cgroup names it ("/" in a namespace)
    directory: str             # where its files are
    limit: Optional[int]       # the least limit along its path; None: none
    limit_at: str              # which file of which cgroup sets it ("" without a limit)
    available: Optional[int]   # least of limit - usage + inactive file, None if unknown


@dataclass(frozen=True)
class HostMemory:
    """What this process may use of host memory (:func:`host_memory`)."""
    total: int                 # least of MemTotal and the cgroup's limit
    available: int             # least of MemAvailable and the cgroup's room
    ram: int                   # MemTotal (the machine's, or what the kernel shows)
    cgroup: Optional[CgroupMemory]

    @property
    def limited(self) -> bool:
        """Whether the cgroup's limit, not the machine's RAM, is the total."""
        c = self.cgroup
        return c is not None and c.limit is not None and c.limit < self.ram

    def describe(self) -> str:
        """Where :attr:`total` comes from, for a log line or a config's reason."""
        if self.limited:
            return f"the cgroup memory limit {_size(self.total)} ({self.cgroup.limit_at})"
        where = "" if self.cgroup is None else \
            f"; cgroup v{self.cgroup.version} {self.cgroup.path}: " + \
            ("no limit" if self.cgroup.limit is None else
             f"limit {_size(self.cgroup.limit)} at or above the RAM")
        return f"the machine's memory {_size(self.total)} (MemTotal{where})"


def _size(n: int) -> str:
    return f"{n / (1 << 30):.2f} GiB" if n >= 1 << 30 else f"{n / (1 << 20):.1f} MiB"


def _under(root: str, path: str) -> str:
    """The absolute ``path`` as seen from ``root`` (a fake tree in tests)."""
    return os.path.join(root, path.lstrip("/")) if root not in ("", "/") else path


def _read(path: str) -> Optional[str]:
    try:
        with open(path) as f:
            return f.read()
    except (OSError, UnicodeDecodeError, ValueError):
        return None


def _limit(text: Optional[str]) -> Optional[int]:
    """A limit file's value: bytes, or None ("max", LONG_MAX, missing, not a number)."""
    if text is None:
        return None
    text = text.strip()
    if not text.isdigit():
        return None
    value = int(text)
    return value if value < UNLIMITED else None


def _number(text: Optional[str]) -> Optional[int]:
    if text is None or not text.strip().isdigit():
        return None
    return int(text.strip())


def _stat_value(text: Optional[str], keys) -> Optional[int]:
    """The value of the first of ``keys`` that ``memory.stat``'s ``text`` has (as
    lines ``key value``, the value all digits), or None; a regular expression, not a
    parse of every line (the file has dozens)."""
    if not text:
        return None
    for key in keys:
        pattern = _STAT_KEYS.get(key)
        if pattern is None:
            pattern = _STAT_KEYS[key] = re.compile(rf"^[ \t]*{re.escape(key)}[ \t]+(\d+)[ \t]*$",
                                                   re.M)
        m = pattern.search(text)
        if m is not None:
            return int(m.group(1))
    return None


def parse_proc_cgroup(text: str) -> Tuple[Optional[str], Optional[str]]:
    """``(v1 memory path, v2 path)`` from ``/proc/self/cgroup``'s lines
    ``hierarchy:controllers:path``; None where there is no such line."""
    v1 = v2 = None
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3 or not parts[2].startswith("/"):
            continue
        hierarchy, controllers, path = parts
        if hierarchy == "0" and controllers == "":
            v2 = path
        elif "memory" in controllers.split(","):
            v1 = path
    return v1, v2


def _unescape(field: str) -> str:
    return _OCTAL.sub(lambda m: chr(int(m.group(1), 8)), field)


def parse_mountinfo(text: str) -> List[Mount]:
    """The cgroup mounts of ``/proc/self/mountinfo`` (``ID PARENT MAJ:MIN ROOT POINT
    OPTIONS [OPTIONAL...] - FSTYPE SOURCE SUPER_OPTIONS``), in its order."""
    mounts = []
    for line in text.splitlines():
        fields = line.split()
        try:
            dash = fields.index("-", 6)
        except ValueError:
            continue
        if len(fields) < dash + 2:
            continue
        fstype = fields[dash + 1]
        if fstype not in ("cgroup", "cgroup2"):
            continue
        supers = fields[dash + 3].split(",") if len(fields) > dash + 3 else []
        mounts.append(Mount(root=_unescape(fields[3]), point=_unescape(fields[4]),
                            version=2 if fstype == "cgroup2" else 1,
                            controllers=frozenset(supers) if fstype == "cgroup" else
                            frozenset()))
    return mounts


def _relative(path: str, root: str) -> Optional[str]:
    """``path`` below the cgroup ``root`` ("" for the root itself), or None."""
    root = root.rstrip("/")
    if path.rstrip("/") == root:
        return ""
    if path.startswith(root + "/"):
        return path[len(root):].strip("/")
    return None


def cgroup_levels(path: str, mount: Mount, root: str = "/") -> List[Tuple[str, str]]:
    """``(cgroup path, directory)`` of the process's cgroup ``path`` and of each
    ancestor up to the mount's root, the process's own first; just the mount point
    where ``path`` does not lie under the mount's root or its directory is missing."""
    point = _under(root, mount.point)
    rel = _relative(path, mount.root)
    if rel is not None and os.path.isdir(os.path.join(point, rel)):
        parts = rel.split("/") if rel else []
        base = mount.root.rstrip("/")
        return [((base + "/" + "/".join(parts[:i])).rstrip("/") or "/",
                 os.path.join(point, *parts[:i]))
                for i in range(len(parts), -1, -1)]
    return [(path, point)]


def _mount(mounts: List[Mount], version: int, path: str) -> Optional[Mount]:
    """The mount of the hierarchy of ``version`` (v1: the memory controller's), the one
    whose root holds ``path`` first."""
    fitting = [m for m in mounts if m.version == version and
               (version == 2 or "memory" in m.controllers)]
    for m in fitting:
        if _relative(path, m.root) is not None:
            return m
    return fitting[0] if fitting else None


def _level_v2(directory: str):
    """``(limit, file)`` of one v2 cgroup: the lesser of memory.max and memory.high."""
    best = None
    for name in ("memory.max", "memory.high"):
        value = _limit(_read(os.path.join(directory, name)))
        if value is not None and (best is None or value < best[0]):
            best = (value, name)
    return best


def _room(directory: str, limit: int, usage_file: str, inactive_keys) -> Optional[int]:
    """``limit`` less the cgroup's usage plus its inactive file pages, or None."""
    usage = _number(_read(os.path.join(directory, usage_file)))
    if usage is None:
        return None
    inactive = _stat_value(_read(os.path.join(directory, "memory.stat")), inactive_keys) or 0
    return max(0, min(limit, limit - usage + inactive))


def cgroup_memory(root: Optional[str] = None) -> Optional[CgroupMemory]:
    """The memory cgroup this process is in, its effective limit and room (NOTE [ Memory
    limits ]); None where there is none to be found (no ``/proc/self/cgroup``, no memory
    hierarchy). ``root``: where ``/proc`` and ``/sys`` are (default :data:`ROOT`).

    On the real root the layout and the limits are read again at most every
    ``_PLAN_TTL_S`` seconds, or as soon as ``/proc/self/cgroup`` changes; the usage and
    ``memory.stat`` behind the room are read at every call (``policy="auto"`` reads
    this at every forward's end: NOTE [ Memory limits ], "Cost")."""
    global _PLAN
    root = ROOT if root is None else root
    text = _read(_under(root, "/proc/self/cgroup"))
    if text is None:
        return None
    cached = root == "/"
    expires, seen, plan = _PLAN if cached else (0.0, None, None)
    now = time.monotonic()
    if seen != text or now >= expires:
        plan = _plan(root, text)
        if cached:
            _PLAN = (now + _PLAN_TTL_S, text, plan)  # one store: threads read it whole
    if plan is None:
        return None
    version, path, directory, limits = plan
    if not limits:
        return CgroupMemory(version, path, directory, None, "", None)
    rooms = [r for r in (_room(d, limit, usage, keys) for limit, _, d, usage, keys in limits)
             if r is not None]
    limit, where = min(((lim, w) for lim, w, _, _, _ in limits), key=lambda x: x[0])
    return CgroupMemory(version, path, directory, limit, where, min(rooms) if rooms else None)


def _plan(root: str, text: str):
    """What :func:`cgroup_memory` reads the room from: ``(version, path, directory,
    limits)``, each limit ``(bytes, where, directory, usage file, inactive keys)``; None
    without a memory hierarchy."""
    global _MOUNTS
    v1, v2 = parse_proc_cgroup(text)
    info = _read(_under(root, "/proc/self/mountinfo")) or ""
    seen = _MOUNTS  # one read of the pair: another thread may replace it
    if info != seen[0]:  # parsed again only when it changed
        seen = _MOUNTS = (info, parse_mountinfo(info))
    mounts = seen[1]
    if v1 is not None:
        version, path = 1, v1
        mount = _mount(mounts, 1, path) or Mount("/", "/sys/fs/cgroup/memory", 1,
                                                 frozenset({"memory"}))
    elif v2 is not None:
        version, path = 2, v2
        mount = _mount(mounts, 2, path) or Mount("/", "/sys/fs/cgroup", 2, frozenset())
    else:
        return None
    levels = cgroup_levels(path, mount, root)
    directory = levels[0][1]
    limits = []  # (limit, where, directory, usage file, inactive keys)
    if version == 2:
        for cg, d in levels:
            found = _level_v2(d)
            if found is not None:
                limits.append((found[0], f"{found[1]} of {cg}", d, "memory.current",
                               _V2_INACTIVE))
    else:
        # 1 on every kernel since 5.11 (it cannot be 0 there): missing counts as 1
        hierarchical = (_read(os.path.join(directory, "memory.use_hierarchy")) or "1").strip() \
            == "1"
        for cg, d in levels if hierarchical else levels[:1]:
            value = _limit(_read(os.path.join(d, "memory.limit_in_bytes")))
            if value is not None:
                limits.append((value, f"memory.limit_in_bytes of {cg}", d,
                               "memory.usage_in_bytes", _V1_INACTIVE))
        stated = _stat_value(_read(os.path.join(directory, "memory.stat")),
                             ("hierarchical_memory_limit",))
        value = None if stated is None else _limit(str(stated))
        if value is not None and all(value < lim for lim, _, _, _, _ in limits):
            # set above what this process can see: its usage there is at least ours
            limits.append((value, f"hierarchical_memory_limit of {levels[0][0]}", directory,
                           "memory.usage_in_bytes", _V1_INACTIVE))
    return version, path, directory, limits


def meminfo(root: Optional[str] = None) -> Tuple[int, int]:
    """``(MemTotal, MemAvailable)`` in bytes from ``/proc/meminfo``; where it cannot be
    read, the physical pages (``sysconf``) for both, and ``MemFree`` for a kernel
    without ``MemAvailable``."""
    root = ROOT if root is None else root
    fields = {}
    for line in (_read(_under(root, "/proc/meminfo")) or "").splitlines():
        parts = line.split()
        if len(parts) >= 2 and parts[0] in _MEMINFO_KEYS and parts[1].isdigit():
            fields[parts[0][:-1]] = int(parts[1]) * (1024 if parts[2:3] == ["kB"] else 1)
            if len(fields) == len(_MEMINFO_KEYS):
                break  # the first lines: the rest is not read
    total = fields.get("MemTotal")
    if not total:
        try:
            total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError, AttributeError):
            total = 1 << 62  # no way to tell: no limit from here
    available = fields.get("MemAvailable", fields.get("MemFree", total))
    return total, min(available, total)


def host_memory(root: Optional[str] = None) -> HostMemory:
    """``total`` and ``available`` host memory for this process (NOTE [ Memory limits ]):
    the kernel's ``MemTotal``/``MemAvailable`` and its cgroup's limit and room, the
    least of each. ``root``: where ``/proc`` and ``/sys`` are (default :data:`ROOT`)."""
    ram, available = meminfo(root)
    cg = cgroup_memory(root)
    total = ram
    if cg is not None and cg.limit is not None:
        total = min(total, cg.limit)
        available = min(available, total if cg.available is None else cg.available)
    return HostMemory(total=total, available=available, ram=ram, cgroup=cg)
