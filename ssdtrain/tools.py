"""Building blocks for benchmarks and tools: spill files, read buffers, checksums, plans.

These are the pieces the :class:`~ssdtrain.Offloader` is built from, public so that
benchmarks (``benchmarks/io_bandwidth.py``) and examples (``examples/rok_curve.py``)
can measure them alone without reaching into private modules. Training code does not
need them.

Example::

    from ssdtrain import tools
    spill = tools.SpillSet(["/nvme/ssdtrain"], "auto")   # anonymous O_DIRECT spill files
    print(tools.filesystem_type("/nvme/ssdtrain"), spill.files[0].direct)
    spill.close()
"""

from typing import Tuple

from . import _checksum
from ._align import BLOCK
from ._planner import rok_plans
from ._readbuf import ReadBuffers
from ._spill import SpillFile, SpillSet, filesystem_type

__all__ = ["BLOCK", "SpillFile", "SpillSet", "ReadBuffers", "filesystem_type", "rok_plans",
           "crc32c", "crc32c_available", "uring_probe"]


def crc32c_available() -> bool:
    """Whether the compiled extension (``ssdtrain._C``) and its CRC32C are built."""
    return _checksum.available()


def crc32c(address: int, nbytes: int) -> int:
    """CRC32C of ``nbytes`` bytes at host address ``address`` (as ``verify`` computes it).

    Raises:
        ConfigError: the compiled extension is not built (see :func:`crc32c_available`).
    """
    return _checksum.crc32c(address, nbytes)


def uring_probe() -> Tuple[bool, str]:
    """Whether io_uring works here: ``(ok, reason)``, ``reason`` saying why not.

    Raises:
        ImportError: the compiled extension is not built.
    """
    from . import _C
    ok, why = _C.uring_probe()
    return bool(ok), why
