"""Named ranges in profiler traces: what ssdtrain does, on the thread that does it.

NOTE [ Profiler ranges ]

While a profiler started from Python runs (``torch.profiler.profile``,
``torch.autograd.profiler.profile``, ``emit_nvtx()``, ``emit_itt()``), the store opens
a named range around each thing it does, on the thread where it happens:

========================  ===================================  ==========================
range                     what                                 thread
========================  ===================================  ==========================
``ssdtrain::pack``        the pack hook (a record or a keep)   training (forward)
``ssdtrain::unpack``      the unpack hook                      autograd's (backward)
``ssdtrain::wait_write``  forward waits for writes in flight   training (forward)
                          (``write_behind_bytes``; in pack)
``ssdtrain::wait_read``   backward waits for a read (a         autograd's (backward)
                          prefetch not done yet, or a miss;
                          in unpack)
``ssdtrain::write``       a write started: slot, staging,      the I/O thread
                          the engine's submission              ("ssdtrain-store"), or
                                                               the training thread at the
                                                               end of forward/in the
                                                               throttle
``ssdtrain::read``        a read started: buffer, submission   the I/O thread, or backward
                                                               (a miss; a lagging window)
``ssdtrain::end_forward`` the end of a forward: the due        training
                          writes and the first reads start
``ssdtrain::release``     memory dropped by the store let go   the I/O thread, or the end
                          of outside its lock                  of backward
``ssdtrain::flush``       ``wait()``/``close()`` waiting for   the caller's
                          I/O in flight
========================  ===================================  ==========================

With ``record_shapes=True`` a range carries its arguments (``bytes``; ``record``, the
record's pack sequence number, for writes and reads). ``write`` and ``read`` cover
starting a request; the transfer itself runs in the engine (native workers, io_uring)
and ends while the threads above go on: the overlap shows as the I/O thread's ranges
beside forward's and backward's ops, and a transfer that did not overlap shows as a
``wait_*`` range on the training thread.

Which profiler sees which thread: torch.profiler records a thread only if profiling
was enabled on it or it inherited the profiler from such a thread (autograd's engine
threads do). The store's I/O thread is neither, so its ranges are in a torch.profiler
trace only when the profiler records every thread:
``torch.profiler.profile(experimental_config=torch.profiler._ExperimentalConfig(
profile_all_threads=True))`` (``ExperimentalConfig.profile_all_threads`` in torch's
``profiler/orchestration/observer.h``; torch's own debug handler profiles that way).
NVTX ranges (Nsight Systems) are process-wide: under ``emit_nvtx()`` every range above
is also an NVTX range, on every thread, where CUDA is in use (initialized).

The one check on the hooks' path is torch's own Python flag,
``torch.autograd.profiler._is_profiler_enabled`` (a module attribute: ~25 ns; set by
every profiler above, process-wide, so the I/O thread sees it too).
``torch._C._autograd._profiler_enabled()`` costs more (a C call, ~90 ns) and is wrong
here: it reads the calling thread's profiler state, so it is False on the I/O thread,
and False on every thread with ``profile_all_threads``. A profiler torch starts
without Python (kineto's on-demand daemon) does not set the flag: no ranges then.
The ranges are ``_RecordFunctionFast`` (~2 µs per range while profiling, a tenth of
``record_function``'s, so a traced pack stays close to an untraced one), or
``record_function`` where a torch lacks it.
"""

from __future__ import annotations

import torch
from torch.autograd import profiler as PROFILER

__all__ = ["PROFILER", "PACK", "UNPACK", "WAIT_WRITE", "WAIT_READ", "WRITE", "READ",
           "END_FORWARD", "RELEASE", "FLUSH", "NAMES", "begin", "end", "span"]

PACK = "ssdtrain::pack"
UNPACK = "ssdtrain::unpack"
WAIT_WRITE = "ssdtrain::wait_write"
WAIT_READ = "ssdtrain::wait_read"
WRITE = "ssdtrain::write"
READ = "ssdtrain::read"
END_FORWARD = "ssdtrain::end_forward"
RELEASE = "ssdtrain::release"
FLUSH = "ssdtrain::flush"
NAMES = (PACK, UNPACK, WAIT_WRITE, WAIT_READ, WRITE, READ, END_FORWARD, RELEASE, FLUSH)

# A C context manager; it ends the process (a C++ exception, not a Python one) if its
# second argument is not a tuple or list or its third not a dict: always pass both.
_FAST = getattr(torch._C._profiler, "_RecordFunctionFast", None)
_cuda = None  # the CUDA leaf, imported by the first range (NVTX where CUDA is in use)


class _Span:
    """One open range: the profiler's record and whether an NVTX range was pushed."""

    __slots__ = ("record", "nvtx")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        end(self)


class _Off:
    """What :func:`span` returns while no profiler runs: a context that does nothing."""

    __slots__ = ()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass


_OFF = _Off()


def begin(name: str, args: dict) -> _Span:
    """Open the range ``name`` on this thread; ``args`` (str or int values) show in the
    trace with ``record_shapes=True``. Close it with :func:`end` on the same thread.

    The hooks call this only after checking ``PROFILER._is_profiler_enabled``
    themselves (one attribute read when no profiler runs)."""
    global _cuda
    if _cuda is None:
        from . import cuda as _cuda
    s = _Span()
    s.nvtx = _cuda.nvtx_push(name)
    if _FAST is not None:
        s.record = _FAST(name, (), args)
    else:  # a torch without the fast record: the public one (a dispatcher op, slower)
        s.record = PROFILER.record_function(name)
    s.record.__enter__()
    return s


def end(s: _Span) -> None:
    """Close what :func:`begin` opened, innermost first."""
    s.record.__exit__(None, None, None)
    if s.nvtx:
        _cuda.nvtx_pop()


def span(name: str, nbytes: int = 0, record: int | None = None):
    """A context manager: the range ``name`` while a profiler runs, else nothing. For
    the paths that run once per request or per pass (not per saved tensor)."""
    if not PROFILER._is_profiler_enabled:
        return _OFF
    args = {"bytes": nbytes} if record is None else {"bytes": nbytes, "record": record}
    return begin(name, args)
