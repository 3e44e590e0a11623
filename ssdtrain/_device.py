"""The only module that knows CUDA: streams, events and pinned staging for device records.

See NOTE [ Device records ] for the ordering rules; every function here is small
on purpose, because CI has no GPU: the tests in tests/test_device.py run
wherever CUDA exists.

NOTE [ Device records ]
=======================

A record whose storage lives on a CUDA device moves like a host record (the same
states, slots and engines), with three extra rules:

1. **Writes start after the producer.** The saved tensor may still be being
   computed when pack runs (kernels are asynchronous). Pack records an event on
   the current stream (:meth:`DeviceTransfers.produced`) *when the record is
   created*, not when its write starts: the write may start later (the record
   waits in the kept tail) from another pack, maybe on another stream. The offload
   stream waits for that event and copies device -> pinned staging (with a
   GPUDirect engine, the event itself is what the write waits for). A single
   "ssdtrain-d2h" thread waits for the copy's event and only then submits the
   disk write: forward never synchronizes with the device.
2. **The block is not reused before the copy ends.** The record holds the saved
   tensor (``Record.source``) until the disk write has completed, and the write
   starts only after the copy's event: when that reference drops, the copy is
   long done, so the caching allocator may reuse the block at once. No
   ``record_stream`` is needed on this side.
3. **Loads are consumed after they land.** A read lands in pinned staging and is
   copied host -> device on the prefetch stream, into memory allocated on that
   stream at the same address offset modulo 512 as the saved tensor had (so
   kernels that pick code paths by alignment, such as cuBLAS, see the same
   alignment and give the same bits); an event marks the copy's end. Unpack makes the consumer stream (the
   current stream of autograd's device thread) wait on that event and calls
   ``record_stream`` for it, so the allocator does not hand the block to the
   prefetch stream again while backward still reads it (pytorch/pytorch#106360).

Writes and prefetch reads are started by the store's I/O thread (NOTE [ The store's
I/O thread ] in _store.py), whose current device is not the record's: the functions
it calls (:meth:`DeviceTransfers.stage_out`, :meth:`DeviceTransfers.read_buffer`)
enter the record's device themselves, and use streams and events they were given,
never the thread's current stream.

In-place modification is checked when the write ends, after the copy's event: an
in-place op called before the check bumped the version already (the record fails
with autograd's message); one called after it runs after the copy on the device.
Pinned staging comes from torch's caching host allocator, which records the
streams using a block and does not reuse it before they are done. Events that a
host thread waits on are created with ``blocking=True`` so the waiter sleeps
instead of spinning on a core that compute needs.

Not handled: CUDA graph capture (saved tensors of a captured region must stay
in memory; ssdtrain does not detect capture; and the store's I/O thread allocates
pinned memory and records events whenever a write is due, which a capture in the
global mode on another thread does not allow), and an out-of-memory error while
allocating a loaded record's device memory fails that record (its backward
raises) instead of retrying later.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from ._align import BLOCK
from .io.base import then

__all__ = ["DeviceTransfers", "GDS_PROBE_MEMORY", "is_device_tensor"]

# Device buffers keep a record's address modulo this (cuBLAS and friends choose
# kernels by alignment up to 256 bytes; the caching allocator hands out 512).
_DEVICE_ALIGN = 512


def is_device_tensor(t: torch.Tensor) -> bool:
    """Whether ``t`` lives on a CUDA device (a record that needs :class:`DeviceTransfers`)."""
    return t.device.type == "cuda"


class _GdsProbeMemory:
    """Device memory for the GPUDirect Storage probe (``ssdtrain.io.gds.probe``), which
    itself never touches CUDA: it is handed :data:`GDS_PROBE_MEMORY` and sees addresses."""

    @staticmethod
    def missing() -> str:
        """Why there is no device to test with, or ``""``."""
        return "" if torch.cuda.is_available() else "no CUDA device is available"

    @staticmethod
    def buffers(nbytes: int):
        """``(source, destination, same)``: the addresses of ``nbytes`` random bytes and of
        ``nbytes`` zeros on the current device (not a context on GPU 0), both ready, and a
        callable telling whether the destination now equals the source. The callable
        holds both buffers: keep it until the test I/O has ended."""
        device = torch.device("cuda", torch.cuda.current_device())
        src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=device)
        dst = torch.zeros_like(src)
        torch.cuda.synchronize(device)
        return src.data_ptr(), dst.data_ptr(), lambda: torch.equal(src, dst)


GDS_PROBE_MEMORY = _GdsProbeMemory()


def _bytes_view(storage, base: int, nbytes: int, device) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=device).set_(storage, base, (nbytes,), (1,))


class DeviceTransfers:
    """Streams, events and staging for the records of one CUDA device.

    Args:
        device: the ``torch.device`` (with its index).
        direct: the engine takes device addresses (GPUDirect Storage): no staging.
    """

    def __init__(self, device: torch.device, direct: bool):
        self.device = device
        self.direct = direct
        self.d2h = torch.cuda.Stream(device)
        self.h2d = torch.cuda.Stream(device)
        # One thread: waits for copies to end, then submits the disk write.
        self._waiter = ThreadPoolExecutor(1, thread_name_prefix="ssdtrain-d2h")
        self._closed = threading.Event()

    # ------------------------------------------------------------------ writes
    def produced(self):
        """An event on the current stream: the saved tensor is complete once it has
        run. Called by pack when it creates the record (rule 1)."""
        event = torch.cuda.Event(blocking=True)
        event.record(torch.cuda.current_stream(self.device))
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
        src = _bytes_view(storage, base, nbytes, self.device)
        # The store's I/O thread calls this: its current device is not the record's
        # (a pinned allocation there would create a context on device 0).
        with torch.cuda.device(self.device):
            host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
            self.d2h.wait_event(produced)
            with torch.cuda.stream(self.d2h):
                host.copy_(src, non_blocking=True)
            done = torch.cuda.Event(blocking=True)
            done.record(self.d2h)
        return host.data_ptr(), host, done

    def after(self, event, submit) -> Future:
        """``submit()`` (which returns a future) once ``event`` has completed, on the
        waiter thread; the returned future completes with that future's outcome."""
        ready = self._waiter.submit(event.synchronize)  # releases the GIL while it waits
        return then(ready, submit)

    # ------------------------------------------------------------------- reads
    def read_buffer(self, misalign: int, nbytes: int):
        """Where a read lands: ``(address, keepalive)``, ``address % BLOCK == misalign``.

        Pinned host staging, or (``direct``) device memory allocated on the prefetch
        stream; ``keepalive`` is the tensor to pass to :meth:`stage_in`.
        """
        if self.direct:
            with torch.cuda.device(self.device), torch.cuda.stream(self.h2d):
                buf = torch.empty(nbytes + BLOCK, dtype=torch.uint8, device=self.device)
        else:  # on the store's I/O thread too (see stage_out)
            with torch.cuda.device(self.device):
                buf = torch.empty(nbytes + BLOCK, dtype=torch.uint8, pin_memory=True)
        # Same offset in a block as the slot: O_DIRECT moves the middle without bouncing,
        # and (direct) the device copy keeps the saved tensor's alignment.
        shift = (misalign - buf.data_ptr()) % BLOCK
        view = buf[shift:shift + nbytes]
        return view.data_ptr(), view

    def stage_in(self, buf: torch.Tensor):
        """After the read into ``buf`` ended: ``(device storage, byte offset, event or None)``.

        Staged data is copied to device memory allocated on the prefetch stream; the
        event marks the copy's end. Runs on the engine thread that finished the read.
        """
        if self.direct:
            return buf.untyped_storage(), buf.storage_offset(), None
        nbytes = buf.numel()
        misalign = buf.data_ptr() % _DEVICE_ALIGN  # the saved tensor's, see read_buffer
        with torch.cuda.device(self.device), torch.cuda.stream(self.h2d):
            dst = torch.empty(nbytes + _DEVICE_ALIGN, dtype=torch.uint8, device=self.device)
            shift = (misalign - dst.data_ptr()) % _DEVICE_ALIGN
            dst[shift:shift + nbytes].copy_(buf, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record(self.h2d)
        return dst.untyped_storage(), shift, ready

    def consume(self, storage, ready) -> None:
        """Make the current stream wait for a load and keep its block from early reuse."""
        consumer = torch.cuda.current_stream(self.device)
        if ready is not None:
            consumer.wait_event(ready)
        _bytes_view(storage, 0, storage.nbytes(), self.device).record_stream(consumer)

    def close(self) -> None:
        self._waiter.shutdown(wait=True)


# ------------------------------------------------------------------ for tools (ssdtrain check)
def default_device() -> torch.device:
    """The device a tool runs a model on when none is named: CUDA where available."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (a no-op off CUDA): for timing a step."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def rng_state(device: torch.device) -> dict:
    """The random-number state a step on ``device`` draws from: the CPU generator's, and
    the device's own on CUDA (``{"cpu": ..., "cuda": ...}``)."""
    state = {"cpu": torch.random.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict, device: torch.device) -> None:
    """Restore what :func:`rng_state` returned."""
    torch.random.set_rng_state(state["cpu"])
    if "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)
