"""The ssdtrain error family.

Every error ssdtrain raises derives from :class:`SSDTrainError`, itself a
``RuntimeError`` so code that already catches autograd's errors keeps working.
Messages start with ``ssdtrain:``, say what happened and what was expected,
and end with what to do.
"""

import errno as _errno
import resource as _resource

__all__ = [
    "SSDTrainError",
    "ConfigError",
    "SpillIOError",
    "IntegrityError",
    "OffloaderClosedError",
    "InplaceModificationError",
    "ResourceError",
]


class SSDTrainError(RuntimeError):
    """Base class of every error raised by ssdtrain."""


class ConfigError(SSDTrainError, ValueError):
    """An :class:`~ssdtrain.OffloadConfig` field (named in the message) is invalid."""


class SpillIOError(SSDTrainError, OSError):
    """Reading or writing the spill tier failed; carries ``errno`` and ``filename``."""

    def __init__(self, message, errno=None, filename=None):
        SSDTrainError.__init__(self, message)
        self.errno = errno
        self.filename = filename
        self.strerror = message

    def __str__(self):
        return self.strerror


class IntegrityError(SSDTrainError):
    """Data read back from the spill tier is not what was written."""


class OffloaderClosedError(SSDTrainError):
    """A saved tensor was unpacked after its :class:`~ssdtrain.Offloader` was closed."""


class InplaceModificationError(SSDTrainError):
    """A tensor saved for backward was modified in place after it was saved.

    Autograd raises the same complaint without hooks; with saved-tensor hooks
    installed it no longer checks, so ssdtrain does (NOTE [ In-place checks ] in
    docs/ARCHITECTURE.md says where, and what cannot be detected).
    """


class ResourceError(SSDTrainError, OSError):
    """A thread, a file descriptor or memory ssdtrain needed could not be had.

    ``resource`` says which (``"thread"``, ``"file descriptor"``, ``"memory"``) and
    ``errno`` the system's error, where there is one. Made by :func:`resource_error`.
    """

    def __init__(self, message, errno=None, resource=None):
        SSDTrainError.__init__(self, message)
        self.errno = errno
        self.strerror = message
        self.filename = None
        self.resource = resource

    def __str__(self):
        return self.strerror


# CPython's message when a thread cannot be created (threading.Thread.start).
_NO_THREAD = "can't start new thread"


def resource_error(what, cause, *, threads=None, nbytes=None, thread=False):
    """The :class:`ResourceError` for ``cause`` met while doing ``what`` (a phrase:
    "the store could not start its I/O thread"), or ``None`` if ``cause`` is not about a
    resource that could not be had.

    What it recognizes: a thread that could not start (CPython's ``RuntimeError("can't
    start new thread")``; or, with ``thread=True``, any ``OSError`` of creating one, as
    the native engine reports ``pthread_create``'s ``EAGAIN``); too many open files
    (``EMFILE`` for the process, ``ENFILE`` for the system); no memory (``ENOMEM``,
    ``MemoryError``). ``threads``: how many threads were being started; ``nbytes``: how
    much memory was asked for. Each message says what happened, what was expected and
    what to do, with this process's limits.
    """
    err = getattr(cause, "errno", None)
    detail = f"{type(cause).__name__}: {cause}"
    if thread and isinstance(cause, OSError) or \
            isinstance(cause, RuntimeError) and _NO_THREAD in str(cause):
        want = f"{threads} thread{'s' if threads != 1 else ''}" if threads else "a thread"
        return ResourceError(
            f"ssdtrain: {what}: the system refused a new thread ({detail}). ssdtrain needed "
            f"{want}; this process is at its limit of threads or has no memory for another "
            f"thread's stack (limits: {_limits('nproc', 'stack', 'as')}). Raise the limit "
            f"(`ulimit -u`, a container's pids.max, /proc/sys/kernel/threads-max) or free "
            f"memory, or need fewer threads: lower io_threads, or run fewer offloaders or "
            f"processes at once.", errno=err or _errno.EAGAIN, resource="thread")
    if err in (_errno.EMFILE, _errno.ENFILE):
        whose = "this process has" if err == _errno.EMFILE else "the system has"
        return ResourceError(
            f"ssdtrain: {what}: {whose} too many files open ({detail}). ssdtrain needed one "
            f"more file descriptor (one per spill directory, plus the I/O engine's); "
            f"limits: {_limits('nofile')}. Raise the limit (`ulimit -n`"
            f"{'' if err == _errno.EMFILE else ', /proc/sys/fs/file-max'}), close files "
            f"this process does not need, or close offloaders that are done "
            f"(Offloader.close()).", errno=err, resource="file descriptor")
    if err == _errno.ENOMEM or isinstance(cause, MemoryError):
        much = f"{nbytes} bytes" if nbytes is not None else "memory"
        return ResourceError(
            f"ssdtrain: {what}: the system refused {much} ({detail}). Memory is short, or "
            f"this process has as many memory mappings as it may have (vm.max_map_count) or "
            f"reached its address-space limit ({_limits('as')}). Free memory, lower "
            f"prefetch_bytes (read buffers) or keep_tail_bytes, or raise vm.max_map_count.",
            errno=_errno.ENOMEM, resource="memory")
    return None


_RLIMITS = {"nproc": ("RLIMIT_NPROC", "threads+processes", 1),
            "stack": ("RLIMIT_STACK", "stack MiB", 1 << 20),
            "as": ("RLIMIT_AS", "address space MiB", 1 << 20),
            "nofile": ("RLIMIT_NOFILE", "open files", 1)}


def _limits(*names):
    """``"open files 1024 (hard 4096)"``..., this process's soft and hard limits."""
    out = []
    for name in names:
        attr, label, unit = _RLIMITS[name]
        try:
            soft, hard = _resource.getrlimit(getattr(_resource, attr))
        except (AttributeError, OSError, ValueError):
            continue
        show = [("unlimited" if v == _resource.RLIM_INFINITY else str(v // unit))
                for v in (soft, hard)]
        out.append(f"{label} {show[0]}" + (f" (hard {show[1]})" if show[1] != show[0] else ""))
    return ", ".join(out) or "unknown"
