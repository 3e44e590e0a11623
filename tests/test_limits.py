"""Memory limits from where the process really is (NOTE [ Memory limits ] in
ssdtrain/_limits.py): its own memory cgroup (v1, v2, hybrid, nested, namespaced, mounted
anywhere), the kernel's MemTotal/MemAvailable, and what ``host_budget_bytes="auto"``
and ``policy="auto"``'s memory floor make of them.

Most tests build a fake ``/proc`` and ``/sys`` under ``tmp_path`` and read it through
``root=`` (or ``ssdtrain._limits.ROOT``). The last two run child processes in a real
cgroup made for them, where the machine lets a test make one (root, a writable memory
hierarchy), and skip saying why where it does not.
"""

from __future__ import annotations

import json
import logging
import os
import resource
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ssdtrain
from ssdtrain import testing
from ssdtrain import _limits
from ssdtrain._config import budget_bytes, default_host_budget
from ssdtrain._limits import cgroup_memory, host_memory, parse_mountinfo, parse_proc_cgroup

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
V1_UNLIMITED = "9223372036854771712"   # LONG_MAX rounded down to a 4 KiB page
# The mount lines of this machine's hybrid hierarchy (v1 controllers, v2 "unified").
V1_MOUNT = "35 31 0:32 {root} /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory"
V2_MOUNT = "41 31 0:38 {root} /sys/fs/cgroup rw,nosuid shared:9 - cgroup2 cgroup2 rw,nsdelegate"
UNIFIED = "41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw"
TMPFS = "31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755"


def fake(root: Path, files: dict, *, total=64 * GiB, available=60 * GiB) -> str:
    """Write ``files`` (absolute path as the process sees it -> text) under ``root``,
    with a /proc/meminfo of ``total`` and ``available`` bytes; returns ``str(root)``."""
    files = {"/proc/meminfo": f"MemTotal:       {total // KiB} kB\n"
                              f"MemFree:        {available // KiB // 2} kB\n"
                              f"MemAvailable:   {available // KiB} kB\n"
                              "Buffers:          1024 kB\n", **files}
    for path, text in files.items():
        p = root / path.lstrip("/")
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return str(root)


def v2_tree(tmp_path, path="/job", levels=None, *, root="/", point="/sys/fs/cgroup", **kw):
    """A pure cgroup v2 machine: the process in ``path``; ``levels`` maps a cgroup path
    to its files (name -> text)."""
    files = {"/proc/self/cgroup": f"0::{path}\n",
             "/proc/self/mountinfo": V2_MOUNT.format(root=root).replace("/sys/fs/cgroup", point)
             + "\n"}
    for cg, named in (levels or {}).items():
        rel = cg[len(root.rstrip("/")):] if cg.startswith(root) else cg
        for name, text in named.items():
            files[f"{point}/{rel.strip('/')}/{name}".replace("//", "/")] = text
    return fake(tmp_path, files, **kw)


# ------------------------------------------------------------------------- cgroup v2
def test_v2_reads_the_process_own_cgroup_not_the_files_at_the_root(tmp_path):
    """The bug: the files at the root of /sys/fs/cgroup were read (no limit there), not
    the process's cgroup named in /proc/self/cgroup."""
    root = v2_tree(tmp_path, "/job", {
        "/": {"memory.max": "max\n", "memory.current": "40000000000\n"},
        "/job": {"memory.max": f"{2 * GiB}\n", "memory.current": f"{500 * MiB}\n",
                 "memory.stat": f"anon {400 * MiB}\nfile {100 * MiB}\n"
                                f"active_file {60 * MiB}\ninactive_file {40 * MiB}\n"}})
    cg = cgroup_memory(root)
    assert (cg.version, cg.path, cg.limit) == (2, "/job", 2 * GiB)
    assert cg.directory == os.path.join(root, "sys/fs/cgroup/job")
    assert cg.limit_at == "memory.max of /job"
    assert cg.available == 2 * GiB - 500 * MiB + 40 * MiB  # inactive page cache counts
    mem = host_memory(root)
    assert (mem.total, mem.available, mem.ram) == (2 * GiB, cg.available, 64 * GiB)
    assert mem.limited
    assert mem.describe() == "the cgroup memory limit 2.00 GiB (memory.max of /job)"
    assert default_host_budget(mem) == (GiB, "half of the cgroup memory limit 2.00 GiB "
                                             "(memory.max of /job)")


def test_v2_nested_limit_is_the_least_along_the_path_high_included(tmp_path):
    """A parent's limit binds its children: the effective limit is the least of
    memory.max and memory.high from the process's cgroup up to the root; "max" is none;
    the room is the least of each limited level's."""
    root = v2_tree(tmp_path, "/a/b/c", {
        "/a": {"memory.max": f"{GiB}\n", "memory.high": "max\n",
               "memory.current": f"{900 * MiB}\n", "memory.stat": "inactive_file 0\n"},
        "/a/b": {"memory.max": "max\n", "memory.high": "max\n"},
        "/a/b/c": {"memory.max": f"{3 * GiB}\n", "memory.high": f"{2 * GiB}\n",
                   "memory.current": f"{100 * MiB}\n"}})
    cg = cgroup_memory(root)
    assert (cg.limit, cg.limit_at) == (GiB, "memory.max of /a")
    assert cg.available == 124 * MiB          # /a: 1024 - 900, less than /a/b/c's room
    (tmp_path / "sys/fs/cgroup/a/b/c/memory.high").write_text(f"{512 * MiB}\n")
    cg = cgroup_memory(root)
    assert (cg.limit, cg.limit_at) == (512 * MiB, "memory.high of /a/b/c")
    assert cg.available == 124 * MiB
    (tmp_path / "sys/fs/cgroup/a/memory.current").write_text(f"{100 * MiB}\n")
    assert cgroup_memory(root).available == 412 * MiB   # /a/b/c: 512 - 100


def test_v2_max_everywhere_is_no_limit_and_the_machine_speaks(tmp_path):
    root = v2_tree(tmp_path, "/user.slice/job", {
        "/user.slice": {"memory.max": "max\n"},
        "/user.slice/job": {"memory.max": "max\n", "memory.high": "max\n",
                            "memory.current": f"{5 * GiB}\n"}}, total=32 * GiB,
        available=20 * GiB)
    cg = cgroup_memory(root)
    assert cg.limit is None and cg.available is None and cg.limit_at == ""
    mem = host_memory(root)
    assert (mem.total, mem.available, mem.limited) == (32 * GiB, 20 * GiB, False)
    assert mem.describe() == ("the machine's memory 32.00 GiB (MemTotal; cgroup v2 "
                              "/user.slice/job: no limit)")


def test_a_limit_above_the_ram_leaves_the_ram_the_total(tmp_path):
    root = v2_tree(tmp_path, "/job", {"/job": {"memory.max": f"{128 * GiB}\n",
                                               "memory.current": f"{GiB}\n"}},
                   total=16 * GiB, available=10 * GiB)
    mem = host_memory(root)
    assert (mem.total, mem.available, mem.limited) == (16 * GiB, 10 * GiB, False)
    assert "limit 128.00 GiB at or above the RAM" in mem.describe()


def test_available_is_never_more_than_memavailable(tmp_path):
    """A cgroup with room on a machine without: the kernel's MemAvailable wins."""
    root = v2_tree(tmp_path, "/job", {"/job": {"memory.max": f"{8 * GiB}\n",
                                               "memory.current": f"{GiB}\n"}},
                   total=16 * GiB, available=2 * GiB)
    mem = host_memory(root)
    assert (mem.total, mem.available) == (8 * GiB, 2 * GiB)


def test_namespaced_v2_root_path_reads_the_files_at_the_mount_point(tmp_path):
    """In a cgroup namespace (Docker, Kubernetes on v2) /proc/self/cgroup says "0::/"
    and the container's own cgroup files sit at the mount point."""
    root = v2_tree(tmp_path, "/", {"/": {"memory.max": f"{GiB}\n",
                                         "memory.current": f"{256 * MiB}\n"}})
    cg = cgroup_memory(root)
    assert (cg.path, cg.limit, cg.limit_at) == ("/", GiB, "memory.max of /")
    assert cg.directory == os.path.join(root, "sys/fs/cgroup")
    assert host_memory(root).total == GiB


def test_the_mount_point_comes_from_mountinfo(tmp_path):
    """A v2 hierarchy mounted elsewhere (here at "/run/my cgroup", octal-escaped in
    mountinfo as the kernel writes it); nothing under /sys/fs/cgroup is read."""
    files = {"/proc/self/cgroup": "0::/svc\n",
             "/proc/self/mountinfo": "22 1 0:5 / /proc rw - proc proc rw\n"
             "41 31 0:38 / /run/my\\040cgroup rw shared:9 - cgroup2 none rw\n",
             "/run/my cgroup/svc/memory.max": f"{3 * GiB}\n",
             "/run/my cgroup/svc/memory.current": f"{GiB}\n",
             "/sys/fs/cgroup/svc/memory.max": f"{GiB}\n"}   # a decoy
    root = fake(tmp_path, files)
    cg = cgroup_memory(root)
    assert (cg.limit, cg.available) == (3 * GiB, 2 * GiB)
    assert cg.directory == os.path.join(root, "run/my cgroup/svc")


def test_without_mountinfo_the_usual_mount_points_are_read(tmp_path):
    root = fake(tmp_path, {"/proc/self/cgroup": "0::/job\n",
                           "/sys/fs/cgroup/job/memory.max": f"{GiB}\n"})
    assert cgroup_memory(root).limit == GiB
    root = fake(tmp_path / "v1", {"/proc/self/cgroup": "4:memory:/job\n0::/\n",
                                  "/sys/fs/cgroup/memory/job/memory.limit_in_bytes":
                                      f"{GiB}\n"})
    assert cgroup_memory(root).limit == GiB


# ------------------------------------------------------------------------- cgroup v1
def v1_files(path, levels, *, root="/", point="/sys/fs/cgroup/memory"):
    files = {"/proc/self/cgroup": f"9:name=systemd:/\n8:pids:{path}\n"
                                  f"4:memory:{path}\n1:cpu,cpuacct:/\n",
             "/proc/self/mountinfo": "\n".join(
                 [TMPFS, V1_MOUNT.format(root=root).replace("/sys/fs/cgroup/memory", point),
                  "36 31 0:33 / /sys/fs/cgroup/pids rw - cgroup cgroup rw,pids"]) + "\n"}
    for cg, named in levels.items():
        rel = cg[len(root.rstrip("/")):]
        for name, text in named.items():
            files[f"{point}/{rel.strip('/')}/{name}".replace("//", "/")] = text
    return files


def test_v1_reads_the_memory_controller_line_and_the_levels_above(tmp_path):
    """cgroup v1: the ``memory`` line of /proc/self/cgroup, memory.limit_in_bytes at
    each level (use_hierarchy 1), usage less total_inactive_file; LONG_MAX is none."""
    root = fake(tmp_path, v1_files("/batch/job42", {
        "/": {"memory.limit_in_bytes": V1_UNLIMITED, "memory.usage_in_bytes": "1"},
        "/batch": {"memory.limit_in_bytes": f"{4 * GiB}\n",
                   "memory.usage_in_bytes": f"{3 * GiB}\n",
                   "memory.stat": f"inactive_file 1\ntotal_inactive_file {128 * MiB}\n"},
        "/batch/job42": {"memory.limit_in_bytes": V1_UNLIMITED + "\n",
                         "memory.usage_in_bytes": f"{GiB}\n",
                         "memory.use_hierarchy": "1\n",
                         "memory.stat": f"cache 1\nhierarchical_memory_limit {4 * GiB}\n"}}))
    cg = cgroup_memory(root)
    assert (cg.version, cg.path) == (1, "/batch/job42")
    assert (cg.limit, cg.limit_at) == (4 * GiB, "memory.limit_in_bytes of /batch")
    assert cg.available == GiB + 128 * MiB
    assert host_memory(root).describe() == ("the cgroup memory limit 4.00 GiB "
                                            "(memory.limit_in_bytes of /batch)")


def test_v1_hierarchical_limit_covers_ancestors_out_of_sight(tmp_path):
    """A container on v1 sees its own cgroup at the mount point (mountinfo's root is
    /docker/abc); a limit set above it shows only as hierarchical_memory_limit."""
    root = fake(tmp_path, v1_files("/docker/abc", {
        "/docker/abc": {"memory.limit_in_bytes": V1_UNLIMITED,
                        "memory.usage_in_bytes": f"{300 * MiB}\n",
                        "memory.use_hierarchy": "1",
                        "memory.stat": f"total_inactive_file {20 * MiB}\n"
                                       f"hierarchical_memory_limit {GiB}\n"}},
        root="/docker/abc"))
    cg = cgroup_memory(root)
    assert cg.directory == os.path.join(root, "sys/fs/cgroup/memory")
    assert (cg.limit, cg.limit_at) == (GiB, "hierarchical_memory_limit of /docker/abc")
    assert cg.available == GiB - 280 * MiB


def test_v1_without_use_hierarchy_only_its_own_limit_binds(tmp_path):
    """use_hierarchy 0 (kernels before 5.11): a parent's limit does not bind."""
    root = fake(tmp_path, v1_files("/a/b", {
        "/a": {"memory.limit_in_bytes": f"{GiB}\n", "memory.usage_in_bytes": "0"},
        "/a/b": {"memory.limit_in_bytes": f"{2 * GiB}\n",
                 "memory.usage_in_bytes": f"{GiB}\n", "memory.use_hierarchy": "0\n",
                 "memory.stat": f"hierarchical_memory_limit {2 * GiB}\n"}}))
    cg = cgroup_memory(root)
    assert (cg.limit, cg.limit_at, cg.available) == (2 * GiB, "memory.limit_in_bytes of /a/b",
                                                     GiB)
    # kernels since 5.11 are always hierarchical: a missing file counts as 1
    (tmp_path / "sys/fs/cgroup/memory/a/b/memory.use_hierarchy").unlink()
    cg = cgroup_memory(root)
    assert (cg.limit, cg.limit_at, cg.available) == (GiB, "memory.limit_in_bytes of /a", GiB)


def test_hybrid_hierarchy_reads_v1_memory_not_the_unified_mount(tmp_path):
    """This machine's layout: v1 controllers, a v2 mount at /sys/fs/cgroup/unified
    without the memory controller, the process in memory:/process_api/<id>."""
    files = {"/proc/self/cgroup": "9:name=systemd:/\n4:memory:/process_api/9c33\n"
                                  "2:cpuacct:/\n0::/\n",
             "/proc/self/mountinfo": "\n".join([TMPFS, V1_MOUNT.format(root="/"), UNIFIED])
             + "\n",
             "/sys/fs/cgroup/unified/cgroup.controllers": "\n",
             "/sys/fs/cgroup/memory/memory.limit_in_bytes": V1_UNLIMITED,
             "/sys/fs/cgroup/memory/process_api/memory.limit_in_bytes": V1_UNLIMITED,
             "/sys/fs/cgroup/memory/process_api/9c33/memory.limit_in_bytes": f"{2 * GiB}",
             "/sys/fs/cgroup/memory/process_api/9c33/memory.usage_in_bytes": f"{GiB}",
             "/sys/fs/cgroup/memory/process_api/9c33/memory.use_hierarchy": "1",
             "/sys/fs/cgroup/memory/process_api/9c33/memory.stat":
                 f"total_inactive_file 0\nhierarchical_memory_limit {2 * GiB}\n"}
    root = fake(tmp_path, files, total=24 * GiB, available=23 * GiB)
    cg = cgroup_memory(root)
    assert (cg.version, cg.path, cg.limit, cg.available) == (1, "/process_api/9c33",
                                                             2 * GiB, GiB)
    assert budget_of(root) == GiB


def budget_of(root):
    return default_host_budget(host_memory(root))[0]


# ------------------------------------------------------------- never a crash
BREAKAGES = {
    "no /proc/self/cgroup": lambda t: (t / "proc/self/cgroup").unlink(),
    "garbage /proc/self/cgroup": lambda t: (t / "proc/self/cgroup").write_text("x\n::\n3:a\n"),
    "garbage mountinfo": lambda t: (t / "proc/self/mountinfo").write_text("- - -\n1 2 3\n"),
    "memory.max a directory": lambda t: (
        (t / "sys/fs/cgroup/job/memory.max").unlink(),
        (t / "sys/fs/cgroup/job/memory.max").mkdir()),
    "memory.max not a number": lambda t: (t / "sys/fs/cgroup/job/memory.max").write_text("1e9"),
    "memory.max empty": lambda t: (t / "sys/fs/cgroup/job/memory.max").write_text(""),
    "memory.max not text": lambda t: (t / "sys/fs/cgroup/job/memory.max").write_bytes(b"\xff\xfe"),
    "memory.max negative": lambda t: (t / "sys/fs/cgroup/job/memory.max").write_text("-1"),
    "memory.current missing": lambda t: (t / "sys/fs/cgroup/job/memory.current").unlink(),
    "memory.stat garbage": lambda t: (t / "sys/fs/cgroup/job/memory.stat").write_text(
        "inactive_file x\n\x00\n1 2 3\n"),
    "cgroup directory missing": lambda t: (t / "proc/self/cgroup").write_text("0::/gone\n"),
    "no /proc/meminfo": lambda t: (t / "proc/meminfo").unlink(),
    "meminfo garbage": lambda t: (t / "proc/meminfo").write_text("MemTotal: lots\n"),
}


@pytest.mark.parametrize("broken", sorted(BREAKAGES))
def test_missing_or_bad_files_fall_back_and_never_raise(tmp_path, broken):
    """Whatever cannot be read says nothing; what can still bounds the numbers."""
    root = v2_tree(tmp_path, "/job", {"/job": {"memory.max": f"{GiB}\n",
                                               "memory.current": f"{GiB // 4}\n",
                                               "memory.stat": "inactive_file 0\n"}},
                   total=8 * GiB, available=6 * GiB)
    BREAKAGES[broken](tmp_path)
    mem = host_memory(root)
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    limit_readable = not broken.startswith(("memory.max", "no /proc/self", "garbage /proc",
                                            "cgroup directory"))
    assert mem.total == min(GiB if limit_readable else mem.ram, mem.ram)
    assert mem.ram == (ram if "meminfo" in broken else 8 * GiB)
    assert 0 <= mem.available <= mem.total
    if limit_readable and broken != "memory.current missing" and "meminfo" not in broken:
        assert mem.available == GiB - GiB // 4
    assert isinstance(mem.describe(), str) and isinstance(budget_of(root), int)


# ------------------------------------------------------------- random nested trees
_values = st.one_of(st.none(), st.just("max"), st.integers(0, 1 << 40).map(str),
                    st.sampled_from(["", "junk", "-5", V1_UNLIMITED]))


@st.composite
def v2_trees(draw):
    depth = draw(st.integers(1, 5))
    names = [f"n{i}" for i in range(depth)]
    top = draw(st.integers(0, depth))   # the mount's root: the levels above are not seen
    levels = []
    for i in range(top, depth + 1):
        levels.append(dict(path="/" + "/".join(names[:i]),
                           max=draw(_values), high=draw(_values),
                           current=draw(st.one_of(st.none(), st.integers(0, 1 << 40))),
                           inactive=draw(st.one_of(st.none(), st.integers(0, 1 << 40)))))
    return names, top, levels


def _limit_of(text):
    return int(text) if text is not None and text.isdigit() and int(text) < 1 << 60 else None


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tree=v2_trees())
def test_random_v2_trees_least_limit_along_the_visible_path(tree):
    """Over random nested trees (limits, "max", junk or nothing at each level; the
    mount's root anywhere on the path): the effective limit is the least valid
    memory.max/memory.high from the process's cgroup up to the mount's root, the room
    the least of each limited level's limit - usage + inactive file pages."""
    names, top, levels = tree
    mount_root = "/" + "/".join(names[:top])
    with tempfile.TemporaryDirectory() as d:
        files = {"/proc/self/cgroup": "0::/" + "/".join(names) + "\n",
                 "/proc/self/mountinfo": V2_MOUNT.format(root=mount_root) + "\n"}
        for lv in levels:
            base = "/sys/fs/cgroup" + lv["path"][len(mount_root.rstrip("/")):]
            os.makedirs(os.path.join(d, base.lstrip("/")), exist_ok=True)
            for key in ("max", "high", "current"):
                if lv[key] is not None:
                    files[f"{base}/memory.{key}"] = str(lv[key])
            if lv["inactive"] is not None:
                files[f"{base}/memory.stat"] = f"anon 1\ninactive_file {lv['inactive']}\n"
        root = fake(Path(d), files)
        cg = cgroup_memory(root)
    limits, rooms = [], []
    for lv in levels:
        lim = [v for v in (_limit_of(lv["max"]), _limit_of(lv["high"])) if v is not None]
        if lim:
            limits.append(min(lim))
            if lv["current"] is not None:
                cur, inact = lv["current"], lv["inactive"] or 0
                rooms.append(max(0, min(min(lim), min(lim) - cur + inact)))
    assert cg.limit == (min(limits) if limits else None)
    assert cg.available == (min(rooms) if rooms else None)
    if limits:   # the process's own level first: the deepest with the least limit
        def level_limit(lv):
            found = [v for v in (_limit_of(lv["max"]), _limit_of(lv["high"])) if v is not None]
            return min(found) if found else None
        at = next(lv["path"] or "/" for lv in reversed(levels) if level_limit(lv) == cg.limit)
        assert cg.limit_at.endswith(" of " + at), (cg.limit_at, at)


@settings(max_examples=100, deadline=None)
@given(depth=st.integers(1, 4), data=st.data())
def test_random_v1_trees_least_limit_with_hierarchy(depth, data):
    """v1: with use_hierarchy 1 the least memory.limit_in_bytes along the path and the
    leaf's hierarchical_memory_limit; with 0 the leaf's own and that value."""
    names = [f"n{i}" for i in range(depth)]
    hierarchy = data.draw(st.booleans())
    limits = [data.draw(_values) for _ in range(depth + 1)]
    hier = data.draw(_values)
    with tempfile.TemporaryDirectory() as d:
        levels = {"/" + "/".join(names[:i]): {} for i in range(depth + 1)}
        for (path, files), lim in zip(levels.items(), limits):
            if lim is not None:
                files["memory.limit_in_bytes"] = lim
        leaf = levels["/" + "/".join(names)]
        leaf["memory.use_hierarchy"] = "1" if hierarchy else "0"
        if hier is not None:
            leaf["memory.stat"] = f"hierarchical_memory_limit {hier}\n"
        root = fake(Path(d), v1_files("/" + "/".join(names), levels))
        got = cgroup_memory(root).limit
    seen = [_limit_of(v) for v in (limits if hierarchy else limits[-1:])] + [_limit_of(hier)]
    seen = [v for v in seen if v is not None]
    assert got == (min(seen) if seen else None)


def test_parsers_take_what_they_know_and_leave_the_rest():
    assert parse_proc_cgroup("12:memory:/a:b\n0::/c\n") == ("/a:b", "/c")
    assert parse_proc_cgroup("4:cpu,memory:/x\n") == ("/x", None)
    assert parse_proc_cgroup("0::/only\n1:name=systemd:/s\n") == (None, "/only")
    assert parse_proc_cgroup("") == (None, None)
    (m,) = parse_mountinfo("41 31 0:38 /a\\134b /x\\011y rw - cgroup2 none rw\n")
    assert (m.root, m.point, m.version) == ("/a\\b", "/x\ty", 2)
    (m,) = parse_mountinfo("35 31 0:32 / /m rw shared:1 master:2 - cgroup cg rw,memory,cpu\n")
    assert m.version == 1 and "memory" in m.controllers


def test_this_machine_is_read_without_error():
    """The real /proc and /sys: whatever they hold, a cgroup found is the one
    /proc/self/cgroup names, and the numbers are within the machine's."""
    mem = host_memory()
    assert 0 < mem.total <= mem.ram and 0 <= mem.available <= mem.total
    cg = mem.cgroup
    if cg is not None:
        v1, v2 = parse_proc_cgroup(Path("/proc/self/cgroup").read_text())
        assert cg.path == (v1 if cg.version == 1 else v2)


def _stat_oracle(text, keys):
    """What memory.stat's first of ``keys`` is, parsed line by line (the reference)."""
    stat = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[1].isdigit():
            stat.setdefault(parts[0], int(parts[1]))
    return next((stat[k] for k in keys if k in stat), None)


_STAT_LINE = st.one_of(
    st.tuples(st.sampled_from(["inactive_file", "total_inactive_file", "anon", "file",
                               "hierarchical_memory_limit", "inactive_file_x", "x_inactive_file"]),
              st.sampled_from([" ", "\t", "  "]),
              st.integers(0, 2**63).map(str) | st.sampled_from(["-1", "12a", "", "max"]))
    .map("".join),
    st.sampled_from(["", "garbage", "inactive_file 1 2", " inactive_file 5"]))


@given(st.lists(_STAT_LINE, max_size=12),
       st.sampled_from([("inactive_file",), ("total_inactive_file", "inactive_file"),
                        ("hierarchical_memory_limit",)]))
@settings(max_examples=300, deadline=None)
def test_stat_value_is_what_a_full_parse_finds(lines, keys):
    """memory.stat's value is found by a pattern, not a parse of every line: the same
    answer as the parse (first occurrence of a key, first of the keys), whatever the
    lines around it are."""
    text = "\n".join(lines) + "\n"
    assert _limits._stat_value(text, keys) == _stat_oracle(text, keys), text


def test_the_real_roots_layout_and_limits_are_read_once_a_second(monkeypatch):
    """NOTE [ Memory limits ], "Cost": on the real root a second call within
    ``_PLAN_TTL_S`` reads /proc/self/cgroup and, per level with a limit, its usage and
    memory.stat only; past it, or once /proc/self/cgroup reads otherwise, everything is
    read again. The answers are the same."""
    reads, real = [], _limits._read

    def counted(path):
        reads.append(path)
        return real(path)
    monkeypatch.setattr(_limits, "_read", counted)
    monkeypatch.setattr(_limits, "_PLAN", (0.0, None, None))
    first = cgroup_memory()
    if first is None:
        pytest.skip("no memory cgroup on this machine")
    full = len(reads)
    del reads[:]
    again = cgroup_memory()
    assert (again.limit, again.limit_at, again.directory) == \
        (first.limit, first.limit_at, first.directory)
    assert reads[0] == "/proc/self/cgroup" and "/proc/self/mountinfo" not in reads
    assert len(reads) < full and all(p.endswith(("memory.current", "memory.usage_in_bytes",
                                                 "memory.stat")) for p in reads[1:]), reads
    assert not any(p.endswith(("limit_in_bytes", "memory.max", "memory.high",
                               "use_hierarchy")) for p in reads), reads
    del reads[:]
    monkeypatch.setattr(_limits, "_PLAN", (0.0,) + _limits._PLAN[1:])  # expired
    cgroup_memory()
    assert len(reads) == full and "/proc/self/mountinfo" in reads
    del reads[:]

    def moved(path):
        reads.append(path)
        text = real(path)
        return text + "\n" if path == "/proc/self/cgroup" else text  # reads otherwise
    monkeypatch.setattr(_limits, "_read", moved)
    cgroup_memory()
    assert len(reads) == full, reads


def test_a_fake_root_is_read_whole_every_time(tmp_path):
    """A tree given as ``root`` (tests, tools) is never cached: a limit written between two
    calls is seen by the second."""
    root = v2_tree(tmp_path, "/job", {
        "/job": {"memory.max": f"{2 * GiB}\n", "memory.current": f"{GiB}\n"}})
    assert cgroup_memory(root).limit == 2 * GiB
    (Path(root) / "sys/fs/cgroup/job/memory.max").write_text(f"{GiB}\n")
    assert cgroup_memory(root).limit == GiB


# --------------------------------------------------- what "auto" makes of them
@pytest.fixture
def job_in_a_1gib_cgroup(tmp_path, monkeypatch):
    """``ssdtrain._limits.ROOT`` pointed at a v2 machine of 64 GiB whose process is in
    /job, limited to 1 GiB with 900 MiB used (8 MiB of it inactive page cache)."""
    root = v2_tree(tmp_path / "machine", "/job", {
        "/job": {"memory.max": f"{GiB}\n", "memory.current": f"{900 * MiB}\n",
                 "memory.stat": f"inactive_file {8 * MiB}\n"}})
    monkeypatch.setattr(_limits, "ROOT", root)
    return root


def test_auto_host_budget_is_half_the_cgroup_limit_and_says_where_from(
        job_in_a_1gib_cgroup, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="ssdtrain")
    cfg = ssdtrain.OffloadConfig(host_budget_bytes="auto").resolve()
    assert cfg.host_budget_bytes == 512 * MiB
    assert cfg.host_budget_reason == ("half of the cgroup memory limit 1.00 GiB "
                                      "(memory.max of /job)")
    assert ssdtrain.OffloadConfig(host_budget_bytes="1GiB").resolve().host_budget_reason \
        == "as configured"
    off = ssdtrain.Offloader(host_budget_bytes="auto", spill_dir=str(tmp_path),
                             policy="static")
    try:
        assert off.config.host_budget_reason == cfg.host_budget_reason
    finally:
        off.close()
    assert ("ssdtrain: host tier budget 512.0 MiB: half of the cgroup memory limit 1.00 GiB "
            "(memory.max of /job)") in caplog.messages


def test_auto_budget_is_not_capped_by_memlock_where_cuda_pins(tmp_path, monkeypatch):
    """CUDA's pinned memory is not counted against RLIMIT_MEMLOCK (NOTE [ Memory limits
    ]): a CUDA machine with Docker's 64 KiB ``ulimit -l`` still gets half its memory."""
    root = v2_tree(tmp_path, "/job", {"/job": {"memory.max": f"{4 * GiB}\n"}})
    monkeypatch.setattr(_limits, "ROOT", root)
    real = resource.getrlimit
    monkeypatch.setattr(resource, "getrlimit", lambda which: (64 * KiB, 64 * KiB)
                        if which == resource.RLIMIT_MEMLOCK else real(which))
    from ssdtrain._device import cuda as _cuda
    monkeypatch.setattr(_cuda, "default_device", lambda: torch.device("cuda", 0))
    assert budget_bytes("auto") == 2 * GiB


def test_the_memory_floor_of_a_cpu_run_reads_the_cgroup(job_in_a_1gib_cgroup, spill_dir):
    """``policy="auto"``'s memory floor on a CPU run (NOTE [ The offload quota ], step
    0) reads the host memory its cgroup leaves: the limit as the total, limit less
    usage (inactive page cache back) as free, not the machine's MemAvailable."""
    off = ssdtrain.Offloader(spill_dir=str(spill_dir), policy="auto")
    try:
        assert testing.headroom(off) == (GiB - 900 * MiB + 8 * MiB, GiB)
    finally:
        off.close()


# ------------------------------------------------------------- a real cgroup
CHILD = str(Path(__file__).resolve().parent / "cgroup_child.py")


def _remove(path):
    """rmdir a cgroup whose processes have exited (the kernel may lag a moment)."""
    for _ in range(200):
        try:
            os.rmdir(path)
            return
        except FileNotFoundError:
            return
        except OSError:
            time.sleep(0.05)
    os.rmdir(path)  # raises: the test says it could not clean up


@pytest.fixture
def child_cgroup():
    """``run(args, limit_bytes, env)``: runs ``cgroup_child.py`` in a new memory cgroup
    below this process's own (v1, or v2 where its parent lets a child have the memory
    controller) limited to ``limit_bytes``, ``{dir}`` in ``args`` replaced by its
    directory; the cgroup is removed when the run ends, pass or fail. Skips where the
    machine does not let a test make one (not root, a read-only or v2 hierarchy
    without the memory controller delegated)."""
    cg = cgroup_memory("/")
    if cg is None:
        pytest.skip("no memory cgroup found for this process (/proc/self/cgroup)")
    limit = "memory.limit_in_bytes" if cg.version == 1 else "memory.max"
    tag = f"ssdtrain-test-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    made = []

    def make():
        path = os.path.join(cg.directory, f"{tag}-{len(made)}")
        os.mkdir(path)
        made.append(path)
        return path

    try:
        path = make()
    except OSError as e:
        pytest.skip(f"cannot make a child memory cgroup in {cg.directory}: {e} (run as "
                    f"root with a writable cgroup hierarchy)")
    try:
        if not os.path.exists(os.path.join(path, limit)):
            pytest.skip(f"a child cgroup of {cg.path} has no {limit} (the memory "
                        f"controller is not delegated to it)")
        probe = subprocess.run(["sh", "-c", 'echo $$ > "$0/cgroup.procs"', path],
                               capture_output=True, text=True)
        if probe.returncode != 0:
            pytest.skip(f"cannot move a process into a child cgroup: {probe.stderr.strip()}")
    finally:
        _remove(path)

    def run(args, limit_bytes, env=None, timeout=300):
        path = make()
        try:
            with open(os.path.join(path, limit), "w") as f:
                f.write(str(limit_bytes))
            # the shell joins the cgroup, then becomes python: all it allocates counts
            cmd = ["sh", "-c", 'echo $$ > "$0/cgroup.procs" && exec "$@"', path,
                   sys.executable, CHILD, *[a.replace("{dir}", path) for a in args]]
            return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                                  env={**os.environ, **(env or {})})
        finally:
            _remove(path)

    try:
        yield run, cg.version
    finally:
        for path in made:
            _remove(path)


def test_auto_budget_in_a_real_cgroup_is_half_its_limit(child_cgroup):
    """A real process in a 512 MiB cgroup: ``host_budget_bytes="auto"`` resolves to
    256 MiB and says so (before: half the machine's RAM, the root's files read)."""
    run, _ = child_cgroup
    p = run(["budget"], 512 * MiB)
    assert p.returncode == 0, p.stderr
    got = json.loads(p.stdout.strip().splitlines()[-1])
    assert got["budget"] == 256 * MiB, got
    assert got["reason"].startswith("half of the cgroup memory limit 512.0 MiB"), got


def test_auto_is_not_killed_in_a_cgroup_where_static_fits(child_cgroup, spill_dir):
    """A CPU model in a cgroup of what torch takes plus 160 MiB, where a step's 384
    MiB of activations do not fit without ssdtrain (killed: the limit binds) and fit
    under "static": the default, ``policy="auto"``, fits too. Before, its memory floor
    read the machine's MemAvailable, its baseline steps kept every activation, and the
    kernel killed it after its first step. (glibc's heap is told to return large
    frees at once, so that the cgroup's usage is what is live.)"""
    run, version = child_cgroup
    env = {"MALLOC_MMAP_THRESHOLD_": str(1 << 20)}
    outcome = {mode: run(["train", mode, str(spill_dir), "160", "5", "{dir}", str(version)],
                         64 * GiB, env=env)
               for mode in ("none", "static", "auto")}
    assert outcome["none"].returncode in (-9, 137), \
        ("the limit must bind without ssdtrain", outcome["none"].returncode,
         outcome["none"].stdout, outcome["none"].stderr[-2000:])
    assert outcome["static"].returncode == 0, outcome["static"].stderr[-2000:]
    auto = outcome["auto"]
    assert auto.returncode == 0, ("policy='auto' was killed where 'static' fits",
                                  auto.returncode, outcome["static"].stdout,
                                  auto.stderr[-2000:])
    got = json.loads(auto.stdout.strip().splitlines()[-1])
    assert got["floor"] > 0, got   # the floor saw the cgroup's limit, not the machine's
    assert got["peak"] is None or got["peak"] <= got["limit"], got
