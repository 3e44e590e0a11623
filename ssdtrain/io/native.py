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

import weakref
from concurrent.futures import Future

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
        self.owner = None  # the request has ended: its memory is the owner's again
        if err == 0:
            self.future.set_result(self.nbytes if crc is None else crc)
            return
        self.future.set_exception(io_error(self.verb, self.file, self.offset, self.nbytes, err,
                                           message))


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

    Raises:
        ConfigError: the module is not built, an argument is invalid, or
            ``backend="uring"`` where io_uring cannot be used.
        ResourceError: a worker thread (or memory) could not be had.
    """

    name = "native"
    capabilities = Capabilities(checksums=True)  # NOTE [ Engine capabilities ] in base.py

    def __init__(self, *, io_threads: int = 4, chunk_bytes: int = 16 << 20,
                 backend: str = "auto"):
        if _C is None:
            raise ConfigError(f"ssdtrain: the native I/O engine is not available: {_UNAVAILABLE} "
                              f"Or use engine='posix'.")
        if backend not in BACKENDS:
            raise ConfigError(f"ssdtrain: backend must be one of {BACKENDS}, got {backend!r}.")
        if io_threads < 1 or chunk_bytes <= 0 or chunk_bytes % BLOCK:
            raise ConfigError(f"ssdtrain: the native engine needs io_threads >= 1 and chunk_bytes "
                              f"a positive multiple of {BLOCK}; got io_threads={io_threads}, "
                              f"chunk_bytes={chunk_bytes}.")
        try:
            engine = _C.Engine(io_threads, chunk_bytes, "threads" if backend == "auto" else backend)
        except BaseException as e:  # noqa: BLE001 - each cause gets its own error
            raise start_error(e, backend, io_threads) from None
        self.chunk_bytes = chunk_bytes
        self.backend = engine.backend
        self._engine = engine
        # Drains and joins the workers at shutdown(), when this object is collected,
        # or at interpreter exit (before finalization, when callbacks can still run).
        self._finalizer = weakref.finalize(self, engine.shutdown)
        self._abandoned = False  # last: abandon() skips an engine not fully made

    def write(self, file, offset, address, nbytes, *, crc=False, owner=None):
        return self._submit(self._engine.submit_write, "writing", file, offset, address, nbytes,
                            crc, owner)

    def read(self, file, offset, address, nbytes, *, crc=False, owner=None):
        return self._submit(self._engine.submit_read, "reading", file, offset, address, nbytes,
                            crc, owner)

    def shutdown(self):
        self._finalizer()

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
        future = Future()
        future.set_running_or_notify_cancel()
        # A closed SpillFile has fd -1: the system call then fails with EBADF, as in posix.
        # The completion carries the owner into the C++ queue (NOTE [ Requests own their
        # memory ] in base.py); a refused call drops it, nothing queued.
        submit(file.fd, file.direct, offset, address, nbytes, file.name,
               _Completion(future, verb, file, offset, nbytes, owner), crc)
        return future
