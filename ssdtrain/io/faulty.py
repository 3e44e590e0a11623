"""Fault injection: an engine wrapper that fails chosen requests, for tests and drills.

:class:`FaultyEngine` wraps any :class:`~ssdtrain.io.base.Engine` and makes the
``nth`` write or read (counted per operation, from 1) fail the way a real device
would, so every error path of the store can be exercised on a healthy disk:

========== ==========================================================================
kind       what the request does
========== ==========================================================================
ENOSPC,    fails with that errno and moves no data (a full device, a quota, a file
EDQUOT,    size limit, a media error): a :class:`~ssdtrain.SpillIOError`, as the
EFBIG, EIO engines report it
short      moves the first half of the bytes, then fails: a write with ``EIO``
           ("short write"), a read with ``ENODATA`` (the spill file ends early:
           :class:`~ssdtrain.IntegrityError`)
corrupt    succeeds, but one byte is flipped: on disk after a write, in memory after
           a read (on disk during a read whose engine takes the CRC, ``crc=True``)
           (``verify=True`` must catch it; without it the data is wrong)
hang       never completes until :meth:`FaultyEngine.shutdown` (a hung device:
           ``io_timeout_s`` must end the wait); it holds the request's ``owner``
           until then, as a hung device's request would
========== ==========================================================================

It is a debugging tool, not part of the training path: install it on an open
offloader with :func:`install`::

    from ssdtrain.io import faulty
    off = ssdtrain.Offloader(spill_dir="/nvme/tmp")
    faulty.install(off, faulty.Fault("write", "ENOSPC", nth=3))
"""

from __future__ import annotations

import ctypes
import errno as _errno
import os
import threading
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Optional

from .base import EngineWrapper, io_error, then

__all__ = ["Fault", "FaultyEngine", "install", "KINDS"]

_ERRNOS = {"ENOSPC": _errno.ENOSPC, "EDQUOT": _errno.EDQUOT, "EFBIG": _errno.EFBIG,
           "EIO": _errno.EIO}
KINDS = tuple(_ERRNOS) + ("short", "corrupt", "hang")


@dataclass(frozen=True)
class Fault:
    """Fail requests ``nth`` .. ``nth + times - 1`` of operation ``op``.

    Args:
        op: ``"write"`` or ``"read"``.
        kind: one of :data:`KINDS` (see the module docstring).
        nth: the first request to fail, counted from 1 per operation. Default 1.
        times: how many consecutive requests fail; ``None``: every one from ``nth`` on.
            Default 1.
        nbytes: only requests of exactly this many bytes fail (``nth`` and ``times``
            still count every request of ``op``); ``None``: any size. A record's write
            is one request of the record's size, so a size no other record has picks
            the records that fail (``nth=1, times=None, nbytes=n``: every write of the
            records of ``n`` bytes). Default None.
    """

    op: str
    kind: str
    nth: int = 1
    times: Optional[int] = 1
    nbytes: Optional[int] = None

    def __post_init__(self):
        if self.op not in ("write", "read"):
            raise ValueError(f"Fault.op must be 'write' or 'read', got {self.op!r}")
        if self.kind not in KINDS:
            raise ValueError(f"Fault.kind must be one of {KINDS}, got {self.kind!r}")
        if self.nth < 1 or (self.times is not None and self.times < 1):
            raise ValueError(f"Fault.nth and Fault.times must be >= 1, got {self.nth}, "
                             f"{self.times}")
        if self.nbytes is not None and self.nbytes < 1:
            raise ValueError(f"Fault.nbytes must be >= 1 or None, got {self.nbytes}")

    def hits(self, op: str, n: int, nbytes: Optional[int] = None) -> bool:
        """Whether the ``n``-th request of ``op`` (of ``nbytes`` bytes) fails."""
        return op == self.op and n >= self.nth and (self.times is None
                                                    or n < self.nth + self.times) \
            and (self.nbytes is None or nbytes == self.nbytes)


class FaultyEngine(EngineWrapper):
    """Wraps ``inner``; requests matched by ``faults`` fail, the others pass through.

    An :class:`~ssdtrain.io.base.EngineWrapper`: it has ``inner``'s capabilities and
    passes on every keyword argument, so the store drives it exactly as it drives
    ``inner`` (with the native engine, the CRC is taken by its workers: ``crc=True``).
    A corrupted request with ``crc=True`` returns the CRC a device would report: of the
    bytes written before the flip on disk; of the flipped bytes a read delivered (the
    byte is flipped on disk for that read, and restored after it). Every request's
    ``owner`` is held as an engine holds it (NOTE [ Requests own their memory ] in
    base.py): by the inner engine, by the wrapper for a hung request until
    :meth:`shutdown`, and until the flip for a read corrupted in memory.

    Attributes:
        calls: ``{"write": n, "read": n}``, requests seen so far.
        injected: ``[(op, n, kind)]``, the faults injected so far.
        injected_nbytes: ``[nbytes]``, the size of each of those requests, in that order.
    """

    def __init__(self, inner, faults=()):
        super().__init__(inner)
        self.faults = list(faults)
        self.calls = {"write": 0, "read": 0}
        self.injected = []
        self.injected_nbytes = []
        self._hung = []
        self._lock = threading.Lock()

    def write(self, file, offset, address, nbytes, **kw):
        return self._request("write", file, offset, address, nbytes, kw)

    def read(self, file, offset, address, nbytes, **kw):
        return self._request("read", file, offset, address, nbytes, kw)

    def shutdown(self):
        """Fails the hung requests (nothing may wait forever), then shuts ``inner`` down."""
        with self._lock:
            hung, self._hung = self._hung, []
        while hung:
            fut, file, offset, nbytes, verb, _owner = hung.pop()  # its owner goes first
            del _owner
            if not fut.done():
                fut.set_exception(io_error(verb, file, offset, nbytes, _errno.EIO,
                                           "injected hang, ended by shutdown"))
        self.inner.shutdown()

    def abandon(self):
        """In a forked child: forgets the hung requests (they belong to the parent: none is
        failed here, which would run the parent's callbacks in the child) and abandons
        ``inner``. The lock is replaced, not taken: another thread may have held it at
        the fork."""
        self._lock = threading.Lock()
        self._hung = []
        self.inner.abandon()

    def _request(self, op, file, offset, address, nbytes, kw):
        with self._lock:
            self.calls[op] += 1
            n = self.calls[op]
            fault = next((f for f in self.faults if f.hits(op, n, nbytes)), None)
            if fault is not None:
                self.injected.append((op, n, fault.kind))
                self.injected_nbytes.append(nbytes)
        do = self.inner.write if op == "write" else self.inner.read
        if fault is None:
            return do(file, offset, address, nbytes, **kw)
        verb = "writing" if op == "write" else "reading"
        kind = fault.kind
        if kind in _ERRNOS:
            return _failed(io_error(verb, file, offset, nbytes, _ERRNOS[kind],
                                    f"{os.strerror(_ERRNOS[kind])} (injected)"))
        if kind == "hang":
            fut = Future()
            fut.set_running_or_notify_cancel()
            with self._lock:
                self._hung.append((fut, file, offset, nbytes, verb, kw.get("owner")))
            return fut
        if kind == "short":
            half = nbytes // 2
            err = _errno.EIO if op == "write" else _errno.ENODATA
            what = "short write" if op == "write" else "short read: spill data truncated"

            def fail():
                raise io_error(verb, file, offset, nbytes, err,
                               f"{what} ({half} of {nbytes} bytes, injected)")
            inner = do(file, offset, address, half, **kw) if half else _done(0)
            return then(inner, fail)
        # corrupt: the request succeeds; one byte (the middle one) is flipped afterwards.
        at = nbytes // 2
        if op == "read" and kw.get("crc"):
            # The engine's CRC must be of the bytes that landed: the device delivers the
            # wrong byte (flipped on disk for this read, restored once it has ended).
            _flip_on_disk(file, offset + at)
            inner = do(file, offset, address, nbytes, **kw)
            inner.add_done_callback(lambda _: _flip_on_disk(file, offset + at))
            return inner
        inner = do(file, offset, address, nbytes, **kw)
        if op == "write":  # the result (byte count or CRC) is of the bytes written
            return then(inner, lambda: _flip_on_disk(file, offset + at) or inner.result())
        # The flip touches the memory after the inner engine let go of it: held till then.
        return then(inner, lambda: _flip_in_memory(address + at) or inner.result(),
                    kw.get("owner"))


def install(offloader, *faults: Fault) -> FaultyEngine:
    """Wrap ``offloader``'s engine in a :class:`FaultyEngine` injecting ``faults``.

    Install before the requests to fail are made (before the forward pass, say).

    Returns:
        The wrapper (its ``calls`` and ``injected`` show what happened).
    """
    return offloader.wrap_engine(lambda engine: FaultyEngine(engine, faults))


def _failed(exc) -> Future:
    fut = Future()
    fut.set_running_or_notify_cancel()
    fut.set_exception(exc)
    return fut


def _done(value) -> Future:
    fut = Future()
    fut.set_running_or_notify_cancel()
    fut.set_result(value)
    return fut


def _flip_on_disk(file, offset):
    # A second, buffered descriptor of the (anonymous) spill file; O_DIRECT readers see
    # the change because the kernel writes dirty pages back before a direct read.
    fd = os.open(f"/proc/self/fd/{file.fd}", os.O_RDWR | os.O_CLOEXEC)
    try:
        byte = os.pread(fd, 1, offset)
        os.pwrite(fd, bytes([byte[0] ^ 0x40]), offset)
        os.fsync(fd)
    finally:
        os.close(fd)


def _flip_in_memory(address):
    cell = ctypes.c_ubyte.from_address(address)
    cell.value ^= 0x40
