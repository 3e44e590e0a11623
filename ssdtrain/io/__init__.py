"""I/O engines: move bytes between memory addresses and spill-file slots.

Every engine has the same small interface (see :class:`Engine`): ``write`` and
``read`` take a spill file, a file offset, a memory address and a length and
return a ``concurrent.futures.Future`` that completes with the byte count or
fails with :class:`~ssdtrain.SpillIOError`. The caller keeps the memory alive
until the future is done. ``posix`` is the pure-Python reference engine.

What the engines write into and check, below the store: ``spill`` (spill files and the
slots inside them), ``readbuf`` (the bounded pool reads land in) and ``checksum``
(CRC32C of records). This package imports nothing of ssdtrain but the leaf modules
(tests/test_layers.py).
"""

import logging
from typing import Tuple

from .._errors import ConfigError
from . import gds, native
from .base import Engine
from .posix import PosixEngine

__all__ = ["Engine", "PosixEngine", "choose_engine", "make_engine"]  # gds.KvikioEngine: GPUDirect Storage

log = logging.getLogger("ssdtrain")
_logged_auto = False


def choose_engine(name: str, *, directories=(), verify: bool = False,
                  gds_memory=None) -> Tuple[str, str]:
    """``(engine name, why)``: ``name`` itself, or for ``"auto"`` the engine it picks.

    ``"auto"``: ``kvikio`` where GPUDirect Storage passes :func:`gds.probe` in every
    directory, else ``native`` where it is built, else ``posix``; the choice and the
    reasons for passing over the others are logged once per process. ``verify``
    (CRC32C of host copies) rules kvikio out: device records never pass through host
    memory there. ``gds_memory``: the device memory :func:`gds.probe` tests with
    (``ssdtrain._device.transfers.GDS_PROBE_MEMORY``); without it kvikio is never usable.

    Raises:
        ConfigError: ``kvikio`` named with ``verify``, or ``native`` named where it is
            not built.
    """
    global _logged_auto
    if name == "auto":
        name, why = _auto(directories, verify, gds_memory)
        if not _logged_auto:
            log.info("ssdtrain: engine auto -> %s (%s)", name, why)
        _logged_auto = True
        return name, why
    if name == "kvikio" and verify:
        raise ConfigError("ssdtrain: verify=True cannot be used with engine='kvikio': "
                          "GPUDirect Storage moves device records without a host copy to "
                          "checksum. Use engine='native' with verify=True, or verify=False.")
    if name == "native" and not native.available():
        raise ConfigError(f"ssdtrain: engine='native' is not available: "
                          f"{native.unavailable_reason()} Or use engine='posix'.")
    if name not in ("kvikio", "native", "posix"):
        raise AssertionError(f"ssdtrain: unknown engine {name!r} passed validation; please "
                             f"report.")
    return name, "configured"


def make_engine(name: str, *, io_threads: int, io_chunk_bytes: int, directories=(),
                verify: bool = False, gds_memory=None, polled: bool = False) -> Engine:
    """The engine :func:`choose_engine` names for ``name``, started; ``polled``: the native
    engine's futures are settled by polling it (NOTE [ Polled completions ] in base.py).

    Raises:
        ConfigError: as :func:`choose_engine`; kvikio also when its probe of device
            memory fails.
    """
    name, _ = choose_engine(name, directories=directories, verify=verify, gds_memory=gds_memory)
    if name == "kvikio":
        return gds.KvikioEngine(io_threads=io_threads, directories=directories,
                                memory=gds_memory)
    if name == "native":
        return native.NativeEngine(io_threads=io_threads, chunk_bytes=io_chunk_bytes,
                                   poll=polled)
    return PosixEngine(io_threads=io_threads, chunk_bytes=io_chunk_bytes)


def _auto(directories, verify, gds_memory):
    """``(engine name, why)`` for ``engine="auto"``."""
    if verify:
        reasons = ["verify=True checksums host copies"]
    else:
        reasons = [r for r in (gds.probe(d, gds_memory) for d in directories) if r] or \
            ([] if directories else ["no spill directory to probe"])
    if not reasons:
        return "kvikio", "GPUDirect Storage works in every spill directory"
    no_gds = f"no GPUDirect Storage: {reasons[0]}"
    if native.available():
        return "native", no_gds
    return "posix", f"{no_gds}; no native engine: {native.unavailable_reason()}"
