"""The block size of direct I/O and rounding to it.

A leaf: it imports nothing from ssdtrain, so the I/O engines (``ssdtrain/io/``)
and the store modules can both use it (see "Layers" in docs/ARCHITECTURE.md).
"""

__all__ = ["BLOCK", "align_down", "align_up"]

BLOCK = 4096  # alignment of O_DIRECT memory, offsets and lengths (>= any logical block here)


def align_down(x, a=BLOCK):
    return x - x % a


def align_up(x, a=BLOCK):
    return -(-x // a) * a
