"""The interface every I/O engine implements."""

import abc
import errno as _errno
from concurrent.futures import Future

from .. import _fork
from .._errors import IntegrityError, SpillIOError


class Engine(abc.ABC):
    """Moves bytes between memory and spill files, asynchronously.

    Every engine is registered with :mod:`ssdtrain._fork` when it is made (here, in
    ``__new__``, so subclasses need not remember to): in a child forked while it is
    alive, :meth:`abandon` is called right after the fork (NOTE [ Engines after fork ]).
    """

    name: str = "?"
    device_memory: bool = False
    """Whether ``write``/``read`` also take CUDA device addresses (``device=True``):
    GPUDirect Storage. Engines without it see host memory only."""

    checksums: bool = False
    """Whether ``write``/``read`` take ``crc=True``: the future's result is then the
    CRC32C of the request's bytes (written, or read) instead of the byte count, taken
    on the engine's worker without the GIL (the native engine). Without it the store
    chains the checksum behind the request (:func:`then`)."""

    def __new__(cls, *args, **kwargs):
        self = super().__new__(cls)
        _fork.register(self, Engine.abandon_in_child)
        return self

    @abc.abstractmethod
    def write(self, file, offset: int, address: int, nbytes: int) -> Future:
        """Write ``nbytes`` from memory at ``address`` to ``file`` at ``offset``."""

    @abc.abstractmethod
    def read(self, file, offset: int, address: int, nbytes: int) -> Future:
        """Read ``nbytes`` from ``file`` at ``offset`` into memory at ``address``."""

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


def then(inner: Future, fn) -> Future:
    """A future that completes with ``fn()`` once ``inner`` has succeeded.

    ``fn`` runs on the thread that completes ``inner``. An exception from ``inner`` or
    from ``fn`` becomes the returned future's exception; if ``fn`` returns a future,
    the returned future completes with that one's outcome instead.
    """
    outer = Future()
    outer.set_running_or_notify_cancel()

    def settle(fut):
        try:
            fut.result()
            value = fn()
        except BaseException as e:  # never leave outer pending: a waiter would hang
            outer.set_exception(e)
            return
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
