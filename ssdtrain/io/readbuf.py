"""Read destinations for records coming back from the spill tier: a bounded pool.

A read lands in page-aligned anonymous memory with the record's misalignment
(NOTE [ Zero-copy O_DIRECT from unaligned tensors ] in docs/ARCHITECTURE.md) and
is handed out as a ``torch.UntypedStorage``. Fresh pages cost the reading thread
a page fault and a zeroed page per 4 KiB, so memory whose storage has died is
reused. One anonymous ``mmap`` per read is what this replaces: with tens of
thousands of small records the mappings passed ``vm.max_map_count`` (65,530) and
the process died.

NOTE [ Read buffer pool ]
Small requests (at most ``SMALL_BYTES`` once rounded up to whole blocks) are
*pieces* of ``SLAB_BYTES`` anonymous mappings (*slabs*), cut in 4 KiB blocks so
a piece can honour any misalignment; a slab is unmapped only when no block of it
is in use. Larger requests get a mapping of their own, reused by exact size (the
same layers read the same sizes step after step). Mapped memory is therefore
the slabs holding a live piece, the live large mappings, and idle memory: idle
large mappings plus wholly free slabs, at most ``limit`` bytes plus one spare
slab (so a pool that empties and fills a slab does not map and unmap it every
time) plus one large mapping (a large mapping is kept idle while the idle bytes
are below ``limit``: NOTE [ Read buffers across steps ]). A single live piece pins its whole slab: the bound is in bytes
in use rounded up to slabs, not in the number of records.

Each piece owns whole blocks: every block that the storage, or an O_DIRECT read
of its bytes done in place in whole blocks, can touch. Two live pieces never
share a block.

Give-back. A ``weakref.finalize`` on the returned storage (torch keeps the
Python storage object alive as long as its StorageImpl, so it fires when the last
view dies) appends the piece to ``_queue``, a ``collections.deque``: an atomic,
lock-free append that may run anywhere, in any thread, inside a garbage
collection started by an allocation in this module included. Nothing else
happens in the finalizer: no lock, no unmapping. :meth:`ReadBuffers.storage`,
:meth:`~ReadBuffers.collect` and :meth:`~ReadBuffers.trim` drain the queue; the
store calls them under its lock, one thread at a time, so the pool has no lock.
A storage also holds a ``memoryview`` of its mapping, so ``mmap.close()`` raises
``BufferError`` while it lives: a mapping with a live storage is never unmapped,
whatever the books say; it is dropped instead and unmapped by the ``mmap``
object's deallocation once the last storage on it is gone.

Interrupts. A ``KeyboardInterrupt`` may be raised at any line of this module.
Each change to the books is computed first and committed by one line of
stores and deletions, no call; a take or a give-back sets or clears
``piece.live`` on that line. The change happens fully or not at all (as in NOTE
[ Interrupt-safe allocation ] in io/spill.py). A mapping leaves the books before it
is unmapped: interrupted in between, it goes with its last reference and its
deallocation unmaps it. The queue is read with a peek and popped only after the
give-back, which is idempotent (a piece no longer live is skipped), so an
interrupt there processes a piece again rather than loses it. A piece taken by
:meth:`ReadBuffers.storage` but not yet covered by a finalizer is given back by
its ``except BaseException`` clause; once the storage exists, only its finalizer
gives the piece back. What an interrupt can still cost is one piece, leaked,
never handed out twice: a signal between the creation of a storage and of its
finalizer (inside one line), or inside ``weakref.finalize.__call__`` (Python
code in weakref.py, where Python prints and drops the exception).

Mappings are ``MAP_SHARED`` (``mmap``'s default, as before): an O_DIRECT read in
flight across a ``fork()`` then cannot land in a page that copy-on-write has
given to the child.
"""

import collections
import mmap
import weakref

import torch

from .spill import BLOCK, align_up

__all__ = ["ReadBuffers", "SLAB_BYTES", "SMALL_BYTES", "unmap_now"]

SLAB_BYTES = 4 << 20    # one mapping shared by many small pieces
SMALL_BYTES = 256 << 10  # pieces up to this size (whole blocks) come from slabs
_SLAB_BLOCKS = SLAB_BYTES // BLOCK
_SMALL_BLOCKS = SMALL_BYTES // BLOCK
# Patterns for a slab's block map: _FREE[n] finds n free blocks, _USED[n] marks them.
_FREE = tuple(bytes(n) for n in range(_SMALL_BLOCKS + 1))
_USED = tuple(b"\x01" * n for n in range(_SMALL_BLOCKS + 1))
_MAX_LEAD = 16
_U8 = torch.uint8
_finalize = weakref.finalize


class _Slab:
    """One ``SLAB_BYTES`` anonymous mapping; ``used[i]`` is 1 while block ``i`` is handed out."""

    __slots__ = ("mm", "used", "nused")

    def __init__(self):
        self.mm = mmap.mmap(-1, SLAB_BYTES)
        self.used = bytearray(_SLAB_BLOCKS)
        self.nused = 0  # blocks in use: the count of ones in ``used``


class _Piece:
    """One hand-out: ``size`` bytes at ``offset`` of ``mm``.

    ``slab`` is the slab the piece is cut from, or None for a mapping of its own.
    ``live`` is set and cleared on the same line as the books change, so a
    second give-back of the same piece does nothing. A new object per hand-out,
    so a stale give-back can never free a later hand-out of the same memory.
    """

    __slots__ = ("mm", "slab", "offset", "size", "live")

    def __init__(self, size):
        self.mm = self.slab = None
        self.offset = 0
        self.size = size
        self.live = False


class ReadBuffers:
    """A bounded pool of read destinations (NOTE [ Read buffer pool ]).

    Not thread-safe by design: :meth:`storage`, :meth:`collect` and :meth:`trim`
    are called by one thread at a time (the store holds its lock around them).
    Finalizers of the storages handed out only append to a lock-free queue, from
    any thread, so they never wait on that lock nor on this pool.

    Args:
        limit: idle bytes kept mapped for reuse (the store passes
            ``prefetch_bytes``); one spare slab and one large mapping are kept beyond it.
        unmap: what is done with a mapping that leaves the pool (it has left the books
            already): by default it is unmapped at once; the store passes its
            graveyard's ``append``, so its I/O thread unmaps it outside the store's
            lock (NOTE [ Unmapping off the training thread ]).
    """

    def __init__(self, limit: int, unmap=None):
        self._limit = int(limit)
        self._unmap = unmap_now if unmap is None else unmap
        self._queue = collections.deque()  # pieces whose storage died (appended by finalizers)
        self._slabs = []       # every slab mapped
        self._cursor = 0       # the slab to try first (next fit); a hint, any value is valid
        self._empty = 0        # slabs with no block in use
        self._large = {}       # size -> idle mappings of that size
        self._idle = 0         # bytes in ``_large``
        self._out = {}         # live pieces with a mapping of their own -> None
        # What :meth:`trim_unused` keeps: hints, not books (an interrupt may lose an
        # update: then one idle mapping more or less is kept until the next trim).
        self.watching = False  # set by the store around forward's first read-ahead
        self._wanted = {}      # size -> large hand-outs of that size while watching
        self._peak_slabs = 0   # the most slabs with a block in use at once while watching

    def storage(self, misalign: int, lead: int, nbytes: int) -> torch.UntypedStorage:
        """A uint8 CPU storage of ``lead + nbytes`` bytes for a read.

        Byte ``lead`` lies at an address congruent to ``misalign`` modulo ``BLOCK``:
        the read lands at ``storage.data_ptr() + lead`` (O_DIRECT needs the file
        offset congruent to the address). The storage starts at an address
        congruent to ``misalign - lead``, hence 16-byte aligned whenever
        ``(misalign - lead) % 16 == 0``, so views of any dtype can be rebuilt on
        it. The memory is not zeroed. It returns to the pool when the storage
        dies. ``lead + nbytes == 0`` gets an empty storage of no mapping.

        Raises:
            ValueError: ``misalign`` is outside ``[0, BLOCK)``, ``lead`` outside
                ``[0, 16)`` or ``nbytes`` negative (a caller bug).
        """
        if self._queue:
            self.collect()
        if not (0 <= misalign < BLOCK and 0 <= lead < _MAX_LEAD and nbytes >= 0):
            raise ValueError(f"ssdtrain: read buffer request misalign={misalign}, lead={lead}, "
                             f"nbytes={nbytes} is out of range (expected 0 <= misalign < {BLOCK}, "
                             f"0 <= lead < {_MAX_LEAD}, nbytes >= 0); please report this bug.")
        total = lead + nbytes
        if total == 0:
            return torch.UntypedStorage(0)
        skew = (misalign - lead) % BLOCK  # where the storage starts in its first block
        size = align_up(skew + total)
        piece = _Piece(size)
        st = None
        try:
            if size <= SMALL_BYTES:
                self._take_small(piece, size // BLOCK)
            else:
                self._take_large(piece)
            start, push = piece.offset + skew, self._queue.append
            # ``view`` keeps the mapping exported while the storage lives (see the module
            # docstring). The storage and its finalizer are made on one line: a line-level
            # interrupt finds no storage (the piece is given back below) or both.
            view = memoryview(piece.mm)[start:start + total]
            st = torch.frombuffer(view, dtype=_U8).untyped_storage(); _finalize(st, push, piece)
        except BaseException:
            if st is None: self._give_back(piece)  # no storage, so no finalizer will
            raise
        return st

    def collect(self) -> None:
        """Take back the pieces whose storages died: drain the give-back queue."""
        queue = self._queue
        while queue:
            self._give_back(queue[0])  # peek, then pop: an interrupt repeats, never loses
            queue.popleft()

    def trim(self) -> None:
        """Collect, then unmap (as ``unmap`` says) every idle mapping and every slab with
        no block in use."""
        self.collect()
        self._wanted = {}; self._peak_slabs = 0
        large, self._large = self._large, {}; self._idle = 0
        keep = [s for s in self._slabs if s.nused]
        drop = [s for s in self._slabs if not s.nused]
        self._slabs = keep; self._empty = 0; self._cursor = 0
        for mm in [mm for idle in large.values() for mm in idle] + [s.mm for s in drop]:
            self._unmap(mm)

    def trim_unused(self) -> None:
        """Collect, then unmap the idle memory beyond what was handed out while
        ``watching`` since the last trim (NOTE [ Read buffers across steps ]): of each
        size, the idle mappings beyond the number handed out then; the wholly free slabs
        beyond the most slabs in use at once then, less those in use now."""
        self.collect()
        wanted, peak = self._wanted, self._peak_slabs
        used = len(self._slabs) - self._empty
        self._wanted = {}; self._peak_slabs = 0
        large, gone, idle = {}, [], 0
        for size, group in self._large.items():
            n = min(len(group), wanted.get(size, 0))
            if n:
                large[size] = group[:n]; idle += n * size
            gone += group[n:]
        empties = [s for s in self._slabs if not s.nused]
        drop = {id(s) for s in empties[max(0, peak - used):]}
        keep = [s for s in self._slabs if id(s) not in drop]
        if not gone and not drop:
            return
        self._large, self._idle, self._slabs, self._empty, self._cursor = \
            large, idle, keep, len(empties) - len(drop), 0
        for mm in gone + [s.mm for s in empties if id(s) in drop]:
            self._unmap(mm)

    def mapped_bytes(self) -> int:
        """Bytes of every mapping the pool holds: slabs, live and idle large mappings."""
        return len(self._slabs) * SLAB_BYTES + self._idle + sum(p.size for p in self._out)

    def mappings(self) -> int:
        """The number of mappings the pool holds (each is one ``mmap``)."""
        return len(self._slabs) + len(self._out) + sum(len(idle) for idle in self._large.values())

    def idle_bytes(self) -> int:
        """Mapped bytes no storage uses and no slab pins: at most ``limit`` plus one slab
        and one large mapping."""
        return self._idle + self._empty * SLAB_BYTES

    def check_invariants(self) -> None:
        """Raise AssertionError if the books disagree with themselves (for tests and repair)."""
        def fail(what):
            raise AssertionError(f"ssdtrain: read buffer pool: {what}; please report this bug.")
        if len({id(s) for s in self._slabs}) != len(self._slabs):
            fail("a slab is listed twice")
        for slab in self._slabs:
            if slab.mm.closed:
                fail("a listed slab is unmapped")
            if slab.used.count(1) != slab.nused or slab.used.count(0) != _SLAB_BLOCKS - slab.nused:
                fail(f"a slab counts {slab.nused} blocks in use, its block map "
                     f"{slab.used.count(1)}")
        empty = sum(1 for s in self._slabs if not s.nused)
        if empty != self._empty:
            fail(f"{self._empty} slabs counted empty, {empty} are")
        idle, seen = 0, set()
        for size, group in self._large.items():
            for mm in group:
                if mm.closed or len(mm) != size or id(mm) in seen:
                    fail(f"an idle mapping of {size} bytes is unmapped, of another size or "
                         f"listed twice")
                seen.add(id(mm))
                idle += size
        if idle != self._idle:
            fail(f"{self._idle} idle bytes counted, {idle} listed")
        for piece in self._out:
            if not piece.live or piece.slab is not None or piece.mm.closed \
                    or len(piece.mm) != piece.size or id(piece.mm) in seen:
                fail("a live large piece is not live, unmapped, of another size or also idle")
            seen.add(id(piece.mm))

    # -- internals: each commits with one line (NOTE [ Read buffer pool ]) ---------------

    def _take_small(self, piece, n):
        """Cut ``n`` blocks for ``piece``: next fit over the slabs, first fit inside one."""
        slabs, free, want = self._slabs, _SLAB_BLOCKS - n, _FREE[n]
        k, c = len(slabs), self._cursor
        for j in range(k):
            slab = slabs[(c + j) % k]
            i = slab.used.find(want) if slab.nused <= free else -1
            if i >= 0:
                break
        else:  # no slab has n free blocks in a row: a new one
            slab = _Slab()
            piece.mm = slab.mm; piece.slab = slab
            slab.used[:n] = _USED[n]; slab.nused = n; slabs += (slab,); piece.live = True
            self._cursor = k
            if self.watching:
                self._note_slabs()
            return
        piece.mm = slab.mm; piece.slab = slab; piece.offset = i * BLOCK
        was_empty = not slab.nused
        slab.used[i:i + n] = _USED[n]; slab.nused += n; self._empty -= was_empty; piece.live = True
        self._cursor = (c + j) % k
        if self.watching:
            self._note_slabs()

    def _note_slabs(self):
        """Raise the hint of the most slabs in use at once (:meth:`trim_unused`)."""
        used = len(self._slabs) - self._empty
        if used > self._peak_slabs:
            self._peak_slabs = used

    def _take_large(self, piece):
        """A mapping of exactly ``piece.size`` bytes: an idle one, else a new one."""
        size = piece.size
        if self.watching:  # a hint (trim_unused)
            self._wanted[size] = self._wanted.get(size, 0) + 1
        idle = self._large.get(size)
        if idle:
            piece.mm = idle[-1]  # not live yet: a give-back now does nothing
            del idle[-1]; self._idle -= size; self._out[piece] = None; piece.live = True
            if not idle:
                del self._large[size]  # not a key per size ever seen (an interrupt: an empty list)
        else:
            piece.mm = mmap.mmap(-1, size)
            self._out[piece] = None; piece.live = True

    def _give_back(self, piece):
        """Return a piece whose storage died (or was never made). Idempotent."""
        slab = piece.slab
        if slab is not None:
            if piece.live:
                a, n = piece.offset // BLOCK, piece.size // BLOCK
                e = slab.nused == n  # the slab empties
                slab.used[a:a + n] = _FREE[n]; slab.nused -= n; self._empty += e; piece.live = False
            if not slab.nused and self._empty > 1 and self.idle_bytes() > self._limit:
                self._drop(slab)
            return
        if not piece.live:
            return
        size = piece.size
        if self.idle_bytes() < self._limit:
            idle = self._large.get(size)
            if idle is None:
                idle = self._large[size] = []
            idle += (piece.mm,); self._idle += size; del self._out[piece]; piece.live = False
        else:
            del self._out[piece]; piece.live = False
            self._unmap(piece.mm)

    def _drop(self, slab):
        """Unmap ``slab``, which has no block in use, and forget it."""
        rest = [s for s in self._slabs if s is not slab]
        if len(rest) == len(self._slabs) or slab.nused:
            return
        self._slabs = rest; self._empty -= 1
        self._unmap(slab.mm)


# NOTE [ Read buffers across steps ]
# The store trims the pool at the start of each forward. Unmapping every idle buffer
# there, as it once did, freed the pages backward had just read into and faulted
# fresh, zeroed ones in at forward's end, when the first window's reads start: with
# 64 MiB records, some 96 ms of unmapping per step on the I/O thread and up to 13 ms
# of page faults per buffer at forward's end, 2.6-3.1 ms per saved tensor added to a
# launch-like loop's forward on this project's 2-core VM, against 0.24 ms with the
# buffers kept (docs/results/launch_loop_polled_cpu_2026-11-27.md).
#
# Keeping every idle buffer through forward is no answer: memory is what ssdtrain
# is for, and a step whose backward starts on kept records (the default's quota
# keeps the last ones) reads nothing at forward's end, so its idle buffers would
# add to forward's peak (a CPU model in a cgroup 160 MiB above torch's own use was
# killed so, tests/test_limits.py). What forward's end maps anyway costs nothing to
# keep: the store sets ``watching`` around the first window's reads
# (Store._end_pass_locked), and the start of the next forward (trim_unused) keeps,
# of each size, as many idle mappings as were handed out then, and as many free
# slabs as were then in use at once, less those in use now; the rest is unmapped.
# In a steady run the first window maps and unmaps nothing after the first step; a
# step whose forward's end read nothing frees the pool at the next forward's start;
# close() frees all. Memory held through forward is at most what the last forward's
# end mapped (its window: ``prefetch_bytes`` plus one record), which that end will
# map again when forward's memory is at its height.
#
# A large mapping given back is kept idle while the idle bytes are below ``limit``,
# so they may pass ``limit`` by one mapping: the window holds up to
# ``prefetch_bytes`` plus one record (INV-BOUNDED), and its mappings are a few KiB
# larger than its records (the misalignment), so a strict ``limit`` unmapped one
# buffer at every backward's end. Only host records read into this pool; a device
# record reads into pinned staging (NOTE [ Bounded staging ] in _device/staging.py).

# NOTE [ Unmapping off the training thread ]
# Unmapping is the kernel freeing every page: about 65 ms for 256 MiB on this
# project's VM, and milliseconds for one 64 MiB read buffer. The store's trim at the
# start of each forward, and give-backs beyond the idle limit during backward, paid
# that on the training thread (benchmarks/hook_cost.py showed it as most of the time
# "inside ssdtrain" per step). The store therefore passes ``unmap=`` its graveyard:
# a mapping that leaves the books is queued there and its I/O thread closes it
# outside the store's lock (mmap.close() releases the GIL around munmap; NOTE [ The
# store's I/O thread ] in _store/store.py). The mappings have already left the books (an
# interrupt before the queueing leaves them to their deallocation, as everywhere in
# this module). Memory is given back a little later than the trim, not at forward's
# peak. A pool made with no ``unmap`` (tests, tools) unmaps in place.

def unmap_now(mm):
    """Unmap ``mm`` now (``mmap.close()``, which releases the GIL around munmap)."""
    try:
        mm.close()
    except BufferError:  # a dying storage still exports it: its deallocation unmaps it
        pass
