"""The ``native`` engine: the C++ engine in ``csrc/`` (module ``ssdtrain._C``).

Same contract as the posix reference engine (``ssdtrain/io/posix.py``): a request
is split at address multiples of ``chunk_bytes`` across ``io_threads`` workers; on
``O_DIRECT`` files the file offset is congruent to the address modulo ``BLOCK``
(NOTE [ Zero-copy O_DIRECT from unaligned tensors ]) and only the partial first and
last blocks pass through an aligned bounce block; on buffered files a write ends with
``sync_file_range`` of its own blocks (NOTE [ Range sync in buffered mode ] in
``csrc/engine/engine.cpp``) and ``POSIX_FADV_DONTNEED``, a read with
``POSIX_FADV_DONTNEED``. Workers submit with ``pread``/``pwrite`` (the thread pool,
the default) or through io_uring (``backend="uring"``, where the kernel allows it:
probed at run time); ``backend`` says which is in use. No call here
holds the GIL while it waits on I/O (see NOTE [ Completions, the GIL and shutdown ]
in ``csrc/binding.cpp``).
"""

from __future__ import annotations

import collections
import logging
import threading
import time
import weakref
from concurrent.futures import Future, InvalidStateError
from _thread import allocate_lock as _allocate_lock

from .._errors import ConfigError, SSDTrainError, resource_error
from .._align import BLOCK
from .base import Capabilities, Engine, abandoned, io_error

try:
    from .. import _C
except ImportError as _e:  # not built (or built for another Python)
    _C = None
    _UNAVAILABLE = (f"ssdtrain._C cannot be imported ({_e}); build it with "
                    f"`pip install -e .` (or `make venv`), which needs a C++17 compiler.")
else:
    _UNAVAILABLE = ""

__all__ = ["NativeEngine", "available", "unavailable_reason"]

BACKENDS = ("auto", "uring", "threads")

# NOTE [ Which native back end auto picks ]
# "auto" is the thread pool. Measured on this project's VM (kernel 6.18, ext4 on a
# virtual disk, 4 workers, 16 MiB chunks, 512 MiB in 64 MiB records, CPU seconds of
# the whole process per GB, medians of 3 interleaved runs): with io_uring SQEs of
# 1 MiB, io_uring cost 0.14-0.22 s/GB writing a fresh spill file against the pool's
# 0.07-0.11 (reads 0.07-0.08 vs 0.06-0.08; benchmarks/io_bandwidth.py: 0.115 vs 0.062);
# with whole-piece SQEs (csrc/engine/engine.cpp, kUringSegmentBytes) io_uring came to
# the pool's cost on fresh files (0.076 vs 0.077) and stayed above it on reused slots
# (0.055 vs 0.049 s/GB), reads equal. io_uring was never cheaper. A probe choosing per
# spill directory was not built: telling a 10% difference apart on this VM took
# several hundred MiB per back end (run-to-run spread of the same configuration was up
# to 1.6x), i.e. seconds of I/O and disk writes at every Offloader creation, for a
# choice that came out the same each time. backend="uring" still selects io_uring.


def available() -> bool:
    """Whether the native engine can be used here (``ssdtrain._C`` imports)."""
    return _C is not None


def unavailable_reason() -> str:
    """Why :func:`available` is False; ``""`` when it is True."""
    return _UNAVAILABLE


class _Completion:
    """The callback of one request: runs on an engine worker and settles the future.

    The C++ engine holds it from before the request is queued until it has run (or, in
    a forked child, forever), and it holds ``owner`` (NOTE [ Requests own their memory ]
    in base.py), let go of before the future is settled."""

    __slots__ = ("future", "verb", "file", "offset", "nbytes", "owner")

    def __init__(self, future, verb, file, offset, nbytes, owner):
        self.future, self.verb, self.file = future, verb, file
        self.offset, self.nbytes = offset, nbytes
        self.owner = owner

    def __call__(self, err: int, message: str, crc=None) -> None:
        """Settle the future: on a worker (callback mode) or in ``poll`` (NOTE [ Polled
        completions ] in base.py). Idempotent, and resumable after an interrupt at any
        line: a poll cut short calls it again."""
        self.owner = None  # the request has ended: its memory is the owner's again
        fut = self.future
        if fut is None:
            return
        if not fut.done():
            if err == 0:
                fut.set_result(self.nbytes if crc is None else crc)
            else:
                fut.set_exception(io_error(self.verb, self.file, self.offset, self.nbytes, err,
                                           message))
        self.future = None


_SLICE_S = 0.05  # the longest sleep between polls of a future's own wait (a missed wake's cost)


# Future's own logger (concurrent.futures._base), for _PolledFuture's callbacks.
_FUTURE_LOG = logging.getLogger("concurrent.futures")


class _PolledFuture(Future):
    """A polled engine's future (NOTE [ Polled completions ] in base.py): ``result`` and
    ``exception`` poll the engine while they wait, so whoever waits for one directly
    (a test, a wrapper) needs nothing else. ``concurrent.futures.wait`` does not poll,
    and cannot wait for one (it raises ``TypeError``): the store waits with
    ``EngineSlot.wait`` (_store/engine.py).

    NOTE [ A future without a condition ]: ``Future.__init__`` makes a
    ``threading.Condition`` (a Python object around an ``RLock``) so that threads can
    sleep until the future is settled; settling notifies it, and ``done``, ``result``
    and ``exception`` take it. Nobody sleeps on a polled future: a waiter polls the
    engine (:meth:`_settle`), and only a poll settles it (``_Completion``, one poll at a
    time). So this class keeps ``Future``'s state and its callbacks' semantics (run once,
    on the settling thread, or at once when added to a settled future; an exception in
    one is logged, as ``Future`` does) with a plain lock around the callback list, and
    reads the state without one. A request's future then costs about 1 µs of the
    hooks' thread instead of about 5 (create, add a callback, settle, read the outcome:
    ``tests/test_polled.py`` checks the semantics against ``Future``'s)."""

    def __init__(self, engine):  # noqa: D107 - not Future.__init__ (the NOTE above)
        self._finished = False  # settled (Future's ``_state``, read by no method of Future's here)
        self._result = None
        self._exception = None
        self._done_callbacks = []
        self._callbacks_lock = _allocate_lock()
        # Weakly: the C++ side holds this future (in the payload) until it is polled, and
        # a strong reference back would keep the engine alive through it.
        self._engine = weakref.ref(engine)

    @property
    def _condition(self):  # what concurrent.futures.wait and as_completed take first
        raise TypeError("ssdtrain: a polled engine's future cannot be waited for with "
                        "concurrent.futures.wait or as_completed, which never poll the "
                        "engine; call its result() or exception(), which do.")

    def cancel(self):
        return False  # submitted: running from the start, as Future.cancel says of those

    def cancelled(self):
        return False

    def running(self):
        return not self._finished

    def done(self):
        return self._finished

    def set_running_or_notify_cancel(self):
        return True

    def result(self, timeout=None):
        self._settle(timeout)
        if not self._finished:
            raise TimeoutError()
        if self._exception is not None:
            try:
                raise self._exception
            finally:
                self = None  # noqa: PLW0642 - no cycle through the traceback (as Future)
        return self._result

    def exception(self, timeout=None):
        self._settle(timeout)
        if not self._finished:
            raise TimeoutError()
        return self._exception

    def add_done_callback(self, fn):
        with self._callbacks_lock:
            if not self._finished:
                self._done_callbacks.append(fn)
                return
        try:
            fn(self)
        except Exception:  # noqa: BLE001 - as Future.add_done_callback
            _FUTURE_LOG.exception("exception calling callback for %r", self)

    def set_result(self, result):
        self._finish(result, None)

    def set_exception(self, exception):
        self._finish(None, exception)

    def _finish(self, result, exception):
        with self._callbacks_lock:
            if self._finished:
                raise InvalidStateError(f"{self!r}: settled already")
            callbacks = self._done_callbacks
            # One line of stores, no call (NOTE [ Interrupt-safe allocation ] in io/spill.py):
            # cut short before it, nothing has changed and the poll that retries settles it
            # with its callbacks; it is never settled with its callbacks dropped.
            self._result, self._exception, self._done_callbacks, self._finished = \
                result, exception, [], True
        for fn in callbacks:
            try:
                fn(self)
            except Exception:  # noqa: BLE001 - as Future._invoke_callbacks
                _FUTURE_LOG.exception("exception calling callback for %r", self)

    def __repr__(self):
        if not self._finished:
            return f"<{type(self).__name__} at {id(self):#x} state=running>"
        if self._exception is not None:
            return (f"<{type(self).__name__} at {id(self):#x} state=finished raised "
                    f"{type(self._exception).__name__}>")
        return (f"<{type(self).__name__} at {id(self):#x} state=finished returned "
                f"{type(self._result).__name__}>")

    def _settle(self, timeout):
        engine = self._engine()
        if engine is not None and not self._finished:
            engine.settle(self, timeout)


def start_error(exc, backend, io_threads):
    """The ssdtrain error for ``exc``, raised by ``_C.Engine(...)``: a worker thread that
    could not start (``OSError`` with ``pthread_create``'s errno, see ``csrc/binding.cpp``)
    or no memory (``MemoryError``) is a :class:`~ssdtrain.ResourceError` naming it;
    ``RuntimeError`` with ``backend="uring"`` is io_uring refused by the kernel (a
    :class:`~ssdtrain.ConfigError`); anything else is reported as it is. ``exc`` itself
    when it is no ``Exception`` (an interrupt)."""
    if not isinstance(exc, Exception):
        return exc
    err = resource_error(f"the native I/O engine could not start {io_threads} worker "
                         f"thread(s)", exc, threads=io_threads, thread=isinstance(exc, OSError))
    if err is not None:
        return err
    if isinstance(exc, RuntimeError) and backend == "uring":
        return ConfigError(f"ssdtrain: the native engine's 'uring' back end cannot start: {exc}. "
                           f"Use backend='auto' or 'threads'.")
    if isinstance(exc, ValueError):
        return ConfigError(f"ssdtrain: the native engine refused its arguments: {exc}.")
    return SSDTrainError(f"ssdtrain: the native I/O engine could not start "
                         f"({type(exc).__name__}: {exc}); please report this.")


class NativeEngine(Engine):
    """Engine over ``ssdtrain._C``: a native worker pool with io_uring or pread/pwrite.

    Args:
        io_threads: worker threads. Default 4.
        chunk_bytes: requests are split at addresses that are multiples of this (a
            positive multiple of ``BLOCK``) so several workers share a large request.
            Default 16 MiB.
        backend: ``"auto"`` (the thread pool: measured no more expensive than io_uring
            in CPU per byte anywhere here, NOTE [ Which native back end auto picks ]),
            ``"uring"`` (io_uring; fail if it is unusable) or ``"threads"``
            (``pread``/``pwrite``). Default ``"auto"``.
        watch_us: while requests keep coming, one idle worker looks at the queue every
            ``watch_us`` microseconds, so that a submit (on the training thread) wakes no
            worker; a request then waits at most that long to start (NOTE [ Waking
            workers ] in csrc/engine/engine.cpp). 0: a submit that finds every worker
            asleep wakes one. Default 100.
        poll: requests end in C++ without the GIL, and their futures are settled only by
            :meth:`poll` (the engine is its own ``poller``: NOTE [ Polled completions ] in
            base.py; the store's, made by the Offloader, is). Default False: a worker
            settles each future as its request ends.

    Raises:
        ConfigError: the module is not built, an argument is invalid, or
            ``backend="uring"`` where io_uring cannot be used.
        ResourceError: a worker thread (or memory) could not be had.
    """

    name = "native"
    capabilities = Capabilities(checksums=True)  # NOTE [ Engine capabilities ] in base.py

    def __init__(self, *, io_threads: int = 4, chunk_bytes: int = 16 << 20,
                 backend: str = "auto", poll: bool = False, watch_us: int = 100):
        if _C is None:
            raise ConfigError(f"ssdtrain: the native I/O engine is not available: {_UNAVAILABLE} "
                              f"Or use engine='posix'.")
        if backend not in BACKENDS:
            raise ConfigError(f"ssdtrain: backend must be one of {BACKENDS}, got {backend!r}.")
        if io_threads < 1 or chunk_bytes <= 0 or chunk_bytes % BLOCK:
            raise ConfigError(f"ssdtrain: the native engine needs io_threads >= 1 and chunk_bytes "
                              f"a positive multiple of {BLOCK}; got io_threads={io_threads}, "
                              f"chunk_bytes={chunk_bytes}.")
        if isinstance(watch_us, bool) or not isinstance(watch_us, int) or \
                not 0 <= watch_us <= 100_000:
            raise ConfigError(f"ssdtrain: the native engine's watch_us must be an integer "
                              f"number of microseconds in [0, 100000], got {watch_us!r}.")
        try:
            engine = _C.Engine(io_threads, chunk_bytes, "threads" if backend == "auto" else backend,
                               watch_us)
        except BaseException as e:  # noqa: BLE001 - each cause gets its own error
            raise start_error(e, backend, io_threads) from None
        self.chunk_bytes = chunk_bytes
        self.backend = engine.backend
        self._engine = engine
        self._ended = collections.deque()  # polled, not yet settled: (payload, err, msg, crc)
        # Polls never overlap (the store's, a waiter's); one a future's callback starts on
        # the polling thread returns at once (a re-entered RLock).
        self._polling = threading.RLock()
        self._polled = bool(poll)
        if poll:
            self._write, self._read = engine.submit_write_queued, engine.submit_read_queued
        else:
            self._write, self._read = engine.submit_write, engine.submit_read
        # Drains and joins the workers at shutdown(), when this object is collected,
        # or at interpreter exit (before finalization, when callbacks can still run).
        self._finalizer = weakref.finalize(self, engine.shutdown)
        self._abandoned = False  # last: abandon() skips an engine not fully made

    def write(self, file, offset, address, nbytes, *, crc=False, owner=None):
        return self._submit(self._write, "writing", file, offset, address, nbytes, crc, owner)

    def read(self, file, offset, address, nbytes, *, crc=False, owner=None):
        return self._submit(self._read, "reading", file, offset, address, nbytes, crc, owner)

    @property
    def poller(self):
        """This engine with ``poll=True``, else None (NOTE [ Polled completions ])."""
        return self if getattr(self, "_polled", False) else None

    def poll(self) -> int:
        """Settle the futures of the requests that ended (poll mode; NOTE [ Polled
        completions ] in base.py); how many. Polls take turns. The C++ side appends
        to a deque (no interrupt can fall between its list and ours); each is settled,
        then popped, so an interrupt leaves the rest, and the one it cut, to the next
        call."""
        ended = self._ended
        n = 0
        with self._polling:
            if self._polling._recursion_count() > 1:
                return 0  # from a callback of this thread's poll: that one settles the rest
            self._engine.poll(ended)
            while ended:
                payload, err, message, crc = ended[0]
                payload(err, message, crc)
                ended.popleft()
                n += 1
        return n

    def settle(self, fut, timeout=None):
        """Poll until ``fut`` is done, ``timeout`` seconds at most (None: no limit)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not fut.done():
            since = self._engine.ended()
            self.poll()
            if fut.done():
                return
            left = _SLICE_S if deadline is None else min(_SLICE_S, deadline - time.monotonic())
            if left <= 0:
                return
            self._engine.wait_any(since, left)

    def ended(self) -> int:
        """Requests ended so far, and :meth:`wake` calls (:meth:`wait_any`'s count)."""
        return self._engine.ended()

    def wait_any(self, since: int, timeout: float) -> bool:
        """Wait, without the GIL, until :meth:`ended` passes ``since``, at most ``timeout``
        seconds; whether it had."""
        return self._engine.wait_any(since, timeout)

    def wake(self, *_) -> None:
        """Count one more for :meth:`wait_any` and wake its waiters (a done-callback)."""
        self._engine.wake()

    def wakes(self) -> int:
        """How many submits woke a worker (a futex call on the submitting thread: NOTE
        [ Waking workers ] in csrc/engine/engine.cpp)."""
        return 0 if self._abandoned else self._engine.wakes()

    def in_flight(self) -> int:
        """Polled requests submitted and not ended."""
        return self._engine.in_flight()

    def shutdown(self):
        self._finalizer()
        if self.poller is not None and not self._abandoned:
            self.poll()  # the requests drained at shutdown: their futures end too

    def abandon(self):
        """In a forked child: the C++ engine forgets the parent's workers (leaked, never
        joined; see ``ssdtrain::Engine::abandon``) and the finalizer that would join them
        at exit is detached. Requests queued before the fork never complete."""
        if getattr(self, "_abandoned", True):  # done already, or __init__ did not finish
            return
        self._abandoned = True
        self._finalizer.detach()
        self._engine.abandon()

    def _submit(self, submit, verb, file, offset, address, nbytes, crc, owner):
        if self._abandoned:
            return abandoned(self, verb, file, offset, nbytes)
        if file.direct and offset % BLOCK != address % BLOCK:
            raise AssertionError(f"ssdtrain: O_DIRECT request with offset {offset} not congruent "
                                 f"to address {address:#x} modulo {BLOCK}; please report.")
        if self._polled:
            future = _PolledFuture(self)  # running from the start (NOTE [ A future without a condition ])
        else:
            future = Future()
            future.set_running_or_notify_cancel()
        # A closed SpillFile has fd -1: the system call then fails with EBADF, as in posix.
        # The completion carries the owner into the C++ queue (NOTE [ Requests own their
        # memory ] in base.py); a refused call drops it, nothing queued.
        # Polled: the same object is the payload poll() hands back.
        submit(file.fd, file.direct, offset, address, nbytes, file.name,
               _Completion(future, verb, file, offset, nbytes, owner), crc)
        return future
