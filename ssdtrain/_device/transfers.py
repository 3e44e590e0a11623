"""The device path: records whose storage lives in accelerator memory.

The ordering rules (NOTE [ Device records ]) are written once, here, against a *leaf*:
the module that knows one kind of accelerator (its streams, events, allocator and
copies). ``_device/cuda.py`` is the CUDA leaf; ``testing/loopback.py`` is a stand-in accelerator
made of host memory and threads, which runs this same code in CI, where no GPU is
(tests/test_loopback*.py). The store asks :func:`leaf_of` which leaf a saved tensor
belongs to, and gets a :class:`DeviceTransfers` per device.

NOTE [ Device records ]
=======================

A record whose storage lives on a device moves like a host record (the same states,
slots and engines), with these extra rules. Each has a test on the loopback device
that a deliberate break of the rule fails (tests/test_loopback_rules.py).

1. **Writes start after the producer.** The saved tensor may still be being
   computed when pack runs (kernels are asynchronous). Pack records an event on the
   current stream (:meth:`DeviceTransfers.produced`) *when the record is created*,
   not when its write starts: the write may start later (the record waits in the
   kept tail) from another pack, maybe on another stream. The offload stream waits
   for that event, then copies device -> pinned staging (with a GPUDirect engine,
   the event itself is what the write waits for).
2. **The disk write starts after the copy.** A single "ssdtrain-d2h" thread waits
   for the copy's event and only then submits the disk write: forward never
   synchronizes with the device.
3. **The block is not reused before the copy ends.** The record holds the saved
   tensor (``Record.source``) until the disk write has completed, and the write
   starts only after the copy's event: when that reference drops, the copy is long
   done, so the allocator may reuse the block at once. No ``record_stream`` is
   needed on this side.
4. **Staging is not reused before its copy ends.** Pinned staging comes from a
   :class:`StagingPool`: a buffer goes back to the pool when its holder drops it,
   and is handed out again only once the copy that used it last has completed (an
   event kept with it), or, to a device copy (``take(ordered=True)``), before that,
   the new copy's stream first waiting on the event (NOTE [ Copies the hooks start ]).
5. **Loads are allocated for the consumer.** A read lands in pinned staging and is
   copied host -> device on the prefetch stream into memory allocated *on the
   compute stream* (the stream the hooks last ran on), so that stream reuses the
   block once backward is done with it (a block allocated on the prefetch stream
   would only ever be reused by later loads: reserved memory grew by the prefetch
   window). The allocator may hand out a block that the compute stream's queued
   kernels still read, so the prefetch stream first waits for the compute stream
   (``wait_stream``), and the block is marked used by the prefetch stream
   (``record_stream``) so that it is not reused before the copy ends even if the
   record is dropped first.
6. **Loads keep the saved tensor's alignment.** The load sits at the saved
   tensor's device address modulo 512 (:func:`device_misalign`), not the staging
   buffer's: kernels that pick code paths by alignment (cuBLAS) see the same
   alignment and give the same bits. Every path back keeps it: a read from the SSD
   and a copy back from the host tier (HOSTED, or SPILLING claimed while its
   eviction write runs) land at that misalignment; a record claimed while its copy
   to RAM or its write runs (HOSTING, WRITING) is served from the saved memory
   itself (tests/test_load_paths.py forces each path). Exact for storages whose own
   address is 16-byte aligned (every allocator's); one made over memory at an odd
   address (``torch.frombuffer``, DLPack) comes back at another address modulo 16
   (NOTE [ View geometry ] in _decision/records.py).
7. **Loads are consumed after they land.** An event marks the copy's end. Unpack
   makes the consumer stream (the current stream of the unpacking thread) wait on
   it (a record served from memory, never loaded: on its producer's event) and calls
   ``record_stream`` for it, so that a consumer other than the compute stream keeps
   the block from reuse while it still reads it (pytorch/pytorch#106360).
8. **No device work inside a graph capture.** Pack on a stream that is capturing a
   CUDA graph keeps the tensor in memory (``PassThrough``): recording an event, or
   allocating pinned memory on the I/O thread, is not allowed in a capture.

Writes and prefetch reads are started by the store's I/O thread (NOTE [ The store's
I/O thread ] in _store/store.py), whose current device is not the record's: the functions
it calls (:meth:`DeviceTransfers.stage_out`, :meth:`DeviceTransfers.read_buffer`)
enter the record's device themselves, and use streams and events they were given,
never the thread's current stream. Before taking the store lock the I/O thread
makes sure the staging pool has a buffer for the next write (:meth:`StagingPool.
reserve`), so that a pinned allocation (milliseconds) rarely runs under the lock.

In-place modification is checked when the write ends, after the copy's event: an
in-place op called before the check bumped the version already (the record fails
with autograd's message); one called after it runs after the copy on the device.
A storage resized or replaced after pack is checked before any staging: the record
fails with that error. Events that a host thread waits on are created blocking, so
the waiter sleeps instead of spinning on a core that compute needs.

Not handled: while another thread captures a CUDA graph in the global mode, the
store's I/O thread may still wait on events or allocate pinned memory for records
saved outside the capture; an out-of-memory error while allocating a loaded
record's device memory fails that record (its backward raises) instead of retrying
later; GPUDirect reads still land in memory allocated on the prefetch stream.

NOTE [ Copies the hooks start ]
===============================

On a GPU host the thread that runs the hooks launches every kernel, and every other
thread of ssdtrain's that runs Python per record takes the GIL from it: the first
traces on an H200 (docs/results/gpu_trace_2026-11-28.md) showed the store's I/O thread
and the copy waiter ("ssdtrain-d2h") each running a record's Python (a copy's start,
its wait, its settlement, the inbox) while forward launched. With the Offloader's
(polled) native engine (NOTE [ The data path on the hooks' thread ] in _store/store.py), a
device record admitted to the host tier is now copied to RAM and back by the hooks'
own stream work, and no other thread runs Python for it:

* **Start.** The pack that decides the record starts its copy (``WritePath.
  start_due_locked(inline=True)``), when the staging pool can hand out a buffer with no
  allocation (``StagingPool.ready(ordered=True)``): an idle one, or one whose last copy
  (a load back to the device, say) is still queued, the new copy then queued after it on
  the device (``take(ordered=True)``: the d2h stream waits for that copy's event; rule
  4 without a host wait). Else the I/O thread starts it, as before: a pinned allocation
  takes milliseconds, never on the hooks' thread.
* **Settle.** Its future (:meth:`DeviceTransfers.polled`, a ``_PolledFuture``) is
  settled by a poll of its event (:meth:`DeviceTransfers.poll`, one stream: they end in
  order), which every locked region of the store runs first on any thread but the I/O
  thread (``Store._drain_locked``): the hooks, the end of forward and of backward,
  ``wait()``; the step's begin too, before ``policy="auto"`` reads what is still in
  flight. A waiter polls while it waits (``EngineSlot.wait`` (_store/engine.py), ``_CopyFuture.wait``); a
  copy's memory (the saved tensor, the lease) is held from before the copy is queued
  until a poll has seen it end (NOTE [ Memory owned by requests ] in _store/store.py), and
  ``close()`` waits for each one left. A poll can be cut short anywhere (an interrupt):
  each copy is then unsettled, or settled and still queued (the next poll pops it), and
  the lock is reentrant so that a future's callback may poll again
  (tests/test_hosttier.py sweeps every line with the native engine).
* **Load.** Prefetch's copy back from RAM (``ReadPath.pump_locked(inline=True)``, a
  HOSTED record) is stream work and a device allocation on the caching allocator, no
  pinned one: unpack issues it itself.
* **Release.** Memory the settled copies dropped goes back on the thread that settled
  them (``Store._after_hook``, ``Store._settle``), so the next step's first copies find
  the buffers back in the pool rather than waiting for the I/O thread to let go of them.

tests/test_hooks_thread.py watches every thread with a profile function: after warm-up,
no function that runs per record (start, wait, settle, load, use) runs on any thread
but the hooks' own, for static steps and the default's at pinned quotas. Left to the I/O
thread: records on their way to the SSD (staging, the waiter, evictions), and a copy to
RAM whose pool has no buffer of its class (then it allocates one, and the pool keeps it).

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
import time
import weakref
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from .._align import BLOCK
from .._decision.records import GEOMETRY_ALIGN
from ..io.base import then
from ..io.native import _PolledFuture

__all__ = ["DeviceTransfers", "StagingPool", "GDS_PROBE_MEMORY", "leaf_of", "device_misalign",
           "ALIGN"]

# Device buffers keep a record's address modulo this (cuBLAS and friends choose
# kernels by alignment up to 256 bytes; the caching allocator hands out 512).
ALIGN = 512

_cuda = None  # the CUDA leaf, imported on the first CUDA tensor


def leaf_of(t: torch.Tensor, loopback=None):
    """The leaf that owns ``t``'s memory, or None (a host record).

    ``loopback`` is a :class:`ssdtrain.testing.loopback.LoopbackDevice` attached to the store
    (tests only); without one a CPU tensor is always a host record."""
    global _cuda
    if t.is_cuda:
        if _cuda is None:
            from . import cuda as leaf  # the only import of CUDA code
            _cuda = leaf.LEAF
        return _cuda
    if loopback is not None and loopback.owns(t):
        return loopback
    return None


def device_misalign(ptr: int, lo: int) -> int:
    """Where a record's first byte lies modulo :data:`ALIGN` in device memory, for a
    storage at address ``ptr`` whose record starts at byte ``lo`` (rule 6). Always
    congruent to ``lo`` modulo 16, so that every view can be rebuilt on the load
    (NOTE [ View geometry ] in _decision/records.py)."""
    return (ptr - ptr % GEOMETRY_ALIGN + lo) % ALIGN


def _bytes_view(leaf, storage, base: int, nbytes: int, device) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=leaf.torch_device(device)).set_(
        storage, base, (nbytes,), (1,))


# ------------------------------------------------------------------------ staging
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
class DeviceTransfers:
    """Streams, events and staging for the records of one device.

    Args:
        leaf: the device's leaf module object (``_cuda.LEAF`` or a loopback device).
        device: the device, as the leaf names it (a ``torch.device`` for CUDA).
        direct: the engine takes device addresses (GPUDirect Storage): no staging.
        pool: the :class:`StagingPool` its staging comes from.
    """

    def __init__(self, leaf, device, direct: bool, pool: StagingPool):
        self.leaf = leaf
        self.device = device
        self.direct = direct
        self.pool = pool
        self.d2h = leaf.new_stream(device)
        self.h2d = leaf.new_stream(device)
        # The stream the hooks last ran on: loads are allocated for it (rule 5).
        self.compute = leaf.current_stream(device)
        # One thread: waits for copies to end, then submits the disk write.
        self._waiter = ThreadPoolExecutor(1, thread_name_prefix="ssdtrain-d2h")
        # Copies to the host tier started by the hooks: (event, future, held), in the
        # d2h stream's order (NOTE [ Copies the hooks start ]).
        self.landing = collections.deque()
        self._poll_lock = threading.RLock()

    # ------------------------------------------------------------------ writes
    def produced(self):
        """An event on the current stream: the saved tensor is complete once it has
        run. Called by pack when it creates the record (rule 1)."""
        leaf = self.leaf
        stream = leaf.current_stream(self.device)
        self.compute = stream
        event = leaf.new_event()
        event.record(stream)
        return event

    def stage_out(self, storage, base: int, nbytes: int, produced):
        """Start moving ``nbytes`` at byte ``base`` of a device storage towards the disk.

        Args:
            produced: the record's :meth:`produced` event, taken at pack.

        Returns ``(address, keepalive, event)``: the address the engine writes from
        (pinned staging, or the device memory itself when ``direct``), an object to
        hold until the write ends, and the event to wait for before writing.
        """
        if self.direct:
            return storage.data_ptr() + base, None, produced
        # The store's I/O thread calls this: its current device is not the record's
        # (a pinned allocation there would create a context on device 0): to_host
        # enters the record's device.
        lease, done = self.to_host(storage, base, nbytes, produced)
        return lease.view.data_ptr(), lease, done

    def to_host(self, storage, base: int, nbytes: int, produced):
        """Queue a copy of ``nbytes`` at byte ``base`` of a device storage into pinned
        memory of the pool, for the host tier (NOTE [ Host tier ] in _store/hosttier.py):
        ``(lease, event)``, the copy done once the event has completed (rules 1, 4).
        A GPUDirect engine changes nothing here: the host tier is host memory."""
        leaf = self.leaf
        src = _bytes_view(leaf, storage, base, nbytes, self.device)
        with leaf.entered(self.device):
            lease, last = self.pool.take(nbytes, ordered=True)
            if last is not None:  # the buffer's last copy, still queued (rule 4)
                self.d2h.wait_event(last)
            self.d2h.wait_event(produced)                     # rule 1
            with leaf.using(self.d2h):
                leaf.copy(lease.view, src)
            done = leaf.new_event()
            done.record(self.d2h)
            lease.after(done)                                 # rule 4
        return lease, done

    def polled(self, event, owner) -> Future:
        """A future that a poll (:meth:`poll`) settles once ``event`` (a copy queued on the
        d2h stream) has completed; ``owner`` (what the copy uses) is held until then
        (NOTE [ Copies the hooks start ])."""
        fut = _CopyFuture(self)
        self.landing.append((event, fut, [owner]))
        return fut

    def poll(self) -> int:
        """Settle the futures of :meth:`polled` copies that have ended, oldest first (one
        stream: they end in order); how many. Polls take turns (a reentrant lock: a
        future's callback may poll again on the same thread, and pops what it settles).
        An interrupt anywhere leaves every copy either unsettled or settled and still
        queued, which the next poll pops: none is settled twice or dropped unsettled,
        and no flag is left set."""
        landing, n = self.landing, 0
        if not landing:
            return 0
        with self._poll_lock:
            while landing:
                item = landing[0]
                event, fut, held = item
                if not fut.done():
                    if not event.query():
                        break
                    fut.set_result(None)
                    n += 1
                if landing and landing[0] is item:  # not popped by a poll inside
                    landing.popleft()
                held.clear()
        return n

    def settle(self, fut, timeout=None) -> None:
        """Wait until the :meth:`polled` future ``fut`` is done, ``timeout`` seconds at
        most (None: no limit), polling; sleeps (without the GIL) between polls."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not fut.done():
            self.poll()
            if fut.done() or (deadline is not None and time.monotonic() >= deadline):
                return
            time.sleep(_POLL_SLEEP_S)

    def after(self, event, submit, owner=None) -> Future:
        """``submit()`` (which returns a future) once ``event`` has completed, on the
        waiter thread; the returned future completes with that future's outcome (rule 2).
        ``owner`` (what the copy and the request use) is bound into what is queued, from
        the wait's work item on, and let go of once ``submit`` has handed it to the
        engine (NOTE [ Requests own their memory ] in io/base.py): an interrupt between
        the two queues loses nothing the copy or the request can touch."""
        held = [owner]
        ready = self._waiter.submit(_synchronize, event, held)  # releases the GIL while it waits
        return then(ready, submit, owner)

    # ------------------------------------------------------------------- probe
    def time_copies(self, nbytes: int, repeats: int):
        """The best of ``repeats`` times, in seconds, to copy ``nbytes`` from device memory
        to pinned staging on the offload stream and back on the prefetch stream:
        ``(d2h_s, h2d_s)``, the host tier's bandwidths for ``policy="auto"`` (NOTE [ The
        offload quota ] in _policies/auto.py). Each copy waits for its stream's earlier work first
        and is waited for: call it between steps (the offloader does, in ``__enter__``)."""
        leaf = self.leaf
        best = [float("inf"), float("inf")]
        with leaf.entered(self.device):
            with leaf.using(self.compute):
                dev = leaf.empty(nbytes, self.device)
            lease = self.pool.take(nbytes)
            try:
                for _ in range(repeats):
                    for i, (stream, dst, src) in enumerate(((self.d2h, lease.view, dev),
                                                            (self.h2d, dev, lease.view))):
                        stream.wait_stream(self.compute)   # dev may still be written there
                        stream.synchronize()
                        t0 = time.perf_counter()
                        with leaf.using(stream):
                            leaf.copy(dst, src)
                        done = leaf.new_event()
                        done.record(stream)
                        done.synchronize()
                        best[i] = min(best[i], time.perf_counter() - t0)
            finally:
                # Rules 4 and 5 the simple way: no copy of this probe is still queued
                # when its staging and device memory go back (an interrupt included).
                self.d2h.synchronize()
                self.h2d.synchronize()
        return best[0], best[1]

    # ------------------------------------------------------------------- reads
    def read_buffer(self, misalign: int, nbytes: int):
        """Where a read lands: ``(address, keepalive)``, ``address % BLOCK == misalign``.

        Pinned host staging (a :class:`_Lease`), or (``direct``) device memory
        allocated on the prefetch stream (the tensor); pass ``keepalive`` to
        :meth:`stage_in`.
        """
        leaf = self.leaf
        if self.direct:
            with leaf.entered(self.device), leaf.using(self.h2d):
                buf = leaf.empty(nbytes + BLOCK, self.device)
            # Same offset in a block as the slot: O_DIRECT moves the middle without
            # bouncing, and the device copy keeps the saved tensor's alignment.
            shift = (misalign - buf.data_ptr()) % BLOCK
            view = buf[shift:shift + nbytes]
            return view.data_ptr(), view
        with leaf.entered(self.device):  # on the store's I/O thread too (see stage_out)
            # Staging is page-aligned: the slot's misalignment is the offset in it.
            lease = self.pool.take(nbytes, offset=misalign)
        return lease.view.data_ptr(), lease

    def stage_in(self, buf, misalign: int):
        """After the read into ``buf`` ended: ``(device storage, byte offset, event or
        None)``; the record's bytes start at that offset, at ``misalign`` modulo
        :data:`ALIGN` (rule 6). Runs where the read's future is settled: on the engine
        thread that finished the read, or, with a polled engine, on the thread that polls
        it, in the store's locked region (NOTE [ Polled completions ] in io/base.py).

        Staged data is copied to device memory allocated for the compute stream (rule
        5); the event marks the copy's end (rule 7).
        """
        if self.direct:
            return buf.untyped_storage(), buf.storage_offset(), None
        return self.from_host(buf, misalign)

    def from_host(self, lease, misalign: int):
        """Queue a copy of pinned ``lease.view`` into device memory allocated for the
        compute stream (rule 5), at ``misalign`` modulo :data:`ALIGN` (rule 6):
        ``(device storage, byte offset, event)``, the event marking the copy's end (rule
        7). Staged reads end here, and loads from the host tier (NOTE [ Host tier ])."""
        leaf = self.leaf
        src = lease.view
        nbytes = src.numel()
        with leaf.entered(self.device):
            compute = self.compute
            with leaf.using(compute):
                dst = leaf.empty(nbytes + misalign, self.device)
            shift = (misalign - dst.data_ptr()) % ALIGN
            if shift + nbytes > dst.numel():  # an allocator whose blocks are not aligned
                with leaf.using(compute):
                    dst = leaf.empty(nbytes + ALIGN, self.device)
                shift = (misalign - dst.data_ptr()) % ALIGN
            self.h2d.wait_stream(compute)       # the block may still be read there (rule 5)
            with leaf.using(self.h2d):
                leaf.copy(dst[shift:shift + nbytes], src)
            ready = leaf.new_event()
            ready.record(self.h2d)
            leaf.record_stream(dst, self.h2d)   # not reused before the copy ends (rule 5)
            lease.after(ready)                  # the staging, likewise (rule 4)
        return dst.untyped_storage(), shift, ready

    def consume(self, storage, ready) -> None:
        """Make the current stream wait for a load and keep its block from early reuse
        (rule 7). Called by unpack, under the store lock."""
        leaf = self.leaf
        consumer = leaf.current_stream(self.device)
        self.compute = consumer
        if ready is not None:
            consumer.wait_event(ready)
        leaf.record_stream(_bytes_view(leaf, storage, 0, storage.nbytes(), self.device),
                           consumer)

    def close(self) -> None:
        self._waiter.shutdown(wait=True)  # writes waiting for a copy are submitted first
        while self.landing:  # copies the hooks started: settled once they have ended
            event = self.landing[0][0]
            event.synchronize()
            self.poll()
        self.pool.release()


_POLL_SLEEP_S = 0.0002  # a waiter's sleep between polls of a copy's event


class _CopyFuture(_PolledFuture):
    """The future of a copy the hooks started (:meth:`DeviceTransfers.polled`): settled
    by a poll, as a polled engine's request is (``result()`` and ``exception()`` poll)."""

    def wait(self, timeout) -> None:
        """Poll until done, ``timeout`` seconds at most, sleeping between polls
        (``EngineSlot.wait`` (_store/engine.py))."""
        self._settle(timeout)


def _synchronize(event, held):
    """The waiter thread's wait (:meth:`DeviceTransfers.after`): the copy has ended once
    ``event`` has, so what ``held`` keeps for it is let go of."""
    try:
        event.synchronize()
    finally:
        held.clear()


# ------------------------------------------------------------------ the device map
class DeviceMap:
    """A store's devices: the :class:`DeviceTransfers` of each ``(leaf, device)`` its
    saved tensors came from, made at the first record of each, and their staging pools,
    one per leaf. The store makes records' transfers here (under its lock), the I/O
    thread reserves staging and, when the store ends, closes them (``close()``), and
    the store's probe (``_store/probe.py``) copies through them and asks the devices for
    their free memory.

    Args:
        stats: the store's ``Stats`` (the pools count their pinned bytes there).
        idle_bytes: the idle staging a pool keeps for reuse: what may be in flight at
            once, and the host tier's records (NOTE [ Host tier ] in _store/hosttier.py).
        engine: the engine requests go to; its ``capabilities.device_memory`` says
            whether transfers need staging. ``Store.engine``'s setter sets it.
    """

    def __init__(self, stats, idle_bytes: int, engine):
        self.transfers = {}   # (leaf, device) -> DeviceTransfers
        self.staging = {}     # leaf -> StagingPool (NOTE [ Device records ])
        # (leaf, device) of the first device tensor passed through without a record
        # (the quota spent: NOTE [ The pack decision ] in _decision/policy.py): a list that pack
        # appends to once, so its check costs what an attribute's did.
        self.passed = []
        self.engine = engine
        self._stats = stats
        self._idle_bytes = idle_bytes

    def get(self, leaf, device) -> DeviceTransfers:
        """The transfers of ``device`` (made at its first record)."""
        dev = self.transfers.get((leaf, device))
        if dev is None:
            pool = self.staging.get(leaf)
            if pool is None:
                pool = self.staging[leaf] = StagingPool(leaf, self._stats, self._idle_bytes)
            dev = self.transfers[(leaf, device)] = DeviceTransfers(
                leaf, device, self.engine.capabilities.device_memory, pool)
        return dev

    def seen(self) -> list:
        """The ``(leaf, device)`` pairs the store has seen a saved tensor of: those with
        records, else the one passed through without a record, else none."""
        return list(self.transfers) or list(self.passed[:1])

    def poll(self) -> None:
        """Every device's :meth:`DeviceTransfers.poll` (the store's locked regions call it
        first: NOTE [ Copies the hooks start ])."""
        for dev in list(self.transfers.values()):
            if dev.landing:
                dev.poll()

    def trim(self, sync: bool = False) -> None:
        """Every staging pool's :meth:`StagingPool.trim` (NOTE [ Bounded staging ]): at
        ``wait()`` (``sync``) and at each step's start, outside the store lock."""
        for pool in list(self.staging.values()):
            pool.trim(sync)

    def close(self) -> None:
        """Close every device's transfers (writes waiting for a device copy are
        submitted first) and release their staging."""
        for dev in list(self.transfers.values()):
            dev.close()


def __getattr__(name):
    # The GPUDirect Storage probe's device memory lives in the CUDA leaf; api.py and
    # _config.py import it from here.
    if name == "GDS_PROBE_MEMORY":
        from .cuda import GDS_PROBE_MEMORY
        return GDS_PROBE_MEMORY
    raise AttributeError(name)
