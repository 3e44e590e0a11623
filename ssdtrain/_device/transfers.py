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

Staging pools and their bound: ``_device/staging.py`` (NOTE [ Bounded staging ]).
"""

from __future__ import annotations

import collections
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from .._align import BLOCK
from .._decision.records import GEOMETRY_ALIGN
from ..io.base import then
from ..io.native import _PolledFuture
from .staging import StagingPool

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
