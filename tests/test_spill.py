"""Spill files and slot allocation (``ssdtrain/io/spill.py``).

``SlotAllocator`` is pure bookkeeping, so it is driven directly by hypothesis with
random alloc/free sequences and checked against a block-by-block model; ``rebuild``
(the store's repair) must reproduce its books from the live runs, and a
KeyboardInterrupt injected (``sys.settrace``) at every line of alloc, free and rebuild
must leave them as before or as after the call. A ``SpillFile``'s slots are leases
(NOTE [ Slots are leases ]): random orders of allocations and drops (inside garbage
collections too), reaps and rebuilds must keep its allocator equal to the slots
alive, an interrupt at any line included. ``SpillFile``
and ``SpillSet`` are checked on real directories: files are anonymous, opened
read-write, ``O_DIRECT`` where asked and possible, and striped over directories.
"""

from __future__ import annotations

import errno
import fcntl
import os
import shutil
import sys
import tempfile

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ssdtrain import ConfigError
from ssdtrain.io import spill as _spill
from ssdtrain.io.spill import BLOCK, SlotAllocator, SpillFile, SpillSet, filesystem_type

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


# ------------------------------------------------------------- SlotAllocator.rebuild

@_settings
@given(_ops)
def test_rebuild_from_live_runs_matches_the_allocator(ops):
    """The store repairs itself by rebuilding from the slots its records hold: that
    must give exactly the books the allocator kept (same end, used and free runs)."""
    a, live = SlotAllocator(), {}
    for op in ops:
        _apply(a, live, op)
    b = SlotAllocator()
    b.alloc(7)  # rebuild replaces whatever was there
    b.rebuild(live.items())
    assert (b.end, b.used, b.free_runs()) == (a.end, a.used, a.free_runs())
    _check_invariants(b, dict(live))
    a.rebuild(reversed(list(live.items())))  # in place, any order: nothing changes
    assert (a.end, a.used, a.free_runs()) == (b.end, b.used, b.free_runs())
    # Both go on allocating and freeing identically.
    live_a, live_b = dict(live), dict(live)
    for op in ops[:20]:
        assert _apply(a, live_a, op) == _apply(b, live_b, op)


@_settings
@given(_ops, st.sets(st.integers(0, 200)))
def test_rebuild_reclaims_lost_runs(ops, lost):
    """Runs whose owners were lost to an interrupt become free again."""
    a, live = SlotAllocator(), {}
    for op in ops:
        _apply(a, live, op)
    keep = {s: n for i, (s, n) in enumerate(sorted(live.items())) if i not in lost}
    a.rebuild(keep.items())
    _check_invariants(a, dict(keep))
    assert a.used == sum(keep.values())
    assert a.end == max((s + n for s, n in keep.items()), default=0)
    for s, n in keep.items():  # what is still referenced can be freed, exactly once
        a.free(s, n)
    assert (a.end, a.used, a.free_runs()) == (0, 0, [])


@pytest.mark.parametrize("runs", [[(0, 2), (1, 1)], [(3, 4), (0, 4)], [(0, 1), (0, 1)],
                                  [(0, 0)], [(2, -1)], [(-1, 2)]], ids=repr)
def test_rebuild_rejects_invalid_runs_and_changes_nothing(runs):
    a = SlotAllocator()
    for n in (3, 2, 4):
        a.alloc(n)
    a.free(3, 2)
    state = (a.end, a.used, a.free_runs())
    with pytest.raises(AssertionError, match="please report"):
        a.rebuild(runs)
    assert (a.end, a.used, a.free_runs()) == state


def test_rebuild_simple():
    a = SlotAllocator()
    a.rebuild([(5, 2), (1, 1), (9, 3)])
    assert (a.end, a.used, a.free_runs()) == (12, 6, [(0, 1), (2, 3), (7, 2)])
    assert a.alloc(3) == 2 and a.alloc(1) == 0 and a.alloc(3) == 12
    a.rebuild([])
    assert (a.end, a.used, a.free_runs()) == (0, 0, [])


# ------------------------------------------------- interrupts inside alloc and free

def _state(a: SlotAllocator):
    assert sorted(a._length) == a._starts, "free-run index and lengths disagree"
    return a.end, a.used, a.free_runs()


def _allocator(live_runs, free_runs_):
    """An allocator whose live runs are ``live_runs`` (rebuilt from them), then with
    ``free_runs_`` freed through ``free`` (so the books are what free leaves)."""
    a = SlotAllocator()
    a.rebuild(list(live_runs) + list(free_runs_))
    for s, n in free_runs_:
        a.free(s, n)
    return a


class _InterruptAt:
    """A ``sys.settrace`` function that raises KeyboardInterrupt at the ``k``-th trace
    event (call, line or return) inside ``SlotAllocator.alloc``/``free``, as a Ctrl-C
    arriving there would."""

    CODES = (SlotAllocator.alloc.__code__, SlotAllocator.free.__code__,
             SlotAllocator.rebuild.__code__, SlotAllocator.books.__code__)

    def __init__(self, k):
        self.k, self.n, self.fired_at = k, 0, None

    def __call__(self, frame, event, arg):
        if frame.f_code not in self.CODES:
            return None
        return self._local(frame, event, arg)

    def _local(self, frame, event, arg):
        if self.n == self.k:
            self.fired_at = (event, frame.f_lineno)
            raise KeyboardInterrupt
        self.n += 1
        return self._local


# (live runs, runs freed after them, the operation): every branch of alloc and free.
_INTERRUPT_CASES = {
    "alloc-exact-fit": ([(0, 2), (5, 1)], [(2, 3)], ("alloc", 3)),
    "alloc-split": ([(0, 2), (9, 1)], [(2, 7)], ("alloc", 3)),
    "alloc-at-end": ([(0, 2), (4, 1)], [(2, 2)], ("alloc", 5)),
    "alloc-empty": ([], [], ("alloc", 1)),
    "free-tail": ([(0, 2), (2, 3)], [], ("free", 2, 3)),
    "free-tail-merge-prev": ([(0, 2), (5, 3)], [(2, 3)], ("free", 5, 3)),
    "free-merge-both": ([(0, 1), (3, 1), (6, 1)], [(1, 2), (4, 2)], ("free", 3, 1)),
    "free-merge-prev": ([(0, 1), (3, 1), (5, 1)], [(1, 2)], ("free", 3, 1)),
    "free-merge-next": ([(0, 1), (1, 1), (4, 1)], [(2, 2)], ("free", 1, 1)),
    "free-isolated": ([(0, 1), (1, 1), (2, 1), (3, 1)], [], ("free", 1, 1)),
    "free-only-run": ([(0, 4)], [], ("free", 0, 4)),
}


def _run(a, op):
    return a.alloc(op[1]) if op[0] == "alloc" else a.free(op[1], op[2])


@pytest.mark.parametrize("case", sorted(_INTERRUPT_CASES))
def test_interrupt_at_every_line_of_alloc_and_free(case):
    """NOTE [ Interrupt-safe allocation ]: a KeyboardInterrupt raised at any trace event
    inside alloc/free leaves the books either as before the call or as after it; a run
    allocated but lost with the interrupt is reclaimed by rebuild()."""
    live_runs, freed, op = _INTERRUPT_CASES[case]
    ref = _allocator(live_runs, freed)
    before = _state(ref)
    result = _run(ref, op)
    after = _state(ref)
    assert after != before
    live_after = dict(live_runs)
    if op[0] == "alloc":
        live_after[result] = op[1]
    else:
        del live_after[op[1]]
    outcomes, k = set(), 0
    while True:
        a = _allocator(live_runs, freed)
        tracer, old = _InterruptAt(k), sys.gettrace()
        sys.settrace(tracer)
        try:
            _run(a, op)
        except KeyboardInterrupt:
            pass
        finally:
            sys.settrace(old)
        if tracer.fired_at is None:
            break  # k is past the last event: every point has been tried
        state = _state(a)
        assert state in (before, after), \
            f"interrupted at {tracer.fired_at}: books {state}, neither {before} nor {after}"
        outcomes.add(state == after)
        live = live_after if state == after else dict(live_runs)
        _check_invariants(a, dict(live))
        # The caller never saw the result of an interrupted alloc: rebuilding from
        # what it knows of reclaims the run.
        a.rebuild(live_runs if op[0] == "alloc" else live.items())
        _check_invariants(a, dict(live_runs) if op[0] == "alloc" else dict(live))
        k += 1
    assert k > 3, f"only {k} trace events seen: the tracer did not reach alloc/free"
    assert outcomes == {False, True}, "interrupts hit only one side of the commit"


def test_interrupt_at_every_line_of_rebuild():
    """rebuild() commits in one line too: interrupted anywhere, it changed all or nothing."""
    live, freed = [(0, 1), (3, 1), (6, 2)], [(1, 2), (4, 2)]
    target = [(2, 3), (9, 1)]
    ref = _allocator(live, freed)
    before = _state(ref)
    ref.rebuild(target)
    after = _state(ref)
    seen, k = set(), 0
    while True:
        a = _allocator(live, freed)
        tracer, old = _InterruptAt(k), sys.gettrace()
        sys.settrace(tracer)
        try:
            a.rebuild(target)
        except KeyboardInterrupt:
            pass
        finally:
            sys.settrace(old)
        if tracer.fired_at is None:
            break
        state = _state(a)
        assert state in (before, after), f"interrupted at {tracer.fired_at}: books {state}"
        seen.add(state == after)
        k += 1
    assert k > 3 and seen == {False, True}


def test_commit_lines_make_no_call():
    """The commit lines of alloc, free and rebuild (those storing ``used``) are subscript and
    attribute stores only: CPython checks for a pending signal at calls and backward
    jumps, so a real Ctrl-C cannot split such a line (a tracer's line events cannot
    either, which the test above checks)."""
    import dis

    for fn, attr in ((SlotAllocator.alloc, "used"), (SlotAllocator.free, "used"),
                     (SlotAllocator.rebuild, "used"), (SpillFile.rebuild, "used"),
                     (SpillFile.alloc, "lease")):
        ins = list(dis.get_instructions(fn))
        commits = {i.positions.lineno for i in ins
                   if i.opname == "STORE_ATTR" and i.argval == attr}
        assert commits, fn
        for line in commits:
            ops = [i.opname for i in ins if i.positions.lineno == line]
            assert not any("CALL" in o or "JUMP_BACKWARD" in o for o in ops), (fn, line, ops)


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
        del s, s0, s1
        slots.clear()  # dropping the slots is freeing them (NOTE [ Slots are leases ])
        f.reap()
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
        slots.clear()
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


@pytest.mark.parametrize("kind", ["devtmpfs", "tmpfs", "ramfs", "rootfs"])
def test_spill_set_on_ram_filesystem_warns(tmp_path, monkeypatch, caplog, kind):
    """Every RAM-backed file system warns, devtmpfs (``/dev``) included. The file system
    type is faked: nothing is created in /dev."""
    import logging

    monkeypatch.setattr(_spill, "filesystem_type", lambda path: kind)
    with caplog.at_level(logging.WARNING, logger="ssdtrain"):
        s = SpillSet([str(tmp_path)], "off")
    s.close()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("RAM" in m and str(tmp_path) in m and kind in m for m in warnings), caplog.text


@pytest.mark.parametrize("kind", ["ext4", "xfs", "btrfs", ""])
def test_spill_set_on_disk_filesystem_does_not_warn(tmp_path, monkeypatch, caplog, kind):
    import logging

    monkeypatch.setattr(_spill, "filesystem_type", lambda path: kind)
    with caplog.at_level(logging.WARNING, logger="ssdtrain"):
        s = SpillSet([str(tmp_path)], "off")
    s.close()
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text


def test_dev_is_devtmpfs_where_mounted_so():
    """The real /dev, where it is devtmpfs (most Linux hosts; containers often mount a
    tmpfs there): both are in RAM_FILESYSTEMS, so a spill_dir under /dev warns."""
    kind = filesystem_type("/dev")
    if kind not in ("devtmpfs", "tmpfs"):
        pytest.skip(f"/dev is on {kind!r} here")
    assert kind in _spill.RAM_FILESYSTEMS


# ------------------------------------------------------- SpillFile / SpillSet.rebuild

def test_spill_file_rebuild(tmp_path):
    """A repair rebuilds a file's allocator from its slots alive: blocks lost to an
    interrupt (allocated, their slot never made) come back; the slots alive keep theirs."""
    f = SpillFile(str(tmp_path), "off")
    try:
        slots = [f.alloc(n, 7) for n in (100, 5000, 9000, 1, 20000)]
        lost = f.allocator.alloc(3)  # an interrupt after the books, before the lease
        kept = [slots[0], slots[3]]
        del slots[:]  # slots 1, 2 and 4 die: returned, not reaped yet
        assert f.allocator.used == sum(s.nblocks for s in kept) + 2 + 3 + 5 + 3
        f.rebuild()
        assert f.allocator.used == sum(s.nblocks for s in kept)
        assert f.allocator.end == kept[1].block + kept[1].nblocks
        _check_invariants(f.allocator, {s.block: s.nblocks for s in kept})
        f.reap()  # the dead leases' blocks were rebuilt free: nothing is freed twice
        _check_invariants(f.allocator, {s.block: s.nblocks for s in kept})
        again = f.alloc(5000, 7)  # a lost slot's blocks are reused
        assert again.block == kept[0].block + kept[0].nblocks and lost >= again.block
        assert f.problems() == []
        del kept, again
        f.reap()
        assert (f.allocator.used, f.allocator.end) == (0, 0)
    finally:
        f.close()


def test_spill_set_rebuild_and_problems(tmp_path):
    dirs = [tmp_path / "a", tmp_path / "b"]
    for d in dirs:
        d.mkdir()
    s = SpillSet([str(d) for d in dirs], "off")
    try:
        slots = [s.alloc(10_000, 64) for _ in range(6)]  # striped: a, b, a, b, a, b
        kept = [slots[1], slots[4], slots[5]]
        del slots[:]
        s.rebuild()
        assert s.used_bytes() == sum(sl.nblocks for sl in kept) * BLOCK
        for f in s.files:
            mine = {sl.block: sl.nblocks for sl in kept if sl.file is f}
            _check_invariants(f.allocator, mine)
        assert s.problems(kept) == []
        stranger = SpillFile(str(tmp_path), "off")
        try:
            foreign = stranger.alloc(1, 0)
            assert any("not a lease" in p for p in s.problems([foreign]))
        finally:
            stranger.close()
        s.files[0].allocator.alloc(2)  # blocks no lease holds: a mismatch until rebuilt
        assert any("!= its" in p for p in s.problems(kept))
        s.rebuild()
        assert s.problems(kept) == []
        del kept
        s.rebuild()
        assert s.used_bytes() == 0 and all(f.allocator.end == 0 for f in s.files)
    finally:
        s.close()


def test_outside_bytes_count_the_live_slots_no_record_holds(tmp_path):
    s = SpillSet([str(tmp_path)], "off")
    try:
        probe = s.alloc(3 * BLOCK, 0, outside=True)
        held = s.alloc(BLOCK, 0)
        assert s.outside_bytes() == 3 * BLOCK
        s.let_go(held)  # a record let go of it; a request may still hold it
        assert s.outside_bytes() == 4 * BLOCK
        del probe
        assert s.outside_bytes() == BLOCK
        del held
        assert s.outside_bytes() == 0 and s.used_bytes() == 0
    finally:
        s.close()


# ---------------------------------------------------------- leases (NOTE [ Slots are leases ])

class _Holder:
    """Something that holds a slot: a record or a request (a cycle when ``cyclic``, so
    that only the garbage collector frees it)."""

    def __init__(self, slot, cyclic=False):
        self.slot = slot
        self.me = self if cyclic else None


# An op: alloc nbytes; drop a holder (index modulo the holders); hold a slot a second
# time (a request); drop a holder into a garbage cycle; collect the garbage; reap; an
# alloc during which a garbage collection runs (the gc's threshold at 1); rebuild.
_lease_ops = st.lists(st.one_of(
    st.tuples(st.just("alloc"), st.integers(0, 5 * BLOCK)),
    st.tuples(st.just("drop"), st.integers(0, 1 << 16)),
    st.tuples(st.just("hold"), st.integers(0, 1 << 16)),
    st.tuples(st.just("cycle"), st.integers(0, 1 << 16)),
    st.tuples(st.just("collect"), st.just(0)),
    st.tuples(st.just("reap"), st.just(0)),
    st.tuples(st.just("alloc_in_gc"), st.integers(0, 5 * BLOCK)),
    st.tuples(st.just("rebuild"), st.just(0)),
), max_size=80)


def _live_slots(holders):
    return {id(h.slot): h.slot for h in holders}


def _assert_disjoint(holders, after):
    runs = sorted((sl.block, sl.nblocks) for sl in _live_slots(holders).values())
    for (b0, n0), (b1, _) in zip(runs, runs[1:]):
        assert b0 + n0 <= b1, f"after {after}: two live slots share blocks: {runs}"


def _check_leases(f, holders):
    """The file's slots alive are disjoint, every one a registered lease, and once the
    dead are reaped the allocator's books are exactly those of the slots alive."""
    live = _live_slots(holders)
    runs = sorted((sl.block, sl.nblocks) for sl in live.values())
    for (b0, n0), (b1, _) in zip(runs, runs[1:]):
        assert b0 + n0 <= b1, f"two live slots share blocks: {runs}"
    assert all(f.holds(sl) for sl in live.values())
    assert f.problems() == []  # reaps first
    _check_invariants(f.allocator, dict(runs))


@_settings
@given(_lease_ops)
def test_the_allocator_always_equals_the_live_leases(tmp_path_factory, ops):
    """Random orders of allocations, drops (plain, by a second holder, inside a garbage
    collection, inside a collection that runs during an allocation), reaps and
    rebuilds: no two live slots ever share a block, and once reaped, the allocator is
    exactly the slots alive; nothing is freed twice (``free`` would raise)."""
    import gc
    f = SpillFile(str(tmp_path_factory.mktemp("leases")), "off")
    holders = []
    threshold = gc.get_threshold()
    try:
        for op, arg in ops:
            if op in ("alloc", "alloc_in_gc"):
                if op == "alloc_in_gc":
                    gc.set_threshold(1)
                try:
                    holders.append(_Holder(f.alloc(arg, arg % BLOCK)))
                finally:
                    gc.set_threshold(*threshold)
            elif op == "collect":
                gc.collect()
            elif op == "reap":
                f.reap()
            elif op == "rebuild":
                f.rebuild()
            elif holders:
                i = arg % len(holders)
                if op == "drop":
                    holders.pop(i)
                elif op == "hold":
                    holders.append(_Holder(holders[i].slot))
                else:  # cycle: only the collector frees it (maybe inside a later alloc)
                    _Holder(holders.pop(i).slot, cyclic=True)
            _assert_disjoint(holders, op)
        gc.collect()
        _check_leases(f, holders)
        holders.clear()
        f.reap()
        assert (f.allocator.used, f.allocator.end) == (0, 0)
    finally:
        gc.set_threshold(*threshold)
        f.close()


class _LineInterrupt:
    """Raises KeyboardInterrupt at the ``k``-th 'line' event in ``codes`` (a Ctrl-C there)."""

    def __init__(self, codes, k):
        self.codes, self.k, self.n, self.fired = codes, k, 0, False

    def __call__(self, frame, event, arg):
        return self._local if frame.f_code in self.codes else None

    def _local(self, frame, event, arg):
        if event == "line" and not self.fired:
            if self.n == self.k:
                self.fired = True
                raise KeyboardInterrupt
            self.n += 1
        return self._local


@pytest.mark.parametrize("what", ["alloc", "reap", "rebuild"])
def test_an_interrupt_at_any_line_of_a_lease_operation_is_repaired(tmp_path, what):
    """NOTE [ Interrupt-safe allocation ] for leases: a KeyboardInterrupt at any line of
    ``SpillFile.alloc``, ``reap`` or ``rebuild`` leaves the file safe to use before any
    repair (the next allocations hand out no block a live slot holds and free nothing
    twice), and the repair (``rebuild``) makes the allocator equal the slots alive
    again. Without the one-line commits (a rebuild's books and leases in two lines, a
    reap that frees before it forgets the lease), an interrupt between the two frees
    blocks twice."""
    import gc
    codes = {SpillFile.alloc.__code__, SpillFile.reap.__code__, SpillFile.rebuild.__code__,
             SlotAllocator.alloc.__code__, SlotAllocator.free.__code__,
             SlotAllocator.books.__code__}
    k, fired = 0, 0
    while True:
        f = SpillFile(str(tmp_path), "off")
        try:
            holders = [_Holder(f.alloc(n, 3)) for n in (100, 9000, 1, 20000, 5000)]
            del holders[1], holders[2]  # two dead leases: returned, not reaped
            injector = _LineInterrupt(codes, k)
            sys.settrace(injector)
            try:
                if what == "alloc":
                    holders.append(_Holder(f.alloc(7000, 3)))
                elif what == "reap":
                    f.reap()
                else:
                    f.rebuild()
            except KeyboardInterrupt:
                pass
            finally:
                sys.settrace(None)
            gc.collect()  # the interrupt's frames (and a slot made in them) are gone
            # Safe before any repair: the next allocations (each reaps first) hand out no
            # live slot's blocks and free nothing twice (free raises on a double free).
            holders.append(_Holder(f.alloc(12000, 3)))
            holders.append(_Holder(f.alloc(300, 3)))
            _assert_disjoint(holders, f"an interrupt in {what} (line event {k})")
            f.rebuild()  # the store's repair: the allocator is the slots alive again
            _check_leases(f, holders)
            holders.append(_Holder(f.alloc(12000, 3)))
            _check_leases(f, holders)
        finally:
            f.close()
        if not injector.fired:
            break
        fired += 1
        k += 1
    assert fired > 3, fired
