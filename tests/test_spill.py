"""Spill files and slot allocation (``ssdtrain/_spill.py``).

``SlotAllocator`` is pure bookkeeping, so it is driven directly by hypothesis with
random alloc/free sequences and checked against a block-by-block model. ``SpillFile``
and ``SpillSet`` are checked on real directories: files are anonymous, opened
read-write, ``O_DIRECT`` where asked and possible, and striped over directories.
"""

from __future__ import annotations

import errno
import fcntl
import os
import shutil
import tempfile

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ssdtrain import ConfigError
from ssdtrain import _spill
from ssdtrain._spill import BLOCK, SlotAllocator, SpillFile, SpillSet, filesystem_type

DIRECT_FILESYSTEMS = ("ext4", "xfs", "btrfs")

# ------------------------------------------------------------------ SlotAllocator model

# An op is ("alloc", nblocks) or ("free", index into the live runs, taken modulo their count).
_ops = st.lists(
    st.one_of(st.tuples(st.just("alloc"), st.integers(1, 40)),
              st.tuples(st.just("free"), st.integers(0, 1 << 16))),
    max_size=120,
)
# Pure bookkeeping, microseconds per op: no deadline, so a loaded CI machine cannot flake it.
_settings = settings(deadline=None, max_examples=150)


def _check_invariants(a: SlotAllocator, live: dict[int, int]):
    """Every block below ``end`` is either in exactly one live run or in one free run."""
    runs = sorted(live.items())
    for (s0, n0), (s1, _) in zip(runs, runs[1:]):
        assert s0 + n0 <= s1, f"live runs overlap: {runs}"
    for s, n in runs:
        assert 0 <= s and s + n <= a.end, (s, n, a.end)
    assert a.used == sum(n for _, n in runs)

    free = a.free_runs()
    assert free == sorted(free)
    for (s0, n0), (s1, _) in zip(free, free[1:]):
        assert s0 + n0 < s1, f"free runs not coalesced: {free}"
    if free:
        last_start, last_len = free[-1]
        assert last_start + last_len < a.end, f"free run at the tail instead of end shrinking: {free}"
    for s, n in free:
        assert n > 0 and s >= 0
    covered = sorted(runs + free)
    pos = 0
    for s, n in covered:
        assert s == pos, f"gap or overlap at block {pos}: live {runs}, free {free}, end {a.end}"
        pos = s + n
    assert pos == a.end


def _apply(a: SlotAllocator, live: dict[int, int], op):
    kind, arg = op
    if kind == "alloc" or not live:
        n = arg if kind == "alloc" else 1
        start = a.alloc(n)
        live[start] = n
        return ("alloc", start, n)
    start = sorted(live)[arg % len(live)]
    n = live.pop(start)
    a.free(start, n)
    return ("free", start, n)


@_settings
@given(_ops)
def test_allocator_invariants(ops):
    a, live = SlotAllocator(), {}
    for op in ops:
        _apply(a, live, op)
        _check_invariants(a, live)
    for start in sorted(live, key=lambda s: (s * 7919) % 101):  # free in a scrambled order
        a.free(start, live.pop(start))
        _check_invariants(a, live)
    assert a.end == 0
    assert a.used == 0
    assert a.free_runs() == []


def _first_fit(free_bitmap: list[bool], n: int) -> int:
    """Start of the first maximal free run of at least ``n`` blocks, else the end."""
    i = 0
    while i < len(free_bitmap):
        if free_bitmap[i]:
            j = i
            while j < len(free_bitmap) and free_bitmap[j]:
                j += 1
            if j - i >= n:
                return i
            i = j
        else:
            i += 1
    return len(free_bitmap)


@_settings
@given(_ops)
def test_allocator_is_first_fit(ops):
    """The class promises first fit over coalesced runs: compare with a bitmap model."""
    a, live = SlotAllocator(), {}
    bitmap: list[bool] = []  # True = free, one entry per block below `end`
    for kind, arg in ops:
        if kind == "alloc" or not live:
            n = arg if kind == "alloc" else 1
            expected = _first_fit(bitmap, n)
            start = a.alloc(n)
            assert start == expected
            live[start] = n
            bitmap.extend([True] * max(0, start + n - len(bitmap)))
            bitmap[start:start + n] = [False] * n
        else:
            start = sorted(live)[arg % len(live)]
            n = live.pop(start)
            a.free(start, n)
            bitmap[start:start + n] = [True] * n
            while bitmap and bitmap[-1]:
                bitmap.pop()
        assert a.end == len(bitmap)


@_settings
@given(_ops, st.integers(0, 1 << 16))
def test_freed_space_is_reused(ops, pick):
    a, live = SlotAllocator(), {}
    for op in ops:
        _apply(a, live, op)
    if not live:
        return
    start = sorted(live)[pick % len(live)]
    n = live.pop(start)
    end_before = a.end
    a.free(start, n)
    again = a.alloc(n)
    assert a.end <= end_before, "a same-size alloc after a free grew the file"
    assert again <= start  # first fit finds the freed run or an earlier one
    live[again] = n
    _check_invariants(a, live)


@_settings
@given(_ops, st.integers(0, 1 << 16))
def test_double_free_raises_and_changes_nothing(ops, pick):
    a, live = SlotAllocator(), {}
    for op in ops:
        _apply(a, live, op)
    if not live:
        return
    start = sorted(live)[pick % len(live)]
    n = live.pop(start)
    a.free(start, n)
    state = (a.end, a.used, a.free_runs())
    with pytest.raises(AssertionError, match="please report"):
        a.free(start, n)
    assert (a.end, a.used, a.free_runs()) == state, "a rejected free corrupted the allocator"
    _check_invariants(a, live)


def test_double_free_simple():
    a = SlotAllocator()
    x, y, z = a.alloc(2), a.alloc(3), a.alloc(1)
    assert (x, y, z) == (0, 2, 5)
    a.free(y, 3)
    with pytest.raises(AssertionError, match="double free.*please report"):
        a.free(y, 3)
    with pytest.raises(AssertionError, match="please report"):
        a.free(y + 1, 1)  # inside a free run
    a.free(z, 1)  # the tail: end shrinks past the free run before it
    assert a.end == 2 and a.free_runs() == []
    with pytest.raises(AssertionError, match="please report"):
        a.free(z, 1)  # beyond end now
    a.free(x, 2)
    assert (a.end, a.free_runs()) == (0, [])


def test_rejected_double_free_leaves_used_unchanged():
    """A rejected free must not change the books: ``used`` feeds spill_bytes_in_use()."""
    a = SlotAllocator()
    a.alloc(1)
    a.alloc(1)
    a.free(0, 1)
    with pytest.raises(AssertionError, match="please report"):
        a.free(0, 1)
    assert a.used == 1


@pytest.mark.parametrize("start, n", [(-1, 1), (0, 0), (0, -2), (0, 5), (4, 1)])
def test_free_outside_raises(start, n):
    a = SlotAllocator()
    a.alloc(4)
    with pytest.raises(AssertionError, match="please report"):
        a.free(start, n)
    assert (a.end, a.used) == (4, 4)


@pytest.mark.parametrize("n", [0, -1])
def test_alloc_non_positive(n):
    with pytest.raises(ValueError):
        SlotAllocator().alloc(n)


# ------------------------------------------------------------------- filesystem_type

def test_filesystem_type():
    assert filesystem_type("/dev/shm") == "tmpfs"
    assert filesystem_type("/proc") == "proc"
    assert filesystem_type("/proc/self") == "proc"
    assert filesystem_type("/") != ""


def test_filesystem_type_of_subdir_and_prefix_lookalike():
    shm = tempfile.mkdtemp(prefix="ssdtrain-test-", dir="/dev/shm")
    try:
        assert filesystem_type(shm) == "tmpfs"
    finally:
        os.rmdir(shm)
    # "/dev/shmfoo" is not under the /dev/shm mount point.
    assert filesystem_type("/dev/shmfoo") == filesystem_type("/dev")


def test_filesystem_type_follows_symlinks(tmp_path):
    link = tmp_path / "link"
    link.symlink_to("/dev/shm")
    assert filesystem_type(str(link)) == "tmpfs"


# ------------------------------------------------------------------------ SpillFile

def _accmode(fd):
    return fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE


def _fs_supports_direct(path) -> bool:
    try:
        fd = os.open(path, os.O_RDWR | os.O_TMPFILE | os.O_DIRECT, 0o600)
    except OSError:
        return False
    os.close(fd)
    return True


def _open_fds():
    return set(os.listdir("/proc/self/fd"))


@pytest.fixture
def shm_dir():
    d = tempfile.mkdtemp(prefix="ssdtrain-test-", dir="/dev/shm")
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.mark.parametrize("direct_io", ["auto", "on", "off"])
def test_spill_file_is_anonymous_and_read_write(tmp_path, direct_io):
    if direct_io == "on" and filesystem_type(str(tmp_path)) not in DIRECT_FILESYSTEMS:
        pytest.skip(f"{tmp_path} is on {filesystem_type(str(tmp_path))!r}, not a file system "
                    f"known to support O_DIRECT")
    f = SpillFile(str(tmp_path), direct_io)
    try:
        assert os.listdir(tmp_path) == []  # no name, ever
        st_ = os.fstat(f.fd)
        assert st_.st_nlink == 0, "spill file has a name: it would outlive a crash"
        assert st_.st_size == 0  # the O_DIRECT probe left nothing behind
        assert _accmode(f.fd) == os.O_RDWR
        assert fcntl.fcntl(f.fd, fcntl.F_GETFD) & fcntl.FD_CLOEXEC
        assert bool(fcntl.fcntl(f.fd, fcntl.F_GETFL) & os.O_DIRECT) == f.direct
        assert f.directory == str(tmp_path)
        assert str(tmp_path) in f.name
        assert f.size_bytes() == 0
    finally:
        f.close()
    assert f.fd == -1
    f.close()  # idempotent
    assert f.size_bytes() == 0


def test_direct_on_disk_tmp(tmp_path):
    kind = filesystem_type(str(tmp_path))
    if kind not in DIRECT_FILESYSTEMS:
        pytest.skip(f"{tmp_path} is on {kind!r}, not a file system known to support O_DIRECT")
    for mode in ("auto", "on"):
        f = SpillFile(str(tmp_path), mode)
        try:
            assert f.direct is True, mode
        finally:
            f.close()
    f = SpillFile(str(tmp_path), "off")
    try:
        assert f.direct is False
        assert not fcntl.fcntl(f.fd, fcntl.F_GETFL) & os.O_DIRECT
    finally:
        f.close()


def test_direct_on_tmpfs(shm_dir):
    """``on`` fails where the file system refuses O_DIRECT: tmpfs before Linux 6.6.

    Newer kernels accept O_DIRECT on tmpfs; then ``on`` must succeed with a direct file.
    """
    if _fs_supports_direct(shm_dir):
        f = SpillFile(shm_dir, "on")
        try:
            assert f.direct is True
        finally:
            f.close()
        pytest.skip("this kernel's tmpfs accepts O_DIRECT (Linux >= 6.6), so direct_io='on' "
                    "on /dev/shm cannot fail here; the refusal path is covered by "
                    "test_direct_on_refused_by_filesystem")
    before = _open_fds()
    with pytest.raises(ConfigError, match="direct_io") as excinfo:
        SpillFile(shm_dir, "on")
    assert shm_dir in str(excinfo.value) and "tmpfs" in str(excinfo.value)
    assert _open_fds() <= before
    f = SpillFile(shm_dir, "auto")
    try:
        assert f.direct is False
    finally:
        f.close()


def test_direct_on_refused_by_filesystem(tmp_path, monkeypatch):
    """Fault injection: a file system whose O_DIRECT probe fails (e.g. old tmpfs, FUSE)."""
    monkeypatch.setattr(_spill, "_direct_io_works", lambda fd: False)
    before = _open_fds()
    with pytest.raises(ConfigError, match="direct_io") as excinfo:
        SpillFile(str(tmp_path), "on")
    assert str(tmp_path) in str(excinfo.value)
    assert _open_fds() <= before, "the refused O_DIRECT descriptor was leaked"
    f = SpillFile(str(tmp_path), "auto")
    try:
        assert f.direct is False
        assert not fcntl.fcntl(f.fd, fcntl.F_GETFL) & os.O_DIRECT
        assert _accmode(f.fd) == os.O_RDWR
    finally:
        f.close()
    assert _open_fds() <= before
    assert os.listdir(tmp_path) == []


def test_fallback_without_o_tmpfile(tmp_path, monkeypatch):
    """Where O_TMPFILE is unsupported, a named file is created and unlinked at once."""
    real_open = os.open

    def no_tmpfile(path, flags, mode=0o777, *, dir_fd=None):
        if (flags & os.O_TMPFILE) == os.O_TMPFILE:
            raise OSError(errno.EOPNOTSUPP, "Operation not supported")
        return real_open(path, flags, mode, dir_fd=dir_fd)

    monkeypatch.setattr(_spill.os, "open", no_tmpfile)
    for mode in ("auto", "off"):
        f = SpillFile(str(tmp_path), mode)
        try:
            assert os.listdir(tmp_path) == []
            assert os.fstat(f.fd).st_nlink == 0
            assert _accmode(f.fd) == os.O_RDWR
        finally:
            f.close()


def test_missing_and_non_directory(tmp_path):
    with pytest.raises(ConfigError, match="spill_dir.*does not exist"):
        SpillFile(str(tmp_path / "nope"), "auto")
    (tmp_path / "file").write_bytes(b"")
    with pytest.raises(ConfigError, match="spill_dir.*not a directory"):
        SpillFile(str(tmp_path / "file"), "auto")


@pytest.mark.parametrize("misalign", [0, 1, 64, 4095])
@pytest.mark.parametrize("nbytes", [0, 1, 4095, 4096, 4097, 3 * BLOCK + 5])
def test_alloc_offsets_congruent(tmp_path, nbytes, misalign):
    f = SpillFile(str(tmp_path), "off")
    try:
        slots = [f.alloc(nbytes, misalign) for _ in range(3)]
        for s in slots:
            assert s.file is f
            assert s.nbytes == nbytes
            assert s.offset % BLOCK == misalign
            assert s.offset == s.block * BLOCK + misalign
            # the slot's whole blocks cover its bytes, with no spare block
            assert s.block * BLOCK <= s.offset
            assert s.offset + nbytes <= (s.block + s.nblocks) * BLOCK
            assert s.nblocks == max(1, -(-(misalign + nbytes) // BLOCK))
        for s0, s1 in zip(slots, slots[1:]):
            assert s0.block + s0.nblocks <= s1.block
        assert f.allocator.used == 3 * slots[0].nblocks
        for s in slots:
            f.free(s)
        assert f.allocator.used == 0 and f.allocator.end == 0
    finally:
        f.close()


# ------------------------------------------------------------------------- SpillSet

def test_spill_set_stripes_over_directories(tmp_path):
    dirs = [tmp_path / "a", tmp_path / "b"]
    for d in dirs:
        d.mkdir()
    s = SpillSet([str(d) for d in dirs], "auto")
    try:
        assert [f.directory for f in s.files] == [str(d) for d in dirs]
        assert len({os.fstat(f.fd).st_ino for f in s.files}) == 2
        slots = [s.alloc(10_000, 64) for _ in range(6)]
        assert [sl.file for sl in slots] == [s.files[0], s.files[1]] * 3
        assert [sl.block for sl in slots] == [0, 0, 3, 3, 6, 6]
        assert s.used_bytes() == 6 * 3 * BLOCK
        for d in dirs:
            assert os.listdir(d) == []
        for sl in slots:
            sl.file.free(sl)
        assert s.used_bytes() == 0
    finally:
        s.close()
    assert [f.fd for f in s.files] == [-1, -1]


def test_spill_set_single_directory(tmp_path):
    s = SpillSet([str(tmp_path)], "off")
    try:
        slots = [s.alloc(1, 0) for _ in range(3)]
        assert all(sl.file is s.files[0] for sl in slots)
        assert [sl.block for sl in slots] == [0, 1, 2]
    finally:
        s.close()


def test_spill_set_failure_closes_opened_files(tmp_path):
    before = _open_fds()
    with pytest.raises(ConfigError, match="does not exist"):
        SpillSet([str(tmp_path), str(tmp_path / "missing")], "auto")
    assert _open_fds() <= before


def test_spill_set_on_tmpfs_warns(shm_dir, caplog):
    import logging

    with caplog.at_level(logging.WARNING, logger="ssdtrain"):
        s = SpillSet([shm_dir], "auto")
    s.close()
    assert any("RAM" in r.getMessage() and shm_dir in r.getMessage() for r in caplog.records), \
        caplog.text
