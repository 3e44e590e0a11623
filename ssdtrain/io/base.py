"""The interface every I/O engine implements."""

import abc
import errno as _errno
from concurrent.futures import Future

from .._errors import IntegrityError, SpillIOError


class Engine(abc.ABC):
    """Moves bytes between memory and spill files, asynchronously."""

    name: str = "?"
    device_memory: bool = False
    """Whether ``write``/``read`` also take CUDA device addresses (``device=True``):
    GPUDirect Storage. Engines without it see host memory only."""

    @abc.abstractmethod
    def write(self, file, offset: int, address: int, nbytes: int) -> Future:
        """Write ``nbytes`` from memory at ``address`` to ``file`` at ``offset``."""

    @abc.abstractmethod
    def read(self, file, offset: int, address: int, nbytes: int) -> Future:
        """Read ``nbytes`` from ``file`` at ``offset`` into memory at ``address``."""

    @abc.abstractmethod
    def shutdown(self) -> None:
        """Finish queued requests and stop the workers."""


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
