"""Records of saved storages: their states, I/O, forwarding, prefetch and lifetimes.

One :class:`Record` per saved storage (range); many handles may point at it
(dedup). The store moves records between states::

    PENDING --(tail window full)--> WRITING --(write done)--> ON_DISK --(read)--> LOADING --> LOADED
       |                               | (prefetch pinned it)                                  |
       +--(forward ended)--> KEPT      +----------------------------> LOADED                    |
                                                      ON_DISK <--(every handle unpacked once)---+

A record that holds its bytes in memory (PENDING, WRITING, KEPT, LOADED) is
served without a read ("forwarding"). Memory is released as soon as a write
completes; disk slots when the last handle dies.

Threads: pack runs on the training thread, unpack on autograd's threads, I/O
completions on engine workers. All state lives under one lock, never held
across a wait, and futures are hooked up only after the lock is released (a
future that is already done runs its callback inline).
"""

import collections
import enum
import errno as _errno
import functools
import logging
import mmap
import threading
import time
import weakref
from concurrent.futures import TimeoutError as FutureTimeout

import torch

from . import _checksum
from ._errors import (InplaceModificationError, OffloaderClosedError, SSDTrainError,
                      SpillIOError)
from ._device import is_device_tensor
from ._identity import StorageWeakRef, byte_extent, record_range, storage_key
from ._policy import TRACKER, is_offloadable_kind
from ._spill import BLOCK, align_up
from .io.base import then

__all__ = ["Store", "Record", "State", "Handle", "Kept"]

log = logging.getLogger("ssdtrain")


class State(enum.Enum):
    PENDING = "pending"    # in the tail window; write not started; bytes in memory
    WRITING = "writing"    # write in flight; bytes in memory
    KEPT = "kept"          # forward ended before it was written: stays in memory
    ON_DISK = "on_disk"    # only on disk
    LOADING = "loading"    # read in flight
    LOADED = "loaded"      # in memory again (and still on disk)
    FAILED = "failed"      # a write or read failed; ``error`` says why
    FREED = "freed"        # no handle left


_RESIDENT = (State.PENDING, State.WRITING, State.KEPT, State.LOADED)


class Record:
    """One saved storage range ``[lo, hi)`` and where its bytes are."""

    __slots__ = ("key", "sref", "lo", "hi", "nbytes", "version", "source", "storage", "base",
                 "slot", "future", "state", "seq", "handles", "unseen", "generation", "error",
                 "prefetched", "pinned", "writes", "owner", "crc", "device", "staging", "ready",
                 "produced", "__weakref__")

    def __init__(self, key, sref, lo, hi, version, source, seq):
        self.key, self.sref = key, sref
        self.lo, self.hi, self.nbytes = lo, hi, hi - lo
        self.version = version
        self.source = source            # a detached alias: keeps the bytes alive, shares _version
        self.storage = source.untyped_storage()
        self.base = lo                  # byte of ``storage`` where this record's ``lo`` lies
        self.slot = None
        self.future = None
        self.state = State.PENDING
        self.seq = seq                  # pack order of the latest handle (prefetch order)
        self.handles = 0
        self.unseen = 0                 # live handles not unpacked since the last load
        self.generation = 0             # bumped each time the in-memory copy is dropped
        self.error = None
        self.prefetched = False         # counted in the prefetch window, not yet consumed
        self.pinned = False             # prefetch wants the bytes kept when the write ends
        self.writes = 0
        self.owner = None               # the _Pass that packed it last (prefetch window)
        self.crc = None                 # CRC32C of the bytes written (verify=True)
        self.device = None              # DeviceTransfers of a CUDA record (_device.py)
        self.staging = None             # pinned copy being written (CUDA records)
        self.ready = None               # event: the loaded device copy has landed
        self.produced = None            # event: the saved CUDA tensor is complete (pack)

    def __repr__(self):
        return f"<Record {self.state.value} {self.nbytes} B seq={self.seq}>"


class Handle:
    """What autograd holds instead of a saved tensor: a record and the view to rebuild."""

    __slots__ = ("store", "record", "dtype", "size", "stride", "byte_offset", "version",
                 "tensor_ref", "base_ref", "seen", "__weakref__")

    def __init__(self, store, record, t, version):
        self.store = store
        self.record = record
        self.dtype = t.dtype
        self.size = t.size()
        self.stride = t.stride()
        self.byte_offset = t.storage_offset() * t.element_size()
        self.version = version
        # Version checks at unpack (NOTE in _inplace_error): the saved tensor is often a
        # temporary view; its base, which shares the version counter, usually lives on.
        self.tensor_ref = weakref.ref(t)
        self.base_ref = None if t._base is None else weakref.ref(t._base)
        self.seen = -1                  # generation in which this handle was last unpacked

    def __del__(self):
        store = self.store
        if store is not None:
            store.release(self.record, self.seen)


class ReadBuffers:
    """Page-aligned read destinations, reused within backward.

    A fresh anonymous mapping costs a page fault and a zeroed page per 4 KiB, paid
    in the kernel by the reading thread: on a small machine that is CPU taken from
    compute. A buffer whose storage has died goes back to a free list (by exact
    size: the same layers save the same sizes step after step) and serves the next
    read. Idle buffers are bounded by ``limit`` bytes and dropped when forward
    begins, so they never add to forward's peak.
    """

    def __init__(self, limit):
        self._lock = threading.Lock()
        self._free = collections.defaultdict(list)  # mapping size -> [mmap]
        self._idle = 0
        self._limit = limit

    def storage(self, misalign, nbytes):
        """An uint8 storage of ``nbytes`` whose address is ``misalign`` modulo ``BLOCK``."""
        size = align_up(misalign + nbytes)
        with self._lock:
            free = self._free.get(size)
            mm = free.pop() if free else None
            if mm is not None:
                self._idle -= size
        if mm is None:
            mm = mmap.mmap(-1, size)
        storage = torch.frombuffer(memoryview(mm)[misalign:misalign + nbytes],
                                   dtype=torch.uint8).untyped_storage()
        # Storage objects are preserved while their StorageImpl lives, so this runs
        # when the last view of the loaded bytes is gone.
        weakref.finalize(storage, self._give_back, mm, size)
        return storage

    def _give_back(self, mm, size):
        with self._lock:
            if self._idle + size <= self._limit:
                self._free[size].append(mm)
                self._idle += size
                return
        _unmap(mm)

    def trim(self):
        with self._lock:
            free, self._free, self._idle = self._free, collections.defaultdict(list), 0
        for group in free.values():
            for mm in group:
                _unmap(mm)


def _unmap(mm):
    try:
        mm.close()
    except BufferError:  # still exported by a dying memoryview: the GC unmaps it
        pass


class Kept:
    """A saved tensor passed through in memory, with the version it was saved at.

    Holds a detached alias (no reference cycle through ``grad_fn``) that shares the
    version counter, so in-place writes after saving are caught as autograd would.
    """

    __slots__ = ("tensor", "version")

    def __init__(self, t):
        self.tensor = t.detach()
        self.version = t._version

    def unpack(self):
        t = self.tensor
        if t._version != self.version:
            raise _inplace_error(t, t._version, self.version)
        return t


def _weak_callback(store, method, rec):
    """A future callback that does not keep the store alive (see _release_resources)."""
    ref = weakref.ref(store)

    def callback(fut):
        s = ref()
        if s is not None:
            method(s, rec, fut)
    return callback


class _Pass:
    """One forward under the offloader: the records it saved, for prefetch."""

    __slots__ = ("records", "queue")

    def __init__(self):
        self.records = []
        self.queue = None  # deque of records to prefetch, built when forward ends


class Store:
    """The records of one offloader, and every transition between their states."""

    def __init__(self, config, spill, engine, stats):
        self.cfg = config
        self.spill = spill
        self.engine = engine
        self.stats = stats
        self._lock = threading.Lock()
        self._written = threading.Condition(self._lock)  # notified when a write ends
        self._writing = collections.OrderedDict()  # WRITING records, oldest first
        self._writing_bytes = 0
        self._registry = {}                    # storage key -> [Record]
        self._tail = collections.OrderedDict()  # PENDING records, oldest first
        self._tail_bytes = 0
        self._resident = 0
        self._ahead = 0                        # prefetched bytes not yet consumed
        self._passes = []                      # passes whose prefetch is not finished
        self._current = None                   # the pass being recorded (forward running)
        self._seq = 0
        self._deferred = collections.deque()   # (record, seen) released while the lock was busy
        self._errors = []
        self._live = 0
        self._buffers = ReadBuffers(config.prefetch_bytes)
        self._devices = {}                     # torch.device -> DeviceTransfers
        self._warned = set()                   # warnings already logged (once per store)
        self.layers = None                     # _adaptive.LayerPolicy (Offloader.track)
        self.write_behind = config.write_behind_bytes  # a plan may lower it to fit its budget
        self.closed = False
        # Threads and files go when the store becomes unreachable (the Offloader and
        # every graph holding its handles are gone) or at interpreter exit.
        self._finalizer = weakref.finalize(self, _release_in_background, engine, spill,
                                           self._devices)

    # ------------------------------------------------------------------ forward
    def begin_pass(self):
        with self._lock:
            self._check_open()
            self._drain()
            self._buffers.trim()  # idle read buffers would only add to forward's peak
            self._current = _Pass()

    def end_pass(self):
        """Forward ended: the tail stays in memory; prefetch starts in reverse pack order."""
        attach = []
        with self._lock:
            p, self._current = self._current, None
            if p is None or self.closed:
                return
            for rec in self._tail:
                rec.state = State.KEPT
                self.stats.kept_bytes += rec.nbytes
                # The kept tail is what backward uses first: it fills the window, so
                # kept + prefetched bytes stay within prefetch_bytes (not their sum).
                rec.prefetched = True
                self._ahead += rec.nbytes
            self._tail.clear()
            self._tail_bytes = 0
            todo = {id(r): r for r in p.records if r.state in (State.WRITING, State.ON_DISK)}
            p.queue = collections.deque(sorted(todo.values(), key=lambda r: -r.seq))
            p.records = None
            self._passes = [q for q in self._passes if q.queue] + ([p] if p.queue else [])
            self._pump(attach)
        self._attach(attach)

    def pack(self, t):
        """The saved-tensor pack hook."""
        stats = self.stats
        nbytes = t.numel() * t.element_size()
        stats.packed_bytes += nbytes
        if nbytes < max(1, self.cfg.min_tensor_bytes) or not is_offloadable_kind(t) \
                or (t.requires_grad and t.grad_fn is None):
            stats.kept_bytes += nbytes
            return Kept(t)
        storage = t.untyped_storage()
        key = storage_key(storage)
        if TRACKER.contains(key):
            stats.kept_bytes += nbytes
            return Kept(t)
        version = t._version
        extent = byte_extent(t)
        attach = []
        layers = self.layers
        choice = None if layers is None else layers.choice()  # NOTE [ Applying a plan ]
        with self._lock:
            self._check_open()
            if self._errors:
                raise _copy(self._errors.pop(0))
            self._drain()
            self._seq += 1
            rec = None
            for r in self._registry.get(key, ()):
                if r.version == version and r.lo <= extent[0] and extent[1] <= r.hi \
                        and r.state is not State.FAILED:
                    rec = r
                    break
            if rec is None:
                lo, hi = record_range(extent, storage.nbytes())
                rec = Record(key, StorageWeakRef(storage), lo, hi, version, t.detach(), self._seq)
                if is_device_tensor(t):
                    rec.device = self._transfers(t.device)
                    rec.produced = rec.device.produced()
                self._registry.setdefault(key, []).append(rec)
                self._live += 1
                stats.unique_bytes += rec.nbytes
                self._add_resident(rec.nbytes)
                if layers is not None:
                    layers.attribute(rec.nbytes)
                if choice == "keep":
                    rec.state = State.KEPT
                    stats.kept_bytes += rec.nbytes
                elif choice == "offload":
                    self._start_write(rec, attach)
                else:
                    self._tail[rec] = None
                    self._tail_bytes += rec.nbytes
            else:
                stats.deduplicated_bytes += nbytes
                rec.seq = self._seq
                if rec.state is State.PENDING:
                    self._tail.move_to_end(rec)
            rec.handles += 1
            rec.unseen += 1
            if self._current is not None:
                self._current.records.append(rec)
                rec.owner = self._current
            self._trim_tail(attach)
            handle = Handle(self, rec, t, version)
        self._attach(attach)
        if self._writing_bytes > self.write_behind:
            self._throttle()
        return handle

    def _throttle(self):
        """Wait until the writes in flight fit in ``write_behind_bytes`` (never under the
        lock: the condition releases it while waiting)."""
        limit = self.write_behind
        t0 = time.perf_counter()
        try:
            with self._written:
                while self._writing_bytes > limit and not self.closed:
                    oldest = next(iter(self._writing))
                    if not self._written.wait(timeout=self.cfg.io_timeout_s) \
                            and oldest.state is State.WRITING:
                        raise SpillIOError(
                            f"ssdtrain: writing record {oldest!r} to {oldest.slot.file.name} did "
                            f"not finish within io_timeout_s={self.cfg.io_timeout_s} s; the "
                            f"device may be hung or overloaded.",
                            filename=oldest.slot.file.directory)
                    if self._errors:
                        raise _copy(self._errors.pop(0))
        finally:
            self.stats.write_stall_seconds += time.perf_counter() - t0

    def _trim_tail(self, attach):
        while self._tail_bytes > self.cfg.keep_tail_bytes and self._tail:
            rec, _ = self._tail.popitem(last=False)
            self._tail_bytes -= rec.nbytes
            if not self._over_budget(rec):
                self._start_write(rec, attach)

    def _transfers(self, device):
        dev = self._devices.get(device)
        if dev is None:
            from ._device import DeviceTransfers  # the only import of CUDA code
            dev = self._devices[device] = DeviceTransfers(device, self.engine.device_memory)
        return dev

    def _start_write(self, rec, attach):
        dev, ready = rec.device, None
        if dev is None:
            address = rec.storage.data_ptr() + rec.base
        else:  # NOTE [ Device records ] in _device.py
            address, rec.staging, ready = dev.stage_out(rec.storage, rec.base, rec.nbytes,
                                                        rec.produced)
        rec.slot = self.spill.alloc(rec.nbytes, address % BLOCK)
        rec.state = State.WRITING
        rec.writes += 1
        self._writing[rec] = None
        self._writing_bytes += rec.nbytes
        submit = functools.partial(self._submit_write, rec.slot, address, rec.nbytes,
                                   dev is not None and dev.direct)
        fut = submit() if ready is None else dev.after(ready, submit)
        rec.future = fut
        attach.append((fut, _weak_callback(self, Store._write_done, rec)))

    def _submit_write(self, slot, address, nbytes, on_device):
        if on_device:
            return self.engine.write(slot.file, slot.offset, address, nbytes, device=True)
        fut = self.engine.write(slot.file, slot.offset, address, nbytes)
        if self.cfg.verify:  # the future's result becomes the CRC of what was written
            fut = then(fut, functools.partial(_checksum.crc32c, address, nbytes))
        return fut

    def _write_done(self, rec, fut):
        with self._lock:
            if rec.future is not fut:
                return
            rec.future = None
            rec.staging = None
            if rec in self._writing:
                del self._writing[rec]
                self._writing_bytes -= rec.nbytes
                self._written.notify_all()
            exc = _without_frames(fut.exception())
            if exc is not None:
                if not self._keep_after_failed_write(rec, exc):
                    rec.error = exc
                    rec.state = State.FAILED
                    self._errors.append(exc)
                    log.error("%s", exc)
            elif rec.source._version != rec.version:
                rec.error = _inplace_error(rec.source, rec.source._version, rec.version)
                rec.state = State.FAILED
            else:
                self.stats.offloaded_bytes += rec.nbytes
                self.stats.records_written += 1
                if self.cfg.verify:
                    rec.crc = fut.result()
                rec.source = rec.produced = None
                if rec.pinned and rec.state is State.WRITING:
                    rec.state = State.LOADED  # prefetch reached it before the write ended
                else:
                    rec.state = State.ON_DISK
                    rec.storage = None
                    self._add_resident(-rec.nbytes)
            if rec.handles == 0:
                self._free(rec)

    # ----------------------------------------------------------------- backward
    def unpack(self, handle):
        """The saved-tensor unpack hook."""
        if type(handle) is Kept:
            return handle.unpack()
        rec = handle.record
        for ref in (handle.tensor_ref, handle.base_ref):
            t = None if ref is None else ref()
            if t is not None and t._version != handle.version:
                raise _inplace_error(t, t._version, handle.version)
        attach, view = [], None
        with self._lock:
            if self.closed:
                raise OffloaderClosedError(
                    "ssdtrain: backward needs a tensor saved under an Offloader that has been "
                    "closed; call Offloader.close() only after the last backward of the graphs "
                    "built under it (or keep the Offloader open).")
            self._drain()
            first = handle.seen != rec.generation
            if rec.state is State.FAILED:
                raise _in_context(rec.error, rec)
            if rec.source is not None and rec.source._version != rec.version:
                raise _inplace_error(rec.source, rec.source._version, rec.version)
            if rec.state in _RESIDENT:
                if first and rec.prefetched and rec.state is not State.KEPT:
                    self.stats.prefetch_hits += 1
                else:
                    self.stats.forwarded += 1
                # Used now, under the lock: once it is released, a write that ends
                # drops the bytes from memory (State.ON_DISK).
                view = self._use(rec, handle, attach)
            elif rec.state is State.LOADING:
                self.stats.prefetch_hits += first
            elif rec.state is State.ON_DISK:
                self.stats.prefetch_misses += 1
                self._start_read(rec, attach)
            else:
                raise SSDTrainError(f"ssdtrain: unpacking a record in state {rec.state.value}; "
                                    f"please report this bug.")
            fut = rec.future
        self._attach(attach)
        if view is not None:
            return view
        attach = []
        # LOADING and this handle not yet unpacked in this generation: nothing can drop
        # the bytes between the read's end and their use below.
        self._wait(rec, fut)
        with self._lock:
            self._read_done(rec, fut)
            if rec.state is State.FAILED:
                raise _in_context(rec.error, rec)
            if rec.storage is None:
                raise SSDTrainError(f"ssdtrain: record {rec!r} has no data after its read; "
                                    f"please report this bug.")
            view = self._use(rec, handle, attach)
        self._attach(attach)
        return view

    def _use(self, rec, handle, attach):
        """The unpacked view of a resident record (under the lock)."""
        storage, base = rec.storage, rec.base
        if rec.device is not None:
            rec.device.consume(storage, rec.ready)
        if handle.seen != rec.generation:
            handle.seen = rec.generation
            rec.unseen -= 1
            if rec.prefetched:
                rec.prefetched = False
                self._ahead -= rec.nbytes
        owner = rec.owner
        if owner is not None and owner.queue and self._passes[-1] is not owner \
                and owner in self._passes:
            # Backward of another micro-batch began (e.g. 1F1B): prefetch for it now.
            self._passes.remove(owner)
            self._passes.append(owner)
        view = torch.empty((0,), dtype=handle.dtype).set_(
            storage, (handle.byte_offset - rec.lo + base) // handle.dtype.itemsize,
            handle.size, handle.stride)
        if rec.unseen == 0 and rec.state is State.LOADED:
            self._evict(rec)
        self._pump(attach)
        return view

    def _wait(self, rec, fut):
        t0 = time.perf_counter()
        try:
            # exception(), not result(): raising the request's error here would give it a
            # traceback whose frames hold this handle (see _without_frames).
            fut.exception(timeout=self.cfg.io_timeout_s)
        except FutureTimeout:
            raise SpillIOError(
                f"ssdtrain: reading record {rec!r} from {rec.slot.file.name} at offset "
                f"{rec.slot.offset} did not finish within io_timeout_s={self.cfg.io_timeout_s} s"
                f"{_needed_by()}; the device may be hung or overloaded. Check the device "
                f"(dmesg), or raise io_timeout_s if it is only slow.",
                filename=rec.slot.file.directory) from None
        finally:
            self.stats.stall_seconds += time.perf_counter() - t0

    def _start_read(self, rec, attach):
        misalign, dev, slot = rec.slot.offset % BLOCK, rec.device, rec.slot
        if dev is None:
            storage = self._buffers.storage(misalign, rec.nbytes)
            rec.storage, rec.base = storage, 0
            address = storage.data_ptr()
        else:  # lands in staging (or device memory); the storage is set when it is done
            address, buf = dev.read_buffer(misalign, rec.nbytes)
        self._add_resident(rec.nbytes)
        rec.state = State.LOADING
        if dev is not None and dev.direct:
            fut = self.engine.read(slot.file, slot.offset, address, rec.nbytes, device=True)
        else:
            fut = self.engine.read(slot.file, slot.offset, address, rec.nbytes)
            if self.cfg.verify:
                fut = then(fut, functools.partial(_verify, rec, rec.crc, slot, address, rec.nbytes))
        if dev is not None:
            fut = then(fut, functools.partial(dev.stage_in, buf))
        rec.future = fut
        attach.append((fut, _weak_callback(self, Store._on_read_done, rec)))

    def _on_read_done(self, rec, fut):
        with self._lock:
            self._read_done(rec, fut)

    def _read_done(self, rec, fut):
        """Idempotent: the waiter and the future's callback may both call it."""
        if rec.future is not fut:
            return
        rec.future = None
        exc = _without_frames(fut.exception())
        if exc is not None:
            rec.error = exc
            rec.state = State.FAILED
            rec.storage = None
            self._add_resident(-rec.nbytes)
        else:
            if rec.device is not None:
                rec.storage, rec.base, rec.ready = fut.result()
            rec.state = State.LOADED
            self.stats.bytes_read += rec.nbytes
            self.stats.records_read += 1
        if rec.handles == 0:
            self._free(rec)

    def _evict(self, rec):
        """Every live handle has been unpacked: drop the copy (retain_graph reads again)."""
        rec.state = State.ON_DISK
        rec.storage = rec.ready = None
        rec.generation += 1
        rec.unseen = rec.handles
        self._add_resident(-rec.nbytes)

    # ------------------------------------------------------------------ prefetch
    def _pump(self, attach):
        budget = self.cfg.prefetch_bytes
        while self._passes and self._ahead < budget:
            p = self._passes[-1]
            if not p.queue:
                self._passes.pop()
                continue
            rec = p.queue.popleft()
            if rec.handles == 0 or rec.prefetched:
                continue
            if rec.state is State.WRITING:
                rec.pinned = True
            elif rec.state is State.ON_DISK:
                self._start_read(rec, attach)
            else:
                continue
            rec.prefetched = True
            self._ahead += rec.nbytes

    # ----------------------------------------------------------------- lifetimes
    def release(self, rec, seen):
        """A handle died (autograd freed the graph or this saved tensor)."""
        if self.closed:
            return
        self._deferred.append((rec, seen))
        if self._lock.acquire(blocking=False):
            try:
                self._drain()
            finally:
                self._lock.release()

    def _drain(self):
        while self._deferred:
            rec, seen = self._deferred.popleft()
            if rec.state is State.FREED:
                continue
            rec.handles -= 1
            if seen != rec.generation:
                rec.unseen -= 1
            if rec.handles == 0:
                if rec.state in (State.WRITING, State.LOADING):
                    continue  # freed when the I/O completes
                self._free(rec)
            elif rec.unseen == 0 and rec.state is State.LOADED:
                self._evict(rec)

    def _free(self, rec):
        if rec.state is State.FREED:
            return
        if rec.storage is not None:
            self._add_resident(-rec.nbytes)
        if rec.state is State.PENDING:
            self._tail.pop(rec, None)
            self._tail_bytes -= rec.nbytes
        if rec.prefetched:
            self._ahead -= rec.nbytes
            rec.prefetched = False
        if rec.slot is not None and not self.closed:
            rec.slot.file.free(rec.slot)
        rec.slot = None
        rec.storage = rec.source = rec.staging = rec.ready = rec.produced = None
        rec.state = State.FREED
        self._live -= 1
        group = self._registry.get(rec.key)
        if group is not None:
            group.remove(rec)
            if not group:
                del self._registry[rec.key]

    def _add_resident(self, delta):
        self._resident += delta
        if self._resident > self.stats.peak_resident_bytes:
            self.stats.peak_resident_bytes = self._resident

    # -------------------------------------------------------------------- misc
    def _attach(self, attach):
        for fut, callback in attach:
            fut.add_done_callback(callback)

    def _check_open(self):
        if self.closed:
            raise OffloaderClosedError("ssdtrain: this Offloader has been closed; create a new "
                                       "one (ssdtrain.offload(...)) to offload again.")

    def raise_pending_error(self):
        with self._lock:
            if self._errors:
                raise _copy(self._errors.pop(0))

    def snapshot(self):
        """(live records, resident bytes, spill bytes in use) for stats and tests."""
        with self._lock:
            self._drain()
            return self._live, self._resident, self.spill.used_bytes()

    def flush(self):
        """Wait until every write and read in flight has completed."""
        while True:
            with self._lock:
                self._drain()
                futs = [(r, r.future, r.slot) for group in self._registry.values()
                        for r in group if r.future is not None]
            if not futs:
                return
            for rec, f, slot in futs:
                try:
                    f.exception(timeout=self.cfg.io_timeout_s)  # errors: on their records
                except FutureTimeout:
                    where = "?" if slot is None else f"{slot.file.name} at offset {slot.offset}"
                    raise SpillIOError(
                        f"ssdtrain: I/O of record {rec!r} ({where}) did not finish within "
                        f"io_timeout_s={self.cfg.io_timeout_s} s while waiting for I/O in flight "
                        f"(wait() or close()); the device may be hung or overloaded.",
                        filename=None if slot is None else slot.file.directory) from None
            time.sleep(0)  # let completion callbacks run

    def close(self):
        if self.closed:
            return
        try:
            self.flush()
        finally:
            with self._lock:
                self.closed = True
                for group in self._registry.values():
                    for rec in group:
                        rec.storage = rec.source = rec.staging = rec.ready = rec.produced = None
                        rec.slot = None
                self._registry.clear()
                self._tail.clear()
                self._writing.clear()
                self._writing_bytes = 0
                self._written.notify_all()
                self._passes.clear()
                self._resident = 0
            self._buffers.trim()  # idle read buffers are memory too: not kept until GC
            if self._finalizer.detach() is not None:
                _release_resources(self.engine, self.spill, self._devices)

    # ------------------------------------------------ spill errors and budget
    # (issue 6: on_spill_error, max_spill_bytes / on_spill_full; called under the lock)
    def _keep_after_failed_write(self, rec, exc):
        """``on_spill_error="keep"``: a record whose write failed stays in memory."""
        if self.cfg.on_spill_error != "keep" or not isinstance(exc, SpillIOError) \
                or rec.storage is None:
            return False
        if rec.slot is not None and not self.closed:
            rec.slot.file.free(rec.slot)
        rec.slot = None
        rec.state = State.KEPT
        self.stats.spill_errors += 1
        self.stats.kept_bytes += rec.nbytes
        self._warn_once("write", "ssdtrain: a spill write failed (%s); on_spill_error='keep' "
                        "keeps such records in memory, so memory use grows until the device is "
                        "fixed. Further failures are counted in Stats.spill_errors.", exc)
        return True

    def _over_budget(self, rec):
        """``max_spill_bytes``: keep ``rec`` in memory (or queue the error) if writing it
        would take the spill slots in use beyond the budget. Returns whether it did."""
        limit = self.cfg.max_spill_bytes
        if limit is None:
            return False
        misalign = 0 if rec.device is not None else (rec.storage.data_ptr() + rec.base) % BLOCK
        need = max(BLOCK, align_up(misalign + rec.nbytes))
        used = self.spill.used_bytes()
        if used + need <= limit:
            return False
        rec.state = State.KEPT
        self.stats.over_budget_bytes += rec.nbytes
        self.stats.kept_bytes += rec.nbytes
        if self.cfg.on_spill_full == "raise":
            self._errors.append(SpillIOError(
                f"ssdtrain: writing record {rec!r} ({need} bytes of slots) would take the spill "
                f"files beyond max_spill_bytes={limit} ({used} bytes in use); "
                f"on_spill_full='raise' stops here. Raise max_spill_bytes, offload less "
                f"(min_tensor_bytes, keep_tail_bytes), or set on_spill_full='keep' to keep such "
                f"records in memory.", errno=_errno.ENOSPC,
                filename=self.spill.files[0].directory))
        else:
            self._warn_once("budget", "ssdtrain: max_spill_bytes=%d reached (%d bytes in use); "
                            "records beyond it stay in memory (Stats.over_budget_bytes).",
                            limit, used)
        return True

    def _warn_once(self, what, msg, *args):
        if what not in self._warned:
            self._warned.add(what)
            log.warning(msg, *args)


def _release_resources(engine, spill, devices):
    try:
        for dev in list(devices.values()):
            dev.close()  # writes waiting for a device copy are submitted first
        engine.shutdown()  # waits for requests still queued: they use the files
    finally:
        spill.close()


def _release_in_background(engine, spill, devices):
    # A garbage-collected store must not block whatever thread dropped it (it may even
    # be an engine worker, which cannot join itself).
    if not threading.main_thread().is_alive():
        # Interpreter exit (atexit runs after threading's shutdown stopped the main
        # thread): a thread started now would not be waited for, and finalization
        # would end it inside the native engine's join (std::terminate, exit code
        # 134). Release here, in order: nothing else runs any more.
        _release_resources(engine, spill, devices)
        return
    threading.Thread(target=_release_resources, args=(engine, spill, devices),
                     name="ssdtrain-release").start()


def _verify(rec, expected, slot, address, nbytes):
    observed = _checksum.crc32c(address, nbytes)
    if observed != expected:
        raise _checksum.mismatch(f"record {rec!r}", f"{slot.file.name} at offset {slot.offset}",
                                 expected, observed)


def _needed_by():
    """`` (needed by <Node>)`` naming the autograd node running backward, if any."""
    node = torch._C._current_autograd_node()
    return "" if node is None else f" (needed by {node.name()} in backward)"


def _in_context(err, rec):
    """``err`` again, its message naming the record and the backward op that needed it."""
    return _copy(err, f" [record {rec!r}{_needed_by()}]")


def _without_frames(exc):
    """``exc`` with no traceback. An error raised while a request completed inline (on the
    training thread, in pack) has frames that link back to forward's, which hold the
    graph, whose handles hold the record that keeps the error: a leak."""
    if exc is not None:
        exc.__traceback__ = None
        exc.__context__ = None
    return exc


def _copy(err, note=""):
    """A new exception like ``err`` (message + ``note``) to raise in its place.

    The error kept on a record (and in the pending list) is never raised itself: a raised
    exception's traceback holds the frames of forward or backward, and through them the
    graph whose handles keep that very record alive (a cycle through the store, which
    ``gc`` cannot break while the store lives)."""
    if not isinstance(err, SSDTrainError):
        return err
    if isinstance(err, SpillIOError):
        return SpillIOError(str(err) + note, errno=err.errno, filename=err.filename)
    try:
        return type(err)(str(err) + note)
    except TypeError:
        return err


def _inplace_error(t, now, expected):
    return InplaceModificationError(
        f"ssdtrain: one of the variables needed for gradient computation has been modified by "
        f"an inplace operation: [{t.type()} {list(t.size())}] is at version {now}; expected "
        f"version {expected} instead. Autograd does not check this while saved-tensor hooks are "
        f"installed, so ssdtrain does. Hint: avoid the in-place operation, or clone the tensor "
        f"before modifying it.")
