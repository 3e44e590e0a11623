"""CRC32C of records: computed when a write ends, checked when a read ends.

The checksum is never taken on the training thread. An engine with ``checksums``
(the native one) takes it on the worker that finishes the request, without the GIL,
and the request's future completes with it (``write(..., crc=True)``); a read's CRC is
compared when the store completes the read. Other engines get it chained behind their
future (:func:`ssdtrain.io.base.then`), on the thread that completes the I/O. Either
way a mismatch is the record's :class:`~ssdtrain.IntegrityError`, on the same path as
an I/O error.
"""

from .._errors import ConfigError, IntegrityError

__all__ = ["available", "crc32c", "mismatch"]

try:
    from .. import _C
except ImportError:  # the native module is not built
    _C = None


def available() -> bool:
    """Whether checksums can be computed here (they need ``ssdtrain._C``)."""
    return _C is not None


def crc32c(address: int, nbytes: int) -> int:
    """CRC32C of ``nbytes`` at ``address`` (releases the GIL; SSE4.2 where present)."""
    if _C is None:
        raise ConfigError("ssdtrain: verify=True needs the native module ssdtrain._C, which is "
                          "not built here; build it with `pip install -e .` (a C++17 compiler) "
                          "or set verify=False.")
    return _C.crc32c(address, nbytes)


def mismatch(what: str, where: str, expected: int, observed: int) -> IntegrityError:
    """The error for data read back that does not match its checksum."""
    return IntegrityError(
        f"ssdtrain: {what} read back from {where} has CRC32C {observed:#010x}; {expected:#010x} "
        f"was written. The spill data was corrupted on the device or on its way; backward "
        f"stops here rather than compute wrong gradients. Check the device (dmesg, SMART) or "
        f"move spill_dir to another one.")
