"""I/O engines: move bytes between memory addresses and spill-file slots.

Every engine has the same small interface (see :class:`Engine`): ``write`` and
``read`` take a spill file, a file offset, a memory address and a length and
return a ``concurrent.futures.Future`` that completes with the byte count or
fails with :class:`~ssdtrain.SpillIOError`. The caller keeps the memory alive
until the future is done. ``posix`` is the pure-Python reference engine.
"""

from .base import Engine
from .posix import PosixEngine

__all__ = ["Engine", "PosixEngine", "make_engine"]


def make_engine(name: str, *, io_threads: int, io_chunk_bytes: int) -> Engine:
    """The engine called ``name`` (``"auto"`` picks the best one available)."""
    if name in ("auto", "posix"):
        return PosixEngine(io_threads=io_threads, chunk_bytes=io_chunk_bytes)
    raise AssertionError(f"ssdtrain: unknown engine {name!r} passed validation; please report.")
