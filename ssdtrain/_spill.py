"""Spill directories, spill files and slot allocation inside them.

A spill file is anonymous: opened with ``O_TMPFILE`` (or created and unlinked at
once where the file system lacks it), so its blocks return to the file system
when the process ends, however it ends. Records live in *slots*: runs of whole
4 KiB blocks, reused step to step. See NOTE [ Zero-copy O_DIRECT from unaligned
tensors ] in docs/ARCHITECTURE.md for why a record's file offset is congruent
to its memory address modulo the block size.
"""

import bisect
import errno as _errno
import logging
import mmap
import os
import threading
from dataclasses import dataclass

from ._errors import ConfigError, SpillIOError

__all__ = ["BLOCK", "SlotAllocator", "SpillFile", "SpillSet", "Slot", "filesystem_type"]

log = logging.getLogger("ssdtrain")

BLOCK = 4096  # alignment of O_DIRECT memory, offsets and lengths (>= any logical block here)


def align_down(x, a=BLOCK):
    return x - x % a


def align_up(x, a=BLOCK):
    return -(-x // a) * a


class SlotAllocator:
    """First-fit allocator of runs of blocks in one file; freed runs coalesce.

    Pure bookkeeping (no I/O), so property tests can drive it directly.
    """

    def __init__(self):
        self._starts = []   # sorted starts of free runs
        self._length = {}   # start -> length of free run
        self.end = 0        # blocks in use or free below this; the file's high-water mark
        self.used = 0       # blocks currently allocated

    def alloc(self, nblocks: int) -> int:
        if nblocks <= 0:
            raise ValueError(f"nblocks must be positive, got {nblocks}")
        for i, start in enumerate(self._starts):
            length = self._length[start]
            if length >= nblocks:
                del self._starts[i]
                del self._length[start]
                if length > nblocks:
                    self._insert(start + nblocks, length - nblocks)
                self.used += nblocks
                return start
        start = self.end
        self.end += nblocks
        self.used += nblocks
        return start

    def free(self, start: int, nblocks: int) -> None:
        if nblocks <= 0 or start < 0 or start + nblocks > self.end:
            raise AssertionError(f"ssdtrain: freeing blocks [{start}, {start + nblocks}) outside "
                                 f"[0, {self.end}); please report this bug.")
        i = bisect.bisect_left(self._starts, start)
        prev = self._starts[i - 1] if i > 0 else None
        if (i < len(self._starts) and self._starts[i] < start + nblocks) or \
                (prev is not None and prev + self._length[prev] > start):
            raise AssertionError(f"ssdtrain: double free of blocks at {start}; please report.")
        self.used -= nblocks
        if prev is not None and prev + self._length[prev] == start:  # merge with the run before
            start, nblocks = prev, self._length.pop(prev) + nblocks
            del self._starts[i - 1]
            i -= 1
        if i < len(self._starts) and self._starts[i] == start + nblocks:  # and the one after
            nblocks += self._length.pop(self._starts[i])
            del self._starts[i]
        if start + nblocks == self.end:  # the tail shrinks rather than stays free
            self.end = start
        else:
            self._insert(start, nblocks)

    def free_runs(self):
        return [(s, self._length[s]) for s in self._starts]

    def _insert(self, start, length):
        bisect.insort(self._starts, start)
        self._length[start] = length


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
    """Where one record lives: ``nbytes`` at byte ``offset`` of ``file``, in whole blocks."""

    file: "SpillFile"
    block: int
    nblocks: int
    offset: int
    nbytes: int


class SpillFile:
    """One anonymous spill file in a directory, with its slot allocator."""

    def __init__(self, directory: str, direct_io: str):
        self.directory = directory
        _check_directory(directory)
        self.direct = False
        fd = None
        if direct_io in ("auto", "on"):
            fd = _open_anonymous(directory, os.O_DIRECT)
            if fd is not None and not _direct_io_works(fd):
                os.close(fd)
                fd = None
            if fd is None and direct_io == "on":
                raise ConfigError(f"ssdtrain: spill_dir {directory!r} ({filesystem_type(directory)})"
                                  f" does not support O_DIRECT, which direct_io='on' requires; use "
                                  f"direct_io='auto' or a directory on an NVMe file system.")
            self.direct = fd is not None
        if fd is None:
            fd = _open_anonymous(directory, 0)
        self.fd = fd
        self.allocator = SlotAllocator()
        self._lock = threading.Lock()
        self.name = f"{directory}/<anonymous spill file fd {fd}>"

    def alloc(self, nbytes: int, misalign: int) -> Slot:
        """A slot for ``nbytes`` whose file offset is ``misalign`` modulo ``BLOCK``."""
        nblocks = max(1, align_up(misalign + nbytes) // BLOCK)
        with self._lock:
            block = self.allocator.alloc(nblocks)
        return Slot(self, block, nblocks, block * BLOCK + misalign, nbytes)

    def free(self, slot: Slot) -> None:
        with self._lock:
            self.allocator.free(slot.block, slot.nblocks)

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
        for f in self.files:
            kind = filesystem_type(f.directory)
            if kind in ("tmpfs", "ramfs"):
                log.warning("ssdtrain: spill_dir %s is on %s, which lives in RAM: offloading "
                            "there frees no memory. Point spill_dir at an SSD.", f.directory, kind)
            log.info("ssdtrain: spilling to %s (%s, %s)", f.directory, kind or "unknown fs",
                     "O_DIRECT" if f.direct else "buffered + fdatasync + DONTNEED")

    def alloc(self, nbytes: int, misalign: int) -> Slot:
        f = self.files[self._next % len(self.files)]
        self._next += 1
        return f.alloc(nbytes, misalign)

    def used_bytes(self) -> int:
        return sum(f.allocator.used for f in self.files) * BLOCK

    def close(self):
        for f in self.files:
            f.close()


def _check_directory(directory):
    if not os.path.exists(directory):
        raise ConfigError(f"ssdtrain: spill_dir {directory!r} does not exist; create it "
                          f"(mkdir -p) or point spill_dir at an existing directory.")
    if not os.path.isdir(directory):
        raise ConfigError(f"ssdtrain: spill_dir {directory!r} is not a directory; spill_dir "
                          f"must name a directory on the SSD to spill to.")


def _open_anonymous(directory, extra_flags):
    """An unnamed read-write file in ``directory``; ``None`` if ``extra_flags`` are refused."""
    flags = os.O_RDWR | os.O_CLOEXEC | extra_flags
    try:
        return os.open(directory, flags | os.O_TMPFILE, 0o600)
    except OSError as e:
        if e.errno in (_errno.EACCES, _errno.EROFS, _errno.EPERM, _errno.ENOSPC, _errno.EDQUOT):
            raise _unwritable(directory, e) from None
        if e.errno == _errno.EINVAL and extra_flags:
            return None  # O_DIRECT refused (e.g. tmpfs); the caller falls back
        if e.errno not in (_errno.EOPNOTSUPP, _errno.EISDIR, _errno.EINVAL):
            raise _unwritable(directory, e) from None
    # No O_TMPFILE here: create a private name, unlink it at once.
    for _ in range(100):
        path = os.path.join(directory, f".ssdtrain-{os.getpid()}-{os.urandom(6).hex()}.spill")
        try:
            fd = os.open(path, flags | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        except FileExistsError:
            continue
        except OSError as e:
            if e.errno == _errno.EINVAL and extra_flags:
                return None
            raise _unwritable(directory, e) from None
        os.unlink(path)
        return fd
    raise SpillIOError(f"ssdtrain: could not create a unique spill file in {directory!r}.",
                       filename=directory)


def _unwritable(directory, e):
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
