"""The interface every I/O engine implements.

NOTE [ Engine capabilities ]

What an engine's ``write``/``read`` take beyond the four positional arguments is part of
its declared type, not found by probing: each engine class declares ``capabilities``
(a :class:`Capabilities`), and :class:`Engine` refuses to make an engine whose class
does not (``TypeError``). ``checksums``: ``crc=True`` is taken and the future's result
is then the CRC32C of the request's bytes; ``device_memory``: ``device=True`` is taken
(CUDA device addresses, GPUDirect Storage). A wrapper (fault injection, tracing)
derives from :class:`EngineWrapper`, which reports its inner engine's capabilities,
name and back end and forwards the keyword arguments, so a wrapped engine is driven
exactly as the bare one (the same CRC path); a wrapper that cannot take what its inner
engine takes declares narrower ``capabilities`` itself. ``tests/test_contracts.py``
checks every engine class.

NOTE [ Requests own their memory ]

Every engine's ``write``/``read`` takes ``owner=`` (any object: what holds the memory
the request reads or writes, and its disk slot). The engine keeps a reference to it
from before the request is queued until the request has ended, and lets go of it just
before it settles the request's future: a caller that never receives the future (an
interrupt between the engine's queue and its ``return``) loses nothing, and one that
keeps the future keeps nothing. Native: the ``_Completion`` the C++ side holds carries
it; posix and kvikio: the work item queued holds it; a wrapper that holds a request
(fault injection's ``hang``, tests' manual and slow engines) holds it with the request,
and one that touches the memory after its inner engine is done (a corrupted read, a
CRC behind the request: :func:`then`) holds it until it has. Why the store relies on
it: NOTE [ Memory owned by requests ] in ``ssdtrain/_store/store.py``; ``tests/test_contracts.py``
checks every engine class and wrapper, an interrupt at every line of its submission
included.

NOTE [ Polled completions ]

A request's completion runs Python: its future is settled and the future's callbacks
run (the store's queues the completion in its inbox). Run on the engine's worker, that
Python takes the GIL from the thread that launches kernels, about 100 us a request on
this project's VM (docs/results/launch_loop_cpu_2026-11-27.md). An engine that can end
its requests without Python (the native engine made with ``poll=True``: NOTE
[ Completions without the GIL ] in csrc/binding.cpp) exposes itself as ``poller``:

* ``poller.poll()`` settles the futures of the requests that ended, on the calling
  thread, and returns how many. Polls take turns (a lock); one that a future's callback
  starts inside a poll on the same thread returns at once, and the outer one settles the
  rest. The store polls at the start of every locked region (NOTE [ Store lock
  discipline ] in _store/store.py), so the hooks settle what ended since the last one. A poll
  cut short by an interrupt leaves the rest, and the future it was settling, to the next
  one (settling is idempotent); the callbacks that future had not run yet are lost, and
  the store's repair attaches its own again.
* ``poller.ended()`` counts the requests ended so far, ``poller.wait_any(since,
  timeout)`` waits without the GIL until that count passes ``since``, and
  ``poller.wake()`` adds one to it: a future completed elsewhere (a device copy's
  waiter thread, a test's wrapper) wakes a waiter through a done-callback.

Until someone polls, a polled engine's future is not done, however long ago its
request ended. Its own ``result()`` and ``exception()`` poll while they wait;
``concurrent.futures.wait`` does not, and the store waits with ``EngineSlot.wait`` (_store/engine.py) (poll,
then ``wait_any`` from the count read before the poll, so a completion between the two
is never missed). Engines whose workers settle the futures themselves have ``poller``
None, and a wrapper reports its inner engine's; :func:`wait_futures` is the wait for
those.
"""

import abc
import dataclasses
import errno as _errno
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as _wait
from typing import Optional

from .. import _fork
from .._errors import IntegrityError, SpillIOError, resource_error


@dataclasses.dataclass(frozen=True)
class Capabilities:
    """What an engine's requests take beyond the address range (NOTE [ Engine
    capabilities ]).

    Attributes:
        checksums: ``write``/``read`` take ``crc=True``; the future's result is then the
            CRC32C of the request's bytes (written, or read) instead of the byte count,
            taken on the engine's worker without the GIL (the native engine). Without it
            the store chains the checksum behind the request (:func:`then`).
        device_memory: ``write``/``read`` also take CUDA device addresses
            (``device=True``): GPUDirect Storage. Engines without it see host memory only.
    """

    checksums: bool = False
    device_memory: bool = False


class Engine(abc.ABC):
    """Moves bytes between memory and spill files, asynchronously.

    Every engine is registered with :mod:`ssdtrain._fork` when it is made (here, in
    ``__new__``, so subclasses need not remember to): in a child forked while it is
    alive, :meth:`abandon` is called right after the fork (NOTE [ Engines after fork ]).
    Each engine class declares its :class:`Capabilities` as ``capabilities`` (NOTE [
    Engine capabilities ]); one that does not cannot be made.
    """

    name: str = "?"
    backend: Optional[str] = None
    """The native engine's back end in use (``"threads"`` or ``"uring"``); None elsewhere."""

    capabilities: Capabilities
    """Declared by every engine class (NOTE [ Engine capabilities ])."""

    poller = None
    """The object that settles this engine's futures when polled (NOTE [ Polled
    completions ]); None: the engine's workers settle them."""

    def __new__(cls, *args, **kwargs):
        if not any("capabilities" in k.__dict__ for k in cls.__mro__ if k is not Engine):
            raise TypeError(f"ssdtrain: engine class {cls.__qualname__} does not declare its "
                            f"capabilities; give it a `capabilities = Capabilities(...)` class "
                            f"attribute, or derive a wrapper from ssdtrain.io.base."
                            f"EngineWrapper (NOTE [ Engine capabilities ]).")
        self = super().__new__(cls)
        _fork.register(self, Engine.abandon_in_child)
        return self

    @property
    def checksums(self) -> bool:
        """``capabilities.checksums`` (read-only)."""
        return self.capabilities.checksums

    @property
    def device_memory(self) -> bool:
        """``capabilities.device_memory`` (read-only)."""
        return self.capabilities.device_memory

    @abc.abstractmethod
    def write(self, file, offset: int, address: int, nbytes: int, *, owner=None) -> Future:
        """Write ``nbytes`` from memory at ``address`` to ``file`` at ``offset``; ``owner``
        is held until the request has ended (NOTE [ Requests own their memory ])."""

    @abc.abstractmethod
    def read(self, file, offset: int, address: int, nbytes: int, *, owner=None) -> Future:
        """Read ``nbytes`` from ``file`` at ``offset`` into memory at ``address``; ``owner``
        is held until the request has ended (NOTE [ Requests own their memory ])."""

    @abc.abstractmethod
    def shutdown(self) -> None:
        """Finish queued requests and stop the workers."""

    def abandon(self) -> None:
        """In a forked child: forget the parent's workers and requests, never waiting.

        Called automatically in the child right after ``os.fork()``. Afterwards
        ``write``/``read`` return futures failed with :class:`~ssdtrain.SpillIOError`
        (:func:`abandoned`), ``shutdown`` returns at once, and the futures of requests
        made before the fork never complete (their memory belongs to the parent's
        requests: nothing here may free or reuse it).
        Must not block, take a lock another thread may have held at the fork, or touch
        a device. Idempotent. The default does nothing: right for engines without
        threads of their own.
        """

    @staticmethod
    def abandon_in_child(engine: "Engine") -> None:
        """The :mod:`ssdtrain._fork` callback: ``engine.abandon()``."""
        engine.abandon()


class EngineWrapper(Engine):
    """An engine that delegates to ``inner``: the base of fault injection and tracing
    wrappers. Its capabilities, name and back end are ``inner``'s (properties, so they
    cannot drift), and ``write``/``read`` forward every keyword argument (NOTE [ Engine
    capabilities ]); a subclass overrides the requests it changes."""

    def __init__(self, inner: Engine):
        self.inner = inner

    @property
    def capabilities(self) -> Capabilities:
        return self.inner.capabilities

    @property
    def name(self) -> str:
        return self.inner.name

    @property
    def backend(self) -> Optional[str]:
        return self.inner.backend

    @property
    def poller(self):
        """The inner engine's (NOTE [ Polled completions ])."""
        return self.inner.poller

    def write(self, file, offset, address, nbytes, **kw) -> Future:
        return self.inner.write(file, offset, address, nbytes, **kw)

    def read(self, file, offset, address, nbytes, **kw) -> Future:
        return self.inner.read(file, offset, address, nbytes, **kw)

    def shutdown(self) -> None:
        self.inner.shutdown()

    def abandon(self) -> None:
        self.inner.abandon()


def start_pool(threads: int, prefix: str, what: str) -> ThreadPoolExecutor:
    """A ``ThreadPoolExecutor`` of ``threads`` workers, every one started now.

    ``ThreadPoolExecutor`` starts its threads one per ``submit``, later, when a request
    is made: a thread that cannot start then fails that request with a bare
    ``RuntimeError``, or leaves its piece queued with no worker to run it. Started
    here, a missing thread is found when the engine is made, as a
    :class:`~ssdtrain.ResourceError` naming the cause (``what``: the engine).
    """
    pool = ThreadPoolExecutor(threads, thread_name_prefix=prefix)
    go = threading.Event()
    try:
        for _ in range(threads):  # each blocks until all started: the next needs a new thread
            pool.submit(go.wait)
    except RuntimeError as e:
        go.set()
        pool.shutdown(wait=True)
        err = resource_error(f"the {what} could not start its I/O threads", e, threads=threads)
        if err is None:
            raise
        raise err from None
    go.set()
    return pool


def io_error(verb: str, file, offset: int, nbytes: int, err: int, message: str):
    """The error for a failed request: :class:`SpillIOError` with errno and directory, or
    :class:`IntegrityError` when a read ran into the end of the file (``ENODATA``: the
    spill file is shorter than what was written to it)."""
    if verb == "reading" and err == _errno.ENODATA:
        return IntegrityError(
            f"ssdtrain: reading {nbytes} bytes at offset {offset} of {file.name} ran past the "
            f"end of the file ({message}): the spill file was truncated after the write. The "
            f"data of this record is gone; do not let other programs modify spill_dir "
            f"({file.directory}).")
    return SpillIOError(
        f"ssdtrain: {verb} {nbytes} bytes at offset {offset} of {file.name} failed: {message} "
        f"(errno {err}). Check free space and the device's health; the data of this record is "
        f"lost only if it was not kept in memory.", errno=err, filename=file.directory)


def abandoned(engine: Engine, verb: str, file, offset: int, nbytes: int) -> Future:
    """The outcome of a request made to ``engine`` after :meth:`Engine.abandon` (in a
    forked child, on an engine inherited from the parent): a future failed with
    :class:`SpillIOError`, moving no data."""
    fut = Future()
    fut.set_running_or_notify_cancel()
    fut.set_exception(SpillIOError(
        f"ssdtrain: {verb} {nbytes} bytes at offset {offset} of {file.name} was refused: the "
        f"{engine.name} engine belongs to the process this one was forked from, and its I/O "
        f"threads do not exist here. Create a new Offloader in the child instead of using "
        f"the parent's.", filename=file.directory))
    return fut


def wait_futures(futures, timeout: float) -> list:
    """Wait until every future of ``futures`` is done, at most ``timeout`` seconds; the
    ones not done. For futures that settle themselves (an engine whose ``poller`` is
    None: NOTE [ Polled completions ])."""
    _, not_done = _wait(futures, timeout=max(0.0, timeout))
    return list(not_done)


def then(inner: Future, fn, owner=None) -> Future:
    """A future that completes with ``fn()`` once ``inner`` has succeeded.

    ``fn`` runs on the thread that completes ``inner``. An exception from ``inner`` or
    from ``fn`` becomes the returned future's exception; if ``fn`` returns a future,
    the returned future completes with that one's outcome instead. ``owner`` (the
    memory ``fn`` touches: NOTE [ Requests own their memory ]) and ``fn`` itself are
    held until ``fn`` has returned, or ``inner`` failed, and let go of before the
    returned future is settled.
    """
    outer = Future()
    outer.set_running_or_notify_cancel()
    held = [fn, owner]

    def settle(fut):
        try:
            fut.result()
            value = held[0]()
        except BaseException as e:  # never leave outer pending: a waiter would hang
            held.clear()
            outer.set_exception(e)
            return
        held.clear()
        if isinstance(value, Future):
            value.add_done_callback(lambda f: _copy_outcome(f, outer))
        else:
            outer.set_result(value)
    inner.add_done_callback(settle)
    return outer


def _copy_outcome(src: Future, dst: Future) -> None:
    exc = src.exception()
    if exc is None:
        dst.set_result(src.result())
    else:
        dst.set_exception(exc)
