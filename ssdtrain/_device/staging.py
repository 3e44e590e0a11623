"""Pinned staging for device records' copies: :class:`StagingPool`, one per leaf of a
store, and the leases it hands out (rule 4 of NOTE [ Device records ] in
_device/transfers.py: a buffer is not reused before the copy that used it last ends).

NOTE [ Bounded staging ]
========================

Pinned allocations cost milliseconds, so a :class:`StagingPool` keeps buffers for
reuse; but pinned memory is the scarcest host memory there is, so it never keeps more
than its idle limit (``write_behind_bytes + prefetch_bytes + host_budget_bytes``: what
one step has in flight at once and the host tier's copies) idle, counted as the
allocator reserved them (the size class, or the larger reservation of a packed block):

* every way into the idle set (a buffer given back once its last copy ended, one
  reserved ahead for the next write or read by :meth:`StagingPool.reserve`) makes
  room by letting go of the buffers idle longest (least recently used first); a
  buffer larger than the whole limit is never kept idle (nor reserved ahead: ``take``
  allocates it, ``ready`` says so, so the I/O thread does not wait for it);
* the I/O thread reserves a read's buffer in the class the read takes (its slot's
  offset in a page plus its bytes), and only for a read from the SSD (a load from the
  host tier needs none);
* :meth:`StagingPool.trim` collects the buffers given back at each step's start; at
  ``wait()`` and ``close()`` (``Store.flush``) it first waits for their last copies,
  so that they count as idle, not in use, and gives what was let go of back to the
  system (``leaf.release_cached_pinned``: torch's caching host allocator keeps freed
  pinned blocks; between such trims they stay in that cache, where the next
  allocation of the same class finds them).

So after ``wait()`` a pool holds at most its idle limit idle
(``Stats.staging_idle_bytes``) plus what live records hold (the host tier's pinned
copies), and with no graph alive ``Stats.staging_bytes == staging_idle_bytes <= idle
limit`` (docs/ARCHITECTURE.md, "The host tier"). Before, a reservation entered the
idle set without a look at the limit, one per size class, and the one made for a read
asked the wrong class (without the read's offset in its page), so it was never used: a
soak with page-sized classes held hundreds of MiB to GBs of idle pinned memory after
``wait()`` (tests/test_soak.py, benchmarks/soak.py).
"""

from __future__ import annotations

import collections
import threading
import weakref

from .._align import BLOCK

__all__ = ["StagingPool"]

_STATS_LOCK = threading.Lock()  # Stats.staging_bytes of every pool of a store


class _Lease:
    """Pinned staging handed out by a :class:`StagingPool`: ``view`` (uint8, the bytes
    asked for). The buffer goes back to the pool when the lease dies; ``after(event)``
    says that a copy queued on it must end before it is handed out again (rule 4)."""

    __slots__ = ("view", "_event", "__weakref__")

    def __init__(self, view, event_box):
        self.view = view
        self._event = event_box

    def after(self, event) -> None:
        self._event[0] = event


class StagingPool:
    """Pinned host buffers for device records' copies, reused across records.

    A request is rounded to the size the leaf's host allocator really reserves for it
    (``leaf.pinned_size``: torch's caching host allocator rounds to a power of two),
    and a buffer of that size is taken whole: nothing is asked beyond it, and a buffer
    serves every request that rounds to its size (its *size class*). Every buffer starts
    on a page (``BLOCK``): a read lands at the slot's offset in a page, which is the
    staging's at the write (O_DIRECT). torch's host allocator packs small blocks at any
    offset in a page (seen on torch 2.11): such a buffer is asked again one page larger
    and used from its first page boundary (the reservation counted is the larger one).
    ``stats.staging_bytes`` is the pinned memory the pool holds (in use, waiting for a
    copy to end, and idle); ``stats.peak_staging_bytes`` the most it held;
    ``stats.staging_idle_bytes`` its idle part.

    Pinned allocations cost milliseconds, so buffers are kept for reuse, within a
    limit: NOTE [ Bounded staging ].

    A lease's death only appends to a deque (a weakref finalizer: any thread, inside a
    garbage collection included); the pool's lock is taken by the pool's methods only,
    never by a finalizer, and buffers let go of are dropped after it is released.
    """

    def __init__(self, leaf, stats, idle_limit: int):
        self._leaf = leaf
        self._stats = stats
        self._limit = int(idle_limit)
        self._lock = threading.Lock()
        self._idle = {}                       # size -> {address: buffer}, most recent last
        self._lru = collections.OrderedDict() # address -> size of idle buffers, oldest first
        self._idle_bytes = 0                  # pinned bytes reserved for the idle buffers
        self._back = collections.deque()      # (buffer, size, event box) of dead leases
        self._busy = []                       # given back, their last copy not ended
        self._reserved = {}                   # buffer address -> bytes reserved for it
        self._let_go = 0                      # buffers let go of since the last trim
        self.held = 0                         # pinned bytes of every buffer the pool has

    @property
    def idle_limit(self) -> int:
        """The most bytes (as reserved) the pool keeps idle (NOTE [ Bounded staging ])."""
        return self._limit

    def size_for(self, nbytes: int) -> int:
        return self._leaf.pinned_size(max(1, nbytes))

    def take(self, nbytes: int, *, offset: int = 0, ordered: bool = False):
        """A lease of ``nbytes`` at byte ``offset`` of a page-aligned buffer.

        ``ordered``: the caller writes it with a device copy, queued after the event
        this then returns too (``(lease, event or None)``): a buffer whose last copy is
        still queued may be handed out, the new copy ordered after it on the device
        (rule 4, NOTE [ Device records ]), when no idle one is there."""
        size = self.size_for(offset + nbytes)
        drop, after = [], None
        with self._lock:
            self._collect_locked(drop)
            buf = self._pop_locked(size)
            if buf is None and ordered:
                buf, after = self._pop_busy_locked(size)
        del drop  # outside the lock: letting go of pinned memory costs time
        if buf is None:
            buf = self._allocate(size)
        box = [None, False]  # [the last copy's event, placed back in the pool]
        lease = _Lease(buf[offset:offset + nbytes], box)
        weakref.finalize(lease, self._back.append, (buf, size, box))
        return (lease, after) if ordered else lease

    def ready(self, nbytes: int, *, offset: int = 0, ordered: bool = False) -> bool:
        """Whether :meth:`take` of ``nbytes`` at ``offset`` need not wait for
        :meth:`reserve`: an idle buffer is there (``ordered``: or one whose last copy is
        still queued), or none would be reserved (its class is larger than the idle
        limit: ``take`` allocates)."""
        size = self.size_for(offset + nbytes)
        drop = []
        with self._lock:
            self._collect_locked(drop)
            return bool(self._idle.get(size)) or size > self._limit or (
                ordered and any(item[1] == size and not item[2][1] for item in self._busy))

    def reserve(self, nbytes: int, *, offset: int = 0) -> None:
        """Make sure a buffer for :meth:`take` of ``nbytes`` at ``offset`` is idle,
        allocating it now if not, within the idle limit (NOTE [ Bounded staging ]): the
        I/O thread calls this before it takes the store lock for a request."""
        size = self.size_for(offset + nbytes)
        drop = []
        with self._lock:
            self._collect_locked(drop)
            if self._idle.get(size) or size > self._limit:
                return
        del drop
        buf = self._allocate(size)
        drop = []
        with self._lock:
            self._place_locked(buf, size, drop)

    def idle_bytes(self) -> int:
        drop = []
        with self._lock:
            self._collect_locked(drop)
            return self._idle_bytes

    def busy(self) -> int:
        """Buffers given back whose last copy has not ended yet (tests)."""
        drop = []
        with self._lock:
            self._collect_locked(drop)
            return len(self._busy)

    def trim(self, sync: bool = False) -> None:
        """Collect the buffers given back. With ``sync`` (``wait()``, ``close()``), first
        wait for their last copies, so that they count as idle, not in use, and then give
        what the pool let go of since the last such trim back to the system (NOTE [
        Bounded staging ]: a pinned free may synchronize the device, so not at every
        step). Never under the store lock."""
        if sync:
            with self._lock:
                pending = [item[2][0] for item in list(self._back) + self._busy]
            for event in pending:
                if event is not None:
                    event.synchronize()
        drop = []
        with self._lock:
            self._collect_locked(drop)
            if not sync:
                return
            let_go, self._let_go = self._let_go, 0
        del drop
        if let_go:
            self._leaf.release_cached_pinned()

    def release(self) -> None:
        """Let go of every idle buffer (the store is closing)."""
        drop = []
        with self._lock:
            self._collect_locked(drop)
            while self._lru:
                self._evict_locked(drop)
        del drop
        self.trim(sync=True)

    def _allocate(self, size):
        """A page-aligned pinned buffer of ``size`` bytes (see the class docstring). Its
        reservation is kept in ``_reserved`` (by address) for the books."""
        leaf = self._leaf
        buf = leaf.pinned(size)  # outside the pool's lock: milliseconds
        reserved = size
        if buf.data_ptr() % BLOCK:
            reserved = self.size_for(size + BLOCK)
            buf = leaf.pinned(reserved)
            shift = -buf.data_ptr() % BLOCK
            buf = buf[shift:shift + size]
        with self._lock:
            self._reserved[buf.data_ptr()] = reserved
            self._account(reserved)
        return buf

    def _pop_locked(self, size):
        """The idle buffer of ``size`` that became idle last, or None. It leaves the idle
        set before the books change: an interrupt between can cost the books a buffer's
        bytes, never hand one out twice."""
        idle = self._idle.get(size)
        if not idle:
            return None
        ptr, buf = idle.popitem()
        if not idle:
            del self._idle[size]  # one key per class idle now, not per class ever seen
        self._lru.pop(ptr, None)
        self._idle_account(-self._reserved.get(ptr, size))
        return buf

    def _pop_busy_locked(self, size):
        """``(buffer, event)``: a buffer of ``size`` given back whose last copy (the
        event) has not ended, out of the busy list, or ``(None, None)``. It leaves the
        list before anything else changes; its reservation stays counted (held, not
        idle)."""
        for i, item in enumerate(self._busy):
            buf, sz, box = item
            if sz == size and not box[1]:
                box[1] = True  # never placed idle by a collect an interrupt cut short
                del self._busy[i]
                return buf, box[0]
        return None, None

    def _place_locked(self, buf, size, drop):
        """``buf`` becomes idle, the idle buffers idle longest let go of to make room; a
        buffer larger than the whole limit is let go of at once."""
        ptr = buf.data_ptr()
        reserved = self._reserved.get(ptr, size)
        if reserved > self._limit:
            self._let_go_locked(ptr, buf, drop)
            return
        while self._lru and self._idle_bytes + reserved > self._limit:
            self._evict_locked(drop)
        # Counted before it can be taken (an interrupt between: a buffer counted idle and
        # never reused, as _collect_locked says; never one counted off twice).
        self._idle_account(reserved)
        self._lru[ptr] = size
        self._idle.setdefault(size, {})[ptr] = buf

    def _evict_locked(self, drop):
        """Let go of the buffer idle longest."""
        ptr, size = self._lru.popitem(last=False)
        idle = self._idle.get(size, {})
        buf = idle.pop(ptr, None)
        if not idle:
            self._idle.pop(size, None)
        if buf is not None:
            self._idle_account(-self._reserved.get(ptr, size))
            self._let_go_locked(ptr, buf, drop)

    def _let_go_locked(self, ptr, buf, drop):
        self._account(-self._reserved.pop(ptr, 0))
        self._let_go += 1
        drop.append(buf)  # dropped by the caller once the lock is released

    def _collect_locked(self, drop):
        """Buffers given back become idle (or are let go of) once their last copy ended.

        A KeyboardInterrupt may land between any two calls here (on the training thread:
        a read on a miss): an item may then be seen twice, so each is *placed* at most
        once, its flag set before it is placed. What an interrupt can cost is one buffer,
        never reused (still counted in ``held``), never one handed out twice."""
        back = self._back
        while back:
            self._busy.append(back[0])
            back.popleft()  # an interrupt before this line: the item is seen twice
        if not self._busy:
            return
        busy = []
        for item in self._busy:
            buf, size, box = item
            if box[1]:
                continue  # placed already, by a collect an interrupt cut short
            event = box[0]
            if event is not None and not event.query():
                busy.append(item)
                continue
            box[1] = True
            self._place_locked(buf, size, drop)
        self._busy = busy

    def _account(self, delta):
        self.held += delta
        stats = self._stats
        with _STATS_LOCK:
            stats.staging_bytes += delta
            if stats.staging_bytes > stats.peak_staging_bytes:
                stats.peak_staging_bytes = stats.staging_bytes

    def _idle_account(self, delta):
        self._idle_bytes += delta
        stats = self._stats
        with _STATS_LOCK:
            stats.staging_idle_bytes += delta


# ---------------------------------------------------------------------- transfers
