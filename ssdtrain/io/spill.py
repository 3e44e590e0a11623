"""Spill directories, spill files and slot allocation inside them.

A spill file is anonymous: opened with ``O_TMPFILE`` (or created and unlinked at
once where the file system lacks it), so its blocks return to the file system
when the process ends, however it ends. Records live in *slots*: runs of whole
4 KiB blocks, reused step to step. See NOTE [ Zero-copy O_DIRECT from unaligned
tensors ] in docs/ARCHITECTURE.md for why a record's file offset is congruent
to its memory address modulo the block size.

NOTE [ Slots are leases ]

A :class:`Slot` is held by whoever uses it: the record that lives in it and every
engine request that writes or reads it (a request's ``owner``: NOTE [ Memory owned by
requests ] in _store/store.py). Nothing frees a slot: its blocks go back to the allocator
when the last holder drops it. Each slot has a lease (:class:`_Lease`, a weak
reference carrying its ``(block, nblocks)``) registered with its file; the lease's
callback is the file's ``returned`` deque's ``append`` (C code: safe inside a garbage
collection or an interrupt, no ``__del__``), and the blocks of the leases returned are
given back to the allocator at the file's next :meth:`SpillFile.reap`, which the store
runs under its lock (at every allocation, ``used_bytes`` and ``problems``). So the
allocator's truth is which slots are alive: a repair rebuilds it from the leases still
alive (:meth:`SpillFile.rebuild`, no list of slots from anyone), and
:meth:`SpillSet.problems` compares the two. A request a repair or ``close()`` cut
loose from its record keeps its slot until it ends, and that slot is never handed to
another record meanwhile.
"""

import bisect
import collections
import errno as _errno
import logging
import mmap
import os
import stat
import tempfile
import weakref
from dataclasses import dataclass, field

from .._align import BLOCK, align_down, align_up  # re-exported: BLOCK lived here first
from .._errors import ConfigError, SpillIOError, resource_error

__all__ = ["BLOCK", "RAM_FILESYSTEMS", "SlotAllocator", "SpillFile", "SpillSet", "Slot",
           "filesystem_type", "default_spill_dir"]

log = logging.getLogger("ssdtrain")

# File systems whose files live in memory: a spill directory there frees nothing.
# ``rootfs`` is the initramfs root (ramfs or tmpfs); it names "/" in /proc/mounts only
# where no real root was mounted over it.
RAM_FILESYSTEMS = ("tmpfs", "ramfs", "devtmpfs", "rootfs")


class SlotAllocator:
    """First-fit allocator of runs of blocks in one file; freed runs coalesce.

    Pure bookkeeping (no I/O), so property tests can drive it directly. Not
    thread-safe: the store calls it only under its own lock.

    NOTE [ Interrupt-safe allocation ]
    A KeyboardInterrupt may arrive at any point of the training thread, including
    inside :meth:`alloc`, :meth:`free` and :meth:`rebuild`. Each first computes what it
    will change, touching nothing, then commits every change in one line made of
    subscript and attribute stores only: no call, hence no point where CPython
    checks for a pending signal (nor a line event for a tracer), so the operation
    happens fully or not at all. What can still be lost is the caller's knowledge
    of the result (an interrupt right after ``alloc`` returned leaks the run);
    :meth:`rebuild`, from the runs still referenced, reclaims such leaks. A spill
    file's leases (NOTE [ Slots are leases ]) follow the same rule: a lease is
    registered in one line of stores, and :meth:`SpillFile.rebuild` commits the
    allocator's books and the leases still alive in one line (:meth:`books` computes
    the books without committing them).
    """

    def __init__(self):
        self._starts = []   # sorted starts of free runs
        self._length = {}   # start -> length of free run
        self.end = 0        # blocks in use or free below this; the file's high-water mark
        self.used = 0       # blocks currently allocated

    def alloc(self, nblocks: int) -> int:
        """The first block of a run of ``nblocks`` free blocks (first fit), now in use."""
        if nblocks <= 0:
            raise ValueError(f"nblocks must be positive, got {nblocks}")
        starts, length, used = self._starts, self._length, self.used + nblocks
        for i, start in enumerate(starts):
            run = length[start]
            if run == nblocks:  # exact fit: the free run goes
                del starts[i], length[start]; self.used = used; return start
            if run > nblocks:  # the rest stays free, at the same place in the order
                s, n = start + nblocks, run - nblocks
                starts[i] = s; length[s] = n; del length[start]; self.used = used; return start
        start, end = self.end, self.end + nblocks
        self.end = end; self.used = used; return start

    def free(self, start: int, nblocks: int) -> None:
        """Return ``[start, start + nblocks)``, which :meth:`alloc` gave out, to the free runs.

        Raises:
            AssertionError: the run lies outside the file or overlaps a free run
                (a double free); nothing changes then.
        """
        end = self.end
        if nblocks <= 0 or start < 0 or start + nblocks > end:
            raise AssertionError(f"ssdtrain: freeing blocks [{start}, {start + nblocks}) outside "
                                 f"[0, {end}); please report this bug.")
        starts, length = self._starts, self._length
        i = bisect.bisect_left(starts, start)
        prev = starts[i - 1] if i > 0 else None
        nxt = starts[i] if i < len(starts) else None
        if (nxt is not None and nxt < start + nblocks) or \
                (prev is not None and prev + length[prev] > start):
            raise AssertionError(f"ssdtrain: double free of blocks at {start}; please report.")
        merge_prev = prev is not None and prev + length[prev] == start
        merge_next = nxt is not None and nxt == start + nblocks
        lo = prev if merge_prev else start
        hi = nxt + length[nxt] if merge_next else start + nblocks
        used, merged = self.used - nblocks, hi - lo
        # NOTE [ Interrupt-safe allocation ]: one line of stores per case. A run
        # merged with the next free run cannot reach ``end``: that run would be at the
        # tail, which never stays free.
        if hi == end:  # the tail shrinks rather than stays free
            if merge_prev:
                del starts[i - 1], length[prev]; self.end = prev; self.used = used
            else:
                self.end = start; self.used = used
        elif merge_prev and merge_next:
            del starts[i], length[nxt]; length[prev] = merged; self.used = used
        elif merge_prev:
            length[prev] = merged; self.used = used
        elif merge_next:
            starts[i] = start; length[start] = merged; del length[nxt]; self.used = used
        else:
            starts[i:i] = [start]; length[start] = nblocks; self.used = used

    def rebuild(self, runs) -> None:
        """Recompute the books from ``runs``, the ``(start, nblocks)`` runs in use.

        Every other block below the new high-water mark (the largest end of a used run)
        becomes free, coalesced; ``used`` is their total. The store calls it to repair
        itself after an interrupt (NOTE [ Interrupt-safe allocation ]): runs lost by
        then become free again.

        Raises:
            AssertionError: a run is empty, negative, or overlaps another; nothing
                changes then.
        """
        starts, length, pos, used = self.books(runs)
        self._starts, self._length, self.end, self.used = starts, length, pos, used

    @staticmethod
    def books(runs):
        """``(free starts, free lengths, end, used)``: the books of an allocator whose
        runs in use are ``runs`` (:meth:`rebuild` without committing them). An
        allocator's books are always these of its runs in use (a freed tail shrinks
        ``end``), so ``books`` of the leases alive is what a healthy one holds.

        Raises:
            AssertionError: a run is empty, negative, or overlaps another.
        """
        runs = sorted((int(s), int(n)) for s, n in runs)
        starts, length, pos, used = [], {}, 0, 0
        for s, n in runs:
            if n <= 0 or s < 0:
                raise AssertionError(f"ssdtrain: rebuilding the spill allocator from an invalid "
                                     f"run of {n} blocks at {s}; please report this bug.")
            if s < pos:
                raise AssertionError(f"ssdtrain: rebuilding the spill allocator from overlapping "
                                     f"runs (one ends at block {pos}, the next starts at {s}); "
                                     f"please report this bug.")
            if s > pos:
                starts.append(pos)
                length[pos] = s - pos
            pos, used = s + n, used + n
        return starts, length, pos, used

    def free_runs(self):
        return [(s, self._length[s]) for s in self._starts]


def filesystem_type(path: str) -> str:
    """The type (``ext4``, ``tmpfs``...) of the file system holding ``path``; ``""`` if unknown."""
    try:
        with open("/proc/self/mounts") as f:
            mounts = [line.split()[1:3] for line in f if len(line.split()) >= 3]
    except OSError:
        return ""
    path = os.path.realpath(path)
    best, kind = "", ""
    for point, fstype in mounts:
        point = point.replace("\\040", " ")
        if (path == point or path.startswith(point.rstrip("/") + "/")) and len(point) >= len(best):
            best, kind = point, fstype
    return kind


@dataclass(eq=False)
class Slot:
    """Where one record lives: ``nbytes`` at byte ``offset`` of ``file``, in whole blocks.
    A lease (NOTE [ Slots are leases ]): its blocks are in use while it is alive, and go
    back to the file's allocator once the last holder has dropped it."""

    file: "SpillFile"
    block: int
    nblocks: int
    offset: int
    nbytes: int
    lease: "_Lease" = field(default=None, repr=False)


class _Lease(weakref.ref):
    """A slot's claim on its blocks: a weak reference to the :class:`Slot` that carries
    its ``(block, nblocks)``; its callback (the file's ``returned.append``) queues it when
    the slot dies (NOTE [ Slots are leases ])."""

    __slots__ = ("block", "nblocks")

    def __new__(cls, slot, callback):
        self = super().__new__(cls, slot, callback)
        self.block, self.nblocks = slot.block, slot.nblocks
        return self

    def __init__(self, slot, callback):
        super().__init__(slot, callback)


class SpillFile:
    """One anonymous spill file in a directory, with its slot allocator."""

    def __init__(self, directory: str, direct_io: str):
        self.directory = directory
        _check_directory(directory)
        self.direct = False
        fd = None
        dir_fd = _open_private_directory(directory)  # NOTE [ Spill directory privacy ]
        try:
            if direct_io in ("auto", "on"):
                fd = _open_anonymous(directory, os.O_DIRECT, dir_fd)
                if fd is not None and not _direct_io_works(fd):
                    os.close(fd)
                    fd = None
                if fd is None and direct_io == "on":
                    raise ConfigError(f"ssdtrain: spill_dir {directory!r} "
                                      f"({filesystem_type(directory)}) does not support O_DIRECT, "
                                      f"which direct_io='on' requires; use direct_io='auto' or a "
                                      f"directory on an NVMe file system.")
                self.direct = fd is not None
            if fd is None:
                fd = _open_anonymous(directory, 0, dir_fd)
        finally:
            os.close(dir_fd)
        self.fd = fd
        self.allocator = SlotAllocator()
        # NOTE [ Slots are leases ]: the slots handed out and not yet reaped (id(lease) ->
        # lease), and the leases of slots that died (appended by their callback, any
        # thread, inside a garbage collection too).
        self.leases = {}
        self.returned = collections.deque()
        # No lock of its own: the store calls alloc, reap and rebuild only under its lock
        # (a second lock here, left held by an interrupt, would hang every later step).
        self.name = f"{directory}/<anonymous spill file fd {fd}>"

    def alloc(self, nbytes: int, misalign: int) -> Slot:
        """A slot for ``nbytes`` whose file offset is ``misalign`` modulo ``BLOCK``: a
        lease, whose blocks come back when it dies (NOTE [ Slots are leases ]). The slots
        that died since are reaped first, so their blocks can be reused."""
        self.reap()
        nblocks = max(1, align_up(misalign + nbytes) // BLOCK)
        block = self.allocator.alloc(nblocks)
        slot = Slot(self, block, nblocks, block * BLOCK + misalign, nbytes)
        lease = _Lease(slot, self.returned.append)
        key = id(lease)
        # NOTE [ Interrupt-safe allocation ]: registered in one line of stores; cut short
        # before it, the blocks are in use with no lease, and the next rebuild frees them.
        slot.lease = lease; self.leases[key] = lease  # noqa: E702
        return slot

    def reap(self) -> None:
        """Give back the blocks of the slots that died (NOTE [ Slots are leases ]). A lease
        leaves :attr:`leases` before its blocks are freed: an interrupt between leaks the
        blocks until the next rebuild, never frees them twice; a lease a rebuild already
        dropped (it was dead then) is skipped."""
        returned, leases = self.returned, self.leases
        while returned:
            lease = returned[0]
            if leases.pop(id(lease), None) is not None:
                self.allocator.free(lease.block, lease.nblocks)
            returned.popleft()

    def holds(self, slot) -> bool:
        """Whether ``slot`` is one of this file's leases not reaped."""
        lease = slot.lease
        return slot.file is self and lease is not None and self.leases.get(id(lease)) is lease

    def live_runs(self):
        """``(block, nblocks)`` of the leases registered (alive, or dead and not reaped)."""
        return [(lease.block, lease.nblocks) for lease in list(self.leases.values())]

    def rebuild(self) -> None:
        """Recompute the allocator from the slots still alive: blocks lost to an
        interrupt (allocated, never leased; or a lease reaped before its free) become
        free again (NOTE [ Interrupt-safe allocation ], NOTE [ Slots are leases ]). The
        books and the leases still alive are committed in one line of stores; a slot
        that dies meanwhile is counted alive here and reaped later."""
        live = {k: lease for k, lease in list(self.leases.items()) if lease() is not None}
        starts, length, end, used = SlotAllocator.books(
            (lease.block, lease.nblocks) for lease in live.values())
        a = self.allocator
        a._starts, a._length, a.end, a.used, self.leases = starts, length, end, used, live

    def problems(self):
        """What disagrees between the allocator and the leases registered: a list of
        messages, empty when its books are those of the leases' runs."""
        self.reap()
        try:
            want = SlotAllocator.books(self.live_runs())
        except AssertionError as e:
            return [f"{self.name}: leases overlap ({e})"]
        a = self.allocator
        got = (a._starts, a._length, a.end, a.used)
        if got != want:
            return [f"{self.name}: allocator (free {a.free_runs()}, end {a.end}, used {a.used})"
                    f" != its {len(self.leases)} leases (end {want[2]}, used {want[3]})"]
        return []

    def size_bytes(self) -> int:
        return os.fstat(self.fd).st_size if self.fd >= 0 else 0

    def close(self):
        if self.fd >= 0:
            fd, self.fd = self.fd, -1
            os.close(fd)


class SpillSet:
    """The spill files of one offloader, one per directory; slots striped over them."""

    def __init__(self, directories, direct_io: str):
        self.files = []
        try:
            for d in directories:
                self.files.append(SpillFile(d, direct_io))
        except BaseException:
            self.close()
            raise
        self._next = 0
        self.outside = {}  # id(lease) -> lease of the slots no record holds (let_go)
        for f in self.files:
            kind = filesystem_type(f.directory)
            if kind in RAM_FILESYSTEMS:
                log.warning("ssdtrain: spill_dir %s is on %s, which lives in RAM: offloading "
                            "there frees no memory. Point spill_dir at an SSD.", f.directory, kind)
            log.info("ssdtrain: spilling to %s (%s, %s)", f.directory, kind or "unknown fs",
                     "O_DIRECT" if f.direct else "buffered + sync_file_range + DONTNEED")

    def alloc(self, nbytes: int, misalign: int, outside: bool = False) -> Slot:
        """A slot (a lease: NOTE [ Slots are leases ]) of the next file in turn;
        ``outside``: no record will hold it (the bandwidth probe's), see
        :meth:`outside_bytes`."""
        f = self.files[self._next % len(self.files)]
        self._next += 1
        slot = f.alloc(nbytes, misalign)
        if outside:
            self.let_go(slot)
        return slot

    def let_go(self, slot) -> None:
        """``slot`` is held by no record any more but may still be held by a request (a
        record a repair cut loose from its request, or the probe's): it counts in
        :meth:`outside_bytes` for as long as it lives."""
        self.outside[id(slot.lease)] = slot.lease

    def outside_bytes(self) -> int:
        """Spill bytes of live slots no record holds (:meth:`let_go`): they count against
        ``max_spill_bytes`` too (``TailWindow.overflow``). Dead ones are forgotten."""
        outside, n = self.outside, 0
        for key, lease in list(outside.items()):
            if lease() is None:
                outside.pop(key, None)
            else:
                n += lease.nblocks
        return n * BLOCK

    def reap(self) -> None:
        """Every file's :meth:`SpillFile.reap`."""
        for f in self.files:
            f.reap()

    def rebuild(self) -> None:
        """Recompute every file's allocator from its slots still alive (a repair, and
        ``close()``): :meth:`SpillFile.rebuild`."""
        for f in self.files:
            f.rebuild()

    def used_bytes(self) -> int:
        """Bytes of the blocks of the slots alive (the dead ones reaped first)."""
        self.reap()
        return sum(f.allocator.used for f in self.files) * BLOCK

    def problems(self, slots):
        """What disagrees between each file's allocator and its leases, and whether every
        slot of ``slots`` (the records') is a live lease of one of the files: a list of
        messages, empty when all agree (``Store.check_invariants``)."""
        bad = [p for f in self.files for p in f.problems()]
        files = self.files
        for slot in slots:
            if not any(f.holds(slot) for f in files):
                bad.append(f"{slot!r} is not a lease of this store's spill files")
        return bad

    def close(self):
        for f in self.files:
            f.close()


def check_spill_dir(directory) -> None:
    """Raise the :class:`ConfigError` that opening a spill file in ``directory`` would:
    it must exist, be a directory and pass NOTE [ Spill directory privacy ]."""
    _check_directory(directory)
    os.close(_open_private_directory(directory))


def _check_directory(directory):
    if not os.path.exists(directory):
        raise ConfigError(f"ssdtrain: spill_dir {directory!r} does not exist; create it "
                          f"(mkdir -p) or point spill_dir at an existing directory.")
    if not os.path.isdir(directory):
        raise ConfigError(f"ssdtrain: spill_dir {directory!r} is not a directory; spill_dir "
                          f"must name a directory on the SSD to spill to.")


def _open_anonymous(directory, extra_flags, dir_fd=None):
    """An unnamed read-write file in ``directory`` (opened as ``dir_fd`` when given);
    ``None`` if ``extra_flags`` are refused."""
    flags = os.O_RDWR | os.O_CLOEXEC | extra_flags
    try:
        # O_EXCL: the file can never be given a name (linkat through /proc/self/fd).
        if dir_fd is None:
            return os.open(directory, flags | os.O_TMPFILE | os.O_EXCL, 0o600)
        return os.open(".", flags | os.O_TMPFILE | os.O_EXCL, 0o600, dir_fd=dir_fd)
    except OSError as e:
        if e.errno in (_errno.EACCES, _errno.EROFS, _errno.EPERM, _errno.ENOSPC, _errno.EDQUOT):
            raise _unwritable(directory, e) from None
        if e.errno == _errno.EINVAL and extra_flags:
            return None  # O_DIRECT refused (e.g. tmpfs); the caller falls back
        if e.errno not in (_errno.EOPNOTSUPP, _errno.EISDIR, _errno.EINVAL):
            raise _unwritable(directory, e) from None
    # No O_TMPFILE here: create a private name, unlink it at once.
    for _ in range(100):
        name = f".ssdtrain-{os.getpid()}-{os.urandom(6).hex()}.spill"
        path = name if dir_fd is not None else os.path.join(directory, name)
        try:
            fd = os.open(path, flags | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600,
                         dir_fd=dir_fd)
        except FileExistsError:
            continue
        except OSError as e:
            if e.errno == _errno.EINVAL and extra_flags:
                return None
            raise _unwritable(directory, e) from None
        os.unlink(path, dir_fd=dir_fd)
        return fd
    raise SpillIOError(f"ssdtrain: could not create a unique spill file in {directory!r}.",
                       filename=directory)


# NOTE [ Spill directory privacy ]
#
# Spilled activations are training data. Spill files are anonymous (O_TMPFILE with
# O_EXCL: no name, ever, and none can be given to them later; or, where the file
# system lacks O_TMPFILE, a random name created with O_EXCL|O_NOFOLLOW, mode 0600,
# unlinked at once), so other users cannot open them by name and nothing outlives
# the process. The directory itself is checked on the descriptor that the files are
# then created through (no window between the check and the use):
#   * a symbolic link as spill_dir is followed only if it belongs to this user or
#     root (an attacker's link in a shared directory is refused), then the target is
#     opened with O_NOFOLLOW;
#   * the directory must belong to this user or to root: another user's directory
#     is theirs to watch and to swap;
#   * a world-writable directory needs the sticky bit (as /tmp and /dev/shm have):
#     without it any user may rename or remove what is created there.
# The default spill_dir is a directory ssdtrain creates for this user, mode 0700
# (default_spill_dir).

def _trusted_uids():
    return {os.geteuid(), 0}


def _open_private_directory(directory):
    """``directory`` opened (``O_DIRECTORY|O_NOFOLLOW``) once it passed the checks of
    NOTE [ Spill directory privacy ]; the caller closes the descriptor."""
    path = directory
    try:
        link = os.lstat(directory)
    except OSError as e:
        raise _unwritable(directory, e) from None
    if stat.S_ISLNK(link.st_mode):
        if link.st_uid not in _trusted_uids():
            raise ConfigError(
                f"ssdtrain: spill_dir {directory!r} is a symbolic link owned by uid "
                f"{link.st_uid}, not by this user (uid {os.geteuid()}) or root; ssdtrain does not "
                f"follow another user's links (they could point the spill data anywhere). Give "
                f"the real directory ({os.path.realpath(directory)!r}) if you trust it.")
        path = os.path.realpath(directory)
    try:
        dir_fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        if e.errno == _errno.ELOOP:  # replaced by a link since lstat
            raise ConfigError(f"ssdtrain: spill_dir {directory!r} changed into a symbolic link "
                              f"while being opened; refusing it.") from None
        raise _unwritable(directory, e) from None
    try:
        _check_private(directory, os.fstat(dir_fd))
    except BaseException:
        os.close(dir_fd)
        raise
    return dir_fd


def _check_private(directory, st):
    if st.st_uid not in _trusted_uids():
        raise ConfigError(
            f"ssdtrain: spill_dir {directory!r} belongs to uid {st.st_uid}, not to this user "
            f"(uid {os.geteuid()}) or root: its owner could read or replace the spilled "
            f"activations. Use a directory you own (mkdir -m 700 ...).")
    if st.st_mode & stat.S_IWOTH and not st.st_mode & stat.S_ISVTX:
        raise ConfigError(
            f"ssdtrain: spill_dir {directory!r} is world-writable without the sticky bit (mode "
            f"{stat.S_IMODE(st.st_mode):#o}): any user may rename or remove files in it. Use a "
            f"private directory (mkdir -m 700 ...), or set the sticky bit (chmod +t) as /tmp has.")


def default_spill_dir():
    """The spill directory used when none is configured: ``<tmp>/ssdtrain-<uid>``.

    Created with mode 0700 if missing. One that exists must be a real directory (not a
    link) owned by this user; its mode is narrowed to 0700 (NOTE [ Spill directory
    privacy ]).

    Raises:
        ConfigError: it exists but is a link, not a directory, or another user's.
    """
    path = os.path.join(os.path.abspath(tempfile.gettempdir()), f"ssdtrain-{os.geteuid()}")
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except OSError as e:
        raise ConfigError(f"ssdtrain: cannot create the default spill directory {path!r} "
                          f"({e.strerror}); set spill_dir (or SSDTRAIN_SPILL_DIR).") from None
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
        raise ConfigError(
            f"ssdtrain: the default spill directory {path!r} exists but is "
            f"{'not a directory' if not stat.S_ISDIR(st.st_mode) else f'owned by uid {st.st_uid}'}"
            f"; someone else may have planted it. Remove it, or set spill_dir (or "
            f"SSDTRAIN_SPILL_DIR) to a private directory.")
    if stat.S_IMODE(st.st_mode) != 0o700:
        os.chmod(path, 0o700, follow_symlinks=False)
    return path


def _unwritable(directory, e):
    """The error for an ``OSError`` ``e`` of creating a file in ``directory``: a resource
    that ran out (EMFILE, ENFILE, ENOMEM) is named as such, not as the directory's fault."""
    err = resource_error(f"opening a spill file in {directory!r}", e)
    if err is not None:
        return err
    return ConfigError(f"ssdtrain: spill_dir {directory!r} is not writable ({e.strerror}, errno "
                       f"{e.errno}); choose a directory this process can create files in.")


def _direct_io_works(fd) -> bool:
    buf = mmap.mmap(-1, BLOCK)
    try:
        return os.pwrite(fd, buf, 0) == BLOCK and os.preadv(fd, [buf], 0) == BLOCK
    except OSError:
        return False
    finally:
        buf.close()
        try:
            os.ftruncate(fd, 0)
        except OSError:
            pass
