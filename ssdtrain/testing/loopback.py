"""The loopback device: a stand-in accelerator that runs the store's device path in CI.

CI has no GPU, so the device path (NOTE [ Device records ] in _device/transfers.py) would never
run there. A :class:`LoopbackDevice` is a leaf of ``_device/transfers.py`` like the CUDA one
(``_device/cuda.py``), so the store runs the very same code for it; only what a stream, an
event, an allocation and a copy are differs:

* **Streams** run their work in order, asynchronously, each on a thread of its own
  (started when work arrives, ended when idle). The *default stream* is the host
  itself: torch's CPU kernels run at once on the calling thread, so work "launched"
  on it runs inline, and making it wait for an event blocks the caller.
* **Events** are marks in a stream's sequence of work: complete once the stream has
  run everything queued before the mark. A recorded event is a number, so taking
  one never takes a lock.
* **Device memory** comes from a caching allocator of its own: blocks of host memory
  (anonymous mappings, never unmapped while the device lives) rounded to 512 bytes,
  accounted against ``capacity`` (``torch.OutOfMemoryError`` beyond it), kept per
  stream and size when freed and handed out again *at once* to the next allocation
  on the same stream, as CUDA's caching allocator does. ``record_stream`` delays that
  reuse until the other streams' work queued at the free has run. A new block and a
  reused one are filled with ``0xff`` bytes (NaN for floats) by work on the
  allocating stream, so that reading memory before a copy lands reads garbage,
  deterministically.
* **Copies** are memcpys run by the stream, after an injectable delay and at an
  optional rate (bytes/s): ``d2h_delay`` for device -> pinned copies, ``h2d_delay``
  for pinned -> device ones. A copy reads its source when it runs, not when it was
  queued, and holds no reference to device memory (as on a GPU): a block freed and
  reused meanwhile is read as it is then.
* **Kernels** of a test: :meth:`LoopbackDevice.kernel` queues a Python function on the
  current stream after a delay (a slow producer, a slow consumer).
* **Graph capture**: inside :meth:`LoopbackDevice.capture` the capturing stream refuses
  events, and pinned allocations are refused everywhere (CUDA's global capture mode).

Which tensors live on it: those it allocated (:meth:`LoopbackDevice.empty`, loads of
the store), and with ``claim_host_tensors=True`` every CPU tensor a store it is
attached to saves (a whole CPU model then takes the device path). It is attached to
one offloader at a time with :func:`attach`; nothing changes for CPU tensors
otherwise. For tests only: nothing in ssdtrain's public API creates one.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import itertools
import mmap
import queue
import threading
import time
import weakref

import torch

__all__ = ["LoopbackDevice", "LoopbackStream", "LoopbackEvent", "attach"]

_ALIGN = 512
_PAGE = 4096
_POISON = 0xFF
_IDLE_S = 0.5   # a stream's thread ends after this long without work


def _delay(value) -> float:
    return float(value() if callable(value) else value)


class LoopbackEvent:
    """A mark in a stream's work: complete when the stream has run everything queued
    before :meth:`record`. Never recorded, it is complete (as a CUDA event)."""

    def __init__(self, device):
        self._device = device
        self._mark = None  # (stream, sequence number)

    def record(self, stream=None):
        stream = stream or self._device.current_stream()
        if stream.capturing:
            raise RuntimeError("loopback: operation not permitted when stream is capturing "
                               "(an event recorded on a stream that captures a graph)")
        # The host stream's work has run by the time its thread records: complete.
        self._mark = None if stream.host else (stream, stream.queued)

    def query(self) -> bool:
        mark = self._mark
        return mark is None or mark[0].ran >= mark[1]

    def synchronize(self) -> None:
        mark = self._mark
        if mark is not None:
            mark[0].wait_for(mark[1])

    def mark(self):
        return self._mark


class LoopbackStream:
    """An in-order queue of work, run by a thread of its own; ``host=True`` is the
    default stream, run inline by whoever launches work on it."""

    _names = itertools.count()

    def __init__(self, device, host=False):
        self.device = device
        self.host = host
        self.capturing = False
        self.queued = 0          # work items queued so far
        self.ran = 0             # work items run so far
        self._lock = threading.Lock()      # queued + put, thread start (never in a finalizer)
        self._done = threading.Condition(threading.Lock())
        self._queue = queue.SimpleQueue()
        self._thread = None
        self.name = "host" if host else f"stream{next(self._names)}"

    def __repr__(self):
        return f"<LoopbackStream {self.name}>"

    def launch(self, fn) -> None:
        """Queue ``fn()`` after everything queued before."""
        if self.host:  # the caller's own work: it runs now, in the caller's order
            try:
                fn()
            except BaseException as e:  # noqa: BLE001 - kept for the test to see
                self.device.errors.append(e)
            return
        with self._lock:
            self.queued += 1
            self._queue.put([self.queued, fn])
            if self._thread is None:
                self._thread = threading.Thread(target=self._work, daemon=True,
                                                name=f"loopback-{self.name}")
                self._thread.start()

    def wait_event(self, event) -> None:
        """Later work runs after ``event`` (the host stream: the caller waits now)."""
        mark = event.mark()
        if mark is None:
            return
        stream, seq = mark
        if self.host:
            stream.wait_for(seq)
        else:
            self.launch(lambda: stream.wait_for(seq))

    def wait_stream(self, other) -> None:
        event = LoopbackEvent(self.device)
        event.record(other)
        self.wait_event(event)

    def synchronize(self) -> None:
        if not self.host:
            self.wait_for(self.queued)

    def wait_for(self, seq) -> None:
        with self._done:
            while self.ran < seq:
                self._done.wait()

    def _run(self, item):
        seq, fn = item
        item[1] = None
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 - kept for the test to see
            self.device.errors.append(e)
        # What the work held (a copy's pinned buffer) goes before it counts as run: once
        # an event says so, the memory is the waiter's to free, as on a GPU.
        fn = None
        with self._done:
            self.ran = seq
            self._done.notify_all()

    def _work(self):
        while True:
            try:
                item = self._queue.get(timeout=_IDLE_S)  # [sequence number, work]
            except queue.Empty:
                with self._lock:
                    if self._queue.empty():
                        self._thread = None
                        return
                continue
            self._run(item)
            item = None


class _Block:
    __slots__ = ("mm", "ptr", "size", "stream", "streams", "marks")

    def __init__(self, size, stream):
        self.mm = mmap.mmap(-1, size)
        self.ptr = ctypes.addressof(ctypes.c_char.from_buffer(self.mm))
        self.size = size
        self.stream = stream
        self.streams = set()
        self.marks = ()


class LoopbackDevice:
    """A stand-in accelerator (see the module docstring).

    Args:
        capacity: bytes of device memory its allocator may have in use at once.
        rate: bytes/s of its copies (None: as fast as memcpy).
        d2h_delay, h2d_delay: seconds before each device -> pinned (pinned -> device)
            copy runs: a number, or a callable called at each copy (a schedule).
        claim_host_tensors: every CPU tensor a store it is attached to saves is taken
            for device memory (a whole CPU model takes the device path).
        pinned_capacity: bytes of pinned memory it may hand out at once (None: no limit).
        pinned_skew: where in its page a pinned buffer under 1 MiB starts (torch's host
            allocator packs small blocks; O_DIRECT staging must not assume pages).
    """

    name = "loopback"

    def __init__(self, *, capacity=1 << 30, rate=None, d2h_delay=0.0, h2d_delay=0.0,
                 claim_host_tensors=False, pinned_capacity=None, pinned_skew=1024):
        self.capacity = capacity
        self.rate = rate
        self.d2h_delay = d2h_delay
        self.h2d_delay = h2d_delay
        self.claim_host_tensors = claim_host_tensors
        self.pinned_capacity = pinned_capacity
        self.pinned_skew = pinned_skew
        self.errors = []                     # exceptions raised by work on its streams
        self.default_stream = LoopbackStream(self, host=True)
        self._streams = weakref.WeakSet()
        self._current = threading.local()
        self._lock = threading.Lock()        # the allocator's books
        self._live = {}                      # block address -> _Block (handed out)
        self._free = collections.defaultdict(list)  # (stream, size) -> [_Block]
        self._freed = collections.deque()    # blocks whose storage died (finalizers)
        self._pinned = {}                    # address -> bytes of pinned buffers alive
        self.allocated = 0                   # bytes of blocks handed out
        self.reserved = 0                    # bytes of every block
        self.peak_allocated = 0
        self.pinned_bytes = 0                # pinned memory handed out, not yet dead
        self.capturing_threads = 0
        self.copies = collections.Counter()  # "d2h", "h2d", "other"
        self.allocations = []                # (stream, nbytes) of each allocation (tests)

    def __repr__(self):
        return f"<LoopbackDevice {self.allocated}/{self.capacity} B>"

    # ------------------------------------------------------------- test interface
    def current_stream(self, device=None) -> LoopbackStream:
        return getattr(self._current, "stream", None) or self.default_stream

    def Stream(self) -> LoopbackStream:  # noqa: N802 - torch.cuda.Stream's name
        stream = LoopbackStream(self)
        self._streams.add(stream)
        return stream

    @contextlib.contextmanager
    def stream(self, stream):
        """Make ``stream`` this thread's current stream inside the block."""
        old = getattr(self._current, "stream", None)
        self._current.stream = stream
        try:
            yield stream
        finally:
            self._current.stream = old

    def Event(self) -> LoopbackEvent:  # noqa: N802
        return LoopbackEvent(self)

    def kernel(self, fn, *, seconds=0.0) -> None:
        """Queue ``fn()`` on the current stream, after ``seconds`` (a slow kernel)."""
        wait = _delay(seconds)

        def run():
            if wait:
                time.sleep(wait)
            fn()
        self.current_stream().launch(run)

    def alloc(self, shape, dtype=torch.float32) -> torch.Tensor:
        """Device memory for a tensor of ``shape``, allocated for the current stream
        (uninitialized: 0xff bytes once the stream has run up to here)."""
        n = 1
        for s in shape:
            n *= s
        itemsize = torch.empty((), dtype=dtype).element_size()
        return self.empty(n * itemsize).view(dtype).view(tuple(shape))

    def headroom(self, device=None):
        """``(free, total)``: its capacity less what is allocated, and its capacity."""
        with self._lock:
            self._collect_locked()
            return self.capacity - self.allocated, self.capacity

    def synchronize(self, device=None) -> None:
        """Wait for the work queued so far on every stream of this device (``device``:
        the leaf interface's argument, this device)."""
        for stream in list(self._streams):
            stream.synchronize()

    @contextlib.contextmanager
    def capture(self, stream=None):
        """Capture a graph on ``stream`` (the current one by default): events on it and
        pinned allocations anywhere are refused inside the block."""
        stream = stream or self.current_stream()
        stream.capturing = True
        self.capturing_threads += 1
        try:
            yield stream
        finally:
            stream.capturing = False
            self.capturing_threads -= 1

    def owns(self, t) -> bool:
        """Whether ``t`` is device memory of this device (the store's question)."""
        if t.device.type != "cpu":
            return False
        if self.claim_host_tensors:
            return True
        return t.untyped_storage().data_ptr() in self._live

    # ------------------------------------------------ the leaf interface (_device/transfers.py)
    def device(self, t):
        return self

    @staticmethod
    def torch_device(device):
        return torch.device("cpu")

    def capturing(self, device) -> bool:
        return self.current_stream().capturing

    @staticmethod
    def entered(device):
        return contextlib.nullcontext()

    def new_stream(self, device):
        return self.Stream()

    def using(self, stream):
        return self.stream(stream)

    def new_event(self):
        return LoopbackEvent(self)

    def empty(self, nbytes, device=None) -> torch.Tensor:
        """``nbytes`` of device memory (uint8), allocated for the current stream."""
        stream = self.current_stream()
        size = max(_ALIGN, -(-nbytes // _ALIGN) * _ALIGN)
        with self._lock:
            self._collect_locked()
            if self.allocated + size > self.capacity:
                raise torch.OutOfMemoryError(
                    f"loopback: allocating {nbytes} bytes would take device memory in use to "
                    f"{self.allocated + size} bytes, beyond its capacity of {self.capacity}")
            block = self._reusable_locked(stream, size)
            if block is None:
                block = _Block(size, stream)
                self.reserved += size
            block.streams = set()
            self._live[block.ptr] = block
            self.allocated += size
            self.peak_allocated = max(self.peak_allocated, self.allocated)
            self.allocations.append((stream, nbytes))
        ptr, mm = block.ptr, block.mm
        stream.launch(lambda: ctypes.memset(ptr, _POISON, size))
        # The storage covers the whole block (frombuffer refuses an empty buffer); its
        # death gives the block back.
        storage = torch.frombuffer(mm, dtype=torch.uint8).untyped_storage()
        weakref.finalize(storage, self._on_free, block)
        return torch.empty(0, dtype=torch.uint8).set_(storage, 0, (nbytes,), (1,))

    def pinned(self, nbytes) -> torch.Tensor:
        """Host memory for staging. Like torch's caching host allocator, which packs small
        blocks, a request under 1 MiB starts 1 KiB into a page (``pinned_skew``)."""
        if self.capturing_threads:
            raise RuntimeError("loopback: pinned allocation while a graph is being captured "
                               "(operation not permitted when stream is capturing)")
        if self.pinned_capacity is not None and \
                self.pinned_bytes + nbytes > self.pinned_capacity:
            raise RuntimeError(f"loopback: no pinned memory for {nbytes} bytes "
                               f"({self.pinned_bytes} of {self.pinned_capacity} in use)")
        skew = self.pinned_skew if nbytes < (1 << 20) else 0
        mm = mmap.mmap(-1, max(nbytes + skew, 1))
        t = torch.frombuffer(mm, dtype=torch.uint8)[skew:skew + nbytes]
        self.pinned_bytes += nbytes
        key = t.untyped_storage().data_ptr()
        self._pinned[key] = nbytes
        weakref.finalize(t.untyped_storage(), self._unpin, key, nbytes)
        return t

    @staticmethod
    def release_cached_pinned():
        """Nothing is cached: a pinned buffer's mapping goes when its last tensor does."""

    @staticmethod
    def pinned_size(nbytes):
        return -(-nbytes // _PAGE) * _PAGE

    def copy(self, dst, src) -> None:
        """Queue a copy of ``src`` into ``dst`` (uint8, as long) on the current stream."""
        nbytes = src.numel() * src.element_size()
        if dst.numel() * dst.element_size() != nbytes:
            raise ValueError(f"loopback: copy of {nbytes} bytes into "
                             f"{dst.numel() * dst.element_size()}")
        d, s = dst.data_ptr(), src.data_ptr()
        dev_src, dev_dst = self._block_of(src), self._block_of(dst)
        pin_src = src.untyped_storage().data_ptr() in self._pinned
        pin_dst = dst.untyped_storage().data_ptr() in self._pinned
        kind = "d2h" if pin_dst and not pin_src else "h2d" if pin_src and not pin_dst else \
            "other"
        self.copies[kind] += 1
        wait = _delay(self.d2h_delay if kind == "d2h" else self.h2d_delay if kind == "h2d"
                      else 0.0)
        if self.rate:
            wait += nbytes / self.rate
        # Device blocks are never unmapped while the device lives: the copy holds no
        # reference to them (a block freed meanwhile is read as it is, as on a GPU).
        # Other memory (pinned staging, torch's CPU tensors) is held until it ran.
        keep = (None if dev_dst else dst, None if dev_src else src)

        def run():
            if wait:
                time.sleep(wait)
            ctypes.memmove(d, s, nbytes)
            keep  # noqa: B018 - held until the copy ran
        self.current_stream().launch(run)

    def record_stream(self, t, stream) -> None:
        """``t``'s block is not reused before ``stream``'s work queued when it is freed."""
        block = self._block_of(t)
        if block is not None and stream is not block.stream:
            block.streams.add(stream)

    # ------------------------------------------------------------------ internals
    def _block_of(self, t):
        return self._live.get(t.untyped_storage().data_ptr())

    def _on_free(self, block):
        """A block's storage died (a finalizer: any thread, maybe inside a collection).
        Takes no lock: the streams' queued counts are read as they are now."""
        block.marks = tuple((s, s.queued) for s in block.streams)
        self._live.pop(block.ptr, None)
        self._freed.append(block)

    def _unpin(self, ptr, nbytes):
        self._pinned.pop(ptr, None)
        self.pinned_bytes -= nbytes

    def _collect_locked(self):
        freed = self._freed
        while freed:
            block = freed[0]
            self.allocated -= block.size
            self._free[(block.stream, block.size)].append(block)
            freed.popleft()

    def _reusable_locked(self, stream, size):
        blocks = self._free.get((stream, size))
        if not blocks:
            return None
        for i, block in enumerate(blocks):
            if all(s.ran >= seq for s, seq in block.marks):
                del blocks[i]
                return block
        return None

    def free_blocks(self) -> dict:
        """``{(stream, block size): count}`` of the freed blocks an allocation for that
        stream may reuse now or once the streams that used them pass their marks (the
        caching allocator's per-stream pools)."""
        with self._lock:
            self._collect_locked()
            return {key: len(blocks) for key, blocks in self._free.items() if blocks}

    def in_use(self) -> int:
        """Bytes of device memory handed out and not yet freed."""
        with self._lock:
            self._collect_locked()
            return self.allocated

    def empty_cache(self) -> int:
        """Unmap the free blocks no stream's queued work may still touch, as
        ``torch.cuda.empty_cache()`` gives cached blocks back (a soak of records of many
        sizes would otherwise keep one block per size). Returns the bytes given back."""
        with self._lock:
            self._collect_locked()
            gone = []
            for key, blocks in list(self._free.items()):
                keep = [b for b in blocks if not all(s.ran >= seq for s, seq in b.marks)]
                gone += [b for b in blocks if b not in keep]
                if keep:
                    self._free[key] = keep
                else:
                    del self._free[key]
            freed = sum(b.size for b in gone)
            self.reserved -= freed
        for block in gone:
            block.mm.close()  # its storage is dead: nothing exports the mapping
        return freed


def attach(offloader, device: LoopbackDevice) -> LoopbackDevice:
    """Make ``offloader`` take ``device``'s tensors to the device path (tests)."""
    offloader._store.loopback = device
    return device
