"""``ManualEngine``: an engine whose requests run only when the test says so.

Tests that drive the store through every interleaving of packs, completions and
unpacks need to decide *when* each write or read ends, and *how* (done or
failed). :class:`ManualEngine` wraps a real engine: ``write`` and ``read`` queue
the request and return a pending future; :meth:`ManualEngine.complete` performs
one queued request with the real engine, synchronously, and settles its future
on the calling thread, so the store's completion callbacks run there, inline
(as they do when a fast engine completes a request before ``write`` returns)::

    off = ssdtrain.Offloader(engine="posix", ...)
    engine = manual_engine.install(off)
    with off:
        y = model(x)          # writes are queued, none runs
    engine.complete(0)        # the oldest request runs now, on this thread
    engine.complete(0, fail=errno.ENOSPC)   # the next one fails, moving no data

Requests are never run by a background thread of this wrapper: what is not
completed stays pending until :meth:`ManualEngine.shutdown` fails it.
"""

from __future__ import annotations

import errno as _errno
import itertools
import os
import threading
from concurrent.futures import Future

from ssdtrain.io import base as _base
from ssdtrain.io.base import Engine, EngineWrapper, io_error

__all__ = ["ManualEngine", "Request", "install"]


class Request:
    """One queued engine request.

    Attributes:
        id: its number, counted from 0 per engine, in submission order.
        op: ``"write"`` or ``"read"``.
        file, offset, address, nbytes: the arguments the store passed.
        kw: extra keyword arguments (``device=True``), passed on to the inner engine;
            ``owner`` (NOTE [ Requests own their memory ] in ssdtrain/io/base.py) is held
            here while the request is pending, and let go of before it is settled.
        future: the future the store holds; settled by :meth:`ManualEngine.complete`.
    """

    __slots__ = ("id", "op", "file", "offset", "address", "nbytes", "kw", "future")

    def __init__(self, id, op, file, offset, address, nbytes, kw):
        self.id, self.op, self.file, self.offset = id, op, file, offset
        self.address, self.nbytes, self.kw = address, nbytes, kw
        self.future = Future()
        self.future.set_running_or_notify_cancel()

    @property
    def verb(self):
        return "writing" if self.op == "write" else "reading"

    def __repr__(self):
        return (f"<Request #{self.id} {self.op} {self.nbytes} B at offset {self.offset} of "
                f"{getattr(self.file, 'name', self.file)}>")


class ManualEngine(EngineWrapper):
    """Wraps ``inner``; requests wait in a queue until :meth:`complete` runs them.

    Attributes:
        inner: the real engine that performs completed requests.
        log: every request ever submitted, in order (pending or not).
    """

    def __init__(self, inner: Engine):
        super().__init__(inner)  # inner's capabilities, name and back end
        self.log = []
        self._pending = []
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._shut = False
        self._abandoned = False

    # ----------------------------------------------------------- Engine API
    def write(self, file, offset, address, nbytes, **kw):
        return self._queue("write", file, offset, address, nbytes, kw)

    def read(self, file, offset, address, nbytes, **kw):
        return self._queue("read", file, offset, address, nbytes, kw)

    def shutdown(self):
        """Fails every pending request (nothing may wait forever), then shuts ``inner`` down."""
        with self._lock:
            self._shut = True
            pending, self._pending = self._pending, []
        for req in pending:
            _settle_failed(req, _errno.EIO, "still pending when the engine was shut down "
                                            "(ManualEngine)")
        self.inner.shutdown()

    def abandon(self):
        """In a forked child: forget the pending requests without settling them (their
        memory belongs to the parent's requests), refuse new ones, and let ``inner``
        forget its threads. Never blocks: the lock is replaced, not taken (a thread that
        held it at the fork does not exist in the child). Idempotent."""
        self._lock = threading.Lock()
        self._abandoned = True
        self._pending = []
        abandon = getattr(self.inner, "abandon", None)
        if abandon is not None:
            abandon()

    # ------------------------------------------------------------ control
    def pending(self):
        """The requests not completed yet, oldest first (a copy)."""
        with self._lock:
            return list(self._pending)

    def complete(self, i=0, fail=None):
        """Run pending request ``i`` (an index into :meth:`pending`) now, on this thread.

        Args:
            i: which pending request; 0 is the oldest.
            fail: ``None`` (default) performs the request with the inner engine and
                settles the future with its outcome. An errno (or ``True`` for ``EIO``)
                fails the future instead, with the error the engines raise
                (:func:`ssdtrain.io.base.io_error`), without moving any data.

        Returns:
            The completed :class:`Request`.

        Raises:
            IndexError: there is no pending request ``i``.
        """
        with self._lock:
            if not 0 <= i < len(self._pending):
                raise IndexError(f"ManualEngine.complete({i}): only {len(self._pending)} "
                                 f"requests are pending")
            req = self._pending.pop(i)
        if fail is not None and fail is not False:
            err = _errno.EIO if fail is True else int(fail)
            _settle_failed(req, err, f"{os.strerror(err)} (injected by ManualEngine)")
            return req
        do = self.inner.write if req.op == "write" else self.inner.read
        kw = dict(req.kw)
        req.kw = {k: v for k, v in kw.items() if k != "owner"}
        try:  # the owner goes to the inner engine, which lets go of it when it is done
            value = do(req.file, req.offset, req.address, req.nbytes, **kw).result()
        except BaseException as e:  # the real request failed: the store must see that
            kw = None
            req.future.set_exception(e)
        else:
            kw = None
            req.future.set_result(value)
        return req

    def complete_all(self, op=None, fail=None):
        """Complete pending requests (of ``op`` only, when given), oldest first, until
        none is left; requests submitted by completion callbacks are completed too.
        Returns the completed requests."""
        done = []
        while True:
            pending = self.pending()
            idx = next((k for k, r in enumerate(pending) if op is None or r.op == op), None)
            if idx is None:
                return done
            done.append(self.complete(idx, fail=fail))

    # ----------------------------------------------------------- internals
    def _queue(self, op, file, offset, address, nbytes, kw):
        if self._abandoned:
            verb = "writing" if op == "write" else "reading"
            refuse = getattr(_base, "abandoned", None)  # the engines' own refusal, if any
            if refuse is not None:
                return refuse(self, verb, file, offset, nbytes)
            fut = Future()
            fut.set_running_or_notify_cancel()
            fut.set_exception(io_error(verb, file, offset, nbytes, _errno.ESHUTDOWN,
                                       "engine abandoned after fork (ManualEngine)"))
            return fut
        req = Request(next(self._ids), op, file, offset, address, nbytes, kw)
        with self._lock:
            shut = self._shut
            if not shut:  # pending first: an interrupt after it loses no request's owner
                self._pending.append(req)
                self.log.append(req)
        if shut:
            _settle_failed(req, _errno.ESHUTDOWN, "submitted after the engine was shut down "
                                                  "(ManualEngine)")
            self.log.append(req)
        return req.future


def _settle_failed(req, err, message):
    req.kw = {k: v for k, v in req.kw.items() if k != "owner"}  # let go of before it ends
    if not req.future.done():
        req.future.set_exception(io_error(req.verb, req.file, req.offset, req.nbytes, err,
                                          message))


def install(offloader) -> ManualEngine:
    """Wrap ``offloader``'s engine in a :class:`ManualEngine` (as
    :func:`ssdtrain.io.faulty.install` does) and return the wrapper. Install before
    the forward whose requests the test wants to control."""
    return offloader.wrap_engine(ManualEngine)
