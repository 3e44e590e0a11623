"""I/O engines: move bytes between memory addresses and spill-file slots.

Every engine has the same small interface (see :class:`Engine`): ``write`` and
``read`` take a spill file, a file offset, a memory address and a length and
return a ``concurrent.futures.Future`` that completes with the byte count or
fails with :class:`~ssdtrain.SpillIOError`. The caller keeps the memory alive
until the future is done. ``posix`` is the pure-Python reference engine.
"""

import logging

from .._errors import ConfigError
from . import native
from .base import Engine
from .posix import PosixEngine

__all__ = ["Engine", "PosixEngine", "make_engine"]

log = logging.getLogger("ssdtrain")
_logged_auto = False


def make_engine(name: str, *, io_threads: int, io_chunk_bytes: int) -> Engine:
    """The engine called ``name``; ``"auto"``: native where it is built, else posix."""
    global _logged_auto
    if name == "auto":
        if native.available():
            name = "native"
        else:
            if not _logged_auto:
                log.info("ssdtrain: engine auto -> posix (%s)", native.unavailable_reason())
            name = "posix"
        _logged_auto = True
    if name == "native":
        if not native.available():
            raise ConfigError(f"ssdtrain: engine='native' is not available: "
                              f"{native.unavailable_reason()} Or use engine='posix'.")
        return native.NativeEngine(io_threads=io_threads, chunk_bytes=io_chunk_bytes)
    if name == "posix":
        return PosixEngine(io_threads=io_threads, chunk_bytes=io_chunk_bytes)
    raise AssertionError(f"ssdtrain: unknown engine {name!r} passed validation; please report.")
